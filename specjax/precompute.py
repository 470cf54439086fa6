"""python -m specjax.precompute --config X.yaml [key=value ...]: the frozen target's states, once.

Runs the JAX target over the run's prepared data (the same templating, loss masking, truncation and
train/val split as training; the examples first-fit packed in order into data.seq_length rows) and
writes per row its tapped states, final hidden state and token arrays to target.cache_dir
(specjax.data.state_cache: tensorstore zarr3, precompute.dtype, precompute.rows_per_shard rows per
shard file). Training with target.source=cache then runs the same step without the target's forward
and loads only its embedding and lm_head. precompute.backend=vllm computes the same states with a
vLLM engine in a subprocess (precompute.vllm_python; specjax.data.vllm_states) into the same cache.

Before it starts it prints the bytes per token and the total. Resumable: a killed precompute rerun
with the same config writes only the rows not yet written (no row twice, none lost); a rerun with
other settings or data is refused, naming each field that differs. The taps are the draft type's
(draft.aux_layer_ids or its default), so a cache serves every draft type with the same taps.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from tqdm import tqdm

from specjax import checkpoint as ckpt
from specjax import mesh as meshlib
from specjax.config import Config, ConfigError, load_config
from specjax.data.state_cache import StateCache, manifest_differences, state_bytes_per_token
from specjax.data.vllm_states import precompute_vllm
from specjax.train.cache_source import cache_fields, packed_rows
from specjax.train.run import checked_tokenizer, prepare_training_examples
from specjax.drafts.teacher import TOPK_STATE_KEYS, tail_mass, top_k_of
from specjax.drafts.ttt import TTTConfig, teacher_from_hidden
from specjax.train.setup import (build_vocab, check_batch_fits, check_draft_fits_target, load_prepared_target, make_mesh,
                                 preflight, prepare_target_folder, resolve_aux_ids)

__all__ = ["main", "precompute", "states_fn", "write_split"]

log = logging.getLogger("specjax")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def precompute(cfg: Config, *, progress: bool = True) -> str:
    """Write (or finish writing) the state cache of `cfg` at target.cache_dir; returns its path."""
    out = cfg.target.cache_dir
    if not out:
        raise ValueError("target.cache_dir is empty: name the folder to write the state cache to "
                         "(e.g. target.cache_dir=runs/state_cache)")
    if jax.process_count() > 1:
        raise ValueError("python -m specjax.precompute runs in one process (its writes are not split across hosts "
                         "yet); run it on one host")
    if cfg.precompute.backend == "vllm":  # the states from a vLLM engine: specjax.data.vllm_states
        if cfg.precompute.teacher_top_k:
            raise ValueError("precompute.backend=vllm stores the final hidden state (vLLM gives no draft-vocab "
                             "logits); Fix: precompute.teacher_top_k=0, or precompute.backend=jax for a top-k teacher")
        return precompute_vllm(cfg, progress=progress)
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, source="online"))  # the whole target
    tokenizer = preflight(cfg)
    prepare_target_folder(cfg)
    check_draft_fits_target(cfg)
    mesh = make_mesh(cfg)
    check_batch_fits(cfg, mesh)
    target = load_prepared_target(cfg, mesh)
    tokenizer = checked_tokenizer(cfg, tokenizer, target)
    os.makedirs(out, exist_ok=True)
    prepared = prepare_training_examples(cfg, tokenizer, out)
    aux_ids = resolve_aux_ids(cfg, target)
    fields = cache_fields(cfg, prepared, tokenizer, aux_ids)
    T = cfg.data.seq_length
    rows = {"train": packed_rows(prepared.train, T), "val": packed_rows(prepared.val, T)}
    D, A, dtype = int(target.config.hidden_size), len(aux_ids), cfg.precompute.dtype
    top_k = cfg.precompute.teacher_top_k
    extra, vocab = {}, None
    if top_k:
        Vd = cfg.draft.draft_vocab_size
        if top_k > Vd:
            raise ValueError(f"precompute.teacher_top_k={top_k} is more than draft.draft_vocab_size={Vd}; "
                             f"Fix: precompute.teacher_top_k<={Vd} (={Vd} keeps the whole draft-vocab teacher)")
        # the teacher is indexed by the draft vocab, so the cache fixes it: written beside the states,
        # and a training run must use the same one (checked against draft_vocab_sha256)
        vocab = build_vocab(cfg, prepared.train, target.config.vocab_size, out)
        extra = {"draft_vocab_sha256": ckpt.vocab_sha256(vocab)}

    if os.path.isfile(os.path.join(out, "manifest.json")):
        cache = StateCache.open(out)
        diffs = manifest_differences(cache.fields, fields)
        m = cache.manifest
        for key, want in (("dtype", dtype), ("hidden_size", D), ("num_aux", A), ("teacher_top_k", top_k),
                          *extra.items()):
            if m.get(key, 0) != want:
                diffs.append(f"{key}: the cache has {m[key]!r}, this run has {want!r}")
        if diffs:
            raise ValueError(f"{out} holds a state cache written for other settings or data:\n  " + "\n  ".join(diffs)
                             + "\nFix: put those settings back to continue it, or set target.cache_dir to a new folder")
        log.info("precompute: continuing the state cache in %s", out)
    else:
        cache = StateCache.create(out, fields, {k: len(v) for k, v in rows.items()}, seq_length=T, num_aux=A,
                                  hidden=D, dtype=dtype,
                                  rows_per_shard=cfg.precompute.rows_per_shard or cfg.data.batch_size,
                                  teacher_top_k=top_k, extra=extra)

    per_token = state_bytes_per_token(A, D, dtype, top_k)
    n_rows = sum(len(v) for v in rows.values())
    msg = (f"precompute: {n_rows} rows x {T} tokens ({len(rows['train'])} train, {len(rows['val'])} val), taps "
           f"{list(aux_ids)} ({D} wide, {dtype}) + "
           f"{f'top-{top_k} teacher' if top_k else 'final hidden'}: {per_token:,} bytes per token, "
           f"{_gib(per_token * T * n_rows)} in all -> {out}")
    log.info(msg)
    if cfg.target.dtype == "float32" and dtype != "float32":
        log.warning("precompute: the float32 target's states are stored in %s (rounded); precompute.dtype=float32 "
                    "keeps them exact (twice the bytes of bfloat16)", dtype)

    B = cfg.data.batch_size
    batch_sharding = NamedSharding(mesh, meshlib.logical_to_pspec(meshlib.BATCH_LOGICAL, mesh))

    draft_ids = None if vocab is None else jnp.asarray(vocab.draft_ids, jnp.int32)
    states = states_fn(target, aux_ids, top_k, draft_ids)

    t0 = time.perf_counter()
    tails = []  # the top-k teacher's tail mass on loss tokens (the bound's m), for the log and manifest
    for split, split_rows in rows.items():
        if split_rows:
            tails += write_split(cache.split(split), split_rows, states, target.params, B, batch_sharding, top_k,
                                 progress=progress, desc=f"precompute {split}")
    if tails:
        m = np.concatenate(tails)
        log.info("precompute: the top-%d teacher's tail mass on loss tokens (m in docs/training.md's bound): mean "
                 "%.2e, 99th percentile %.2e, max %.2e", top_k, m.mean(), np.percentile(m, 99), m.max())
    log.info("precompute: %s complete (%.1f s)", out, time.perf_counter() - t0)
    return out


def states_fn(target, aux_ids, top_k: int = 0, draft_ids=None):
    """The jitted (params, ids, positions, segment_ids) -> (final hidden, aux [B, T, A, D], top-k teacher
    dict, tail mass) that precompute stores: the final hidden (teacher and tail None), or with top_k > 0
    the top-k teacher over `draft_ids` and its tail mass (final hidden None)."""
    @jax.jit
    def states(params, ids, pos, seg):
        final, aux = target.forward(params, ids, aux_layer_ids=tuple(aux_ids), positions=pos, segment_ids=seg)
        if not top_k:
            return final, jnp.stack(aux, axis=2), None, None
        # the online step's own teacher computation (fp32 logits from the target-dtype final hidden)
        logits, argmax, lse = teacher_from_hidden(final, target.lm_head_weight(params), draft_ids,
                                                  TTTConfig.vocab_chunk, with_lse=True, softcap=target.logit_softcap)
        return None, jnp.stack(aux, axis=2), top_k_of(logits, argmax, lse, top_k)._asdict(), tail_mass(logits, top_k)

    return states


def write_split(store, split_rows: list, states, params, batch_size: int, batch_sharding, top_k: int = 0, *,
                progress: bool = True, desc: str = "precompute") -> list:
    """Compute and write the rows of `split_rows` (token arrays [T] each) that `store` (a CacheSplit) does
    not hold yet, `batch_size` rows per call of `states` (states_fn); returns the top-k teacher's tail
    masses on loss tokens (one array per batch; empty without a top-k teacher). The next batch's forward
    is dispatched before this batch is copied to the host and written, so the device computes while the
    host writes (a batch's rows are marked done only after its own writes, as before)."""
    pending = np.flatnonzero(~store.done())
    tails = []
    if pending.size == 0:
        return tails
    B, T = batch_size, len(split_rows[0]["input_ids"])
    bar = tqdm(total=len(split_rows), initial=len(split_rows) - pending.size, desc=desc, unit="row",
               dynamic_ncols=True, disable=not progress)

    def write(idx, batch, on_device_states):
        final, aux, teacher, tail = jax.device_get(on_device_states)
        n = len(idx)
        if top_k:
            tails.append(tail[:n][batch["loss_mask"][:n] > 0])
            teacher = {name: v[:n] for name, v in zip(TOPK_STATE_KEYS, (
                teacher["ids"], teacher["logits"], teacher["argmax"], teacher["lse"]))}
        store.write(idx, {k: v[:n] for k, v in batch.items()}, None if top_k else final[:n], aux[:n], teacher)
        bar.update(n)

    in_flight = None
    for b0 in range(0, pending.size, B):
        idx = pending[b0:b0 + B]
        batch = {k: np.zeros((B, T), np.int32) for k in split_rows[0]}
        for r, i in enumerate(idx):
            for k in batch:
                batch[k][r] = split_rows[i][k]
        on_device = {k: jax.device_put(v, batch_sharding) for k, v in batch.items()}
        dispatched = (idx, batch, states(params, on_device["input_ids"], on_device["positions"],
                                         on_device["segment_ids"]))
        if in_flight is not None:
            write(*in_flight)
        in_flight = dispatched
    if in_flight is not None:
        write(*in_flight)
    bar.close()
    return tails


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m specjax.precompute", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the training config (target, data, draft taps, precompute.*)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. target.cache_dir=runs/cache")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = _parser().parse_intermixed_args(argv)  # options may come between the overrides
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    for noisy in ("absl", "jax._src", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        out = precompute(cfg, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"state cache written: {out}\ntrain from it with: target.source=cache target.cache_dir={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

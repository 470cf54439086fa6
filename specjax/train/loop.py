"""The training loop: build everything from a Config, train, validate, checkpoint, export.

Order: target -> tokenizer -> data -> draft vocab -> draft config/params -> mesh + jitted step ->
restore (latest checkpoint, data position, RNG) -> steps -> final checkpoint -> export.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax import checkpoint as ckpt
from specjax import mesh as meshlib
from specjax.config import Config, config_to_dict
from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig
from specjax.train.metrics import MetricsWriter, summarize
from specjax.train.optim import lr_schedule, make_optimizer
from specjax.train.step import BATCH_KEYS, build_step_fns, init_state

log = logging.getLogger("specjax")

VOCAB_FILE = "draft_vocab.npz"
RUN_META_FILE = "run_meta.json"


@dataclass
class RunResult:
    output_dir: str
    final_step: int
    first_metrics: dict = field(default_factory=dict)
    last_metrics: dict = field(default_factory=dict)
    val_metrics: dict = field(default_factory=dict)
    initial_val_metrics: dict = field(default_factory=dict)
    export_dir: Optional[str] = None
    wall_time_s: float = 0.0
    stopped_early: bool = False
    preempted: bool = False
    skipped_steps: int = 0
    # real acceptance from speculative decoding (decode_eval.*): {step: {dataset: summary}}, where a
    # summary has tau, tau_lo, tau_hi (95%), accept (per position), n_prompts, steps, tok_s
    decode_eval: dict = field(default_factory=dict)


class NonFiniteTrainingError(RuntimeError):
    pass


class _TooManySkips(Exception):
    def __init__(self, step, rows):
        self.step, self.rows = step, rows


class _StopSignal:
    """SIGTERM/SIGINT ask the loop to finish the current step, checkpoint and exit cleanly."""

    def __init__(self):
        self.requested = False

    def _handler(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts at once
        self.requested = True
        log.warning("received %s: finishing the current step, then checkpointing", signal.Signals(signum).name)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread
            return
        old = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)


def _source_rows(examples, example_ids) -> list[str]:
    if example_ids is None:
        return []
    ids = sorted(set(np.asarray(example_ids).ravel().tolist()) - {0})
    return [f"{examples[i - 1].source}:{examples[i - 1].row}" for i in ids if 0 < i <= len(examples)]


def _save(mngr, step, state, data_iter, result) -> None:
    try:
        ckpt.save(mngr, step, state, data_iter, {"step": step, "metrics": result.last_metrics})
    except OSError as e:
        latest = mngr.latest_step()
        raise ckpt.CheckpointSaveError(
            f"saving the checkpoint for step {step} in {mngr.directory} failed: {e}. The previous checkpoint "
            f"(step {latest}) is intact and a restart resumes from it. Free disk space or point "
            f"run.output_dir at a volume with room."
        ) from e


def _resolve_path(p: str) -> str:
    """`pkg://specjax/assets/x` -> the installed package file; other paths unchanged. Dataset presets
    (`preset://sharegpt`) pass through: specjax.data.sources reads them (and refuses evaluation
    presets as training data)."""
    if p.startswith("preset://"):
        return p
    if p.startswith("pkg://"):
        import importlib.resources as ir

        pkg, _, rel = p[len("pkg://"):].partition("/")
        return str(ir.files(pkg).joinpath(rel))
    return p


def _check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_probe.{os.getpid()}")  # per process: hosts may share the folder
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise OSError(f"run.output_dir {path!r} is not writable ({e}); choose another run.output_dir.") from e


def target_shardings(cls, config, mesh):
    """NamedShardings for every target leaf from its weight map, known before any weight is read,
    so the loader puts each tensor straight onto its shards (no full host copy of a big target)."""
    from specjax.targets.base import tree_set

    logical, shapes = {}, {}
    for spec in cls.weight_specs(config):
        tree_set(logical, spec.path, spec.axes)
        tree_set(shapes, spec.path, jax.ShapeDtypeStruct(spec.shape, jnp.float32))
    return meshlib.tree_shardings(mesh, logical, shapes)


def build_target(cfg: Config, mesh=None):
    from specjax.targets import load_target
    from specjax.targets.loading import read_hf_config
    from specjax.targets.registry import get_target_class

    path = cfg.target.path
    if not path:
        raise ValueError("target.path is empty: set it to a Hugging Face folder (config.json + *.safetensors).")
    if cfg.target.build_demo:
        from specjax.demo import ensure_demo_target

        ensure_demo_target(path)
    if cfg.target.gguf:
        from specjax.convert import ensure_target_folder

        ensure_target_folder(path, cfg.target.gguf)
    cls = get_target_class(read_hf_config(path))
    overrides = kernel_overrides(cfg, cls)
    shardings = None
    if mesh is not None:
        shardings = target_shardings(cls, cls.config_from_hf(read_hf_config(path), **overrides), mesh)
    return load_target(path, dtype=cfg.target.dtype, shardings=shardings, **overrides)


def kernel_overrides(cfg: Config, cls) -> dict:
    """`kernels.moe` / `kernels.ssd` / `kernels.target_attention*` as the target config's runtime
    fields (for the architectures that have MoE experts / an SSD scan / attention; others ignore them)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    out = {}
    if "moe_implementation" in fields:
        out["moe_implementation"] = cfg.kernels.moe
    if "ssd_implementation" in fields:
        out["ssd_implementation"] = cfg.kernels.ssd
    if "attention_implementation" in fields:
        out["attention_implementation"] = cfg.kernels.target_attention
    if "attention_q_block" in fields and cfg.kernels.target_attention_q_block:
        out["attention_q_block"] = cfg.kernels.target_attention_q_block
    return out


def build_tokenizer(cfg: Config):
    from transformers import AutoTokenizer

    tok_path = cfg.data.tokenizer or cfg.target.path
    try:
        return AutoTokenizer.from_pretrained(tok_path, trust_remote_code=cfg.target.trust_remote_code)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(
            f"cannot load the tokenizer from {tok_path!r} ({type(e).__name__}: {e}); point data.tokenizer "
            f"(or target.path) at a folder with tokenizer.json / tokenizer_config.json.") from e


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def preflight(cfg: Config):
    """Problems of the machine or the config that no row causes, checked before any expensive stage
    (GGUF conversion, regeneration, the target build, compilation): jinja2 importable, and, when the
    tokenizer is already on disk, that it loads and its chat template renders. Raises one ValueError
    naming the cause and the fix. Returns the tokenizer when it was loaded, else None (the demo and
    GGUF targets write theirs during the build)."""
    from specjax.data.chat import check_chat_template

    check_chat_template()
    tok_path = cfg.data.tokenizer or cfg.target.path
    if not tok_path or not any(os.path.isfile(os.path.join(tok_path, f)) for f in _TOKENIZER_FILES):
        return None
    tokenizer = build_tokenizer(cfg)
    check_chat_template(tokenizer, cfg.data.chat_template)
    return tokenizer


def build_vocab(cfg: Config, examples, vocab_size: int, out_dir: str):
    from specjax.drafts.vocab import DraftVocab, build_draft_vocab, token_counts_from_examples

    path = os.path.join(out_dir, VOCAB_FILE)
    if os.path.exists(path):  # resume: the vocab must not change under a checkpoint
        vocab = DraftVocab.load(path)
        if vocab.t2d.shape[0] != vocab_size or vocab.draft_ids.shape[0] != cfg.draft.draft_vocab_size:
            raise ValueError(
                f"{path} was built for V={vocab.t2d.shape[0]}, Vd={vocab.draft_ids.shape[0]} but this run has "
                f"V={vocab_size}, Vd={cfg.draft.draft_vocab_size}; use a new run.output_dir."
            )
        return vocab
    counts = token_counts_from_examples(examples, vocab_size)
    vocab = build_draft_vocab(counts, cfg.draft.draft_vocab_size)
    vocab.validate()
    if jax.process_index() == 0:  # every process computes the same vocab; one writes it
        vocab.save(path)
    return vocab


def resolve_aux_ids(cfg: Config, target) -> tuple[int, ...]:
    from specjax.targets import validate_aux_layer_ids

    ids = cfg.target.aux_layer_ids or target.default_aux_layer_ids()
    return tuple(int(i) for i in validate_aux_layer_ids(tuple(ids), target.num_layers))


def make_draft_config(cfg: Config, target, aux_ids) -> eagle3.Eagle3Config:
    d = cfg.draft
    # e.g. hybrid Mamba targets: the draft's KV heads must equal the target's (vLLM KV-cache pages);
    # checked before training, not at export
    check = getattr(type(target), "check_draft_compat", None)
    if check is not None:
        check(target.config, d.num_key_value_heads)
    return eagle3.config_from_target(
        target.config, draft_vocab_size=d.draft_vocab_size, aux_layer_ids=aux_ids,
        intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
        fc_norm=d.fc_norm, norm_output=d.norm_output,
    )



def make_ttt_config(cfg: Config) -> TTTConfig:
    """draft.ttt_steps / step_decay with the configured kernels (kernels.ttt_attention / soft_ce);
    the training loop, --compile-only and specjax.targets.shapes all build the step from this."""
    return TTTConfig(ttt_steps=cfg.draft.ttt_steps, step_decay=cfg.draft.step_decay,
                     attention_impl=cfg.kernels.ttt_attention, soft_ce_impl=cfg.kernels.soft_ce)

class DecodeEval:
    """decode_eval.*: real tau from lossless speculative decoding (specjax.eval) of held-out prompts
    with the target and the draft being trained, logged beside the training proxies.

    Processes: a computation on a target sharded across processes is collective, so every process
    would have to run it identically (only process 0 writing metrics); the speculative decoder,
    however, reads each step's accepted count back to the host, which a value spanning several
    processes' devices does not allow. So multi-process runs refuse decode_eval at start (measure
    the exported draft with `python -m specjax.eval` instead); one process with many devices works
    (the target stays sharded on the mesh). The prompts are loaded when the run starts, so a bad
    preset name fails before any training step."""

    def __init__(self, cfg: Config, target, tokenizer, draft_cfg, vocab, mesh=None):
        from specjax.data.chat import resolve_chat_template
        from specjax.data.presets import load_eval_prompts
        from specjax.eval.cli import eos_token_ids

        de = cfg.decode_eval  # ranges are checked by the config
        if not de.prompts:
            raise ValueError("decode_eval.prompts is empty: give presets (mtbench, humaneval) or JSONL/parquet paths.")
        target.require_decoding()
        if jax.process_count() > 1:
            # the decoder reads accepted counts back to the host after every step, which a value
            # spanning several processes' devices does not allow
            raise ValueError(
                "decode_eval runs only in single-process jobs for now; set decode_eval.every_steps=0 and "
                "decode_eval.at_end=false, and measure the exported draft with `python -m specjax.eval`.")
        self.cfg, self.target, self.tokenizer, self.draft_cfg, self.vocab = de, target, tokenizer, draft_cfg, vocab
        self.mesh = mesh
        self.prompts = [p for name in de.prompts for p in load_eval_prompts(_resolve_path(name), limit=de.limit)]
        if not self.prompts:
            raise ValueError(f"decode_eval.prompts {list(de.prompts)} gave no prompts.")
        self.template = resolve_chat_template(tokenizer, cfg.data.chat_template)
        self.eos = eos_token_ids(cfg.target.path, tokenizer)

    def due(self, step: int, total_steps: int, final: bool) -> bool:
        """In the loop (final=False) at every multiple of every_steps before the last step; after the
        last step (final=True) when at_end or the last step is such a multiple."""
        every = self.cfg.every_steps and step % self.cfg.every_steps == 0
        if final:
            return bool(self.cfg.at_end or every)
        return bool(every and step < total_steps)

    def __call__(self, params) -> tuple[dict, dict]:
        """(flat metrics for the log, per-dataset summaries) for the draft `params` (device arrays,
        possibly sharded over this process's devices)."""
        from jax.sharding import NamedSharding, PartitionSpec

        from specjax.eval.cli import measure, summarize
        from specjax.eval.spec_decode import Draft, SpecDecoder

        # one full copy of the draft on every device of the target's mesh (the decoder's programs
        # mix it with the target's arrays, which live there); without a mesh, a host copy
        host = (jax.device_put(params, NamedSharding(self.mesh, PartitionSpec())) if self.mesh is not None
                else jax.device_get(params))
        decoder = SpecDecoder(self.target, Draft(params=host, config=self.draft_cfg, vocab=self.vocab),
                              num_spec_tokens=self.cfg.num_spec_tokens)
        t0 = time.time()
        # warmup=0: compiles are counted in the wall time, but tau does not depend on time
        records = measure(decoder, self.tokenizer, self.template, self.prompts,
                          num_spec_tokens=self.cfg.num_spec_tokens, max_new_tokens=self.cfg.max_new_tokens,
                          temperature=self.cfg.temperature, eos_ids=self.eos, with_greedy=False, warmup=0,
                          retime=False)
        summaries = summarize(records, self.cfg.num_spec_tokens)
        flat, short = {"decode_wall_s": time.time() - t0}, {}
        for name, s in summaries.items():
            tau = s["tau"]
            flat[f"decode_tau/{name}"] = tau["value"]
            flat[f"decode_tau_lo/{name}"] = tau["lo"]
            flat[f"decode_tau_hi/{name}"] = tau["hi"]
            accept = [e["value"] for e in s["acceptance"]["unconditional"]]
            for i, a in enumerate(accept):
                flat[f"decode_accept_{i}/{name}"] = a
            flat[f"decode_tok_s/{name}"] = s["spec_tok_s"]["value"]
            short[name] = {"tau": tau["value"], "tau_lo": tau["lo"], "tau_hi": tau["hi"], "accept": accept,
                           "n_prompts": s["n_prompts"], "steps": s["steps"], "tok_s": s["spec_tok_s"]["value"]}
        return flat, short


def _global_batch(np_batch: dict, sharding) -> dict:
    """Every process holds the same global numpy batch (identical iterators); each contributes the
    rows of its own devices, so training is the same whatever the number of processes."""
    nproc, proc = jax.process_count(), jax.process_index()
    rows = np_batch["input_ids"].shape[0] // nproc
    return {k: jax.make_array_from_process_local_data(
        sharding, np.asarray(np_batch[k])[proc * rows:(proc + 1) * rows]) for k in BATCH_KEYS}


def _to_float_dict(metrics: dict) -> dict:
    out = {}
    for k, v in metrics.items():
        v = np.asarray(v)
        if v.ndim == 0:
            out[k] = float(v)
        else:
            for i, x in enumerate(v.tolist()):
                out[f"{k.removesuffix('_k')}_{i}"] = float(x)
    return out


def train(cfg: Config) -> RunResult:
    t_start = time.time()
    out_dir = os.path.abspath(cfg.run.output_dir)
    _check_writable(out_dir)
    proc, nproc = jax.process_index(), jax.process_count()

    tokenizer = preflight(cfg)  # before the target build: jinja2, the tokenizer, its template
    mesh = meshlib.make_mesh({a: getattr(cfg.parallelism, a) for a in meshlib.MESH_AXES})
    target = build_target(cfg, mesh)
    if tokenizer is None:  # written by the build (demo, GGUF): check it now, before the data pass
        from specjax.data.chat import check_chat_template

        tokenizer = build_tokenizer(cfg)
        check_chat_template(tokenizer, cfg.data.chat_template)
    if len(tokenizer) > target.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the target's vocab_size is "
            f"{target.config.vocab_size}; use the target's own tokenizer (data.tokenizer)."
        )

    from specjax.data import make_eval_batches, make_train_iterator, prepare_examples

    files = tuple(_resolve_path(p) for p in cfg.data.train_files)
    if not files:
        raise ValueError("data.train_files is empty: give one or more JSONL/JSON/parquet chat files.")
    prepared = prepare_examples(
        files, tokenizer, cfg.data.seq_length, cfg.data.val_fraction, cfg.data.shuffle_seed,
        max_rows=cfg.data.max_rows, truncate=cfg.data.truncate, chat_template=cfg.data.chat_template,
        mask_reasoning_content=cfg.data.mask_reasoning_content, mask_generation_prompt=cfg.data.mask_generation_prompt,
    )
    n_skipped = sum(prepared.skipped.values())
    log.info("data: %d rows -> %d train / %d val examples; skipped %d %s", prepared.n_rows,
             len(prepared.train), len(prepared.val), n_skipped, dict(prepared.skipped))
    if not prepared.train:
        raise ValueError(f"no usable training rows in {files} (skipped: {dict(prepared.skipped)}).")

    vocab = build_vocab(cfg, prepared.train, target.config.vocab_size, out_dir)
    aux_ids = resolve_aux_ids(cfg, target)
    draft_cfg = make_draft_config(cfg, target, aux_ids)
    ttt = make_ttt_config(cfg)
    compute_dtype = jnp.float32 if cfg.target.dtype == "float32" else jnp.bfloat16

    n_batch_shards = math.prod(mesh.shape[a] for a in ("data", "fsdp", "expert"))
    if cfg.data.batch_size % n_batch_shards:
        raise ValueError(
            f"data.batch_size={cfg.data.batch_size} must be divisible by data*fsdp*expert={n_batch_shards} "
            f"(mesh {dict(mesh.shape)}); change data.batch_size or parallelism.*."
        )
    if cfg.data.batch_size % nproc:
        raise ValueError(f"data.batch_size={cfg.data.batch_size} must be divisible by the {nproc} processes.")

    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    schedule = lr_schedule(cfg.optim, cfg.train.steps)
    draft_params = eagle3.init_draft_params(draft_cfg, jax.random.key(cfg.run.seed), std=cfg.draft.init_std)
    if cfg.draft.init_from:  # warm start from a published head (checked against draft_cfg and the vocab)
        from specjax_converters.eagle3_import import warm_start_params

        draft_params = warm_start_params(cfg.draft.init_from, draft_cfg, vocab, draft_params)
    fns = build_step_fns(target, target.params, draft_params, draft_cfg, ttt, optimizer, mesh, compute_dtype)
    target_params = jax.device_put(target.params, fns.target_shardings)
    vocab_arrays = jax.device_put(
        {"draft_ids": jnp.asarray(vocab.draft_ids, jnp.int32), "t2d": jnp.asarray(vocab.t2d),
         "d2t": jnp.asarray(vocab.d2t, jnp.int32)}, fns.vocab_shardings)
    state = jax.jit(lambda p: init_state(p, optimizer, cfg.run.seed), out_shardings=fns.state_shardings)(draft_params)
    del draft_params

    # one global iterator, identical on every process (packing is cheap next to the step); each
    # process feeds its rows of the global batch to its devices (see _global_batch)
    data_iter = make_train_iterator(prepared.train, cfg.data.seq_length, cfg.data.batch_size,
                                    cfg.data.shuffle_seed)
    mngr = ckpt.manager(os.path.join(out_dir, "checkpoints"), keep=cfg.checkpoint.keep)
    meta = {
        "config": config_to_dict(cfg),
        "draft_config": eagle3.config_to_dict(draft_cfg),
        "target_path": os.path.abspath(cfg.target.path),
        "target_config": target.hf_config,
        "vocab_file": VOCAB_FILE,
    }
    if proc == 0:
        with open(os.path.join(out_dir, RUN_META_FILE), "w") as f:
            json.dump(meta, f, indent=1)

    start_step = 0
    restore_from = cfg.checkpoint.restore_from
    if restore_from != "none" and (mngr.latest_step() is not None or restore_from != "latest"):
        rmngr = mngr
        step = None
        if restore_from != "latest":
            rdir, step = os.path.split(os.path.abspath(restore_from))
            if not step.isdigit() or not os.path.isdir(restore_from):
                raise FileNotFoundError(
                    f"checkpoint.restore_from={restore_from!r} is not a saved checkpoint; give a "
                    f"<run>/checkpoints/<step> folder, 'latest' (default) or 'none'.")
            rmngr, step = ckpt.manager(rdir, read_only=True), int(step)
        state, _ = ckpt.restore(rmngr, ckpt.abstract_like(state), data_iter, step=step)
        start_step = int(state["step"])
        log.info("resumed from %s at step %d", rmngr.directory, start_step)

    decode_eval = None
    if cfg.decode_eval.every_steps or cfg.decode_eval.at_end:
        decode_eval = DecodeEval(cfg, target, tokenizer, draft_cfg, vocab, mesh)
        log.info("decode_eval: %d prompts from %s, every %s steps%s", len(decode_eval.prompts),
                 list(cfg.decode_eval.prompts), cfg.decode_eval.every_steps or "-",
                 " and at the end" if cfg.decode_eval.at_end else "")

    val_batches = make_eval_batches(prepared.val, cfg.data.seq_length, cfg.data.batch_size)[: cfg.train.eval_batches]
    writer = MetricsWriter(out_dir, enabled=proc == 0)
    result = RunResult(output_dir=out_dir, final_step=start_step)

    def run_eval(step):
        if not val_batches:
            return {}
        ms = [fns.eval_step(state["params"], target_params, vocab_arrays, _global_batch(b, fns.batch_sharding))
              for b in val_batches]
        agg = {k: float(np.mean([_to_float_dict(m)[k] for m in ms])) for k in _to_float_dict(ms[0])}
        writer.write(step, "val", agg)
        return agg

    def run_decode_eval(step):
        nonlocal t_since
        t0 = time.time()
        flat, short = decode_eval(state["params"])
        t_since += time.time() - t0  # keep decoding time out of the training tokens/s
        writer.write(step, "decode", flat)
        result.decode_eval[step] = short
        log.info("step %d decode_eval: %s", step,
                 ", ".join(f"{n} tau {d['tau']:.3f} [{d['tau_lo']:.3f}, {d['tau_hi']:.3f}]" for n, d in short.items()))

    bar = None
    if cfg.train.progress and proc == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", dynamic_ncols=True)
    if start_step == 0:
        result.initial_val_metrics = run_eval(0)  # the untrained draft, for comparison
    tokens_since, t_since = 0, time.time()
    step = start_step
    end_step = min(cfg.train.steps, cfg.train.stop_at_step or cfg.train.steps)
    stop = _StopSignal()
    consecutive_skips, pending = 0, None  # `pending`: (step, skipped flag array, batch) read one step late

    def check_skip(entry):
        """Non-finite guard bookkeeping, one step behind so the host never waits on the device."""
        nonlocal consecutive_skips
        s_step, flag, batch_ids = entry
        if float(flag) == 0.0:
            consecutive_skips = 0
            return
        consecutive_skips += 1
        result.skipped_steps += 1
        rows = _source_rows(prepared.train, batch_ids)
        log.warning("step %d: non-finite loss or gradient; update skipped (params unchanged). Source rows: %s",
                    s_step, rows)
        writer.write(s_step, "skip", {"consecutive": consecutive_skips, "rows": rows})
        if consecutive_skips >= cfg.train.max_consecutive_skips:
            raise _TooManySkips(s_step, rows)

    try:
        with stop.installed():
            while step < end_step:
                np_batch = next(data_iter)
                tokens_since += int(np.sum(np.asarray(np_batch["segment_ids"]) > 0))
                state, metrics = fns.train_step(state, target_params, vocab_arrays,
                                                _global_batch(np_batch, fns.batch_sharding))
                step += 1
                if pending is not None:
                    check_skip(pending)
                pending = (step, metrics["skipped"], np_batch.get("example_ids"))
                if step % cfg.train.log_every == 0 or step == end_step or step == start_step + 1:
                    m = _to_float_dict(jax.device_get(metrics))
                    dt = time.time() - t_since
                    m["tokens_per_s"] = tokens_since / max(dt, 1e-9)
                    m["lr"] = float(schedule(step - 1))
                    tokens_since, t_since = 0, time.time()
                    writer.write(step, "train", m)
                    if not result.first_metrics:
                        result.first_metrics = dict(m, step=step)
                    result.last_metrics = dict(m, step=step)
                    if bar is not None:
                        bar.set_postfix(summarize(m), refresh=False)
                if bar is not None:
                    bar.update(1)
                if nproc > 1:  # every process must agree to stop at the same step (saves are collective)
                    from jax.experimental import multihost_utils

                    stop.requested = bool(np.any(multihost_utils.process_allgather(np.array(stop.requested))))
                    stop.requested = stop.requested or mngr.reached_preemption(step)
                if stop.requested:
                    check_skip(pending)
                    pending = None
                    result.preempted = True
                    break
                if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
                    run_eval(step)
                if decode_eval is not None and decode_eval.due(step, cfg.train.steps, final=False):
                    run_decode_eval(step)
                if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0 and step < cfg.train.steps:
                    check_skip(pending)
                    pending = None
                    _save(mngr, step, state, data_iter, result)
            if pending is not None:
                check_skip(pending)
    except _TooManySkips as e:
        _save(mngr, step, state, data_iter, result)
        writer.close()
        raise NonFiniteTrainingError(
            f"{cfg.train.max_consecutive_skips} consecutive steps (up to step {e.step}) had a non-finite loss or "
            f"gradient, so training stopped; the last good state is checkpointed in {mngr.directory}. Likely causes: "
            f"optim.lr too high (now {cfg.optim.lr}) or no/too-loose optim.grad_clip (now {cfg.optim.grad_clip}); "
            f"bad data in the rows of the last batch {e.rows}; a target in too low a precision (target.dtype)."
        ) from None
    finally:
        if bar is not None:
            bar.close()
    if result.preempted:
        _save(mngr, step, state, data_iter, result)
        writer.close()
        result.final_step, result.stopped_early = step, True
        result.wall_time_s = time.time() - t_start
        log.warning("stop requested (SIGTERM/SIGINT or preemption): checkpoint saved at step %d in %s; "
                    "run the same command again to resume.", step, mngr.directory)
        return result

    result.final_step = step
    result.stopped_early = step < cfg.train.steps
    result.val_metrics = run_eval(step)
    # the last step (a stop_at_step run was already measured in the loop at its multiples)
    if decode_eval is not None and not result.stopped_early and decode_eval.due(step, cfg.train.steps, final=True):
        run_decode_eval(step)
    if mngr.latest_step() != step:
        _save(mngr, step, state, data_iter, result)
    writer.close()

    if cfg.export.at_end and not result.stopped_early:
        from jax.experimental import multihost_utils

        from specjax.export import export_from_state

        # every process takes part in the gather (params may be sharded across hosts); one writes
        host_params = (multihost_utils.process_allgather(state["params"], tiled=True) if nproc > 1
                       else jax.device_get(state["params"]))
        export_dir = cfg.export.out_dir or os.path.join(out_dir, "export")
        result.export_dir = export_dir
    if cfg.export.at_end and not result.stopped_early and proc == 0:
        export_from_state(host_params, draft_cfg, vocab, target.hf_config, export_dir,
                          dtype=cfg.export.dtype, extra_manifest={"step": step, "metrics": result.last_metrics,
                                                                  "config": config_to_dict(cfg),
                                                                  "target_path": os.path.abspath(cfg.target.path)})
    result.wall_time_s = time.time() - t_start
    return result

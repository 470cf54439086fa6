"""The training loop: a run set-up (specjax.train.setup), then steps with periodic hooks.

Order: the run-folder lock (specjax.run_lock: one run per run.output_dir, held to the end) ->
preflight -> target -> tokenizer -> data -> draft vocab -> run set-up (draft config, TTT config,
optimizer, jitted step) -> restore (latest checkpoint, data position) -> steps, each followed by
the hooks that are due (log, validate, decode_eval, checkpoint) -> final validation, decode_eval and
checkpoint -> export.

Every checkpoint records the run's identity (`run_identity`: config, a hash of the training
examples' token ids, a hash of the draft vocabulary) and its step. A resume compares them with this
run's (`resume_differences`): differences of settings or data are refused unless
checkpoint.allow_config_change; a checkpoint of another draft vocabulary, or one whose folder name
is not its step, is always refused, with every difference listed.

The mutable state of a run (train state, step, timing, the non-finite guard) lives in one `_Loop`
object that the hooks read and update, instead of closures over `nonlocal` variables.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from specjax import checkpoint as ckpt
from specjax import run_lock
from specjax.config import Config, config_to_dict
from specjax.data import make_eval_batches, make_train_iterator, prepare_examples
from specjax.data.pipeline import batches_per_epoch
from specjax.data.chat import TemplateLimits, check_chat_template
from specjax.data.sources import RowLimits
from specjax.drafts import draft_types
from specjax.export import export_from_state
from specjax.train.decode_eval import make_decode_eval
from specjax.train.metrics import MetricsWriter, summarize
from specjax.train.setup import (
    VOCAB_FILE, build_run_setup, build_target, build_tokenizer, build_vocab, check_batch_fits, check_writable,
    make_mesh, preflight, resolve_path,
)
from specjax.train.step import BATCH_KEYS, init_state

log = logging.getLogger("specjax")

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
    """SIGTERM/SIGINT, at any moment of the run (set-up, steps, final validation, save, export), ask it
    to finish what it is doing, checkpoint and exit cleanly; nothing is killed half-way. A second
    SIGINT exits at once.

    Python runs signal handlers between bytecodes of the main thread, so while XLA compiles (one long
    C++ call) two Ctrl-C's would reach the handler as one, late. The signal numbers are therefore
    also written to a wakeup pipe (`signal.set_wakeup_fd`, done in C when each signal arrives) that a
    watcher thread reads: it sees the second SIGINT when it arrives and ends the process there.
    Raising KeyboardInterrupt instead could land inside XLA's compiler or a runtime thread (a
    segfault was seen); checkpoints on disk are complete or absent (atomic saves), so exiting the
    process directly loses nothing saved."""

    def __init__(self):
        self.requested = False
        self._sigints = 0

    def _handler(self, signum, frame):
        if not self.requested:
            log.warning("received %s: finishing the current stage, then checkpointing and exiting",
                        signal.Signals(signum).name)
        self.requested = True

    def _watch(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 64)
            except OSError:
                data = b""
            if not data:  # the write end was closed: the run is over
                os.close(fd)
                return
            for signum in data:
                if signum in (signal.SIGINT, signal.SIGTERM):
                    self.requested = True
                if signum == signal.SIGINT:
                    self._sigints += 1
                    if self._sigints >= 2:
                        os.write(2, b"\nsecond interrupt: exiting now; the last saved checkpoint is intact\n")
                        os._exit(130)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self  # signal handlers can only be set from the main thread
            return
        old = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        r, w = os.pipe()
        os.set_blocking(w, False)
        old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="specjax-signals", daemon=True).start()
        try:
            yield self
        finally:
            signal.set_wakeup_fd(old_fd)
            os.close(w)  # the watcher reads EOF and ends
            for sig, h in old.items():
                signal.signal(sig, h)


def _source_rows(examples, example_ids) -> list[str]:
    if example_ids is None:
        return []
    ids = sorted(set(np.asarray(example_ids).ravel().tolist()) - {0})
    return [f"{examples[i - 1].source}:{examples[i - 1].row}" for i in ids if 0 < i <= len(examples)]


def _disk_full(e: BaseException) -> bool:
    text = str(e)
    return getattr(e, "errno", None) == 28 or "RESOURCE_EXHAUSTED" in text or "No space left" in text


def _save(mngr, step, state, data_iter, result, identity: dict) -> None:
    """A checkpoint (its meta: the step, the last metrics and the run's `identity`), or one error that
    says the previous one is intact. A full disk reaches us as an OSError, or as orbax/tensorstore's
    ValueError(RESOURCE_EXHAUSTED ...); what the failed save left behind is removed so it does not
    keep the disk full."""
    try:
        ckpt.save(mngr, step, state, data_iter,
                  {"step": step, "metrics": result.last_metrics, ckpt.IDENTITY: identity})
    except ckpt.NonFiniteState:
        raise
    except (OSError, ValueError) as e:
        if isinstance(e, ValueError) and not _disk_full(e):
            raise
        removed = ckpt.remove_partial_saves(str(mngr.directory), step)
        mngr.reload()
        latest = mngr.latest_step()
        raise ckpt.CheckpointSaveError(
            f"saving the checkpoint for step {step} in {mngr.directory} failed: {str(e).splitlines()[0][:300]}. "
            f"The previous checkpoint (step {latest}) is intact and a restart resumes from it"
            f"{f'; the partial save was removed ({len(removed)} folder(s))' if removed else ''}. Free disk space "
            f"or point run.output_dir at a volume with room."
        ) from e


# Settings that may change between a run and its resumption without changing what is trained: how
# long this invocation runs and reports, where it checkpoints and exports, how it is parallelised
# and which kernels compute it. Any other difference is refused unless checkpoint.allow_config_change.
_RESUME_MAY_CHANGE = ("run.output_dir", "run.name", "train.stop_at_step", "train.progress", "train.log_every",
                      "train.eval_every", "train.eval_batches", "train.max_consecutive_skips", "checkpoint.",
                      "export.", "parallelism.", "kernels.", "decode_eval.", "regenerate.")


def config_differences(saved: dict, now: dict) -> list[str]:
    """`key: saved -> now` for every setting that differs and matters to a resumed run. A key the saved
    config lacks (written by an older specjax) counts as its default."""
    defaults = config_to_dict(Config())
    out = []
    for section in sorted(set(saved) | set(now)):
        a, b, d = saved.get(section) or {}, now.get(section) or {}, defaults.get(section) or {}
        for key in sorted(set(a) | set(b)):
            name = f"{section}.{key}"
            if any(name == p or (p.endswith(".") and name.startswith(p)) for p in _RESUME_MAY_CHANGE):
                continue
            old, new = a.get(key, d.get(key)), b.get(key, d.get(key))
            if old != new:
                out.append(f"{name}: {old!r} -> {new!r}")
    return out


def run_identity(cfg: Config, train_examples, vocab) -> dict:
    """What a checkpoint of this run records about the run, to be compared on resume
    (`resume_differences`): the config, a hash of the training examples' token ids and one of the
    draft vocabulary."""
    config = config_to_dict(cfg)
    return {"format": 1, "config": config, "config_sha256": ckpt.config_sha256(config),
            "data_sha256": ckpt.examples_sha256(train_examples), "train_examples": len(train_examples),
            "draft_vocab_sha256": ckpt.vocab_sha256(vocab)}


def _short(digest) -> str:
    return f"{digest[:12]}…" if isinstance(digest, str) else repr(digest)


def resume_differences(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """The differences between the identity a checkpoint recorded (`saved`) and this run's (`now`), as
    (what checkpoint.allow_config_change may accept, what nothing accepts). Settings and data may
    change on purpose (any data.* change alters the token ids, and the override exists for such
    changes); the draft vocabulary never changes within a run folder (draft_vocab.npz is reused on
    every resume), and the draft's lm_head rows are in its order, so a different one means the
    checkpoint's params belong to another run."""
    config = saved.get("config")
    allowed = [f"config {d}" for d in config_differences(config if isinstance(config, dict) else {}, now["config"])]
    if saved.get("data_sha256") != now["data_sha256"]:
        allowed.append(f"data sha256 {_short(saved.get('data_sha256'))} -> {_short(now['data_sha256'])} (the "
                       f"training examples' token ids: {saved.get('train_examples')} -> {now['train_examples']} "
                       f"examples)")
    never = []
    if saved.get("draft_vocab_sha256") != now["draft_vocab_sha256"]:
        never.append(f"draft vocabulary sha256 {_short(saved.get('draft_vocab_sha256'))} -> "
                     f"{_short(now['draft_vocab_sha256'])} ({VOCAB_FILE})")
    return allowed, never


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


# ---------------------------------------------------------------------------------------------
# the loop: explicit state + periodic hooks
# ---------------------------------------------------------------------------------------------
@dataclass
class _Loop:
    """What changes while a run trains; hooks read and update it."""
    state: Any
    step: int
    start_step: int
    end_step: int
    total_steps: int
    result: RunResult
    tokens_since: int = 0
    t_since: float = field(default_factory=time.time)
    consecutive_skips: int = 0
    pending: Optional[tuple] = None  # (step, skipped flag array, example ids): read one step late
    metrics: Any = None  # the last step's metrics (device arrays)


@dataclass(frozen=True)
class Hook:
    """Runs `fn(loop)` after every step `due(step)` says; `settle` first resolves the non-finite
    guard, so e.g. a checkpoint never holds a step whose skip has not been looked at."""
    name: str
    due: Callable[[int], bool]
    fn: Callable[[_Loop], None]
    settle: bool = False


def every(n: int, before: int) -> Callable[[int], bool]:
    """Due at each multiple of n (n = 0: never) before step `before` (the final step has its own
    end-of-run handling)."""
    return lambda step: bool(n) and step % n == 0 and step < before


class _Trainer:
    """One run: set-up done in __init__, `fit()` trains and exports."""

    def __init__(self, cfg: Config, stop: "_StopSignal"):
        self.t_start = time.time()
        self.cfg = cfg
        self.stop = stop
        self.out_dir = out_dir = os.path.abspath(cfg.run.output_dir)
        check_writable(out_dir)
        self.proc, self.nproc = jax.process_index(), jax.process_count()

        tokenizer = preflight(cfg)  # before the target build: jinja2, the tokenizer, its template
        mesh = make_mesh(cfg)
        target = build_target(cfg, mesh)
        if tokenizer is None:  # written by the build (demo, GGUF): check it now, before the data pass

            tokenizer = build_tokenizer(cfg)
            check_chat_template(tokenizer, cfg.data.chat_template, TemplateLimits.of(cfg.data))
        if len(tokenizer) > target.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the target's vocab_size is "
                f"{target.config.vocab_size}; use the target's own tokenizer (data.tokenizer)."
            )


        files = tuple(resolve_path(p) for p in cfg.data.train_files)
        if not files:
            raise ValueError("data.train_files is empty: give one or more JSONL/JSON/parquet chat files.")
        t_prep = time.perf_counter()
        prepared = prepare_examples(
            files, tokenizer, cfg.data.seq_length, cfg.data.val_fraction, cfg.data.shuffle_seed,
            max_rows=cfg.data.max_rows, truncate=cfg.data.truncate, chat_template=cfg.data.chat_template,
            mask_reasoning_content=cfg.data.mask_reasoning_content,
            mask_generation_prompt=cfg.data.mask_generation_prompt,
            skip_report_dir=out_dir,  # every skipped row, file:line and reason: <output_dir>/skipped_rows.jsonl
            workers=cfg.data.prepare_processes(),
            row_limits=RowLimits.of(cfg.data), template_limits=TemplateLimits.of(cfg.data),
        )
        n_skipped = sum(prepared.skipped.values())
        log.info("data: %d rows -> %d train / %d val examples; skipped %d %s (%.1f s)", prepared.n_rows,
                 len(prepared.train), len(prepared.val), n_skipped, dict(prepared.skipped),
                 time.perf_counter() - t_prep)
        if not prepared.train:
            raise ValueError(f"no usable training rows in {files} (skipped: {dict(prepared.skipped)}).")
        self.prepared = prepared
        if cfg.train.epochs is not None:  # steps from the data: whole batches of `epochs` passes
            per_epoch = batches_per_epoch(prepared.train, cfg.data.seq_length, cfg.data.batch_size)
            steps = max(1, math.ceil(cfg.train.epochs * per_epoch))
            log.info("train.epochs=%g: %d packed batches of %d x %d per pass -> train.steps=%d (was %d)",
                     cfg.train.epochs, per_epoch, cfg.data.batch_size, cfg.data.seq_length, steps, cfg.train.steps)
            cfg = self.cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))

        self.vocab = vocab = build_vocab(cfg, prepared.train, target.config.vocab_size, out_dir)
        self.identity = run_identity(cfg, prepared.train, vocab)  # recorded in every checkpoint
        check_batch_fits(cfg, mesh)
        self.setup = setup = build_run_setup(cfg, target, mesh)
        self.target, self.mesh, self.fns = target, mesh, setup.fns
        draft_params = setup.init_draft_params(vocab)
        self.target_params = jax.device_put(target.params, setup.fns.target_shardings)
        self.vocab_arrays = jax.device_put(
            {"draft_ids": jnp.asarray(vocab.draft_ids, jnp.int32), "t2d": jnp.asarray(vocab.t2d),
             "d2t": jnp.asarray(vocab.d2t, jnp.int32)}, setup.fns.vocab_shardings)
        state = jax.jit(lambda p: init_state(p, setup.optimizer),
                        out_shardings=setup.fns.state_shardings)(draft_params)
        del draft_params

        # one global iterator, identical on every process (packing is cheap next to the step); each
        # process feeds its rows of the global batch to its devices (see _global_batch)
        self.data_iter = make_train_iterator(prepared.train, cfg.data.seq_length, cfg.data.batch_size,
                                             cfg.data.shuffle_seed)
        self.mngr = ckpt.manager(os.path.join(out_dir, "checkpoints"), keep=cfg.checkpoint.keep)
        state, start_step = self._restore(state)
        self._write_run_meta(resumed_at=start_step)

        self.decode_eval = None
        if cfg.decode_eval.every_steps or cfg.decode_eval.at_end:
            self.decode_eval = make_decode_eval(cfg, target, tokenizer, setup.draft_config, vocab, mesh, out_dir)
            log.info("decode_eval (%s): %d prompts from %s, every %s steps%s", cfg.decode_eval.backend,
                     len(self.decode_eval.prompts), list(cfg.decode_eval.prompts),
                     cfg.decode_eval.every_steps or "-", " and at the end" if cfg.decode_eval.at_end else "")
        self.val_batches = make_eval_batches(prepared.val, cfg.data.seq_length,
                                             cfg.data.batch_size)[: cfg.train.eval_batches]
        self.writer = MetricsWriter(out_dir, enabled=self.proc == 0)
        end_step = min(cfg.train.steps, cfg.train.stop_at_step or cfg.train.steps)
        self.loop = _Loop(state=state, step=start_step, start_step=start_step, end_step=end_step,
                          total_steps=cfg.train.steps, result=RunResult(output_dir=out_dir, final_step=start_step))
        self.hooks = self._hooks()

    # ---- set-up pieces -------------------------------------------------------------------------
    def _check_resume(self, ckpt_dir: str, step: int, meta: dict) -> None:
        """A resumed run trains what the checkpoint's run trained: the same data, model, objective,
        schedule and draft vocabulary, from the step its folder names. The checkpoint's recorded
        identity is compared with this run's (`resume_differences`); a checkpoint from before
        identities is compared by its run folder's run_meta.json, with a warning that its data and
        vocabulary cannot be checked. Settings and data differences are refused unless
        checkpoint.allow_config_change; another draft vocabulary or step is always refused."""
        where = os.path.join(ckpt_dir, str(step))
        explicit = self.cfg.checkpoint.restore_from != "latest"
        saved, saved_step = meta.get(ckpt.IDENTITY), meta.get("step")
        other_step = ([f"step: folder {step} holds step {saved_step}"]
                      if isinstance(saved_step, int) and saved_step != step else [])
        other_vocab = []
        if isinstance(saved, dict):
            allowed, other_vocab = resume_differences(saved, self.identity)
        else:
            run_meta = os.path.join(os.path.dirname(os.path.abspath(ckpt_dir)), RUN_META_FILE)
            log.warning("checkpoint %s records no run identity (written by an older specjax): its data and draft "
                        "vocabulary could not be checked against this run's; only the settings in %s are compared.",
                        where, run_meta)
            allowed = [f"config {d}" for d in self._run_meta_differences(run_meta)]
        if other_vocab or other_step:
            raise ckpt.CheckpointFromAnotherRun(self._foreign_checkpoint_message(
                where, step, allowed + other_vocab + other_step, bool(other_vocab), bool(other_step)))
        if not allowed:
            return
        if not self.cfg.checkpoint.allow_config_change:
            head = (f"starting {self.out_dir} from checkpoint {where} (checkpoint.restore_from), which was trained "
                    f"with a different configuration or data:" if explicit else
                    f"resuming {self.out_dir} at step {step} with a different configuration or data than it was "
                    f"trained with:")
            fix = ("Give a checkpoint of a run with these settings, set checkpoint.restore_from=none to start fresh, "
                   "or set checkpoint.allow_config_change=true to start from it with this run's settings and data "
                   "(a warm start)." if explicit else
                   "Use a new run.output_dir, set checkpoint.restore_from=none to start fresh, or set "
                   "checkpoint.allow_config_change=true to resume with the new settings and data.")
            raise ValueError(f"{head}\n  " + "\n  ".join(allowed) + f"\n{fix}")
        path = os.path.join(self.out_dir, RUN_META_FILE)
        kept = os.path.join(self.out_dir, f"run_meta.before_step{step}.json")
        moved = os.path.exists(path)
        if self.proc == 0 and moved:
            os.replace(path, kept)
        log.warning("%s at step %d with a changed configuration or data (checkpoint.allow_config_change): %s%s",
                    f"starting from {where}" if explicit else "resuming", step, "; ".join(allowed),
                    f"; the previous run_meta.json is kept as {kept}" if moved else "")

    def _run_meta_differences(self, path: str) -> list[str]:
        """config_differences between the run_meta.json at `path` (none: nothing to compare) and now."""
        if not os.path.exists(path):
            return []
        try:
            with open(path) as f:
                saved = json.load(f).get("config") or {}
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{path} cannot be read ({e}); it records the configuration the checkpoints were "
                             f"trained with. Restore it, or set checkpoint.restore_from=none to start fresh.") from e
        return config_differences(saved, config_to_dict(self.cfg))

    def _foreign_checkpoint_message(self, where: str, step: int, differences: list[str], other_vocab: bool,
                                    other_step: bool) -> str:
        ckpt_dir, run_dir = os.path.dirname(where), os.path.dirname(os.path.dirname(where))
        why = " ".join(
            ([f"Its draft's lm_head rows are in the order of another draft vocabulary, so no setting can resume it "
              f"with this run's {VOCAB_FILE}."] if other_vocab else [])
            + (["A checkpoint folder is named after the step it saved; this one was copied in or renamed."]
               if other_step else []))
        if self.cfg.checkpoint.restore_from != "latest":
            fix = (f"To continue that run, start in a new run.output_dir holding a copy of "
                   f"{os.path.join(run_dir, VOCAB_FILE)} (add checkpoint.allow_config_change=true if its settings or "
                   "data differ); to start from its weights only, set draft.init_from to its export."
                   if other_vocab else
                   "Give the checkpoint folder whose name is its step.")
        else:
            fix = (f"Move {where} out of {ckpt_dir} (the run then resumes from its own older checkpoints), use a new "
                   "run.output_dir, or set checkpoint.restore_from=none to start fresh"
                   + ("; to start from another run's weights, set draft.init_from to its export." if other_vocab
                      else "."))
        return (f"checkpoint {where} does not belong to this run ({self.out_dir}) as step {step}:\n  "
                + "\n  ".join(differences) + f"\n{why} {fix}")

    def _write_run_meta(self, resumed_at: int = 0) -> None:
        meta = {
            "config": config_to_dict(self.cfg),
            "draft_config": draft_types.config_to_dict(self.setup.draft_config),
            "target_path": os.path.abspath(self.cfg.target.path),
            "target_config": self.target.hf_config,
            "vocab_file": VOCAB_FILE,
        }
        if draft_types.is_dflash(self.setup.draft_config):  # absent: EAGLE-3 (as in runs from before DFlash)
            meta[draft_types.FAMILY_KEY] = draft_types.DFLASH
        if resumed_at:
            meta["resumed_at_step"] = resumed_at
        if self.proc == 0:
            with open(os.path.join(self.out_dir, RUN_META_FILE), "w") as f:
                json.dump(meta, f, indent=1)

    def _restore(self, state):
        """latest: the newest checkpoint that verifies (damaged ones are moved aside, see
        specjax.checkpoint); an explicit <run>/checkpoints/<step>: that one, or an error naming its
        damage. Either way the checkpoint must be of this run (`_check_resume`)."""
        restore_from = self.cfg.checkpoint.restore_from
        if restore_from == "none" or (not self.mngr.all_steps() and restore_from == "latest"):
            return state, 0
        abstract = ckpt.abstract_like(state)
        if restore_from == "latest":  # before the data position is restored into another dataset
            try:  # shapes first: a draft of other shapes can never resume, whatever the settings allow
                ckpt.check_compatible(self.mngr, self.mngr.latest_step(), abstract)
            except ckpt.CheckpointMismatch:
                raise
            except Exception:  # noqa: BLE001 - unreadable metadata: restore_verified handles the damage
                pass
            rdir = str(self.mngr.directory)
            restored, _, _ = ckpt.restore_verified(
                self.mngr, abstract, self.data_iter, check_meta=lambda step, meta: self._check_resume(rdir, step, meta))
            if restored is None:  # every step folder was damaged and moved aside: start fresh
                return state, 0
        else:
            restored, rdir = self._restore_explicit(restore_from, abstract)
        start_step = int(restored["step"])
        log.info("resumed from %s at step %d", rdir, start_step)
        return restored, start_step

    def _restore_explicit(self, restore_from: str, abstract):
        """checkpoint.restore_from=<run>/checkpoints/<step>: that checkpoint or an error; one whose
        checksum list is missing or unusable is used with a warning (it was asked for by name)."""
        rdir, step = os.path.split(os.path.abspath(restore_from))
        if not step.isdigit() or not os.path.isdir(restore_from):
            raise FileNotFoundError(
                f"checkpoint.restore_from={restore_from!r} is not a saved checkpoint; give a "
                f"<run>/checkpoints/<step> folder, 'latest' (default) or 'none'.")
        step = int(step)
        files = ckpt.check_files(rdir, step)
        if files.damage is not None:
            raise ckpt.CheckpointDamaged(
                f"checkpoint.restore_from={restore_from!r} is damaged: {files.damage}. Give an older "
                f"<run>/checkpoints/<step>, or 'latest' to take the newest one that verifies.")
        if files.unverified is not None:
            log.warning("checkpoint.restore_from=%s could not be verified: %s. It is used as asked, unverified: a "
                        "changed byte in it would go unnoticed.", restore_from, files.unverified)
        rmngr = ckpt.manager(rdir, read_only=True)
        ckpt.check_compatible(rmngr, step, abstract)
        self._check_resume(rdir, step, ckpt.read_meta(rmngr, step))
        restored, _ = ckpt.restore(rmngr, abstract, self.data_iter, step=step)
        ckpt.check_restored_step(rdir, step, restored)
        if not ckpt.all_finite({"params": restored["params"], "opt_state": restored["opt_state"]}):
            raise ckpt.CheckpointDamaged(
                f"checkpoint.restore_from={restore_from!r} holds NaN/Inf params or optimizer state; give an "
                f"older <run>/checkpoints/<step>, or 'latest' to take the newest one that verifies.")
        return restored, rdir

    def _hooks(self) -> list[Hook]:
        cfg, L = self.cfg, self.loop
        hooks = [Hook("log", lambda s: s % cfg.train.log_every == 0 or s == L.end_step or s == L.start_step + 1,
                      self._log)]
        hooks.append(Hook("validate", every(cfg.train.eval_every, cfg.train.steps), lambda lp: self._validate(lp.step)))
        if self.decode_eval is not None:
            hooks.append(Hook("decode_eval", lambda s: self.decode_eval.due(s, cfg.train.steps, final=False),
                              lambda lp: self._decode_eval(lp.step)))
        hooks.append(Hook("checkpoint", every(cfg.checkpoint.every_steps, cfg.train.steps),
                          lambda lp: self._checkpoint(lp.step), settle=True))
        return hooks

    # ---- hooks ----------------------------------------------------------------------------------
    def _log(self, lp: _Loop) -> None:
        m = _to_float_dict(jax.device_get(lp.metrics))
        dt = time.time() - lp.t_since
        m["tokens_per_s"] = lp.tokens_since / max(dt, 1e-9)
        m["lr"] = float(self.setup.schedule(lp.step - 1))
        lp.tokens_since, lp.t_since = 0, time.time()
        self.writer.write(lp.step, "train", m)
        if not lp.result.first_metrics:
            lp.result.first_metrics = dict(m, step=lp.step)
        lp.result.last_metrics = dict(m, step=lp.step)
        if self.bar is not None:
            self.bar.set_postfix(summarize(m), refresh=False)

    def _validate(self, step: int) -> dict:
        if not self.val_batches:
            return {}
        ms = [self.fns.eval_step(self.loop.state["params"], self.target_params, self.vocab_arrays,
                                 _global_batch(b, self.fns.batch_sharding)) for b in self.val_batches]
        agg = {k: float(np.mean([_to_float_dict(m)[k] for m in ms])) for k in _to_float_dict(ms[0])}
        self.writer.write(step, "val", agg)
        return agg

    def _decode_eval(self, step: int) -> None:
        t0 = time.time()
        flat, short = self.decode_eval(self.loop.state["params"], step)
        self.loop.t_since += time.time() - t0  # keep decoding time out of the training tokens/s
        self.writer.write(step, "decode", flat)
        self.loop.result.decode_eval[step] = short
        log.info("step %d decode_eval: %s", step,
                 ", ".join(f"{n} tau {d['tau']:.3f} [{d['tau_lo']:.3f}, {d['tau_hi']:.3f}]" for n, d in short.items()))

    def _checkpoint(self, step: int) -> None:
        _save(self.mngr, step, self.loop.state, self.data_iter, self.loop.result, self.identity)

    # ---- the non-finite guard (one step behind, so the host never waits on the device) ----------
    def _settle(self) -> None:
        lp = self.loop
        if lp.pending is None:
            return
        s_step, flag, batch_ids = lp.pending
        lp.pending = None
        if float(flag) == 0.0:
            lp.consecutive_skips = 0
            return
        lp.consecutive_skips += 1
        lp.result.skipped_steps += 1
        rows = _source_rows(self.prepared.train, batch_ids)
        log.warning("step %d: non-finite loss or gradient; update skipped (params unchanged). Source rows: %s",
                    s_step, rows)
        self.writer.write(s_step, "skip", {"consecutive": lp.consecutive_skips, "rows": rows})
        if lp.consecutive_skips >= self.cfg.train.max_consecutive_skips:
            raise _TooManySkips(s_step, rows)

    # ---- training ---------------------------------------------------------------------------------
    def _step(self) -> None:
        lp = self.loop
        np_batch = next(self.data_iter)
        lp.tokens_since += int(np.sum(np.asarray(np_batch["segment_ids"]) > 0))
        lp.state, lp.metrics = self.fns.train_step(lp.state, self.target_params, self.vocab_arrays,
                                                   _global_batch(np_batch, self.fns.batch_sharding))
        lp.step += 1
        self._settle()  # the previous step's flag, which is ready by now
        lp.pending = (lp.step, lp.metrics["skipped"], np_batch.get("example_ids"))

    def _stop_requested(self) -> bool:
        if self.nproc > 1:  # every process must agree to stop at the same step (saves are collective)

            self.stop.requested = bool(np.any(multihost_utils.process_allgather(np.array(self.stop.requested))))
            self.stop.requested = self.stop.requested or self.mngr.reached_preemption(self.loop.step)
        return self.stop.requested

    def _train_steps(self) -> None:
        lp = self.loop
        while lp.step < lp.end_step:
            self._step()
            for hook in self.hooks[:1]:  # logging before the progress bar moves
                if hook.due(lp.step):
                    hook.fn(lp)
            if self.bar is not None:
                self.bar.update(1)
            if self._stop_requested():
                self._settle()
                lp.result.preempted = True
                return
            for hook in self.hooks[1:]:
                if hook.due(lp.step):
                    if hook.settle:
                        self._settle()
                    hook.fn(lp)
        self._settle()

    def fit(self) -> RunResult:
        cfg, lp = self.cfg, self.loop
        result = lp.result
        self.bar = None
        if cfg.train.progress and self.proc == 0:
            self.bar = tqdm(total=cfg.train.steps, initial=lp.start_step, desc="train", dynamic_ncols=True)
        if self.stop.requested:  # a signal during the set-up: nothing trained, nothing to save
            return self._stopped()
        if lp.start_step == 0:
            result.initial_val_metrics = self._validate(0)  # the untrained draft, for comparison
        lp.tokens_since, lp.t_since = 0, time.time()
        try:
            self._train_steps()
        except _TooManySkips as e:
            self._checkpoint(lp.step)
            self.writer.close()
            raise NonFiniteTrainingError(
                f"{cfg.train.max_consecutive_skips} consecutive steps (up to step {e.step}) had a non-finite loss "
                f"or gradient, so training stopped; the last good state is checkpointed in {self.mngr.directory}. "
                f"Likely causes: optim.lr too high (now {cfg.optim.lr}) or no/too-loose optim.grad_clip (now "
                f"{cfg.optim.grad_clip}); bad data in the rows of the last batch {e.rows}; a target in too low a "
                f"precision (target.dtype)."
            ) from None
        finally:
            if self.bar is not None:
                self.bar.close()
        step = lp.step
        if result.preempted or self.stop.requested:
            return self._stopped()

        result.final_step = step
        result.stopped_early = step < cfg.train.steps
        result.val_metrics = self._validate(step)
        # the last step (a stop_at_step run was already measured in the loop at its multiples)
        if (self.decode_eval is not None and not result.stopped_early and not self.stop.requested
                and self.decode_eval.due(step, cfg.train.steps, final=True)):
            self._decode_eval(step)
        if self.mngr.latest_step() != step:
            self._checkpoint(step)
        if self.stop.requested:  # during the final validation or save: the checkpoint is there
            return self._stopped()
        self.writer.close()
        if cfg.export.at_end and not result.stopped_early:
            result.export_dir = self._export(step)
        result.wall_time_s = time.time() - self.t_start
        return result

    def _stopped(self) -> RunResult:
        """A signal asked the run to stop: checkpoint what was trained since the last save, then return
        (a rerun of the same command resumes there, and exports when the schedule is done)."""
        lp, result = self.loop, self.loop.result
        if lp.step > lp.start_step and self.mngr.latest_step() != lp.step:
            self._checkpoint(lp.step)
        self.writer.close()
        result.preempted = True
        result.final_step, result.stopped_early = lp.step, True
        result.wall_time_s = time.time() - self.t_start
        log.warning("stop requested (SIGTERM/SIGINT or preemption): checkpoint at step %s in %s; run the same "
                    "command again to resume.", self.mngr.latest_step(), self.mngr.directory)
        return result

    def _export(self, step: int) -> str:
        cfg, state = self.cfg, self.loop.state
        # every process takes part in the gather (params may be sharded across hosts); one writes
        host_params = (multihost_utils.process_allgather(state["params"], tiled=True) if self.nproc > 1
                       else jax.device_get(state["params"]))
        export_dir = cfg.export.out_dir or os.path.join(self.out_dir, "export")
        if self.proc == 0:
            export_from_state(host_params, self.setup.draft_config, self.vocab, self.target.hf_config, export_dir,
                              dtype=cfg.export.dtype,
                              extra_manifest={"step": step, "metrics": self.loop.result.last_metrics,
                                              "config": config_to_dict(cfg),
                                              "target_path": os.path.abspath(cfg.target.path)})
        return export_dir


def train(cfg: Config) -> RunResult:
    """Build the run from `cfg`, train (resuming from the latest checkpoint by default), export.
    SIGTERM/SIGINT are handled from the first line to the export (see _StopSignal). The run holds
    run.output_dir's lock throughout: a second run on the folder is refused (specjax.run_lock)."""
    stop = _StopSignal()
    with stop.installed(), run_lock.holding(cfg.run.output_dir):  # one run per folder (specjax.run_lock)
        return _Trainer(cfg, stop).fit()

"""The training loop: steps of a built run (specjax.train.run), each followed by the hooks that are due.

`train(cfg)` builds the run (`build_run`: lock, preflight, target, tokenizer, data, vocab, run
set-up, restore), then trains: each step is followed by the hooks whose `every` says the step is
theirs (log, progress, stop, validate, decode_eval, regenerate, checkpoint, in that order); then the final
validation, decode_eval and checkpoint, the export and the run report (specjax.report). SIGTERM/SIGINT
ask the run to checkpoint and stop (specjax.train.signals).

A stop never loses a validation or decode_eval: one that was due at the step where the run stops,
but had not run, is named in that checkpoint's meta (`DUE_NOT_RUN`), and the resumed run does it
first, on the very state it was due on. Each validation prints one line; the progress bar shows the
smoothed train loss and the last validation. Every invocation marks its start and end in
metrics.jsonl (split `run`), and ends by writing the report of the whole run, a stopped one too.

The mutable state of a run (train state, step, timing, the non-finite guard) lives in one `_Loop`
object that the hooks read and update, instead of closures over `nonlocal` variables.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from specjax import checkpoint as ckpt
from specjax.config import Config, config_to_dict
from specjax.export import eval_manifest, export_from_state, train_metrics_at
from specjax.report import write_report
from specjax.run_files import EXPORT_DIR
from specjax.train.cache_source import HostRows, place_host_rows
from specjax.train.metrics import RUN_SPLIT, MetricsWriter, Smoothed, summarize, validation_line
from specjax.train.run import Run, build_run
from specjax.train.signals import StopSignal
from specjax.train.step import BATCH_KEYS

log = logging.getLogger("specjax")

# the checkpoint meta key naming the hooks that were due at its step when a stop came before them
DUE_NOT_RUN = "due_not_run"


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
    start_step: int = 0  # the step this invocation started from (a resume's checkpoint step)
    report_path: Optional[str] = None  # the run report (specjax.report), None when it could not be written


class NonFiniteTrainingError(RuntimeError):
    pass


class _TooManySkips(Exception):
    def __init__(self, step, rows):
        self.step, self.rows = step, rows


def _source_rows(examples, example_ids) -> list[str]:
    if example_ids is None:
        return []
    ids = sorted(set(np.asarray(example_ids).ravel().tolist()) - {0})
    return [f"{examples[i - 1].source}:{examples[i - 1].row}" for i in ids if 0 < i <= len(examples)]


def _disk_full(e: BaseException) -> bool:
    text = str(e)
    return getattr(e, "errno", None) == 28 or "RESOURCE_EXHAUSTED" in text or "No space left" in text


def _save(mngr, step, state, data_iter, result, identity: dict, due_not_run: tuple = ()) -> None:
    """A checkpoint (its meta: the step, the last metrics, the run's `identity` and, when a stop came
    before them, the hooks due at this step that did not run), or one error that says the previous
    one is intact. A full disk reaches us as an OSError, or as orbax/tensorstore's
    ValueError(RESOURCE_EXHAUSTED ...); what the failed save left behind is removed so it does not
    keep the disk full."""
    meta = {"step": step, "metrics": result.last_metrics, ckpt.IDENTITY: identity}
    if due_not_run:
        meta[DUE_NOT_RUN] = list(due_not_run)
    try:
        ckpt.save(mngr, step, state, data_iter, meta)
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


def global_batch(np_batch: dict, sharding, keys=BATCH_KEYS) -> dict:
    """Every process holds the same global numpy batch (identical iterators) and contributes the rows of
    its own devices, so training is the same whatever the number of processes; a cache-fed run's
    iterator yields only those rows (HostRows)."""
    if isinstance(np_batch, HostRows):
        return place_host_rows(np_batch, sharding, keys)
    nproc, proc = jax.process_count(), jax.process_index()
    rows = np_batch["input_ids"].shape[0] // nproc
    return {k: jax.make_array_from_process_local_data(
        sharding, np.asarray(np_batch[k])[proc * rows:(proc + 1) * rows]) for k in keys}


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
# the loop: explicit state + hooks
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
    due_not_run: tuple = ()  # hooks due at `step` that a stop came before (recorded in its checkpoint)


@dataclass(frozen=True)
class Hook:
    """Runs `fn(loop)` after every step for which `every(step)` is true; `settle` first resolves the
    non-finite guard, so e.g. a checkpoint never holds a step whose skip has not been looked at.
    `resumable`: work a stop must not lose (validation, decode_eval): a requested stop is checked
    right before it, and when the run stops first, the checkpoint names it and the resumed run does
    it on the same state."""
    name: str
    every: Callable[[int], bool]
    fn: Callable[[_Loop], None]
    settle: bool = False
    resumable: bool = False


def every(n: int, before: int) -> Callable[[int], bool]:
    """Due at each multiple of n (n = 0: never) before step `before` (the final step has its own
    end-of-run handling)."""
    return lambda step: bool(n) and step % n == 0 and step < before


def each_step(step: int) -> bool:
    return True


class _StopNow(Exception):
    """Raised by the stop hook to end the steps (the state is settled and the result marked)."""


class _Trainer:
    """Trains a built Run: `fit()` runs the steps and their hooks, then the final validation,
    checkpoint and export."""

    def __init__(self, run: Run, stop: StopSignal):
        self.run, self.stop = run, stop
        self.cfg, self.out_dir, self.mngr = run.cfg, run.out_dir, run.mngr
        self.fns, self.data_iter, self.decode_eval = run.setup.fns, run.data.iterator, run.decode_eval
        self.proc, self.nproc = jax.process_index(), jax.process_count()
        self.writer = MetricsWriter(self.out_dir, enabled=self.proc == 0)
        end_step = min(self.cfg.train.steps, self.cfg.train.stop_at_step or self.cfg.train.steps)
        self.loop = _Loop(state=run.state, step=run.start_step, start_step=run.start_step, end_step=end_step,
                          total_steps=self.cfg.train.steps,
                          result=RunResult(output_dir=self.out_dir, final_step=run.start_step))
        self.bar = None
        self.hooks: list[Hook] = []
        self.smooth = Smoothed()  # the bar's train metrics: one batch's loss is too noisy to read
        self.last_val: dict = {}  # the last validation, for the bar
        self.last_decode: Optional[tuple] = None  # (step, flat metrics) of the last decode_eval

    def _hooks(self) -> list[Hook]:
        """The hooks after each step, in the order they run: the log line before the progress bar moves;
        a requested stop before anything slower than a log line."""
        cfg, L, steps = self.cfg, self.loop, self.cfg.train.steps
        hooks = [Hook("log", lambda s: s % cfg.train.log_every == 0 or s == L.end_step or s == L.start_step + 1,
                      self._log)]
        if self.bar is not None:
            hooks.append(Hook("progress", each_step, lambda lp: self.bar.update(1)))
        hooks.append(Hook("stop", each_step, self._stop_if_requested))
        hooks.append(Hook("validate", every(cfg.train.eval_every, steps), lambda lp: self._validate(lp.step),
                          resumable=True))
        if self.decode_eval is not None:
            hooks.append(Hook("decode_eval", lambda s: self.decode_eval.due(s, steps, final=False),
                              lambda lp: self._decode_eval(lp.step), resumable=True))
        if self.run.regen is not None:  # before the checkpoint of the same step, which then holds the round
            hooks.append(Hook("regenerate", every(cfg.regenerate.every_steps, steps),
                              lambda lp: self._regen_round(lp.step), resumable=True))
        hooks.append(Hook("checkpoint", every(cfg.checkpoint.every_steps, steps),
                          lambda lp: self._checkpoint(lp.step), settle=True))
        return hooks

    # ---- hooks ----------------------------------------------------------------------------------
    def _log(self, lp: _Loop) -> None:
        m = _to_float_dict(jax.device_get(lp.metrics))
        dt = time.time() - lp.t_since
        m["tokens_per_s"] = lp.tokens_since / max(dt, 1e-9)
        m["lr"] = float(self.run.setup.schedule(lp.step - 1))
        if self.run.regen is not None:
            m["regen_rounds"] = self.run.regen.rounds_done
            m["regen_examples"] = self.run.regen.examples_replaced
        lp.tokens_since, lp.t_since = 0, time.time()
        self.writer.write(lp.step, "train", m)
        if not lp.result.first_metrics:
            lp.result.first_metrics = dict(m, step=lp.step)
        lp.result.last_metrics = dict(m, step=lp.step)
        smoothed = self.smooth.update(m)
        if self.bar is not None:  # tokens/s as measured: its first window holds the compile
            self.bar.set_postfix(summarize(dict(smoothed, tokens_per_s=m["tokens_per_s"]), self.last_val),
                                 refresh=False)

    def _validate(self, step: int) -> dict:
        if not self.run.data.val_batches:
            return {}
        ms = [self.fns.eval_step(self.loop.state["params"], self.run.target_params, self.run.vocab_arrays,
                                 global_batch(b, self.fns.batch_sharding, self.fns.batch_keys))
              for b in self.run.data.val_batches]
        agg = {k: float(np.mean([_to_float_dict(m)[k] for m in ms])) for k in _to_float_dict(ms[0])}
        self.writer.write(step, "val", agg)
        self.last_val = agg
        if self.proc == 0:
            log.info("%s", validation_line(step, agg, self.last_decode))
        return agg

    def _decode_eval(self, step: int) -> None:
        t0 = time.time()
        flat, short = self.decode_eval(self.loop.state["params"], step)
        self.loop.t_since += time.time() - t0  # keep decoding time out of the training tokens/s
        self.writer.write(step, "decode", flat)
        self.last_decode = (step, flat)
        self.loop.result.decode_eval[step] = short
        log.info("step %d decode_eval: %s", step,
                 ", ".join(f"{n} tau {d['tau']:.3f} [{d['tau_lo']:.3f}, {d['tau_hi']:.3f}]" for n, d in short.items()))

    def _regen_round(self, step: int) -> None:
        t0 = time.time()
        res = self.run.regen.run_round(step)
        self.loop.t_since += time.time() - t0  # keep generation time out of the training tokens/s
        self.writer.write(step, "regen", res.metrics())

    def _checkpoint(self, step: int, due_not_run: tuple = ()) -> None:
        _save(self.mngr, step, self.loop.state, self.data_iter, self.loop.result, self.run.identity, due_not_run)

    def _mark(self, event: str, step: int, **info) -> None:
        """An invocation's start or end in metrics.jsonl (split `run`): where each resume began, and
        its wall time, for the run report."""
        self.writer.write(step, RUN_SPLIT, {"event": event, **info})

    def _report(self) -> Optional[str]:
        """The run report (specjax.report) of the whole run so far; a failure is logged, never raised:
        the run it describes has trained and saved."""
        if self.proc != 0:
            return None
        try:
            path = write_report(self.out_dir)
        except Exception as e:  # noqa: BLE001 - whatever went wrong, the checkpoint and export stand
            log.error("the run report could not be written (%s: %s); the run is not affected. Write it again with "
                      "`python -m specjax.report %s`.", type(e).__name__, str(e).splitlines()[0][:300] if str(e)
                      else "", self.out_dir)
            return None
        log.info("run report: %s", path)
        return path

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
        rows = _source_rows(self.run.data.train, batch_ids)
        log.warning("step %d: non-finite loss or gradient; update skipped (params unchanged). Source rows: %s",
                    s_step, rows)
        self.writer.write(s_step, "skip", {"consecutive": lp.consecutive_skips, "rows": rows})
        if lp.consecutive_skips >= self.cfg.train.max_consecutive_skips:
            raise _TooManySkips(s_step, rows)

    # ---- training ---------------------------------------------------------------------------------
    def _step(self) -> None:
        lp = self.loop
        np_batch = next(self.data_iter)
        tokens = int(np.sum(np.asarray(np_batch["segment_ids"]) > 0))
        # a HostRows batch is this process's share: the others' rows are not read here (an estimate
        # with several processes, exact with one)
        lp.tokens_since += tokens * (jax.process_count() if isinstance(np_batch, HostRows) else 1)
        batch = global_batch(np_batch, self.fns.batch_sharding, self.fns.batch_keys)
        lp.state, lp.metrics = self.fns.train_step(lp.state, self.run.target_params, self.run.vocab_arrays, batch)
        lp.step += 1
        self._settle()  # the previous step's flag, which is ready by now
        lp.pending = (lp.step, lp.metrics["skipped"], np_batch.get("example_ids"))

    def _stop_requested(self) -> bool:
        if self.nproc > 1:  # every process must agree to stop at the same step (saves are collective)

            self.stop.requested = bool(np.any(multihost_utils.process_allgather(np.array(self.stop.requested))))
            self.stop.requested = self.stop.requested or self.mngr.reached_preemption(self.loop.step)
        return self.stop.requested

    def _stop_if_requested(self, lp: _Loop) -> None:
        if self._stop_requested():
            self._stop_now(self.hooks)

    def _stop_now(self, remaining: list[Hook]) -> None:
        """End the steps here: settle the guard, note which of the `remaining` hooks were due at this
        step and are resumable (the checkpoint will name them), mark the result."""
        lp = self.loop
        self._settle()
        lp.due_not_run = tuple(h.name for h in remaining if h.resumable and h.every(lp.step))
        lp.result.preempted = True
        raise _StopNow

    def _train_steps(self) -> None:
        """Step, then the due hooks, until the end step or a stop."""
        lp = self.loop
        try:
            while lp.step < lp.end_step:
                self._step()
                for i, hook in enumerate(self.hooks):
                    if hook.every(lp.step):
                        if hook.settle:
                            self._settle()
                        if hook.resumable and self._stop_requested():  # e.g. during the previous hook
                            self._stop_now(self.hooks[i:])
                        hook.fn(lp)
        except _StopNow:
            return
        self._settle()

    def _run_due_from_checkpoint(self) -> bool:
        """A resumed run first does the validation / decode_eval that its checkpoint says a stop came
        before (DUE_NOT_RUN), at the checkpoint's step, on its state. True when a stop is requested
        meanwhile (the checkpoint still names them, so the next resume does them again)."""
        lp = self.loop
        due = self.run.resume_meta.get(DUE_NOT_RUN) or []
        if lp.start_step >= lp.end_step:  # the end-of-run validation and decode_eval run at this step anyway
            return False
        for hook in self.hooks:
            if hook.name in due:
                if self._stop_requested():
                    return True
                log.info("step %d: %s was due when the previous run stopped; running it now", lp.step, hook.name)
                hook.fn(lp)
        return False

    def _console(self):
        """While the bar is drawn, log lines go through tqdm.write, above it, instead of breaking it."""
        if self.bar is None:
            return contextlib.nullcontext()
        consoles = [lg for lg in (logging.getLogger(), log) if any(
            isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stdout, sys.stderr)
            for h in lg.handlers)]
        return logging_redirect_tqdm(loggers=consoles) if consoles else contextlib.nullcontext()

    def fit(self) -> RunResult:
        cfg, lp = self.cfg, self.loop
        result = lp.result
        result.start_step = lp.start_step
        self._mark("start", lp.start_step, start_step=lp.start_step, end_step=lp.end_step, steps=cfg.train.steps,
                   setup_s=round(time.time() - self.run.t_start, 3))
        if cfg.train.progress and self.proc == 0:
            self.bar = tqdm(total=cfg.train.steps, initial=lp.start_step, desc="train", dynamic_ncols=True)
        self.hooks = self._hooks()
        stopped = False
        try:
            with self._console():
                if self.stop.requested:  # a signal during the set-up: nothing trained, nothing to save
                    stopped = True
                elif lp.start_step == 0:
                    result.initial_val_metrics = self._validate(0)  # the untrained draft, for comparison
                else:
                    stopped = self._run_due_from_checkpoint()
                lp.tokens_since, lp.t_since = 0, time.time()
                if not stopped:
                    self._train_steps()
        except _TooManySkips as e:
            self._checkpoint(lp.step)
            self._mark("end", lp.step, wall_time_s=round(time.time() - self.run.t_start, 3), stopped=False,
                       error="non-finite loss or gradient")
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
        if stopped or result.preempted or self.stop.requested:
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
        if cfg.export.at_end and not result.stopped_early:
            result.export_dir = self._export(step)
        result.wall_time_s = time.time() - self.run.t_start
        self._mark("end", step, wall_time_s=round(result.wall_time_s, 3), stopped=False,
                   exported=result.export_dir is not None)
        self.writer.close()
        result.report_path = self._report()
        return result

    def _stopped(self) -> RunResult:
        """A signal asked the run to stop: checkpoint what was trained since the last save, then return
        (a rerun of the same command resumes there, and exports when the schedule is done)."""
        lp, result = self.loop, self.loop.result
        if lp.step > lp.start_step and self.mngr.latest_step() != lp.step:
            self._checkpoint(lp.step, lp.due_not_run)
        result.preempted = True
        result.final_step, result.stopped_early = lp.step, True
        result.wall_time_s = time.time() - self.run.t_start
        self._mark("end", lp.step, wall_time_s=round(result.wall_time_s, 3), stopped=True)
        self.writer.close()
        log.warning("stop requested (SIGTERM/SIGINT or preemption): checkpoint at step %s in %s; run the same "
                    "command again to resume%s.", self.mngr.latest_step(), self.mngr.directory,
                    f" (it first runs {', '.join(lp.due_not_run)} at step {lp.step}, due when the stop came)"
                    if lp.due_not_run else "")
        result.report_path = self._report()  # after the checkpoint: a kill during it loses nothing
        return result

    def _export(self, step: int) -> str:
        cfg, state = self.cfg, self.loop.state
        # every process takes part in the gather (params may be sharded across hosts); one writes
        host_params = (multihost_utils.process_allgather(state["params"], tiled=True) if self.nproc > 1
                       else jax.device_get(state["params"]))
        export_dir = cfg.export.out_dir or os.path.join(self.out_dir, EXPORT_DIR)
        if self.proc == 0:  # which holds metrics.jsonl, where the validation and decode_eval rows are read
            export_from_state(host_params, self.run.setup.draft_config, self.run.vocab, self.run.target.hf_config,
                              export_dir, dtype=cfg.export.dtype,
                              extra_manifest={"step": step,
                                              "metrics": (self.loop.result.last_metrics
                                                          or train_metrics_at(self.out_dir, step)),
                                              "config": config_to_dict(cfg),
                                              "target_path": os.path.abspath(cfg.target.path),
                                              **eval_manifest(self.out_dir, step)})
        return export_dir


def train(cfg: Config) -> RunResult:
    """Build the run from `cfg` (specjax.train.run.build_run), train (resuming from the latest
    checkpoint by default), export. SIGTERM/SIGINT are handled from the first line to the export
    (specjax.train.signals.StopSignal). The run holds run.output_dir's lock throughout: a second run
    on the folder is refused (specjax.run_lock)."""
    stop = StopSignal()
    with stop.installed(), build_run(cfg, stop) as run:
        return _Trainer(run, stop).fit()

"""Metrics: the sinks (`metrics.jsonl`, one JSON object per logged step and split, and TensorBoard),
what the progress bar and the console show, and the run's history read back from metrics.jsonl.

Splits of metrics.jsonl: `train` (the logged steps), `val` (held-out validation), `decode`
(decode_eval), `skip` (non-finite steps) and `run` (one `start` row when an invocation begins
training and one `end` row when it ends, so the history knows where each resume began). Every
resume appends to the file; a resume re-logs the steps after its checkpoint, and there the later
row wins (`read_history`).

The draft families log different keys, and everything here works from the keys present: `loss`;
`acc_<i>` (acceptance at draft position i: a TTT step, or a block slot); `tau_sim` (TTT drafts:
accepted draft tokens per step, no bonus token) or `accept_len` (block drafters: tokens per block,
bonus included); `decode_tau/<dataset>` (decode_eval: the engine's tau, bonus included).
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Optional

from specjax.run_files import TENSORBOARD_DIR, metrics_path

RUN_SPLIT = "run"  # the invocation markers' split: event "start" / "end"
_ACC = re.compile(r"^acc_(\d+)$")
_DECODE_TAU = re.compile(r"^decode_tau/(.+)$")


class MetricsWriter:
    def __init__(self, out_dir: str, enabled: bool = True):
        self.enabled = enabled
        self.path = metrics_path(out_dir)
        self._tb = None
        if enabled and os.path.exists(self.path):
            # a killed run can leave a torn last line; start the resumed run on a fresh line
            with open(self.path, "rb+") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() and (f.seek(-1, os.SEEK_END) or f.read(1) != b"\n"):
                    f.write(b"\n")
        if enabled:
            try:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(os.path.join(out_dir, TENSORBOARD_DIR))
            except ImportError:  # TensorBoard output is optional; metrics.jsonl is the record
                self._tb = None

    def write(self, step: int, split: str, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "split": split, "time": time.time(), **metrics}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None and split != RUN_SPLIT:  # the markers are bookkeeping, not curves
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


# ---------------------------------------------------------------------------------------------
# what the keys mean, whatever the family
# ---------------------------------------------------------------------------------------------
def acc_positions(m: dict) -> list[int]:
    """The draft positions i with an `acc_<i>` key, in order."""
    return sorted(int(g.group(1)) for g in (_ACC.match(k) for k in m) if g)


def predicted_tau(m: dict) -> Optional[tuple[float, int]]:
    """(tau, K) that a row's accuracies predict, in the engines' definition of tau (tokens per
    verification step, the bonus token included): 1 + tau_sim for a TTT draft, accept_len for a
    block drafter (which counts its bonus token already). K is the number of draft positions the
    row measures (its `acc_<i>` keys). None when the row has neither as a finite number."""
    k = len(acc_positions(m))
    for key, bonus in (("tau_sim", 1.0), ("accept_len", 0.0)):
        v = m.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return bonus + float(v), k
    return None


def decode_taus(m: dict) -> dict[str, tuple[float, Optional[float], Optional[float]]]:
    """{dataset: (tau, lo, hi)} of a decode row (lo/hi: its 95% interval, None when not logged)."""
    out = {}
    for k, v in m.items():
        g = _DECODE_TAU.match(k)
        if g and isinstance(v, (int, float)) and math.isfinite(v):
            name = g.group(1)
            out[name] = (float(v), m.get(f"decode_tau_lo/{name}"), m.get(f"decode_tau_hi/{name}"))
    return out


class Smoothed:
    """An exponential moving average of each numeric metric, bias-corrected (the first value is
    itself, not a fraction of it), so a batch-of-2 loss that jumps between 6 and 26 reads as its
    trend. `beta` 0.9 weighs about the last 10 values."""

    def __init__(self, beta: float = 0.9):
        self.beta, self._avg, self._n = beta, {}, 0

    def update(self, m: dict) -> dict:
        self._n += 1
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self._avg[k] = self.beta * self._avg.get(k, 0.0) + (1.0 - self.beta) * float(v)
        correction = 1.0 - self.beta ** self._n
        return {k: a / correction for k, a in self._avg.items()}


def summarize(m: dict, val: Optional[dict] = None) -> dict:
    """The few numbers shown on the progress bar (from the smoothed train metrics), and the last
    validation's loss and predicted tau when there is one."""
    out = {}
    for key, fmt in (("loss", "{:.3f}"), ("acc_0", "{:.3f}"), ("tau_sim", "{:.2f}"), ("accept_len", "{:.2f}"),
                     ("tokens_per_s", "{:.0f}")):
        if key in m:
            out[key.replace("tokens_per_s", "tok/s")] = fmt.format(m[key])
    if val:
        if "loss" in val:
            out["val_loss"] = f"{val['loss']:.3f}"
        tau = predicted_tau(val)
        if tau is not None:
            out["val_tau"] = f"{tau[0]:.2f}"
    return out


def validation_line(step: int, m: dict, decode: Optional[tuple[int, dict]] = None) -> str:
    """One console line for a validation: loss, acc_0, tau_sim or accept_len, the tau they predict,
    and the latest decode_eval tau (`decode`: (its step, its decode row)) when there is one."""
    parts = [f"step {step} validation: loss {m['loss']:.4f}" if "loss" in m else f"step {step} validation:"]
    for key in ("acc_0", "tau_sim", "acc", "accept_len"):
        if key in m:
            parts.append(f"{key} {m[key]:.4f}")
    tau = predicted_tau(m)
    if tau is not None:
        parts.append(f"predicted tau {tau[0]:.3f} at K={tau[1]}")
    if decode is not None:
        d_step, row = decode
        for name, (t, lo, hi) in sorted(decode_taus(row).items()):
            ci = f" [{lo:.3f}, {hi:.3f}]" if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) else ""
            parts.append(f"decode tau {name} {t:.3f}{ci} (step {d_step})")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# reading metrics.jsonl back
# ---------------------------------------------------------------------------------------------
def _rows(out_dir: str) -> list[dict]:
    path = metrics_path(out_dir)
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # a line torn by a killed process
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return rows


def read_metrics(out_dir: str, split: str = "train") -> list[dict]:
    return [r for r in _rows(out_dir) if r.get("split") == split]


def last_per_step(rows: list[dict]) -> dict[int, dict]:
    """A resumed run re-logs the steps after its last checkpoint; keep the latest row per step."""
    return {r["step"]: r for r in rows}


@dataclass
class Segment:
    """One invocation of the run: the step it started training from, the last step it logged, and
    its wall time (from its start marker minus its set-up time to its end marker, or to its last
    row when it was killed before writing one)."""
    start_step: int
    last_step: int
    wall_time_s: Optional[float]
    ended: bool  # an end marker was written (not killed)
    stopped: bool = False  # it ended on a stop request (SIGTERM/SIGINT, preemption)


@dataclass
class History:
    """A run's metrics.jsonl over all its invocations: per split, the latest row of each step, in
    step order. A `start` marker at step 0 after earlier rows means the folder was trained again from
    scratch (checkpoint.restore_from=none): the history begins there."""
    rows: dict = field(default_factory=dict)  # split -> {step: row}, steps ascending
    segments: list = field(default_factory=list)  # [Segment], one per invocation (runs with markers)

    def steps(self, split: str) -> list[int]:
        return list(self.rows.get(split, {}))

    def series(self, split: str, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key` in `split`, for the rows that hold it as a finite number."""
        pts = [(s, float(r[key])) for s, r in self.rows.get(split, {}).items()
               if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
               and math.isfinite(r[key])]
        return [s for s, _ in pts], [v for _, v in pts]

    def first(self, split: str) -> dict:
        rows = self.rows.get(split) or {}
        return rows[min(rows)] if rows else {}

    def last(self, split: str) -> dict:
        rows = self.rows.get(split) or {}
        return rows[max(rows)] if rows else {}

    def at_or_before(self, split: str, step: int) -> dict:
        rows = [s for s in self.rows.get(split) or {} if s <= step]
        return self.rows[split][max(rows)] if rows else {}

    @property
    def wall_time_s(self) -> Optional[float]:
        """The run's wall time over its invocations (None without start markers)."""
        times = [s.wall_time_s for s in self.segments if s.wall_time_s is not None]
        return sum(times) if times else None


def read_history(out_dir: str) -> History:
    rows = _rows(out_dir)
    begin = 0
    for i, r in enumerate(rows):
        if r.get("split") == RUN_SPLIT and r.get("event") == "start" and r.get("start_step") == 0:
            begin = i
    rows = rows[begin:]
    by_split: dict = {}
    for r in rows:
        if r.get("split") != RUN_SPLIT:
            by_split.setdefault(r.get("split"), {})[r["step"]] = r
    hist = History(rows={s: dict(sorted(d.items())) for s, d in by_split.items()})
    current = None  # (start row, last row seen since)
    for r in rows + [None]:
        is_start = r is not None and r.get("split") == RUN_SPLIT and r.get("event") == "start"
        if current is not None and (r is None or is_start):  # killed: no end marker
            start, last = current
            hist.segments.append(Segment(int(start.get("start_step", start["step"])), last["step"],
                                         last["time"] - start["time"] + float(start.get("setup_s", 0.0)), False))
            current = None
        if r is None:
            break
        if is_start:
            current = (r, r)
        elif current is not None and r.get("split") == RUN_SPLIT and r.get("event") == "end":
            start = current[0]
            hist.segments.append(Segment(int(start.get("start_step", start["step"])), r["step"],
                                         float(r.get("wall_time_s", r["time"] - start["time"])), True,
                                         bool(r.get("stopped", False))))
            current = None
        elif current is not None:
            current = (current[0], r)
    return hist

"""Metrics sinks: `metrics.jsonl` (one JSON object per logged step and split) and TensorBoard."""
from __future__ import annotations

import json
import os
import time

from specjax.run_files import TENSORBOARD_DIR, metrics_path


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
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()


def summarize(m: dict) -> dict:
    """The few numbers shown on the progress bar."""
    out = {}
    for key, fmt in (("loss", "{:.3f}"), ("acc_0", "{:.3f}"), ("tau_sim", "{:.2f}"), ("tokens_per_s", "{:.0f}")):
        if key in m:
            out[key.replace("tokens_per_s", "tok/s")] = fmt.format(m[key])
    return out


def read_metrics(out_dir: str, split: str = "train") -> list[dict]:
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
            if row.get("split") == split:
                rows.append(row)
    return rows


def last_per_step(rows: list[dict]) -> dict[int, dict]:
    """A resumed run re-logs the steps after its last checkpoint; keep the latest row per step."""
    return {r["step"]: r for r in rows}

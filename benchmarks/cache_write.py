"""Write rate of the state cache (specjax.data.state_cache) by shard size: N rows of bf16 states written
B rows at a time, as precompute writes them, into shards of each given size. A write into a shard
rewrites the whole shard file (tensorstore's zarr3 sharding), so shards of many writes cost quadratic I/O.

    PYTHONPATH=.:kernels python benchmarks/cache_write.py --rows 64 --batch 4 --rows-per-shard 64,16,4 --out F.json

Random bf16 states (they compress like random data under the store's zstd); one process, the machine's
page cache (no fsync), so it times the host work precompute does per batch, not the disk.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import tempfile
import time

import ml_dtypes
import numpy as np

from specjax.data.state_cache import StateCache


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4, help="rows per write")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--aux", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows-per-shard", default="64,16,4")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    T, A, D, N, B = args.seq, args.aux, args.hidden, args.rows, args.batch
    rng = np.random.default_rng(0)
    aux = rng.standard_normal((B, T, A, D), np.float32).astype(ml_dtypes.bfloat16)
    final = rng.standard_normal((B, T, D), np.float32).astype(ml_dtypes.bfloat16)
    tokens = {k: np.zeros((B, T), np.int32) for k in ("input_ids", "loss_mask", "segment_ids", "positions")}
    state_bytes = N * T * (A + 1) * D * 2
    rows = []
    work = tempfile.mkdtemp(prefix="cache-write-")
    try:
        for rps in (int(x) for x in args.rows_per_shard.split(",")):
            path = os.path.join(work, f"rps{rps}")
            split = StateCache.create(path, {}, {"train": N}, seq_length=T, num_aux=A, hidden=D, dtype="bfloat16",
                                      rows_per_shard=rps).split("train")
            t = time.perf_counter()
            for b0 in range(0, N, B):
                split.write(np.arange(b0, min(b0 + B, N)), tokens, final, aux)
            s = time.perf_counter() - t
            rows.append({"rows_per_shard": rps, "s": s, "tok_s": N * T / s, "state_MB_s": state_bytes / s / 1e6})
            print(f"rows_per_shard {rps:4d}: {s:6.2f} s  {N * T / s:9.0f} tok/s  {state_bytes / s / 1e6:6.0f} MB/s of states")
            shutil.rmtree(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": f"{platform.node()} {os.cpu_count()} cores", "argv": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()

"""A precompute killed (SIGKILL) at random moments, then finished, against an uninterrupted one.

    python benchmarks/precompute_kill.py --kills 3 --out benchmarks/results/precompute_kill.json

Runs `python -m specjax.precompute --config CONFIG target.cache_dir=...` once uninterrupted (timing it),
then in a second folder starts it and SIGKILLs it at a random moment (once a random, increasing number
of rows is written, plus up to 0.5 s), `--kills` times, and reruns it to completion.
Compared: every array of every split (numpy equality, dtype included) and every file's bytes
(sha256 of each file under the cache folder, the manifest included). Writes the timings, the rows
written before each kill and the comparison to `--out`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def _cmd(config: str, cache: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "specjax.precompute", "--config", config, "--no-progress",
            f"target.cache_dir={cache}", *overrides]


def _rows_done(cache: str) -> int:
    from specjax.data.state_cache import StateCache

    if not os.path.isfile(os.path.join(cache, "manifest.json")):
        return 0
    c = StateCache.open(cache)
    return sum(int(c.split(s).done().sum()) for s in ("train", "val") if c.rows(s))


def _file_hashes(root: str) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _arrays_equal(a: str, b: str) -> list[str]:
    import numpy as np

    from specjax.data.state_cache import StateCache

    ca, cb = StateCache.open(a), StateCache.open(b)
    diffs = []
    for split in ("train", "val"):
        if not ca.rows(split):
            continue
        sa, sb = ca.split(split), cb.split(split)
        for name in sa.arrays:
            x, y = sa.arrays[name].read().result(), sb.arrays[name].read().result()
            if x.dtype != y.dtype or not np.array_equal(x, y):
                diffs.append(f"{split}/{name}")
    return diffs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/demo_cpu.yaml")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/precompute_kill.json")
    ap.add_argument("overrides", nargs="*", default=["precompute.rows_per_shard=4"])
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="precompute_kill_")
    ref, killed = os.path.join(work, "ref"), os.path.join(work, "killed")
    env = dict(os.environ, PYTHONUNBUFFERED="1")

    t0 = time.perf_counter()
    subprocess.run(_cmd(args.config, ref, args.overrides), check=True, env=env, stdout=subprocess.DEVNULL)
    ref_s = time.perf_counter() - t0
    total = _rows_done(ref)
    print(f"uninterrupted: {total} rows in {ref_s:.1f} s")

    kills = []
    # each kill lands once a random number of rows (spread over the run, increasing) is written, plus a
    # random extra delay, so it interrupts real work (mid-batch or mid-write) each time
    targets = sorted(rng.randrange(1, total) for _ in range(args.kills))
    for i, target in enumerate(targets):
        p = subprocess.Popen(_cmd(args.config, killed, args.overrides), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        started = time.perf_counter()
        while p.poll() is None and _rows_done(killed) < target:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.5))
        finished = p.poll() is not None
        if not finished:
            p.send_signal(signal.SIGKILL)
        p.wait()
        kills.append({"target_rows": target, "after_s": round(time.perf_counter() - started, 2),
                      "finished_before_kill": finished, "rows_done": _rows_done(killed)})
        print(f"kill {i + 1}: after {kills[-1]['after_s']:.1f} s, {kills[-1]['rows_done']} of {total} rows done"
              + (" (it had finished)" if finished else ""))
    t1 = time.perf_counter()
    subprocess.run(_cmd(args.config, killed, args.overrides), check=True, env=env, stdout=subprocess.DEVNULL)
    last_s = time.perf_counter() - t1

    array_diffs = _arrays_equal(ref, killed)
    ha, hb = _file_hashes(ref), _file_hashes(killed)
    file_diffs = sorted(k for k in set(ha) | set(hb) if ha.get(k) != hb.get(k))
    result = {
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/precompute_kill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": args.config, "overrides": args.overrides, "rows": total, "uninterrupted_s": round(ref_s, 1),
        "kills": kills, "final_run_s": round(last_s, 1), "files": len(ha), "array_differences": array_diffs,
        "file_differences": file_diffs, "byte_identical": not array_diffs and not file_diffs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("rows", "kills", "files", "array_differences", "file_differences",
                                             "byte_identical")}))
    shutil.rmtree(work, ignore_errors=True)
    return 0 if result["byte_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

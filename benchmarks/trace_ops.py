"""Where a device's time goes, from a `jax.profiler` trace: total time per op (kernel) name on each
device stream, its share of the stream's busy time, and how much of the traced span the stream sat
idle (launch gaps, host waits).

    python benchmarks/trace_ops.py TRACE_DIR [--top 25] [--out summary.json]

TRACE_DIR is what `jax.profiler.trace(TRACE_DIR)` wrote (the newest `*.trace.json.gz` under it is
read; it is Chrome's trace-event JSON: "X" events with microsecond `ts`/`dur`, process names from "M"
events). It runs where the trace was taken, beside the repository. regen_speed.py --profile DIR calls
`summarize` itself.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_results  # noqa: E402

from specjax.bench.core import union_length  # noqa: E402

# a kernel name's trailing instance number (fusion.123, loop_add_fusion_4) joins one row per kind
_INSTANCE = re.compile(r"[._]\d+$")


def newest_trace(trace_dir: str) -> str:
    found = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise SystemExit(f"{trace_dir}: no *.trace.json.gz under it; pass the folder jax.profiler.trace wrote")
    return max(found, key=os.path.getmtime)


def summarize(trace_dir: str, top: int = 25) -> dict:
    """Per line (thread) of each device process (a name holding 'device' or 'GPU'/'TPU'; the host's
    when there is none): its busy time (union of its events), the traced span, and the ops with the
    most total time. A GPU's kernels sit on its stream lines; the profiler adds derived lines (XLA
    modules, XLA ops) that cover the same time, so lines are kept apart, never summed."""
    path = newest_trace(trace_dir)
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = [p for p, n in names.items() if re.search(r"device|GPU|TPU", n) and "host" not in n.lower()]
    pids = set(device_pids or names)
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    lines = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e:
            lines[(e["pid"], e.get("tid"))].append(e)
    out = {"trace": path, "processes": []}
    for (pid, tid), xs in sorted(lines.items(), key=lambda kv: -len(kv[1])):
        by = collections.defaultdict(lambda: [0.0, 0])
        for e in xs:
            key = _INSTANCE.sub("", e.get("name", "?"))
            by[key][0] += float(e["dur"])
            by[key][1] += 1
        start = min(float(e["ts"]) for e in xs)
        end = max(float(e["ts"]) + float(e["dur"]) for e in xs)
        busy = union_length((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in xs)
        total = sum(v[0] for v in by.values())
        rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
        out["processes"].append({
            "name": f"{names.get(pid, pid)} / {threads.get((pid, tid), tid)}", "events": len(xs), "span_ms": (end - start) / 1e3,
            "busy_ms": busy / 1e3, "idle_share": 1.0 - busy / max(end - start, 1e-9),
            "ops": [{"op": k, "total_ms": v[0] / 1e3, "count": v[1], "mean_us": v[0] / v[1],
                     "share_of_op_time": v[0] / max(total, 1e-9)} for k, v in rows]})
    return out


def format_summary(summary: dict) -> str:
    lines = [f"trace: {summary['trace']}"]
    for p in summary["processes"]:
        lines.append(f"{p['name']}: {p['events']} events, span {p['span_ms']:.1f} ms, busy {p['busy_ms']:.1f} ms "
                     f"(idle {100 * p['idle_share']:.1f}%)")
        for o in p["ops"]:
            lines.append(f"  {o['total_ms']:10.2f} ms {100 * o['share_of_op_time']:5.1f}% {o['count']:8d} x "
                         f"{o['mean_us']:9.2f} us  {o['op'][:90]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    s = summarize(a.trace_dir, a.top)
    print(format_summary(s))
    return write_results(s, a.out)


if __name__ == "__main__":
    sys.exit(main())

"""Where a device's time goes, from a `jax.profiler` trace: total time per op (kernel) name on each
device stream, its share of the stream's busy time, and how much of the traced span the stream sat
idle (launch gaps, host waits).

    python benchmarks/trace_ops.py TRACE_DIR [--top 25] [--out summary.json]
    python benchmarks/trace_ops.py TRACE_DIR --steps-from decode_attention:30 [--top 40]

With --steps-from KIND:K the trace is read as one call of a loop: its step count is the number of
KIND kernels over K (a kernel that runs K times a step, e.g. a 30-layer target's attention), and each
kernel instance of the busiest XLA module is put in a group by how many times it ran a step (30 per step:
once per layer; K per step: a K-long draft chain; 1: the step's own work; under 1: outside the loop),
with its time per step. That shows what a step costs beyond another loop's step with the same layers.
The `--top` instances with the most time a step are listed by name too (launches a step, mean time).

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


def _events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def summarize(trace_dir: str, top: int = 25) -> dict:
    """Per line (thread) of each device process (a name holding 'device' or 'GPU'/'TPU'; the host's
    when there is none): its busy time (union of its events), the traced span, and the ops with the
    most total time. A GPU's kernels sit on its stream lines; the profiler adds derived lines (XLA
    modules, XLA ops) that cover the same time, so lines are kept apart, never summed."""
    path = newest_trace(trace_dir)
    events = _events(path)
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


def per_step(trace_dir: str, steps_from: str, top: int = 25) -> dict:
    """Kernel time per loop step, grouped by launches per step (see the module docstring), and the
    `top` kernel instances by time a step. The instance names (gemm_fusion_dot_453) are unique within
    an XLA module, so an instance's count over the step count says where in the step it runs."""
    kind, _, per = steps_from.rpartition(":")
    if not kind or not per.isdigit() or int(per) < 1:
        raise SystemExit(f"--steps-from {steps_from!r}: want KIND:K, e.g. decode_attention:30 (K >= 1 kernels a step)")
    path = newest_trace(trace_dir)
    events = _events(path)
    kernels = [e for e in events if e.get("ph") == "X" and "dur" in e and e.get("args", {}).get("hlo_module")]
    if not kernels:
        raise SystemExit(f"{path}: no kernel events with an hlo_module (a GPU trace has them; a CPU trace does not)")
    module = collections.Counter(e["args"]["hlo_module"] for e in kernels).most_common(1)[0][0]
    kernels = [e for e in kernels if e["args"]["hlo_module"] == module]
    markers = sum(1 for e in kernels if _INSTANCE.sub("", e["name"]) == kind)
    if markers == 0 or markers % int(per):
        raise SystemExit(f"{path}: {markers} {kind!r} kernels in {module}, not a multiple of {per}: "
                         f"pick a kind that runs exactly K times a step")
    steps = markers // int(per)
    by = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by[e["name"]][0] += 1
        by[e["name"]][1] += float(e["dur"])
    groups = collections.defaultdict(lambda: {"instances": 0, "launches": 0, "us": 0.0, "kinds": collections.Counter()})
    for name, (count, us) in by.items():
        g = groups[round(count / steps, 1)]
        g["instances"] += 1
        g["launches"] += count
        g["us"] += us
        g["kinds"][_INSTANCE.sub("", name)] += count
    rows = [{"launches_per_step": m, "instances": g["instances"], "launches_a_step": g["launches"] / steps,
             "us_a_step": g["us"] / steps, "kinds": dict(g["kinds"].most_common(4))}
            for m, g in sorted(groups.items())]
    ranked = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    instances = [{"name": name, "launches_a_step": count / steps, "mean_us": us / count, "us_a_step": us / steps}
                 for name, (count, us) in ranked]
    return {"trace": path, "module": module, "steps": steps, "us_a_step": sum(r["us_a_step"] for r in rows),
            "groups": rows, "top_instances": instances}


def format_per_step(p: dict) -> str:
    lines = [f"trace: {p['trace']}", f"{p['module']}: {p['steps']} steps, {p['us_a_step']:.0f} us of kernels a step"]
    for r in p["groups"]:
        kinds = ", ".join(f"{k} {v}" for k, v in r["kinds"].items())
        lines.append(f"  x{r['launches_per_step']:<5} {r['instances']:4d} instances {r['launches_a_step']:7.1f} launches "
                     f"{r['us_a_step']:8.1f} us a step  ({kinds})"[:160])
    lines.append("kernel instances by time a step:")
    for r in p.get("top_instances", []):
        lines.append(f"  {r['name'][:48]:48s} {r['launches_a_step']:6.2f} a step x {r['mean_us']:7.2f} us = "
                     f"{r['us_a_step']:7.1f} us a step")
    return "\n".join(lines)


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
    ap.add_argument("--steps-from", default=None, metavar="KIND:K",
                    help="group kernel time per loop step by launches a step; steps = #KIND kernels / K")
    a = ap.parse_args(argv)
    if a.steps_from:
        s = per_step(a.trace_dir, a.steps_from, a.top)
        print(format_per_step(s))
        return write_results(s, a.out)
    s = summarize(a.trace_dir, a.top)
    print(format_summary(s))
    return write_results(s, a.out)


if __name__ == "__main__":
    sys.exit(main())

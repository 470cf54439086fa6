"""benchmarks/trace_ops.py on a real jax.profiler trace taken here: the traced computation's ops are
found with their counts, busy time never exceeds the span, shares add up, and a folder without a
trace is a clear error; per_step on a made-up GPU trace whose counts are known."""
import gzip
import json
import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import trace_ops  # noqa: E402


def test_summarize_a_cpu_trace(tmp_path):
    f = jax.jit(lambda x: jnp.sin(x @ x).sum())
    x = jnp.ones((128, 128))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            f(x).block_until_ready()
    s = trace_ops.summarize(str(tmp_path), top=1000)
    assert s["processes"], s
    for p in s["processes"]:
        assert 0.0 <= p["busy_ms"] <= p["span_ms"] + 1e-6 and 0.0 <= p["idle_share"] <= 1.0
        assert abs(sum(o["share_of_op_time"] for o in p["ops"]) - 1.0) < 1e-6
    # the three calls of the jitted function are on the host's python line (no device lines on a CPU)
    calls = [o for p in s["processes"] for o in p["ops"] if o["op"].startswith("PjitFunction(<lambda>)")]
    assert calls and calls[0]["count"] >= 3, calls
    assert "span" in trace_ops.format_summary(s)


def test_no_trace_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no \\*.trace.json.gz"):
        trace_ops.summarize(str(tmp_path))


def _kernel(name, ts, dur, module="jit_loop"):
    return {"ph": "X", "pid": 1, "tid": 7, "ts": ts, "dur": dur, "name": name, "args": {"hlo_module": module}}


def test_per_step_groups_kernel_instances_by_launches_a_step(tmp_path):
    """A made-up GPU trace of 3 steps of a 2-layer loop: attention_1 and gemm_2 run once per layer,
    draft_3 twice a step, accept_4 once a step, prefill_5 once in all, and a smaller module's kernel
    is left out. Each group's launches and time a step are what was put in."""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    ts = 0.0
    events.append(_kernel("prefill_5", ts, 30.0))
    for _ in range(3):
        for _layer in range(2):
            events += [_kernel("decode_attention_1", ts, 6.0), _kernel("gemm_fusion_dot_2", ts, 4.0)]
        events += [_kernel("draft_3", ts, 2.5), _kernel("draft_3", ts, 2.5), _kernel("accept_4", ts, 1.0)]
    events.append(_kernel("other_9", ts, 99.0, module="jit_small"))
    path = tmp_path / "t" / "x.trace.json.gz"
    path.parent.mkdir()
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    p = trace_ops.per_step(str(tmp_path), "decode_attention:2")
    assert p["module"] == "jit_loop" and p["steps"] == 3
    got = {g["launches_per_step"]: (g["instances"], g["launches_a_step"], g["us_a_step"]) for g in p["groups"]}
    assert got == {0.3: (1, 1 / 3, 10.0), 1.0: (1, 1.0, 1.0), 2.0: (3, 6.0, 25.0)}, got
    assert abs(p["us_a_step"] - 36.0) < 1e-9
    assert [(r["name"], r["launches_a_step"], r["mean_us"], r["us_a_step"]) for r in p["top_instances"]] == [
        ("decode_attention_1", 2.0, 6.0, 12.0), ("prefill_5", 1 / 3, 30.0, 10.0), ("gemm_fusion_dot_2", 2.0, 4.0, 8.0),
        ("draft_3", 2.0, 2.5, 5.0), ("accept_4", 1.0, 1.0, 1.0)]
    assert [r["name"] for r in trace_ops.per_step(str(tmp_path), "decode_attention:2", top=2)["top_instances"]] == [
        "decode_attention_1", "prefill_5"]
    assert "3 steps" in trace_ops.format_per_step(p)
    with pytest.raises(SystemExit, match="not a multiple of 4"):
        trace_ops.per_step(str(tmp_path), "decode_attention:4")
    with pytest.raises(SystemExit, match="want KIND:K"):
        trace_ops.per_step(str(tmp_path), "decode_attention")

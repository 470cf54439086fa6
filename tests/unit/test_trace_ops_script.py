"""benchmarks/trace_ops.py on a real jax.profiler trace taken here: the traced computation's ops are
found with their counts, busy time never exceeds the span, shares add up, and a folder without a
trace is a clear error."""
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

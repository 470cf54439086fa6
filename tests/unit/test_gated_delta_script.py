"""benchmarks/gated_delta.py's train rows (forward + backward of the gated delta rule and of SSD) run at a
toy shape on the CPU and give one positive timing per row."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
_spec = importlib.util.spec_from_file_location("gated_delta_bench", os.path.join(ROOT, "benchmarks", "gated_delta.py"))
gd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gd)


def test_train_rows_at_a_toy_shape():
    out: dict = {}
    gd.bench_train(gd.TINY, 1, 32, 3, 1, 16, out)
    ops = [(r["op"], r.get("precision"), r["chunk"]) for r in out["rows"]]
    assert ops == [("gated_delta_fwd_bwd", "highest", 16), ("gated_delta_fwd_bwd", "default", 16),
                   ("ssd_fwd_bwd", None, 64), ("ssd_fwd_bwd", None, 128)]
    assert all(r["ms"] > 0 and r["tok_per_s"] > 0 for r in out["rows"])

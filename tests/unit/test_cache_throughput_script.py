"""benchmarks/cache_throughput.py (issue 58's goals): a CPU smoke run at toy widths of both shapes must give
every row (online and the bf16, fp8 and top-k caches) with positive numbers, and remove its caches."""
import importlib.util
import json
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("cache_throughput", os.path.join(ROOT, "benchmarks", "cache_throughput.py"))
ct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ct)


def test_variant_names():
    assert ct.variant_names("bf16,fp8,topk", 64) == [("bf16", "bfloat16", 0), ("fp8", "float8_e4m3fn", 0),
                                                     ("topk64_fp8", "float8_e4m3fn", 64)]


def test_tiny_run_every_row_positive(tmp_path):
    out, work = tmp_path / "r.json", tmp_path / "work"
    assert ct.main(["--tiny", "--models", "llama3_8b,qwen3_30b_a3b", "--work-dir", str(work), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    lines = {(ln["model"], ln["variant"]): ln for ln in result["summary"]}
    assert set(lines) == {(m, v) for m in ("llama3_8b", "qwen3_30b_a3b")
                          for v in ("online", "bf16", "fp8", "topk64_fp8")}
    for (model, variant), ln in lines.items():
        assert ln["ok"], ln
        keys = ["tok_s", "plan_bytes"]
        if variant != "online":
            keys += ["ratio_vs_online", "step_only_tok_s", "bytes_per_token", "estimate_bytes_per_token",
                     "precompute_tok_s", "precompute_forward_tok_s"]
        for k in keys:
            assert ln[k] > 0 and math.isfinite(ln[k]), (model, variant, k, ln.get(k))
    for r in result["rows"]:
        if r.get("losses"):
            assert all(math.isfinite(x) for x in r["losses"]), r
    # the estimate: per token 4 int arrays (13 bytes) + the states; fp8 stores half the bf16 state bytes + scales
    est = {v: lines[("llama3_8b", v)]["estimate_bytes_per_token"] for v in ("bf16", "fp8")}
    assert est["bf16"] == 13 + 4 * 64 * 2 and est["fp8"] == 13 + 4 * (64 + 4)
    assert not work.exists()  # caches removed without --keep-caches

"""benchmarks/scaling.py runs end to end on the 8 fake CPU devices at tiny widths (the lead runs the
real thing on 2 H200s): both parts produce numbers, the JSON and the markdown table are written, the
sharded configs train the same first loss as one device, and context=2 fits a sequence that one
device (under the same small memory limit) does not."""
import importlib.util
import json
import os

import pytest


@pytest.fixture(scope="module")
def scaling(repo_root):
    spec = importlib.util.spec_from_file_location("scaling_bench", os.path.join(repo_root, "benchmarks", "scaling.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_run_writes_results(scaling, tmp_path):
    out = tmp_path / "res"
    # one timed step; (ii) tries 256 and 512 tokens under a limit between the two configs' plans
    assert scaling.main(["--tiny", "--out", str(out), "--steps", "1", "--ttt-steps", "1", "--search-start", "256",
                         "--search-max", "512", "--search-step", "256", "--mem-limit-gb", "0.015"]) == 0
    rep = json.loads((out / "scaling.json").read_text())
    md = (out / "scaling.md").read_text()
    thr = {r["config"]: r for r in rep["throughput"]}
    assert set(thr) == {"1 GPU", "2 GPUs data=2", "2 GPUs fsdp=2", "2 GPUs fsdp=2, target replicated"}
    for r in thr.values():
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / r["devices"])
        assert r["loss"] == pytest.approx(thr["1 GPU"]["loss"], rel=1e-4)  # the same run on every mesh
    assert thr["1 GPU"]["scaling_vs_1gpu"] == pytest.approx(1.0)
    seq = {r["context"]: r for r in rep["longest_sequence"]}
    assert seq[1]["longest_fitting_seq"] == 256 and seq[1]["first_failing_seq"] == 512
    assert seq[2]["longest_fitting_seq"] == 512  # half the activations per device
    assert "| 2 GPUs fsdp=2 |" in md and "Longest sequence" in md

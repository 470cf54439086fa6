"""Task accuracy of the arms (`python -m specjax.bench --accuracy humaneval|arithmetic`): pass@1 of
each server's replies on a task, and an equivalence test (TOST) between the two arms.

The tasks (`TASKS`), each giving its problems, the user turn of a problem and the check of a reply:

* humaneval: each HumanEval problem is sent as the humaneval preset's user turn (the whole function
  asked for in one ```python block), and every reply is checked by running the problem's tests in a
  sandboxed child process (`specjax.eval.task_accuracy`, `specjax.eval.sandbox`; never in this
  process). Before any request is sent, `run_accuracy` probes the sandbox: where this machine cannot
  isolate generated code it stops with `SandboxUnavailable` naming what is missing, unless
  `unsafe_exec` (--unsafe-exec) is set, which runs the programs with weaker isolation, logs a
  warning and records it in the results' `exec` section (`unsafe_exec`, `sandbox_unavailable`).
* arithmetic: seeded small-integer sums, differences and products ("What is 7 + 5? Reply with just
  the number."), each reply checked by extracting its number and comparing it to the answer
  (`specjax.eval.arithmetic_task`; nothing runs). A task a small target partly solves, for when
  HumanEval's pass@1 is 0 on both arms and there is nothing to test.

Every problem goes through `core.run_level` (no /metrics scrapes). Per temperature:

* temperature 0: one run per arm; the problem is the unit. pass@1 of each arm is a proportion;
  the TOST compares the two proportions with the unpooled binomial standard error and the normal
  distribution (`stats.tost_proportions`; the arms are taken as independent samples, which is
  conservative when the same problems are easy or hard for both). Also reported: how many problems
  each arm alone passed (discordant pairs) and how many replies were byte-identical.
* temperature > 0: `runs` runs per arm, the arms alternating which goes first; the run is the unit,
  because sampled replies differ from run to run. pass@1 of a run is its share of problems passed;
  the TOST is Welch's on the runs' pass@1 values (`stats.tost`).

Equivalence is declared when both one-sided p-values are below alpha, i.e. the (1 - 2 alpha)
interval of the difference (first arm - second arm) lies inside (-margin, +margin). With it the
smallest margin this sample supports (|diff| + q se) and the floor no observed difference could
get below (q se) are reported (`stats.equivalence_margins`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from specjax.bench import core
from specjax.bench.client import Endpoint
from specjax.bench.repeats import arm_order
from specjax.eval import arithmetic_task as at
from specjax.eval import stats
from specjax.eval import task_accuracy as ta

__all__ = ["TASKS", "problems_for", "default_max_tokens", "execution_isolation", "run_accuracy", "score_run",
           "compare_arms"]


@dataclass(frozen=True)
class _Task:
    """What a task provides: its problems (the first `limit`), the user turn of a problem, the
    verdict dicts of (problem, reply) pairs in order (a reply of None: the request failed; then the
    time limit, workers and unsafe_exec), the task's own per-run counts over the verdict rows, its
    default max_tokens, what is recorded about its scoring in the results (a dict merged into the
    accuracy section; (timeout_s, workers, unsafe_exec)), and whether it runs generated code."""
    load: Callable[[Optional[int]], list]
    user_turn: Callable[[Any], str]
    check: Callable[[Sequence, Sequence[Optional[str]], float, int, bool], list[dict]]
    counts: tuple[tuple[str, Callable[[dict], bool]], ...]
    max_tokens: int
    scoring: Callable[[float, int, bool], dict]
    runs_code: bool = False


def _humaneval_turn(p: ta.Problem) -> str:
    from specjax.data.presets import humaneval_user_turn  # the data stack: only here

    return humaneval_user_turn(p.prompt)


_TASKS = {
    "humaneval": _Task(
        load=ta.load_humaneval, user_turn=_humaneval_turn,
        check=lambda ps, rs, timeout_s, workers, unsafe_exec: [
            v.to_dict() for v in ta.check_replies(ps, rs, timeout_s=timeout_s, workers=workers,
                                                  unsafe_exec=unsafe_exec)],
        counts=(("no_code_block", lambda r: r["code_found"] in ("whole reply", "none")),
                ("timed_out", lambda r: r["result"].startswith("timed out"))),
        max_tokens=512,
        scoring=lambda timeout_s, workers, unsafe_exec: {
            "exec": dict(ta.isolation(unsafe_exec), timeout_s=timeout_s, workers=workers)},
        runs_code=True),
    "arithmetic": _Task(
        load=at.generate_problems, user_turn=at.ArithmeticProblem.user_turn,
        check=lambda ps, rs, timeout_s, workers, unsafe_exec: [v.to_dict() for v in at.check_replies(ps, rs)],
        counts=(("no_number", lambda r: r["how"] == "none"),),
        max_tokens=at.DEFAULT_MAX_TOKENS,
        scoring=lambda timeout_s, workers, unsafe_exec: {"scoring": at.describe()}),
}
TASKS = tuple(_TASKS)


def _task(task: str) -> _Task:
    if task not in _TASKS:
        raise ValueError(f"unknown accuracy task {task!r}; tasks: {', '.join(TASKS)}")
    return _TASKS[task]


def problems_for(task: str, limit: Optional[int] = None) -> list:
    """The first `limit` problems of a task (all when None)."""
    return _task(task).load(limit)


def default_max_tokens(task: str) -> int:
    """max_tokens of a task's requests when --accuracy-max-tokens is not given (humaneval 512: a whole
    function; arithmetic 32: one short line)."""
    return _task(task).max_tokens


def execution_isolation(task: str, unsafe_exec: bool = False, log: Callable[[str], None] = print) -> Optional[dict]:
    """For a task that runs generated code (humaneval): how it will be isolated (the results' `exec`
    section, without the time limit and workers), after a real probe of the sandbox. Raises
    `ta.SandboxUnavailable` (naming what is missing and --unsafe-exec) when the sandbox does not work
    and `unsafe_exec` is not set; with it, logs a warning and returns the weaker isolation. None for a
    task that runs nothing. Call it before any request (`run_accuracy` does)."""
    if not _task(task).runs_code:
        return None
    iso = ta.isolation(unsafe_exec)
    if iso.get("sandbox") is None:
        log(f"warning: --unsafe-exec: this machine cannot sandbox the generated code ({iso['sandbox_unavailable']}); "
            "it runs with weaker isolation: it can read and write your files, signal your processes and leave "
            "processes behind")
    return iso


def score_run(problems: Sequence, level_result: dict, *, timeout_s: float = ta.DEFAULT_TIMEOUT_S, workers: int = 2,
              task: str = "humaneval", unsafe_exec: bool = False) -> dict:
    """Check every reply of one run (a `run_level` result over the problems) and count."""
    tdef = _task(task)
    by_id = {r["job_id"]: r for r in level_result["requests"]}
    replies = [by_id[p.task_id]["text"] if p.task_id in by_id and by_id[p.task_id]["ok"] else None
               for p in problems]
    verdicts = tdef.check(problems, replies, timeout_s, workers, unsafe_exec)
    rows = []
    for p, v in zip(problems, verdicts):
        r = by_id.get(p.task_id) or {}
        rows.append(dict(v, finish_reason=r.get("finish_reason"), output_tokens=r.get("output_tokens"),
                         request_ok=bool(r.get("ok")), error=r.get("error"), text=r.get("text")))
    n = len(rows)
    passed = sum(r["passed"] for r in rows)
    out = {"n": n, "passed": passed, "pass_at_1": passed / n if n else math.nan,
           "failed_requests": sum(not r["request_ok"] for r in rows),
           "truncated": sum(r["finish_reason"] == "length" for r in rows)}
    for name, pred in tdef.counts:
        out[name] = sum(pred(r) for r in rows)
    out.update(wall_s=level_result["wall_s"], problems=rows)
    return out


def compare_arms(runs: dict[str, list[dict]], temperature: float, margin: float, alpha: float,
                 level: float = 0.95) -> dict:
    """pass@1 per arm and (two arms) the TOST of the first arm against the second; see the module
    docstring for the unit at each temperature."""
    arms = list(runs)
    out: dict = {"temperature": temperature, "unit": "problem" if temperature == 0 else "run",
                 "pass_at_1": {}, "tost": None, "tost_error": None, "margins": None, "margin": margin, "alpha": alpha}
    for arm in arms:
        rs = runs[arm]
        if temperature == 0:
            out["pass_at_1"][arm] = stats.proportion_estimate(rs[0]["passed"], rs[0]["n"], level).to_dict()
        else:
            e = stats.mean_estimate([r["pass_at_1"] for r in rs], level).to_dict()
            if e["lo"] == e["lo"]:  # a t interval of a share, clipped to the possible [0, 1]
                e["lo"], e["hi"] = max(e["lo"], 0.0), min(e["hi"], 1.0)
            out["pass_at_1"][arm] = e
    if len(arms) != 2:
        return out
    a, b = runs[arms[0]], runs[arms[1]]
    out["diff_of"] = [arms[0], arms[1]]
    try:
        if temperature == 0:
            res = stats.tost_proportions(a[0]["passed"], a[0]["n"], b[0]["passed"], b[0]["n"], margin, alpha)
            pa = {r["task_id"]: r for r in a[0]["problems"]}
            pb = {r["task_id"]: r for r in b[0]["problems"]}
            common = [k for k in pa if k in pb]
            out["paired_counts"] = {
                "both_passed": sum(pa[k]["passed"] and pb[k]["passed"] for k in common),
                f"only_{arms[0]}": sum(pa[k]["passed"] and not pb[k]["passed"] for k in common),
                f"only_{arms[1]}": sum(pb[k]["passed"] and not pa[k]["passed"] for k in common),
                "both_failed": sum(not pa[k]["passed"] and not pb[k]["passed"] for k in common),
                "identical_replies": sum(pa[k]["text"] is not None and pa[k]["text"] == pb[k]["text"] for k in common),
                "problems": len(common)}
        else:
            xa, xb = [r["pass_at_1"] for r in a], [r["pass_at_1"] for r in b]
            if len(set(xa)) == 1 and len(set(xb)) == 1:
                raise ValueError(f"no variation between runs in either arm ({xa} and {xb}): the standard error is 0 "
                                 "and equivalence cannot be tested; use more problems or runs (a server that ignores "
                                 "the temperature gives the same replies every run)")
            res = stats.tost(xa, xb, margin, alpha)
    except ValueError as e:
        out["tost_error"] = str(e)
        return out
    out["tost"] = res.to_dict()
    out["margins"] = stats.equivalence_margins(res.diff, res.se, res.df, alpha)
    return out


def run_accuracy(eps: dict[str, Endpoint], models: dict[str, str], problems: Sequence, *,
                 temperatures: Sequence[float], runs: int, concurrency: int, max_tokens: int, margin: float,
                 alpha: float, timeout_s: float = ta.DEFAULT_TIMEOUT_S, workers: int = 2,
                 system: Optional[str] = None, extra_body: Optional[dict] = None,
                 request_timeout: Optional[float] = None,
                 level: float = 0.95, task: str = "humaneval",
                 log: Callable[[str], None] = print, unsafe_exec: bool = False) -> dict:
    """Generate and check the problems on every arm at every temperature (one run at temperature 0,
    `runs` runs above it) and compare the arms. Returns the `accuracy` section of results.json.
    A task that runs generated code probes the sandbox first, before any request (see the module
    docstring and `execution_isolation`)."""
    if not problems:
        raise ValueError("no problems to evaluate")
    if any(t < 0 for t in temperatures):
        raise ValueError(f"temperatures must be >= 0, got {list(temperatures)}")
    if runs < 2 and any(t > 0 for t in temperatures) and len(eps) == 2:
        raise ValueError(f"--accuracy-runs {runs}: the TOST at temperature > 0 takes the run as the unit and needs "
                         "at least 2 runs per arm (the Nemotron card used about 20)")
    tdef = _task(task)
    execution_isolation(task, unsafe_exec, log)  # refuses (or warns) before any request
    jobs = [core.BenchJob(p.task_id, task, (tdef.user_turn(p),)) for p in problems]
    out: dict = {"task": task, "problems": len(problems), "margin": margin, "alpha": alpha,
                 **tdef.scoring(timeout_s, workers, unsafe_exec), "concurrency": concurrency,
                 "max_tokens": max_tokens, "temperatures": []}
    for t in temperatures:
        n_runs = 1 if t == 0 else runs
        per_arm: dict[str, list[dict]] = {arm: [] for arm in eps}
        for r in range(n_runs):
            for arm in arm_order(list(eps), r):
                res = core.run_level(eps[arm], models[arm], jobs, concurrency, max_tokens=max_tokens,
                                     temperature=t, system=system, extra_body=extra_body, scrape="none",
                                     request_timeout=request_timeout)
                sc = score_run(problems, res, timeout_s=timeout_s, workers=workers, task=task,
                               unsafe_exec=unsafe_exec)
                sc.update(run=r, arm=arm, temperature=t)
                per_arm[arm].append(sc)
                log(f"accuracy {task} T={t:g} run {r + 1}/{n_runs} {arm}: pass@1 {sc['passed']}/{sc['n']} = "
                    f"{sc['pass_at_1']:.3f} ({sc['failed_requests']} failed requests, {sc['truncated']} cut at "
                    f"max_tokens)")
        entry = compare_arms(per_arm, t, margin, alpha, level)
        entry["runs"] = per_arm
        out["temperatures"].append(entry)
    return out

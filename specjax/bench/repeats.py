"""Repeated windows (`python -m specjax.bench --repeats N`): both arms measured in the same N windows
of one server session each.

A window is one pass over the concurrency ladder on every arm: for each level, each arm runs the
prompt set once (`core.run_level`). The arms take turns going first (window 0 in the order given,
window 1 reversed, and so on), so a drift of the machine over the session does not always favour the
same arm. Every request record gets a `window` field.

Per concurrency level and arm the window is the unit: its aggregate output tok/s (output tokens /
time with a request in flight) and, with spec-decode counters, its tau (1 + accepted / drafts of the
window's counters) are one value each. Reported over the N windows:

* per arm: the mean with a t interval (df = N - 1);
* the ratio of the two arms' means (first arm / second arm) with the two-sample delta-method
  interval and Welch-Satterthwaite df (`stats.ratio_of_means`, as the Nemotron 3.5 card's
  "two-sample delta-method intervals"), and beside it the interval paired by window (the ratio
  estimator with windows as clusters), which is narrower when the windows share a drift;
* the per-window ratios, for the plot.

These intervals describe variation between windows within one start of each server. They do not
cover variation between server starts (boot to boot: compilation, memory layout, kernel choice),
other machines or other engine versions; `CAVEATS` says so in the report."""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

from specjax.bench import core
from specjax.bench.client import Endpoint
from specjax.eval import stats

__all__ = ["arm_order", "run_windows", "pool_levels", "summarize_windows", "CAVEATS"]

CAVEATS = (
    "The intervals over windows describe variation between windows within one session (one start) of each "
    "server. They do not cover boot-to-boot variation (a restarted server may compile, lay out memory and "
    "pick kernels differently), other machines, other engine versions or other prompt sets.",
    "The same prompts are sent in every window: a server with prefix caching serves later windows' prompts "
    "from its cache (both arms alike), so TTFT in later windows is not that of new prompts.",
)


def arm_order(arms: Sequence[str], window: int) -> list[str]:
    """The arms in the order they run in `window`: as given in even windows, reversed in odd ones."""
    arms = list(arms)
    return arms if window % 2 == 0 else arms[::-1]


def run_windows(eps: dict[str, Endpoint], models: dict[str, str], jobs: Sequence[core.BenchJob],
                concurrency: Sequence[int], repeats: int, *, level_kwargs: dict, confidence: float = 0.95,
                progress: Optional[Callable[[str], tuple]] = None,
                log: Callable[[str], None] = print,
                on_level: Optional[Callable[[list[dict]], None]] = None) -> list[dict]:
    """Run `repeats` windows (see the module docstring). `progress(desc)` returns (bar, callback) or
    (None, None). `on_level(windows)` is called after every level of every arm with the windows so
    far (the last one possibly unfinished), so that the caller can save what is measured. Returns
    one dict per window: {"index", "order", "levels": {arm: [run_level results, one per
    concurrency, each with "window" and "summary"]}}."""
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if not eps:
        raise ValueError("run_windows needs at least one arm")
    windows: list[dict] = []
    for w in range(repeats):
        order = arm_order(list(eps), w)
        win = {"index": w, "order": order, "levels": {arm: [] for arm in eps}}
        windows.append(win)
        for c in concurrency:
            for arm in order:
                bar, update = progress(f"window {w + 1}/{repeats} {arm} c={c}") if progress else (None, None)
                try:
                    res = core.run_level(eps[arm], models[arm], jobs, c, progress=update, **level_kwargs)
                finally:
                    if bar is not None:
                        bar.close()
                for r in res["requests"]:
                    r["window"] = w
                res["window"] = w
                res["summary"] = core.summarize_level(res, confidence)
                win["levels"][arm].append(res)
                s = res["summary"]
                why = s.get("acceptance_unavailable")
                why = f"; acceptance unavailable: {why}" if why else ""
                log(f"window {w + 1}/{repeats} {arm} c={c}: {s['ok']}/{s['requests']} ok, "
                    f"{s['output_tok_s']:.1f} tok/s{why}")
                if on_level is not None:
                    on_level(windows)
    return windows


def _sum_counters(totals: Sequence[dict]) -> dict:
    k = max(len(t.get("accepted_per_pos") or []) for t in totals)
    out = dict(totals[-1])
    for key in ("drafts", "draft_tokens", "accepted"):
        out[key] = float(sum(t.get(key) or 0.0 for t in totals))
    out["accepted_per_pos"] = [float(sum((list(t.get("accepted_per_pos") or []) + [0.0] * k)[i] for t in totals))
                               for i in range(k)]
    return out


def pool_levels(levels: Sequence[dict]) -> dict:
    """One level result from the same level of several windows: the requests of all of them (their
    `window` field tells them apart), wall / busy / scrape time summed, the spec-decode counters summed
    and their scrape windows concatenated. When a window's acceptance was unavailable the pooled
    level has none either, and `unavailable_reason` names the windows and why."""
    if not levels:
        raise ValueError("pool_levels needs at least one level result")
    cs = {lv["concurrency"] for lv in levels}
    if len(cs) != 1:
        raise ValueError(f"pool_levels: the levels have different concurrency {sorted(cs)}")
    specs = [lv.get("spec") or {} for lv in levels]
    reasons = [f"window {lv.get('window', i)}: {s['unavailable_reason']}"
               for i, (lv, s) in enumerate(zip(levels, specs)) if s.get("unavailable_reason")]
    spec: dict = {"engine": next((s.get("engine") for s in specs if s.get("engine")), None),
                  "available": all(s.get("available") for s in specs), "total": None, "windows": [],
                  "unavailable_reason": "; ".join(reasons)[:2000] if reasons else None}
    if spec["available"]:
        spec["total"] = _sum_counters([s["total"] for s in specs])
        spec["windows"] = [w for s in specs for w in s.get("windows") or []]
    return {"concurrency": cs.pop(), "wall_s": float(sum(lv["wall_s"] for lv in levels)),
            "busy_s": float(sum(lv.get("busy_s") or lv["wall_s"] for lv in levels)),
            "scrape_s": float(sum(lv.get("scrape_s") or 0.0 for lv in levels)),
            "requests": [r for lv in levels for r in lv["requests"]], "spec": spec,
            "scrape_errors": [e for lv in levels for e in lv.get("scrape_errors") or []][:20],
            "windows": len(levels)}


def _window_tau(level_result: dict) -> Optional[float]:
    spec = level_result.get("spec") or {}
    total = spec.get("total")
    if not spec.get("available") or not total or spec.get("engine") != "vllm" or not total.get("drafts"):
        return None
    return 1.0 + total["accepted"] / total["drafts"]


def summarize_windows(windows: Sequence[dict], level: float = 0.95) -> list[dict]:
    """Per concurrency level: each arm's per-window aggregate tok/s and tau with their means and
    intervals over windows, and (two arms) the ratio of the first arm to the second with its
    two-sample and paired delta-method intervals and the per-window ratios."""
    if not windows:
        return []
    arms = list(windows[0]["levels"])
    out = []
    for i, lv0 in enumerate(windows[0]["levels"][arms[0]]):
        c = lv0["concurrency"]
        entry: dict = {"concurrency": c, "windows": len(windows), "arms": {}, "unit": "window"}
        for arm in arms:
            lvs = [w["levels"][arm][i] for w in windows]
            tok_s = [lv["summary"]["output_tok_s"] for lv in lvs]
            taus = [_window_tau(lv) for lv in lvs]
            failed = int(sum(lv["summary"]["failed"] for lv in lvs))
            finite = [x for x in tok_s if x is not None and math.isfinite(x)]
            a: dict = {"output_tok_s": tok_s, "output_tok_s_mean": stats.mean_estimate(finite, level).to_dict(),
                       "failed_requests": failed, "tau": taus, "tau_mean": None}
            if all(t is not None for t in taus):
                a["tau_mean"] = stats.mean_estimate(taus, level).to_dict()
            entry["arms"][arm] = a
        if len(arms) == 2:
            xa, xb = entry["arms"][arms[0]]["output_tok_s"], entry["arms"][arms[1]]["output_tok_s"]
            pairs = [(x, y) for x, y in zip(xa, xb) if x is not None and y is not None and math.isfinite(x)
                     and math.isfinite(y) and y > 0]
            entry["ratio_of"] = [arms[0], arms[1]]
            entry["window_ratios"] = [x / y for x, y in pairs]
            entry["ratio"] = entry["ratio_paired"] = None
            if pairs:
                a_, b_ = [p[0] for p in pairs], [p[1] for p in pairs]
                entry["ratio"] = stats.ratio_of_means(a_, b_, level).to_dict()
                entry["ratio_paired"] = stats.ratio_of_means(a_, b_, level, paired=True).to_dict()
        out.append(entry)
    return out

"""Outputs of a benchmark: the markdown tables, results.json and the PNG plots.

Plots need matplotlib (the `bench` extra); without it `write_plots` says so in one line and
writes none. Nothing here raises on a missing optional piece: a plot that fails is reported and
skipped."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Callable, Optional

__all__ = ["format_estimate", "format_markdown", "write_results", "write_plots", "json_safe"]

ARMS = ("spec", "baseline")


def _num(x: Optional[float], fmt: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, fmt)


def format_estimate(e: Optional[dict], fmt: str = ".3f", scale: float = 1.0) -> str:
    """'v [lo, hi]' of an Estimate dict; an unbounded side prints as '–'; no interval: 'v'."""
    if not e or e.get("value") is None or not math.isfinite(e["value"]):
        return "–"
    v = format(e["value"] * scale, fmt)
    lo, hi = e.get("lo"), e.get("hi")
    lo_ok = lo is not None and math.isfinite(lo)
    hi_ok = hi is not None and math.isfinite(hi)
    if not lo_ok and not hi_ok:
        return v
    return f"{v} [{_num(lo * scale if lo_ok else None, fmt)}, {_num(hi * scale if hi_ok else None, fmt)}]"


def format_markdown(results: dict) -> str:
    """Three tables (throughput and speedup, latency, acceptance) from a results dict."""
    arms = [a for a in ARMS if a in results.get("arms", {})]
    level = results.get("config", {}).get("confidence", 0.95)
    pct = f"{100 * level:.0f}%"
    lines = [f"Intervals: {pct}. Units: latency and per-request tok/s: the request; aggregate tok/s: the level "
             "(no interval); acceptance: scrape windows between request completions (= requests at concurrency 1).", ""]
    speed = {s["concurrency"]: s for s in results.get("speedup", [])}
    lines += ["| arm | conc | requests (failed) | output tokens | tok/s (aggregate) | tok/s per request | "
              "speedup (per request) | speedup (aggregate) |",
              "|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        for lv in results["arms"][arm]["levels"]:
            s = lv["summary"]
            sp = speed.get(s["concurrency"]) if arm == "spec" else None
            lines.append("| {} | {} | {} ({}) | {} | {} | {} | {} | {} |".format(
                arm, s["concurrency"], s["requests"], s["failed"], s["output_tokens"], _num(s["output_tok_s"], ".1f"),
                format_estimate(s["request_output_tok_s"], ".1f"),
                format_estimate(sp["request_tok_s_ratio"], ".3f") if sp else "",
                _num(sp["output_tok_s_ratio"], ".3f") if sp else ""))
    lines += ["", "| arm | conc | TTFT mean ms | TTFT p50 | TTFT p90 | TTFT p99 | ITL mean ms | ITL p50 | ITL p90 | "
              "ITL p99 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in arms:
        for lv in results["arms"][arm]["levels"]:
            s = lv["summary"]
            cells = [format_estimate(s[m][k], ".1f", 1e3) for m in ("ttft_s", "itl_s") for k in ("mean", "p50", "p90", "p99")]
            lines.append(f"| {arm} | {s['concurrency']} | " + " | ".join(cells) + " |")
    acc_rows = []
    for arm in arms:
        for lv in results["arms"][arm]["levels"]:
            a = lv["summary"].get("acceptance")
            if not a:
                continue
            if a.get("engine") == "sglang":
                acc_rows.append(f"| {arm} | {lv['summary']['concurrency']} | – | {_num(a['tau']['value'], '.3f')} "
                                "(SGLang gauge) | – | – |")
                continue
            per = a.get("per_position") or {}
            unc = ", ".join(format_estimate(e, ".3f") for e in per.get("unconditional", [])) or "–"
            cond = ", ".join(format_estimate(e, ".3f") for e in per.get("conditional", [])) or "–"
            acc_rows.append(f"| {arm} | {lv['summary']['concurrency']} | {int(a['drafts'])} | "
                            f"{format_estimate(a.get('tau'), '.3f')} | {unc} | {cond} |")
    if acc_rows:
        lines += ["", "| arm | conc | drafts | tau = 1 + accepted/drafts | acceptance by position | "
                  "conditional on the previous |", "|---|---|---|---|---|---|"] + acc_rows
    return "\n".join(lines) + "\n"


def json_safe(x: Any) -> Any:
    """nan/inf -> None (strict JSON), tuples -> lists, recursively."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return json_safe(x.item())
    return x


def write_results(results: dict, out_dir: str, log: Callable[[str], None] = print, plots: bool = True) -> list[str]:
    """results.json, results.md and (with matplotlib) the plots into out_dir; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    p = os.path.join(out_dir, "results.json")
    with open(p + ".tmp", "w") as f:
        json.dump(json_safe(results), f, indent=1, allow_nan=False)
    os.replace(p + ".tmp", p)
    paths.append(p)
    p = os.path.join(out_dir, "results.md")
    with open(p, "w") as f:
        f.write(format_markdown(results))
    paths.append(p)
    if plots:
        paths += write_plots(results, out_dir, log)
    return paths


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _err(e: dict) -> tuple[float, float, float]:
    v = e.get("value")
    lo, hi = e.get("lo"), e.get("hi")
    v = math.nan if v is None else v
    lo_d = v - lo if lo is not None and math.isfinite(lo) else 0.0
    hi_d = hi - v if hi is not None and math.isfinite(hi) else 0.0
    return v, max(lo_d, 0.0), max(hi_d, 0.0)


def write_plots(results: dict, out_dir: str, log: Callable[[str], None] = print) -> list[str]:
    """acceptance_by_position.png (spec arm, one bar group per concurrency) and
    tok_s_vs_concurrency.png (aggregate and per-request tok/s of each arm). Returns the paths."""
    plt = _matplotlib()
    if plt is None:
        log("matplotlib is not installed (pip install matplotlib, or specjax[bench]): plots skipped")
        return []
    paths = []
    arms = results.get("arms", {})
    try:
        levels = [lv for lv in arms.get("spec", {}).get("levels", [])
                  if (lv["summary"].get("acceptance") or {}).get("per_position")]
        if levels:
            fig, ax = plt.subplots(figsize=(6, 4))
            k = max(len(lv["summary"]["acceptance"]["per_position"]["unconditional"]) for lv in levels)
            width = 0.8 / len(levels)
            for j, lv in enumerate(levels):
                ests = lv["summary"]["acceptance"]["per_position"]["unconditional"]
                vals = [_err(e) for e in ests]
                xs = [i + (j - (len(levels) - 1) / 2) * width for i in range(len(ests))]
                ax.bar(xs, [v[0] for v in vals], width, yerr=[[v[1] for v in vals], [v[2] for v in vals]],
                       capsize=3, label=f"concurrency {lv['summary']['concurrency']}")
            ax.set_xticks(range(k))
            ax.set_xlabel("draft position")
            ax.set_ylabel("accepted_i / drafts")
            ax.set_ylim(0, 1)
            ax.set_title("Acceptance by position")
            ax.legend()
            fig.tight_layout()
            p = os.path.join(out_dir, "acceptance_by_position.png")
            fig.savefig(p, dpi=100)
            plt.close(fig)
            paths.append(p)
        if arms:
            fig, ax = plt.subplots(figsize=(6, 4))
            for arm in ARMS:
                if arm not in arms:
                    continue
                lvs = [lv["summary"] for lv in arms[arm]["levels"]]
                cs = [s["concurrency"] for s in lvs]
                ax.plot(cs, [s["output_tok_s"] for s in lvs], marker="o", label=f"{arm}: aggregate")
                vals = [_err(s["request_output_tok_s"]) for s in lvs]
                ax.errorbar(cs, [v[0] for v in vals], yerr=[[v[1] for v in vals], [v[2] for v in vals]],
                            marker="s", linestyle="--", capsize=3, label=f"{arm}: per request (mean)")
            levels_c = sorted({s["concurrency"] for a in arms.values() for s in (lv["summary"] for lv in a["levels"])})
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels_c)
            ax.set_xticklabels([str(c) for c in levels_c])
            ax.minorticks_off()
            ax.set_xlabel("concurrency")
            ax.set_ylabel("output tokens / s")
            ax.set_title("Output tokens/s vs concurrency")
            ax.legend()
            fig.tight_layout()
            p = os.path.join(out_dir, "tok_s_vs_concurrency.png")
            fig.savefig(p, dpi=100)
            plt.close(fig)
            paths.append(p)
    except Exception as e:  # a plot must never cost the results
        log(f"plotting failed ({type(e).__name__}: {e}); results.json and results.md are written")
    return paths

"""Outputs of a benchmark: the markdown tables, results.json and the PNG plots.

Plots need matplotlib (the `bench` extra); without it `write_plots` says so in one line and
writes none. Nothing here raises on a missing optional piece: a plot that fails is reported and
skipped. results.json and results.md are each written to a temporary file that is then renamed over
the old one, so a reader (or a run killed while writing) sees the previous complete file or the
new one, never half of one. Results of a run that did not finish (`status` other than "complete")
open their markdown with what they hold; a level whose acceptance could not be measured shows the
reason in the acceptance table."""
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
    """The report: a setup section (command, versions, servers and their flags) when the results
    carry the command, three tables (throughput and speedup, latency, acceptance), then the repeated
    windows and the task accuracy with its equivalence test when they were measured, and what the
    intervals do not cover."""
    lines = []
    status = results.get("status", "complete")
    if status != "complete":
        done = sum(len(a.get("levels", [])) for a in results.get("arms", {}).values())
        how = ("saved while it ran; if it runs no more, it ended before finishing" if status == "running"
               else status)
        lines += [f"**Incomplete run** ({how}): {done} finished level(s) below; the rest was not measured.", ""]
    if results.get("command"):
        lines += _setup_section(results) + ["## Throughput, latency and acceptance", ""]
    lines += _tables(results)
    if results.get("repeats"):
        lines += [""] + _repeats_section(results)
    if results.get("accuracy"):
        lines += [""] + _accuracy_section(results)
    if results.get("repeats") or results.get("accuracy"):
        lines += [""] + _limits_section(results)
    return "\n".join(lines) + "\n"


def _label(results: dict, arm: str) -> str:
    return (results.get("labels") or {}).get(arm, arm)


def _setup_section(results: dict) -> list[str]:
    cfg = results.get("config", {})
    lines = ["# Serving evaluation (specjax.bench)", "", "## Setup", "",
             f"Created {results.get('created', '–')}. The exact command:", "", "```", results["command"], "```", ""]
    for arm, srv in (results.get("servers") or {}).items():
        lines.append(f"* arm `{arm}` ({_label(results, arm)}): {srv.get('url')}, model `{srv.get('model')}`, "
                     f"engine {srv.get('engine') or 'unknown'} {srv.get('version') or '(no /version)'}, "
                     f"spec-decode metrics: {'yes' if srv.get('spec_metrics') else 'no'}")
        flags = srv.get("flags")
        lines.append(f"  * server flags: `{flags}`" if flags else
                     "  * server flags: not recorded (pass --server-flags / --baseline-server-flags)")
    vers = results.get("versions") or {}
    lines.append("* client versions: " + ", ".join(f"{k} {v}" for k, v in vers.items() if v))
    pr = results.get("prompts") or {}
    lines.append(f"* prompts: {', '.join(pr.get('sets', []))} ({pr.get('count', '–')} prompts); endpoint "
                 f"{cfg.get('endpoint')}, max_tokens {cfg.get('max_tokens')}, temperature {cfg.get('temperature')}, "
                 f"concurrency {cfg.get('concurrency')}, windows {cfg.get('repeats') or 1}")
    return lines + [""]


def _repeats_section(results: dict) -> list[str]:
    rp = results["repeats"]
    level = results.get("config", {}).get("confidence", 0.95)
    pct = f"{100 * level:.0f}%"
    n = rp["windows"]
    lines = [f"## Repeated windows ({n} windows, one server session per arm)", "",
             f"Each window runs every concurrency level on every arm, the arms alternating which goes first. Unit: "
             f"the window (its aggregate output tok/s and its tau). Means with {pct} t intervals over the {n} windows; "
             "the ratio of the means with the two-sample delta-method interval (Welch df), and paired by window. "
             "The tables above pool the requests of all windows.", "",
             "| conc | arm | tok/s mean | tau mean | failed requests |", "|---|---|---|---|---|"]
    for e in rp["levels"]:
        for arm, a in e["arms"].items():
            lines.append(f"| {e['concurrency']} | {_label(results, arm)} | "
                         f"{format_estimate(a['output_tok_s_mean'], '.2f')} | {format_estimate(a.get('tau_mean'), '.3f')} | "
                         f"{a['failed_requests']} |")
    rows = [e for e in rp["levels"] if e.get("ratio_of")]
    if rows:
        a, b = rows[0]["ratio_of"]
        lines += ["", f"| conc | tok/s ratio {_label(results, a)} / {_label(results, b)} (two-sample) | paired by window | "
                      "per-window ratios, min – max |", "|---|---|---|---|"]
        for e in rows:
            wr = e.get("window_ratios") or []
            rng = f"{min(wr):.3f} – {max(wr):.3f}" if wr else "–"
            lines.append(f"| {e['concurrency']} | {format_estimate(e.get('ratio'), '.3f')} | "
                         f"{format_estimate(e.get('ratio_paired'), '.3f')} | {rng} |")
    return lines


def _accuracy_section(results: dict) -> list[str]:
    acc = results["accuracy"]
    level = results.get("config", {}).get("confidence", 0.95)
    pct = f"{100 * level:.0f}%"
    if acc.get("scoring"):  # a task scored by reading the reply (arithmetic)
        sc = acc["scoring"]
        lines = [f"## Task accuracy: {acc['task']} pass@1, answer extracted from the reply", "",
                 f"{acc['problems']} problems, concurrency {acc['concurrency']}, max_tokens {acc['max_tokens']}. "
                 f"Problems (seed {sc.get('seed')}): {sc.get('generator')} Scoring: {sc.get('rule')}. Nothing is "
                 f"executed. pass@1 with {pct} intervals (temperature 0: over problems; above 0: over runs).", ""]
        counts = (("no_number", "no number"),)
    else:  # humaneval: executed
        ex = acc.get("exec") or {}
        lines = [f"## Task accuracy: {acc['task']} pass@1, executed", "",
                 f"{acc['problems']} problems, concurrency {acc['concurrency']}, max_tokens {acc['max_tokens']}. Each "
                 f"reply's code (its ```python block) runs with the problem's tests in a child process: "
                 f"`{ex.get('python')} {ex.get('flags')}`, time limit {ex.get('timeout_s')} s, {ex.get('network')}; "
                 f"{ex.get('limits')}. pass@1 with {pct} intervals (temperature 0: over problems; above 0: over runs).",
                 ""]
        counts = (("no_code_block", "no code block"), ("timed_out", "timed out"))
    lines += ["| temperature | unit | arm | runs | pass@1 | failed requests | cut at max_tokens | " +
              "".join(f"{h} | " for _, h in counts).rstrip(), "|---|---|---|---|---|---|---|" + "---|" * len(counts)]
    for t in acc["temperatures"]:
        for arm, rs in t["runs"].items():
            lines.append(f"| {t['temperature']:g} | {t['unit']} | {_label(results, arm)} | {len(rs)} | "
                         f"{format_estimate(t['pass_at_1'].get(arm), '.4f')} | "
                         f"{sum(r['failed_requests'] for r in rs)} | {sum(r['truncated'] for r in rs)} | " +
                         "".join(f"{sum(r[k] for r in rs)} | " for k, _ in counts).rstrip())
    eq = [t for t in acc["temperatures"] if t.get("diff_of")]
    if eq:
        lines += ["", "### Equivalence (two one-sided tests)", ""]
    for t in eq:
        a, b = (_label(results, x) for x in t["diff_of"])
        n = t["pass_at_1"][t["diff_of"][0]].get("n")
        unit = f"n = {n} problems per arm" if t["unit"] == "problem" else f"n = {n} runs per arm"
        head = f"* temperature {t['temperature']:g} ({t['unit']} as the unit, {unit}):"
        if t.get("tost") is None:
            lines.append(f"{head} no test: {t.get('tost_error')}")
            continue
        r, m = t["tost"], t["margins"]
        conf = f"{100 * (1 - 2 * r['alpha']):.0f}%"
        verdict = (f"equivalent within ±{t['margin']:g}: both one-sided tests reject at p < {r['alpha']:g}"
                   if r["equivalent"] else f"not shown equivalent within ±{t['margin']:g} at alpha {r['alpha']:g}")
        lines.append(f"{head} pass@1 {a} − {b} = {r['diff']:+.4f}, se {r['se']:.4f}, {conf} interval "
                     f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]; p_low = {r['p_low']:.3g}, p_high = {r['p_high']:.3g}: "
                     f"{verdict}. The smallest margin this difference supports is ±{m['smallest_margin']:.3f}; "
                     f"at this sample size no margin below ±{m['margin_floor']:.3f} is demonstrable however small "
                     "the true difference.")
        pc = t.get("paired_counts")
        if pc:
            only = [k for k in pc if k.startswith("only_")]
            lines.append(f"  * per problem: both passed {pc['both_passed']}, " +
                         ", ".join(f"only {_label(results, k[5:])} {pc[k]}" for k in only) +
                         f", both failed {pc['both_failed']}; byte-identical replies {pc['identical_replies']} of "
                         f"{pc['problems']} (byte identity is not the test: a serving stack need not be "
                         "deterministic or batch-invariant, with or without speculation)")
    return lines


def _limits_section(results: dict) -> list[str]:
    lines = ["## What this evidence does not cover", ""]
    for c in (results.get("repeats") or {}).get("caveats") or []:
        lines.append(f"* {c}")
    if results.get("accuracy"):
        lines.append("* Task accuracy is measured on one task and the problems listed; equivalence on it says "
                     "nothing about other tasks or domains.")
        lines.append("* The proportion test at temperature 0 uses the normal approximation and treats the arms as "
                     "independent samples; with few problems or pass@1 near 0 or 1 it is approximate.")
        if results["accuracy"].get("scoring"):
            lines.append("* The arithmetic task is synthetic: it checks that the arms answer alike on a task the "
                         "target partly solves, not what the model can do; its answer extraction reads a number "
                         "from free text and can misread a reply (the same rule on both arms).")
    return lines


def _tables(results: dict) -> list[str]:
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
            why = lv["summary"].get("acceptance_unavailable")
            if not a and why:
                cell = str(why).replace("|", "/").replace("\n", " ")[:300]
                acc_rows.append(f"| {arm} | {lv['summary']['concurrency']} | – | unavailable: {cell} | – | – |")
                continue
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
    return lines


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
    paths = [_write_atomic(os.path.join(out_dir, "results.json"),
                           lambda f: json.dump(json_safe(results), f, indent=1, allow_nan=False)),
             _write_atomic(os.path.join(out_dir, "results.md"), lambda f: f.write(format_markdown(results)))]
    if plots:
        paths += write_plots(results, out_dir, log)
    return paths


def _write_atomic(path: str, write: Callable) -> str:
    """`write(file)` into path.tmp, flushed to disk, then renamed over `path`."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


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
    """acceptance_by_position.png (every arm with per-position counters, one bar group per
    concurrency), tok_s_vs_concurrency.png (aggregate and per-request tok/s of each arm; with
    repeated windows also the mean over windows with its interval) and, with repeated windows and
    two arms, window_ratios.png (the tok/s ratio of every window per concurrency, with the
    delta-method interval of the ratio of means as a band). Returns the paths."""
    plt = _matplotlib()
    if plt is None:
        log("matplotlib is not installed (pip install matplotlib; a dependency of specjax): plots skipped")
        return []
    paths = []

    def save(fig, ax, name):
        ax.legend()
        fig.tight_layout()
        paths.append(os.path.join(out_dir, name))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    arms = results.get("arms", {})
    try:
        levels = [(arm, lv) for arm in ARMS for lv in arms.get(arm, {}).get("levels", [])
                  if (lv["summary"].get("acceptance") or {}).get("per_position")]
        several = len({arm for arm, _ in levels}) > 1
        if levels:
            fig, ax = plt.subplots(figsize=(6, 4))
            k = max(len(lv["summary"]["acceptance"]["per_position"]["unconditional"]) for _, lv in levels)
            width = 0.8 / len(levels)
            for j, (arm, lv) in enumerate(levels):
                ests = lv["summary"]["acceptance"]["per_position"]["unconditional"]
                vals = [_err(e) for e in ests]
                xs = [i + (j - (len(levels) - 1) / 2) * width for i in range(len(ests))]
                ax.bar(xs, [v[0] for v in vals], width, yerr=[[v[1] for v in vals], [v[2] for v in vals]],
                       capsize=3, label=(f"{(results.get('labels') or {}).get(arm, arm)} " if several else "") +
                       f"concurrency {lv['summary']['concurrency']}")
            ax.set_xticks(range(k))
            ax.set_xlabel("draft position")
            ax.set_ylabel("accepted_i / drafts")
            ax.set_ylim(0, 1)
            ax.set_title("Acceptance by position")
            save(fig, ax, "acceptance_by_position.png")
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
                rp = (results.get("repeats") or {}).get("levels") or []
                wm = [(e["concurrency"], _err(e["arms"][arm]["output_tok_s_mean"])) for e in rp if arm in e["arms"]]
                if wm:
                    ax.errorbar([c for c, _ in wm], [v[0] for _, v in wm],
                                yerr=[[v[1] for _, v in wm], [v[2] for _, v in wm]], marker="D", linestyle=":",
                                capsize=3, label=f"{arm}: mean over {results['repeats']['windows']} windows")
            levels_c = sorted({s["concurrency"] for a in arms.values() for s in (lv["summary"] for lv in a["levels"])})
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels_c)
            ax.set_xticklabels([str(c) for c in levels_c])
            ax.minorticks_off()
            ax.set_xlabel("concurrency")
            ax.set_ylabel("output tokens / s")
            ax.set_title("Output tokens/s vs concurrency")
            save(fig, ax, "tok_s_vs_concurrency.png")
        rows = [e for e in (results.get("repeats") or {}).get("levels") or [] if e.get("window_ratios")]
        if rows:
            fig, ax = plt.subplots(figsize=(6, 4))
            for e in rows:
                xs = list(range(1, len(e["window_ratios"]) + 1))
                line, = ax.plot(xs, e["window_ratios"], marker="o", label=f"concurrency {e['concurrency']}")
                r = e.get("ratio") or {}
                if r.get("lo") is not None and r.get("hi") is not None and math.isfinite(r["lo"]):
                    ax.axhspan(r["lo"], r["hi"], color=line.get_color(), alpha=0.15)
                if r.get("value") is not None:
                    ax.axhline(r["value"], color=line.get_color(), linestyle="--", linewidth=1)
            a, b = ((results.get("labels") or {}).get(x, x) for x in rows[0]["ratio_of"])
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ax.set_xticks(range(1, max(len(e["window_ratios"]) for e in rows) + 1))
            ax.set_xlabel("window")
            ax.set_ylabel(f"output tok/s, {a} / {b}")
            ax.set_title("Per-window throughput ratio (band: delta-method interval)")
            save(fig, ax, "window_ratios.png")
    except Exception as e:  # a plot must never cost the results
        log(f"plotting failed ({type(e).__name__}: {e}); results.json and results.md are written")
    return paths

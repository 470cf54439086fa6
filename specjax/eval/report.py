"""Statistics and reports over specjax.eval.measure's per-prompt records: per-dataset summaries (tau as
vLLM counts it, per-position acceptance, tok/s, speedup, each with a 95% interval; prompts are the
unit), the table, and the equivalence comparison of two saved runs (TOST).
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional, Sequence

import numpy as np

from specjax.eval import stats

RESULTS_FORMAT = "specjax-eval"
RESULTS_VERSION = 2  # 2: tau is vLLM's 1 + accepted/drafts (1 was emitted/steps)
COMPARE_METRICS = ("tau", "speedup", "spec_tok_s", "greedy_tok_s")


# ---------------------------------------------------------------------------------------------
# statistics per dataset


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else math.nan


def summarize_dataset(records: Sequence[dict], num_spec_tokens: int, level: float = 0.95) -> dict:
    """Everything the table and a comparison need, recomputed from the per-prompt records only."""
    if not records:
        raise ValueError("no prompts to summarise")
    tot = [r["totals"] for r in records]
    steps = np.array([t["steps"] for t in tot], float)
    emitted = np.array([t["emitted"] for t in tot], float)
    acc = np.array([t["accepted_per_position"] for t in tot], float).reshape(len(tot), num_spec_tokens)
    rates = stats.acceptance_rates(acc, steps, level)
    out: dict[str, Any] = {
        "n_prompts": len(records),
        "n_turns": int(sum(len(r["turns"]) for r in records)),
        "steps": int(steps.sum()),
        "emitted": int(emitted.sum()),
        "accepted": int(acc.sum()),
        # tau as vLLM reports it: 1 + accepted drafts / drafts (= (steps + accepted) / steps); intervals
        # are clipped to what is possible: 1 <= tau <= K + 1
        "tau": stats.ratio_estimate(steps + acc.sum(axis=1), steps, level,
                                    clip=(1.0, num_spec_tokens + 1.0)).to_dict(),
        # tokens the output kept per step (an EOS or the length limit ends the last step early)
        "tokens_per_step": stats.ratio_estimate(emitted, steps, level, clip=(1.0, num_spec_tokens + 1.0)).to_dict(),
        "acceptance": {k: [e.to_dict() for e in v] for k, v in rates.items()},
        "spec_tokens": int(sum(t["spec_tokens"] for t in tot)),
        "spec_wall_s": float(sum(t["spec_wall_s"] for t in tot)),
        "draft_time_s": float(sum(t["draft_time_s"] for t in tot)),
        "target_time_s": float(sum(t["target_time_s"] for t in tot)),
        "mismatched_turns": int(sum(t["mismatched_turns"] for t in tot)),
    }
    spec_tps = np.array([_rate(t["spec_tokens"], t["spec_wall_s"]) for t in tot])
    out["spec_tok_s"] = stats.mean_estimate(spec_tps[np.isfinite(spec_tps)], level).to_dict()
    if all("greedy_tokens" in t for t in tot):
        greedy_tps = np.array([_rate(t["greedy_tokens"], t["greedy_wall_s"]) for t in tot])
        ok = np.isfinite(spec_tps) & np.isfinite(greedy_tps)
        out["greedy_tokens"] = int(sum(t["greedy_tokens"] for t in tot))
        out["greedy_wall_s"] = float(sum(t["greedy_wall_s"] for t in tot))
        out["greedy_tok_s"] = stats.mean_estimate(greedy_tps[ok], level).to_dict()
        if ok.any():
            out["speedup"] = stats.ratio_of_means(spec_tps[ok], greedy_tps[ok], level).to_dict()
            out["speedup_paired"] = stats.ratio_of_means(spec_tps[ok], greedy_tps[ok], level, paired=True).to_dict()
    return out


def summarize(records: Sequence[dict], num_spec_tokens: int, level: float = 0.95) -> dict[str, dict]:
    """Per-dataset summaries, in the order the datasets first appear."""
    by: dict[str, list[dict]] = {}
    for r in records:
        by.setdefault(r["dataset"], []).append(r)
    return {name: summarize_dataset(rs, num_spec_tokens, level) for name, rs in by.items()}


def _est(d: Optional[dict]) -> str:
    if not d:
        return "-"
    v, lo, hi = d["value"], d["lo"], d["hi"]
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    if lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return f"{v:.3f}"
    return f"{v:.3f} [{lo:.3f}, {hi:.3f}]"


def format_table(summaries: dict[str, dict]) -> str:
    head = ["dataset", "n", "steps", "tau [95% CI]", "tok/step", "accept/pos (uncond.)", "accept/pos (cond.)",
            "spec tok/s", "greedy tok/s", "speedup [95% CI]"]
    rows = []
    for name, s in summaries.items():
        pos_u = " ".join(f"{e['value']:.2f}" for e in s["acceptance"]["unconditional"])
        pos_c = " ".join(f"{e['value']:.2f}" for e in s["acceptance"]["conditional"])
        rows.append([name, str(s["n_prompts"]), str(s["steps"]), _est(s["tau"]),
                     f"{s['tokens_per_step']['value']:.3f}", pos_u, pos_c,
                     f"{s['spec_tok_s']['value']:.1f}",
                     f"{s['greedy_tok_s']['value']:.1f}" if "greedy_tok_s" in s else "-",
                     _est(s.get("speedup"))])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


# ---------------------------------------------------------------------------------------------
# comparison


def load_results(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--compare {path}: no such file; give a JSON written by `python -m specjax.eval --out`.") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--compare {path}: not valid JSON ({e}).") from None
    return check_results(res, f"--compare {path}")


def check_results(res: Any, where: str) -> dict:
    """`res` if it is a specjax.eval results file of this version, else a ValueError naming `where`."""
    if not isinstance(res, dict) or res.get("format") != RESULTS_FORMAT or "prompts" not in res:
        raise ValueError(f"{where}: not a specjax.eval results file (written by `python -m specjax.eval --out`).")
    if res.get("format_version") != RESULTS_VERSION:
        raise ValueError(f"{where}: results format version {res.get('format_version')}, this specjax "
                         f"reads {RESULTS_VERSION}; re-run the saved evaluation with this version.")
    return res


def compare_runs(this: dict, other: dict, *, metric: str = "tau", margin: float, relative: bool = False,
                 alpha: float = 0.05) -> dict[str, dict]:
    """TOST per dataset present in both runs, recomputed from each run's per-prompt records."""
    if metric not in COMPARE_METRICS:
        raise ValueError(f"--compare-metric {metric!r}: choose one of {COMPARE_METRICS}.")
    if not margin > 0:
        raise ValueError(f"--margin must be > 0, got {margin}.")
    k_a = this["config"]["num_spec_tokens"]
    k_b = other["config"]["num_spec_tokens"]
    sa = summarize(this["prompts"], k_a)
    sb = summarize(other["prompts"], k_b)
    out = {}
    for name in sa:
        if name not in sb:
            continue
        ea, eb = sa[name].get(metric), sb[name].get(metric)
        if ea is None or eb is None:
            out[name] = {"error": f"{metric} is missing in one run (greedy baseline not measured)"}
            continue
        m = margin * abs(eb["value"]) if relative else margin
        try:
            res = stats.tost_from_estimates(ea["value"], ea["se"], ea["df"], eb["value"], eb["se"], eb["df"],
                                            m, alpha)
            out[name] = dict(res.to_dict(), metric=metric)
        except ValueError as e:
            out[name] = {"error": str(e)}
    if not out:
        raise ValueError(f"the two runs share no dataset (this: {list(sa)}, other: {list(sb)}).")
    return out


def format_comparison(cmp: dict[str, dict], metric: str, margin: float, relative: bool, other_path: str) -> str:
    m = f"+-{margin:g}" + (" x other" if relative else "")
    lines = [f"equivalence (TOST, Welch t) of {metric} vs {other_path}, margin {m}:"]
    for name, r in cmp.items():
        if "error" in r:
            lines.append(f"  {name}: cannot test: {r['error']}")
            continue
        lines.append(
            f"  {name}: this {r['estimate_a']:.4f} vs other {r['estimate_b']:.4f}, diff {r['diff']:+.4f} "
            f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}] ({100 * (1 - 2 * r['alpha']):.0f}% CI), margin "
            f"({r['margin_low']:+.4f}, {r['margin_high']:+.4f}); p_low={r['p_low']:.3g} p_high={r['p_high']:.3g} "
            f"-> {r['verdict'].upper()} at alpha={r['alpha']}")
    return "\n".join(lines)



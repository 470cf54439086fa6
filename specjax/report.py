"""The run report: is the head any good? `python -m specjax.report RUN_DIR`.

Reads a run folder's metrics.jsonl over every invocation (a resume appends to it; where a resume
re-logs steps, the later rows win: specjax.train.metrics.read_history) and its run_meta.json, and
writes into the folder (names in specjax.run_files):

- report.md: the run (target, draft, steps, wall time, tokens/s), its first / best / last
  validation, decode_eval's measured tau, the plots, and a sentence that places the head: the tau
  validation predicts, the tau real decoding measured (decode_eval), and what that means for speed
  by a stated rule of thumb;
- report_loss.png, report_acc.png, report_tau.png: loss (train and validation), accuracy at each
  draft position (validation), predicted tau (train and validation) and decode_eval's tau, over the
  steps of the whole run, with the steps where it was resumed marked.

Training writes it at the end of every invocation (specjax.train.loop), a stopped one included. It
works from the keys each row holds, not from the draft family: `acc_<i>` per draft position,
`tau_sim` (TTT drafts) or `accept_len` (block drafters), `decode_tau/<dataset>`. Plots need
matplotlib (Agg); without it the markdown is still written and one log line says why there are no
plots.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from specjax.run_files import (METRICS_FILE, REPORT_ACC_PLOT, REPORT_FILE, REPORT_LOSS_PLOT, REPORT_TAU_PLOT,
                               RUN_META_FILE, metrics_path, report_path, run_meta_path)
from specjax.train.metrics import History, Smoothed, acc_positions, decode_taus, predicted_tau, read_history

log = logging.getLogger("specjax")

# The rule of thumb that places a head (tau in the engines' definition: tokens per verification
# step, the bonus token included). Each drafted token costs a draft forward, and a verification
# step (the target on K+1 tokens) costs more than a plain decode step, so a step with speculation
# costs roughly 1.3-1.6 plain steps at K=3 on a typical server: below ~1.5 tokens per step it
# tends to lose, above ~2.5 it usually wins. More drafted tokens per step, large batches and
# expensive drafts move the bar up.
SLOW_BELOW = 1.5
PAYS_ABOVE = 2.5
RULE_K = 3
PLOT_SIZE_IN = (8.0, 4.5)
PLOT_DPI = 100  # report PNGs are 800 x 450 pixels
_SMOOTH_BETA = 0.9


class NotARunFolder(ValueError):
    pass


@dataclass
class Report:
    """What the report says, computed before anything is drawn or written."""
    run_dir: str
    meta: dict
    history: History
    placement: str
    plots: dict = field(default_factory=dict)  # plot file name -> {label: (steps, values)}
    markers: list = field(default_factory=list)  # steps where a later invocation resumed


# ---------------------------------------------------------------------------------------------
# where the head stands
# ---------------------------------------------------------------------------------------------
def verdict(tau: float) -> str:
    if tau < SLOW_BELOW:
        return "is likely to make decoding slower than no speculation on most servers"
    if tau < PAYS_ABOVE:
        return ("is in the range where speculation may help a little or not at all, depending on the server and its "
                "batch size, so measure it there before relying on it")
    return "is in the range where speculation usually pays"


def rule_of_thumb() -> str:
    return (f"Rule of thumb (tau = tokens per verification step, the bonus token included): each drafted token costs "
            f"a draft forward, and a verification step costs more than a plain decode step, so at K={RULE_K} a tau "
            f"below ~{SLOW_BELOW} tends to be slower than no speculation on most servers, and above ~{PAYS_ABOVE} it "
            f"usually pays. More drafted tokens per step, a slower draft or large batches raise the bar; the only "
            f"sure answer is a timed run on the server you will use (specjax.bench).")


def _k_note(k: Optional[int]) -> str:
    if k is None or k == RULE_K:
        return ""
    return (f" (the rule of thumb is stated for K={RULE_K}; at K={k} the bar is "
            f"{'higher' if k > RULE_K else 'lower'})")


def decode_k(row: dict) -> Optional[int]:
    """The drafted tokens per step a decode row measured (its decode_accept_<i>/<dataset> keys)."""
    ks = {}
    for key in row:
        if key.startswith("decode_accept_") and "/" in key:
            ks[key.split("/", 1)[1]] = ks.get(key.split("/", 1)[1], 0) + 1
    return max(ks.values()) if ks else None


def place_head(history: History, meta: dict) -> str:
    """One sentence: the tau validation predicts (at the last validation), the tau decode_eval
    measured (its last evaluation), and what the better-founded of the two means for speed."""
    val = history.last("val")
    pred = predicted_tau(val) if val else None
    parts, basis = [], None
    if pred is not None:
        src = "1 + tau_sim" if "tau_sim" in val else "accept_len"
        parts.append(f"validation at step {val['step']} predicts tau {pred[0]:.2f} at K={pred[1]} ({src})")
        basis = (pred[0], pred[1], "predicted")
    else:
        train = history.rows.get("train") or {}
        smoothed = {}
        sm = Smoothed(_SMOOTH_BETA)
        for row in train.values():
            smoothed = sm.update(row)
        tp = predicted_tau(smoothed) if smoothed else None
        if tp is not None:
            last = max(train)
            parts.append(f"no validation ran (data.val_fraction or train.eval_every is 0), and the training batches "
                         f"(which the head has seen) predict tau {tp[0]:.2f} at K={tp[1]} at step {last}")
            basis = (tp[0], tp[1], "predicted")
    dec = history.last("decode")
    measured = decode_taus(dec) if dec else {}
    if measured:
        de = (meta.get("config") or {}).get("decode_eval") or {}
        k = decode_k(dec) or de.get("num_spec_tokens")
        ds = "; ".join(f"{t:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if isinstance(lo, (int, float)) and
                                     isinstance(hi, (int, float)) else "") + f" on {name}"
                       for name, (t, lo, hi) in sorted(measured.items()))
        parts.append(f"real speculative decoding (decode_eval, {de.get('backend', '?')} backend, "
                     f"K={k if k is not None else '?'}) measured tau {ds} at step {dec['step']}")
        basis = (statistics.mean(t for t, _, _ in measured.values()), k, "measured")
    if basis is None:
        return ("Nothing places this head yet: no validation, training or decode_eval row holds an accuracy "
                "(train longer, or set data.val_fraction and train.eval_every, or decode_eval.at_end=true).")
    tau, k, kind = basis
    what = (f"a head at the measured tau of {tau:.2f}" if kind == "measured" else
            f"a head at the predicted tau of {tau:.2f} (a proxy from batches of text, which can differ from what an "
            f"engine accepts on your prompts either way; decode_eval or python -m specjax.eval measures it)")
    said = "; ".join(parts)
    return f"{said[0].upper()}{said[1:]}: by the rule of thumb below, {what} {verdict(tau)}{_k_note(k)}."


# ---------------------------------------------------------------------------------------------
# the data behind the plots
# ---------------------------------------------------------------------------------------------
def _smoothed_series(steps: list[int], values: list[float]) -> list[float]:
    sm, out = Smoothed(_SMOOTH_BETA), []
    for v in values:
        out.append(sm.update({"v": v})["v"])
    return out


def _tau_series(history: History, split: str) -> tuple[list[int], list[float]]:
    pts = [(s, predicted_tau(r)) for s, r in (history.rows.get(split) or {}).items()]
    pts = [(s, p[0]) for s, p in pts if p is not None]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_data(history: History) -> dict:
    """{plot file: {label: (steps, values)}}: every curve the plots draw, over the whole run."""
    loss, acc, tau = {}, {}, {}
    s, v = history.series("train", "loss")
    if s:
        loss["train (each logged batch)"] = (s, v)
        loss["train (smoothed)"] = (s, _smoothed_series(s, v))
    s, v = history.series("val", "loss")
    if s:
        loss["validation"] = (s, v)
    acc_split = "val" if history.rows.get("val") else "train"
    positions = sorted({i for r in (history.rows.get(acc_split) or {}).values() for i in acc_positions(r)})
    for i in positions:
        s, v = history.series(acc_split, f"acc_{i}")
        if s:
            acc[f"acc_{i}"] = (s, v if acc_split == "val" else _smoothed_series(s, v))
    s, v = history.series(acc_split, "acc")
    if s:
        acc["acc (all positions)"] = (s, v if acc_split == "val" else _smoothed_series(s, v))
    s, v = _tau_series(history, "train")
    if s:
        tau["predicted, train (smoothed)"] = (s, _smoothed_series(s, v))
    s, v = _tau_series(history, "val")
    if s:
        tau["predicted, validation"] = (s, v)
    names = sorted({n for r in (history.rows.get("decode") or {}).values() for n in decode_taus(r)})
    for name in names:
        pts = [(st, decode_taus(r)[name][0]) for st, r in history.rows["decode"].items() if name in decode_taus(r)]
        tau[f"decode_eval {name}"] = ([p[0] for p in pts], [p[1] for p in pts])
    return {REPORT_LOSS_PLOT: loss, REPORT_ACC_PLOT: acc, REPORT_TAU_PLOT: tau}


def _read_meta(run_dir: str) -> dict:
    try:
        with open(run_meta_path(run_dir)) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError):
        return {}


def build_report(run_dir: str) -> Report:
    run_dir = os.path.abspath(run_dir)
    if not os.path.isfile(metrics_path(run_dir)):
        raise NotARunFolder(
            f"{run_dir} has no {METRICS_FILE}: give a training run's folder (run.output_dir), which holds "
            f"{METRICS_FILE} and {RUN_META_FILE} once a run has started training.")
    history, meta = read_history(run_dir), _read_meta(run_dir)
    markers = sorted({seg.start_step for seg in history.segments[1:] if seg.start_step > 0})
    return Report(run_dir=run_dir, meta=meta, history=history, placement=place_head(history, meta),
                  plots=plot_data(history), markers=markers)


# ---------------------------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------------------------
def fmt(x, digits: int = 4) -> str:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return "–"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}f}"


def _duration(s: Optional[float]) -> str:
    if s is None:
        return "unknown"
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min ({s:.0f} s)"


def _tokens_per_s(history: History) -> Optional[float]:
    """The median training tokens/s over the logged steps, without the first logged step of each
    invocation (its window holds the step's compilation)."""
    train = history.rows.get("train") or {}
    starts = [seg.start_step for seg in history.segments] or [min(train, default=0) - 1]
    skip = {min((s for s in train if s > start), default=None) for start in starts}
    rates = [r["tokens_per_s"] for s, r in train.items() if s not in skip and isinstance(r.get("tokens_per_s"),
                                                                                          (int, float))]
    return statistics.median(rates) if rates else None


def _wall_time(history: History) -> str:
    if history.segments:
        n = len(history.segments)
        killed = sum(not s.ended for s in history.segments)
        note = (f"{n} invocation{'s' if n > 1 else ''}, set-up included"
                + (f"; {killed} killed without an end marker, counted to its last logged row" if killed else ""))
        return f"{_duration(history.wall_time_s)} ({note})"
    times = [r["time"] for rows in history.rows.values() for r in rows.values() if isinstance(r.get("time"),
                                                                                              (int, float))]
    if len(times) < 2:
        return "unknown"
    return f"about {_duration(max(times) - min(times))} (first to last row of {METRICS_FILE}; set-up not counted)"


def _val_columns(rows: list[dict]) -> list[str]:
    cols = ["loss"]
    for key in ("acc_0", "acc", "tau_sim", "accept_len"):
        if any(key in r for r in rows):
            cols.append(key)
    return cols


def _validation_table(history: History) -> list[str]:
    rows = history.rows.get("val") or {}
    if not rows:
        return ["No validation rows: validation runs when data.val_fraction > 0 and train.eval_batches > 0 (at step "
                "0, every train.eval_every steps and at the end)."]
    first, last = history.first("val"), history.last("val")
    by_tau = [(predicted_tau(r)[0], s) for s, r in rows.items() if predicted_tau(r) is not None]
    if by_tau:
        best, best_by = rows[max(by_tau)[1]], "highest predicted tau"
    else:
        best, best_by = rows[min((r.get("loss", math.inf), s) for s, r in rows.items())[1]], "lowest loss"
    cols = _val_columns([first, best, last])
    head = ["", "step", *cols, "predicted tau", "K"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in (("first", first), (f"best ({best_by})", best), ("last", last)):
        p = predicted_tau(r)
        out.append("| " + " | ".join([name, str(r["step"]), *(fmt(r.get(c)) for c in cols),
                                      fmt(p[0]) if p else "–", str(p[1]) if p else "–"]) + " |")
    out.append("")
    out.append(f"{len(rows)} validations in all (steps {min(rows)} to {max(rows)}); predicted tau is 1 + tau_sim, or "
               f"accept_len for a block drafter, at K = the draft positions the run trains.")
    return out


def _decode_table(history: History, meta: dict) -> list[str]:
    rows = history.rows.get("decode") or {}
    if not rows:
        return []
    de = (meta.get("config") or {}).get("decode_eval") or {}
    k = decode_k(history.last("decode")) or de.get("num_spec_tokens", "?")
    out = ["## decode_eval: real speculative decoding", "",
           f"Backend {de.get('backend', '?')}, K={k}, prompts "
           f"{de.get('prompts', '?')} ({de.get('limit', '?')} each), temperature {de.get('temperature', '?')}.", "",
           "| step | dataset | tau | 95% interval |", "|---|---|---|---|"]
    steps = sorted(rows)
    shown = steps if len(steps) <= 20 else steps[:1] + steps[-19:]
    for s in shown:
        for name, (t, lo, hi) in sorted(decode_taus(rows[s]).items()):
            out.append(f"| {s} | {name} | {fmt(t)} | [{fmt(lo)}, {fmt(hi)}] |")
    if shown != steps:
        out.append(f"\n({len(steps) - len(shown)} evaluations between step {shown[0]} and {shown[1]} left out here; "
                   f"every one is in {METRICS_FILE}, split decode.)")
    out.append("")
    return out


def _run_table(report: Report) -> list[str]:
    meta, history = report.meta, report.history
    config = meta.get("config") or {}
    train_cfg, draft_cfg = config.get("train") or {}, config.get("draft") or {}
    tc = meta.get("target_config") or {}
    target = meta.get("target_path") or "unknown (no run_meta.json)"
    if tc.get("model_type"):
        target += f" ({tc['model_type']})"
    draft = draft_cfg.get("type") or meta.get("draft_family") or "unknown"
    train = history.rows.get("train") or {}
    last_step = max(train, default=None)
    planned = train_cfg.get("steps")
    steps = f"{last_step if last_step is not None else 0}" + (f" of {planned}" if planned else "")
    resumed = [seg.start_step for seg in history.segments if seg.start_step > 0]
    if resumed:
        steps += f" (resumed at step{'s' if len(resumed) > 1 else ''} {', '.join(map(str, resumed))})"
    tok = _tokens_per_s(history)
    n_batches = train_cfg.get("eval_batches")
    val_cfg = (f"every {train_cfg.get('eval_every')} steps, up to {n_batches} batch{'' if n_batches == 1 else 'es'}"
               if train_cfg.get("eval_every") else "at step 0 and at the end only (train.eval_every=0)")
    rows = [("target", target), ("draft", draft), ("steps", steps), ("wall time", _wall_time(history)),
            ("training tokens/s", f"{tok:.0f} (median over the logged steps)" if tok is not None else "unknown"),
            ("validation", val_cfg)]
    return ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows), ""]


def format_markdown(report: Report, plots_written: Optional[list[str]] = None, plots_note: str = "") -> str:
    name = os.path.basename(report.run_dir.rstrip(os.sep))
    out = [f"# Run report: {name}", "",
           f"`{report.run_dir}`, from {METRICS_FILE} and {RUN_META_FILE} at "
           f"{time.strftime('%Y-%m-%d %H:%M:%S')} (`python -m specjax.report {report.run_dir}` writes it again).", "",
           "## Where this head stands", "", report.placement, "", rule_of_thumb(), "",
           "## The run", "", *_run_table(report),
           "## Validation", "", *_validation_table(report.history), "",
           *_decode_table(report.history, report.meta),
           "## Plots", ""]
    if plots_written:
        titles = {REPORT_LOSS_PLOT: "loss", REPORT_ACC_PLOT: "accuracy by draft position",
                  REPORT_TAU_PLOT: "tau over steps"}
        for p in plots_written:
            out += [f"![{titles.get(p, p)}]({p})", ""]
        if report.markers:
            out += [f"Dotted vertical lines: the steps where the run was resumed "
                    f"({', '.join(map(str, report.markers))}).", ""]
    else:
        out += [plots_note or "No plots were written.", ""]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save_png(fig, path: str) -> None:
    tmp = path + ".tmp"
    fig.savefig(tmp, dpi=PLOT_DPI, format="png")
    os.replace(tmp, path)


def write_plots(report: Report, plt) -> list[str]:
    """The three PNGs (a plot with no data is not written); returns their file names."""
    written = []
    styles = {
        "train (each logged batch)": dict(color="C0", alpha=0.25, linewidth=0.8),
        "train (smoothed)": dict(color="C0", linewidth=1.8),
        "validation": dict(color="C1", marker="o", markersize=3, linewidth=1.6),
        "predicted, train (smoothed)": dict(color="C0", linewidth=1.8),
        "predicted, validation": dict(color="C1", marker="o", markersize=3, linewidth=1.6),
    }
    titles = {REPORT_LOSS_PLOT: ("loss", "loss"),
              REPORT_ACC_PLOT: ("accuracy at each draft position" + (" (validation)" if report.history.rows.get("val")
                                                                     else " (training batches, smoothed)"), "accuracy"),
              REPORT_TAU_PLOT: ("tau: predicted (1 + tau_sim, or accept_len) and measured (decode_eval)",
                                "tokens per verification step")}
    for name, curves in report.plots.items():
        if not curves:
            continue
        fig, ax = plt.subplots(figsize=PLOT_SIZE_IN)
        try:
            n_acc = sum(label.startswith("acc_") for label in curves)
            cmap = plt.get_cmap("viridis")
            j = 0
            for label, (steps, values) in curves.items():
                style = styles.get(label)
                if style is None and label.startswith("acc_"):
                    style = dict(color=cmap(j / max(n_acc - 1, 1)) if n_acc > 10 else f"C{j % 10}", linewidth=1.4,
                                 marker="o" if len(steps) < 30 else None, markersize=3)
                    j += 1
                elif style is None and label.startswith("acc "):
                    style = dict(color="black", linestyle="--", linewidth=1.4)
                elif style is None:  # decode_eval datasets
                    style = dict(marker="s", markersize=4, linewidth=1.2)
                ax.plot(steps, values, label=label, **style)
            if name == REPORT_TAU_PLOT:
                ax.axhline(SLOW_BELOW, color="gray", linestyle=":", linewidth=1)
                ax.axhline(PAYS_ABOVE, color="gray", linestyle="--", linewidth=1)
                ax.text(0.01, SLOW_BELOW, f" ~{SLOW_BELOW}: slower below (K={RULE_K})", color="gray", fontsize=7,
                        va="bottom", transform=ax.get_yaxis_transform())
                ax.text(0.01, PAYS_ABOVE, f" ~{PAYS_ABOVE}: usually pays above (K={RULE_K})", color="gray",
                        fontsize=7, va="bottom", transform=ax.get_yaxis_transform())
            for j, m in enumerate(report.markers):
                ax.axvline(m, color="gray", linestyle=":", linewidth=1, label="resumed here" if j == 0 else None)
            title, ylabel = titles[name]
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, ncol=2 if len(curves) > 6 else 1)
            fig.tight_layout()
            _save_png(fig, os.path.join(report.run_dir, name))
            written.append(name)
        finally:
            plt.close(fig)
    return written


def _write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_report(run_dir: str, info: Callable[[str], None] = log.info) -> str:
    """Write report.md and the plots into `run_dir`; returns report.md's path."""
    return write(build_report(run_dir), info)


def write(report: Report, info: Callable[[str], None] = log.info) -> str:
    """Write `report` (report.md and the plots) into its run folder; returns report.md's path.
    Without matplotlib the markdown is written all the same, and `info` gets one line saying why
    there are no plots."""
    written, note = [], ""
    try:
        plt = _pyplot()
    except ImportError as e:
        plt, note = None, (f"No plots: matplotlib could not be imported ({type(e).__name__}: {e}); "
                           f"`pip install matplotlib` and run `python -m specjax.report {report.run_dir}`.")
        info(f"run report: {note}")
    if plt is not None:
        written = write_plots(report, plt)
    for name in report.plots:  # a plot this report did not draw must not be shown from an earlier one
        if name not in written and os.path.exists(os.path.join(report.run_dir, name)):
            os.remove(os.path.join(report.run_dir, name))
    path = report_path(report.run_dir)
    _write_text(path, format_markdown(report, written, note))
    return path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="the training run's folder (run.output_dir)")
    args = ap.parse_args(argv)
    try:
        report = build_report(args.run_dir)
        path = write(report, info=lambda line: print(line, file=sys.stderr))
    except (NotARunFolder, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.placement)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

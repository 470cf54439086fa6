"""Measure real acceptance: lossless speculative decoding with the JAX target and an EAGLE-3 draft
on evaluation prompts, against plain greedy decoding of the same target on the same device.

    python -m specjax.eval --target DIR --draft DIR --prompts mtbench,humaneval --num-spec-tokens 5
        [--limit N] [--max-new-tokens M] [--temperature T] [--mode chain|tree] [--out results.json]
        [--compare other.json --margin X [--compare-metric tau|speedup|spec_tok_s] [--relative-margin]]

Per dataset it prints: prompts, verification steps, tau as vLLM reports it (1 + accepted draft
tokens / drafts, i.e. the bonus token of every step included) with a 95% interval, the tokens the
output kept per step (an EOS or the length limit ends the last step early, so <= tau) (prompts are the unit; see specjax.eval.stats), per-position
acceptance (unconditional, and conditional on the previous position), speculative and greedy
tokens/s and the speedup with a two-sample delta-method 95% interval. The JSON written with --out
holds the configuration, versions, device and every prompt's raw counts, so a later run can be
compared with this one (--compare runs two one-sided tests on a metric per dataset).

Multi-turn prompts (MT-bench) are asked as MT-bench does: turn 2 follows the model's own turn-1
answer (each arm continues its own conversation; at temperature 0 both answers are the same).
At temperature 0 speculative output must equal greedy output token for token; any prompt where it
does not is a mismatch, reported, and makes the exit code 1. Compilation is kept out of the timings:
the first prompt is run once untimed (`--warmup`), and a later call that still traces or compiles
(a prompt in a new shape bucket; counted with jax.monitoring) is run again and the rerun is timed.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from specjax.eval import stats

log = logging.getLogger("specjax")

RESULTS_FORMAT = "specjax-eval"
RESULTS_VERSION = 2  # 2: tau is vLLM's 1 + accepted/drafts (1 was emitted/steps)
COMPARE_METRICS = ("tau", "speedup", "spec_tok_s", "greedy_tok_s")


# ---------------------------------------------------------------------------------------------
# prompts and tokens


def eos_token_ids(target_dir: Optional[str], tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: the tokenizer's EOS plus config.json and generation_config.json
    `eos_token_id` (int or list); chat models often end a turn on a token other than the tokenizer's
    EOS (e.g. <|im_end|>)."""
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v if isinstance(x, int))

    add(getattr(tokenizer, "eos_token_id", None))
    if target_dir:
        for name in ("config.json", "generation_config.json"):
            path = os.path.join(target_dir, name)
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as f:
                    add(json.load(f).get("eos_token_id"))
    return tuple(sorted(ids))


def render_prompt(tokenizer, template: str, messages: list[dict]) -> list[int]:
    """Chat-template the conversation with the generation prompt (the assistant header) and tokenize
    the text as is (the template already holds any BOS)."""
    from specjax.data.chat import render_chat

    text = render_chat(tokenizer, template, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


_compiles = {"n": 0, "listening": False}


def _compile_events() -> int:
    """How many jit traces / backend compiles have happened in this process (jax.monitoring)."""
    if not _compiles["listening"]:
        import jax

        def on_event(event: str, duration: float, **kw) -> None:
            if event.startswith("/jax/core/compile/"):
                _compiles["n"] += 1

        jax.monitoring.register_event_duration_secs_listener(on_event)
        _compiles["listening"] = True
    return _compiles["n"]


def _steady(call: Callable[[], Any], retime: bool) -> tuple[Any, int]:
    """Run `call`; when it traced or compiled anything (a prompt of a new shape bucket), run it again
    so the timing excludes compilation (the decoders are deterministic for a given seed, so the
    result is the same). Returns (result, number of re-runs)."""
    if not retime:
        return call(), 0
    for again in range(3):
        before = _compile_events()
        res = call()
        if _compile_events() == before:
            return res, again
    log.warning("still compiling after 3 runs of one prompt; its timing includes compilation")
    return res, again


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _spec_numbers(res, num_spec_tokens: int) -> dict:
    acc = [int(x) for x in res.accept_lengths]
    per_pos = [int(x) for x in res.accepted_per_position]
    if len(per_pos) != num_spec_tokens:
        raise RuntimeError(f"the decoder reported {len(per_pos)} positions for num_spec_tokens={num_spec_tokens}")
    if len(acc) != int(res.num_steps):
        raise RuntimeError(f"the decoder reported {len(acc)} accept lengths for {res.num_steps} steps")
    return {"new_tokens": len(res.tokens), "num_steps": int(res.num_steps), "accept_lengths": acc,
            "accepted_per_position": per_pos, "wall_s": float(res.wall_s),
            "draft_time_s": float(res.draft_time_s), "target_time_s": float(res.target_time_s)}


def run_prompt(decoder, tokenizer, template: str, prompt, *, num_spec_tokens: int, max_new_tokens: int,
               temperature: float, eos_ids: Sequence[int], seed: int, with_greedy: bool,
               retime: bool = False) -> dict:
    """Speculative (and, with `with_greedy`, plain greedy) decoding of every turn of one prompt.
    Returns the prompt's record: per-turn raw numbers plus per-prompt totals (the statistics' unit).
    `retime`: re-run a call that compiled something, so timings exclude compilation."""
    spec_msgs: list[dict] = []
    greedy_msgs: list[dict] = []
    turns = []
    for t, user_text in enumerate(prompt.turns):
        spec_msgs.append({"role": "user", "content": user_text})
        ids = render_prompt(tokenizer, template, spec_msgs)
        res, rerun = _steady(lambda: decoder.generate(ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                                      eos_token_ids=tuple(eos_ids), seed=seed + t), retime)
        turn = {"prompt_tokens": len(ids), "spec": _spec_numbers(res, num_spec_tokens), "greedy": None,
                "match": None, "reruns": rerun}
        spec_msgs.append({"role": "assistant", "content": tokenizer.decode(res.tokens, skip_special_tokens=True)})
        if with_greedy:
            greedy_msgs.append({"role": "user", "content": user_text})
            g_ids = render_prompt(tokenizer, template, greedy_msgs)
            g, rerun = _steady(lambda: decoder.greedy(g_ids, max_new_tokens=max_new_tokens,
                                                      eos_token_ids=tuple(eos_ids)), retime)
            turn["reruns"] += rerun
            turn["greedy"] = {"prompt_tokens": len(g_ids), "new_tokens": len(g.tokens), "wall_s": float(g.wall_s)}
            greedy_msgs.append({"role": "assistant", "content": tokenizer.decode(g.tokens, skip_special_tokens=True)})
            if temperature == 0.0:  # lossless at greedy: the same tokens, one for one
                turn["match"] = list(res.tokens) == list(g.tokens) and g_ids == ids
                if not turn["match"]:
                    i = _first_divergence(res.tokens, g.tokens)
                    turn["first_divergence"] = i
                    turn["spec_tail"] = [int(x) for x in res.tokens[i:i + 8]]
                    turn["greedy_tail"] = [int(x) for x in g.tokens[i:i + 8]]
        turns.append(turn)
    return _with_totals({"id": prompt.id, "dataset": prompt.dataset, "category": prompt.category,
                         "turns": turns}, num_spec_tokens)


def _with_totals(rec: dict, num_spec_tokens: int) -> dict:
    turns = rec["turns"]
    tot = {
        "emitted": int(sum(sum(t["spec"]["accept_lengths"]) for t in turns)),
        "steps": int(sum(t["spec"]["num_steps"] for t in turns)),
        "accepted_per_position": [int(sum(t["spec"]["accepted_per_position"][i] for t in turns))
                                  for i in range(num_spec_tokens)],
        "spec_tokens": int(sum(t["spec"]["new_tokens"] for t in turns)),
        "spec_wall_s": float(sum(t["spec"]["wall_s"] for t in turns)),
        "draft_time_s": float(sum(t["spec"]["draft_time_s"] for t in turns)),
        "target_time_s": float(sum(t["spec"]["target_time_s"] for t in turns)),
    }
    if all(t["greedy"] is not None for t in turns):
        tot["greedy_tokens"] = int(sum(t["greedy"]["new_tokens"] for t in turns))
        tot["greedy_wall_s"] = float(sum(t["greedy"]["wall_s"] for t in turns))
    tot["mismatched_turns"] = int(sum(1 for t in turns if t["match"] is False))
    rec["totals"] = tot
    return rec


def measure(decoder, tokenizer, template: str, prompts: Sequence, *, num_spec_tokens: int,
            max_new_tokens: int, temperature: float = 0.0, eos_ids: Sequence[int] = (), seed: int = 0,
            with_greedy: bool = True, warmup: int = 1, retime: bool = True,
            progress: Optional[Callable[[int, int, dict], None]] = None,
            deadline: Optional[float] = None) -> list[dict]:
    """Run every prompt and return the per-prompt records. Compilation is kept out of the timings:
    `warmup` prompts are run once untimed first, and with `retime` any call that still compiles
    (a new shape bucket: prompt length, cache size) is run again and the second run is timed.
    With `deadline` (a time.time() value) no prompt is started after it; the records measured so far
    are returned, so a time-limited run keeps whole prompts in order (the first n)."""
    kw = dict(num_spec_tokens=num_spec_tokens, max_new_tokens=max_new_tokens, temperature=temperature,
              eos_ids=eos_ids, seed=seed, with_greedy=with_greedy, retime=retime)
    for p in list(prompts)[:max(0, warmup)]:
        run_prompt(decoder, tokenizer, template, p, **dict(kw, retime=False))
    records = []
    for i, p in enumerate(prompts):
        if deadline is not None and time.time() >= deadline:
            break
        records.append(run_prompt(decoder, tokenizer, template, p, **kw))
        if progress is not None:
            progress(i + 1, len(prompts), records[-1])
    return records


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
    if not isinstance(res, dict) or res.get("format") != RESULTS_FORMAT or "prompts" not in res:
        raise ValueError(f"--compare {path}: not a specjax.eval results file (written by `python -m specjax.eval --out`).")
    if res.get("format_version") != RESULTS_VERSION:
        raise ValueError(f"--compare {path}: results format version {res.get('format_version')}, this specjax "
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


# ---------------------------------------------------------------------------------------------
# environment


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("specjax", "jax", "jaxlib", "numpy", "transformers", "flax"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def device_info() -> dict:
    import jax

    d = jax.devices()[0]
    return {"platform": d.platform, "device_kind": getattr(d, "device_kind", ""), "device_count": jax.device_count(),
            "process_count": jax.process_count(), "host": platform.node()}


# ---------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specjax.eval", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="HF folder of the target (config.json + *.safetensors + tokenizer)")
    ap.add_argument("--draft", required=True, help="exported EAGLE-3 head folder (model.safetensors + config.json)")
    ap.add_argument("--prompts", default="mtbench,humaneval",
                    help="comma-separated presets (mtbench, humaneval) or JSONL/parquet paths")
    ap.add_argument("--num-spec-tokens", type=int, default=5, help="draft tokens per verification step (K)")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="per turn")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--mode", choices=("chain", "tree"), default="chain")
    ap.add_argument("--tree-top-k", type=int, default=2, help="branching of tree drafting (--mode tree)")
    ap.add_argument("--dtype", default="float32", help="target dtype (float32 | bfloat16)")
    ap.add_argument("--matmul-precision", default="auto", choices=("auto", "default", "high", "highest"),
                    help="jax matmul precision while decoding: auto (highest for a float32 target: on GPU the f32 "
                         "default is TF32, which breaks near-ties differently in verification and greedy steps), "
                         "default, high, highest")
    ap.add_argument("--chat-template", default=None, help="Jinja template (string or file) if the tokenizer has none")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="prompts run once untimed first to compile (default 1)")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy baseline (no speedup, no equality check)")
    ap.add_argument("--max-mismatches", type=int, default=0,
                    help="turns allowed to differ from greedy at temperature 0 before the exit code is 1 "
                         "(default 0; low-precision targets can resolve near-ties differently)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no prompt after this many seconds (counted from the start of the run); the "
                         "results cover the prompts finished, in order, and say that the budget cut the run")
    ap.add_argument("--out", default=None, help="write every number to this JSON file")
    ap.add_argument("--compare", default=None, help="a results JSON of an earlier run to test equivalence against")
    ap.add_argument("--margin", type=float, default=None, help="equivalence margin (metric units, or a fraction "
                                                                 "of the other run's value with --relative-margin)")
    ap.add_argument("--relative-margin", action="store_true")
    ap.add_argument("--compare-metric", choices=COMPARE_METRICS, default="tau")
    ap.add_argument("--alpha", type=float, default=0.05, help="TOST level (each one-sided test)")
    return ap


def _check_args(a) -> Optional[str]:
    if a.num_spec_tokens < 1:
        return "--num-spec-tokens must be >= 1"
    if a.limit is not None and a.limit < 1:
        return "--limit must be >= 1"
    if a.max_new_tokens < 1:
        return "--max-new-tokens must be >= 1"
    if not a.temperature >= 0:
        return "--temperature must be >= 0"
    if a.mode == "tree" and a.temperature > 0:
        return "--mode tree verifies greedily; use --mode chain for --temperature > 0"
    if a.compare and (a.margin is None or not a.margin > 0):
        return "--compare needs --margin X (> 0), the equivalence margin"
    if a.compare and a.no_greedy and a.compare_metric != "tau":
        return f"--compare-metric {a.compare_metric} needs the greedy baseline; drop --no-greedy"
    if not 0 < a.alpha < 0.5:
        return "--alpha must be in (0, 0.5)"
    if a.max_mismatches < 0:
        return "--max-mismatches must be >= 0"
    if a.budget_s is not None and not a.budget_s > 0:
        return "--budget-s must be > 0 (seconds)"
    for flag, path in (("--target", a.target), ("--draft", a.draft)):
        if not os.path.isfile(os.path.join(path, "config.json")):
            return f"{flag} {path}: no config.json there; give the model folder"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    started = time.time()
    args = _parser().parse_args(argv)
    err = _check_args(args)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    other = None
    try:
        if args.compare:  # fail before the long run, not after
            other = load_results(args.compare)
        from transformers import AutoTokenizer

        from specjax.data.chat import resolve_chat_template
        from specjax.data.presets import load_eval_prompts
        from specjax.eval.spec_decode import SpecDecoder, load_draft
        from specjax.targets import load_target

        names = [p.strip() for p in args.prompts.split(",") if p.strip()]
        if not names:
            raise ValueError("--prompts is empty; give e.g. mtbench,humaneval")
        prompts = [p for name in names for p in load_eval_prompts(name, limit=args.limit)]
        if not prompts:
            raise ValueError(f"--prompts {args.prompts}: no prompts loaded")
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        template = resolve_chat_template(tokenizer, args.chat_template)
        target = load_target(args.target, dtype=args.dtype)
        draft = load_draft(args.draft)  # SpecDecoder checks that it fits the target
        decoder = SpecDecoder(target, draft, num_spec_tokens=args.num_spec_tokens, mode=args.mode,
                              tree_top_k=args.tree_top_k,
                              matmul_precision=None if args.matmul_precision == "default" else args.matmul_precision)
    except (ValueError, FileNotFoundError, OSError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    eos = eos_token_ids(args.target, tokenizer)
    with_greedy = not args.no_greedy

    t0 = time.time()

    def progress(i, n, rec):
        t = rec["totals"]
        print(f"[{i}/{n}] {rec['dataset']}/{rec['id']}: {t['steps']} steps, tau {1 + sum(t['accepted_per_position']) / max(t['steps'], 1):.2f}"
              + (", MISMATCH" if t["mismatched_turns"] else ""), file=sys.stderr, flush=True)

    records = measure(decoder, tokenizer, template, prompts, num_spec_tokens=args.num_spec_tokens,
                      max_new_tokens=args.max_new_tokens, temperature=args.temperature, eos_ids=eos,
                      seed=args.seed, with_greedy=with_greedy, warmup=args.warmup, progress=progress,
                      deadline=None if args.budget_s is None else started + args.budget_s)
    cut = len(records) < len(prompts)
    if cut:
        print(f"--budget-s {args.budget_s:g}: stopped after {len(records)} of {len(prompts)} prompts; the results "
              f"below cover those {len(records)}", file=sys.stderr)
    if not records:
        print(f"error: --budget-s {args.budget_s:g} ran out before the first prompt finished; raise it", file=sys.stderr)
        return 1
    summaries = summarize(records, args.num_spec_tokens)
    mismatches = sum(s["mismatched_turns"] for s in summaries.values())
    checked = with_greedy and args.temperature == 0.0
    result = {
        "format": RESULTS_FORMAT, "format_version": RESULTS_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m specjax.eval " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {"target": os.path.abspath(args.target), "draft": os.path.abspath(args.draft),
                   "prompts": names, "limit": args.limit, "num_spec_tokens": args.num_spec_tokens,
                   "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "mode": args.mode,
                   "tree_top_k": args.tree_top_k, "dtype": args.dtype,
                   "matmul_precision": decoder.matmul_precision or "default", "seed": args.seed, "warmup": args.warmup,
                   "eos_token_ids": list(eos), "greedy_baseline": with_greedy},
        "versions": versions(),
        "device": device_info(),
        "statistics": {"unit": "prompt (all turns of a conversation)", "level": 0.95,
                       "tau": "1 + sum(accepted)/sum(steps) (vLLM's definition), cluster delta-method se, t(n-1)",
                       "tokens_per_step": "sum(emitted)/sum(steps), same method",
                       "speedup": "mean(spec tok/s)/mean(greedy tok/s) per prompt, two-sample delta method, Welch df"},
        "datasets": summaries,
        "equality_checked": checked,
        "mismatches": mismatches if checked else None,
        "prompts_requested": len(prompts), "prompts_measured": len(records), "cut_by_budget": cut,
        "wall_s": time.time() - t0,
        "prompts": records,
    }
    print(format_table(summaries))
    if checked:
        n_turns = sum(s["n_turns"] for s in summaries.values())
        print(f"speculative == greedy at temperature 0: {n_turns - mismatches}/{n_turns} turns identical, "
              f"{mismatches} mismatches")
    if other is not None:
        try:
            cmp = compare_runs(result, other, metric=args.compare_metric, margin=args.margin,
                               relative=args.relative_margin, alpha=args.alpha)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        result["comparison"] = {"other": os.path.abspath(args.compare), "metric": args.compare_metric,
                                "margin": args.margin, "relative_margin": args.relative_margin, "alpha": args.alpha,
                                "datasets": cmp}
        print(format_comparison(cmp, args.compare_metric, args.margin, args.relative_margin, args.compare))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(_finite_or_null(result), f, indent=1, default=_json_default, allow_nan=False)
        os.replace(tmp, args.out)
        print(f"wrote {args.out}")
    if checked and mismatches > args.max_mismatches:
        bad = [f"{r['dataset']}/{r['id']}" for r in records if r["totals"]["mismatched_turns"]]
        print(f"error: speculative output differs from greedy output at temperature 0 in {mismatches} turn(s): "
              f"{bad[:10]}. Speculative decoding must be lossless; with --dtype float32 and --matmul-precision "
              f"highest (what auto picks for float32) this is a decoder bug. In bfloat16, or with TF32 matmuls "
              f"(the GPU default for float32, --matmul-precision default), the verification of K+1 tokens in "
              f"one call can round a near-tie differently from one-token decoding: check with --dtype float32 "
              f"--matmul-precision highest (or allow it with --max-mismatches N).",
              file=sys.stderr)
        return 1
    return 0


def _finite_or_null(x):
    """Strict JSON: an undefined statistic (nan, e.g. an interval from one prompt) is written as null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_null(v) for v in x]
    return x


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"cannot write {type(x).__name__} to JSON")

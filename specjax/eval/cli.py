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
import sys
import time
from typing import Optional, Sequence

import numpy as np

from specjax.eval.measure import device_info, eos_token_ids, measure, versions
from specjax.eval.report import (
    COMPARE_METRICS, RESULTS_FORMAT, RESULTS_VERSION, compare_runs, format_comparison, format_table, load_results,
    summarize,
)

log = logging.getLogger("specjax")


# ---------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m specjax.eval", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="HF folder of the target (config.json + *.safetensors + tokenizer)")
    ap.add_argument("--draft", required=True, help="exported EAGLE-3 or DFlash head folder (model.safetensors + config.json)")
    ap.add_argument("--prompts", default="mtbench,humaneval",
                    help="comma-separated presets (mtbench, humaneval) or JSONL/parquet paths")
    ap.add_argument("--num-spec-tokens", type=int, default=5, help="draft tokens per verification step (K)")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="per turn")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--mode", choices=("chain", "tree"), default="chain")
    ap.add_argument("--tree-top-k", type=int, default=2, help="branching of tree drafting (--mode tree)")
    ap.add_argument("--tree-total-tokens", type=int, default=None,
                    help="EAGLE-2's re-ranking (--mode tree): verify only this many best nodes of the expanded tree "
                         "(by cumulative draft log-prob); default: every node")
    ap.add_argument("--dtype", default="float32", help="target dtype (float32 | bfloat16)")
    ap.add_argument("--matmul-precision", default="auto", choices=("auto", "default", "high", "highest"),
                    help="jax matmul precision while decoding: auto (highest for a float32 target: on GPU the f32 "
                         "default is TF32, which breaks near-ties differently in verification and greedy steps), "
                         "default, high, highest")
    ap.add_argument("--chat-template", default=None, help="Jinja template (string or file) if the tokenizer has none")
    ap.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                    help="variables for the chat template, as the run's data.chat_template_kwargs, e.g. "
                         "'{\"enable_thinking\": false}'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1, help="prompts run once untimed first to compile (default 1)")
    ap.add_argument("--device-loop", action="store_true",
                    help="run each turn as one device program per side (spec_loop.SpecLoop for speculative, "
                         "generate.generate for greedy) instead of one jitted call per step; same outputs, "
                         "no host round trip per step")
    ap.add_argument("--batch-size", type=int, default=1,
                    help="with --device-loop and temperature 0: decode this many prompts at once (each turn one "
                         "batched program); tau and counts are unchanged, tok/s become batch throughputs")
    ap.add_argument("--no-greedy", action="store_true", help="skip the greedy baseline (no speedup, no equality check)")
    ap.add_argument("--max-mismatches", type=int, default=0,
                    help="turns allowed to differ from greedy at temperature 0 before the exit code is 1 "
                         "(default 0; low-precision targets can resolve near-ties differently)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no prompt after this many seconds (counted from the start of the run); the "
                         "results cover the prompts finished, in order, and say that the budget cut the run")
    ap.add_argument("--out", default=None, help="write every number to this JSON file")
    ap.add_argument("--record-tokens", action="store_true",
                    help="keep every turn's prompt ids and speculative output ids in the --out JSON, to run another "
                         "engine on exactly the same inputs: `python -m specjax.bench --eval-tokens OUT.json` sends "
                         "them to a server, `python -m specjax.bench compare OUT.json BENCH_OUT` compares outputs "
                         "and per-position counts")
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
    if a.batch_size < 1:
        return "--batch-size must be >= 1"
    if a.batch_size > 1 and not (a.device_loop and a.temperature == 0.0):
        return "--batch-size > 1 needs --device-loop and --temperature 0 (batched greedy decoding)"
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
    if a.chat_template_kwargs is not None:
        try:
            _template_kwargs(a)
        except ValueError as e:
            return str(e)
    for flag, path in (("--target", a.target), ("--draft", a.draft)):
        if not os.path.isfile(os.path.join(path, "config.json")):
            return f"{flag} {path}: no config.json there; give the model folder"
    return None


def _template_kwargs(a) -> Optional[dict]:
    if a.chat_template_kwargs is None:
        return None
    try:
        kwargs = json.loads(a.chat_template_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs is not JSON ({e}); give e.g. '{{\"enable_thinking\": false}}'")
    if not isinstance(kwargs, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object of variables, got {a.chat_template_kwargs}")
    return kwargs


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
        from specjax.data.datasets import load_eval_prompts
        from specjax.eval.spec_decode import SpecDecoder, load_draft
        from specjax.targets import load_target

        names = [p.strip() for p in args.prompts.split(",") if p.strip()]
        if not names:
            raise ValueError("--prompts is empty; give e.g. mtbench,humaneval")
        prompts = [p for name in names for p in load_eval_prompts(name, limit=args.limit)]
        if not prompts:
            raise ValueError(f"--prompts {args.prompts}: no prompts loaded")
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        template = resolve_chat_template(tokenizer, args.chat_template, variables=_template_kwargs(args))
        target = load_target(args.target, dtype=args.dtype)
        draft = load_draft(args.draft)  # SpecDecoder checks that it fits the target
        decoder = SpecDecoder(target, draft, num_spec_tokens=args.num_spec_tokens, mode=args.mode,
                              tree_top_k=args.tree_top_k, tree_total_tokens=args.tree_total_tokens,
                              matmul_precision=None if args.matmul_precision == "default" else args.matmul_precision)
        if args.device_loop:
            from specjax.eval.spec_loop import DeviceLoopDecoder

            decoder = DeviceLoopDecoder(decoder)
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
                      deadline=None if args.budget_s is None else started + args.budget_s,
                      record_tokens=args.record_tokens, batch_size=args.batch_size)
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
                   "tree_top_k": args.tree_top_k, "tree_total_tokens": args.tree_total_tokens, "dtype": args.dtype,
                   "matmul_precision": decoder.matmul_precision or "default", "seed": args.seed, "warmup": args.warmup,
                   "eos_token_ids": list(eos), "greedy_baseline": with_greedy, "device_loop": args.device_loop,
                   "record_tokens": args.record_tokens, "batch_size": args.batch_size},
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

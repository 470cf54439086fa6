"""An engine against specjax.eval on the same inputs, per prompt and per draft position.

    python -m specjax.eval --target T --draft D --prompts P --record-tokens --out eval.json
    (serve D with T: python -m specjax.serve_cmd --draft D --target T --eval-results eval.json)
    python -m specjax.bench --url URL --eval-tokens eval.json --concurrency 1 --out bench/
    python -m specjax.bench compare eval.json bench/ [--require-equal] [--out compare.json]

`--eval-tokens` makes the benchmark send every turn that specjax.eval decoded as the token ids it
decoded (`jobs_from_eval`), to `/v1/completions`, with its max_new_tokens, temperature and EOS ids
(`stop_token_ids`) and no repetition, presence or frequency penalty (`eval_request_settings`), so
the engine decodes exactly what specjax.eval decoded. At concurrency 1 the benchmark keeps each
request's own spec-decode counters and token ids (`specjax.bench.core.run_level`).

`compare` pairs each specjax.eval turn with the engine's request that had the same prompt token ids
(the server's echo; a benchmark run on a chat prompt set matches too when the server's chat
template gave the same ids), else the request of the same prompt id and turn, and prints per turn:
whether the inputs are the same, specjax.eval's verification steps and accepted counts per position
beside the engine's drafts and accepted counts per position (vLLM's
`spec_decode_num_drafts` / `..._num_accepted_tokens_per_pos`), tau on each side, and whether the
outputs are the same (else the first position where they differ; the engine's output is cut at the
first of specjax.eval's EOS ids, which specjax.eval does not emit). Then the totals per dataset and
overall: steps and drafts, accepted counts and acceptance per position, tau. A turn is equal when
its inputs, outputs and counts are all equal; in float32 (specjax.eval's default, and the dtype
`specjax.serve_cmd` then prints) every turn must be. `--require-equal` makes the exit code 1 when
one is not (or is missing); otherwise the exit code is 0 whatever the comparison shows, and 2 when a
file cannot be compared.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any, Optional, Sequence

from specjax.bench.core import BenchJob
from specjax.eval.report import check_results

__all__ = ["load_eval_record", "jobs_from_eval", "eval_request_settings", "load_bench_results", "compare_runs",
           "format_comparison", "main", "BENCH_FORMAT"]

BENCH_FORMAT = "specjax.bench"
RESULTS_FILE = "results.json"  # what specjax.bench --out writes (specjax.bench.report)


# ---------------------------------------------------------------------------------------------
# specjax.eval's record as the benchmark's prompt source


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{what} {path}: no such file") from None
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{what} {path}: not valid JSON ({e})") from None


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)


def load_eval_record(path: str, what: str = "specjax.eval results") -> dict:
    """A specjax.eval results JSON written with --record-tokens (every turn's prompt_ids and output_ids);
    a ValueError naming the file and the fix otherwise."""
    res = check_results(_read_json(path, what), f"{what} {path}")
    for rec in res["prompts"]:
        for t, turn in enumerate(rec.get("turns") or []):
            if not (_is_ids(turn.get("prompt_ids")) and _is_ids(turn.get("output_ids"))):
                raise ValueError(f"{what} {path}: prompt {rec.get('dataset')}/{rec.get('id')} turn {t} has no token ids: "
                                 "run specjax.eval with --record-tokens (it keeps every turn's prompt and output ids)")
    if not res["prompts"]:
        raise ValueError(f"{what} {path}: holds no prompts")
    return res


def jobs_from_eval(results: dict, limit: Optional[int] = None) -> list[BenchJob]:
    """One job per turn of the first `limit` prompts (all without it) of a specjax.eval record: its
    prompt token ids as specjax.eval decoded them (a later turn's ids hold specjax.eval's own earlier
    answers), with the prompt's id and dataset and the turn's index."""
    prompts = results["prompts"] if limit is None else results["prompts"][:limit]
    return [BenchJob(str(rec["id"]), str(rec["dataset"]), (), prompt_ids=tuple(int(x) for x in turn["prompt_ids"]),
                     turn=t)
            for rec in prompts for t, turn in enumerate(rec["turns"])]


def eval_request_settings(results: dict) -> dict:
    """What every request must carry to decode what specjax.eval decoded: {"max_tokens",
    "temperature", "extra_body"} (stop_token_ids = its EOS set; penalties off, as specjax.eval has none)."""
    cfg = results["config"]
    return {"max_tokens": int(cfg["max_new_tokens"]), "temperature": float(cfg["temperature"]),
            "extra_body": {"stop_token_ids": [int(i) for i in cfg.get("eos_token_ids") or []],
                           "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}}


# ---------------------------------------------------------------------------------------------
# the comparison


def load_bench_results(path: str) -> dict:
    """specjax.bench's results.json (or the --out folder holding it)."""
    if os.path.isdir(path):
        path = os.path.join(path, RESULTS_FILE)
    res = _read_json(path, "specjax.bench results")
    if not isinstance(res, dict) or res.get("format") != BENCH_FORMAT or not isinstance(res.get("arms"), dict):
        raise ValueError(f"specjax.bench results {path}: not a specjax.bench results.json (written by "
                         "`python -m specjax.bench --out DIR`)")
    return res


def _first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """The first index where a and b differ (the shorter length when one is a prefix of the other);
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _cut_at_stop(ids: Sequence[int], stop: set) -> list[int]:
    for i, t in enumerate(ids):
        if t in stop:
            return list(ids[:i])
    return list(ids)


def _tau(steps: int, accepted: Sequence[int]) -> Optional[float]:
    return 1.0 + sum(accepted) / steps if steps else None


def _server_dtype(bench: dict, arm: str) -> Optional[str]:
    """The --dtype in the server's launch command as recorded by --server-flags, None when not recorded."""
    flags = ((bench.get("servers") or {}).get(arm) or {}).get("flags")
    if not flags:
        return None
    try:
        words = shlex.split(flags)
    except ValueError:
        return None
    for i, w in enumerate(words):
        if w == "--dtype" and i + 1 < len(words):
            return words[i + 1]
        if w.startswith("--dtype="):
            return w.split("=", 1)[1]
    return "auto (no --dtype)"


def _level(bench: dict, arm: str, concurrency: int) -> dict:
    arms = bench["arms"]
    if arm not in arms:
        raise ValueError(f"the benchmark has no arm {arm!r} (it has {', '.join(arms)}); pass --arm")
    for lv in arms[arm]["levels"]:
        if lv.get("concurrency") == concurrency:
            return lv
    have = [lv.get("concurrency") for lv in arms[arm]["levels"]]
    raise ValueError(f"the benchmark's arm {arm!r} has no level at concurrency {concurrency} (it has {have}); "
                     "per-request counters exist at concurrency 1 only: run specjax.bench with --concurrency 1")


def compare_runs(eval_results: dict, bench: dict, *, arm: str = "spec", concurrency: int = 1) -> dict:
    """Per-turn rows and totals (see the module docstring) of specjax.eval's record against one level
    of a benchmark. Rows: {"dataset", "id", "turn", "prompt_tokens", "match" (how the request was
    found: "token ids", "prompt id" or None), "input_diff" (first differing prompt position, None when
    equal or unknown), "inputs_verified", "eval_steps", "eval_accepted", "engine_drafts",
    "engine_accepted", "eval_tau", "engine_tau", "eval_tokens", "engine_tokens", "output_diff",
    "counts_equal", "outputs_equal", "equal", "problem"}."""
    cfg = eval_results["config"]
    k = int(cfg["num_spec_tokens"])
    stop = {int(i) for i in cfg.get("eos_token_ids") or []}
    level = _level(bench, arm, concurrency)
    requests = sorted((r for r in level["requests"] if r.get("ok")), key=lambda r: (r.get("window") or 0, r["index"]))
    by_ids: dict[tuple, dict] = {}
    by_key: dict[tuple, dict] = {}
    for r in requests:  # the first of repeated requests (windows) is the one compared
        if r.get("prompt_token_ids") is not None:
            by_ids.setdefault(tuple(r["prompt_token_ids"]), r)
        by_key.setdefault((str(r.get("dataset")), str(r.get("job_id")), int(r.get("turn") or 0)), r)
    rows = []
    for rec in eval_results["prompts"]:
        for t, turn in enumerate(rec["turns"]):
            ids = [int(x) for x in turn["prompt_ids"]]
            spec = turn["spec"]
            row: dict[str, Any] = {
                "dataset": str(rec["dataset"]), "id": str(rec["id"]), "turn": t, "prompt_tokens": len(ids),
                "eval_steps": int(spec["num_steps"]), "eval_accepted": [int(x) for x in spec["accepted_per_position"]],
                "eval_tokens": len(turn["output_ids"]), "match": None, "input_diff": None, "inputs_verified": False,
                "engine_drafts": None, "engine_accepted": None, "engine_tau": None, "engine_tokens": None,
                "output_diff": None, "counts_equal": False, "outputs_equal": False, "equal": False, "problem": None}
            row["eval_tau"] = _tau(row["eval_steps"], row["eval_accepted"])
            r = by_ids.get(tuple(ids))
            if r is not None:
                # ids the benchmark sent (no echo from the server) match by construction: unverified
                row.update(match="token ids", inputs_verified=r.get("prompt_token_ids_from") != "sent")
            else:
                r = by_key.get((row["dataset"], row["id"], t))
                if r is not None:
                    row["match"] = "prompt id"
                    if r.get("prompt_token_ids") is not None:
                        row["input_diff"] = _first_difference(ids, r["prompt_token_ids"])
                        row["inputs_verified"] = True
            if r is None:
                row["problem"] = "no request of the benchmark had this prompt"
                rows.append(row)
                continue
            c = r.get("spec")
            if c is not None:
                row.update(engine_drafts=int(c["drafts"]), engine_accepted=[int(x) for x in c["accepted_per_pos"]])
                row["engine_tau"] = _tau(row["engine_drafts"], row["engine_accepted"])
                row["counts_equal"] = (row["engine_drafts"], row["engine_accepted"]) == (row["eval_steps"],
                                                                                         row["eval_accepted"])
            out = r.get("output_token_ids")
            if out is not None:
                engine_out = _cut_at_stop(out, stop)
                row["engine_tokens"] = len(engine_out)
                row["output_diff"] = _first_difference([int(x) for x in turn["output_ids"]], engine_out)
                row["outputs_equal"] = row["output_diff"] is None
            problems = []
            if row["input_diff"] is not None:
                problems.append(f"prompt ids differ from position {row['input_diff']}")
            if c is None:
                problems.append("no per-request counters (concurrency > 1, SGLang, or a failed /metrics scrape)")
            elif len(row["engine_accepted"]) != k:
                problems.append(f"the engine drafted {len(row['engine_accepted'])} tokens per step, specjax.eval {k}")
            if out is None:
                problems.append("no output token ids (the server did not return them, or --no-token-ids)")
            row["problem"] = "; ".join(problems) or None
            row["equal"] = row["input_diff"] is None and row["counts_equal"] and row["outputs_equal"]
            rows.append(row)
    return {"eval": {"dtype": cfg.get("dtype"), "num_spec_tokens": k, "temperature": cfg.get("temperature"),
                     "max_new_tokens": cfg.get("max_new_tokens"), "target": cfg.get("target"), "draft": cfg.get("draft")},
            "engine": {"arm": arm, "concurrency": concurrency, "engine": (level.get("spec") or {}).get("engine"),
                       "server_dtype": _server_dtype(bench, arm),
                       "url": ((bench.get("servers") or {}).get(arm) or {}).get("url")},
            "rows": rows, "totals": _totals(rows, k), "equal_turns": sum(r["equal"] for r in rows),
            "turns": len(rows)}


def _totals(rows: list[dict], k: int) -> dict:
    """Sums per dataset and overall ("all") over the turns both sides counted."""
    out: dict[str, dict] = {}
    for name in [*dict.fromkeys(r["dataset"] for r in rows), "all"]:
        sel = [r for r in rows if (name == "all" or r["dataset"] == name)]
        counted = [r for r in sel if r["engine_drafts"] is not None and len(r["engine_accepted"]) == k]
        steps = sum(r["eval_steps"] for r in counted)
        drafts = sum(r["engine_drafts"] for r in counted)
        e_acc = [sum(r["eval_accepted"][i] for r in counted) for i in range(k)]
        g_acc = [sum(r["engine_accepted"][i] for r in counted) for i in range(k)]
        out[name] = {"turns": len(sel), "counted_turns": len(counted), "equal_turns": sum(r["equal"] for r in sel),
                     "eval_steps": steps, "engine_drafts": drafts, "eval_accepted": e_acc, "engine_accepted": g_acc,
                     "eval_tau": _tau(steps, e_acc), "engine_tau": _tau(drafts, g_acc),
                     "eval_acceptance": [a / steps if steps else None for a in e_acc],
                     "engine_acceptance": [a / drafts if drafts else None for a in g_acc]}
    return out


def _f(x: Optional[float], fmt: str = ".4f") -> str:
    return "–" if x is None else format(x, fmt)


def format_comparison(cmp: dict, eval_path: str = "specjax.eval", bench_path: str = "specjax.bench") -> str:
    ev, en = cmp["eval"], cmp["engine"]
    lines = [f"specjax.eval {eval_path} ({ev['dtype']}, K={ev['num_spec_tokens']}, temperature {ev['temperature']}, "
             f"max_new_tokens {ev['max_new_tokens']})",
             f"engine {en['engine'] or '?'} of specjax.bench {bench_path} (arm {en['arm']}, concurrency "
             f"{en['concurrency']}, server --dtype {en['server_dtype'] or 'not recorded (pass --server-flags)'})"]
    sd = en["server_dtype"]
    if sd is not None and ev["dtype"] is not None and sd != ev["dtype"]:
        lines.append(f"WARNING: the server ran with --dtype {sd}, specjax.eval in {ev['dtype']}: expect other text "
                     "and counts (python -m specjax.serve_cmd --eval-results prints the matching command)")
    if ev["temperature"]:
        lines.append(f"note: temperature {ev['temperature']}: both sides sample, so outputs and counts are "
                     "draws, not expected to be equal")
    head = ["prompt", "turn", "input", "steps", "drafts", "eval accepted/pos", "engine accepted/pos", "tau eval",
            "tau engine", "output"]
    body = []
    for r in cmp["rows"]:
        if r["match"] is None:
            inp = "missing"
        elif r["input_diff"] is not None:
            inp = f"differs@{r['input_diff']}"
        else:
            inp = "same" if r["inputs_verified"] else "unverified"
        if r["engine_tokens"] is None:
            outp = "–"
        elif r["outputs_equal"]:
            outp = f"same ({r['eval_tokens']})"
        else:
            outp = f"differs@{r['output_diff']} ({r['eval_tokens']}/{r['engine_tokens']})"
        pid = os.path.basename(r["id"]) if r["id"].startswith("/") else r["id"]  # a file's row: path:line
        body.append([f"{r['dataset']}/{pid}", str(r["turn"]), inp, str(r["eval_steps"]),
                     "–" if r["engine_drafts"] is None else str(r["engine_drafts"]),
                     str(r["eval_accepted"]), "–" if r["engine_accepted"] is None else str(r["engine_accepted"]),
                     _f(r["eval_tau"]), _f(r["engine_tau"]), outp + ("" if r["equal"] else "  *")])
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    lines += ["", line(head), line(["-" * w for w in widths]), *map(line, body)]
    problems = [f"  {r['dataset']}/{r['id']} turn {r['turn']}: {r['problem']}" for r in cmp["rows"] if r["problem"]]
    if problems:
        lines += ["", "problems:", *problems]
    lines.append("")
    for name, t in cmp["totals"].items():
        label = "all" if name == "all" else f"dataset {name}"
        lines.append(f"{label}: {t['equal_turns']}/{t['turns']} turns equal; over the {t['counted_turns']} turns both "
                     f"counted: steps {t['eval_steps']} / drafts {t['engine_drafts']}; accepted/pos {t['eval_accepted']} / "
                     f"{t['engine_accepted']}; tau {_f(t['eval_tau'])} / {_f(t['engine_tau'])} (specjax.eval / engine)")
        lines.append("  acceptance per position: " + "  ".join(
            f"{i}: {_f(a, '.3f')} / {_f(b, '.3f')}" for i, (a, b) in enumerate(zip(t["eval_acceptance"],
                                                                                    t["engine_acceptance"]))))
        if len(cmp["totals"]) == 2:  # one dataset: its totals are "all"'s
            break
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m specjax.bench compare",
        description="Compare an engine's per-prompt outputs and spec-decode counts (a specjax.bench run with "
                    "--eval-tokens, or any run with token ids at concurrency 1) with specjax.eval's on the same "
                    "prompt token ids.")
    ap.add_argument("eval_results", help="results JSON of `python -m specjax.eval --record-tokens --out FILE`")
    ap.add_argument("bench_results", help="results.json of `python -m specjax.bench --out DIR` (or DIR)")
    ap.add_argument("--arm", default="spec", help="the benchmark's arm to compare (default spec: the --url server)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="the benchmark level to compare (default 1: the only one with per-request counters)")
    ap.add_argument("--require-equal", action="store_true",
                    help="exit 1 unless every turn has the same inputs, outputs and counts (what float32 gives)")
    ap.add_argument("--out", default=None, help="also write the comparison as JSON to this file")
    args = ap.parse_args(argv)
    try:
        ev = load_eval_record(args.eval_results)
        bench = load_bench_results(args.bench_results)
        cmp = compare_runs(ev, bench, arm=args.arm, concurrency=args.concurrency)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_comparison(cmp, args.eval_results, args.bench_results))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(cmp, f, indent=1)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.require_equal and cmp["equal_turns"] < cmp["turns"]:
        note = "" if cmp["eval"]["dtype"] == "float32" else (
            f" (specjax.eval ran in {cmp['eval']['dtype']}: near-ties round differently outside float32)")
        print(f"error: {cmp['turns'] - cmp['equal_turns']} of {cmp['turns']} turns differ (--require-equal){note}",
              file=sys.stderr)
        return 1
    return 0

"""τ of a `specjax.eval` results file split by where the tokens are: by turn, by prompt category, and
over each turn's first N new tokens only. A decode-speed benchmark that generates N tokens of first
turns sees the last of these, not the file's overall τ.

    python benchmarks/tau_by_turn.py RESULTS.json[.gz] [--first-tokens 128] [--out summary.json]

Whole groups use `specjax.eval.report.summarize_dataset` on the group's turns: τ as the file reports
it (1 + accepted drafts / steps, vLLM's count) with its 95% interval, prompts as the unit. The records
keep accepted drafts per turn, not per step, so a first-N group reports tokens per step over the steps
that start before token N instead (the step that crosses N counts whole); that equals 1 + accepted /
steps except for a step that an EOS or the length limit cut short, which only a turn's last step can be.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_results  # noqa: E402

from specjax.eval.measure import _with_totals  # noqa: E402
from specjax.eval.report import check_results, summarize_dataset  # noqa: E402


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        res = json.load(f)
    try:
        return check_results(res, path)
    except ValueError as e:
        raise SystemExit(str(e)) from None


def first_tokens(accept_lengths: list[int], n: int) -> tuple[int, int]:
    """(tokens, steps) of the steps that start before token n of the turn (the step that crosses n is
    counted whole, as a decoder generating n tokens would run it)."""
    tokens = steps = 0
    for a in accept_lengths:
        if tokens >= n:
            break
        tokens += a
        steps += 1
    return tokens, steps


def tau_by_turn(res: dict, first: int) -> dict:
    k = len(res["prompts"][0]["turns"][0]["spec"]["accepted_per_position"])
    records = collections.defaultdict(list)  # group -> records holding only the group's turns
    heads = collections.defaultdict(lambda: [0, 0])  # "turn i, first N tokens" -> [tokens, steps]
    for p in res["prompts"]:
        by_key = collections.defaultdict(list)
        for i, turn in enumerate(p["turns"]):
            for key in ("all", f"turn {i + 1}", f"category {p.get('category') or '-'}"):
                by_key[key].append(turn)
            t, s = first_tokens(turn["spec"]["accept_lengths"], first)
            heads[f"turn {i + 1}, first {first} tokens"][0] += t
            heads[f"turn {i + 1}, first {first} tokens"][1] += s
        for key, turns in by_key.items():
            records[key].append(_with_totals({"id": p.get("id"), "turns": turns}, k))
    out = {}
    for key, recs in sorted(records.items()):
        s = summarize_dataset(recs, k)
        out[key] = {"turns": s["n_turns"], "steps": s["steps"], "tau": s["tau"]["value"],
                    "tau_interval": [s["tau"]["lo"], s["tau"]["hi"]],
                    "tokens_per_step": s["tokens_per_step"]["value"]}
    for key, (t, s) in sorted(heads.items()):
        out[key] = {"steps": s, "tokens_per_step": t / s if s else float("nan")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("--first-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = tau_by_turn(_load(a.results), a.first_tokens)
    for key, r in rows.items():
        tau = f"tau {r['tau']:.3f} [{r['tau_interval'][0]:.3f}, {r['tau_interval'][1]:.3f}]" if "tau" in r else " " * 26
        print(f"{key:28s} steps {r['steps']:6d}  {tau}  tokens/step {r['tokens_per_step']:.3f}")
    return write_results({"results": os.path.basename(a.results), "first_tokens": a.first_tokens, "groups": rows}, a.out)


if __name__ == "__main__":
    sys.exit(main())

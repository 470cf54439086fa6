"""τ of a `specjax.eval` results file split by where the tokens are: by turn, by prompt category, and
over each turn's first N new tokens only. A decode-speed benchmark that generates N tokens of first
turns sees the last of these, not the file's overall τ.

    python benchmarks/tau_by_turn.py RESULTS.json[.gz] [--first-tokens 128] [--out summary.json]

τ here is new tokens over speculative steps (each step emits its accepted drafts plus one target
token), summed over the turns in the group.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_results  # noqa: E402


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        res = json.load(f)
    if not isinstance(res, dict) or "prompts" not in res:
        raise SystemExit(f"{path}: not a specjax.eval results file (no 'prompts'); give one written by "
                         "`python -m specjax.eval --out`")
    return res


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
    groups = collections.defaultdict(lambda: [0, 0])
    for p in res["prompts"]:
        for i, turn in enumerate(p["turns"]):
            spec = turn["spec"]
            for key in ("all", f"turn {i + 1}", f"category {p.get('category') or '-'}"):
                groups[key][0] += spec["new_tokens"]
                groups[key][1] += spec["num_steps"]
            if "accept_lengths" not in spec:
                raise SystemExit("the results file has no per-step accept lengths; re-run specjax.eval with this version")
            t, s = first_tokens(spec["accept_lengths"], first)
            groups[f"turn {i + 1}, first {first} tokens"][0] += t
            groups[f"turn {i + 1}, first {first} tokens"][1] += s
    return {k: {"tokens": t, "steps": s, "tau": t / s if s else float("nan")} for k, (t, s) in sorted(groups.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("--first-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = tau_by_turn(_load(a.results), a.first_tokens)
    for k, r in rows.items():
        print(f"{k:32s} tokens {r['tokens']:7d} steps {r['steps']:6d} tau {r['tau']:.3f}")
    return write_results({"results": os.path.basename(a.results), "first_tokens": a.first_tokens, "groups": rows}, a.out)


if __name__ == "__main__":
    sys.exit(main())

"""Lossless speculative decoding, counted per target family (issue 19's CPU table): for every
registered decoding family, a tiny random target (fp32, CPU), `--prompts` random prompts, and four
decoders: a random EAGLE-3 head and a near-oracle head (the target's own greedy continuation with one
wrong draft whose position moves every step, so every rollback position is exercised), each in chain
and tree mode (K = 3). A turn matches when the speculative output equals the target's greedy output
(`specjax.eval.generate`) token for token.

The device loop (`specjax.eval.spec_loop.SpecLoop`, what decode_speed.py times) is counted apart, on
the same families rebuilt with a `--loop-vocab`-token vocabulary (default 6) and a random head over all
of it, so that its random drafts are accepted at every position (accepted_per_position says how often):
batches of `--loop-batch` ragged prompts in chain and tree mode, and the refill stream (`refill=True`,
`--loop-batch` rows for all prompts) in chain mode.

    python benchmarks/lossless_families.py [--prompts 20] [--max-new-tokens 12] [--loop-vocab 6]
        [--loop-batch 4] [--out results.json]

The targets and the near-oracle decoders are the test suite's (tests/parity/test_decoding_families.py,
tests/parity/test_decoding_nemotron_h.py, tests/eval/_models.py), so this counts over many prompts what
those tests assert on a few.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the suite's own module names (tests/ on the path, as pytest has it): the Nemotron-H tests import
# parity.test_decoding_families, so one module serves both
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "kernels")]


def _targets(tmp: str, vocab: int | None = None):
    import parity.test_decoding_families as fam
    import parity.test_decoding_nemotron_h as nemo
    from eval._models import VOCAB, build_target

    from specjax.targets import load_target

    assert VOCAB == fam.VOCAB == nemo.VOCAB
    v = vocab or fam.VOCAB
    out = {}
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        path = build_target(pathlib.Path(tmp), arch, tied=False, vocab_size=v)
        out[arch] = load_target(path, dtype="float32")
    for name in fam.FAMILIES:
        t = fam.build(name, vocab=v)
        out[t.config.architecture] = t
    t = nemo.build(vocab=v)
    out[t.config.architecture] = t
    return out, fam


def _loop_rows(a, prompt_rng) -> list[dict]:
    """The device loop's rows: every family at a --loop-vocab vocabulary, a random head drafting over
    all of it, chain and tree in batches of --loop-batch, and the chain refill stream."""
    import jax

    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, random_draft
    from specjax.eval.spec_loop import SpecLoop

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        targets, _ = _targets(tmp, vocab=a.loop_vocab)
        for arch, target in targets.items():
            v = int(target.config.vocab_size)
            prompts = [prompt_rng.integers(0, v, size=int(prompt_rng.integers(3, 20))).tolist()
                       for _ in range(a.prompts)]
            refs = generate(target, prompts, max_new_tokens=a.max_new_tokens, batch_size=len(prompts))
            # each family compiles its own loops: drop the earlier families' executables first (with all of
            # them held, the last family's compile failed with LLVM "Cannot allocate memory")
            jax.clear_caches()
            draft = random_draft(target)
            for mode, refill in (("chain", False), ("tree", False), ("chain", True)):
                t0 = time.time()
                dec = SpecDecoder(target, draft, num_spec_tokens=a.k, mode=mode, tree_top_k=2)
                got = SpecLoop(dec).generate(prompts, max_new_tokens=a.max_new_tokens, batch_size=a.loop_batch,
                                             refill=refill)
                matched = sum(r.tokens == ref for r, ref in zip(got, refs))
                steps = sum(r.num_steps for r in got)
                per_pos = [sum(r.accepted_per_position[i] for r in got) for i in range(a.k)]
                row = {"architecture": arch, "head": f"random, vocab {v}", "mode": mode,
                       "decoder": f"SpecLoop, {'refill' if refill else 'batches'} of {a.loop_batch}",
                       "turns": len(prompts), "matched": matched, "tau": 1 + sum(per_pos) / max(steps, 1),
                       "accepted_per_position": per_pos, "wall_s": round(time.time() - t0, 1)}
                rows.append(row)
                print(f"{arch:26s} loop {mode:5s} {'refill ' if refill else 'batched'} matched {matched}/{len(prompts)}"
                      f"  tau {row['tau']:.2f}  accepted per position {per_pos}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--loop-vocab", type=int, default=6, help="vocabulary of the device loop's targets")
    ap.add_argument("--loop-batch", type=int, default=4, help="rows of the device loop's batches")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    from specjax.eval.generate import generate

    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        targets, fam = _targets(tmp)
        for arch, target in targets.items():
            vocab = int(target.config.vocab_size)
            prompts = [rng.integers(0, vocab, size=int(rng.integers(3, 20))).tolist() for _ in range(a.prompts)]
            # greedy references long enough for the near-oracle to look K tokens ahead
            refs = generate(target, prompts, max_new_tokens=a.max_new_tokens + a.k + 1, batch_size=len(prompts))
            jax.clear_caches()  # as in _loop_rows
            draft = fam.random_draft(target)
            for head in ("random", "near-oracle"):
                for mode in ("chain", "tree"):
                    t0 = time.time()
                    matched = accepted = steps = 0
                    for p, ref in zip(prompts, refs):
                        if head == "random":
                            dec = fam.SpecDecoder(target, draft, num_spec_tokens=a.k, mode=mode, tree_top_k=2)
                        else:
                            cls = fam.OneWrongChain if mode == "chain" else fam.OneWrongTree
                            dec = cls(target, draft, num_spec_tokens=a.k, mode=mode, tree_top_k=2, tree_max_width=8)
                            dec.ref, dec.calls = ref, 0
                        res = dec.generate(p, max_new_tokens=a.max_new_tokens)
                        matched += res.tokens == ref[: a.max_new_tokens]
                        accepted += sum(res.accepted_per_position)
                        steps += res.num_steps
                    row = {"architecture": arch, "head": head, "mode": mode, "decoder": "SpecDecoder",
                           "turns": len(prompts), "matched": matched,
                           "tau": 1 + accepted / max(steps, 1), "wall_s": round(time.time() - t0, 1)}
                    rows.append(row)
                    print(f"{arch:26s} {head:11s} {mode:5s} matched {matched}/{len(prompts)}  tau {row['tau']:.2f}",
                          flush=True)
    rows += _loop_rows(a, rng)
    result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"platform": platform.platform(), "jax": jax.__version__, "backend": jax.default_backend()},
              "settings": vars(a), "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(r["matched"] == r["turns"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Op counts of the compiled speculative loop (`spec_loop._spec_batch`) on this machine's backend:
the tests' tiny Llama target (4 layers), a random EAGLE-3 head, K = 5, 32 new tokens, `--batch` rows.
XLA dumps the optimised module; this counts its ops by kind and the shapes of its scatters and copies
(decode_speed.md, "Changed since run 6"). Compiler structure, not speed: XLA:GPU fuses differently.

    JAX_PLATFORMS=cpu PYTHONPATH=tests:kernels:converters:. python benchmarks/loop_ops.py --batch 8
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dump", default=None, help="XLA dump folder (default: a temporary one)")
    a = ap.parse_args(argv)
    dump = a.dump or tempfile.mkdtemp()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
    import pathlib

    from eval._models import build_target  # the test suite's tiny-target builder (tests/ on PYTHONPATH)
    from specjax.eval.spec_decode import SpecDecoder, random_draft
    from specjax.eval.spec_loop import SpecLoop
    from specjax.targets.loading import load_target

    target = load_target(build_target(pathlib.Path(tempfile.mkdtemp()), "LlamaForCausalLM", False, seed=1,
                                      vocab_size=64), dtype="float32")
    draft = random_draft(target)
    prompts = [list(range(1, 9 + i)) for i in range(a.batch)]
    SpecLoop(SpecDecoder(target, draft, num_spec_tokens=5)).generate(prompts, max_new_tokens=32)
    found = sorted(glob.glob(f"{dump}/*jit__spec_batch*after_optimizations.txt"))
    if not found:
        raise SystemExit(f"no optimised jit__spec_batch module in {dump}")
    text = open(found[-1]).read()
    ops = collections.Counter(re.findall(r"= \S+ ([a-z-]+)\(", text))
    print(f"module: {found[-1]}")
    for op in ("scatter", "gather", "dynamic-update-slice", "dynamic-slice", "copy", "select", "fusion"):
        print(f"{op:22s} {ops[op]}")
    for op in ("scatter", "copy"):
        shapes = collections.Counter(re.findall(rf"= (\S+) {op}\(", text))
        print(f"{op} shapes: " + ", ".join(f"{n} x {s.split('{')[0]}" for s, n in shapes.most_common(6)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

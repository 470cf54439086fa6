"""Regeneration speed: `specjax.eval.generate` (prefill + one `lax.while_loop` of one-token steps per
batch, what `regenerate` with the JAX back end runs) on a target of a config.json's shape with random
weights drawn on the device, random prompt ids and no EOS (every row runs `--max-new-tokens`), per
batch size and per `kernels.decode_attention` implementation, side by side in one process.

    python benchmarks/regen_speed.py [--random-target configs/targets/smollm2_135m] [--batch 256,512]
        [--prompt-len 600] [--max-new-tokens 384] [--impl xla,auto] [--repeats 2] [--out results.json]

Generated tok/s = batch x max_new_tokens / wall of one `generate` call (host included), after one
untimed call (the compile); `step_ms` = wall / max_new_tokens. The outputs of the implementations are
compared token for token (bf16 near-ties may flip a row; counted, not asserted).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-target", default=os.path.join(ROOT, "configs/targets/smollm2_135m"))
    ap.add_argument("--batch", default="256,512")
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--impl", default="xla,auto", help="kernels.decode_attention values to compare")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import jax
    import numpy as np

    from specjax.eval.generate import generate
    from specjax.targets.loading import read_hf_config
    from specjax.targets.shapes import make_target, random_params_on_device
    from specjax_kernels._select import recording_choices

    hf = read_hf_config(a.random_target)
    base = make_target(hf)
    params = random_params_on_device(type(base), base.config, dtype=a.dtype)
    rng = np.random.default_rng(0)
    rows = []
    for batch in [int(x) for x in a.batch.split(",")]:
        lens = rng.integers(a.prompt_len // 2, a.prompt_len + 1, size=batch)
        prompts = [rng.integers(0, base.config.vocab_size, size=int(n)).tolist() for n in lens]
        outs = {}
        for impl in a.impl.split(","):
            cfg = dataclasses.replace(base.config, decode_attention_implementation=impl)
            target = type(base)(cfg, base.hf_config, params)
            with recording_choices() as chosen:
                generate(target, prompts, max_new_tokens=a.max_new_tokens, batch_size=batch)  # compile
            walls = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                out = generate(target, prompts, max_new_tokens=a.max_new_tokens, batch_size=batch)
                walls.append(time.perf_counter() - t0)
            outs[impl] = out
            wall = min(walls)
            row = {"batch": batch, "impl": impl, "chosen": sorted(chosen.get("decode_attention", [])),
                   "prompt_len_mean": float(lens.mean()), "max_new_tokens": a.max_new_tokens,
                   "wall_s": [round(w, 3) for w in walls], "tok_per_s": round(batch * a.max_new_tokens / wall, 1),
                   "step_ms": round(1e3 * wall / a.max_new_tokens, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        ref = outs[a.impl.split(",")[0]]
        for impl, out in outs.items():
            same = sum(x == y for x, y in zip(out, ref))
            print(f"batch {batch}: {impl} rows equal to {a.impl.split(',')[0]}: {same}/{len(ref)}", flush=True)
            for r in rows:
                if r["batch"] == batch and r["impl"] == impl:
                    r["rows_equal_first_impl"] = same
    result = {"machine": platform.node(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "target": a.random_target, "dtype": a.dtype, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regeneration speed on a target of a config.json's shape with random weights drawn on the device and
random prompt ids, per batch size, per `kernels.decode_attention` implementation and per engine, side by
side in one process:
  generate    `specjax.eval.generate`: static batches (prefill + one `lax.while_loop` of one-token
              steps per batch, until the batch's longest answer ends)
  continuous  `specjax.eval.continuous.ContinuousGenerator` (what `regenerate` with the JAX back end
              runs): `batch` cache rows, each refilled with the next prompt when its answer ends

    python benchmarks/regen_speed.py [--random-target configs/targets/smollm2_135m] [--batch 256,512]
        [--prompts 4x] [--prompt-len 600] [--max-new-tokens 384] [--eos-ids 0] [--impl xla,auto]
        [--engine generate] [--repeats 2] [--out results.json] [--profile TRACE_DIR]

`--eos-ids N` makes N random token ids end a turn, so answers end at random lengths as real ones do
(with random weights each step ends a row with probability about N / vocab); 0 = no EOS, every row
runs `--max-new-tokens`. Generated tok/s = new tokens (EOS cut) / wall of one call over all `--prompts`
prompts (host included), after one untimed call (the compile). The outputs of every arm are compared
token for token with the first (bf16 near-ties may flip a row; counted, not asserted; sampled arms
draw differently per engine, so only their lengths compare).
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_results  # noqa: E402
from trace_ops import format_summary, summarize  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--random-target", default=os.path.join(ROOT, "configs/targets/smollm2_135m"))
    ap.add_argument("--batch", default="256,512")
    ap.add_argument("--prompts", default="1x", help="prompts per run: N, or Kx = K x the batch")
    ap.add_argument("--eos-ids", type=int, default=0, help="random token ids that end a turn (0: none)")
    ap.add_argument("--engine", default="generate", help="generate,continuous")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0 samples (random weights decode greedily into a few repeated tokens, which rarely are "
                         "an EOS; sampled tokens end rows at random lengths with --eos-ids)")
    ap.add_argument("--segment-steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--max-new-tokens", type=int, default=384)
    ap.add_argument("--impl", default="xla,auto", help="kernels.decode_attention values to compare")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed runs, trace one more run of each arm on its first --batch prompts "
                         "(jax.profiler, into DIR/<batch>_<impl>_<engine>) and store where the device time "
                         "went (trace_ops.summarize) in the arm's row")
    a = ap.parse_args(argv)

    import jax
    import numpy as np

    from specjax.eval.continuous import ContinuousGenerator, Request
    from specjax.eval.generate import generate
    from specjax.targets.loading import read_hf_config
    from specjax.targets.abstract import make_target, random_params_on_device
    from specjax_kernels.selection import recording_choices

    hf = read_hf_config(a.random_target)
    base = make_target(hf)
    params = random_params_on_device(type(base), base.config, dtype=a.dtype)
    rng = np.random.default_rng(0)
    vocab = base.config.vocab_size
    eos = rng.choice(vocab, size=a.eos_ids, replace=False).tolist() if a.eos_ids else []

    engine_stats: dict = {}

    def run(target, engine, prompts, batch):
        if engine == "generate":
            return generate(target, prompts, max_new_tokens=a.max_new_tokens, batch_size=batch, eos_token_ids=eos,
                            temperature=a.temperature)
        got = {}

        def done(key, tokens):
            got[key] = tokens

        gen = ContinuousGenerator(target, batch_size=batch, max_prompt_tokens=a.prompt_len,
                                  max_new_tokens=a.max_new_tokens, eos_token_ids=eos, segment_steps=a.segment_steps,
                                  temperature=a.temperature)
        gen.run((Request(i, tuple(p)) for i, p in enumerate(prompts)), done)
        engine_stats.clear()
        engine_stats.update(gen.stats)  # segments, refills, host_s vs wait_s of the last call
        return [got[i] for i in range(len(prompts))]

    rows = []
    for batch in [int(x) for x in a.batch.split(",")]:
        n = int(a.prompts[:-1]) * batch if a.prompts.endswith("x") else int(a.prompts)
        lens = rng.integers(a.prompt_len // 2, a.prompt_len + 1, size=n)
        prompts = [rng.integers(0, vocab, size=int(k)).tolist() for k in lens]
        outs = {}
        for impl in a.impl.split(","):
            cfg = dataclasses.replace(base.config, kernels=dataclasses.replace(base.config.kernels, decode_attention=impl))
            target = type(base)(cfg, base.hf_config, params)
            for engine in a.engine.split(","):
                with recording_choices() as chosen:
                    run(target, engine, prompts, batch)  # compile
                walls = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    out = run(target, engine, prompts, batch)
                    walls.append(time.perf_counter() - t0)
                outs[(impl, engine)] = out
                wall = min(walls)
                new = sum(len(o) for o in out)
                row = {"batch": batch, "prompts": n, "impl": impl, "engine": engine,
                       "chosen": sorted(chosen.get("decode_attention", [])), "prompt_len_mean": float(lens.mean()),
                       "max_new_tokens": a.max_new_tokens, "eos_ids": a.eos_ids, "temperature": a.temperature, "new_tokens": new,
                       "mean_answer": round(new / n, 1), "wall_s": [round(w, 3) for w in walls],
                       "tok_per_s": round(new / wall, 1)}
                if engine == "continuous":
                    row["engine_stats"] = {k: round(v, 3) if isinstance(v, float) else v
                                           for k, v in engine_stats.items()}
                if a.profile:
                    where = os.path.join(a.profile, f"{batch}_{impl}_{engine}")
                    with jax.profiler.trace(where):
                        run(target, engine, prompts[:batch], batch)
                    row["profile"] = summarize(where, top=30)
                    print(format_summary(row["profile"]), flush=True)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        first = next(iter(outs))
        for arm, out in outs.items():
            same = sum(x == y for x, y in zip(out, outs[first]))
            print(f"batch {batch}: {arm} rows equal to {first}: {same}/{len(out)}", flush=True)
            for r in rows:
                if r["batch"] == batch and (r["impl"], r["engine"]) == arm:
                    r["rows_equal_first_arm"] = same
    result = {"machine": platform.node(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "target": a.random_target, "dtype": a.dtype, "rows": rows}
    return write_results(result, a.out)


if __name__ == "__main__":
    sys.exit(main())

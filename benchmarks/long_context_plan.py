"""XLA compile plans of the EAGLE-3 train step at long context, batch 1 (nothing allocated, no GPU).

Builds the step exactly as benchmarks/train_throughput.py's specjax worker does (Llama-3.1-8B shape,
bf16 target, EAGLE-3 draft with K=7 and Vd=32000, AdamW with fp32 masters) from abstract inputs
(ShapeDtypeStructs), compiles it for the local backend and reports `compiled.memory_analysis()` and
the largest buffers of XLA's buffer assignment (from --xla_dump_to). On a CPU host these are XLA:CPU
plans: what scales with T, and its bytes per token, is the same algebra as on a GPU, but the GPU
compiler's fusion and scheduling differ, so the totals are not GPU measurements.

    PYTHONPATH=.:kernels:converters python benchmarks/long_context_plan.py --seqs 16384,32768 \
        [--layers 32] [--remat ...] [--top 15] [--json out.json]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_buffers(text: str) -> list[dict]:
    """The allocations of an XLA buffer-assignment dump: [{"index", "size", "kind", "values"}], largest first."""
    out = []
    cur = None
    for line in text.splitlines():
        m = re.match(r"allocation (\d+): size (\d+)(.*)", line)
        if m:
            cur = {"index": int(m.group(1)), "size": int(m.group(2)), "kind": m.group(3).strip(" :,"), "values": []}
            out.append(cur)
            continue
        if cur is not None and line.startswith(" value:"):
            cur["values"].append(line.strip()[len("value: "):])
        elif cur is not None and not line.startswith(" "):
            cur = None
    return sorted(out, key=lambda a: -a["size"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="16384,32768,65536,131072")
    ap.add_argument("--layers", type=int, default=32, help="target layers (32: Llama-3.1-8B)")
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--long-context", default=None,
                    help="train.long_context_tokens for the step (None: the default)")
    ap.add_argument("--target-attention", default="xla",
                    help="kernels.target_attention (default xla: the flash-style ttt_attention kernel, as the GPU's "
                         "auto picks its triton kernel; CPU's auto is the plain path with [T, T] scores)")
    ap.add_argument("--cpu-cse-barriers", action="store_true",
                    help="let XLA:CPU drop the optimization barriers (its default; remat then saves nothing)")
    ap.add_argument("--top", type=int, default=12, help="largest buffers to list")
    ap.add_argument("--values", type=int, default=2, help="HLO values printed per listed buffer")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dump = tempfile.mkdtemp(prefix="lcplan_")
    # XLA:CPU removes optimization barriers early (its cse_barrier_expander pass) and CSE then merges every
    # jax.checkpoint recomputation with the forward, so a CPU plan would show no remat saving at all; the
    # GPU and TPU pipelines keep the barriers. Keeping them here makes the CPU plan's remat the GPU's.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_module_re=.*train_step.*"
                               + ("" if args.cpu_cse_barriers else " --xla_disable_hlo_passes=cse_barrier_expander"))
    sys.path.insert(0, HERE)
    import jax
    import jax.numpy as jnp

    import train_throughput as tt
    from specjax import mesh as meshlib
    from specjax.config import OptimConfig
    from specjax.drafts import eagle3
    from specjax.drafts.ttt import TTTConfig
    from specjax.targets.abstract import abstract_params, make_target
    from specjax.train.optim import make_optimizer
    from specjax.train.step import build_step_fns, init_state

    hf = tt.llama_hf(128256, 4096, 14336, args.layers, 32, 8, 128)
    target = make_target(hf, attention_implementation=args.target_attention)
    tparams = abstract_params(type(target), target.config, "bfloat16")
    aux = tt.default_aux_ids(args.layers)
    dcfg = eagle3.config_from_target(target.config, draft_vocab_size=32000, aux_layer_ids=aux)
    opt = make_optimizer(OptimConfig(lr=1e-4, warmup_ratio=0.0, grad_clip=0.5), 100000)
    draft0 = jax.eval_shape(lambda: eagle3.init_draft_params(dcfg, jax.random.key(1)))
    kw = {} if args.long_context is None else {"long_context_tokens": int(args.long_context)}
    ttt = TTTConfig(ttt_steps=args.ttt_steps, step_decay=0.8, **kw)
    mesh = meshlib.make_mesh({}, devices=jax.devices()[:1])
    fns = build_step_fns(target, tparams, draft0, dcfg, ttt, opt, mesh, jnp.bfloat16)
    state = jax.eval_shape(lambda p: init_state(p, opt), draft0)
    V, Vd = hf["vocab_size"], 32000
    vocab = {"draft_ids": jax.ShapeDtypeStruct((Vd,), jnp.int32), "t2d": jax.ShapeDtypeStruct((V,), jnp.bool_),
             "d2t": jax.ShapeDtypeStruct((Vd,), jnp.int32)}
    copts = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    rows = []
    for T in [int(s) for s in args.seqs.split(",")]:
        before = set(glob.glob(os.path.join(dump, "*buffer-assignment.txt")))
        batch = {k: jax.ShapeDtypeStruct((1, T), jnp.int32) for k in ("input_ids", "loss_mask", "segment_ids",
                                                                         "positions")}
        t0 = time.perf_counter()
        compiled = fns.train_step.lower(state, tparams, vocab, batch).compile(compiler_options=copts)
        cs = time.perf_counter() - t0
        ma = compiled.memory_analysis()
        row = {"seq": T, "layers": args.layers, "long_context_tokens": args.long_context, "compile_s": round(cs, 1),
               "argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
               "alias": int(ma.alias_size_in_bytes), "temp": int(ma.temp_size_in_bytes)}
        row["plan"] = row["argument"] + row["output"] - row["alias"] + row["temp"]
        new = sorted(set(glob.glob(os.path.join(dump, "*buffer-assignment.txt"))) - before)
        bufs = parse_buffers(open(new[-1]).read()) if new else []
        row["buffers"] = [{"size": b["size"], "kind": b["kind"], "values": b["values"][:args.values]}
                          for b in bufs[:args.top]]
        rows.append(row)
        g = lambda b: f"{b / 2**30:.2f} GiB"
        print(f"T={T} layers={args.layers} compile {cs:.0f}s: plan {g(row['plan'])} = args {g(row['argument'])} "
              f"+ out {g(row['output'])} - alias {g(row['alias'])} + temp {g(row['temp'])}", flush=True)
        for b in row["buffers"]:
            print(f"   {b['size'] / 2**20:10.1f} MiB  {b['kind'][:60]}")
            for v in b["values"]:
                print(f"        {v[:200]}")
        del compiled
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

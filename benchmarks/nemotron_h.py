"""Nemotron-H target forward on one GPU: the full 52-block Nemotron 3 Nano / 3.5 Lightning 30B-A3B shape
with random bf16 weights, its blocks one by one, and the SSD scan implementations.

    JAX_PLATFORMS=cuda PYTHONPATH=kernels:. python benchmarks/nemotron_h.py --out results.json
    PYTHONPATH=kernels:. python benchmarks/nemotron_h.py --toy   # CPU smoke run at toy width

Reports: compile time and median forward time (wall clock around block_until_ready, after a warm-up)
at B x T tokens, tokens/s, and an MFU estimate from model FLOPs: 2 x active matmul params per
token (embedding excluded; 6 of 128 routed experts + the shared one) + causal attention 2*2*T/2*H*hd
per attention block + the SSD's chunked work. Also: the chunked SSD vs the sequential reference at a
full-width Mamba layer's shape, and fp32 GPU-vs-CPU agreement of a toy model (default GPU matmul
precision).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax.targets import nemotron_h as nh  # noqa: E402
from specjax.targets.base import tree_set  # noqa: E402
from specjax.targets.decoder import StackInputs  # noqa: E402
from specjax.targets.layers.attention import segment_causal_mask  # noqa: E402
from specjax_kernels.ssd import ssd  # noqa: E402

PEAK = 789e12  # bf16 matmul ceiling measured on the H200 (device README)


def timeit(f, *args, iters=10):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def random_params(cfg, key, dtype=jnp.bfloat16):
    """Per-leaf random init on the device (init_params draws one flat fp32 buffer: too big here)."""
    params, cache = {}, {}
    specs = nh.weight_specs(cfg)
    for i, spec in enumerate(specs):
        name = spec.path[-1]
        leaf_dtype = getattr(spec, "dtype", None) or dtype
        if name in ("scale", "D"):
            v = jnp.ones(spec.shape, leaf_dtype)
        elif name == "A_log":
            v = jnp.broadcast_to(jnp.log(jnp.arange(1, cfg.mamba_num_heads + 1, dtype=jnp.float32)), spec.shape).astype(leaf_dtype)
        elif name in ("dt_bias", "e_score_correction_bias", "bias"):
            v = jnp.zeros(spec.shape, leaf_dtype)  # softplus(0) = 0.69: a mid-range step
        else:
            fn = cache.setdefault((spec.shape, str(leaf_dtype)), jax.jit(
                lambda k, s=spec.shape, d=leaf_dtype: (0.02 * jax.random.normal(k, s, jnp.float32)).astype(d)))
            v = fn(jax.random.fold_in(key, i))
        tree_set(params, spec.path, v)
    return params


def model_flops_per_token(cfg, t):
    d = cfg.hidden_size
    m = cfg.mamba_dims
    n_m, n_a, n_e, n_f = (len(cfg.layers_of(k)) for k in nh.BLOCK_TYPES)
    mamba = d * m.in_proj_size + m.intermediate_size * d
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = d * (q + 2 * kv) + q * d
    moe = (cfg.num_experts_per_tok * 2 * cfg.moe_intermediate_size + 2 * cfg.moe_shared_expert_intermediate_size) * d + d * cfg.n_routed_experts
    mlp = 2 * d * cfg.intermediate_size
    matmul = 2 * (n_m * mamba + n_a * attn + n_e * moe + n_f * mlp + d * cfg.vocab_size)
    attn_scores = n_a * 2 * 2 * (t / 2) * q  # QK^T and PV, causal half
    q_len = m.chunk_size  # SSD: C.B and M.x within chunks, states in and out
    ssd_work = n_m * 2 * (m.n_groups * q_len * m.state_size + m.num_heads * q_len * m.head_dim
                          + 2 * m.num_heads * m.head_dim * m.state_size)
    return matmul + attn_scores + ssd_work


def bench_full(cfg, batches, t, out):
    key = jax.random.key(0)
    t0 = time.perf_counter()
    params = random_params(cfg, key)
    jax.block_until_ready(params)
    out["init_s"] = time.perf_counter() - t0
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    out["params_b"] = n_params / 1e9
    fwd = jax.jit(lambda p, ids: nh.forward(p, cfg, ids, aux_layer_ids=(2, 26, 48))
                  if cfg.num_hidden_layers == 52 else nh.forward(p, cfg, ids, aux_layer_ids=(1, 2, 3)))
    fpt = model_flops_per_token(cfg, t)
    for b in batches:
        ids = jax.random.randint(jax.random.key(b), (b, t), 0, cfg.vocab_size, jnp.int32)
        row = {"B": b, "T": t}
        try:
            t0 = time.perf_counter()
            compiled = fwd.lower(params, ids).compile()
            row["compile_s"] = time.perf_counter() - t0
            mem = compiled.memory_analysis()
            if mem is not None:
                row["temp_gib"] = mem.temp_size_in_bytes / 2**30
            sec = timeit(compiled, params, ids, iters=5)
            row.update(fwd_ms=1e3 * sec, tok_per_s=b * t / sec, mfu=fpt * b * t / sec / PEAK)
            final, aux = compiled(params, ids)
            row["finite"] = bool(jnp.isfinite(final.astype(jnp.float32)).all())
        except Exception as e:  # noqa: BLE001  (report OOM etc. and go on)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print("full", row, flush=True)
        out.setdefault("full", []).append(row)
    return params


def bench_blocks(cfg, params, b, t, out):
    """One block of each type at slot 0, alone (no residual stream effects)."""
    x = (0.5 * jax.random.normal(jax.random.key(1), (b, t, cfg.hidden_size), jnp.float32)).astype(jnp.bfloat16)
    seg = jnp.ones((b, t), jnp.int32)
    inputs = StackInputs(segment_causal_mask(seg), None, segment_ids=seg)
    for kind in nh.BLOCK_TYPES:
        if kind not in cfg.layer_types:
            continue
        lp = jax.tree.map(lambda a: a[0], params[nh._PARAM_KEY[kind]])
        f = jax.jit(lambda lp, x, kind=kind: nh.block(kind, lp, cfg, x, inputs)[0])
        row = {"block": kind, "B": b, "T": t, "ms": 1e3 * timeit(f, lp, x)}
        if kind == nh.MOE:
            for impl in ("xla", "reference"):
                c2 = dataclasses.replace(cfg, kernels=dataclasses.replace(cfg.kernels, moe=impl))
                g = jax.jit(lambda lp, x, c2=c2: nh.block(kind, lp, c2, x, inputs)[0])
                try:
                    row[f"ms_moe_{impl}"] = 1e3 * timeit(g, lp, x, iters=3)
                except Exception as e:  # noqa: BLE001
                    row[f"ms_moe_{impl}"] = f"{type(e).__name__}: {str(e)[:200]}"
        print("block", row, flush=True)
        out.setdefault("blocks", []).append(row)


def bench_ssd(cfg, b, t, out):
    m = cfg.mamba_dims
    ks = jax.random.split(jax.random.key(2), 4)
    x = jax.random.normal(ks[0], (b, t, m.num_heads, m.head_dim), jnp.bfloat16)
    dt = jax.nn.softplus(jax.random.normal(ks[1], (b, t, m.num_heads), jnp.float32) - 2.0)
    a = -jnp.exp(jnp.log(jnp.arange(1, m.num_heads + 1, dtype=jnp.float32)))
    bc = jax.random.normal(ks[2], (b, t, m.n_groups, m.state_size), jnp.bfloat16)
    cc = jax.random.normal(ks[3], (b, t, m.n_groups, m.state_size), jnp.bfloat16)
    seg = jnp.concatenate([jnp.ones((b, t // 2), jnp.int32), 2 * jnp.ones((b, t - t // 2), jnp.int32)], 1)
    ys = {}
    for impl, chunk in (("reference", 1), ("xla", 64), ("xla", 128), ("xla", 256)):
        f = jax.jit(lambda *args, impl=impl, chunk=chunk: ssd(*args, chunk_size=chunk, implementation=impl, segment_ids=seg))
        sec = timeit(f, x, dt, a, bc, cc, iters=5)
        ys[(impl, chunk)] = f(x, dt, a, bc, cc)
        row = {"impl": impl, "chunk": chunk, "B": b, "T": t, "ms": 1e3 * sec}
        print("ssd", row, flush=True)
        out.setdefault("ssd", []).append(row)
    ref = ys[("reference", 1)]
    for key, y in ys.items():
        out.setdefault("ssd_rel_err_vs_reference", {})[f"{key[0]}_{key[1]}"] = float(
            jnp.abs(y - ref).max() / jnp.abs(ref).max())
    print("ssd rel err", out["ssd_rel_err_vs_reference"], flush=True)


def gpu_vs_cpu(out):
    """A toy fp32 model on the accelerator vs the same on the CPU, at the default matmul precision
    (TF32 on Hopper) and at 'highest'; plus the chunked SSD vs the reference on the accelerator."""
    small = dict(nh.NEMOTRON_3_NANO_30B_A3B_HF_CONFIG, vocab_size=256, hidden_size=128, num_attention_heads=4,
                 head_dim=32, mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=32,
                 n_routed_experts=16, moe_intermediate_size=64, moe_shared_expert_intermediate_size=64)
    cfg = nh.NemotronHTargetConfig.from_hf(small)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        params = nh.init_params(cfg, jax.random.key(3), jnp.float32, std=0.1)
    ids = np.random.RandomState(0).randint(0, 256, (2, 200)).astype(np.int32)
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            fwd = jax.jit(lambda p, i: nh.forward(p, cfg, i, aux_layer_ids=(2, 26, 48)))
            with jax.default_device(cpu):
                ref_final, ref_aux = fwd(jax.device_put(params, cpu), jax.device_put(ids, cpu))
            dev_final, dev_aux = fwd(jax.device_put(params, jax.devices()[0]), ids)
        errs = {name: float(np.abs(np.asarray(d) - np.asarray(r)).max() / np.abs(np.asarray(r)).max())
                for name, d, r in zip(("aux2", "aux26", "aux48", "final"), (*dev_aux, dev_final), (*ref_aux, ref_final))}
        out[f"toy_fp32_accel_vs_cpu_{precision}"] = errs
        print(f"toy fp32 accelerator vs CPU ({precision} precision)", errs, flush=True)
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--toy", action="store_true", help="toy widths (CPU smoke run)")
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only-check", action="store_true", help="only the accelerator-vs-CPU agreement check")
    ap.add_argument("--no-check", action="store_true", help="skip that check (it needs JAX's CPU backend too)")
    args = ap.parse_args()
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    hf = dict(nh.NEMOTRON_3_NANO_30B_A3B_HF_CONFIG)
    if args.toy:
        hf.update(vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=16, mamba_num_heads=8,
                  mamba_head_dim=8, n_groups=2, ssm_state_size=16, chunk_size=32, n_routed_experts=16,
                  moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)
    cfg = nh.NemotronHTargetConfig.from_hf(hf)
    batches = [int(b) for b in args.batches.split(",")]
    print(out, flush=True)

    def save():  # after every section, so a run cut short still leaves its numbers
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)

    if not args.no_check:
        gpu_vs_cpu(out)
        save()
    if args.only_check:
        return
    bench_ssd(cfg, 1, args.T, out)
    save()
    params = bench_full(cfg, batches, args.T, out)
    save()
    bench_blocks(cfg, params, batches[-1], args.T, out)
    save()


if __name__ == "__main__":
    main()

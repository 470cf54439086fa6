"""One DeepSeek-V3 layer's two halves on the GPU against a dense-GEMM floor of the same FLOPs.

    python benchmarks/layer_floor.py [--config configs/targets/deepseek_v3] [--batch 1] [--seq 4096]
        [--formats bf16,fp8] [--iters 10] [--out results.json]

Parts, each its own jitted forward (the target is frozen: no backward), on random weights at the real
shape (normal(0, 0.02); norm scales 1; FP8 kernels the bf16 ones cast to e4m3 with scale 1):
  mla    the layer's input norm + multi-head latent attention (q LoRA, compressed KV, decoupled RoPE
         key; the training form: keys and values expanded from the latent, causal)
  moe    the post-attention norm + the sigmoid router (correction bias, group-limited top-k, routed
         scaling) + the routed experts through specjax_kernels.moe + the shared expert
  floor  one bf16 GEMM [B*T, D] x [D, N] with N chosen so it does the part's useful FLOPs
For `fp8`, each part reads the FP8 block-scaled kernels the release stores and dequantizes them inside
the jitted call, as the target's layer scan does; the floor stays bf16.

Useful FLOPs: 2 x (multiply-adds of each projection on every token); attention's QK^T and PV over the
causal pairs T(T+1)/2 per sequence (not the masked half); for the MoE the k routed experts, the shared
expert and the router per token. `vs floor` = floor time / part time (1.0 = as fast as a plain GEMM).
ms = median of `--iters` calls after two warm-up calls.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "kernels"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_results  # noqa: E402


def useful_flops(cfg, batch: int, seq: int) -> dict:
    """Useful FLOPs of the MLA and MoE parts of one layer on batch x seq tokens."""
    n, d = batch * seq, cfg.hidden_size
    m = cfg.mla
    h = m.num_heads
    q = (d * m.q_lora_rank + m.q_lora_rank * h * m.qk_head_dim) if m.q_lora_rank else d * h * m.qk_head_dim
    kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
    proj = n * (q + kv + h * m.v_head_dim * d)
    pairs = batch * seq * (seq + 1) // 2
    attn = pairs * h * (m.qk_head_dim + m.v_head_dim)
    experts = cfg.num_experts_per_tok + cfg.n_shared_experts
    moe = n * (experts * 3 * d * cfg.moe_intermediate_size + d * cfg.num_routed_experts)
    return {"mla": 2 * (proj + attn), "moe": 2 * moe}


def random_layer(target, dtype, seed: int):
    """Layer 0's params (stacked leaves indexed) from the family's weight map."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from specjax.targets.base import tree_set

    tree: dict = {}
    key = jax.random.key(seed)
    for i, spec in enumerate(type(target).weight_specs(target.config)):
        if spec.path[0] not in ("layers", "moe_layers"):
            continue
        shape = spec.shape[1:]
        k = jax.random.fold_in(key, i)
        if spec.path[-1] == "scale":
            value = jnp.ones(shape, dtype)
        elif spec.path[-1] == "kernel_scale_inv":
            value = jnp.ones(shape, jnp.float32)
        elif spec.dtype is not None and np.dtype(jnp.dtype(spec.dtype)).itemsize == 1:  # float8
            value = (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(spec.dtype)
        else:
            value = (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(spec.dtype or dtype)
        tree_set(tree, spec.path, value)
    return tree["layers"], tree["moe_layers"]


def time_fn(fn, args, iters: int) -> float:
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_format(fmt: str, hf_base: dict, batch: int, seq: int, iters: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from specjax.layers.norms import rms_norm
    from specjax.targets import deepseek_v3
    from specjax.targets.abstract import make_target
    from specjax.targets.layers import mla
    from specjax.targets.quantized import dequantize_layer_weights, layer_weights_dequantized

    hf = dict(hf_base, num_hidden_layers=1, first_k_dense_replace=0)
    if fmt == "bf16":
        hf.pop("quantization_config", None)
    elif fmt == "fp8":  # the published DeepSeek-V3 release's (config.json of deepseek-ai/DeepSeek-V3)
        hf.setdefault("quantization_config", {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]})
    else:
        raise ValueError(f"--formats: {fmt!r} is not bf16 or fp8")
    target = make_target(hf)
    cfg = target.config
    quant = getattr(cfg, "weight_quant", None)
    dtype = jnp.bfloat16
    attn_p, moe_p = random_layer(target, dtype, 0)
    x = (jax.random.normal(jax.random.key(7), (batch, seq, cfg.hidden_size), jnp.float32)).astype(dtype)
    ids = jnp.zeros((batch, seq), jnp.int32)
    inputs = deepseek_v3.forward_inputs(cfg, ids, None, None, dtype)

    def dequant(p):
        with layer_weights_dequantized(dtype, quant):
            return dequantize_layer_weights(p)

    @jax.jit
    def mla_part(p, x):
        p = dequant(p)
        h = rms_norm(x, p["input_layernorm"]["scale"], cfg.rms_norm_eps)
        return mla.mla_block(p["self_attn"], cfg.mla, h, inputs.mask, inputs.rope)[0]

    @jax.jit
    def moe_part(p, a, x):
        p = dequant(p)
        h = rms_norm(x, a["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
        return deepseek_v3.moe_ffn(p, cfg)(h)

    flops = useful_flops(cfg, batch, seq)
    rows = []
    d = cfg.hidden_size
    for part, fn, args in (("mla", mla_part, (attn_p, x)), ("moe", moe_part, (moe_p, attn_p, x))):
        s = time_fn(fn, args, iters)
        n_cols = max(128, round(flops[part] / (2 * batch * seq * d) / 128) * 128)
        w = (0.02 * jax.random.normal(jax.random.key(3), (d, n_cols), jnp.float32)).astype(dtype)
        gemm = jax.jit(lambda a, b: a.reshape(-1, d) @ b)
        fs = time_fn(gemm, (x, w), iters)
        floor_flops = 2 * batch * seq * d * n_cols
        floor_s = fs * flops[part] / floor_flops  # the floor's rate at exactly the part's FLOPs
        row = {"format": fmt, "part": part, "batch": batch, "seq": seq, "ms": s * 1e3,
               "tflop": flops[part] / 1e12, "tflops_per_s": flops[part] / s / 1e12,
               "floor_ms": floor_s * 1e3, "floor_gemm": [batch * seq, d, n_cols],
               "floor_tflops_per_s": floor_flops / fs / 1e12, "vs_floor": floor_s / s,
               "moe_impl": cfg.kernels.moe, "attention_impl": cfg.mla.implementation}
        print(f"{fmt:5s} {part:4s} {row['ms']:8.2f} ms {row['tflops_per_s']:7.1f} TFLOP/s | floor "
              f"{row['floor_ms']:7.2f} ms ({row['floor_tflops_per_s']:.0f} TFLOP/s) | vs floor {row['vs_floor']:.2f}",
              flush=True)
        rows.append(row)
        del w
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "targets", "deepseek_v3"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--formats", default="bf16,fp8")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import jax

    with open(os.path.join(a.config, "config.json")) as f:
        hf = json.load(f)
    t0 = time.perf_counter()
    rows = []
    for fmt in a.formats.split(","):
        rows.extend(run_format(fmt, hf, a.batch, a.seq, a.iters))
    dev = jax.devices()[0]
    result = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv,
              "device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
              "host": platform.node(), "config": a.config, "rows": rows, "elapsed_s": time.perf_counter() - t0}
    return write_results(result, a.out)


if __name__ == "__main__":
    sys.exit(main())

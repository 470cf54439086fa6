"""Routed experts through JAX's Hopper grouped GEMM (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``,
Mosaic GPU: TMA loads, wgmma, one persistent kernel over all experts' row tiles).

Rows are sorted by expert as in the reference; each of the three projections (gate, up, down) is one
grouped GEMM with no padding of experts to a capacity, bf16/fp16 in, fp32 accumulation, output in
the input dtype. The kernel has no VJP: it serves frozen targets' forwards (training differentiates
the draft only); a differentiated call raises, and `xla` is the differentiable GPU path.

Shape rules of the kernel: the contraction width must be a multiple of ``block_k`` and the output
width of ``block_n * grid_block_n``; ``gmm`` picks the blocks per projection (block_n 128, or 64 for a
width like Nemotron-H's 1856) and raises a clear error for a width that fits none (e.g. 96), which
`api.moe_experts` reports before falling back.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.moe.common import grouped_experts

# block_m, block_n, block_k, max_concurrent_steps: the fastest of six configurations that fit the
# H200's 227 KiB of shared memory in bf16, timed on the Qwen3-30B-A3B layer (8192 tokens, top-8 of 128,
# D 2048, F 768): 2.20 ms against 2.27-8.70 ms for the others (benchmarks/results/kernels.md, "MoE")
BLOCK_M, BLOCK_N, BLOCK_K, STEPS = 128, 128, 64, 6


# An output width that is not a multiple of BLOCK_N (Nemotron-H 30B-A3B's expert width 1856 = 29 x 64)
# runs with block_n = NARROW_BLOCK_N instead of falling back to xla.
NARROW_BLOCK_N = 64


def _blocks_n(n: int) -> tuple[int, int]:
    """(block_n, grid_block_n) for output width n."""
    for block_n in (BLOCK_N, NARROW_BLOCK_N):
        for g in (4, 2, 1):
            if n % (g * block_n) == 0:
                return block_n, g
    raise ValueError(f"moe mgpu: output width {n} is not a multiple of {NARROW_BLOCK_N}; use implementation='xla'")


def gmm(lhs, rhs, group_sizes):
    """lhs [M, K] (rows grouped by expert) @ rhs[e] [K, N] per group -> [M, N] in lhs's dtype."""
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot

    k, n = rhs.shape[1], rhs.shape[2]
    if k % BLOCK_K:
        raise ValueError(f"moe mgpu: contraction width {k} is not a multiple of {BLOCK_K}; use implementation='xla'")
    rhs = rhs.astype(lhs.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    m = lhs.shape[0]
    pad = -m % 8  # the kernel's output tiling needs a row count that is a multiple of 8
    if pad:  # zero rows appended to the last group (the rows are sorted by expert), cut off below
        lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
        group_sizes = group_sizes.at[-1].add(pad)
    block_n, grid_block_n = _blocks_n(n)
    out = ragged_dot(lhs, rhs, group_sizes=group_sizes, block_m=BLOCK_M, block_n=block_n, block_k=BLOCK_K,
                     max_concurrent_steps=STEPS, grid_block_n=grid_block_n)
    return out[:m]


def supports(x_td, up_edf, down_efd) -> str | None:
    """None when the kernel takes these shapes and dtypes, else why not."""
    if x_td.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {x_td.dtype} (the kernel multiplies bf16/fp16)"
    d, f = up_edf.shape[1], up_edf.shape[2]
    for width in (d, f):  # each is the contraction of one projection and the output of another
        if width % BLOCK_K or width % NARROW_BLOCK_N:
            return f"width {width} is not a multiple of {max(BLOCK_K, NARROW_BLOCK_N)}"
    return None


def moe_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf=None, activation="silu"):
    return grouped_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation, gmm)


def available() -> str | None:
    """None on a Hopper GPU (compute capability 9.x), else why the kernel cannot run here."""
    if jax.default_backend() != "gpu":
        return f"needs an NVIDIA Hopper GPU (backend is {jax.default_backend()})"
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not cc.startswith("9."):
        return f"needs compute capability 9.x (Hopper), this GPU has {cc or 'unknown'}"
    return None

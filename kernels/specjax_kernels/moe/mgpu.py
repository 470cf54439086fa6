"""Routed experts through JAX's Hopper grouped GEMM (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``,
Mosaic GPU: TMA loads, wgmma, one persistent kernel over all experts' row tiles).

Rows are sorted by expert as in the reference; each of the three projections (gate, up, down) is one
grouped GEMM with no padding of experts to a capacity, bf16/fp16 in, fp32 accumulation, output in
the input dtype. The kernel has no VJP: it serves frozen targets' forwards (training differentiates
the draft only); a differentiated call raises, and `xla` is the differentiable GPU path.

Shape rules of the kernel: the contraction width must be a multiple of ``block_k`` and the output
width of ``block_n * grid_block_n``; ``gmm`` picks the blocks per projection (``blocks_for``: a tuned
entry, block_n 128, or 64 for a width like Nemotron-H's 1856) and raises a clear error for a width
that fits none (e.g. 96), which `api.moe_experts` reports before falling back.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax_kernels.moe.common import grouped_experts, map_under_vmap

@dataclasses.dataclass(frozen=True)
class Blocks:
    """One ragged_dot_mgpu configuration: row / column / contraction tile, pipeline depth, and how many
    column tiles the persistent loop walks before the next row tile (``grid_block_n``, L2 reuse)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    steps: int = 6
    grid_block_n: int | None = None  # None: the largest of 4, 2, 1 dividing the column tiles

    def fits(self, n: int) -> bool:
        return n % (self.block_n * (self.grid_block_n or 1)) == 0


# The fastest of six configurations that fit the H200's 227 KiB of shared memory in bf16, timed on the
# whole Qwen3-30B-A3B layer (8192 tokens, top-8 of 128, D 2048, F 768): 2.20 ms against 2.27-8.70 ms
# for the others (benchmarks/results/kernels.md, "MoE").
DEFAULT = Blocks()
# An output width that is not a multiple of 128 (Nemotron-H 30B-A3B's expert width 1856 = 29 x 64)
# runs with block_n 64 instead of falling back to xla.
NARROW = dataclasses.replace(DEFAULT, block_n=64)
# Per (contraction K, output N): the best of 25 configurations for each grouped GEMM of the Qwen3-30B-A3B
# layer timed alone on an H200 (`python -m specjax_kernels.moe.bench --gmm-sweep`, 65,536 expert-sorted
# rows; benchmarks/results/kernels.md, "MoE: per-projection blocks"): gate / up 0.452 ms (DEFAULT's
# blocks: ~0.52), fused gate_up 0.864 ms (DEFAULT: 1.03), down 0.705 ms (DEFAULT: 0.74).
TUNED: dict[tuple[int, int], Blocks] = {
    (2048, 768): Blocks(128, 192, 64, 4, 4),
    (2048, 1536): Blocks(128, 192, 64, 4, 4),
    (768, 2048): Blocks(128, 128, 64, 5, 8),
}


def blocks_for(k: int, n: int) -> Blocks:
    """The configuration for a [M, k] x [k, n] grouped GEMM: the tuned one, else DEFAULT, else NARROW."""
    for b in (TUNED.get((k, n)), DEFAULT, NARROW):
        if b is not None and b.fits(n) and k % b.block_k == 0:
            return b
    if k % DEFAULT.block_k:
        raise ValueError(f"moe mgpu: contraction width {k} is not a multiple of {DEFAULT.block_k}; use implementation='xla'")
    raise ValueError(f"moe mgpu: output width {n} is not a multiple of {NARROW.block_n}; use implementation='xla'")


def gmm(lhs, rhs, group_sizes, blocks: Blocks | None = None):
    """lhs [M, K] (rows grouped by expert) @ rhs[e] [K, N] per group -> [M, N] in lhs's dtype.
    The Mosaic kernel has no batching rule (vmap of it failed in decode_speed.md's first MoE run), so a
    vmapped gmm runs each member as its own call (lax.map). moe_experts' forward never reaches this
    batched (its own rule folds the vmap into the rows, see api.per_token); this serves direct calls."""
    return map_under_vmap(functools.partial(_gmm, blocks=blocks))(lhs, rhs, group_sizes)


def _gmm(lhs, rhs, group_sizes, blocks: Blocks | None = None):
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot

    k, n = rhs.shape[1], rhs.shape[2]
    b = blocks or blocks_for(k, n)
    if k % b.block_k or not b.fits(n):
        raise ValueError(f"moe mgpu: {b} does not tile a [{k}, {n}] weight")
    rhs = rhs.astype(lhs.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    m = lhs.shape[0]
    pad = -m % 8  # the kernel's output tiling needs a row count that is a multiple of 8
    if pad:  # zero rows appended to the last group (the rows are sorted by expert), cut off below
        lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
        group_sizes = group_sizes.at[-1].add(pad)
    tiles_n = n // b.block_n
    grid_block_n = b.grid_block_n or next(g for g in (4, 2, 1) if tiles_n % g == 0)
    out = ragged_dot(lhs, rhs, group_sizes=group_sizes, block_m=b.block_m, block_n=b.block_n, block_k=b.block_k,
                     max_concurrent_steps=b.steps, grid_block_n=grid_block_n)
    return out[:m]


def supports(x_td, up_edf, down_efd) -> str | None:
    """None when the kernel takes these shapes and dtypes, else why not."""
    if x_td.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {x_td.dtype} (the kernel multiplies bf16/fp16)"
    d, f = up_edf.shape[1], down_efd.shape[1]
    for width in (d, f):  # each is the contraction of one projection and the output of another
        if width % DEFAULT.block_k or width % NARROW.block_n:
            return f"width {width} is not a multiple of {max(DEFAULT.block_k, NARROW.block_n)}"
    return None


def moe_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf=None, activation="silu", *,
                gate_up_bias=None, down_bias=None):
    return grouped_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation, gmm,
                           gate_up_bias=gate_up_bias, down_bias=down_bias)


def available() -> str | None:
    """None on a Hopper GPU (compute capability 9.x), else why the kernel cannot run here."""
    if jax.default_backend() != "gpu":
        return f"needs an NVIDIA Hopper GPU (backend is {jax.default_backend()})"
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not cc.startswith("9."):
        return f"needs compute capability 9.x (Hopper), this GPU has {cc or 'unknown'}"
    return None

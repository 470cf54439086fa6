"""Routed experts through JAX's TPU grouped GEMM (``jax.experimental.pallas.ops.tpu.megablox`` ``gmm``,
Mosaic TPU), rows sorted by expert as in the reference, no capacity padding, fp32 accumulation.

Off a TPU the kernel runs in Pallas interpret mode (how the CPU tests compare it with the reference);
lowering for a TPU from any host is `jax.export(..., platforms=["tpu"])`. megablox's ``gmm`` carries
its own VJP (``tgmm`` for the weight gradient), so this path is differentiable.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.moe.common import grouped_experts


def _tile(width: int, pref: int = 128) -> int:
    """The largest of 128, 64, ..., 8 dividing `width` (megablox tiles a width exactly), else the width."""
    t = pref
    while t >= 8:
        if width % t == 0:
            return t
        t //= 2
    return width


def gmm(lhs, rhs, group_sizes, *, interpret: bool | None = None):
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    m, k, n = lhs.shape[0], rhs.shape[1], rhs.shape[2]
    tiling = (_tile(m), _tile(k), _tile(n))
    out = megablox_gmm(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32),
                       preferred_element_type=jnp.float32, tiling=tiling, interpret=interpret)
    return out.astype(lhs.dtype)


def moe_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf=None, activation="silu",
                interpret: bool | None = None):
    return grouped_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation,
                           lambda lhs, rhs, sizes: gmm(lhs, rhs, sizes, interpret=interpret))

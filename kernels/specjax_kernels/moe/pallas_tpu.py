"""Routed experts through JAX's TPU grouped GEMM (``jax.experimental.pallas.ops.tpu.megablox`` ``gmm``,
Mosaic TPU), rows sorted by expert as in the reference, no capacity padding, fp32 accumulation.

`interpret=None` (what the api passes) decides at lowering (specjax_kernels.tpu_lowering.
mosaic_or_interpret): the Mosaic kernel when lowering for a TPU, from any host, and Pallas's
interpreter elsewhere (how the CPU tests compare it with the reference). megablox's ``gmm`` carries
its own VJP (``tgmm`` for the weight gradient), so this path is differentiable.

On a mesh of several devices (tpu_lowering.kernel_mesh) the routed experts run under shard_map: each
device takes its own tokens (rows split over the batch axes that divide them) and sees every expert's
weights, which shard_map gathers from however they are sharded (expert / fsdp). XLA cannot partition
a Mosaic call, and a device's tokens route to any expert, so the grouped GEMM needs whole experts.
Gathering the experts costs memory (one layer's experts per device at a time); an expert-parallel
all-to-all is the way to avoid it and is not written yet.

Tested on CPU in interpret mode and lowered for a TPU from the CPU; never compiled or run on a TPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax_kernels.moe.common import grouped_experts
from specjax_kernels.tpu_lowering import active_kernel_mesh, axes_dividing, dim_spec, mosaic_or_interpret, shard_kernel


def _tile(width: int, pref: int = 128) -> int:
    """A row tile: the largest of 128, 64, ..., 8 dividing `width` (megablox tiles a width exactly),
    else the width."""
    t = pref
    while t >= 8:
        if width % t == 0:
            return t
        t //= 2
    return width


def _lane_tile(width: int) -> int:
    """A tile of a dim that is some operand's last (lane) dim, k and n: Mosaic wants a multiple of 128
    or the whole dim, so 128 when it divides, else the whole width (Nemotron-H's 1856-wide experts)."""
    return 128 if width % 128 == 0 else width


def gmm(lhs, rhs, group_sizes, *, interpret: bool | None = None):
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

    m, k, n = lhs.shape[0], rhs.shape[1], rhs.shape[2]
    tiling = (_tile(m), _lane_tile(k), _lane_tile(n))

    def call(interp, lhs, rhs, sizes):
        # megablox takes a plain bool (a custom_vjp static argument); any interpreter means True
        return megablox_gmm(lhs, rhs, sizes, preferred_element_type=jnp.float32, tiling=tiling,
                            interpret=interp is not False)

    out = mosaic_or_interpret(call, lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), interpret=interpret)
    return out.astype(lhs.dtype)


def _local(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation, interpret,
           gate_up_bias=None, down_bias=None):
    return grouped_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation,
                           lambda lhs, rhs, sizes: gmm(lhs, rhs, sizes, interpret=interpret),
                           gate_up_bias=gate_up_bias, down_bias=down_bias)


def moe_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf=None, activation="silu",
                interpret: bool | None = None, *, gate_up_bias=None, down_bias=None):
    km = active_kernel_mesh()
    if km is None:
        return _local(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation, interpret,
                      gate_up_bias, down_bias)
    mesh, batch_axes, _ = km
    rows = P(dim_spec(axes_dividing(mesh, batch_axes, x_td.shape[0])), None)
    # every device sees whole experts (weights and biases alike; see the module docstring)
    optional = {"gate": gate_edf, "gate_up_bias": gate_up_bias, "down_bias": down_bias}
    present = [name for name, a in optional.items() if a is not None]
    args = [x_td, expert_ids_tk, weights_tk, up_edf, down_efd] + [optional[name] for name in present]

    def run(x, ids, w, up, down, *rest):
        got = dict(zip(present, rest))
        return _local(x, ids, w, up, down, got.get("gate"), activation, interpret, got.get("gate_up_bias"),
                      got.get("down_bias"))

    whole = [P(*([None] * a.ndim)) for a in args[3:]]
    return shard_kernel(run, mesh, [rows, rows, rows] + whole, rows, *args)

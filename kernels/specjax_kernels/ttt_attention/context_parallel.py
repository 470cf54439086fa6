"""Context-parallel TTT attention: the sequence is split in contiguous shards along a mesh axis.

Per shard (inside `shard_map` over `axis`):
  * the diagonal keys K_1..K_k of row t live at row t, so they stay local;
  * block 0 (causal over the step-0 keys of the same segment) needs the keys of every earlier
    shard: K0, V0 and the segment ids are all-gathered (tiled) along `axis`, and the local query
    rows run the blockwise online-softmax of `xla.fwd0_offset` against them, starting at their
    global block index so the causal bound and the skipped upper triangle are the global ones;
  * the LSE merge with the diagonal and the custom VJP are the single-device ones (common.py);
    the cotangent of the all-gather is a reduce-scatter (JAX transposes `all_gather` into
    `psum_scatter`), which returns each shard the dK0/dV0 of its own rows summed over all shards.

Why all-gather with contiguous shards (not a ppermute ring, not zig-zag striping): see
docs/architecture.md, "Context parallelism". Memory per device is O(T/C) for queries, outputs and
the diagonal keys, plus O(T) for the gathered K0/V0 (Hkv heads only, GQA-small) and their f32
gradient buffers in the backward; no [T, T] buffer exists on any device.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from specjax_kernels.ttt_attention.common import check_inputs, diagonal_backward, f32, merge_diagonal
from specjax_kernels.ttt_attention.xla import DEFAULT_BLOCK, bwd0_offset, fwd0_offset


def _block_for(t_local: int, block: int) -> int:
    """The largest divisor of the shard length not above `block` (shards are never padded)."""
    for bs in range(min(block, t_local), 0, -1):
        if t_local % bs == 0:
            return bs
    return 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _local(q, kf, vf, kd, vd, seg_q, seg_k, qb0, scale, bs, fwd_impl):
    out, _ = _local_fwd(q, kf, vf, kd, vd, seg_q, seg_k, qb0, scale, bs, fwd_impl)
    return out


def _forward_block0(fwd_impl: str):
    """The block-0 forward with a global query offset: xla's lax loops, or the pallas_gpu kernel
    (Triton on a GPU, interpret mode on the CPU). Both return the same (o, lse), so the backward
    (xla's `bwd0_offset`) is shared."""
    if fwd_impl == "xla":
        return fwd0_offset
    from specjax_kernels.selection import target_platform
    from specjax_kernels.ttt_attention import pallas_gpu
    return functools.partial(pallas_gpu.fwd0_offset, interpret=target_platform() != "gpu")


def _local_fwd(q, kf, vf, kd, vd, seg_q, seg_k, qb0, scale, bs, fwd_impl):
    o0, lse0 = _forward_block0(fwd_impl)(q, kf, vf, seg_q, seg_k, qb0, scale, block=bs)
    out, lse = merge_diagonal(q, kd, vd, o0, lse0, scale)
    out = out.astype(q.dtype)
    return out, (q, kf, vf, kd, vd, seg_q, seg_k, qb0, out, lse)


def _local_bwd(scale, bs, fwd_impl, res, do):
    q, kf, vf, kd, vd, seg_q, seg_k, qb0, out, lse = res
    delta = jnp.sum(do.astype(f32) * out.astype(f32), axis=-1)
    dq, dk, dv = bwd0_offset(q, kf, vf, seg_q, seg_k, qb0, do, lse, delta, scale, block=bs)
    if kd is not None:
        dq_d, dkd, dvd = diagonal_backward(q, kd, vd, do, lse, delta, scale)
        dq = dq + dq_d
        dkd, dvd = dkd.astype(kd.dtype), dvd.astype(vd.dtype)
    else:
        dkd = dvd = None
    return dq.astype(q.dtype), dk.astype(kf.dtype), dv.astype(vf.dtype), dkd, dvd, None, None, None


_local.defvjp(_local_fwd, _local_bwd)


def ttt_attention_context_parallel(q, k0, v0, k_diag=None, v_diag=None, segment_ids=None, *,
                                   mesh: Mesh, axis: str = "context", q_spec: P | None = None,
                                   kv_spec: P | None = None, scale=None, block_size=None,
                                   forward: str = "xla"):
    """Same contract as `ttt_attention(...)` (q [B,T,Hq,D], k0/v0 [B,T,Hkv,D], k_diag/v_diag
    [k,B,T,Hkv,D], segment_ids [B,T]), computed with T split over mesh axis `axis`.

    q_spec / kv_spec: how q and k0/v0 are laid out on the mesh (their dim 1 must be `axis`); the
    batch and head dims may be sharded too (heads: whole GQA groups per shard). Default: only the
    sequence is sharded. `forward`: "xla" (lax loops) or "pallas_gpu" (the Triton kernel with a global
    query offset, `pallas_gpu.fwd0_offset`: interpret-tested on the CPU, not yet run on a GPU, so it
    is opt-in); the backward is xla's either way."""
    if forward not in ("xla", "pallas_gpu"):
        raise ValueError(f"context-parallel ttt_attention: forward must be 'xla' or 'pallas_gpu', got {forward!r}")
    check_inputs(q, k0, v0, k_diag, v_diag, segment_ids)
    B, T, _, D = q.shape
    C = mesh.shape[axis]
    if T % C:
        raise ValueError(f"context-parallel ttt_attention: T={T} is not divisible by the {C} shards of "
                         f"mesh axis `{axis}`; pad the sequence to a multiple of {C}.")
    q_spec = P(None, axis) if q_spec is None else q_spec
    kv_spec = P(None, axis) if kv_spec is None else kv_spec
    q_spec = P(*(tuple(q_spec) + (None,) * (4 - len(q_spec))))
    kv_spec = P(*(tuple(kv_spec) + (None,) * (4 - len(kv_spec))))
    if q_spec[1] != axis or kv_spec[1] != axis:
        raise ValueError(f"q_spec {q_spec} / kv_spec {kv_spec}: the sequence dim (1) must be `{axis}`.")
    seg_spec = P(q_spec[0], axis)
    d_spec = P(None, *kv_spec)
    scale = float(D**-0.5 if scale is None else scale)
    seg = jnp.zeros((B, T), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    bs = _block_for(T // C, block_size or DEFAULT_BLOCK)
    from specjax_kernels.selection import target_platform

    if forward == "pallas_gpu" and target_platform() == "gpu" and (bs < 16 or bs & (bs - 1) or D < 16 or D & (D - 1)):
        raise ValueError(f"context-parallel ttt_attention forward='pallas_gpu' needs a block (here {bs}, the largest "
                         f"divisor of the shard length {T // C} <= {block_size or DEFAULT_BLOCK}) and head_dim ({D}) "
                         f"that are powers of two >= 16; use forward='xla'")
    has_diag = k_diag is not None and k_diag.shape[0] > 0

    def body(q, k0, v0, seg, *diag):
        c = lax.axis_index(axis)
        t_local = q.shape[1]
        kf = lax.all_gather(k0, axis, axis=1, tiled=True)
        vf = lax.all_gather(v0, axis, axis=1, tiled=True)
        segf = lax.all_gather(seg, axis, axis=1, tiled=True)
        kd, vd = diag if diag else (None, None)
        return _local(q, kf, vf, kd, vd, seg, segf, c * (t_local // bs), scale, bs, forward)

    args = (q, k0, v0, seg) + ((k_diag, v_diag) if has_diag else ())
    specs = (q_spec, kv_spec, kv_spec, seg_spec) + ((d_spec, d_spec) if has_diag else ())
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)
    return fn(*args)

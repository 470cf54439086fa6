"""Context-parallel Mamba-2 SSD scan: T split in contiguous shards along a mesh axis (forward).

The recurrence state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T is linear in the state, so a
shard's outputs are (outputs from a zero entering state) + (the entering state's contribution):
  1. every shard scans its rows from a zero state (any local backend) -> y0, and its own final
     state S_c; its carry-through decay is d_c = exp(sum_t dt_t A) if no segment starts inside the
     shard (or at its first row), else 0 (a reset drops whatever entered);
  2. the per-shard summaries (d_c [B,H], S_c [B,H,P,N]) are all-gathered along the axis and every
     shard folds the ones before it (an exclusive scan, C small and static):
        entering_0 = 0,  entering_{c+1} = d_c * entering_c + S_c;
  3. y = y0 + exp(cs_l) * [no reset in rows 0..l] * (C_l . entering), cs_l = sum_{s<=l} dt_s A.
A segment start on the shard's first row is detected by comparing with the previous shard's last
segment id (ppermute). Only O(B*H*P*N) per shard crosses devices.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.ssd.api import check_inputs, ssd
from specjax_kernels.ssd.reference import segment_starts

_HI = lax.Precision.HIGHEST


def previous_shard(x, axis: str, n: int):
    """x of shard c-1 on shard c (zeros on shard 0): the halo / boundary exchange."""
    return lax.ppermute(x, axis, [(i, i + 1) for i in range(n - 1)])


def ssd_context_parallel(x, dt, A, B, C, *, D=None, chunk_size: int = 128, segment_ids=None,
                         mesh: Mesh, axis: str = "context", batch_spec=None,
                         implementation=None):
    """y [B,T,H,P] fp32 of `ssd(...)` (zero initial state) with T split over mesh axis `axis`.
    `batch_spec`: the mesh axes of the batch dim (or None); heads and state stay whole per shard."""
    check_inputs(x, dt, A, B, C, D, None, segment_ids, chunk_size)
    bsz, t, h, p = x.shape
    g = B.shape[2]
    n_shards = mesh.shape[axis]
    if t % n_shards:
        raise ValueError(f"context-parallel ssd: T={t} is not divisible by the {n_shards} shards of mesh "
                         f"axis `{axis}`; pad the sequence to a multiple of {n_shards}.")
    seg = jnp.ones((bsz, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    acc = accum_dtype(x, dt, A, B, C)  # fp32, or fp64 for fp64 inputs
    D = jnp.zeros((h,), acc) if D is None else D

    def body(x, dt, a, bm, cm, d, seg):
        c = lax.axis_index(axis)
        y0, s_own = ssd(x, dt, a, bm, cm, D=d, chunk_size=chunk_size, segment_ids=seg,
                        return_final_state=True, implementation=implementation)
        prev_last = previous_shard(seg[:, -1], axis, n_shards)
        edge = (c > 0) & (seg[:, 0] != prev_last)  # a new segment begins on this shard's row 0
        starts = segment_starts(seg, seg.shape).at[:, 0].set(edge)
        open_ = jnp.cumsum(starts.astype(jnp.int32), axis=1) == 0  # [B,Tl] still in the entering run
        cs = jnp.cumsum(dt.astype(acc) * a.astype(acc), axis=1)  # [B,Tl,H]
        decay = jnp.exp(cs[:, -1]) * open_[:, -1, None]  # [B,H]
        all_decay = lax.all_gather(decay, axis)  # [C,B,H]
        all_state = lax.all_gather(s_own, axis)  # [C,B,H,P,N]
        entering = [jnp.zeros_like(s_own)]
        for j in range(n_shards - 1):
            entering.append(all_decay[j][:, :, None, None] * entering[-1] + all_state[j])
        state_in = jnp.stack(entering)[c]  # [B,H,P,N]
        ch = jnp.repeat(cm.astype(acc), h // g, axis=2)  # [B,Tl,H,N]
        corr = jnp.einsum("bhpn,blhn->blhp", state_in, ch, precision=_HI)
        w = jnp.exp(cs) * open_[..., None]
        return y0 + corr * w[..., None]

    bs = batch_spec
    specs = (P(bs, axis), P(bs, axis), P(), P(bs, axis), P(bs, axis), P(), P(bs, axis))
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(bs, axis), check_vma=False)
    return fn(x, dt, A, B, C, D, seg)

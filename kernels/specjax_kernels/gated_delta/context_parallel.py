"""Context-parallel gated delta rule: T split in contiguous shards along a mesh axis (forward).

Each step S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T, D_t = exp(g_t) (a scalar per head)
or diag(exp(g_t)) (per key channel, Kimi Delta Attention), is affine in the state, so
over a shard the state after row t is P_t S_in + S_t^own, with P_t [Dk, Dk] the product of the
shard's transitions up to t and S^own the state reached from zero; the outputs are
o_t = o_t^own + S_in^T (P_t^T q_t). One local pass gives all of it: the value columns are widened by
Dk zero columns and the entering state by the identity, [0 | I] (the delta rule acts on every value
column independently, and a zero value makes a column evolve as P_t times its start), so
    o_aug = [o^own | P_t^T q_t],   S_aug = [S^own | P].
Then:
  1. every shard runs that pass (any local backend); a segment start on its first row (compared with
     the previous shard's last segment id, ppermute) means nothing enters it: edge_c;
  2. the per-shard summaries (P_c [B,Hv,Dk,Dk], S_c^own, edge_c) are all-gathered along the axis and
     every shard folds the ones before it (C small and static):
        entering_0 = initial_state (or 0),  entering_{c+1} = P_c (entering_c * !edge_c) + S_c^own;
  3. o = o^own + (entering_c * !edge_c)^T (P_t^T q_t). The state after the last shard is
     entering_C (``return_final_state``).
Resets inside a shard are the local op's own (they zero P_t from the reset on). Only
O(B * Hv * Dk * (Dk + Dv)) per shard crosses devices; the local pass costs (Dv + Dk) / Dv of a plain
one in its value-width parts (2x at Dk = Dv, the Qwen3-Next shapes).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.gated_delta.api import check_inputs, gated_delta_rule

_HI = lax.Precision.HIGHEST


def previous_shard(x, axis: str, n: int):
    """x of shard c-1 on shard c (zeros on shard 0): the boundary exchange."""
    return lax.ppermute(x, axis, [(i, i + 1) for i in range(n - 1)])


def gated_delta_rule_context_parallel(q, k, v, g, beta, *, segment_ids=None, initial_state=None, scale=None,
                                      use_qk_l2norm: bool = True, chunk_size: int = 64,
                                      return_final_state: bool = False, mesh: Mesh, axis: str = "context",
                                      batch_spec=None, implementation=None):
    """`gated_delta_rule(...)` with T split over mesh axis `axis`: o [B,T,Hv,Dv] fp32 (and the final
    state [B,Hv,Dk,Dv] fp32). `batch_spec`: the mesh axes of the batch dim (or None); heads and the
    state stay whole per shard."""
    check_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    bsz, t, hv, dv = v.shape
    dk = k.shape[-1]
    n_shards = mesh.shape[axis]
    if t % n_shards:
        raise ValueError(f"context-parallel gated_delta: T={t} is not divisible by the {n_shards} shards of "
                         f"mesh axis `{axis}`; pad the sequence to a multiple of {n_shards}.")
    seg = jnp.ones((bsz, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    acc = accum_dtype(q, k, v, g, beta)
    h0 = jnp.zeros((bsz, hv, dk, dv), acc) if initial_state is None else initial_state.astype(acc)

    def body(q, k, v, g, beta, seg, h0):
        c = lax.axis_index(axis)
        bl, tl = v.shape[:2]
        v_aug = jnp.concatenate([v.astype(acc), jnp.zeros((bl, tl, hv, dk), acc)], axis=-1)
        eye = jnp.broadcast_to(jnp.eye(dk, dtype=acc), (bl, hv, dk, dk))
        s_aug0 = jnp.concatenate([jnp.zeros((bl, hv, dk, dv), acc), eye], axis=-1)
        o_aug, s_aug = gated_delta_rule(q, k, v_aug, g, beta, segment_ids=seg, initial_state=s_aug0, scale=scale,
                                        use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                                        return_final_state=True, implementation=implementation)
        o_own, read = o_aug[..., :dv], o_aug[..., dv:]  # read_t = P_t^T q_t  [B, Tl, Hv, Dk]
        s_own, p_mat = s_aug[..., :dv], s_aug[..., dv:]
        prev_last = previous_shard(seg[:, -1], axis, n_shards)
        edge = (c > 0) & (seg[:, 0] != prev_last)  # [B]: a new segment begins on this shard's row 0
        open_ = (1.0 - edge.astype(acc))[:, None, None, None]
        all_p = lax.all_gather(p_mat, axis)  # [C, B, Hv, Dk, Dk]
        all_s = lax.all_gather(s_own, axis)
        all_open = lax.all_gather(open_, axis)
        entering = [h0]
        for j in range(n_shards):
            entering.append(jnp.einsum("bhij,bhjv->bhiv", all_p[j], entering[-1] * all_open[j], precision=_HI)
                            + all_s[j])
        state_in = jnp.stack(entering[:-1])[c] * open_
        o = o_own + jnp.einsum("bhkv,bthk->bthv", state_in, read, precision=_HI)
        return o, entering[-1]

    bs = batch_spec
    specs = (P(bs, axis),) * 6 + (P(bs),)
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(bs, axis), P(bs)), check_vma=False)
    o, final = fn(q, k, v, g, beta, seg, h0)
    return (o, final) if return_final_state else o

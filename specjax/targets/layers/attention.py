"""Grouped-query attention for frozen targets: causal, segment-aware, fp32 softmax.

This is the plain-jnp reference path (it materialises [B, N, Tq, T] scores). For long sequences
``q_block`` splits the queries into blocks processed one after another with ``lax.map``, which
bounds the score buffer at [B, N, q_block, T] without changing the result.

The training-time mask is a ``SegmentCausalMask``: it keeps only the [B, T] segment ids and builds
the [B, q_block, T] rows each query block needs, so no [B, T, T] buffer exists when queries run in
blocks. It converts to the full bool array wherever an array is expected (``jnp.asarray(mask)``).
Under context parallelism (``mesh.context_mesh()`` set) the sequence is split over `context`: each
shard keeps its query rows, all-gathers K/V and runs the same math (docs/architecture.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from specjax import mesh as meshlib

# query block used under context parallelism when the target config sets none (same result)
CP_Q_BLOCK = 512


def _rows(q_seg_bn, q_idx_n, k_seg_bs):
    """bool [B, n, S]: query at global index q_idx sees key s iff s <= q_idx and same segment."""
    causal = jnp.arange(k_seg_bs.shape[-1])[None, :] <= q_idx_n[:, None]
    return causal[None] & (q_seg_bn[:, :, None] == k_seg_bs[:, None, :])


@jax.tree_util.register_pytree_node_class
class SegmentCausalMask:
    """The [B, T, T] segment-causal mask, held as its [B, T] segment ids (see module docstring)."""

    def __init__(self, segment_ids_bt):
        self.segment_ids = segment_ids_bt

    def tree_flatten(self):
        return (self.segment_ids,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self):
        b, t = self.segment_ids.shape
        return (b, t, t)

    @property
    def dtype(self):
        return jnp.dtype(bool)

    @property
    def ndim(self):
        return 3

    def materialize(self) -> jnp.ndarray:
        t = self.segment_ids.shape[-1]
        return _rows(self.segment_ids, jnp.arange(t), self.segment_ids)

    def __jax_array__(self):
        return self.materialize()

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        return np.asarray(self.materialize(), dtype=dtype)

    def __getitem__(self, idx):
        return self.materialize()[idx]


def segment_causal_mask(segment_ids_bt: jnp.ndarray) -> SegmentCausalMask:
    """[B, T, T] (lazy): query i may see key j iff j <= i and both have the same segment id.

    Padding (segment 0) only sees other padding, so every row keeps its diagonal and the softmax
    never sees an all-masked row (no NaNs); padded outputs are garbage and must be masked by callers.
    """
    return SegmentCausalMask(segment_ids_bt)


def _attend(q_btkgh, k_bskh, v_bskh, mask_bts, scale):
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(scale)
    scores = jnp.where(mask_bts[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh)


def dot_product_attention(
    q_btnh: jnp.ndarray,
    k_bskh: jnp.ndarray,
    v_bskh: jnp.ndarray,
    mask_bts,
    *,
    scale: float,
    q_block: int = 0,
    implementation: str | None = None,
) -> jnp.ndarray:
    """Attention with N query heads sharing K kv heads (N % K == 0). Returns [B, T, N, H].
    ``mask_bts``: a bool [B, T, S] array or a ``SegmentCausalMask`` (S = T).

    ``implementation`` (training-time self-attention with a SegmentCausalMask only): None/"auto" =
    on GPU the flash-style kernels of ``specjax_kernels.ttt_attention`` with no diagonal keys
    (causal + segment-aware + GQA, O(T) memory; benchmarks/results/train_throughput.md measured the
    plain path's [B,N,T,T] fp32 scores as the largest cost of the target forward), elsewhere the
    plain path below (exact reference; the HF parity tests run it). "plain" forces the plain path;
    any ttt_attention implementation name forces that kernel."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    if n % kv:
        raise ValueError(f"num_attention_heads={n} is not a multiple of num_key_value_heads={kv}")
    # Heads are grouped as HF's repeat_kv does: query head i uses kv head i // (N // K).
    cp_mesh = meshlib.context_mesh()
    if cp_mesh is not None and k_bskh.shape[1] == t:  # training-time self-attention (not a KV-cache decode)
        return _context_parallel(q_btnh, k_bskh, v_bskh, mask_bts, scale, q_block, cp_mesh)
    if implementation in (None, "auto"):
        implementation = "auto" if jax.default_backend() == "gpu" else "plain"
    if implementation != "plain" and isinstance(mask_bts, SegmentCausalMask) and k_bskh.shape[1] == t:
        from specjax_kernels.ttt_attention import ttt_attention

        # step 0 of the TTT attention is exactly segment-causal GQA self-attention
        return ttt_attention(q_btnh, k_bskh, v_bskh, None, None, mask_bts.segment_ids, scale=scale,
                             implementation=implementation)
    if isinstance(mask_bts, SegmentCausalMask):
        seg = mask_bts.segment_ids
        return _grouped(q_btnh, k_bskh, v_bskh, (seg, seg, 0), scale, q_block)
    return _grouped(q_btnh, k_bskh, v_bskh, mask_bts, scale, q_block)


def _grouped(q_btnh, k_bskh, v_bskh, mask, scale, q_block):
    """`mask`: a bool [B, T, S] array, or (query segment ids [B, T], key segment ids [B, S], global
    index of query row 0) from which each block's rows are built."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    q = q_btnh.reshape(b, t, kv, n // kv, h)
    lazy = isinstance(mask, tuple)
    if not q_block or t <= q_block or t % q_block:
        m = _rows(mask[0], mask[2] + jnp.arange(t), mask[1]) if lazy else mask
        out = _attend(q, k_bskh, v_bskh, m, scale)
        return out.reshape(b, t, n, h)
    nb = t // q_block
    q_blocks = jnp.moveaxis(q.reshape(b, nb, q_block, kv, n // kv, h), 1, 0)
    if lazy:
        q_seg, k_seg, q0 = mask
        s_blocks = jnp.moveaxis(q_seg.reshape(b, nb, q_block), 1, 0)
        starts = q0 + jnp.arange(nb) * q_block

        def one(x):
            qb, sb, st = x
            return _attend(qb, k_bskh, v_bskh, _rows(sb, st + jnp.arange(q_block), k_seg), scale)

        out = jax.lax.map(one, (q_blocks, s_blocks, starts))
    else:
        m_blocks = jnp.moveaxis(mask.reshape(b, nb, q_block, mask.shape[-1]), 1, 0)
        out = jax.lax.map(lambda qm: _attend(qm[0], k_bskh, v_bskh, qm[1], scale), (q_blocks, m_blocks))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, n, h)


def _context_parallel(q_btnh, k_bskh, v_bskh, mask_bts, scale, q_block, mesh):
    """Context parallelism (forward only): each `context` shard keeps its query rows, all-gathers
    K/V (tiled, so shard c sees keys 0..T-1 in order) and computes exactly its rows. With a
    SegmentCausalMask only the segment ids cross devices; an array mask is split by rows
    ([B, T/C, T] per shard). See docs/architecture.md."""
    t = q_btnh.shape[1]
    meshlib.check_context_divides(t, mesh, "target attention")
    q_spec = meshlib.spec_for(q_btnh.shape, ("batch", "seq", "heads", None), mesh)
    kv_spec = meshlib.spec_for(k_bskh.shape, ("batch", "seq", "kv_heads", None), mesh)
    axis = meshlib.CONTEXT_AXIS
    if (q_spec[2] is None) != (kv_spec[2] is None):  # shard heads only when both split evenly
        q_spec, kv_spec = P(q_spec[0], q_spec[1], None, None), P(kv_spec[0], kv_spec[1], None, None)
    batch = q_spec[0]
    if kv_spec[0] != batch:
        kv_spec = P(batch, *tuple(kv_spec)[1:])
    # Long sequences are the point of context parallelism: queries always run in blocks (same
    # result), and the block is cut by C so the per-device score buffer [B, N, block, T] is 1/C of
    # a single device's [B, N, q_block, T].
    block = max((q_block or CP_Q_BLOCK) // mesh.shape[axis], 1)
    lazy = isinstance(mask_bts, SegmentCausalMask)
    m_in, m_spec = (mask_bts.segment_ids, P(batch, axis)) if lazy else (mask_bts, P(batch, axis, None))

    def body(q, k, v, m):
        k = jax.lax.all_gather(k, axis, axis=1, tiled=True)
        v = jax.lax.all_gather(v, axis, axis=1, tiled=True)
        if lazy:
            t_local = q.shape[1]
            m = (m, jax.lax.all_gather(m, axis, axis=1, tiled=True), jax.lax.axis_index(axis) * t_local)
        return _grouped(q, k, v, m, scale, block)

    return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, m_spec),
                         out_specs=q_spec, check_vma=False)(q_btnh, k_bskh, v_bskh, m_in)

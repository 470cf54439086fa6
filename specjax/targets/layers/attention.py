"""Grouped-query attention for frozen targets: causal, segment-aware, fp32 softmax.

This is the plain-jnp reference path (it materialises [B, N, Tq, T] scores). For long sequences
``q_block`` splits the queries into blocks processed one after another with ``lax.map``, which
bounds the score buffer at [B, N, q_block, T] without changing the result.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_causal_mask(segment_ids_bt: jnp.ndarray) -> jnp.ndarray:
    """bool [B, T, T]: query i may see key j iff j <= i and both have the same segment id.

    Padding (segment 0) only sees other padding, so every row keeps its diagonal and the softmax
    never sees an all-masked row (no NaNs); padded outputs are garbage and must be masked by callers.
    """
    t = segment_ids_bt.shape[-1]
    idx = jnp.arange(t)
    causal = idx[None, :] <= idx[:, None]
    same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return causal[None] & same


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
    mask_bts: jnp.ndarray,
    *,
    scale: float,
    q_block: int = 0,
) -> jnp.ndarray:
    """Attention with N query heads sharing K kv heads (N % K == 0). Returns [B, T, N, H]."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    if n % kv:
        raise ValueError(f"num_attention_heads={n} is not a multiple of num_key_value_heads={kv}")
    # Heads are grouped as HF's repeat_kv does: query head i uses kv head i // (N // K).
    q = q_btnh.reshape(b, t, kv, n // kv, h)
    if not q_block or t <= q_block or t % q_block:
        out = _attend(q, k_bskh, v_bskh, mask_bts, scale)
        return out.reshape(b, t, n, h)
    nb = t // q_block
    q_blocks = jnp.moveaxis(q.reshape(b, nb, q_block, kv, n // kv, h), 1, 0)
    m_blocks = jnp.moveaxis(mask_bts.reshape(b, nb, q_block, mask_bts.shape[-1]), 1, 0)
    out = jax.lax.map(lambda qm: _attend(qm[0], k_bskh, v_bskh, qm[1], scale), (q_blocks, m_blocks))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, n, h)

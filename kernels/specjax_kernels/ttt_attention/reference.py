"""TTT attention, the definition (plain jnp).

At TTT step k a query row t attends to
  * block 0: the step-0 keys K0[s] for every s <= t in the same packed segment (causal), and
  * the diagonal: K_i[t] for i = 1..k, the keys the same row produced at earlier TTT steps.
Scores are softmaxed jointly in fp32. Memory is O(T^2) for block 0 plus O(k*T) for the diagonal:
the [T, (k+1)T] mask is never built.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp


def ttt_attention(
    q_btnd: jnp.ndarray,  # [B, T, Hq, D] queries of step k (RoPE applied)
    k0_btkd: jnp.ndarray,  # [B, T, Hkv, D] step-0 keys
    v0_btkd: jnp.ndarray,  # [B, T, Hkv, D]
    k_diag_nbtkd: Optional[jnp.ndarray] = None,  # [k, B, T, Hkv, D] keys of steps 1..k
    v_diag_nbtkd: Optional[jnp.ndarray] = None,
    segment_ids_bt: Optional[jnp.ndarray] = None,  # [B, T]; attention stays within a segment
    scale: Optional[float] = None,
    sinks_h: Optional[jnp.ndarray] = None,  # [Hq] one more logit per head with no value (gpt-oss)
) -> jnp.ndarray:
    B, T, Hq, D = q_btnd.shape
    Hkv = k0_btkd.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    f32 = jnp.float32
    q = q_btnd.reshape(B, T, Hkv, G, D).astype(f32)
    s0 = jnp.einsum("btkgd,bskd->bkgts", q, k0_btkd.astype(f32)) * scale
    allowed = jnp.tril(jnp.ones((T, T), dtype=bool))[None]
    if segment_ids_bt is not None:
        allowed = allowed & (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])
    s0 = jnp.where(allowed[:, None, None], s0, -jnp.inf)
    scores = s0
    if k_diag_nbtkd is not None and k_diag_nbtkd.shape[0] > 0:
        sd = jnp.einsum("btkgd,nbtkd->bkgtn", q, k_diag_nbtkd.astype(f32)) * scale
        scores = jnp.concatenate([s0, sd], axis=-1)
    m = jnp.max(scores, axis=-1, keepdims=True)
    denom = jnp.sum(jnp.exp(scores - m), axis=-1, keepdims=True)
    if sinks_h is not None:
        sink = sinks_h.astype(f32).reshape(1, Hkv, G, 1, 1)
        m_all = jnp.maximum(m, sink)
        denom = denom * jnp.exp(m - m_all) + jnp.exp(sink - m_all)
        m = m_all
    w = jnp.exp(scores - m) / denom
    out = jnp.einsum("bkgts,bskd->btkgd", w[..., :T], v0_btkd.astype(f32))
    if scores.shape[-1] > T:
        out = out + jnp.einsum("bkgtn,nbtkd->btkgd", w[..., T:], v_diag_nbtkd.astype(f32))
    return out.reshape(B, T, Hq, D).astype(q_btnd.dtype)

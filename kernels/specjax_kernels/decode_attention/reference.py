"""The definition: slice the layer out of the stacked cache, then plain masked attention.

decode_attention(q [B,T,N,H], k_cache / v_cache [L,B,S,K,H], layer int32 [], mask bool [B,T,S],
limit int32 [B], scale) -> [B,T,N,H] in q's dtype. Query head n uses kv head n // (N // K) (HF's
repeat_kv grouping). `limit[b]` promises that no slot >= limit[b] is visible in row b (the kernels
skip those slots; the reference ignores it). A row with no visible slot is not allowed (its
softmax is undefined); cached decoding always sees at least the token itself.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_attention(q, k_cache, v_cache, layer, mask, limit, scale):
    del limit
    b, t, n, h = q.shape
    kv = k_cache.shape[3]
    k = jax.lax.dynamic_index_in_dim(k_cache, layer, axis=0, keepdims=False).astype(q.dtype)
    v = jax.lax.dynamic_index_in_dim(v_cache, layer, axis=0, keepdims=False).astype(q.dtype)
    qg = q.reshape(b, t, kv, n // kv, h)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * jnp.float32(scale)
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, h).astype(q.dtype)

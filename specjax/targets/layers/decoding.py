"""Shared pieces of cached decoding for attention-only targets (one KV cache row per attention
layer application): the cache itself, the per-chunk mask and slots every layer shares, and the
logits at the picked chunk rows.

A target with sliding-window layers also keeps each slot's position (``"pos"`` [1, B, S] int32,
written with the chunk's positions, so tree chunks and left padding are exact): a query at position
p sees a cached key at position s only if p - window < s (:func:`windowed_chunk_inputs`). The
leading axis of 1 keeps the slot on axis 2 like every K/V leaf (``base.commit_tree_path``).

Same contract as ``llama.decode_chunk`` (whose layout and slot rules are in ``layers/attention.py``
"KV cache"): a target whose stack applies some attention layer more than once (a looped target,
HRM-Text's H/L cycles) keeps one cache row per *virtual* layer, so the cache's leading axis is the
unrolled depth and rollback stays "a shorter valid length".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.decode_attention import api as decode_attention

from specjax.targets.layers.attention import AttentionConfig, cache_attention_mask, cache_size_for


def init_kv_cache(num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                  dtype=jnp.float32) -> dict:
    """Zeroed {"k", "v"} [num_layers, B, S, Hkv, D] with S = cache_size_for(max_len)."""
    shape = (int(num_layers), int(batch_size), cache_size_for(max_len), int(num_kv_heads), int(head_dim))
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def init_positions(batch_size: int, max_len: int) -> jax.Array:
    """Zeroed slot positions [1, B, S] int32 of a sliding-window target's cache (module docstring)."""
    return jnp.zeros((1, int(batch_size), cache_size_for(max_len)), jnp.int32)


def windowed_chunk_inputs(cache: dict, input_ids_bt: jax.Array, positions_bt: jax.Array, start_b, window: int,
                          chunk_mask_btt=None, valid_from_b=None, attention: AttentionConfig | None = None):
    """:func:`chunk_inputs` for a target with sliding-window layers: (full mask, windowed mask, write
    slots, cache with the chunk's positions written into ``"pos"``). Both masks are prepared for the
    decode-attention kernel like chunk_inputs' (a family whose layers all slide uses only the second)."""
    start_b, full, slots = chunk_inputs(cache, input_ids_bt, start_b, chunk_mask_btt, valid_from_b)
    rows = jnp.arange(input_ids_bt.shape[0])[:, None]
    pos = cache["pos"].at[0, rows, slots].set(jnp.asarray(positions_bt, jnp.int32), mode="drop")
    rel = jnp.asarray(positions_bt, jnp.int32)[:, :, None] - pos[0][:, None, :]  # [B, T, S] query - key position
    windowed = full & (rel < window)
    if attention is not None:
        full, windowed = (decode_attention.prepare_mask(m, attention.num_heads, attention.head_dim, cache["k"].shape,
                                                        attention.decode_implementation) for m in (full, windowed))
    return full, windowed, slots, {**cache, "pos": pos}


def chunk_inputs(cache: dict, input_ids_bt: jax.Array, start_b, chunk_mask_btt=None, valid_from_b=None,
                 attention: AttentionConfig | None = None):
    """(start [B] int32, attention mask, write slots [B,T]) of a chunk written at slots start[b]..
    (chunk mask causal by default), exactly as ``llama.decode_chunk`` builds them. The mask is bool
    [B,T,S]; given the target's ``attention`` config, it is the ChunkMask that every layer's
    decode-attention kernel reads, its operand built here once rather than in each layer."""
    b, t = input_ids_bt.shape
    num_slots = cache["k"].shape[2]
    start_b = jnp.asarray(start_b, jnp.int32).reshape(b)
    if chunk_mask_btt is None:
        chunk_mask_btt = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    mask = cache_attention_mask(start_b, num_slots, chunk_mask_btt, valid_from_b)
    if attention is not None:
        mask = decode_attention.prepare_mask(mask, attention.num_heads, attention.head_dim, cache["k"].shape,
                                             attention.decode_implementation)
    slots = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return start_b, mask, slots


def picked_logits(final_btd: jax.Array, w_vd: jax.Array, logits_index=None) -> jax.Array:
    """fp32 logits (fp32 accumulation) of the final hidden [B,T,D] against the [V,D] output
    projection: [B,T,V], or [B,n,V] at chunk indices ``logits_index`` [B,n]."""
    picked = final_btd if logits_index is None else jnp.take_along_axis(final_btd, logits_index[:, :, None], axis=1)
    return jnp.einsum("btd,vd->btv", picked, w_vd, preferred_element_type=jnp.float32)

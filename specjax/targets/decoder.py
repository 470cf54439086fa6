"""The decoder every target family runs: embed -> per-layer inputs (RoPE, masks) -> the tap-split
layer stack -> final norm -> logits, for the training forward and for cached decoding.

A family (``llama.py``, ``qwen3_moe.py``, ``hrm_text.py``, ``nemotron_h.py``; ``looped.py`` is
Llama's schedule over virtual layers) describes itself with one :class:`Decoder`: its layer stack
(``run_layers``: which block at which depth, split at the aux taps, through ``layers/scan.py``) and
the hooks where it differs from the Llama defaults (embedding path and scale, final norm, the
inputs every layer shares, the cache). Its Target class sets ``decoder = ...``: the pure functions
``forward``, ``decode_chunk``, ``init_cache``, ``embed_table`` and ``lm_head_weight`` (params and
config first) are the decoder's, and ``base.Target``'s methods of the same names bind them.

The carry through a stack is ``(x, cache)``: the residual stream [B,T,D] and the cache pytree in
cached decoding, None in the training forward. Aux id k is the state after (virtual) layer k.
Cached decoding's contract (slots, chunk mask, valid_from, logits_index, rollback) is
:meth:`Decoder.decode_chunk`'s; the KV layout is ``layers/attention.py`` "KV cache".
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from specjax.layers.norms import rms_norm
from specjax.layers.rope import inverse_frequencies, rope_cos_sin
from specjax.targets.base import layer_depth, tree_get, validate_aux_layer_ids
from specjax.targets.layers import decoding
from specjax.targets.layers.attention import attention_block, attention_inputs
from specjax.targets.layers.mlp import swiglu_mlp
from specjax.targets.layers.scan import scan_at_taps
from specjax.targets.quantized import layer_weights_dequantized


class StackInputs(NamedTuple):
    """What every layer of one call shares, built once per call."""

    mask: Any  # forward: the SegmentCausalMask; decoding: the [B,T,S] cache mask (or its ChunkMask)
    rope: Any  # (cos, sin) [B,T,head_dim], or None for a target without positional encoding
    slots: Any = None  # decoding: the cache slots [B,T] the chunk is written to
    segment_ids: Any = None  # forward: [B,T] (0 = padding), for blocks other than attention (Mamba)
    extra: Any = None  # a family's own per-call input (Nemotron-H: the Mamba-2 decode plan)


# ---------------------------------------------------------------------------------------------
# the pre-norm attention + feed-forward block (Llama, Qwen3, Qwen3-MoE, HRM-Text)
# ---------------------------------------------------------------------------------------------
def attention_ffn_block(attn_params: dict, cfg: Any, x_btd, inputs: StackInputs, norm_scales, ffn: Callable,
                        cache=None, layer=None):
    """x + attn(norm(x)), then + ffn(norm(x)): (new x, new cache or None). ``norm_scales`` the two
    RMSNorm weights (a ones scalar for a weightless norm), ``ffn`` h -> [B,T,D], ``layer`` this
    application's cache row (cached decoding; see layers/attention.attention_block)."""
    h = rms_norm(x_btd, norm_scales[0], cfg.rms_norm_eps)
    o, cache = attention_block(attn_params, cfg.attention, h, inputs.mask, inputs.rope, cache=cache, layer=layer,
                               slots_bt=inputs.slots)
    x_btd = x_btd + o
    h = rms_norm(x_btd, norm_scales[1], cfg.rms_norm_eps)
    return x_btd + ffn(h), cache


def swiglu(p: dict) -> Callable:
    """The SwiGLU feed-forward of params {"gate_proj", "up_proj", "down_proj": {"kernel"}} (or FP8
    kernels with their scales: layers/linear.py), as h -> out."""
    return lambda h: swiglu_mlp(h, p["gate_proj"], p["up_proj"], p["down_proj"])


def tap_split(run_span: Callable, carry, num_layers: int, aux_ids: Sequence[int]):
    """``scan_at_taps`` over the decoder carry (x, cache): the tapped state is x."""
    return scan_at_taps(run_span, carry, num_layers, aux_ids, tapped=lambda c: c[0])


# ---------------------------------------------------------------------------------------------
# the Llama defaults of each hook
# ---------------------------------------------------------------------------------------------
def final_rms_norm(params: dict, cfg: Any, x_btd):
    return rms_norm(x_btd, params["norm"]["scale"], cfg.rms_norm_eps)


def sliding_window_of(cfg: Any) -> int | None:
    """The config's sliding window (None: no layer slides). Every layer slides unless the family mixes
    sliding and full-attention layers in one scan (Gemma 3, gpt-oss: ``layer_mask`` below)."""
    return getattr(cfg, "sliding_window", None)


# ---------------------------------------------------------------------------------------------
# stacks that mix sliding-window and full-attention layers in one scan (Gemma 3, gpt-oss): each
# layer carries its kind as a scanned bool flag
# ---------------------------------------------------------------------------------------------
NO_WINDOW = 2**30  # a full-attention layer's window inside such a scan (hides nothing)


def pick_by_layer(sliding, when_sliding, when_full):
    """The sliding layer's value where the scanned flag is set, else the full layer's (same pytrees)."""
    return jax.tree.map(lambda a, b: jnp.where(sliding, a, b), when_sliding, when_full)


def layer_mask(inputs: StackInputs, sliding, window: int):
    """This layer's attention mask. Training forward: the shared lazy mask with a traced window (the
    full layers' hides nothing); decoding: the (full, windowed) pair of :func:`mixed_window_decode_masks`."""
    if isinstance(inputs.mask, tuple):
        return pick_by_layer(sliding, inputs.mask[1], inputs.mask[0])
    return inputs.mask.with_window(jnp.where(sliding, jnp.int32(window), jnp.int32(NO_WINDOW)), band=window)


def mixed_window_decode_masks(cfg: Any, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt, valid_from_b):
    """((full mask, windowed mask), write slots, cache with the chunk's positions) of a chunk, for
    :func:`layer_mask`; the cache is ``kv_cache_per_layer``'s (which keeps slot positions)."""
    full, windowed, slots, cache = decoding.windowed_chunk_inputs(
        cache, input_ids_bt, positions_bt, start_b, cfg.sliding_window, chunk_mask_btt, valid_from_b, cfg.attention)
    return (full, windowed), slots, cache


def rope_forward_inputs(cfg: Any, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    """The training forward's segment-causal mask (windowed where the config slides) and RoPE
    (positions default to arange, segments to one)."""
    mask, rope = attention_inputs(input_ids_bt.shape, positions, segment_ids, cfg.rope, cfg.head_dim, dtype,
                                  window=sliding_window_of(cfg))
    return StackInputs(mask, rope)


def rope_decode_inputs(cfg: Any, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt, valid_from_b,
                       logits_index, dtype):
    """A chunk's cache mask, write slots and RoPE: (StackInputs, cache; a sliding-window target's
    cache gains the chunk's positions)."""
    window = sliding_window_of(cfg)
    if window is None:
        _, mask, slots = decoding.chunk_inputs(cache, input_ids_bt, start_b, chunk_mask_btt, valid_from_b,
                                               cfg.attention)
    else:
        _, mask, slots, cache = decoding.windowed_chunk_inputs(cache, input_ids_bt, positions_bt, start_b, window,
                                                               chunk_mask_btt, valid_from_b, cfg.attention)
    rope = rope_cos_sin(positions_bt, inverse_frequencies(cfg.rope, cfg.head_dim), dtype)
    return StackInputs(mask, rope, slots=slots), cache


def kv_cache_per_layer(cfg: Any, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed KV cache {"k", "v"} [Lv, B, S, Hkv, D]: one row per (virtual) layer, S = max_len rounded
    up (sliding layers included: rollback stays "a shorter valid length"); with a sliding window also
    the slot positions {"pos"} (layers/decoding.py)."""
    cache = decoding.init_kv_cache(layer_depth(cfg), batch_size, max_len, cfg.num_key_value_heads, cfg.head_dim,
                                   dtype)
    if sliding_window_of(cfg) is not None:
        cache["pos"] = decoding.init_positions(batch_size, max_len)
    return cache


@dataclasses.dataclass(frozen=True)
class Decoder:
    """One family's decoder. ``run_layers(params, cfg, carry, inputs, aux_ids) -> (carry, aux)`` runs
    the whole (virtual) layer stack over the carry (x, cache or None) and returns the state after
    each aux tap; the other fields default to the Llama layout."""

    run_layers: Callable
    embedding: tuple[str, ...] = ("embed_tokens", "embedding")  # the [V, D] table's param path
    scale_embeddings: Callable | None = None  # (cfg, x) -> x after the lookup (HRM-Text's embedding_scale)
    final_norm: Callable | None = final_rms_norm  # (params, cfg, x); None: the stack ends in its own norm
    forward_inputs: Callable = rope_forward_inputs
    decode_inputs: Callable = rope_decode_inputs
    init_cache: Callable = kv_cache_per_layer  # (cfg, batch_size, max_len, dtype) -> zeroed cache

    def embed_table(self, params: dict, cfg: Any = None) -> jax.Array:
        """[V, D] token embedding table."""
        return tree_get(params, self.embedding)

    def lm_head_weight(self, params: dict, cfg: Any) -> jax.Array:
        """[V, D] output projection in HF layout (tied -> the embedding table)."""
        if getattr(cfg, "tie_word_embeddings", False):
            return self.embed_table(params)
        return params["lm_head"]["kernel"].T

    def _embed(self, params, cfg, input_ids_bt):
        x = jnp.take(self.embed_table(params), input_ids_bt, axis=0)
        return x if self.scale_embeddings is None else self.scale_embeddings(cfg, x)

    def _final(self, params, cfg, x):
        return x if self.final_norm is None else self.final_norm(params, cfg, x)

    def forward(self, params: dict, cfg: Any, input_ids_bt: jax.Array, *, aux_layer_ids: Sequence[int] = (),
                positions: jax.Array | None = None, segment_ids: jax.Array | None = None) -> tuple[jax.Array, tuple]:
        """Pure training forward: (final hidden [B,T,D] after the final norm, aux tuple of [B,T,D]).

        aux id k is the residual stream after (virtual) layer k (HF ``hidden_states[k+1]``; for the
        last layer the pre-final-norm state). The stack is split at the taps, so only the tapped
        states are kept. Compute runs in the params dtype; norm statistics and softmax in fp32.
        """
        aux_ids = validate_aux_layer_ids(aux_layer_ids, layer_depth(cfg))
        x = self._embed(params, cfg, input_ids_bt)
        inputs = self.forward_inputs(cfg, input_ids_bt, positions, segment_ids, x.dtype)
        with layer_weights_dequantized(x.dtype, getattr(cfg, "weight_quant", None)):
            (x, _), aux = self.run_layers(params, cfg, (x, None), inputs, aux_ids)
        return self._final(params, cfg, x), aux

    def decode_chunk(self, params: dict, cfg: Any, cache: Any, input_ids_bt: jax.Array, positions_bt: jax.Array,
                     start_b: jax.Array, *, aux_layer_ids: Sequence[int] = (), chunk_mask_btt: jax.Array | None = None,
                     valid_from_b: jax.Array | None = None, logits_index: jax.Array | None = None):
        """PURE cached forward of a chunk of new tokens: (fp32 logits, aux tuple [B,T,D] at
        ``aux_layer_ids``, final hidden [B,T,D] after the final norm, new cache).

        input_ids/positions [B,T] int (positions are the RoPE positions, independent of slots);
        start [B]: the row's valid cache length, where the chunk is written (rollback = a smaller
        start next time). chunk_mask [B,T,T] bool (default causal; a tree mask for tree
        verification); valid_from [B] skips a row's left padding. logits [B,T,V], or [B,n,V] at
        chunk indices ``logits_index`` [B,n] (a prefill then never forms [B,T,V]). Same layers and
        op order as :meth:`forward`.
        """
        aux_ids = validate_aux_layer_ids(aux_layer_ids, layer_depth(cfg))
        x = self._embed(params, cfg, input_ids_bt)
        inputs, cache = self.decode_inputs(cfg, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt,
                                           valid_from_b, logits_index, x.dtype)
        with layer_weights_dequantized(x.dtype, getattr(cfg, "weight_quant", None)):
            (x, cache), aux = self.run_layers(params, cfg, (x, cache), inputs, aux_ids)
        final = self._final(params, cfg, x)
        return decoding.picked_logits(final, self.lm_head_weight(params, cfg), logits_index), aux, final, cache

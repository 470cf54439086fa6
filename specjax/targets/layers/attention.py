"""Grouped-query attention for frozen targets: causal, segment-aware, fp32 softmax.

Read top to bottom: the attention block every target layer calls (projections, optional per-head
q/k RMSNorm, RoPE, attention, optional output gate, o_proj; with an optional KV cache), its
per-forward inputs (mask, RoPE tables), the KV cache of cached decoding, then the attention itself.

``dot_product_attention`` is the plain-jnp reference path (it materialises [B, N, Tq, T] scores).
For long sequences ``q_block`` splits the queries into blocks processed one after another with
``lax.map``, which bounds the score buffer at [B, N, q_block, T] without changing the result.

The training-time mask is a ``SegmentCausalMask``: it keeps only the [B, T] segment ids and builds
the [B, q_block, T] rows each query block needs, so no [B, T, T] buffer exists when queries run in
blocks. It converts to the full bool array wherever an array is expected (``jnp.asarray(mask)``).

Sliding-window attention (Mistral, Phi-3, Gemma 3's local layers, gpt-oss): query at position p sees
key at position s iff p - window < s <= p (transformers' ``sliding_window_overlay``: the window
counts the query itself). A training mask carries its window (``SegmentCausalMask.with_window``, a
Python int or a traced per-layer scalar); cached decoding masks by positions kept in the cache
(``layers/decoding.py``). The flash kernels of ``ttt_attention`` know segments, not windows: a
windowed layer runs them only while the window covers the whole sequence (then it hides nothing) and
the plain blocked path otherwise (``dot_product_attention``).
Under context parallelism (``mesh.context_mesh()`` set) the sequence is split over `context`: each
shard keeps its query rows, all-gathers K/V and runs the same math (docs/architecture.md).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from specjax import mesh as meshlib
from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, apply_rope, inverse_frequencies, rope_cos_sin
from specjax.targets.layers.linear import dense
from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.selection import record_choice, target_platform
from specjax_kernels.ttt_attention import ttt_attention
from specjax_kernels.ttt_attention.context_parallel import ttt_attention_context_parallel

# query block used under context parallelism when the target config sets none (same result)
CP_Q_BLOCK = 512


# =============================================================================================
# Attention block
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static shape and options of a target's attention block (hashable; a target config builds it
    in its ``attention`` property with :meth:`of`)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm_eps: float | None = None  # per-head RMSNorm of q and k before RoPE (Qwen3); None = none
    softmax_scale: float | None = None  # the score scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    qk_norm_unit_offset: bool = False  # Gemma: the q/k norms multiply by 1 + weight (layers/norms.py)
    bias: bool = False  # q/k/v/o projections carry a "bias" (gpt-oss)
    sinks: bool = False  # a learned per-head logit joins each softmax's denominator (gpt-oss; p["sinks"] [N])
    output_gate: bool = False  # HRM-Text: sigmoid(h @ gate_proj) per head dim times the attention output
    q_block: int = 0  # queries in blocks of this many tokens (0 = one block); bounds the score buffer
    implementation: str | None = None  # training self-attention path (see dot_product_attention)
    decode_implementation: str | None = None  # cached decoding's attention (specjax_kernels.decode_attention)

    @classmethod
    def of(cls, cfg: Any, *, qk_norm: bool = False, output_gate: bool = False) -> "AttentionConfig":
        """From a target config's num_attention_heads, num_key_value_heads, head_dim, its kernel
        choices (``kernels``: a targets.kernel_choices.KernelChoices) and, with ``qk_norm``, rms_norm_eps."""
        return cls(
            num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
            qk_norm_eps=cfg.rms_norm_eps if qk_norm else None, output_gate=output_gate,
            q_block=cfg.kernels.target_attention_q_block, implementation=cfg.kernels.target_attention,
            decode_implementation=cfg.kernels.decode_attention,
        )

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.softmax_scale is None else float(self.softmax_scale)


def attention_block(p: dict, spec: AttentionConfig, h_btd, mask, rope=None, *, cache: dict | None = None,
                    layer=None, slots_bt=None):
    """Self-attention of a (normed) hidden state [B,T,D]: (o_proj output [B,T,D], new cache or None).

    ``p``: {"q_proj", "k_proj", "v_proj", "o_proj": {"kernel"}}, plus {"q_norm", "k_norm": {"scale"}}
    with ``spec.qk_norm_eps`` and {"gate_proj": {"kernel"}} with ``spec.output_gate``. ``rope``:
    (cos, sin) [B,T,head_dim] from :func:`attention_inputs`, or None (no positional encoding).
    Training forward: no cache; ``mask`` is the SegmentCausalMask of the chunk itself. Cached
    decoding: ``cache`` {"k", "v"} [L,B,S,Hkv,D], this ``layer``'s index and the ``slots_bt`` [B,T]
    its new K/V go to; attention runs over the layer's whole cache row under the bool [B,T,S]
    ``mask`` of :func:`cache_attention_mask` (or the ChunkMask ``decoding.chunk_inputs`` builds from it).
    """
    b, t, _ = h_btd.shape

    def proj(name, x):
        y = dense(x, p[name])
        return y + p[name]["bias"] if spec.bias else y

    q = proj("q_proj", h_btd).reshape(b, t, spec.num_heads, spec.head_dim)
    k = proj("k_proj", h_btd).reshape(b, t, spec.num_kv_heads, spec.head_dim)
    v = proj("v_proj", h_btd).reshape(b, t, spec.num_kv_heads, spec.head_dim)
    sinks = p["sinks"] if spec.sinks else None
    if spec.qk_norm_eps is not None:  # Qwen3: per-head RMSNorm before RoPE
        q = rms_norm(q, p["q_norm"]["scale"], spec.qk_norm_eps, unit_offset=spec.qk_norm_unit_offset)
        k = rms_norm(k, p["k_norm"]["scale"], spec.qk_norm_eps, unit_offset=spec.qk_norm_unit_offset)
    if rope is not None:
        q = apply_rope(q, *rope)
        k = apply_rope(k, *rope)
    if cache is not None:
        cache = write_kv_cache(cache, layer, slots_bt, k, v)
        # the chunk's slots are contiguous, so nothing at or past its last slot + 1 is visible
        o = cached_attention(q, cache, layer, mask, slots_bt[:, -1] + 1, spec, sinks)
    else:
        o = dot_product_attention(q, k, v, mask, scale=spec.scale, q_block=spec.q_block,
                                  implementation=spec.implementation, sinks=sinks)
    if spec.output_gate:
        o = jax.nn.sigmoid(dense(h_btd, p["gate_proj"]).reshape(b, t, spec.num_heads, spec.head_dim)) * o
    return proj("o_proj", o.reshape(b, t, -1)), cache


def attention_inputs(shape_bt, positions, segment_ids, rope: RopeSpec, head_dim: int, dtype,
                     window: int | None = None):
    """(segment-causal mask (with a sliding ``window`` if given), RoPE (cos, sin)) that every layer of
    a training forward shares; positions default to arange and segment ids to one segment per row."""
    b, t = shape_bt
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    mask = segment_causal_mask(segment_ids).with_window(window)
    return mask, rope_cos_sin(positions, inverse_frequencies(rope, head_dim), dtype)


# =============================================================================================
# KV cache (cached decoding: generation, regeneration, speculative decoding)
# =============================================================================================
# The cache is a fixed-size buffer {"k", "v"}: [L, B, S, Hkv, D] each, S static. A call runs a
# chunk of T new tokens per row, writes their K/V at slots start[b] .. start[b]+T-1 and attends to
# every slot < start[b] (the row's valid prefix) plus the chunk itself under `chunk_mask`
# (causal by default; a tree mask for tree verification). Slots >= start + T are never read, so
# rolling back rejected draft tokens is just passing a smaller `start` next time: the stale
# entries are masked, then overwritten. Writes past S are dropped (never clamped onto live slots).
CACHE_MULTIPLE = 256  # static cache sizes are rounded up to this, so few distinct shapes compile


def cache_size_for(max_len: int, multiple: int = CACHE_MULTIPLE) -> int:
    """The static cache length for `max_len` slots (rounded up to a multiple, at least one)."""
    if max_len < 1:
        raise ValueError(f"cache max_len must be >= 1, got {max_len}")
    return -(-int(max_len) // multiple) * multiple


def cache_attention_mask(start_b: jax.Array, num_slots: int, chunk_mask_btt: jax.Array,
                         valid_from_b: jax.Array | None = None) -> jax.Array:
    """bool [B, T, S]: slot j is visible to chunk query i iff valid_from[b] <= j < start[b], or j is
    chunk slot start[b]+c with chunk_mask[b, i, c]. (valid_from > 0 skips left padding.)"""
    b, t, _ = chunk_mask_btt.shape
    rel = jnp.arange(num_slots, dtype=jnp.int32)[None, :] - start_b[:, None]  # [B, S] slot - start
    prefix = rel < 0
    if valid_from_b is not None:
        prefix = prefix & (jnp.arange(num_slots, dtype=jnp.int32)[None, :] >= valid_from_b[:, None])
    in_chunk = (rel >= 0) & (rel < t)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (b, t, num_slots))
    chunk = jnp.take_along_axis(chunk_mask_btt, idx, axis=2)
    return prefix[:, None, :] | (in_chunk[:, None, :] & chunk)


def write_kv_cache(cache: dict, layer, slots_bt, k_btkh, v_btkh) -> dict:
    """Scatter the chunk's K/V into the carried full cache at (layer, row, slot) (in place inside the
    layer loop; out-of-range slots drop); returns the new cache."""
    rows = jnp.arange(k_btkh.shape[0])[:, None]
    kc = cache["k"].at[layer, rows, slots_bt].set(k_btkh.astype(cache["k"].dtype), mode="drop")
    vc = cache["v"].at[layer, rows, slots_bt].set(v_btkh.astype(cache["v"].dtype), mode="drop")
    return {**cache, "k": kc, "v": vc}


def cached_attention(q_btnh, cache: dict, layer, mask_bts, limit_b, spec: AttentionConfig, sinks=None):
    """Attention of a chunk's queries over `layer` of the cache (its own K/V already written), under
    the chunk's bool [B,T,S] mask or the ChunkMask `decoding.chunk_inputs` prepared for every layer.
    Short chunks (decode steps, draft verification) take `specjax_kernels.decode_attention` when it
    is chosen (a GPU kernel reading the live prefix of the stacked cache in place); the rest, and a
    prefill, slice the layer out and run the plain / blocked path (so does every chunk of a target with
    attention sinks, which the kernel does not take)."""
    from specjax_kernels.decode_attention import api as decode

    scale = spec.scale
    if sinks is None and decode.takes(q_btnh.shape, cache["k"].shape, spec.decode_implementation):
        return decode.decode_attention(q_btnh, cache["k"], cache["v"], layer, mask_bts, limit_b, scale=scale,
                                       implementation=spec.decode_implementation)
    k = jax.lax.dynamic_index_in_dim(cache["k"], layer, axis=0, keepdims=False).astype(q_btnh.dtype)
    v = jax.lax.dynamic_index_in_dim(cache["v"], layer, axis=0, keepdims=False).astype(q_btnh.dtype)
    return dot_product_attention(q_btnh, k, v, decode.plain_mask(mask_bts), scale=scale, q_block=spec.q_block,
                                 implementation=spec.implementation, sinks=sinks)


# =============================================================================================
# Attention (mask, plain / blocked / kernel / context-parallel paths)
# =============================================================================================


# the query block of a banded sliding-window layer when the target sets none (gpt-oss on an H100, 1 x 4096:
# 13,630 -> 17,746 tokens/s with its 12 windowed layers banded at 512 + 128 keys; benchmarks/results/gpt_oss.md)
BAND_Q_BLOCK = 512


def _rows(q_seg_bn, q_idx_n, k_seg_bs, window=None, k_start=0):
    """bool [B, n, S]: query at global index q_idx sees key s iff s <= q_idx, same segment and (with
    a window) q_idx - window < s. Within a packed segment, index differences are position differences.
    `k_start`: the global index of key 0 (a band of keys sliced from a longer row)."""
    k_idx = k_start + jnp.arange(k_seg_bs.shape[-1])[None, :]
    causal = k_idx <= q_idx_n[:, None]
    if window is not None:
        causal = causal & (k_idx > q_idx_n[:, None] - window)
    return causal[None] & (q_seg_bn[:, :, None] == k_seg_bs[:, None, :])


@jax.tree_util.register_pytree_node_class
class SegmentCausalMask:
    """The [B, T, T] segment-causal mask, held as its [B, T] segment ids and an optional sliding
    window (an int, or a traced int32 scalar when layers of one scan differ; see module docstring).
    `band`: a static bound on every window shorter than the row that the mask can hold (the config's
    sliding window when the window is traced), so the plain path reads only that many keys back."""

    def __init__(self, segment_ids_bt, window=None, band=None):
        self.segment_ids = segment_ids_bt
        self.window = window
        self.band = int(window) if band is None and isinstance(window, (int, np.integer)) else band

    def with_window(self, window, band=None) -> "SegmentCausalMask":
        """The same mask restricted to a sliding window (None: no window); `band` as the class says."""
        return SegmentCausalMask(self.segment_ids, window, band)

    def tree_flatten(self):
        return (self.segment_ids, self.window), self.band

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, band=aux)

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
        return _rows(self.segment_ids, jnp.arange(t), self.segment_ids, self.window)

    def __jax_array__(self):
        return self.materialize()

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.materialize(), dtype=dtype)

    def __getitem__(self, idx):
        return self.materialize()[idx]


def segment_causal_mask(segment_ids_bt: jnp.ndarray) -> SegmentCausalMask:
    """[B, T, T] (lazy): query i may see key j iff j <= i and both have the same segment id.

    Padding (segment 0) only sees other padding, so every row keeps its diagonal and the softmax
    never sees an all-masked row (no NaNs); padded outputs are garbage and must be masked by callers.
    """
    return SegmentCausalMask(segment_ids_bt)


def _attend(q_btkgh, k_bskh, v_bskh, mask_bts, scale, sinks=None):
    acc = accum_dtype(q_btkgh)  # fp32, or fp64 for fp64 inputs
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=acc)
    scores = scores * jnp.asarray(scale, acc)
    scores = jnp.where(mask_bts[:, None, None, :, :], scores, jnp.finfo(acc).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    else:  # the sink is one more logit in the denominator, with no value (it takes probability away)
        _, _, kv, g, _ = q_btkgh.shape
        sink = sinks.astype(acc).reshape(1, kv, g, 1, 1)
        m = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
        e = jnp.exp(scores - m)
        probs = (e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))).astype(v_bskh.dtype)
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
    sinks: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """Attention with N query heads sharing K kv heads (N % K == 0). Returns [B, T, N, H].
    ``mask_bts``: a bool [B, T, S] array or a ``SegmentCausalMask`` (S = T).

    ``implementation`` (training-time self-attention with a SegmentCausalMask only): None/"auto" =
    on GPU and TPU (the platform kernels are chosen for: ``specjax_kernels.selection.target_platform``;
    on TPU lowered, not yet measured) the flash-style kernels of ``specjax_kernels.ttt_attention`` with no diagonal keys
    (causal + segment-aware + GQA, O(T) memory; benchmarks/results/train_throughput.md measured the
    plain path's [B,N,T,T] fp32 scores as the largest cost of the target forward), elsewhere the
    plain path below (exact reference; the HF parity tests run it). "plain" forces the plain path;
    any ttt_attention implementation name forces that kernel.

    ``sinks`` [N] (gpt-oss): a per-head logit added to every softmax denominator, with no value: the
    plain path puts it in its softmax, the kernels merge it with their log-sum-exp."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    if n % kv:
        raise ValueError(f"num_attention_heads={n} is not a multiple of num_key_value_heads={kv}")
    # Heads are grouped as HF's repeat_kv does: query head i uses kv head i // (N // K).
    cp_mesh = meshlib.context_mesh()
    if cp_mesh is not None and k_bskh.shape[1] == t:  # training-time self-attention (not a KV-cache decode)
        if sinks is not None:
            raise NotImplementedError("attention sinks (gpt-oss) under context parallelism: set "
                                      "parallelism.context=1")
        return _context_parallel(q_btnh, k_bskh, v_bskh, mask_bts, scale, q_block, cp_mesh, implementation)
    if implementation in (None, "auto"):
        implementation = "auto" if target_platform() in ("gpu", "tpu") else "plain"
    if not isinstance(mask_bts, SegmentCausalMask):
        return _grouped(q_btnh, k_bskh, v_bskh, mask_bts, scale, q_block, sinks)
    seg, window = mask_bts.segment_ids, mask_bts.window

    def plain():
        def run(band):
            # a band needs query blocks (the full [T, S] scores are what it avoids): BAND_Q_BLOCK by default
            block = q_block or (BAND_Q_BLOCK if band is not None and t % BAND_Q_BLOCK == 0 else 0)
            return _grouped(q_btnh, k_bskh, v_bskh, (seg, seg, 0, window), scale, block, sinks, band)

        band = mask_bts.band
        if band is None or window is None:
            return run(None)
        if isinstance(window, (int, np.integer)):
            return run(band if window <= band else None)
        # a traced window: the layers within the band read only its keys, the others (full attention) all
        return jax.lax.cond(window <= band, lambda: run(band), lambda: run(None))

    if implementation == "plain" or k_bskh.shape[1] != t:
        record_choice("target_attention", "plain" + ("" if window is None else " (sliding window)"))
        return plain()

    def kernel():
        # step 0 of the TTT attention is exactly segment-causal GQA self-attention (sinks: one more
        # logit per head in the kernels' softmax, merged from their logsumexp)
        return ttt_attention(q_btnh, k_bskh, v_bskh, None, None, seg, scale=scale, implementation=implementation,
                             sinks=sinks)

    if window is None or (isinstance(window, (int, np.integer)) and window >= t):  # a window >= T hides nothing
        record_choice("target_attention", "ttt_attention kernel")
        return kernel()
    if isinstance(window, (int, np.integer)):
        record_choice("target_attention", "plain (sliding window; the kernels have none)")
        return plain()
    # the kernels have no window: they run the layers whose window covers the sequence (a traced
    # per-layer window, as in Gemma 3's local/global scan, picks at run time) and the plain path the rest
    record_choice("target_attention", "ttt_attention kernel, plain blocked path where a sliding window cuts")
    return jax.lax.cond(jnp.asarray(window) >= t, kernel, plain)


def _grouped(q_btnh, k_bskh, v_bskh, mask, scale, q_block, sinks=None, band=None):
    """`mask`: a bool [B, T, S] array, or (query segment ids [B, T], key segment ids [B, S], global
    index of query row 0, sliding window or None) from which each block's rows are built. `band`: a
    static bound on that window (when it is shorter than the row): each query block then reads only
    the q_block + band keys that can hold its window, not all S."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    q = q_btnh.reshape(b, t, kv, n // kv, h)
    lazy = isinstance(mask, tuple)
    if not q_block or t <= q_block or t % q_block:
        m = _rows(mask[0], mask[2] + jnp.arange(t), mask[1], mask[3]) if lazy else mask
        out = _attend(q, k_bskh, v_bskh, m, scale, sinks)
        return out.reshape(b, t, n, h)
    nb = t // q_block
    q_blocks = jnp.moveaxis(q.reshape(b, nb, q_block, kv, n // kv, h), 1, 0)
    if lazy:
        q_seg, k_seg, q0, window = mask
        s_blocks = jnp.moveaxis(q_seg.reshape(b, nb, q_block), 1, 0)
        starts = q0 + jnp.arange(nb) * q_block

        s_len = k_bskh.shape[1]
        width = q_block + band if band is not None else s_len

        def one(x):
            qb, sb, st = x
            if width >= s_len:
                return _attend(qb, k_bskh, v_bskh, _rows(sb, st + jnp.arange(q_block), k_seg, window), scale, sinks)
            # the block's queries st..st+q_block-1 see keys after st - band at the earliest
            k0 = jnp.clip(st + q_block - width, 0, s_len - width)
            ks, vs = (jax.lax.dynamic_slice_in_dim(a, k0, width, axis=1) for a in (k_bskh, v_bskh))
            rows = _rows(sb, st + jnp.arange(q_block), jax.lax.dynamic_slice_in_dim(k_seg, k0, width, axis=1),
                         window, k_start=k0)
            return _attend(qb, ks, vs, rows, scale, sinks)

        out = jax.lax.map(one, (q_blocks, s_blocks, starts))
    else:
        m_blocks = jnp.moveaxis(mask.reshape(b, nb, q_block, mask.shape[-1]), 1, 0)
        out = jax.lax.map(lambda qm: _attend(qm[0], k_bskh, v_bskh, qm[1], scale, sinks), (q_blocks, m_blocks))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, n, h)


def _context_parallel(q_btnh, k_bskh, v_bskh, mask_bts, scale, q_block, mesh, implementation=None):
    """Context parallelism (forward only): each `context` shard keeps its query rows, all-gathers
    K/V (tiled, so shard c sees keys 0..T-1 in order) and computes exactly its rows. A
    SegmentCausalMask (the training forward) runs the blockwise online softmax of
    `ttt_attention_context_parallel`; only the segment ids cross devices. An array mask is split by
    rows ([B, T/C, T] per shard) and takes the plain blocked path. See docs/architecture.md."""
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
    window = mask_bts.window if lazy else None
    if lazy and window is None:
        # the training forward's segment-causal self-attention: step 0 of the TTT attention, whose
        # context-parallel form walks the gathered keys block by block with an online softmax from
        # each shard's global offset (O(T/C x block) scores per device, never [B, N, block, T])
        # kernels.target_attention=pallas_gpu opts into the Triton forward with a global query offset
        # (interpret-tested; auto keeps the lax loops until it has run on a GPU)
        forward = "pallas_gpu" if implementation == "pallas_gpu" else "xla"
        record_choice("target_attention", f"ttt_attention context parallel ({forward})")
        return ttt_attention_context_parallel(q_btnh, k_bskh, v_bskh, None, None, mask_bts.segment_ids, mesh=mesh,
                                              axis=axis, q_spec=q_spec, kv_spec=kv_spec, scale=scale,
                                              block_size=block, forward=forward)
    # a sliding-window mask (no online-softmax form yet) takes the plain blocked path over gathered keys
    m_in, m_spec = (mask_bts.segment_ids, P(batch, axis)) if lazy else (mask_bts, P(batch, axis, None))
    w_in = jnp.asarray(window if window is not None else t, jnp.int32)

    def body(q, k, v, m, w):
        k = jax.lax.all_gather(k, axis, axis=1, tiled=True)
        v = jax.lax.all_gather(v, axis, axis=1, tiled=True)
        if lazy:
            t_local = q.shape[1]
            m = (m, jax.lax.all_gather(m, axis, axis=1, tiled=True), jax.lax.axis_index(axis) * t_local, w)
        return _grouped(q, k, v, m, scale, block)

    if lazy:
        record_choice("target_attention", "context parallel plain blocked path (sliding window)")
    return jax.shard_map(body, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, m_spec, P()),
                         out_specs=q_spec, check_vma=False)(q_btnh, k_bskh, v_bskh, m_in, w_in)

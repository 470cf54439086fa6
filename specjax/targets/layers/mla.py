"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2) for frozen targets.

Read top to bottom: the static shape (MLAConfig), the projections every path shares (queries, the
compressed KV latent and the shared RoPE key), the training forward (keys and values expanded per
head, then the shared attention of ``layers/attention.py``), and cached decoding over the latent
cache (the absorbed form).

Per token h [D] (transformers' ``DeepseekV3Attention``):
  * queries: q = h @ q_proj, or with a query LoRA q = RMSNorm(h @ q_a_proj) @ q_b_proj, viewed as
    N heads of qk_nope_head_dim + qk_rope_head_dim; the last qk_rope_head_dim dims get RoPE.
  * keys and values: h @ kv_a_proj_with_mqa = [c (kv_lora_rank) | k_rope (qk_rope_head_dim)];
    c = RMSNorm(c) is the compressed latent, k_rope (one head, shared by all) gets RoPE; then
    c @ kv_b_proj gives each head's k_nope (qk_nope_head_dim) and v (v_head_dim), and head n's key is
    [k_nope_n | k_rope].
  * scores (q . k) * softmax_scale, softmax in fp32, output heads [N * v_head_dim] @ o_proj.
  * optionally a per-token query scale (``q_scale_bt`` of :func:`mla_block`; Mistral 4's Llama-4
    attention scaling by position): every head's whole query (nope and rope dims) times it, in both
    the training forward and cached decoding (the absorbed query is linear in it).
Both LoRA norms use eps 1e-6 whatever the config's rms_norm_eps (transformers builds them with the
norm's default). ``rope_interleave`` (DeepSeek's checkpoints: true): the RoPE dims of q and k hold
interleaved pairs (x0, x1), (x2, x3), ...; they are de-interleaved to [x0, x2, ... | x1, x3, ...]
and then rotated in the half-split convention, which is the rotation transformers applies (the
outputs of q and k share the permutation, so the scores are those of the interleaved rotation).

Cached decoding keeps per layer only what the keys and values are made from: the normed latent c
[L, B, S, kv_lora_rank] ("kv") and the roped shared key [L, B, S, qk_rope_head_dim] ("k_rope"),
576 values per token at DeepSeek-V3's shape instead of 128 heads x (192 + 128). The chunk's queries
absorb kv_b_proj's key part (q_nope @ W_uk: [N, kv_lora_rank] per token), score against the cached
latents and RoPE keys directly, and the value part W_uv is applied after the weighted sum of
latents. Slots, the chunk mask and rollback follow ``layers/attention.py`` "KV cache": a chunk is
written at slots start.., attends to the valid prefix plus itself under its chunk mask, and rollback
is a smaller start next time. Both leaves keep the slot on axis 2 (``base.commit_tree_path``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.layers.norms import rms_norm
from specjax.layers.rope import apply_rope
from specjax.targets.layers.attention import cache_size_for, dot_product_attention
from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.selection import target_platform

LORA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' RMSNorm default, not rms_norm_eps


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Static shape and options of an MLA block (hashable; a target config builds it)."""

    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # (qk_nope + qk_rope) ** -0.5, times YaRN's mscale^2 where it applies
    rope_interleave: bool = True
    q_block: int = 0  # queries in blocks of this many tokens (0 = one block); bounds the score buffer
    implementation: str | None = None  # the training forward's attention (layers/attention.dot_product_attention)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# =============================================================================================
# Projections (training forward and cached decoding)
# =============================================================================================
def rotate(x, cos_bth, sin_bth, interleaved: bool):
    """RoPE on [B, T, N, d] (or [B, T, d]) in MLA's layout (module docstring)."""
    squeeze = x.ndim == 3
    x = x[:, :, None, :] if squeeze else x
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    out = apply_rope(x, cos_bth, sin_bth)
    return out[:, :, 0, :] if squeeze else out


def queries(p: dict, spec: MLAConfig, h_btd, rope):
    """(q_nope [B,T,N,qk_nope], roped q_rope [B,T,N,qk_rope]) of a normed hidden state."""
    b, t, _ = h_btd.shape
    if spec.q_lora_rank is None:
        q = h_btd @ p["q_proj"]["kernel"]
    else:
        q = rms_norm(h_btd @ p["q_a_proj"]["kernel"], p["q_a_layernorm"]["scale"], LORA_NORM_EPS)
        q = q @ p["q_b_proj"]["kernel"]
    q = q.reshape(b, t, spec.num_heads, spec.qk_head_dim)
    q_nope, q_rope = q[..., :spec.qk_nope_head_dim], q[..., spec.qk_nope_head_dim:]
    return q_nope, rotate(q_rope, *rope, spec.rope_interleave)


def latents(p: dict, spec: MLAConfig, h_btd, rope):
    """(normed latent c [B,T,kv_lora_rank], roped shared key [B,T,qk_rope]) of a normed hidden state."""
    ckv = h_btd @ p["kv_a_proj_with_mqa"]["kernel"]
    c = rms_norm(ckv[..., :spec.kv_lora_rank], p["kv_a_layernorm"]["scale"], LORA_NORM_EPS)
    return c, rotate(ckv[..., spec.kv_lora_rank:], *rope, spec.rope_interleave)


def _kv_up(p: dict, spec: MLAConfig):
    """kv_b_proj as (W_uk [R, N, qk_nope], W_uv [R, N, v_head_dim])."""
    w = p["kv_b_proj"]["kernel"].reshape(spec.kv_lora_rank, spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim)
    return w[..., :spec.qk_nope_head_dim], w[..., spec.qk_nope_head_dim:]


def attention_width(spec: MLAConfig) -> int:
    """The head width the training forward's attention runs at: max(qk head, v head), rounded up to a
    power of two where a GPU flash kernel may take it (the Triton / Pallas GPU kernels of
    ``specjax_kernels.ttt_attention`` need one: DeepSeek-V3's 192 runs as 256 there)."""
    width = max(spec.qk_head_dim, spec.v_head_dim)
    kernel = spec.implementation in (None, "auto", "triton", "pallas_gpu")
    if kernel and target_platform() == "gpu" and width & (width - 1):
        width = max(16, 1 << (width - 1).bit_length())
    return width


def _pad_last(x, size: int):
    extra = size - x.shape[-1]
    return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


# =============================================================================================
# The block
# =============================================================================================
def mla_block(p: dict, spec: MLAConfig, h_btd, mask, rope, *, cache: dict | None = None, layer=None,
              slots_bt=None, q_scale_bt=None):
    """MLA of a normed hidden state [B,T,D]: (o_proj output [B,T,D], new cache or None).

    ``p``: {"q_proj"} or {"q_a_proj", "q_a_layernorm", "q_b_proj"}, and {"kv_a_proj_with_mqa",
    "kv_a_layernorm", "kv_b_proj", "o_proj"} ({"kernel"} / {"scale"} leaves, kernels [in, out]).
    ``rope``: (cos, sin) [B,T,qk_rope_head_dim] (``layers/rope.rope_tables``). Training forward: no
    cache, ``mask`` the chunk's SegmentCausalMask. Cached decoding: ``cache`` {"kv", "k_rope"} of
    :func:`init_cache`, this ``layer``'s row, the ``slots_bt`` the chunk is written to and the bool
    [B,T,S] ``mask`` of ``attention.cache_attention_mask``. ``q_scale_bt`` [B,T] (None: no scaling)
    multiplies each token's queries (module docstring).
    """
    b, t, _ = h_btd.shape
    q_nope, q_rope = queries(p, spec, h_btd, rope)
    if q_scale_bt is not None:
        scale = jnp.asarray(q_scale_bt).astype(q_nope.dtype)[:, :, None, None]
        q_nope, q_rope = q_nope * scale, q_rope * scale
    c, k_rope = latents(p, spec, h_btd, rope)
    if cache is not None:
        cache = _write(cache, layer, slots_bt, c, k_rope)
        o = absorbed_attention(p, spec, q_nope, q_rope, cache, layer, mask)
    else:
        w_uk, w_uv = _kv_up(p, spec)
        k_nope = jnp.einsum("btr,rnd->btnd", c, w_uk)
        v = jnp.einsum("btr,rnd->btnd", c, w_uv)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None, :], q_rope.shape)], axis=-1)
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        # one head width for q, k and v (zero padding changes neither the scores nor the kept dims),
        # so the shared attention paths (kernels, query blocks, context parallelism) apply unchanged
        width = attention_width(spec)
        o = dot_product_attention(_pad_last(q, width), _pad_last(k, width), _pad_last(v, width), mask,
                                  scale=spec.softmax_scale, q_block=spec.q_block,
                                  implementation=spec.implementation)[..., :spec.v_head_dim]
    return o.reshape(b, t, -1) @ p["o_proj"]["kernel"], cache


# =============================================================================================
# Cached decoding: the latent cache and the absorbed attention
# =============================================================================================
def init_cache(num_layers: int, batch_size: int, max_len: int, spec: MLAConfig, dtype=jnp.float32) -> dict:
    """Zeroed {"kv": [L, B, S, kv_lora_rank], "k_rope": [L, B, S, qk_rope_head_dim]},
    S = attention.cache_size_for(max_len)."""
    lead = (int(num_layers), int(batch_size), cache_size_for(max_len))
    return {"kv": jnp.zeros(lead + (spec.kv_lora_rank,), dtype),
            "k_rope": jnp.zeros(lead + (spec.qk_rope_head_dim,), dtype)}


def _write(cache: dict, layer, slots_bt, c_btr, k_rope_btd) -> dict:
    """The chunk's latents and RoPE keys into (layer, row, slot); slots past S are dropped."""
    rows = jnp.arange(c_btr.shape[0])[:, None]
    kv = cache["kv"].at[layer, rows, slots_bt].set(c_btr.astype(cache["kv"].dtype), mode="drop")
    kr = cache["k_rope"].at[layer, rows, slots_bt].set(k_rope_btd.astype(cache["k_rope"].dtype), mode="drop")
    return {**cache, "kv": kv, "k_rope": kr}


def absorbed_attention(p: dict, spec: MLAConfig, q_nope_btnd, q_rope_btnd, cache: dict, layer, mask_bts):
    """The chunk's attention over ``layer`` of the latent cache (its own latents already written):
    [B, T, N, v_head_dim]. Queries run in blocks of ``spec.q_block`` when the chunk divides into them."""
    w_uk, w_uv = _kv_up(p, spec)
    c = jax.lax.dynamic_index_in_dim(cache["kv"], layer, axis=0, keepdims=False).astype(q_nope_btnd.dtype)
    kr = jax.lax.dynamic_index_in_dim(cache["k_rope"], layer, axis=0, keepdims=False).astype(q_nope_btnd.dtype)
    q_lat = jnp.einsum("btnd,rnd->btnr", q_nope_btnd, w_uk)  # the key up-projection, absorbed
    acc = accum_dtype(q_lat)

    def attend(q_lat, q_rope, mask):
        scores = (jnp.einsum("btnr,bsr->bnts", q_lat, c, preferred_element_type=acc)
                  + jnp.einsum("btnd,bsd->bnts", q_rope, kr, preferred_element_type=acc))
        scores = jnp.where(mask[:, None], scores * jnp.asarray(spec.softmax_scale, acc), jnp.finfo(acc).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(c.dtype)
        return jnp.einsum("bnts,bsr->btnr", probs, c)

    b, t = q_nope_btnd.shape[:2]
    mask = jnp.asarray(mask_bts)
    blk = spec.q_block
    if not blk or t <= blk or t % blk:
        o_lat = attend(q_lat, q_rope_btnd, mask)
    else:  # bounds the [B, N, block, S] score buffer of a long prefill
        split = lambda x: jnp.moveaxis(x.reshape(b, t // blk, blk, *x.shape[2:]), 1, 0)  # noqa: E731
        o_lat = jax.lax.map(lambda a: attend(*a), (split(q_lat), split(q_rope_btnd), split(mask)))
        o_lat = jnp.moveaxis(o_lat, 0, 1).reshape(b, t, *o_lat.shape[3:])
    return jnp.einsum("btnr,rnv->btnv", o_lat, w_uv)  # the value up-projection, after the weighted sum

"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): which keys each query
of a multi-head latent attention layer (``layers/mla.py``) may attend to.

Read top to bottom: the static shape (IndexerConfig), the projections, the score and the top-k rule
(every path shares them), the training forward's mask over a SegmentCausalMask, then cached
decoding over the indexer's own key cache.

Per token h [D] (the layer's normed hidden state) and its query latent c_q = RMSNorm(h @ q_a_proj)
(MLA's query LoRA latent, [q_lora_rank]), with H index heads of width d (transformers'
``DeepseekV32Indexer``):
  * queries: c_q @ wq_b, viewed as H heads of d; keys: LayerNorm(h @ wk) (one head of d, shared by
    all index heads; a LayerNorm with weight and bias, eps 1e-6). The first qk_rope_head_dim dims of
    each query and key get RoPE from MLA's own tables (YaRN included), the rest pass. DeepSeek-V3.2
    rotates them in the half-split convention; GLM-5 in MLA's interleaved-pairs layout
    (``rope_interleave``: the pairs are de-interleaved first, as in mla.rotate).
  * head weights: w = (h @ weights_proj) * H ** -0.5 [H], in fp32 (transformers keeps weights_proj
    fp32 in any model dtype).
  * score of key s for query t: I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s] * d ** -0.5), fp32.
  * the rule: among the keys the query may see (its causal mask), keep the index_topk with the
    highest scores; a query that sees at most index_topk keys keeps all of them. The attention mask
    is the causal mask AND the kept keys. Ties at the k-th score keep the lower key index (lax.top_k).
DeepSeek's own inference code rotates q and k by a Hadamard transform and scores in FP8; the
transform is orthogonal (the dot products are unchanged) and FP8 is a precision choice, so
transformers skips both on every path, and so does this module. transformers applies the rule at
every length in its eager and SDPA paths (``topk = min(index_topk, keys)``).

When the number of keys (the chunk length in training, the cache length in decoding) is at most
index_topk, every query keeps every key it sees: the mask is returned unchanged and nothing is
computed (a training forward then keeps its SegmentCausalMask and the flash attention kernels).
Above it the mask is a dense bool [B, T, S] array: scores are built a query block at a time
(``q_block``), [B, H, block, S] fp32 each, and MLA runs its plain blocked attention path.

Cached decoding keeps the roped keys of every written slot in the indexer's key cache [L, B, S, d]
(``init_cache``; slot on axis 2 like the latent cache, so rollback and the tree commit move it with
the rest). A chunk writes its keys at its slots, then scores its queries against every slot under
the chunk's bool [B, T, S] cache mask, which is what the training forward sees for the same tokens.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax.layers.norms import rms_norm
from specjax.targets.layers.attention import SegmentCausalMask, cache_size_for
from specjax.targets.layers.mla import LORA_NORM_EPS, rotate
from specjax_kernels.dtypes import accum_dtype

KEY_NORM_EPS = 1e-6  # transformers builds the indexer's key LayerNorm with eps 1e-6


@dataclasses.dataclass(frozen=True)
class IndexerConfig:
    """Static shape and options of a lightning indexer (hashable; a target config builds it)."""

    num_heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    rope_dim: int  # qk_rope_head_dim: the leading dims of each query and key that get RoPE
    topk: int  # index_topk
    rope_interleave: bool = False  # GLM-5: interleaved pairs; DeepSeek-V3.2: half-split
    q_block: int = 0  # queries scored in blocks of this many tokens (0 = one block)


# =============================================================================================
# Projections, score and the top-k rule
# =============================================================================================
def layer_norm(x, weight, bias, eps: float):
    """LayerNorm over the last axis: statistics in fp32 (fp64 stays fp64), result in x's dtype."""
    acc = accum_dtype(x)
    x32 = x.astype(acc)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * weight.astype(acc) + bias.astype(acc)).astype(x.dtype)


def _rope_part(x, spec: IndexerConfig, rope):
    """RoPE on the leading rope_dim dims of [B, T, N, d] or [B, T, d]; the rest pass."""
    r = spec.rope_dim
    return jnp.concatenate([rotate(x[..., :r], *rope, spec.rope_interleave), x[..., r:]], axis=-1)


def query_latent(p_attn: dict, h_btd):
    """MLA's query LoRA latent RMSNorm(h @ q_a_proj) [B, T, q_lora_rank], which the indexer's
    queries are projected from (``p_attn``: MLA's params with q_a_proj and q_a_layernorm)."""
    return rms_norm(h_btd @ p_attn["q_a_proj"]["kernel"], p_attn["q_a_layernorm"]["scale"], LORA_NORM_EPS)


def queries(p: dict, spec: IndexerConfig, q_latent_btr, rope):
    """Roped index queries [B, T, H, d]."""
    b, t, _ = q_latent_btr.shape
    q = (q_latent_btr @ p["wq_b"]["kernel"]).reshape(b, t, spec.num_heads, spec.head_dim)
    return _rope_part(q, spec, rope)


def keys(p: dict, spec: IndexerConfig, h_btd, rope):
    """Roped index keys [B, T, d] (what the key cache holds)."""
    k = layer_norm(h_btd @ p["wk"]["kernel"], p["k_norm"]["scale"], p["k_norm"]["bias"], KEY_NORM_EPS)
    return _rope_part(k, spec, rope)


def head_weights(p: dict, spec: IndexerConfig, h_btd):
    """fp32 per-head weights [B, T, H] (weights_proj in fp32, times H ** -0.5)."""
    acc = jnp.promote_types(accum_dtype(h_btd), p["weights_proj"]["kernel"].dtype)
    w = h_btd.astype(acc) @ p["weights_proj"]["kernel"].astype(acc)
    return w * jnp.asarray(spec.num_heads**-0.5, acc)


def index_scores(q_bthd, k_bsd, w_bth):
    """fp32 [B, T, S]: sum over heads of w * ReLU(q . k * d ** -0.5)."""
    acc = jnp.promote_types(accum_dtype(q_bthd), w_bth.dtype)
    dots = jnp.einsum("bthd,bsd->bhts", q_bthd, k_bsd.astype(q_bthd.dtype), preferred_element_type=acc)
    dots = jax.nn.relu(dots * jnp.asarray(q_bthd.shape[-1] ** -0.5, acc))
    return jnp.einsum("bth,bhts->bts", w_bth.astype(acc), dots)


def topk_keep(scores_bts, visible_bts, k: int):
    """bool [B, T, S]: the visible keys among each query's k highest scores (all visible keys
    when it sees at most k); ties keep the lower key index."""
    b, t, s = scores_bts.shape
    visible_bts = jnp.asarray(visible_bts, bool)
    if s <= k:
        return visible_bts
    masked = jnp.where(visible_bts, scores_bts, -jnp.inf)  # unseen keys rank last
    _, idx = jax.lax.top_k(masked, k)
    chosen = jnp.zeros((b, t, s), bool).at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], idx].set(True)
    return chosen & visible_bts


def _keep_in_blocks(spec: IndexerConfig, q_bthd, k_bsd, w_bth, visible_bts):
    """:func:`topk_keep` of :func:`index_scores`, a query block at a time when ``q_block`` divides T."""
    b, t = q_bthd.shape[:2]
    blk = spec.q_block

    def one(q, w, visible):
        return topk_keep(index_scores(q, k_bsd, w), visible, spec.topk)

    if not blk or t <= blk or t % blk:
        return one(q_bthd, w_bth, visible_bts)
    split = lambda x: jnp.moveaxis(x.reshape(b, t // blk, blk, *x.shape[2:]), 1, 0)  # noqa: E731
    out = jax.lax.map(lambda a: one(*a), (split(q_bthd), split(w_bth), split(visible_bts)))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, -1)


# =============================================================================================
# Training forward: the mask over a chunk's SegmentCausalMask
# =============================================================================================
def forward_mask(p: dict, spec: IndexerConfig, h_btd, q_latent_btr, rope, mask: SegmentCausalMask):
    """The chunk's attention mask with the indexer applied: ``mask`` itself while T <= index_topk,
    else a bool [B, T, T] array (the segment-causal keys each query keeps). ``p``: {"wq_b", "wk",
    "weights_proj": {"kernel"}, "k_norm": {"scale", "bias"}}; ``rope``: MLA's (cos, sin) tables."""
    t = h_btd.shape[1]
    if t <= spec.topk:
        return mask
    q = queries(p, spec, q_latent_btr, rope)
    k = keys(p, spec, h_btd, rope)
    return _keep_in_blocks(spec, q, k, head_weights(p, spec, h_btd), jnp.asarray(mask))


# =============================================================================================
# Cached decoding: the indexer's key cache
# =============================================================================================
def init_cache(num_rows: int, batch_size: int, max_len: int, spec: IndexerConfig, dtype=jnp.float32):
    """Zeroed key cache [L, B, S, index_head_dim], S = attention.cache_size_for(max_len)."""
    return jnp.zeros((int(num_rows), int(batch_size), cache_size_for(max_len), spec.head_dim), dtype)


def decode_mask(p: dict, spec: IndexerConfig, h_btd, q_latent_btr, rope, mask_bts, key_cache, row, slots_bt):
    """A chunk's cache mask with the indexer applied: (bool [B, T, S], new key cache). The chunk's
    keys go to ``row`` of ``key_cache`` at ``slots_bt`` (slots past S dropped), then its queries
    score every slot of the row under the bool [B, T, S] ``mask_bts``. A cache of at most
    index_topk slots is neither written nor read (every visible key is kept)."""
    mask_bts = jnp.asarray(mask_bts, bool)
    if key_cache.shape[2] <= spec.topk:
        return mask_bts, key_cache
    k_new = keys(p, spec, h_btd, rope)
    rows = jnp.arange(h_btd.shape[0])[:, None]
    key_cache = key_cache.at[row, rows, slots_bt].set(k_new.astype(key_cache.dtype), mode="drop")
    k_all = jax.lax.dynamic_index_in_dim(key_cache, row, axis=0, keepdims=False)
    q = queries(p, spec, q_latent_btr, rope)
    return _keep_in_blocks(spec, q, k_all, head_weights(p, spec, h_btd), mask_bts), key_cache

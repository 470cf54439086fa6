"""DFlash 2: the DFlash block drafter (specjax.drafts.dflash) plus a two-tap dynamic convolution
around each draft sublayer and a pairwise path selector over each slot's top-k candidates, as
speculators 0.9 defines it (speculators/models/dflash2: model_definitions.py, core.py, metrics.py).
Everything not listed here is DFlash's, imported from specjax.drafts.dflash: the context rows, the
anchors, the block inputs and positions, the attention (chunked and dense), the context cache, the
teacher, the slot decay and the metrics.

What DFlash 2 adds.
  Convolution. A sublayer f (attention, then the MLP) of every draft layer runs as
      u = conv(x_n, base[0], d[0]);   y = conv(f(u), base[1], d[1]);   x + y
  where x_n is the layer's normed input to f, d = kernel_projection(x_n) viewed as
  [2 sides, taps, G groups] per slot (one delta per group of conv_group_size channels), and
      conv(z, b, d)[s] = sum_{t < taps, t <= s} (b[t] + d[s, t, group]) * z[s - t]
  runs over the slots of one block: slot s reads slots s, s-1, ..., never a slot of another block nor
  a later one. The context rows are not convolved (the attention's keys/values of the context come
  from fc's rows as in DFlash). base_kernel starts as [1, 0, ...] and the projection as 0, so an
  initial DFlash 2 layer is the DFlash layer.
  Selector. After lm_head(norm(h)) (the "unary" logits over the full vocab), each drafted slot keeps
  its top-k (selector_top_k) tokens c and scores them
      score(c) = unary(c) + < P[pred] * (W h_n), Q[c] >
  with h_n the slot's final-normed state, W the hidden projection [H -> rank], P / Q the predecessor /
  successor codebooks [V, rank] and pred the token before the slot: in training the real token
  x[a+i-1] (teacher forcing), while drafting the token chosen for the slot before (the anchor for the
  first drafted slot). Drafting walks the slots in order, taking the best-scoring candidate (greedy)
  or sampling softmax(score / T) over the k candidates: the walk vLLM's DFlash2 speculator does.

Objective (speculators' DFlash2DraftModel.forward with its default loss kl_div):
  loss = unary + selector_loss_alpha * selector
  unary     DFlash's "teacher_kl" loss of the unary logits (dflash.dflash_loss's teacher_kl objective:
            KL(teacher || draft) per slot, slot mask, decay exp(-(i-1)/gamma), per row / (mask + 1e-5),
            mean over rows)
  selector  per slot the k-way cross-entropy of the candidate scores against the teacher's argmax
            token, with the same slot mask, decay and reduction. The candidates are the unary top-k;
            when the teacher's token is not among them it replaces the last (k-th) candidate, so every
            slot has a label. The selector's gradient reaches the unary logits too (the gathered
            unary(c) term), as in speculators.
Metrics: DFlash's per-slot accuracy of the unary argmax; accept_len is the realised selector path
(teacher-forced: a slot counts when the teacher's token was among the unary top-k and scores best;
speculators' "eal"), plus unary_loss, selector_loss and recall (target within the unary top-k).

Not implemented (as in DFlash here): speculators' other loss terms, D-PACE weights, sliding-window
layers. DFlash 2 needs the full vocab: draft_vocab_size must equal vocab_size (speculators refuses
otherwise; the codebooks are indexed by target ids).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import jax
import jax.numpy as jnp

from specjax.drafts import dflash, weights
from specjax.drafts.dflash2_weights import CONVS, DFLASH2_WEIGHTS, EXTRA_WEIGHTS
from specjax.drafts.eagle3 import init_params
from specjax.drafts.teacher import TopKTeacher, dense_logits
from specjax.layers.logits import soft_cap
from specjax.layers.norms import rms_norm

__all__ = ["DFLASH2_WEIGHTS", "DFlash2Config", "DFlash2LossConfig", "block_forward", "candidate_scores",
           "config_from_dict", "config_to_dict", "conv_finish", "conv_prepare", "dflash2_loss", "draft_block",
           "draft_forward", "final_states", "grouped_conv", "init_draft_params", "param_logical_axes",
           "predecessor_ids", "propose_block", "teacher_logits", "training_candidates", "walk_candidates"]

KL_DENOM_EPS = 1e-5  # speculators' loss_function adds this to the per-row mask count (both terms)


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DFlash2Config(dflash.DFlashConfig):
    """A DFlash config plus the convolution and selector shapes (speculators' defaults)."""
    conv_kernel_size: int = 2  # taps of each dynamic convolution
    conv_group_size: int = 16  # channels sharing one dynamic delta
    selector_rank: int = 256  # width of the codebooks / the hidden projection
    selector_top_k: int = 16  # candidates the selector scores per slot

    def validate(self) -> None:
        super().validate()

        def fail(field, problem, fix):
            raise ValueError(f"DFlash2Config.{field}={getattr(self, field)!r}: {problem}. Fix: {fix}.")

        for field in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if int(getattr(self, field)) < 1:
                fail(field, "must be a positive integer", f"set {field} >= 1")
        if self.hidden_size % self.conv_group_size:
            fail("conv_group_size", f"does not divide hidden_size={self.hidden_size}",
                 "use a group size that divides the hidden size (16 for most targets)")
        if self.conv_kernel_size > self.block_size:
            fail("conv_kernel_size", f"exceeds block_size={self.block_size} (a tap past the block reads nothing)",
                 f"use conv_kernel_size <= {self.block_size}")
        if self.draft_vocab_size != self.vocab_size:
            fail("draft_vocab_size", f"is not the target vocab ({self.vocab_size}): DFlash 2 drafts over the full "
                 "vocab (its codebooks are indexed by target token ids)", f"set draft_vocab_size={self.vocab_size}")
        if self.selector_top_k > self.vocab_size:
            fail("selector_top_k", f"exceeds the vocab ({self.vocab_size})", f"use selector_top_k <= {self.vocab_size}")

    @property
    def num_groups(self) -> int:
        return self.hidden_size // self.conv_group_size


def as_dflash2(cfg: dflash.DFlashConfig, **extra) -> DFlash2Config:
    """The DFlash2Config with the fields of a DFlashConfig `cfg` and the DFlash 2 fields `extra`."""
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(dflash.DFlashConfig)}
    return DFlash2Config(**base, **extra)


def config_to_dict(cfg: DFlash2Config) -> dict:
    return dflash.config_to_dict(cfg)


def config_from_dict(d: dict) -> DFlash2Config:
    d = dict(d)
    own = {f.name: d.pop(f.name) for f in dataclasses.fields(DFlash2Config)
           if f.name not in {g.name for g in dataclasses.fields(dflash.DFlashConfig)} and f.name in d}
    return as_dflash2(dflash.config_from_dict(d), **own)


# ---------------------------------------------------------------------------------------------
# params
# ---------------------------------------------------------------------------------------------
def init_draft_params(cfg: DFlash2Config, key: jax.Array, *, lm_head_rows=None, std: float = 0.02,
                      dtype=jnp.float32) -> dict:
    """DFlash's init (the same leaves as dflash.init_draft_params for `key`), then the convolutions
    as the identity and the selector normal(0, std) from keys folded after DFlash's."""
    params = dflash.init_draft_params(cfg, key, lm_head_rows=lm_head_rows, std=std, dtype=dtype)
    extra = init_params(EXTRA_WEIGHTS, cfg, jax.random.fold_in(key, 1 << 20), std=std, dtype=dtype)
    for i in range(cfg.num_layers):
        for conv in CONVS:
            c = extra["layers"][str(i)][conv]
            c["base_kernel"] = jnp.zeros_like(c["base_kernel"]).at[:, 0].set(1.0)
            c["kernel_projection"]["kernel"] = jnp.zeros_like(c["kernel_projection"]["kernel"])
            params["layers"][str(i)][conv] = c
    params["candidate_selector"] = extra["candidate_selector"]
    return params


def param_logical_axes(cfg: DFlash2Config) -> dict:
    return weights.logical_axes(DFLASH2_WEIGHTS, cfg)


# ---------------------------------------------------------------------------------------------
# the convolution
# ---------------------------------------------------------------------------------------------
def linear(x, p):
    return jnp.einsum("...i,io->...o", x, p["kernel"].astype(x.dtype))


def grouped_conv(z, delta, base, group_size: int):
    """conv(z, base, delta) over the slot axis (-2) of z [..., S, H]: delta [..., S, taps, G],
    base [taps, H]; slot s reads slots s - t for t <= s only."""
    S = z.shape[-2]
    taps = base.shape[0]
    coef = base.astype(z.dtype) + jnp.repeat(delta, group_size, axis=-1)  # [..., S, taps, H]
    out = coef[..., 0, :] * z
    for t in range(1, min(taps, S)):
        shifted = jnp.concatenate([jnp.zeros_like(z[..., :t, :]), z[..., :S - t, :]], axis=-2)
        out = out + coef[..., t, :] * shifted
    return out


def conv_prepare(conv: dict, cfg: DFlash2Config, x):
    """The input-side convolution of a sublayer's input `x` [..., S, H] and the output side's deltas."""
    d = linear(x, conv["kernel_projection"]).reshape(*x.shape[:-1], 2, cfg.conv_kernel_size, cfg.num_groups)
    return grouped_conv(x, d[..., 0, :, :], conv["base_kernel"][0], cfg.conv_group_size), d[..., 1, :, :]


def conv_finish(conv: dict, cfg: DFlash2Config, y, delta):
    return grouped_conv(y, delta, conv["base_kernel"][1], cfg.conv_group_size)


def layer_forward(layer: dict, cfg: DFlash2Config, x, pos_blk, attend):
    """One DFlash 2 decoder layer over blocks x [B, N, S, H]; `attend(q, k_blk, v_blk)` is DFlash's
    attention against the context rows."""
    xn = rms_norm(x, layer["input_layernorm"]["scale"].astype(x.dtype), cfg.rms_norm_eps)
    xn, d_attn = conv_prepare(layer["attention_conv"], cfg, xn)
    q, k_blk, v_blk = dflash.block_qkv(layer, cfg, xn, pos_blk)
    attn = attend(q, k_blk, v_blk)
    o = linear(attn.reshape(*attn.shape[:-2], -1), layer["self_attn"]["o_proj"])
    h = x + conv_finish(layer["attention_conv"], cfg, o, d_attn)
    m = layer["mlp"]
    hn = rms_norm(h, layer["post_attention_layernorm"]["scale"].astype(h.dtype), cfg.rms_norm_eps)
    hn, d_mlp = conv_prepare(layer["mlp_conv"], cfg, hn)
    y = linear(jax.nn.silu(linear(hn, m["gate_proj"])) * linear(hn, m["up_proj"]), m["down_proj"])
    return h + conv_finish(layer["mlp_conv"], cfg, y, d_mlp)


def final_states(params: dict, cfg: DFlash2Config, h):
    """(norm(h), lm_head(norm(h)) fp32): the selector's slot states and the unary logits."""
    hn = rms_norm(h, params["norm"]["scale"].astype(h.dtype), cfg.rms_norm_eps)
    return hn, jnp.einsum("...d,dv->...v", hn, params["lm_head"]["kernel"].astype(hn.dtype),
                          preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# training forward
# ---------------------------------------------------------------------------------------------
def draft_forward(params: dict, cfg: DFlash2Config, *, aux_hidden: Sequence[jnp.ndarray], input_ids, positions,
                  segment_ids, anchors, embed_table, attention: Literal["chunked", "reference"] = "chunked",
                  anchor_chunk: int = 16, compute_dtype=jnp.float32) -> jnp.ndarray:
    """dflash.draft_forward with DFlash 2 layers: [B, N, S, H] before the final norm."""
    params = jax.tree_util.tree_map(lambda p: p.astype(compute_dtype), params)
    seg = segment_ids.astype(jnp.int32)
    anchors = anchors.astype(jnp.int32)
    ctx = dflash.context_states(params, cfg, [jax.lax.stop_gradient(a) for a in aux_hidden], compute_dtype)
    x = jax.lax.stop_gradient(jnp.take(embed_table, dflash.block_token_ids(input_ids, anchors, cfg), axis=0))
    x = x.astype(compute_dtype)
    pos_blk = dflash.block_positions(positions, anchors, cfg)
    if attention not in ("chunked", "reference"):
        raise ValueError(f"attention={attention!r}: use 'chunked' or 'reference'")
    for i in range(cfg.num_layers):
        layer = params["layers"][str(i)]
        k_ctx, v_ctx = dflash.context_kv(layer, cfg, ctx, positions)
        if attention == "reference":
            attend = functools.partial(_dense, k_ctx=k_ctx, v_ctx=v_ctx, anchors=anchors, seg=seg)
        else:
            attend = functools.partial(_chunked, k_ctx=k_ctx, v_ctx=v_ctx, anchors=anchors, seg=seg,
                                       anchor_chunk=anchor_chunk)
        x = layer_forward(layer, cfg, x, pos_blk, attend)
    return x


def _dense(q, k_blk, v_blk, *, k_ctx, v_ctx, anchors, seg):
    return dflash.dflash_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, anchors, seg)


def _chunked(q, k_blk, v_blk, *, k_ctx, v_ctx, anchors, seg, anchor_chunk):
    return dflash.dflash_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, seg, anchor_chunk=anchor_chunk)


# ---------------------------------------------------------------------------------------------
# the selector
# ---------------------------------------------------------------------------------------------
def candidate_scores(params: dict, unary_logits, hidden_n, pred_ids, cand_ids):
    """unary(c) + <P[pred] * (W h_n), Q[c]> for the candidates cand_ids [..., K] of slots with
    unary logits [..., V], final-normed states [..., H] and predecessor tokens [...]."""
    sel = params["candidate_selector"]
    context = jnp.take(sel["predecessor_codebook"], pred_ids, axis=0) * linear(hidden_n, sel["hidden_projection"])
    successors = jnp.take(sel["successor_codebook"], cand_ids, axis=0)  # [..., K, rank]
    transition = jnp.einsum("...r,...kr->...k", context.astype(jnp.float32), successors.astype(jnp.float32))
    return jnp.take_along_axis(unary_logits, cand_ids, axis=-1) + transition


def training_candidates(unary_logits, target_ids, top_k: int):
    """(candidates [..., K], label position [...], target among the unary top-k [...]): the unary
    top-k, its last entry replaced by the target when the target is not among them."""
    cand = jax.lax.top_k(jax.lax.stop_gradient(unary_logits), top_k)[1].astype(jnp.int32)
    hit = cand == target_ids[..., None]
    contains = jnp.any(hit, axis=-1)
    label = jnp.where(contains, jnp.argmax(hit, axis=-1), top_k - 1).astype(jnp.int32)
    last = jnp.where(contains, cand[..., -1], target_ids.astype(jnp.int32))
    return cand.at[..., -1].set(last), label, contains


def predecessor_ids(block_tokens, cfg: DFlash2Config):
    """[..., S] teacher-forced predecessors of the slots from the blocks' real tokens x[a..a+S-1]:
    the token before each slot's prediction (slot 0 reads the anchor itself)."""
    if cfg.sample_from_anchor:
        return block_tokens
    return jnp.concatenate([block_tokens[..., :1], block_tokens[..., :-1]], axis=-1)


# ---------------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DFlash2LossConfig:
    num_anchors: int = 512  # blocks per batch row (speculators max_anchors)
    loss_decay_gamma: Optional[float] = 4.0  # None or 0: no decay
    selector_loss_alpha: float = 1.0  # weight of the selector's cross-entropy
    anchor_chunk: int = 16
    attention: Literal["chunked", "reference"] = "chunked"
    objective = "teacher_kl"  # the anchor rule (dflash.anchor_candidates); not a field: fixed

    def validate(self, cfg: DFlash2Config) -> None:
        if self.num_anchors < 1:
            raise ValueError(f"DFlash2LossConfig.num_anchors={self.num_anchors}: must be >= 1. Fix: set num_anchors >= 1.")
        if self.selector_loss_alpha < 0:
            raise ValueError(f"DFlash2LossConfig.selector_loss_alpha={self.selector_loss_alpha}: must be >= 0. "
                             "Fix: use a non-negative weight (0 trains the unary head only).")


def teacher_logits(final_hidden, lm_head, src, logit_softcap):
    """The target's logits at rows src [B, N, S] (dense final hidden x lm_head, or a TopKTeacher)."""
    sg = jax.lax.stop_gradient
    B = src.shape[0]
    idx = src.reshape(B, -1)
    if isinstance(final_hidden, TopKTeacher):
        picked = TopKTeacher(*(jnp.take_along_axis(sg(a), idx[:, :, None] if a.ndim == 3 else idx, axis=1)
                               for a in final_hidden))
        return dense_logits(picked, lm_head.shape[0]).reshape(*src.shape, -1)
    h_src = jnp.take_along_axis(sg(final_hidden), idx[:, :, None], axis=1)
    return soft_cap(jnp.einsum("bqd,vd->bqv", h_src, sg(lm_head).astype(h_src.dtype),
                               preferred_element_type=jnp.float32), logit_softcap).reshape(*src.shape, -1)


def dflash2_loss(params: dict, cfg: DFlash2Config, loss_cfg: DFlash2LossConfig, *, anchors, anchor_valid, input_ids,
                 loss_mask, segment_ids, positions, aux_hidden: Sequence[jnp.ndarray], embed_table, final_hidden,
                 lm_head, compute_dtype=jnp.float32, logit_softcap=None, return_scores: bool = False):
    """(loss, metrics) of one packed batch for the blocks at `anchors` [B, N] (see the module doc);
    final_hidden [B, T, H] (or a TopKTeacher) and lm_head [V, H] are the target's. With
    `return_scores`, metrics also carry the unary logits [B, N, S, V] and candidate scores [B, N, S, K]."""
    loss_cfg.validate(cfg)
    B, T = input_ids.shape
    S, K = cfg.block_size, cfg.selector_top_k
    anchors = anchors.astype(jnp.int32)
    h = draft_forward(params, cfg, aux_hidden=aux_hidden, input_ids=input_ids, positions=positions,
                      segment_ids=segment_ids, anchors=anchors, embed_table=embed_table, attention=loss_cfg.attention,
                      anchor_chunk=loss_cfg.anchor_chunk, compute_dtype=compute_dtype)
    hn, logits = final_states(jax.tree_util.tree_map(lambda p: p.astype(compute_dtype), params), cfg, h)
    rows = anchors[:, :, None] + jnp.arange(S)  # [B, N, S] row a+i
    in_row = rows < T
    rows = jnp.minimum(rows, T - 1)
    gather = lambda x: jnp.take_along_axis(x, rows.reshape(B, -1), axis=1).reshape(rows.shape)  # noqa: E731
    trained = (jnp.arange(S) >= cfg.first_trained_slot)[None, None, :]
    slot_mask = gather(loss_mask.astype(jnp.float32)) * anchor_valid[:, :, None] * trained * in_row
    decay = dflash.slot_decay(cfg, loss_cfg.loss_decay_gamma)
    count = jnp.sum(slot_mask, axis=(1, 2)) + KL_DENOM_EPS

    src = jnp.clip(anchors[:, :, None] + jnp.arange(S) - 1 + int(cfg.sample_from_anchor), 0, T - 1)
    teacher = teacher_logits(final_hidden, lm_head, src, logit_softcap)
    log_p, log_q = jax.nn.log_softmax(teacher, axis=-1), jax.nn.log_softmax(logits, axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    unary = jnp.mean(jnp.sum(kl * slot_mask * decay, axis=(1, 2)) / count)

    target_ids = jnp.argmax(teacher, axis=-1).astype(jnp.int32)
    cand, label, contains = training_candidates(logits, target_ids, K)
    scores = candidate_scores(params, logits, hn, predecessor_ids(gather(input_ids).astype(jnp.int32), cfg), cand)
    ce = jax.nn.logsumexp(scores, axis=-1) - jnp.take_along_axis(scores, label[..., None], axis=-1)[..., 0]
    selector = jnp.mean(jnp.sum(ce * slot_mask * decay, axis=(1, 2)) / count)
    loss = unary + loss_cfg.selector_loss_alpha * selector

    sg = jax.lax.stop_gradient
    chosen = jnp.take_along_axis(cand, jnp.argmax(scores, axis=-1)[..., None], axis=-1)[..., 0]
    metrics = dflash.block_metrics(jnp.argmax(logits, axis=-1), target_ids, slot_mask, cfg)
    path = dflash.block_metrics(jnp.where(contains, chosen, -1), target_ids, slot_mask, cfg)
    valid = jnp.sum(slot_mask)
    metrics.update(sg({
        "loss": loss, "unary_loss": unary, "selector_loss": selector,
        "accept_len": path["accept_len"], "accept_len_sum": path["accept_len_sum"],
        "selector_acc": path["acc"], "selector_correct_pos": path["correct_pos"],
        "recall": jnp.sum(contains * slot_mask) / jnp.maximum(valid, 1.0),
    }))
    if return_scores:
        metrics.update(logits=logits, scores=scores, candidates=cand)
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------
def block_forward(params: dict, cfg: DFlash2Config, cache: dict, *, embed_table, last_token_b, last_position_b):
    """The block [x_p, mask, ...] after the newest token at p against the context cache (dflash's
    propose_block with DFlash 2 layers): (final-normed states [B, S, H], unary logits [B, S, V])."""
    B = last_token_b.shape[0]
    S = cfg.block_size
    ids = jnp.concatenate([last_token_b[:, None].astype(jnp.int32),
                           jnp.full((B, S - 1), cfg.mask_token_id, jnp.int32)], axis=1)
    pos = (last_position_b[:, None] + jnp.arange(S)).astype(jnp.int32)[:, None, :]  # [B, 1, S]
    dtype = cache["k"].dtype
    x = jnp.take(embed_table, ids, axis=0).astype(dtype)[:, None]  # [B, 1, S, H]
    visible = (jnp.arange(cache["k"].shape[2])[None, :] < cache["length"][:, None])[:, None, :]
    for i in range(cfg.num_layers):
        layer = params["layers"][str(i)]
        attend = functools.partial(_cached, k_ctx=cache["k"][i], v_ctx=cache["v"][i], visible=visible)
        x = layer_forward(layer, cfg, x, pos, attend)
    hn, logits = final_states(params, cfg, x[:, 0])
    return hn, logits


def _cached(q, k_blk, v_blk, *, k_ctx, v_ctx, visible):
    return dflash.attend_blocks(q, k_ctx, v_ctx, k_blk, v_blk, visible)


def walk_candidates(params: dict, cfg: DFlash2Config, hidden_n, unary_logits, first_pred, *, key=None,
                    temperature=None):
    """The selector's walk over drafted slots [B, K, ...] in order: each slot's unary top-k scored
    with the previous slot's chosen token as predecessor (`first_pred` [B] for the first). Greedy
    without `key`; else sampled from softmax(score / temperature). Returns (tokens [B, K], the
    distribution q [B, K, V] each token was drawn from: one-hot when greedy)."""
    B, n, V = unary_logits.shape
    pred = first_pred.astype(jnp.int32)
    tokens, qs = [], []
    for j in range(n):
        cand = jax.lax.top_k(unary_logits[:, j], cfg.selector_top_k)[1].astype(jnp.int32)  # [B, k]
        scores = candidate_scores(params, unary_logits[:, j], hidden_n[:, j], pred, cand)
        if key is None:
            pick = jnp.argmax(scores, axis=-1)
            probs = jax.nn.one_hot(pick, cfg.selector_top_k, dtype=jnp.float32)
        else:
            scaled = scores / temperature
            pick = jax.random.categorical(jax.random.fold_in(key, j), scaled, axis=-1)
            probs = jax.nn.softmax(scaled, axis=-1)
        pred = jnp.take_along_axis(cand, pick[:, None], axis=-1)[:, 0]
        tokens.append(pred)
        qs.append(jnp.zeros((B, V), jnp.float32).at[jnp.arange(B)[:, None], cand].set(probs))
    return jnp.stack(tokens, axis=1), jnp.stack(qs, axis=1)


def propose_block(params: dict, cfg: DFlash2Config, cache: dict, *, embed_table, last_token_b, last_position_b,
                  key=None, temperature=None):
    """One block's drafted tokens [B, K] (K = cfg.num_draft_tokens) and their q [B, K, V]."""
    hn, logits = block_forward(params, cfg, cache, embed_table=embed_table, last_token_b=last_token_b,
                               last_position_b=last_position_b)
    first = cfg.first_trained_slot
    return walk_candidates(params, cfg, hn[:, first:], logits[:, first:], last_token_b, key=key,
                           temperature=temperature)


@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("ccache",))
def draft_block(dp, embed, ccache, pend_aux, pend_count, start, last_tok, key, temperature, *, dcfg, k, sample):
    """specjax.eval's step (dflash_decoding.draft_block's contract): append the pending context rows,
    then draft one block of k slots (+ the anchor), as vLLM builds it for num_speculative_tokens = k."""
    dp = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), dp)
    tp = pend_aux[0].shape[1]
    pos = start + jnp.arange(tp, dtype=jnp.int32)[None, :]
    ccache = dflash.append_context(dp, dcfg, ccache, pend_aux, pos, jnp.reshape(pend_count, (1,)))
    dcfg = dataclasses.replace(dcfg, block_size=k + dcfg.first_trained_slot)
    tokens, q = propose_block(dp, dcfg, ccache, embed_table=embed, last_token_b=jnp.reshape(last_tok, (1,)),
                              last_position_b=jnp.reshape(start + pend_count, (1,)),
                              key=key if sample else None, temperature=temperature if sample else None)
    return tokens[0, :k], (q[0, :k] if sample else jnp.zeros((k, 1), jnp.float32)), ccache

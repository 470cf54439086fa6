"""The DSpark drafter: DFlash's parallel block backbone, a serial Markov logit-bias head and a
per-position confidence head (speculators 0.9 `DSparkDraftModel`, served by vLLM 0.32 as
`Qwen3DSparkModel` with its DSpark speculator).

Network. The backbone is specjax.drafts.dflash unchanged (context rows from the target's taps,
a block [anchor, mask, ..., mask] through Qwen3 decoder layers with bidirectional attention inside the
block): `hn = norm(h)` per slot and base logits `lm_head(hn)` over the draft vocab. DSpark adds:
  Markov head    e_i = markov_w1[prev_i] (a rank-r code of the previous token, target vocab) and
                 logits_i = lm_head(hn_i) + markov_w2(u_i) (a draft-vocab bias, no bias term), where u_i
                 depends on markov_head_type (speculators' MarkovHead.block_bias):
                   vanilla  u_i = e_i
                   gated    u_i = sigmoid(gate_proj([hn_i, e_i])) * e_i
                   rnn      a state s (zero before slot 0) carried across the block's slots in order:
                            [g; c; o] = joint_proj([s_{i-1}, e_i, hn_i]), g = sigmoid(g),
                            s_i = g * s_{i-1} + (1 - g) * tanh(c), u_i = tanh(o)
  confidence     c_i = proj([hn_i, e_i]) (or proj(hn_i) without confidence_head_with_markov): one logit
                 per slot, the head's estimate of the slot's acceptance probability (vLLM reads it for
                 its adaptive verification only; decoding does not use it).
`prev_i` is the token before the one slot i predicts. With sample_from_anchor (DSpark's default) slot i
predicts x[a+i+1] from the teacher at a+i, so prev_i = x[a+i] (slot 0's is the anchor itself); without
it slot i predicts x[a+i] and prev_i = x[a+i-1] (slot 0, untrained, reads the anchor).

Training (`dspark_loss`, speculators' DSpark forward with loss kl_div and the fixed-exp-decay weights):
  kl     the DFlash teacher_kl term on the Markov-corrected logits: per slot KL(teacher || draft) over
         the draft vocab, weight loss_mask[a+i] * decay_i, per row divided by (mask count + 1e-5),
         mean over rows (dflash.block_teacher_logits, block_slot_mask, slot_decay)
  conf   BCE-with-logits of c_i against c*_i = sum_v min(p_v, q_v) = 1 - TV(p, q) (the teacher / draft
         overlap, no gradient), same weights, per row divided by (mask count + 1e-8), mean over rows
  loss   kl + confidence_alpha * conf. The confidence gradient reaches the backbone and markov_w1 (the
         reference does not detach its features); lm_head stays the target's copy (the family freezes it).
Teacher forcing feeds the real previous tokens to the Markov head; decoding feeds the drafted ones.

Decoding (`draft_block`). One backbone pass over the block gives every slot's base logits (the block is
the anchor + k-1 mask slots with sample_from_anchor, else the anchor + k mask slots, as vLLM builds it);
then, left to right, d_i = argmax(base_i + markov_w2(u_i)) with prev = the newest token for the first
slot and d_{i-1} (a target id) after it: vLLM's DSparkSpeculator._sample_sequential for the vanilla head,
the same chain with the gated / rnn u_i (the rnn state carried along; without sample_from_anchor the
undrafted anchor slot updates it first, as in training, its prev the anchor). Sampling draws each d_i from
softmax((base_i + bias_i) / T), the draft's conditional distribution given the earlier drafts, so
rejection sampling against q_i stays exact.

Not implemented: the compound losses other than kl_div, D-PACE weights, dspark_draft_topk. vLLM 0.32
serves only the vanilla Markov head (Qwen3DSparkModel has no gate_proj / joint_proj).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import jax
import jax.numpy as jnp

from specjax.drafts import dflash, weights
from specjax.drafts.dflash import DFlashConfig, DFlashLossConfig
from specjax.drafts.dspark_weights import DSPARK_HEADS, DSPARK_WEIGHTS, MARKOV_HEAD_TYPES
from specjax.drafts.eagle3 import init_params
from specjax.layers.norms import rms_norm

__all__ = ["DSPARK_WEIGHTS", "DSparkConfig", "DSparkLossConfig", "DSPARK_FIELDS", "as_dspark", "config_from_dict",
           "config_to_dict", "draft_block", "dspark_heads", "dspark_logits", "dspark_loss", "init_draft_params",
           "markov_inputs", "markov_prev_tokens", "markov_step", "param_logical_axes"]

_CONF_DENOM_EPS = 1e-8  # speculators' DSpark confidence term adds this to the per-row mask count
_KL_DENOM_EPS = 1e-5  # and its loss_function this (dflash_loss's)


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """A DFlashConfig (the backbone) plus the Markov and confidence heads; slot 0 drafts by default."""
    sample_from_anchor: bool = True  # DSpark's default: block_size draft tokens per block
    markov_rank: int = 256  # r, the rank of the Markov bias markov_w2 @ markov_w1
    markov_head_type: str = "vanilla"  # speculators' markov_head_type: "vanilla", "gated" or "rnn"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # the confidence head also reads the Markov code

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.markov_rank, int) or self.markov_rank < 1:
            raise ValueError(f"DSparkConfig.markov_rank={self.markov_rank!r}: must be a positive integer (vLLM's "
                             "Qwen3DSparkModel always builds the Markov head). Fix: set markov_rank >= 1.")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"DSparkConfig.markov_head_type={self.markov_head_type!r}: not one of "
                             f"{', '.join(MARKOV_HEAD_TYPES)} (speculators 0.9's Markov heads). Fix: pick one of them.")
        if self.confidence_head_with_markov and not self.enable_confidence_head:
            raise ValueError("DSparkConfig.confidence_head_with_markov=True without enable_confidence_head: there is "
                             "no confidence head to feed. Fix: set confidence_head_with_markov=False or "
                             "enable_confidence_head=True.")


    @property
    def markov_gated(self) -> bool:  # the weight table's `when` for gate_proj
        return self.markov_head_type == "gated"

    @property
    def markov_rnn(self) -> bool:  # the weight table's `when` for joint_proj
        return self.markov_head_type == "rnn"


DSPARK_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def as_dspark(base: DFlashConfig, **heads) -> DSparkConfig:
    """The DSparkConfig with `base`'s backbone fields and the head fields `heads` (DSPARK_FIELDS)."""
    cfg = DSparkConfig(**{f.name: getattr(base, f.name) for f in dataclasses.fields(DFlashConfig)}, **heads)
    cfg.validate()
    return cfg


def config_to_dict(cfg: DSparkConfig) -> dict:
    return dflash.config_to_dict(cfg)


def config_from_dict(d: dict) -> DSparkConfig:
    d = dict(d)
    heads = {k: d.pop(k) for k in DSPARK_FIELDS if k in d}
    return as_dspark(dflash.config_from_dict(d), **heads)


# ---------------------------------------------------------------------------------------------
# params
# ---------------------------------------------------------------------------------------------
def init_draft_params(cfg: DSparkConfig, key: jax.Array, *, lm_head_rows=None, std: float = 0.02,
                      dtype=jnp.float32) -> dict:
    """DFlash's backbone init (its lm_head from `lm_head_rows` when given), then the DSPARK_HEADS rows
    from a key folded off `key` (so the backbone equals a DFlash draft's of the same key)."""
    params = dflash.init_draft_params(cfg, key, lm_head_rows=lm_head_rows, std=std, dtype=dtype)
    return {**params, **init_params(DSPARK_HEADS, cfg, jax.random.fold_in(key, 0x5D), std=std, dtype=dtype)}


def param_logical_axes(cfg: DSparkConfig) -> dict:
    return weights.logical_axes(DSPARK_WEIGHTS, cfg)


# ---------------------------------------------------------------------------------------------
# the heads
# ---------------------------------------------------------------------------------------------
def markov_prev_tokens(cfg: DSparkConfig, block_tokens):
    """[..., S] the Markov head's previous token per slot from the real tokens x[a+i] of the block's
    rows: x[a+i] itself with sample_from_anchor, else x[a+i-1] (slot 0 reads x[a])."""
    if cfg.sample_from_anchor:
        return block_tokens
    return jnp.concatenate([block_tokens[..., :1], block_tokens[..., :-1]], axis=-1)


def _linear(p: dict, x):
    return x @ p["kernel"].astype(x.dtype) + p["bias"].astype(x.dtype)


def markov_step(m: dict, cfg: DSparkConfig, state, code, hn):
    """One slot of the Markov head (`m`: params["markov_head"]): (the next rnn state, u, the rank-r
    input of markov_w2) from the state before the slot [..., r] (passed through unless rnn), the
    previous token's code e = markov_w1[prev] [..., r] and the slot's normed state hn [..., H]."""
    if cfg.markov_head_type == "vanilla":
        return state, code
    if cfg.markov_head_type == "gated":
        return state, jax.nn.sigmoid(_linear(m["gate_proj"], jnp.concatenate([hn, code], axis=-1))) * code
    gate, cand, out = jnp.split(_linear(m["joint_proj"], jnp.concatenate([state, code, hn], axis=-1)), 3, axis=-1)
    gate = jax.nn.sigmoid(gate)
    return gate * state + (1.0 - gate) * jnp.tanh(cand), jnp.tanh(out)


def markov_inputs(m: dict, cfg: DSparkConfig, code, hn):
    """u [..., S, r] of a block's slots (axis -2, in order) from their codes [..., S, r] and normed
    states [..., S, H]; the rnn head scans the slots from a zero state."""
    if not cfg.markov_rnn:
        return markov_step(m, cfg, None, code, hn)[1]
    state = jnp.zeros(code.shape[:-2] + code.shape[-1:], code.dtype)
    _, u = jax.lax.scan(lambda s, x: markov_step(m, cfg, s, *x), state,
                        (jnp.moveaxis(code, -2, 0), jnp.moveaxis(hn, -2, 0)))
    return jnp.moveaxis(u, 0, -2)


def dspark_heads(params: dict, cfg: DSparkConfig, hn, prev_ids):
    """(Markov bias [..., S, Vd] fp32, confidence logit [..., S] or None) of a block's normed slot
    states `hn` [..., S, H] whose previous tokens are `prev_ids` [..., S] (target ids)."""
    m = params["markov_head"]
    code = jnp.take(m["markov_w1"]["embedding"], prev_ids, axis=0).astype(hn.dtype)  # [..., S, r]
    bias = jnp.einsum("...r,rv->...v", markov_inputs(m, cfg, code, hn), m["markov_w2"]["kernel"].astype(hn.dtype),
                      preferred_element_type=jnp.float32)
    if not cfg.enable_confidence_head:
        return bias, None
    c = params["confidence_head"]["proj"]
    feat = jnp.concatenate([hn, code], axis=-1) if cfg.confidence_head_with_markov else hn
    conf = jnp.einsum("...i,io->...o", feat, c["kernel"].astype(feat.dtype),
                      preferred_element_type=jnp.float32)[..., 0] + c["bias"][0].astype(jnp.float32)
    return bias, conf


def dspark_logits(params: dict, cfg: DSparkConfig, h, prev_ids):
    """(Markov-corrected logits [..., S, Vd] fp32, confidence logits or None) of the backbone's
    pre-norm slot states `h` [..., S, H] of a block."""
    hn = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps)
    bias, conf = dspark_heads(params, cfg, hn, prev_ids)
    return dflash.draft_logits(params, cfg, h) + bias, conf


# ---------------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DSparkLossConfig(DFlashLossConfig):
    """DFlash's teacher_kl settings (anchors, decay, attention) plus the confidence term's weight."""
    confidence_alpha: float = 1.0  # speculators' confidence_head_alpha

    def validate(self, cfg) -> None:
        super().validate(cfg)
        if self.objective != "teacher_kl":
            raise ValueError(f"DSparkLossConfig.objective={self.objective!r}: DSpark distils the target (speculators' "
                             "kl_div). Fix: use objective='teacher_kl'.")


def _bce_with_logits(x, z):
    return jnp.maximum(x, 0.0) - x * z + jnp.log1p(jnp.exp(-jnp.abs(x)))


def dspark_loss(params: dict, cfg: DSparkConfig, loss_cfg: DSparkLossConfig, *, anchors, anchor_valid, input_ids,
                loss_mask, segment_ids, positions, aux_hidden: Sequence[jnp.ndarray], embed_table, final_hidden,
                lm_head, draft_ids=None, compute_dtype=jnp.float32, logit_softcap=None,
                attention: Optional[Literal["chunked", "reference"]] = None):
    """(loss, metrics) of one packed batch for the blocks at `anchors` [B, N] (see the module doc;
    the arguments are dflash.dflash_loss's)."""
    loss_cfg.validate(cfg)
    anchors = anchors.astype(jnp.int32)
    h = dflash.draft_forward(params, cfg, aux_hidden=aux_hidden, input_ids=input_ids, positions=positions,
                             segment_ids=segment_ids, anchors=anchors, embed_table=embed_table,
                             attention=attention or loss_cfg.attention, anchor_chunk=loss_cfg.anchor_chunk,
                             compute_dtype=compute_dtype)
    slot_mask, gather = dflash.block_slot_mask(cfg, anchors, anchor_valid, loss_mask)
    prev = markov_prev_tokens(cfg, gather(input_ids.astype(jnp.int32)))
    params_c = jax.tree_util.tree_map(lambda p: p.astype(compute_dtype), params)
    logits, conf = dspark_logits(params_c, cfg, h, prev)  # [B, N, S, Vd]
    teacher = dflash.block_teacher_logits(cfg, anchors, final_hidden, lm_head, draft_ids, logit_softcap)
    decay = dflash.slot_decay(cfg, loss_cfg.loss_decay_gamma)
    log_q, log_p = jax.nn.log_softmax(logits, axis=-1), jax.nn.log_softmax(teacher, axis=-1)
    w = slot_mask * decay
    count = jnp.sum(slot_mask, axis=(1, 2))
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # KL(teacher || draft) per slot
    kl_loss = jnp.mean(jnp.sum(kl * w, axis=(1, 2)) / (count + _KL_DENOM_EPS))
    sg = jax.lax.stop_gradient
    accept = sg(jnp.sum(jnp.minimum(jnp.exp(log_p), jnp.exp(log_q)), axis=-1))  # 1 - TV: acceptance rate
    loss = kl_loss
    metrics = dict(dflash.block_metrics(jnp.argmax(logits, axis=-1), jnp.argmax(teacher, axis=-1), slot_mask, cfg))
    total = jnp.maximum(jnp.sum(slot_mask), 1.0)
    if conf is not None:
        conf_loss = jnp.mean(jnp.sum(_bce_with_logits(conf, accept) * w, axis=(1, 2)) / (count + _CONF_DENOM_EPS))
        loss = kl_loss + loss_cfg.confidence_alpha * conf_loss
        metrics["confidence_loss"] = sg(conf_loss)
        metrics["confidence_abs_error"] = sg(jnp.sum(jnp.abs(jax.nn.sigmoid(conf) - accept) * slot_mask) / total)
    metrics["kl_loss"] = sg(kl_loss)
    metrics["accept_rate"] = jnp.sum(accept * slot_mask) / total
    metrics["loss"] = loss
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("ccache",))
def draft_block(dp, embed, d2t, ccache, pend_aux, pend_count, start, last_tok, key, temperature, *, dcfg, k,
                sample):
    """DSpark drafting: append the pending context rows (the target's taps at positions
    start..start+pend_count-1) to the DFlash context cache, run the backbone over one block after the
    newest token `last_tok` (at position start+pend_count), then draft its k slots left to right
    through the Markov head. Returns (drafts [k] target ids, q [k, Vd] (zeros [k, 1] when greedy), cache)."""
    dp = jax.tree.map(lambda a: a.astype(jnp.float32), dp)
    pos = start + jnp.arange(pend_aux[0].shape[1], dtype=jnp.int32)[None, :]
    ccache = dflash.append_context(dp, dcfg, ccache, pend_aux, pos, jnp.reshape(pend_count, (1,)))
    # the block vLLM builds for num_speculative_tokens = k (slots attend to each other: no longer block)
    f = dcfg.first_trained_slot
    bcfg = dataclasses.replace(dcfg, block_size=k + f)
    h = dflash.block_hidden(dp, bcfg, ccache, embed_table=embed, last_token_b=jnp.reshape(last_tok, (1,)),
                            last_position_b=jnp.reshape(start + pend_count, (1,)))[0]  # [k + f, H]
    base = dflash.draft_logits(dp, bcfg, h)
    hn = rms_norm(h, dp["norm"]["scale"], dcfg.rms_norm_eps)
    m = dp["markov_head"]
    prev0 = jnp.asarray(last_tok, jnp.int32).reshape(())
    state = jnp.zeros((dcfg.markov_rank,), jnp.float32)
    if f:  # the undrafted anchor slot (prev: the anchor) runs first: the rnn state it leaves feeds slot 1
        state, _ = markov_step(m, dcfg, state, m["markov_w1"]["embedding"][prev0], hn[0])

    def step(carry, inputs):
        prev, state = carry
        base_i, hn_i, key_i = inputs
        state, u = markov_step(m, dcfg, state, m["markov_w1"]["embedding"][prev], hn_i)
        logits = base_i + jnp.einsum("r,rv->v", u, m["markov_w2"]["kernel"])
        if sample:
            scaled = logits / temperature
            d = jax.random.categorical(key_i, scaled)
            q = jax.nn.softmax(scaled)
        else:
            d, q = jnp.argmax(logits), jnp.zeros((1,), jnp.float32)
        tok = (d + d2t[d]).astype(jnp.int32)
        return (tok, state), (tok, q)

    _, (drafts, q) = jax.lax.scan(step, (prev0, state), (base[f:], hn[f:], jax.random.split(key, k)))
    return drafts, q, ccache

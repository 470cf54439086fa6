"""XPress: the DFlash block drafter plus a causal refiner head resolved by K Jacobi passes, as
speculators 0.9 defines it (speculators/models/xpress: model_definitions.py XPressRefinerHead,
core.py XPressDraftModel, metrics.py). The backbone is DFlash's (specjax.drafts.dflash, unchanged:
its forward gives the block states h and the base logits lm_head(norm(h))); this module adds the
refiner, its loss and its decoding.

Refiner (r = xpress_rank). For a block's final-normed states h_n [S, H] and the previous token of
each slot prev [S] (target ids):
    c = [down_h(h_n) ; down_g(mean over the block of h_n)]                      [S, 2r]
    x = in_proj([c ; token_embed(prev)])                                        [S, r]
    x = x + (tril(mix_l) applied per channel over slots: x[k] += sum_{j<=k} L[:, k, j] * x[j])
    x = x + mlp_down(silu(mlp_gate(x)) * mlp_up(x))
    bias = readout(x)                                                           [S, Vd]
and the refined logits are base + bias. prev (fill-in layout, sample_from_anchor false): slot k reads
the token of slot k-1; slot 0 reads what `xpress_slot0_prev` says (`slot0_prev`), the same in training
and decoding:
  "before_anchor" (default) the token before the anchor (the anchor itself at a document start), as
                  speculators 0.9's XPressDraftModel does (the speculators-layout export);
  "anchor"        the anchor itself, as vLLM 0.34's XPress drafter does (its XPressSpeculator hands the
                  anchor id in as the anchor's predecessor, v1/worker/gpu/spec_decode/xpress/
                  speculator.py:87-90); such a head is exported in 0.34's own layout
                  (specjax_converters.xpress_export), and 0.34 needs sample_from_anchor false and the
                  full draft vocab for it.

Training (speculators' XPressDraftModel.forward, eager losses):
  loss = L(base + bias(prev = real tokens))                              teacher-forced pass
       + consistency_weight * mean_j L(base + bias(prev_j))              Jacobi rounds j = 1..passes
       + base_anchor_weight * L(base)                                    the backbone's own logits
  prev_j is the previous round's argmax (round 1: the base argmax), slot 0 of it reset to the anchor,
  shifted by one slot (stop-gradient between rounds). L = ce_weight * CE(argmax teacher) +
  tv_weight * (1 - sum min(p_teacher, q)), each per slot x slot mask x DFlash's decay, per row /
  (mask count + 1e-5), mean over rows (speculators' loss_function). The teacher and the slot mask
  are DFlash's (specjax.drafts.dflash2.teacher_logits).
Decoding: the base argmax seeds the block; num_jacobi_passes refiner passes each re-read the
previous pass's tokens as prev; the drafted tokens are the last pass's argmax (sampling: the last
pass's softmax(logits / T), its q). 0 passes is plain DFlash.
Not implemented: ce_from_data, D-PACE weights, base_anchor_full_weight, a weight schedule.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import jax
import jax.numpy as jnp

from specjax.drafts import dflash, weights
from specjax.drafts.dflash2 import teacher_logits
from specjax.drafts.eagle3 import init_params
from specjax.drafts.xpress_weights import REFINER_WEIGHTS, XPRESS_WEIGHTS
from specjax.layers.norms import rms_norm

__all__ = ["SLOT0_PREV", "XPRESS_WEIGHTS", "XPressConfig", "XPressLossConfig", "as_xpress", "block_bias",
           "block_states", "config_from_dict", "config_to_dict", "draft_block", "hidden_cache", "init_draft_params",
           "jacobi", "param_logical_axes", "slot0_prev", "xpress_loss"]

DENOM_EPS = 1e-5  # speculators' loss_function
# slot 0's previous token: speculators' convention (the token before the anchor) or vLLM 0.34's (the anchor)
SLOT0_PREV = ("before_anchor", "anchor")


@dataclass(frozen=True)
class XPressConfig(dflash.DFlashConfig):
    """A DFlash config plus the refiner's shape and the decoding passes."""
    xpress_rank: int = 256
    xpress_mlp_ratio: int = 2
    num_jacobi_passes: int = 6
    xpress_slot0_prev: str = "before_anchor"  # one of SLOT0_PREV (the module doc)

    def validate(self) -> None:
        super().validate()
        for field, least in (("xpress_rank", 1), ("xpress_mlp_ratio", 1), ("num_jacobi_passes", 0)):
            if int(getattr(self, field)) < least:
                raise ValueError(f"XPressConfig.{field}={getattr(self, field)!r}: must be >= {least}. Fix: set "
                                 f"{field} >= {least}.")
        if self.xpress_slot0_prev not in SLOT0_PREV:
            raise ValueError(f"XPressConfig.xpress_slot0_prev={self.xpress_slot0_prev!r}: not one of {SLOT0_PREV}. "
                             "Fix: use before_anchor (speculators' convention) or anchor (vLLM 0.34's).")
        if self.xpress_slot0_prev == "anchor":
            if self.sample_from_anchor:
                raise ValueError("XPressConfig.xpress_slot0_prev='anchor' with sample_from_anchor=True: the anchor "
                                 "convention is vLLM 0.34's, whose XPress drafter refuses sample_from_anchor. Fix: "
                                 "set sample_from_anchor false (or xpress_slot0_prev before_anchor).")
            if self.draft_vocab_size != self.vocab_size:
                raise ValueError(f"XPressConfig.xpress_slot0_prev='anchor' with draft_vocab_size="
                                 f"{self.draft_vocab_size} < vocab_size={self.vocab_size}: the anchor convention is "
                                 "vLLM 0.34's, whose XPress model needs the full draft vocab. Fix: set "
                                 f"draft_vocab_size={self.vocab_size} (or xpress_slot0_prev before_anchor).")


def as_xpress(cfg: dflash.DFlashConfig, **extra) -> XPressConfig:
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(dflash.DFlashConfig)}
    return XPressConfig(**base, **extra)


def config_to_dict(cfg: XPressConfig) -> dict:
    return dflash.config_to_dict(cfg)


def config_from_dict(d: dict) -> XPressConfig:
    d = dict(d)
    own = {k: d.pop(k) for k in ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes", "xpress_slot0_prev")
           if k in d}
    return as_xpress(dflash.config_from_dict(d), **own)


def init_draft_params(cfg: XPressConfig, key: jax.Array, *, lm_head_rows=None, std: float = 0.02,
                      dtype=jnp.float32) -> dict:
    """DFlash's init for `key`, then the refiner normal(0, std) with mix_l at 0 (a no-op residual)."""
    params = dflash.init_draft_params(cfg, key, lm_head_rows=lm_head_rows, std=std, dtype=dtype)
    ref = init_params(REFINER_WEIGHTS, cfg, jax.random.fold_in(key, 1 << 21), std=std, dtype=dtype)["refiner_head"]
    ref["mix_l"] = jnp.zeros_like(ref["mix_l"])
    params["refiner_head"] = ref
    return params


def param_logical_axes(cfg: XPressConfig) -> dict:
    return weights.logical_axes(XPRESS_WEIGHTS, cfg)


# ---------------------------------------------------------------------------------------------
# the refiner
# ---------------------------------------------------------------------------------------------
def linear(x, p):
    return jnp.einsum("...i,io->...o", x, p["kernel"].astype(x.dtype))


def hidden_cache(ref: dict, hn):
    """[down_h(h_n) ; down_g(block mean of h_n)] [..., S, 2r] for final-normed states [..., S, H]."""
    g = jnp.broadcast_to(jnp.mean(hn, axis=-2, keepdims=True), hn.shape)
    return jnp.concatenate([linear(hn, ref["down_h"]), linear(g, ref["down_g"])], axis=-1)


def block_bias(ref: dict, prev_ids, hcache):
    """The refiner's logit bias [..., S, Vd] from the slots' previous tokens [..., S] (target ids)."""
    S = prev_ids.shape[-1]
    lat = jnp.take(ref["token_embed"]["embedding"], prev_ids, axis=0).astype(hcache.dtype)
    x = linear(jnp.concatenate([hcache, lat], axis=-1), ref["in_proj"])
    mix = ref["mix_l"][:, :S, :S].astype(x.dtype) * jnp.tril(jnp.ones((S, S), x.dtype))
    x = x + jnp.einsum("ckj,...jc->...kc", mix, x)
    x = x + linear(jax.nn.silu(linear(x, ref["mlp_gate"])) * linear(x, ref["mlp_up"]), ref["mlp_down"])
    return jnp.einsum("...r,rv->...v", x, ref["readout"]["kernel"].astype(x.dtype), preferred_element_type=jnp.float32)


def shifted_prev(first, tokens):
    """[first, tokens[..., :-1]]: each slot's previous token."""
    return jnp.concatenate([first[..., None], tokens[..., :-1]], axis=-1)


def slot0_prev(cfg: XPressConfig, anchor, before_anchor):
    """Slot 0's previous token in the fill-in layout: the token before the anchor, or with
    xpress_slot0_prev "anchor" (vLLM 0.34's convention) the anchor itself."""
    return anchor if cfg.xpress_slot0_prev == "anchor" else before_anchor


def jacobi(params: dict, cfg: XPressConfig, hn, base, anchor, before_anchor, to_target, passes: int):
    """`passes` refiner passes over blocks (hn [..., S, H], base logits [..., S, Vd]), seeded by the
    base argmax: returns each pass's refined logits (a list) and its argmax in target ids.
    `to_target` maps draft ids to target ids; anchor / before_anchor [...] are target ids (slot 0
    reads `slot0_prev` of them)."""
    ref = params["refiner_head"]
    hc = hidden_cache(ref, hn)
    pred = to_target(jnp.argmax(jax.lax.stop_gradient(base), axis=-1))
    rounds = []
    for _ in range(passes):
        if cfg.sample_from_anchor:
            prev = shifted_prev(anchor, pred)
        else:
            prev = shifted_prev(slot0_prev(cfg, anchor, before_anchor), pred.at[..., 0].set(anchor))
        refined = base + block_bias(ref, prev, hc)
        rounds.append(refined)
        pred = to_target(jnp.argmax(jax.lax.stop_gradient(refined), axis=-1))
    return rounds, pred


# ---------------------------------------------------------------------------------------------
# loss
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class XPressLossConfig:
    num_anchors: int = 512
    loss_decay_gamma: Optional[float] = 4.0
    ce_weight: float = 0.1  # speculators' default compound loss {"ce": 0.1, "tv": 0.9}
    tv_weight: float = 0.9
    consistency_weight: float = 0.3
    consistency_passes: int = 3
    base_anchor_weight: float = 0.6
    anchor_chunk: int = 16
    attention: Literal["chunked", "reference"] = "chunked"
    objective = "teacher_kl"  # DFlash's anchor rule (dflash.anchor_candidates); not a field

    def validate(self, cfg: XPressConfig) -> None:
        for field in ("ce_weight", "tv_weight", "consistency_weight", "consistency_passes", "base_anchor_weight"):
            if getattr(self, field) < 0:
                raise ValueError(f"XPressLossConfig.{field}={getattr(self, field)}: must be >= 0. Fix: use a "
                                 "non-negative value.")
        if self.num_anchors < 1:
            raise ValueError(f"XPressLossConfig.num_anchors={self.num_anchors}: must be >= 1. Fix: set it >= 1.")


def compound_term(logits, teacher, slot_mask, decay, count, loss_cfg: XPressLossConfig):
    """ce_weight * CE(argmax teacher) + tv_weight * TV, reduced as speculators' loss_function."""
    log_q = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(log_q, jnp.argmax(teacher, axis=-1)[..., None], axis=-1)[..., 0]
    tv = 1.0 - jnp.sum(jnp.minimum(jnp.exp(log_q), jax.nn.softmax(teacher, axis=-1)), axis=-1)
    elem = loss_cfg.ce_weight * ce + loss_cfg.tv_weight * tv
    return jnp.mean(jnp.sum(elem * slot_mask * decay, axis=(1, 2)) / count)


def draft_ids_map(draft_ids, vd: int):
    """draft id -> target id (the ascending draft_ids [Vd], or the identity)."""
    if draft_ids is None:
        return lambda d: d.astype(jnp.int32)
    ids = jnp.asarray(draft_ids, jnp.int32)
    return lambda d: jnp.take(ids, d)


def xpress_loss(params: dict, cfg: XPressConfig, loss_cfg: XPressLossConfig, *, anchors, anchor_valid, input_ids,
                loss_mask, segment_ids, positions, aux_hidden: Sequence[jnp.ndarray], embed_table, final_hidden,
                lm_head, draft_ids=None, compute_dtype=jnp.float32, logit_softcap=None, return_logits: bool = False):
    """(loss, metrics) of one packed batch for the blocks at `anchors` [B, N] (see the module doc)."""
    loss_cfg.validate(cfg)
    B, T = input_ids.shape
    S = cfg.block_size
    anchors = anchors.astype(jnp.int32)
    h = dflash.draft_forward(params, cfg, aux_hidden=aux_hidden, input_ids=input_ids, positions=positions,
                             segment_ids=segment_ids, anchors=anchors, embed_table=embed_table,
                             attention=loss_cfg.attention, anchor_chunk=loss_cfg.anchor_chunk,
                             compute_dtype=compute_dtype)
    p = jax.tree_util.tree_map(lambda a: a.astype(compute_dtype), params)
    hn = rms_norm(h, p["norm"]["scale"], cfg.rms_norm_eps)
    base = jnp.einsum("...d,dv->...v", hn, p["lm_head"]["kernel"], preferred_element_type=jnp.float32)

    rows = anchors[:, :, None] + jnp.arange(S)
    in_row = rows < T
    rows = jnp.minimum(rows, T - 1)
    gather = lambda x: jnp.take_along_axis(x, rows.reshape(B, -1), axis=1).reshape(rows.shape)  # noqa: E731
    trained = (jnp.arange(S) >= cfg.first_trained_slot)[None, None, :]
    slot_mask = gather(loss_mask.astype(jnp.float32)) * anchor_valid[:, :, None] * trained * in_row
    decay = dflash.slot_decay(cfg, loss_cfg.loss_decay_gamma)
    count = jnp.sum(slot_mask, axis=(1, 2)) + DENOM_EPS
    table = lm_head if draft_ids is None else jnp.take(lm_head, draft_ids, axis=0)
    src = jnp.clip(anchors[:, :, None] + jnp.arange(S) - 1 + int(cfg.sample_from_anchor), 0, T - 1)
    teacher = teacher_logits(final_hidden, table, src, logit_softcap)

    tokens = gather(input_ids).astype(jnp.int32)  # [B, N, S] the blocks' real tokens
    anchor_tok = tokens[..., 0]
    seg = segment_ids.astype(jnp.int32)
    before = jnp.maximum(anchors - 1, 0)
    same_doc = (anchors > 0) & (jnp.take_along_axis(seg, before, axis=1) == jnp.take_along_axis(seg, anchors, axis=1))
    before_tok = jnp.where(same_doc, jnp.take_along_axis(input_ids, before, axis=1).astype(jnp.int32), anchor_tok)
    ref = p["refiner_head"]
    prev_tf = tokens if cfg.sample_from_anchor else shifted_prev(slot0_prev(cfg, anchor_tok, before_tok), tokens)
    logits_tf = base + block_bias(ref, prev_tf, hidden_cache(ref, hn))
    term = functools.partial(compound_term, teacher=teacher, slot_mask=slot_mask, decay=decay, count=count,
                             loss_cfg=loss_cfg)
    tf_loss = term(logits_tf)
    loss = tf_loss
    passes = loss_cfg.consistency_passes if loss_cfg.consistency_weight > 0 else 0
    rounds, _ = jacobi(p, cfg, hn, base, anchor_tok, before_tok, draft_ids_map(draft_ids, cfg.draft_vocab_size),
                       passes)
    consistency = jnp.mean(jnp.stack([term(r) for r in rounds])) if rounds else jnp.zeros((), jnp.float32)
    loss = loss + loss_cfg.consistency_weight * consistency
    base_loss = term(base)
    if loss_cfg.base_anchor_weight > 0:
        loss = loss + loss_cfg.base_anchor_weight * base_loss

    target_ids = jnp.argmax(teacher, axis=-1)
    last = rounds[-1] if rounds else logits_tf
    metrics = dflash.block_metrics(jnp.argmax(last, axis=-1), target_ids, slot_mask, cfg)
    tf = dflash.block_metrics(jnp.argmax(logits_tf, axis=-1), target_ids, slot_mask, cfg)
    metrics.update(jax.lax.stop_gradient({"loss": loss, "tf_loss": tf_loss, "consistency_loss": consistency,
                                          "base_loss": base_loss, "tf_acc": tf["acc"]}))
    if return_logits:
        metrics.update(base=base, logits_tf=logits_tf, rounds=jnp.stack(rounds) if rounds else None)
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------
def block_states(params: dict, cfg: XPressConfig, cache: dict, *, embed_table, last_token_b, last_position_b):
    """The block [x_p, mask, ...] against the context cache (dflash.propose_block's network), every
    slot: (final-normed states [B, S, H], base logits [B, S, Vd])."""
    B = last_token_b.shape[0]
    S = cfg.block_size
    ids = jnp.concatenate([last_token_b[:, None].astype(jnp.int32),
                           jnp.full((B, S - 1), cfg.mask_token_id, jnp.int32)], axis=1)
    pos = (last_position_b[:, None] + jnp.arange(S)).astype(jnp.int32)[:, None, :]
    dtype = cache["k"].dtype
    x = jnp.take(embed_table, ids, axis=0).astype(dtype)[:, None]
    visible = (jnp.arange(cache["k"].shape[2])[None, :] < cache["length"][:, None])[:, None, :]
    for i in range(cfg.num_layers):
        layer = params["layers"][str(i)]
        xn = rms_norm(x, layer["input_layernorm"]["scale"].astype(dtype), cfg.rms_norm_eps)
        q, k_blk, v_blk = dflash.block_qkv(layer, cfg, xn, pos)
        x = dflash.layer_output(layer, cfg, x, dflash.attend_blocks(q, cache["k"][i], cache["v"][i], k_blk, v_blk,
                                                                      visible))
    hn = rms_norm(x[:, 0], params["norm"]["scale"].astype(dtype), cfg.rms_norm_eps)
    return hn, jnp.einsum("...d,dv->...v", hn, params["lm_head"]["kernel"].astype(hn.dtype),
                          preferred_element_type=jnp.float32)


def init_decode_cache(cfg: XPressConfig, rows: int) -> dict:
    """DFlash's context cache plus the tokens by position (the refiner reads the token before the anchor)."""
    return {"ctx": dflash.init_context_cache(cfg, 1, rows), "tokens": jnp.zeros((rows + 1,), jnp.int32)}


@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("dcache",))
def draft_block(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key, temperature, *, dcfg, k,
                sample):
    """specjax.eval's step: append the pending context rows and their tokens (pend_tok[i] is the token
    at position start + i + 1), then one block of k drafted slots resolved by num_jacobi_passes passes."""
    dp = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), dp)
    tp = pend_aux[0].shape[1]
    pos = start + jnp.arange(tp, dtype=jnp.int32)[None, :]
    ctx = dflash.append_context(dp, dcfg, dcache["ctx"], pend_aux, pos, jnp.reshape(pend_count, (1,)))
    tokens = dcache["tokens"].at[start + 1 + jnp.arange(tp)].set(pend_tok.reshape(-1).astype(jnp.int32), mode="drop")
    p = start + pend_count  # the anchor's (last_tok's) position
    before = jnp.where(p >= 2, tokens[jnp.maximum(p - 1, 0)], last_tok)  # position 0's token is not kept
    dcfg = dataclasses.replace(dcfg, block_size=k + dcfg.first_trained_slot)
    hn, base = block_states(dp, dcfg, ctx, embed_table=embed, last_token_b=jnp.reshape(last_tok, (1,)),
                            last_position_b=jnp.reshape(p, (1,)))
    to_target = lambda d: (d + jnp.take(d2t, d)).astype(jnp.int32)  # noqa: E731
    rounds, pred = jacobi(dp, dcfg, hn, base, jnp.reshape(last_tok, (1,)).astype(jnp.int32),
                          jnp.reshape(before, (1,)).astype(jnp.int32), to_target, dcfg.num_jacobi_passes)
    logits = (rounds[-1] if rounds else base)[0, dcfg.first_trained_slot:]  # [k, Vd]
    cache = {"ctx": ctx, "tokens": tokens}
    if sample:
        scaled = logits / temperature
        d = jax.random.categorical(key, scaled, axis=-1)
        return to_target(d), jax.nn.softmax(scaled, axis=-1), cache
    return pred[0, dcfg.first_trained_slot:], jnp.zeros((k, 1), jnp.float32), cache

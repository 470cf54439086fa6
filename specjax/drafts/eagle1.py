"""The EAGLE-1 draft (draft.type eagle; EAGLE-2 decodes the same head with a draft tree): feature
regression at the target's top layer.

Network (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"; vLLM
0.32 llama_eagle.EagleLlamaForCausalLM serves it):
  f_t       the target's final feature at position t: its last hidden state after the final norm,
            the input of its lm_head (what vLLM's target returns and hands the "eagle" drafter)
  x_t       = fc(concat(embed(x_{t+1}), f_t))            fc: [2H -> H], no bias
  f^_{t+1}  = one Llama decoder layer over x_t without an input norm (vLLM replaces the first layer's
            input_layernorm by the identity): h = x + o_proj(attn(x)); f^ = h + mlp(rms_norm(h))
  logits    = lm_head_target(f^_{t+1}): the target's own lm_head, no norm in between; the draft's
            token for position t+2. While drafting, f^ is also the next step's feature input.
The embedding and lm_head are the target's (frozen, never exported). The decoder layer's pieces are
EAGLE-3's (`eagle3.layer_output`: residual + o_proj, post-attention norm, SwiGLU; the step-0 causal
attention kernel `ttt_attention`); only its input differs (no norms, a 2H -> H fc).

Loss (the paper's section 4.2 and its training code): L = w_reg * L_reg + w_cls * L_cls with
  L_reg = SmoothL1(f^_{t+1}, f_{t+1})  (beta 1, mean over the hidden dim)
  L_cls = CrossEntropy(p_{t+2}, p^_{t+2}) = -sum_v softmax(lm_head f_{t+1})_v log softmax(lm_head f^_{t+1})_v
each averaged over the rows in the loss (loss mask, and t+1 in the same packed sequence), and
w_reg = 1.0, w_cls = 0.1 (the paper: "w_cls is set to 0.1"). The paper also adds U(-0.1, 0.1) noise
to the input features during training (its data augmentation); draft.feature_noise sets the
half-width (0 turns it off).
L_cls runs through the fused soft cross-entropy EAGLE-3 uses (specjax_kernels.soft_ce, kernels.soft_ce;
the teacher given as f_{t+1} and the lm_head, so its logits are made per vocab tile too) and the teacher's
argmax through ttt.chunked_argmax: no [B, T, V] logits exist, in the forward or the backward, at
V = 128k or more. A target's final-logit soft-cap applies to both sides (the xla backend's softcap).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from specjax import mesh as meshlib
from specjax.drafts import eagle3, weights
from specjax.drafts.eagle1_weights import EAGLE1_WEIGHTS
from specjax.drafts.eagle3_decoding import chain_draw, tree_walk
from specjax.drafts.ttt import chunked_argmax
from specjax.layers.rope import RopeSpec, apply_rope, rope_tables
from specjax.targets.layers.attention import cache_attention_mask, dot_product_attention
from specjax_kernels.soft_ce import fused_linear_soft_ce
from specjax_kernels.ttt_attention import ttt_attention

# the paper's loss weights (section 4.2): regression 1.0, classification 0.1; its feature noise U(-0.1, 0.1)
PAPER_REGRESSION_WEIGHT = 1.0
PAPER_TOKEN_WEIGHT = 0.1
PAPER_FEATURE_NOISE = 0.1


@dataclass(frozen=True)
class Eagle1Config:
    hidden_size: int  # H: the target's hidden size (fc reads a target feature and an embedding)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # V, the target's: the draft predicts over it with the target's lm_head
    rms_norm_eps: float = 1e-6
    rope: RopeSpec = RopeSpec()
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"

    # what the shared decoding / export code reads from every draft config
    @property
    def draft_vocab_size(self) -> int:
        """The whole target vocab (vLLM's EAGLE-1 head has no reduced draft vocab)."""
        return self.vocab_size

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """No intermediate taps: the draft reads the target's final feature."""
        return ()

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"EAGLE-1 draft: num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}; set draft.num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"EAGLE-1 draft: hidden_act {self.hidden_act!r}: only 'silu' is supported")


@dataclass(frozen=True)
class Eagle1Objective:
    """The loss weights and the input-feature noise (draft.regression_weight / token_weight / feature_noise)."""
    regression_weight: float = PAPER_REGRESSION_WEIGHT
    token_weight: float = PAPER_TOKEN_WEIGHT
    feature_noise: float = PAPER_FEATURE_NOISE
    noise_seed: int = 0
    attention_impl: Optional[str] = None
    soft_ce_impl: Optional[str] = None  # kernels.soft_ce (the token loss; with a soft-capped target: xla)
    vocab_chunk: int = 8192  # the teacher argmax's vocab chunk (the accuracy metric)


def config_from_target(target_cfg, *, intermediate_size=None, num_attention_heads=None, num_key_value_heads=None,
                       head_dim=None) -> Eagle1Config:
    """The draft's shape from the target's config (width, norms' eps and RoPE always the target's)."""
    H = target_cfg.hidden_size
    nH = num_attention_heads or target_cfg.num_attention_heads
    cfg = Eagle1Config(
        hidden_size=H, intermediate_size=intermediate_size or target_cfg.intermediate_size, num_attention_heads=nH,
        num_key_value_heads=num_key_value_heads or target_cfg.num_key_value_heads,
        head_dim=head_dim or (target_cfg.head_dim if num_attention_heads is None else H // nH),
        vocab_size=target_cfg.vocab_size, rms_norm_eps=target_cfg.rms_norm_eps, rope=target_cfg.rope,
        max_position_embeddings=target_cfg.max_position_embeddings)
    cfg.validate()
    return cfg


def config_to_dict(cfg: Eagle1Config) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> Eagle1Config:
    d = dict(d)
    d["rope"] = RopeSpec(**d["rope"])
    return Eagle1Config(**d)


def init_draft_params(cfg: Eagle1Config, key: jax.Array, *, std: float = 0.02, dtype=jnp.float32) -> dict:
    """Random init from EAGLE1_WEIGHTS (normal(0, std) matrices, ones for the norm), all trained."""
    return eagle3.init_params(EAGLE1_WEIGHTS, cfg, key, std=std, dtype=dtype)


def param_logical_axes(cfg: Eagle1Config) -> dict:
    return weights.logical_axes(EAGLE1_WEIGHTS, cfg)


# ---------------------------------------------------------------------------------------------
# the network
# ---------------------------------------------------------------------------------------------
def linear(x, kernel):
    return jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype))


def fuse(params: dict, emb_btd, feature_btd):
    """x = fc(concat(embed(token), feature)) [B, T, H]."""
    return linear(jnp.concatenate([emb_btd, feature_btd.astype(emb_btd.dtype)], axis=-1), params["fc"]["kernel"])


def attention_qkv(params: dict, cfg: Eagle1Config, x_btd, rope_positions_bt):
    """q [B,T,nH,hd], k/v [B,T,nKV,hd] of the layer's input x (no input norm), RoPE at the target's positions."""
    a = params["midlayer"]["self_attn"]
    B, T, _ = x_btd.shape
    q = linear(x_btd, a["q_proj"]["kernel"]).reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
    k = linear(x_btd, a["k_proj"]["kernel"]).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
    v = linear(x_btd, a["v_proj"]["kernel"]).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, rope_positions_bt, q.dtype)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def draft_forward(params: dict, cfg: Eagle1Config, emb_btd, feature_btd, positions_bt, segment_ids_bt=None, *,
                  attention_impl: Optional[str] = None):
    """The predicted next features f^ [B, T, H] of every row (row t reads embed(x_{t+1}) and f_t),
    causal within each packed sequence."""
    if meshlib.context_mesh() is not None:
        raise ValueError("draft.type=eagle does not split the sequence over parallelism.context; set "
                         "parallelism.context=1")
    x = fuse(params, emb_btd, feature_btd)
    q, k, v = attention_qkv(params, cfg, x, positions_bt)
    attn = ttt_attention(q, k, v, None, None, segment_ids_bt, implementation=attention_impl)
    return eagle3.layer_output(params, cfg, x, attn)


def smooth_l1(diff):
    """SmoothL1 with beta 1 (torch.nn.SmoothL1Loss's default, as the paper's code uses it)."""
    a = jnp.abs(diff)
    return jnp.where(a < 1.0, 0.5 * diff * diff, a - 0.5)


def shift_left(x, n: int = 1, fill=0):
    """x[:, t+n] at row t, `fill` past the end."""
    pad = jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def loss_rows(loss_mask, segment_ids):
    """[B, T] float: row t is in the loss when its loss mask is set and row t+1 belongs to the same
    (packed) sequence, so f_{t+1} and x_{t+1} exist (EAGLE-3's step-0 rows, drafts/ttt.py)."""
    seg = segment_ids.astype(jnp.int32)
    same = (shift_left(seg, 1, fill=-1) == seg) & (seg > 0)
    return loss_mask.astype(jnp.float32) * same.astype(jnp.float32)


def eagle1_loss(params: dict, cfg: Eagle1Config, objective: Eagle1Objective, *, input_ids, loss_mask, segment_ids,
                positions, final_hidden, embed_table, lm_head, noise_key=None, compute_dtype=jnp.float32,
                logit_softcap: Optional[float] = None):
    """(loss, metrics) of one packed batch (see the module doc). `final_hidden` [B, T, H] is the
    target's final feature; `embed_table` / `lm_head` [V, H] the target's (no gradient)."""
    sg = jax.lax.stop_gradient
    if not hasattr(final_hidden, "shape"):
        raise ValueError("draft.type=eagle regresses the target's final hidden state; a state cache with a top-k "
                         "teacher (precompute.teacher_top_k > 0) does not hold it. Fix: build the cache with "
                         "precompute.teacher_top_k=0")
    params = jax.tree_util.tree_map(lambda p: p.astype(compute_dtype), params)
    feat = sg(final_hidden).astype(compute_dtype)
    rows = loss_rows(loss_mask, segment_ids)
    n = jnp.maximum(jnp.sum(rows), 1.0)
    emb = sg(jnp.take(embed_table, shift_left(input_ids.astype(jnp.int32), 1), axis=0)).astype(compute_dtype)
    feat_in = feat
    if noise_key is not None and objective.feature_noise > 0:
        a = objective.feature_noise
        feat_in = feat + jax.random.uniform(noise_key, feat.shape, compute_dtype, -a, a)
    pred = draft_forward(params, cfg, emb, feat_in, positions, segment_ids, attention_impl=objective.attention_impl)
    nxt = shift_left(feat, 1)  # f_{t+1} at row t
    reg = jnp.mean(smooth_l1(pred.astype(jnp.float32) - nxt.astype(jnp.float32)), axis=-1)
    # CE(softmax(W f_{t+1}), softmax(W f^)) per row, masked by `rows`; W the target's lm_head (frozen)
    ce, student_argmax = fused_linear_soft_ce(pred, sg(lm_head), teacher_hidden=sg(nxt), teacher_head=sg(lm_head),
                                              mask=rows, return_argmax=True, implementation=objective.soft_ce_impl,
                                              softcap=logit_softcap)
    B, T, D = nxt.shape
    teacher_argmax = chunked_argmax(sg(nxt).reshape(B * T, D), sg(lm_head), objective.vocab_chunk,
                                    softcap=logit_softcap).reshape(B, T)
    reg_loss = jnp.sum(reg * rows) / n
    tok_loss = jnp.sum(ce) / n
    total = objective.regression_weight * reg_loss + objective.token_weight * tok_loss
    acc = sg(jnp.sum((student_argmax == teacher_argmax) * rows) / n)
    metrics = {"loss": total, "loss_reg": sg(reg_loss), "loss_token": sg(tok_loss), "acc_k": acc[None],
               "tau_sim": acc, "mask_tokens_k": jnp.sum(rows)[None]}
    return total, metrics


# ---------------------------------------------------------------------------------------------
# speculative decoding (specjax.eval): the layer over a KV cache, and the proposers
# ---------------------------------------------------------------------------------------------
def layer_cached(params, cfg: Eagle1Config, cache, x_btd, positions_bt, slots_bt, mask_bts):
    """The decoder layer for rows written at `slots`, attending per `mask` [B,T,S] over the cache.
    Returns (f^ [B,T,H], new cache)."""
    b = x_btd.shape[0]
    rows = jnp.arange(b)[:, None]
    q, k, v = attention_qkv(params, cfg, x_btd, positions_bt)
    kc = cache["k"][0].at[rows, slots_bt].set(k, mode="drop")
    vc = cache["v"][0].at[rows, slots_bt].set(v, mode="drop")
    o = dot_product_attention(q, kc, vc, mask_bts, scale=cfg.head_dim**-0.5)
    return eagle3.layer_output(params, cfg, x_btd, o), {"k": kc[None], "v": vc[None]}


def draft_logits(dp, h_btd):
    """The target's lm_head (dp["target_lm_head"], put there by the family's decoding_params) on f^, fp32."""
    return jnp.einsum("btd,vd->btv", h_btd.astype(jnp.float32), dp["target_lm_head"].astype(jnp.float32))


def uniform_dtype(dp):
    dt = jax.tree.leaves(dp)[0].dtype
    return jax.tree.map(lambda a: a.astype(dt), dp), dt


def draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start, dt):
    """Write the pending rows (tokens x_{t+1}, the target's final feature at t) from slot `start`;
    return the last pending row's f^ [1,1,H] and the cache."""
    (feature,) = pend_aux
    tp = pend_tok.shape[1]
    pos = start + jnp.arange(tp, dtype=jnp.int32)[None, :]
    x = fuse(dp, jnp.take(embed, pend_tok, axis=0).astype(dt), feature.astype(dt))
    causal = jnp.tril(jnp.ones((tp, tp), bool))[None]
    mask = cache_attention_mask(jnp.reshape(start, (1,)), dcache["k"].shape[2], causal)
    h, dcache = layer_cached(dp, dcfg, dcache, x, pos, pos, mask)
    return jax.lax.dynamic_index_in_dim(h, pend_count - 1, axis=1, keepdims=True), dcache


@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("dcache",))
def draft_chain(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, key, temperature, *, dcfg, k, sample):
    """K draft tokens, each step reading the previous step's f^ and token: (target ids [K], draft
    probabilities [K, V] when sampling else [K, 1] zeros, cache)."""
    dp, dt = uniform_dtype(dp)
    num_slots = dcache["k"].shape[2]
    h, dcache = draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start, dt)
    toks, qs = [], []
    for j in range(k):
        logits = draft_logits(dp, h)[:, 0]  # [1, V]
        d, key = chain_draw(logits, key, temperature, sample, qs)
        tok = (d + d2t[d]).astype(jnp.int32)
        toks.append(tok[0])
        if j == k - 1:
            break
        slot = start + pend_count + j
        x = fuse(dp, jnp.take(embed, tok, axis=0).astype(dt)[None], h)
        mask = (jnp.arange(num_slots) <= slot)[None, None, :]
        h, dcache = layer_cached(dp, dcfg, dcache, x, jnp.reshape(slot, (1, 1)), jnp.reshape(slot, (1, 1)), mask)
    q = jnp.stack(qs) if sample else jnp.zeros((k, 1), jnp.float32)
    return jnp.stack(toks), q, dcache


@functools.partial(jax.jit, static_argnames=("dcfg", "widths", "top_k", "total"), donate_argnames=("dcache",))
def draft_tree(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, *, dcfg, widths, top_k, total=None):
    """EAGLE-2's draft tree: the root's top-k children, then per level each node's top-k children,
    keeping the widths[d] nodes of highest cumulative draft log-probability (EAGLE-2's expansion by
    confidence), and with `total` its re-ranking (the `total` best nodes of the whole tree). Returns
    (node target ids, parent node index (-1 = root), cache), nodes level by level."""
    dp, dt = uniform_dtype(dp)
    h_root, dcache = draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start, dt)

    def expand(toks, hid, pos, slots, mask, dcache):  # a node reads its token and its parent's f^
        x = fuse(dp, jnp.take(embed, toks, axis=0).astype(dt)[None], hid[None])
        h, dcache = layer_cached(dp, dcfg, dcache, x, pos, slots, mask)
        return draft_logits(dp, h)[0], h, dcache

    return tree_walk(draft_logits(dp, h_root)[0, 0], h_root, d2t, dcache, start + pend_count, dcache["k"].shape[2],
                     widths=widths, top_k=top_k, expand=expand, total=total)

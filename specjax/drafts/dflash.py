"""The DFlash block drafter: one forward pass drafts a whole block of tokens.

Network. Context rows come from the target: `c = hidden_norm(fc(concat(aux_k for k in
aux_layer_ids)))`, one row per target position. A block of S = block_size slots is embedded with
the target's (frozen) token table: slot 0 holds a real token (the anchor), slots 1..S-1 the
`mask_token_id` token. Then N Qwen3 decoder layers run over the block only: per layer
`x_n = input_layernorm(x)`, queries `q_norm(q_proj(x_n))`, keys `k_norm(k_proj(.))` and values
`v_proj(.)` of BOTH the context rows `c` (the same `c` in every layer, not normalised again) and the
block rows `x_n`, attention, `o_proj`, residual, post-attention norm, SwiGLU MLP, residual. Then
`lm_head(norm(x))` over the draft vocab. RoPE is applied to q and k after their norms.

Alignment, for an anchor at packed-row position a (tokens x, target positions `positions`):
  slot 0 input   x[a]: at decode time the newest token (the target's bonus token), whose target
                 hidden state does not exist yet
  slot i input   mask_token_id, i = 1..S-1
  slot i output  predicts x[a+i]; its teacher is the target's distribution at position a+i-1.
                 Slot 0 predicts nothing and is never supervised.
  with cfg.sample_from_anchor: slot i predicts x[a+i+1] (teacher at a+i) and slot 0 is trained too
  context        the rows s < a of the anchor's packed segment (segment ids; 0 = padding)
  RoPE positions context row s at positions[s]; slot i at positions[a] + i (so slot 0 sits at the
                 anchor's own position and the block continues the sequence)
  attention      every slot sees all its visible context rows and all S slots of its own block
                 (bidirectional inside a block), never another block; a block has no causal order.
                 A JetSpecConfig (cfg.causal) differs only here: slot i sees block slots 0..i
                 (in_block_visibility, the rule vLLM applies to a head with dflash_config.causal)
  loss mask      loss_mask[a+i] (both objectives), and the anchor must be a real (valid) one. As
                 in speculators, a block that runs into the next packed document is masked only
                 by loss_mask (its first tokens are normally a prompt, mask 0), not by segment.
                 SpecForge has no packing; its rows are one document, where the segment rule of
                 the context is the same as its `s < a`.

The taps are `aux_layer_ids`, the word every draft family uses, in the project's output-of-layer-k
convention (HF `hidden_states[k+1]`, the aux states specjax targets capture): the same ids as
SpecForge's `target_layer_ids` and vLLM's `dflash_config.target_layer_ids` (the exported key).
speculators' config field `aux_hidden_state_layer_ids` (and vLLM's
`eagle_aux_hidden_state_layer_ids`) hold k+1.

Training (`dflash_loss`) follows one of two references, chosen by DFlashLossConfig.objective:
  "teacher_kl"  speculators 0.9 (DFlashDraftModel + compute_metrics, loss kl_div): anchors are
                drawn without replacement from the rows t with loss_mask[t] and t < T - S;
                per slot KL(teacher || draft) over the draft vocab (teacher = the target's logits
                at the predicting position, lm_head rows of the draft vocab, renormalised there),
                weight loss_mask[a+i] * decay_i, row loss = sum / (sum of the slot masks + 1e-5),
                mean over rows. decay_i = exp(-(i-1)/gamma) for i >= 1 and 0 for slot 0
                (exp(-i/gamma) with sample_from_anchor); gamma = 4 by default.
  "token_ce"    SpecForge 0.2 (OnlineDFlashModel, loss_type "dflash"): anchors from the rows t < T-1
                with loss_mask[t] and loss_mask[t+1]; per slot cross-entropy against the real token
                x[a+i] (mapped into the draft vocab; a token outside it is not supervised), weight
                (a+i < T) * loss_mask[a+i] * decay_i, loss = total weighted CE / total weight
                (one sum over the whole batch). SpecForge's decay is off unless gamma is set.
Not implemented: speculators' other loss terms (ce / tv / lk / ..., compound weights) and its
D-PACE slot weighting, SpecForge's dpace variants, sliding-window draft layers.
Metrics: per-slot top-1 accuracy of the draft against the objective's target (the teacher's argmax
over the draft vocab, or the real token) over the slot masks, its pooled value, and the accepted
length per block (leading run of correct trained slots + 1 bonus token, speculators' "eal").

Attention. `dflash_attention_reference` is the plain dense form: keys laid out as
[context rows | every block], one boolean [N*S, T + N*S] mask from the anchors and segment ids
(speculators' flex-attention layout). `dflash_attention` computes the same values without it: it
walks the anchors in chunks of `anchor_chunk` (lax.map, each chunk under jax.checkpoint so its
[chunk*S, T] scores are recomputed in the backward instead of stored), builds only that chunk's
[chunk, T] context visibility from anchor positions and segment ids, and scores the chunk's own
[S, S] block keys separately, merging both in one softmax. No [T, T*S] (or [N*S, T+N*S]) buffer
exists. Cost per chunk: heads * chunk*S * T scores.

Decoding (`init_context_cache`, `append_context`, `propose_block`): a per-layer cache of the
context keys/values (RoPE applied at their positions) and a valid length per row. After the target
has produced hidden states for rows up to p-1 and its next token x[p], `propose_block` embeds
[x[p], mask, ..., mask] at positions p..p+S-1, attends to the cached rows and returns the greedy
tokens of slots 1..S-1 (vLLM: num_speculative_tokens = S-1). Block keys are never cached: the next
block recomputes them, as the engines do.

Parameters are a plain pytree whose leaves are the rows of DFLASH_WEIGHTS (dflash_weights.py);
every function is pure. The token embedding and the teacher's lm_head are the target's arrays,
passed in. Both references also keep the output head frozen (speculators: a copy of the target's
draft-vocab rows, `init_draft_params(lm_head_rows=...)`; SpecForge: the target's head itself); the
head is a leaf here so that it is exported, and which leaves train is the optimizer's choice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal, Optional, Sequence

import jax
import jax.numpy as jnp

from specjax.drafts import weights
from specjax.drafts.dflash_weights import DFLASH_VOCAB_TENSORS, DFLASH_WEIGHTS
from specjax.drafts.eagle3 import init_params
from specjax.drafts.teacher import TopKTeacher, dense_logits
from specjax.layers.logits import soft_cap
from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, apply_rope, rope_tables

__all__ = [
    "DFLASH_VOCAB_TENSORS", "DFLASH_WEIGHTS", "DFlashConfig", "DFlashLossConfig", "JetSpecConfig", "OBJECTIVES",
    "anchor_candidates", "append_context", "attend_blocks", "block_hidden", "block_metrics", "block_positions",
    "block_slot_mask", "block_teacher_logits", "block_token_ids",
    "config_from_dict", "config_from_target", "config_to_dict", "context_kv", "context_visibility",
    "context_states", "spread_aux_layer_ids", "dflash_attention", "dflash_attention_reference",
    "dflash_loss", "draft_forward", "draft_logits", "init_context_cache", "init_draft_params",
    "in_block_visibility", "param_logical_axes", "propose_block", "select_anchors", "slot_decay",
]

Objective = Literal["teacher_kl", "token_ce"]
OBJECTIVES = ("teacher_kl", "token_ce")
_KL_DENOM_EPS = 1e-5  # speculators' loss_function adds this to the per-row mask count


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int  # H, the target's hidden size (context rows and draft width)
    num_layers: int  # draft decoder layers
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # V, the target's vocab (the embedding the draft reads)
    draft_vocab_size: int  # Vd, the lm_head rows
    aux_layer_ids: tuple[int, ...]  # output-of-layer-k (HF hidden_states[k+1]); see the module doc
    mask_token_id: int  # the token embedded in slots 1..S-1
    block_size: int = 16  # S slots per block: the anchor + S-1 mask slots
    rms_norm_eps: float = 1e-6
    rope: RopeSpec = RopeSpec()  # the target's RoPE (the block continues the target's positions)
    max_position_embeddings: int = 2048
    num_target_layers: Optional[int] = None  # the target's depth, when known (bounds aux_layer_ids)
    sample_from_anchor: bool = False  # slot 0 predicts too (S draft tokens instead of S-1)
    hidden_act: str = "silu"
    # the attention inside a block: False = every slot sees all S slots (DFlash); True = slot j sees
    # slots 0..j only (JetSpecConfig). A class attribute, not a field: the class says which drafter
    # it is, so config_to_dict, run_meta.json and the export manifest list the same fields for both
    causal: ClassVar[bool] = False

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def first_trained_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens one block yields: vLLM's num_speculative_tokens for this head."""
        return self.block_size - self.first_trained_slot

    def validate(self) -> None:
        def fail(field, problem, fix):
            raise ValueError(f"DFlashConfig.{field}={getattr(self, field)!r}: {problem}. Fix: {fix}.")

        for field in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                      "intermediate_size", "vocab_size", "draft_vocab_size"):
            if int(getattr(self, field)) < 1:
                fail(field, "must be a positive integer", f"set {field} >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_attention_heads", f"is not a multiple of num_key_value_heads={self.num_key_value_heads}",
                 "use a head count divisible by the KV head count (grouped-query attention)")
        if self.head_dim % 2:
            fail("head_dim", "is odd; RoPE rotates pairs of dimensions", "use an even head_dim")
        if self.draft_vocab_size > self.vocab_size:
            fail("draft_vocab_size", f"exceeds the target vocab ({self.vocab_size})",
                 f"set draft_vocab_size <= {self.vocab_size}")
        ids = tuple(self.aux_layer_ids)
        if not ids:
            fail("aux_layer_ids", "is empty", "name at least one target layer (output-of-layer-k ids)")
        if any(int(i) != i for i in ids) or list(ids) != sorted(set(ids)) or ids[0] < 0:
            fail("aux_layer_ids", "must be unique, increasing, non-negative integers",
                 "list each tapped layer once in increasing order (output-of-layer-k convention)")
        if self.num_target_layers is not None and ids[-1] >= self.num_target_layers:
            fail("aux_layer_ids", f"names layer {ids[-1]} but the target has {self.num_target_layers} layers "
                 "(ids are output-of-layer-k, 0-based)",
                 f"use ids in [0, {self.num_target_layers - 1}]; speculators' aux_hidden_state_layer_ids are these + 1")
        if self.block_size < 2 - int(self.sample_from_anchor):
            fail("block_size", "leaves no slot to draft", "use block_size >= 2 (the anchor plus at least one mask slot)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            fail("mask_token_id", f"is outside the target vocab [0, {self.vocab_size})",
                 "use a token id the target's embedding has (a reserved/added special token)")
        if self.hidden_act != "silu":
            fail("hidden_act", "only SwiGLU (silu) MLPs are supported", "use hidden_act='silu'")


@dataclass(frozen=True)
class JetSpecConfig(DFlashConfig):
    """A JetSpec draft: the DFlash network with causal attention inside the block (slot j attends
    to its context rows and to block slots 0..j); every function of this module takes it."""
    causal: ClassVar[bool] = True


def spread_aux_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """SpecForge's default taps (output-of-layer-k): the middle layer for a one-layer draft, else
    `num_draft_layers` ids spread evenly (rounded) from layer 1 to layer L-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers))


def config_from_target(target_cfg, *, draft_vocab_size: int, mask_token_id: int, num_layers: int = 1,
                       block_size: int = 16, aux_layer_ids: Optional[Sequence[int]] = None,
                       intermediate_size: Optional[int] = None, sample_from_anchor: bool = False) -> DFlashConfig:
    """Draft shape from a target config (a specjax target config or anything with the HF field
    names): width, heads, norms, RoPE and vocab are the target's."""
    L = int(target_cfg.num_hidden_layers)
    ids = tuple(int(i) for i in aux_layer_ids) if aux_layer_ids is not None else \
        spread_aux_layer_ids(L, num_layers)
    H, nH = int(target_cfg.hidden_size), int(target_cfg.num_attention_heads)
    cfg = DFlashConfig(
        hidden_size=H, num_layers=int(num_layers), num_attention_heads=nH,
        num_key_value_heads=int(getattr(target_cfg, "num_key_value_heads", None) or nH),
        head_dim=int(getattr(target_cfg, "head_dim", None) or H // nH),
        intermediate_size=int(intermediate_size or target_cfg.intermediate_size),
        vocab_size=int(target_cfg.vocab_size), draft_vocab_size=int(draft_vocab_size), aux_layer_ids=ids,
        mask_token_id=int(mask_token_id), block_size=int(block_size),
        rms_norm_eps=float(target_cfg.rms_norm_eps), rope=getattr(target_cfg, "rope", RopeSpec()),
        max_position_embeddings=int(getattr(target_cfg, "max_position_embeddings", 2048)),
        num_target_layers=L, sample_from_anchor=bool(sample_from_anchor))
    cfg.validate()
    return cfg


def config_to_dict(cfg: DFlashConfig) -> dict:
    d = dataclasses.asdict(cfg)
    d["aux_layer_ids"] = list(cfg.aux_layer_ids)
    return d


def config_from_dict(d: dict) -> DFlashConfig:
    d = dict(d)
    if "target_layer_ids" in d:  # run_meta.json and manifests written before the taps had one name
        d["aux_layer_ids"] = d.pop("target_layer_ids")
    d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
    d["rope"] = RopeSpec(**d["rope"])
    return DFlashConfig(**d)


# ---------------------------------------------------------------------------------------------
# params
# ---------------------------------------------------------------------------------------------
def init_draft_params(cfg: DFlashConfig, key: jax.Array, *, lm_head_rows: Optional[jnp.ndarray] = None,
                      std: float = 0.02, dtype=jnp.float32) -> dict:
    """Random init from DFLASH_WEIGHTS (normal(0, std) kernels, unit norm scales). With
    `lm_head_rows` ([Vd, H]: the target's lm_head rows of the draft vocab, in draft order) the
    draft's lm_head starts as that copy, as both references initialise it."""
    params = init_params(DFLASH_WEIGHTS, cfg, key, std=std, dtype=dtype)
    if lm_head_rows is not None:
        rows = jnp.asarray(lm_head_rows)
        if rows.shape != (cfg.draft_vocab_size, cfg.hidden_size):
            raise ValueError(f"lm_head_rows has shape {rows.shape}; expected [draft_vocab_size, hidden_size] = "
                             f"{(cfg.draft_vocab_size, cfg.hidden_size)} (the target's lm_head rows of the draft vocab)")
        params["lm_head"]["kernel"] = rows.T.astype(dtype)
    return params


def param_logical_axes(cfg: DFlashConfig) -> dict:
    """Logical axes (specjax.mesh.RULES names) of every leaf, from DFLASH_WEIGHTS."""
    return weights.logical_axes(DFLASH_WEIGHTS, cfg)


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------
def _linear(x, p):
    return jnp.einsum("...i,io->...o", x, p["kernel"].astype(x.dtype))


def _rope(x_btnd, positions_bt, cfg: DFlashConfig):
    cos, sin = rope_tables(cfg.rope, cfg.head_dim, positions_bt, x_btnd.dtype)
    return apply_rope(x_btnd, cos, sin)


def context_states(params: dict, cfg: DFlashConfig, aux_hidden: Sequence[jnp.ndarray], dtype=jnp.float32):
    """hidden_norm(fc(concat(aux))) [B, T, H]: the context rows every draft layer attends to."""
    if len(aux_hidden) != cfg.num_aux:
        raise ValueError(f"expected {cfg.num_aux} target hidden states (aux_layer_ids={cfg.aux_layer_ids}), "
                         f"got {len(aux_hidden)}")
    g = jnp.concatenate([a.astype(dtype) for a in aux_hidden], axis=-1)
    return rms_norm(_linear(g, params["fc"]), params["hidden_norm"]["scale"].astype(dtype), cfg.rms_norm_eps)


def context_kv(layer: dict, cfg: DFlashConfig, ctx_btd, positions_bt):
    """One layer's context keys (k_norm, then RoPE at the rows' positions) and values [B, T, nKV, hd]."""
    a = layer["self_attn"]
    B, T, _ = ctx_btd.shape
    k = _linear(ctx_btd, a["k_proj"]).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
    k = rms_norm(k, a["k_norm"]["scale"], cfg.rms_norm_eps)
    v = _linear(ctx_btd, a["v_proj"]).reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
    return _rope(k, positions_bt, cfg), v


def block_qkv(layer: dict, cfg: DFlashConfig, xn_bnsd, positions_bns):
    """One layer's block queries [B, N, S, nH, hd] and keys/values [B, N, S, nKV, hd] from the
    input-normed block rows, RoPE at the slots' positions."""
    a = layer["self_attn"]
    B, N, S, _ = xn_bnsd.shape
    flat = xn_bnsd.reshape(B, N * S, -1)
    pos = positions_bns.reshape(B, N * S)
    q = _linear(flat, a["q_proj"]).reshape(B, N * S, cfg.num_attention_heads, cfg.head_dim)
    k = _linear(flat, a["k_proj"]).reshape(B, N * S, cfg.num_key_value_heads, cfg.head_dim)
    v = _linear(flat, a["v_proj"]).reshape(B, N * S, cfg.num_key_value_heads, cfg.head_dim)
    q = _rope(rms_norm(q, a["q_norm"]["scale"], cfg.rms_norm_eps), pos, cfg)
    k = _rope(rms_norm(k, a["k_norm"]["scale"], cfg.rms_norm_eps), pos, cfg)
    shape = lambda t: t.reshape(B, N, S, *t.shape[2:])  # noqa: E731
    return shape(q), shape(k), shape(v)


def layer_output(layer: dict, cfg: DFlashConfig, x, attn):
    """Residual + o_proj(attention), then the SwiGLU MLP block (pre-norm)."""
    h = x + _linear(attn.reshape(*attn.shape[:-2], -1), layer["self_attn"]["o_proj"])
    m = layer["mlp"]
    hn = rms_norm(h, layer["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
    return h + _linear(jax.nn.silu(_linear(hn, m["gate_proj"])) * _linear(hn, m["up_proj"]), m["down_proj"])


def draft_logits(params: dict, cfg: DFlashConfig, h) -> jnp.ndarray:
    """lm_head(norm(h)) over the draft vocab, fp32."""
    hn = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps)
    return jnp.einsum("...d,dv->...v", hn, params["lm_head"]["kernel"].astype(hn.dtype),
                      preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------
def in_block_visibility(block_size: int, causal: bool) -> jnp.ndarray:
    """[S, S] bool: slot s sees block slot u. Bidirectional (DFlash): every slot. Causal (JetSpec):
    u <= s. vLLM 0.32 draws the same line: v1/spec_decode/dflash.py builds the drafting step's
    attention metadata with the block's S queries appended after the request's context keys
    (seq_lens = context + S) and `causal=self.dflash_causal`, which model_executor/models/qwen3_dflash.py
    resolves per layer in `_dflash_layer_causal` (a top-level is_causal, else dflash_config.causal) via
    `_resolve_layer_attention` / `dflash_has_any_non_causal`; causal attention aligns those queries
    to the end of the keys, so query j sees every context row and block slots 0..j."""
    slots = jnp.arange(block_size)
    if causal:
        return slots[None, :] <= slots[:, None]
    return jnp.ones((block_size, block_size), bool)


def context_visibility(anchors_bn, ctx_segment_ids_bt) -> jnp.ndarray:
    """[B, N, T] bool: block n sees context row t iff t < anchor and t is in the anchor's segment
    (segment 0 = padding sees nothing)."""
    T = ctx_segment_ids_bt.shape[1]
    t = jnp.arange(T)[None, None, :]
    anchor_seg = jnp.take_along_axis(ctx_segment_ids_bt, anchors_bn, axis=1)[:, :, None]
    return (t < anchors_bn[:, :, None]) & (ctx_segment_ids_bt[:, None, :] == anchor_seg) & (anchor_seg > 0)


def dflash_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_segment_ids, *, causal: bool = False):
    """Plain dense DFlash attention. q [B, N, S, nH, hd]; k_ctx/v_ctx [B, T, nKV, hd];
    k_blk/v_blk [B, N, S, nKV, hd]; anchors [B, N] int; ctx_segment_ids [B, T] (0 = padding).

    Keys are [context rows | all N*S block rows]; query (n, s) sees context row t iff t < anchors[n]
    in the same segment, and block row (m, u) iff m == n (and u <= s when `causal`). Returns
    [B, N, S, nH, hd]."""
    B, N, S, nH, D = q.shape
    T, nKV = k_ctx.shape[1], k_ctx.shape[2]
    qf = q.reshape(B, N * S, nH, D).astype(jnp.float32)
    k = jnp.concatenate([k_ctx, k_blk.reshape(B, N * S, nKV, D)], axis=1).astype(jnp.float32)
    v = jnp.concatenate([v_ctx, v_blk.reshape(B, N * S, nKV, D)], axis=1).astype(jnp.float32)
    k, v = jnp.repeat(k, nH // nKV, axis=2), jnp.repeat(v, nH // nKV, axis=2)  # query head h reads kv head h // R
    scores = jnp.einsum("bqhd,bkhd->bhqk", qf, k) * (D ** -0.5)
    q_anchor = jnp.repeat(anchors, S, axis=1)  # [B, N*S]
    q_block = jnp.arange(N * S) // S
    kv = jnp.arange(T + N * S)
    kv_seg = jnp.take(ctx_segment_ids, jnp.minimum(kv, T - 1), axis=1)  # [B, T+N*S]
    q_seg = jnp.take_along_axis(ctx_segment_ids, q_anchor, axis=1)  # [B, N*S]
    sees_context = ((kv[None, None, :] < T) & (kv[None, None, :] < q_anchor[:, :, None])
                    & (kv_seg[:, None, :] == q_seg[:, :, None]) & (q_seg[:, :, None] > 0))
    sees_block = (kv[None, :] >= T) & ((kv[None, :] - T) // S == q_block[:, None])
    if causal:
        sees_block = sees_block & ((kv[None, :] - T) % S <= jnp.arange(N * S)[:, None] % S)
    mask = sees_context | sees_block[None]  # [B, N*S, T+N*S]
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.reshape(B, N, S, nH, D).astype(q.dtype)


def attend_blocks(q, k_ctx, v_ctx, k_blk, v_blk, ctx_visible, *, causal: bool = False):
    """DFlash attention for n blocks against shared context rows, given the blocks' context
    visibility `ctx_visible` [B, n, T] (bool). q [B, n, S, nH, hd], k_ctx/v_ctx [B, T, nKV, hd],
    k_blk/v_blk [B, n, S, nKV, hd]. One softmax over [visible context rows | own block's slots
    (in_block_visibility: all of them, or slots 0..s when `causal`)]."""
    B, n, S, nH, D = q.shape
    nKV = k_ctx.shape[2]
    qg = q.reshape(B, n, S, nKV, nH // nKV, D).astype(jnp.float32)
    scale = D ** -0.5
    s_ctx = jnp.einsum("bnsgrd,btgd->bngrst", qg, k_ctx.astype(jnp.float32)) * scale
    s_blk = jnp.einsum("bnsgrd,bnugd->bngrsu", qg, k_blk.astype(jnp.float32)) * scale
    s_ctx = jnp.where(ctx_visible[:, :, None, None, None, :], s_ctx, -jnp.inf)
    if causal:
        s_blk = jnp.where(in_block_visibility(S, causal), s_blk, -jnp.inf)
    # every slot sees itself, so the row max is finite
    m = jnp.maximum(jnp.max(s_ctx, axis=-1, keepdims=True), jnp.max(s_blk, axis=-1, keepdims=True))
    p_ctx, p_blk = jnp.exp(s_ctx - m), jnp.exp(s_blk - m)
    denom = jnp.sum(p_ctx, axis=-1) + jnp.sum(p_blk, axis=-1)  # [B, n, g, r, S]
    out = (jnp.einsum("bngrst,btgd->bngrsd", p_ctx, v_ctx.astype(jnp.float32))
           + jnp.einsum("bngrsu,bnugd->bngrsd", p_blk, v_blk.astype(jnp.float32))) / denom[..., None]
    return out.transpose(0, 1, 4, 2, 3, 5).reshape(B, n, S, nH, D).astype(q.dtype)


def dflash_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, ctx_segment_ids, *, anchor_chunk: int = 16,
                     causal: bool = False):
    """The values of dflash_attention_reference, computed `anchor_chunk` blocks at a time (see the
    module doc): only a [B, chunk, T] visibility and [chunk*S, T] scores per step, recomputed in
    the backward."""
    B, N = anchors.shape
    C = max(1, min(int(anchor_chunk), N))
    n_chunks = -(-N // C)
    pad = n_chunks * C - N

    def chunked(x):  # [B, N, ...] -> [n_chunks, B, C, ...], padded blocks are anchor 0 (no context)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n_chunks, C, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one_chunk(args):
        qc, kc, vc, ac = args
        return attend_blocks(qc, k_ctx, v_ctx, kc, vc, context_visibility(ac, ctx_segment_ids), causal=causal)

    out = jax.lax.map(one_chunk, (chunked(q), chunked(k_blk), chunked(v_blk), chunked(anchors)))
    out = jnp.moveaxis(out, 0, 1).reshape(B, n_chunks * C, *q.shape[2:])
    return out[:, :N]


# ---------------------------------------------------------------------------------------------
# training forward
# ---------------------------------------------------------------------------------------------
def block_token_ids(input_ids_bt, anchors_bn, cfg: DFlashConfig) -> jnp.ndarray:
    """[B, N, S] block inputs: x[anchor] in slot 0, mask_token_id in the other slots."""
    anchor_tok = jnp.take_along_axis(input_ids_bt, anchors_bn, axis=1)
    B, N = anchors_bn.shape
    masks = jnp.full((B, N, cfg.block_size - 1), cfg.mask_token_id, input_ids_bt.dtype)
    return jnp.concatenate([anchor_tok[:, :, None], masks], axis=-1)


def block_positions(positions_bt, anchors_bn, cfg: DFlashConfig) -> jnp.ndarray:
    """[B, N, S] RoPE positions of the slots: positions[anchor] + i."""
    base = jnp.take_along_axis(positions_bt, anchors_bn, axis=1)
    return base[:, :, None] + jnp.arange(cfg.block_size, dtype=base.dtype)


def draft_forward(params: dict, cfg: DFlashConfig, *, aux_hidden: Sequence[jnp.ndarray], input_ids, positions,
                  segment_ids, anchors, embed_table, attention: Literal["chunked", "reference"] = "chunked",
                  anchor_chunk: int = 16, compute_dtype=jnp.float32) -> jnp.ndarray:
    """The draft over the blocks of one packed batch: [B, N, S, H] hidden states before the final
    norm. aux_hidden: cfg.num_aux x [B, T, H] (the target's states at aux_layer_ids);
    input_ids / positions / segment_ids [B, T]; anchors [B, N] int (block n starts at anchors[n]);
    embed_table [V, H] (the target's, frozen: no gradient flows into it)."""
    params = jax.tree_util.tree_map(lambda p: p.astype(compute_dtype), params)
    seg = segment_ids.astype(jnp.int32)
    anchors = anchors.astype(jnp.int32)
    ctx = context_states(params, cfg, [jax.lax.stop_gradient(a) for a in aux_hidden], compute_dtype)
    x = jax.lax.stop_gradient(jnp.take(embed_table, block_token_ids(input_ids, anchors, cfg), axis=0))
    x = x.astype(compute_dtype)
    pos_blk = block_positions(positions, anchors, cfg)
    for i in range(cfg.num_layers):
        layer = params["layers"][str(i)]
        xn = rms_norm(x, layer["input_layernorm"]["scale"], cfg.rms_norm_eps)
        q, k_blk, v_blk = block_qkv(layer, cfg, xn, pos_blk)
        k_ctx, v_ctx = context_kv(layer, cfg, ctx, positions)
        if attention == "reference":
            attn = dflash_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, anchors, seg, causal=cfg.causal)
        elif attention == "chunked":
            attn = dflash_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, seg, anchor_chunk=anchor_chunk,
                                    causal=cfg.causal)
        else:
            raise ValueError(f"attention={attention!r}: use 'chunked' or 'reference'")
        x = layer_output(layer, cfg, x, attn)
    return x


# ---------------------------------------------------------------------------------------------
# anchors
# ---------------------------------------------------------------------------------------------
def anchor_candidates(loss_mask_bt, block_size: int, objective: Objective) -> jnp.ndarray:
    """[B, T] bool: where a block may start. teacher_kl (speculators): loss_mask[t] and t < T - S;
    token_ce (SpecForge): t < T - 1 and loss_mask[t] and loss_mask[t+1]."""
    m = loss_mask_bt > 0.5
    T = m.shape[1]
    t = jnp.arange(T)[None, :]
    if objective == "teacher_kl":
        return m & (t < T - block_size)
    if objective == "token_ce":
        nxt = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
        return m & nxt
    raise ValueError(f"objective={objective!r}: use one of {OBJECTIVES}")


def select_anchors(key: jax.Array, candidates_bt, num_anchors: int):
    """Up to `num_anchors` candidate rows per batch row, drawn uniformly without replacement and
    sorted. Returns (anchors [B, N] int32, valid [B, N] bool); unused entries are anchor 0, invalid."""
    B, T = candidates_bt.shape
    N = int(num_anchors)
    score = jnp.where(candidates_bt, jax.random.uniform(key, (B, T)), 2.0)  # non-candidates sort last
    picked = jnp.argsort(score, axis=1)[:, :N] if N <= T else jnp.pad(jnp.argsort(score, axis=1), ((0, 0), (0, N - T)))
    keep = jnp.arange(N)[None, :] < jnp.minimum(jnp.sum(candidates_bt, axis=1), N)[:, None]
    anchors = jnp.sort(jnp.where(keep, picked, T), axis=1)  # sentinel T sorts the unused ones last
    valid = anchors < T
    return jnp.where(valid, anchors, 0).astype(jnp.int32), valid


# ---------------------------------------------------------------------------------------------
# loss and metrics
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DFlashLossConfig:
    objective: Objective = "teacher_kl"
    num_anchors: int = 512  # blocks per batch row (speculators max_anchors, SpecForge num_anchors)
    loss_decay_gamma: Optional[float] = 4.0  # None or 0: no decay (SpecForge's default)
    anchor_chunk: int = 16  # blocks per attention step (memory), no effect on values
    attention: Literal["chunked", "reference"] = "chunked"

    def validate(self, cfg: DFlashConfig) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"DFlashLossConfig.objective={self.objective!r}: unknown. Fix: use one of {OBJECTIVES}.")
        if self.objective == "token_ce" and cfg.sample_from_anchor:
            raise ValueError("DFlashLossConfig.objective='token_ce' with DFlashConfig.sample_from_anchor=True: SpecForge's "
                             "DFlash CE never trains slot 0. Fix: use objective='teacher_kl' or sample_from_anchor=False.")
        if self.num_anchors < 1:
            raise ValueError(f"DFlashLossConfig.num_anchors={self.num_anchors}: must be >= 1. Fix: set num_anchors >= 1.")


def slot_decay(cfg: DFlashConfig, gamma: Optional[float]) -> jnp.ndarray:
    """[S] loss weight of each slot: 0 for an untrained slot 0, then exp(-j/gamma) for the j-th
    trained slot (j = 0, 1, ...); 1 for every trained slot without gamma."""
    i = jnp.arange(cfg.block_size, dtype=jnp.float32)
    j = jnp.maximum(i - cfg.first_trained_slot, 0.0)
    decay = jnp.exp(-j / gamma) if gamma else jnp.ones_like(i)
    return decay * (i >= cfg.first_trained_slot)


def block_slot_mask(cfg: DFlashConfig, anchors, anchor_valid, loss_mask):
    """(slot_mask [B, N, S] float, gather): slot i of block n counts with loss_mask[anchor + i], a
    valid anchor, a trained slot and a row inside the batch row; `gather(x)` takes x [B, T] at the
    rows anchor + i (clipped into the row)."""
    B, T = loss_mask.shape
    slot_idx = anchors[:, :, None] + jnp.arange(cfg.block_size)  # [B, N, S] row a+i
    in_row = slot_idx < T
    slot_idx = jnp.minimum(slot_idx, T - 1)

    def gather(x):
        return jnp.take_along_axis(x, slot_idx.reshape(B, -1), axis=1).reshape(B, *slot_idx.shape[1:])

    trained = (jnp.arange(cfg.block_size) >= cfg.first_trained_slot)[None, None, :]
    # slots past the row end: token_ce's anchors may start a block there (SpecForge masks those slots);
    # teacher_kl's rule keeps every block inside the row
    return gather(loss_mask.astype(jnp.float32)) * anchor_valid[:, :, None] * trained * in_row, gather


def block_teacher_logits(cfg: DFlashConfig, anchors, final_hidden, lm_head, draft_ids=None, logit_softcap=None):
    """[B, N, S, Vd] fp32 teacher logits of every block slot: the target's logits (over the draft
    vocab rows of `lm_head`, soft-capped by `logit_softcap`) at the position slot i predicts from,
    anchor + i - 1 (anchor + i with cfg.sample_from_anchor), clipped into the row. `final_hidden` is
    the target's final-norm hidden [B, T, H] or a TopKTeacher read from a state cache. No gradient."""
    if final_hidden is None or lm_head is None:
        raise ValueError("objective 'teacher_kl' needs final_hidden and lm_head (the target's) for the teacher")
    sg = jax.lax.stop_gradient
    B, T = (final_hidden.ids if isinstance(final_hidden, TopKTeacher) else final_hidden).shape[:2]
    S = cfg.block_size
    rows = lm_head if draft_ids is None else jnp.take(lm_head, draft_ids, axis=0)  # [Vd, H]
    src = jnp.clip(anchors[:, :, None] + jnp.arange(S) - 1 + int(cfg.sample_from_anchor), 0, T - 1)
    if isinstance(final_hidden, TopKTeacher):  # read from a state cache: its logits, soft-capped already
        idx = src.reshape(B, -1)
        picked = TopKTeacher(*(jnp.take_along_axis(sg(a), idx[:, :, None] if a.ndim == 3 else idx, axis=1)
                               for a in final_hidden))
        return dense_logits(picked, rows.shape[0]).reshape(B, *src.shape[1:], -1)
    h_src = jnp.take_along_axis(sg(final_hidden), src.reshape(B, -1)[:, :, None], axis=1)
    return soft_cap(jnp.einsum("bqd,vd->bqv", h_src, sg(rows).astype(h_src.dtype),
                               preferred_element_type=jnp.float32), logit_softcap).reshape(B, *src.shape[1:], -1)


def dflash_loss(params: dict, cfg: DFlashConfig, loss_cfg: DFlashLossConfig, *, anchors, anchor_valid, input_ids,
                loss_mask, segment_ids, positions, aux_hidden: Sequence[jnp.ndarray], embed_table,
                final_hidden=None, lm_head=None, draft_ids=None, compute_dtype=jnp.float32,
                logit_softcap=None):
    """(loss, metrics) of one packed batch for the blocks at `anchors` [B, N] (`anchor_valid` [B, N]
    bool; see select_anchors). final_hidden [B, T, H] (the target's final-norm hidden, or a TopKTeacher
    read from a state cache) and lm_head
    [V, H] (the target's) give the teacher of "teacher_kl" (soft-capped by `logit_softcap`, the
    target's Target.logit_softcap); draft_ids [Vd] (ascending target ids) map the draft vocab,
    None = the full vocab."""
    loss_cfg.validate(cfg)
    B, T = input_ids.shape
    S = cfg.block_size
    anchors = anchors.astype(jnp.int32)
    logits = draft_logits(params, cfg, draft_forward(
        params, cfg, aux_hidden=aux_hidden, input_ids=input_ids, positions=positions, segment_ids=segment_ids,
        anchors=anchors, embed_table=embed_table, attention=loss_cfg.attention, anchor_chunk=loss_cfg.anchor_chunk,
        compute_dtype=compute_dtype))  # [B, N, S, Vd] fp32
    slot_mask, gather = block_slot_mask(cfg, anchors, anchor_valid, loss_mask)
    decay = slot_decay(cfg, loss_cfg.loss_decay_gamma)
    log_q = jax.nn.log_softmax(logits, axis=-1)

    if loss_cfg.objective == "teacher_kl":
        teacher = block_teacher_logits(cfg, anchors, final_hidden, lm_head, draft_ids, logit_softcap)
        log_p = jax.nn.log_softmax(teacher, axis=-1)
        per_slot = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # KL(teacher || draft)
        row_loss = jnp.sum(per_slot * slot_mask * decay, axis=(1, 2)) / (jnp.sum(slot_mask, axis=(1, 2)) + _KL_DENOM_EPS)
        loss = jnp.mean(row_loss)
        target_ids = jnp.argmax(teacher, axis=-1)
    else:  # token_ce
        tokens = gather(input_ids)
        if draft_ids is None:
            target_ids, in_vocab = tokens, jnp.ones(tokens.shape, bool)
        else:
            target_ids = jnp.clip(jnp.searchsorted(draft_ids, tokens), 0, draft_ids.shape[0] - 1)
            in_vocab = jnp.take(draft_ids, target_ids) == tokens
        slot_mask = slot_mask * in_vocab
        per_slot = -jnp.take_along_axis(log_q, target_ids[..., None], axis=-1)[..., 0]
        w = slot_mask * decay
        total_w = jnp.sum(w)
        loss = jnp.where(total_w > 0, jnp.sum(per_slot * w) / jnp.where(total_w > 0, total_w, 1.0), 0.0)
    metrics = block_metrics(jnp.argmax(logits, axis=-1), target_ids, slot_mask, cfg)
    metrics["loss"] = loss
    return loss, metrics


def block_metrics(pred_bns, target_bns, slot_mask_bns, cfg: DFlashConfig) -> dict:
    """Per-slot accuracy over the slot masks and the accepted length per block (leading run of
    correct trained slots, an untrained or masked slot ends it, + 1 bonus token), as counts and ratios."""
    valid = slot_mask_bns > 0
    correct = (pred_bns == target_bns) & valid
    correct_pos = jnp.sum(correct, axis=(0, 1)).astype(jnp.float32)
    total_pos = jnp.sum(valid, axis=(0, 1)).astype(jnp.float32)
    first = cfg.first_trained_slot
    run = jnp.sum(jnp.cumprod(correct[..., first:].astype(jnp.float32), axis=-1), axis=-1) + 1.0  # [B, N]
    block_valid = jnp.any(valid[..., first:], axis=-1).astype(jnp.float32)
    sg = jax.lax.stop_gradient
    return sg({
        "acc_pos": correct_pos / jnp.maximum(total_pos, 1.0),  # [S]; slot 0 is 0 unless sample_from_anchor
        "correct_pos": correct_pos,
        "total_pos": total_pos,
        "acc": jnp.sum(correct_pos) / jnp.maximum(jnp.sum(total_pos), 1.0),
        "accept_len": jnp.sum(run * block_valid) / jnp.maximum(jnp.sum(block_valid), 1.0),
        "accept_len_sum": jnp.sum(run * block_valid),
        "num_blocks": jnp.sum(block_valid),
    })


# ---------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------
def init_context_cache(cfg: DFlashConfig, batch: int, max_len: int, dtype=jnp.float32) -> dict:
    """Context keys/values per layer [L, B, max_len, nKV, hd] (RoPE applied) and the number of valid
    rows per batch row, `length` [B]."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "length": jnp.zeros((batch,), jnp.int32)}


def append_context(params: dict, cfg: DFlashConfig, cache: dict, aux_hidden: Sequence[jnp.ndarray], positions_bn,
                   num_valid_b=None) -> dict:
    """Write n new context rows (the target's states at aux_layer_ids for positions
    `positions_bn` [B, n]) after each row's valid ones; only the first `num_valid_b` [B] (default n)
    count, the rest are overwritten by the next append. The caller keeps length + n <= max_len
    (dynamic_update_slice clamps an overflowing write instead of failing)."""
    dtype = cache["k"].dtype
    ctx = context_states(params, cfg, aux_hidden, dtype)
    B, n, _ = ctx.shape
    write = jax.vmap(lambda buf, new, start: jax.lax.dynamic_update_slice(buf, new, (start, 0, 0)))
    ks, vs = [], []
    for i in range(cfg.num_layers):
        k, v = context_kv(params["layers"][str(i)], cfg, ctx, positions_bn)
        ks.append(write(cache["k"][i], k.astype(dtype), cache["length"]))
        vs.append(write(cache["v"][i], v.astype(dtype), cache["length"]))
    added = jnp.full((B,), n, jnp.int32) if num_valid_b is None else num_valid_b.astype(jnp.int32)
    return {"k": jnp.stack(ks), "v": jnp.stack(vs), "length": cache["length"] + added}


def propose_block(params: dict, cfg: DFlashConfig, cache: dict, *, embed_table, last_token_b, last_position_b,
                  d2t=None):
    """Greedy draft of one block after the newest token `last_token_b` [B] at `last_position_b` [B]
    (the cache holds the context rows of every earlier position). Returns (target token ids
    [B, K], draft logits [B, K, Vd]) for the trained slots (K = cfg.num_draft_tokens); `d2t`
    ([Vd] offsets) maps draft ids to target ids, None = the full vocab."""
    x = block_hidden(params, cfg, cache, embed_table=embed_table, last_token_b=last_token_b,
                     last_position_b=last_position_b)
    logits = draft_logits(params, cfg, x)[:, cfg.first_trained_slot:]
    draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = draft if d2t is None else draft + jnp.take(jnp.asarray(d2t), draft).astype(jnp.int32)
    return tokens, logits


def block_hidden(params: dict, cfg: DFlashConfig, cache: dict, *, embed_table, last_token_b, last_position_b):
    """The pre-norm states [B, S, H] of every slot of the block [last_token_b, mask, ...] at
    `last_position_b` [B] against the context cache (propose_block's network)."""
    B = last_token_b.shape[0]
    S = cfg.block_size
    ids = jnp.concatenate([last_token_b[:, None].astype(jnp.int32),
                           jnp.full((B, S - 1), cfg.mask_token_id, jnp.int32)], axis=1)
    pos = (last_position_b[:, None] + jnp.arange(S)).astype(jnp.int32)[:, None, :]  # [B, 1, S]
    dtype = cache["k"].dtype
    x = jnp.take(embed_table, ids, axis=0).astype(dtype)[:, None]  # [B, 1, S, H]
    visible = (jnp.arange(cache["k"].shape[2])[None, :] < cache["length"][:, None])[:, None, :]  # [B, 1, M]
    for i in range(cfg.num_layers):
        layer = params["layers"][str(i)]
        xn = rms_norm(x, layer["input_layernorm"]["scale"].astype(dtype), cfg.rms_norm_eps)
        q, k_blk, v_blk = block_qkv(layer, cfg, xn, pos)
        x = layer_output(layer, cfg, x, attend_blocks(q, cache["k"][i], cache["v"][i], k_blk, v_blk, visible,
                                                      causal=cfg.causal))
    return x[:, 0]

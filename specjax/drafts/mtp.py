"""The MTP draft (draft.type mtp): a target's own multi-token-prediction layer, fine-tuned as the draft.

Targets that ship MTP layers (DeepSeek-V3, GLM-4.5 / 4.6 / 4.7, Qwen3-Next, Qwen3.5, Qwen3.5-MoE)
carry one decoder layer after their stack that reads the target's last state and the next token and
predicts the token after it. vLLM's native "mtp" method runs it as the draft; this module trains it.

Network, per layout (vLLM 0.32 deepseek_mtp.py / glm4_moe_mtp.py / qwen3_next_mtp.py / qwen3_5_mtp.py,
speculators 0.9 models/mtp):
  h_t       the target's last hidden state AFTER its final norm: what vLLM's target model returns
            and its runner hands the MTP drafter (gpu_model_runner: target_hidden_states =
            hidden_states; DeepseekV2Model / Qwen3NextModel / Glm4MoeModel end in self.norm)
  "deepseek" (DeepSeek-V3, GLM-4.5):
            e = embed(x_{t+1}), zeroed at position 0 (vLLM masks that row's embedding)
            u = eh_proj(concat(enorm(e), hnorm(h_t)))                    eh_proj: [2H -> H], no bias
            h' = the target's decoder layer (MLA or GQA attention, then its MoE feed-forward: the
                 layer index num_hidden_layers is past first_k_dense_replace) over u
            logits = lm_head(shared_head.norm(h'))
            next step's hidden: shared_head.norm(h') for DeepSeek-V3 (deepseek_mtp recycles the
            normed state), h' for GLM (glm4_moe_mtp returns the pre-norm state)
  "qwen3_next" (Qwen3-Next, Qwen3.5, Qwen3.5-MoE; norms are (1 + w) RMSNorms):
            u = fc(concat(pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)))
            h' = the target's layer (qwen3_next.decoder_layer) with a full-attention mixer (gated
                 attention) and the feed-forward of layer 0 (MoE when the target has experts)
            logits = lm_head(norm(h')); next step's hidden: norm(h')
The embedding and lm_head are the target's (frozen; vLLM shares them with the target); the MTP
layer's weights are all trained. The block is the target family's own code (deepseek_v3 /
glm4_moe .decoder_layer with deepseek_v3.moe_ffn, qwen3_next.decoder_layer with its mixer and ffn),
its params one layer of the target's weight table (`mtp_weights`).

Loss (speculators 0.9 MTPDraftModel.forward, FastMTP eq. 2): K = num_steps teacher-forced steps with
the one layer; step k (0-based) reads the embedding of x_{t+k+1} and, for k > 0, step k-1's next-step
hidden at the same row, and predicts x_{t+k+2} with token cross-entropy against the data (the
target's own answers when regenerate is on). Step losses are means over their rows (loss mask at the
predicted token, which lies in the same packed sequence), weighted by w_k = beta^k / sum_j beta^j
(beta = draft.step_weight_beta, 0.6), and summed. All steps read the rows' own positions (as
speculators does; RoPE attention is relative, so this equals drafting at shifted positions).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafts.eagle3_decoding import chain_draw
from specjax.drafts.weights import leaf, nest
from specjax.layers.norms import rms_norm
from specjax.layers.rope import rope_tables
from specjax.targets import deepseek_v3, glm4_moe, qwen3_next
from specjax.targets.layers import decoding, mla
from specjax.targets.layers.attention import cache_attention_mask
from specjax.targets.decoder import StackInputs
from specjax.targets.registry import get_target_class

DEEPSEEK, QWEN3_NEXT = "deepseek", "qwen3_next"
SPECULATORS_NUM_STEPS = 3  # speculators' default num_speculative_steps
SPECULATORS_STEP_WEIGHT_BETA = 0.6  # its default step_weight_beta (FastMTP)


class MtpWeight(NamedTuple):
    """One weight of the MTP layer: its param path, its name in the target checkpoint, its specjax
    shape and logical axes, whether the file holds the transpose, and its init."""
    path: tuple[str, ...]
    file_name: str
    shape: tuple[int, ...]
    axes: tuple[Optional[str], ...]
    transpose: bool
    init: str  # "normal", "ones", "zeros"
    dtype: Optional[str] = None  # a fixed dtype (DeepSeek's fp32 router)
    expert_stacked: bool = False  # "{e}" in file_name: one file tensor per expert, stacked on axis 0


def layout_of(target_cfg) -> str:
    """The MTP layout of a target config; ValueError naming what is supported otherwise."""
    if isinstance(target_cfg, qwen3_next.Qwen3NextTargetConfig):
        return QWEN3_NEXT
    if type(target_cfg) in (deepseek_v3.DeepseekV3TargetConfig, glm4_moe.Glm4MoeTargetConfig):
        return DEEPSEEK
    arch = getattr(target_cfg, "architecture", type(target_cfg).__name__)
    raise ValueError(f"draft.type=mtp trains a target's own multi-token-prediction layer, and {arch} has none "
                     "specjax can train (supported: DeepseekV3ForCausalLM, Glm4MoeForCausalLM, Qwen3NextForCausalLM, "
                     "Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM). Fix: use another draft.type (eagle3, dflash, "
                     "eagle) for this target")


def mtp_layers_in_config(target_cfg, hf: Optional[dict] = None) -> int:
    """How many MTP layers the target declares (num_nextn_predict_layers; Qwen3.5: mtp_num_hidden_layers)."""
    if layout_of(target_cfg) == DEEPSEEK:
        return int(target_cfg.num_nextn_predict_layers)
    hf = hf or {}
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if hf.get(key) is not None:
            return int(hf[key])
    return 1


@dataclass(frozen=True)
class MtpConfig:
    target: Any  # the target's config (a frozen target config dataclass): the layer's shapes and blocks
    num_steps: int = SPECULATORS_NUM_STEPS
    step_weight_beta: float = SPECULATORS_STEP_WEIGHT_BETA

    @property
    def layout(self) -> str:
        return layout_of(self.target)

    @property
    def hidden_size(self) -> int:
        return int(self.target.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.target.vocab_size)

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return ()

    @property
    def file_prefix(self) -> str:
        """Where the layer's tensors live in the target checkpoint (and in vLLM's loader)."""
        return f"model.layers.{self.target.num_hidden_layers}." if self.layout == DEEPSEEK else "mtp."

    def validate(self) -> None:
        layout_of(self.target)
        if getattr(self.target, "weight_quant", None) is not None:
            raise ValueError("draft.type=mtp on an FP8 checkpoint: specjax trains the MTP layer in the load dtype and "
                             "exports it unquantized. Fix: dequantize the target to bf16 first")
        if self.layout == QWEN3_NEXT and not self.target.layers_of(qwen3_next.FULL):
            raise ValueError("draft.type=mtp: the Qwen3-Next MTP layer is a full-attention layer and this target's "
                             "layer_types has none to copy the attention shapes from")
        if self.num_steps < 1:
            raise ValueError(f"draft.type=mtp: num_steps={self.num_steps} must be >= 1")


def step_weights(beta: float, num_steps: int) -> list[float]:
    """speculators' normalised exponential decay: w_k = beta^k / sum_j beta^j."""
    raw = [beta**k for k in range(num_steps)]
    return [w / sum(raw) for w in raw]


# ---------------------------------------------------------------------------------------------
# the weight table: the layout's own rows, then one layer of the target's weight table
# ---------------------------------------------------------------------------------------------
def mtp_weights(cfg: MtpConfig) -> list[MtpWeight]:
    tc, D = cfg.target, cfg.hidden_size
    pre = cfg.file_prefix
    if cfg.layout == DEEPSEEK:
        own = [MtpWeight(("enorm", "scale"), pre + "enorm.weight", (D,), ("norm",), False, "ones"),
               MtpWeight(("hnorm", "scale"), pre + "hnorm.weight", (D,), ("norm",), False, "ones"),
               MtpWeight(("eh_proj", "kernel"), pre + "eh_proj.weight", (2 * D, D), (None, "embed"), True, "normal"),
               MtpWeight(("shared_head_norm", "scale"), pre + "shared_head.norm.weight", (D,), ("norm",), False,
                         "ones")]
        groups = {"layers": "block", "moe_layers": "ffn"}
        layer_prefix, norm_init = pre, "ones"
    else:
        own = [MtpWeight(("pre_fc_norm_embedding", "scale"), pre + "pre_fc_norm_embedding.weight", (D,), ("norm",),
                         False, "zeros"),
               MtpWeight(("pre_fc_norm_hidden", "scale"), pre + "pre_fc_norm_hidden.weight", (D,), ("norm",), False,
                         "zeros"),
               MtpWeight(("fc", "kernel"), pre + "fc.weight", (2 * D, D), (None, "embed"), True, "normal"),
               MtpWeight(("norm", "scale"), pre + "norm.weight", (D,), ("norm",), False, "zeros")]
        ffn_group = "moe_layers" if tc.is_moe(0) else "mlp_layers"
        groups = {"layers": "block", "self_attn": "self_attn", ffn_group: "ffn"}
        layer_prefix, norm_init = pre + "layers.0.", "zeros"
    rows = []
    for spec in get_target_class(tc.architecture).weight_specs(tc):
        if spec.path[0] not in groups or not spec.hf_name.startswith("model.layers.{i}."):
            continue
        if cfg.layout == QWEN3_NEXT and spec.path[0] == "layers" and spec.path[1] not in (
                "input_layernorm", "post_attention_layernorm"):
            continue
        name = spec.path[-1]
        init = norm_init if name == "scale" else ("zeros" if name in ("bias", "e_score_correction_bias") else "normal")
        rows.append(MtpWeight((groups[spec.path[0]],) + spec.path[1:],
                              layer_prefix + spec.hf_name[len("model.layers.{i}."):], spec.shape[1:], spec.axes[1:],
                              spec.transpose, init, spec.dtype, spec.expert_stacked))
    return own + rows


def init_params(cfg: MtpConfig, key: jax.Array, *, std: float = 0.02, dtype=jnp.float32) -> dict:
    """The layer initialised as the target's layers are (HF init): normal(0, std) matrices, norm
    scales at their identity (ones; zeros for Qwen's (1 + w) norms), zero biases."""
    table = mtp_weights(cfg)
    keys = jax.random.split(key, len(table))
    out = []
    for w, k in zip(table, keys):
        dt = jnp.dtype(w.dtype) if w.dtype else dtype
        if w.init == "normal":
            out.append((w.path, (std * jax.random.normal(k, w.shape, jnp.float32)).astype(dt)))
        else:
            out.append((w.path, (jnp.ones if w.init == "ones" else jnp.zeros)(w.shape, dt)))
    return nest(out)


def param_logical_axes(cfg: MtpConfig) -> dict:
    return nest((w.path, w.axes) for w in mtp_weights(cfg))


def config_to_dict(cfg: MtpConfig) -> dict:
    return {"target_config": cfg.target.to_hf(), "num_steps": cfg.num_steps, "step_weight_beta": cfg.step_weight_beta}


def config_from_dict(d: dict) -> MtpConfig:
    hf = dict(d["target_config"])
    target = get_target_class(hf).config_class.from_hf(hf)
    return MtpConfig(target=target, num_steps=int(d["num_steps"]), step_weight_beta=float(d["step_weight_beta"]))


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------
def stacked(tree):
    """A one-layer stack (leading axis 1) of a layer's params, as the target's stacked-layer code reads them."""
    return jax.tree.map(lambda a: a[None], tree)


def block(params: dict, cfg: MtpConfig, x_btd, inputs, cache=None):
    """The target's decoder layer (its own block code) over x: (h', cache). `inputs` is the target's
    StackInputs (forward: its segment-causal mask and RoPE; decoding: the cache mask, slots, RoPE);
    `cache` a one-layer cache of the target's kind (row 0) or None."""
    tc = cfg.target
    if cfg.layout == DEEPSEEK:
        layer = glm4_moe.decoder_layer if isinstance(tc, glm4_moe.Glm4MoeTargetConfig) else deepseek_v3.decoder_layer
        return layer(params["block"], tc, x_btd, inputs, deepseek_v3.moe_ffn(params["ffn"], tc), cache, 0)
    moe = tc.is_moe(0)
    ffn_params = {"moe_layers" if moe else "mlp_layers": stacked(params["ffn"])}
    attn = {"self_attn": stacked(params["self_attn"])}
    scales = (params["block"]["input_layernorm"]["scale"], params["block"]["post_attention_layernorm"]["scale"])

    def mix(h):
        return qwen3_next.mixer(qwen3_next.FULL, attn, tc, h, inputs, cache, 0)

    return qwen3_next.decoder_layer(ffn_params, tc, x_btd, scales, mix, moe, 0, {moe})


def layer_norm(cfg: MtpConfig, x, scale):
    if cfg.layout == QWEN3_NEXT:
        return qwen3_next.norm(x, scale, cfg.target)
    return rms_norm(x, scale, cfg.target.rms_norm_eps)


def fuse(params: dict, cfg: MtpConfig, emb_btd, hidden_btd):
    """The layer's input u [B, T, H]: the projection of the normed (embedding, hidden) pair."""
    if cfg.layout == DEEPSEEK:
        e, h, proj = params["enorm"], params["hnorm"], params["eh_proj"]
    else:
        e, h, proj = params["pre_fc_norm_embedding"], params["pre_fc_norm_hidden"], params["fc"]
    cat = jnp.concatenate([layer_norm(cfg, emb_btd, e["scale"]), layer_norm(cfg, hidden_btd.astype(emb_btd.dtype),
                                                                             h["scale"])], axis=-1)
    return jnp.einsum("...i,io->...o", cat, proj["kernel"].astype(cat.dtype))


def recycles_normed(cfg: MtpConfig) -> bool:
    """Whether the next draft step reads the normed output (DeepSeek-V3, Qwen) or the pre-norm one (GLM)."""
    return not isinstance(cfg.target, glm4_moe.Glm4MoeTargetConfig)


def mtp_step(params: dict, cfg: MtpConfig, emb_btd, hidden_btd, inputs, cache=None):
    """One MTP application: (the next step's hidden, the lm_head's input, cache)."""
    out, cache = block(params, cfg, fuse(params, cfg, emb_btd, hidden_btd), inputs, cache)
    final = params["shared_head_norm"] if cfg.layout == DEEPSEEK else params["norm"]
    normed = layer_norm(cfg, out, final["scale"])
    return (normed if recycles_normed(cfg) else out), normed, cache


def masks_first_position(cfg: MtpConfig) -> bool:
    """vLLM's DeepSeek and GLM MTP layers zero the embedding of the row at position 0."""
    return cfg.layout == DEEPSEEK


def logits_of(h_btd, lm_head_vd, softcap=None):
    logits = jnp.einsum("btd,vd->btv", h_btd.astype(jnp.float32), lm_head_vd.astype(jnp.float32))
    return logits if softcap is None else softcap * jnp.tanh(logits / softcap)


CE_ROWS = 512  # token rows per chunk of token_ce: a [512, V] fp32 logits block at a time (V = 248k: 0.5 GB)


def token_ce(h_btd, lm_head_vd, labels_bt, softcap=None, rows: int = CE_ROWS):
    """(cross-entropy [B, T], argmax [B, T]) of the logits h @ lm_head^T against `labels`, formed `rows`
    token rows at a time and recomputed in the backward (jax.checkpoint), so a full-vocab [B, T, V] fp32
    logits tensor never exists (the target's vocab: 248k for Qwen3.5, 129k for DeepSeek)."""
    B, T, D = h_btd.shape
    n = B * T
    c = min(int(rows), n)
    pad = (-n) % c
    h = jnp.pad(h_btd.reshape(n, D), ((0, pad), (0, 0)))
    lab = jnp.pad(labels_bt.reshape(n).astype(jnp.int32), (0, pad))

    @jax.checkpoint
    def chunk(args):
        hc, lc = args
        logits = logits_of(hc[None], lm_head_vd, softcap)[0]
        ce = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, lc[:, None], axis=-1)[:, 0]
        return ce, jnp.argmax(logits, -1).astype(jnp.int32)

    ce, am = jax.lax.map(chunk, (h.reshape(-1, c, D), lab.reshape(-1, c)))
    return ce.reshape(-1)[:n].reshape(B, T), am.reshape(-1)[:n].reshape(B, T)


def forward_inputs(cfg: MtpConfig, input_ids, positions, segment_ids, dtype):
    """The target decoder's own per-call inputs (mask, RoPE, segments) for the training forward."""
    return get_target_class(cfg.target.architecture).decoder.forward_inputs(cfg.target, input_ids, positions,
                                                                             segment_ids, dtype)


def shift_left(x, n: int, fill=0):
    pad = jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def cast_params(params: dict, cfg: MtpConfig, dtype) -> dict:
    """Every leaf in `dtype` except those the target keeps in a fixed dtype (DeepSeek's fp32 router)."""
    fixed = {w.path: w.dtype for w in mtp_weights(cfg) if w.dtype}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    out = []
    for kp, x in flat:
        path = tuple(k.key for k in kp)
        out.append((path, x.astype(fixed.get(path, dtype))))
    return nest(out)


def mtp_forward(params: dict, cfg: MtpConfig, *, input_ids, positions, segment_ids, final_hidden, embed_table,
                compute_dtype=jnp.float32, num_steps: Optional[int] = None):
    """The teacher-forced steps: a list of K lm_head inputs [B, T, H] (row t of step k predicts
    x_{t+k+2}). `final_hidden` [B, T, H] is the target's state after its final norm."""
    sg = jax.lax.stop_gradient
    inputs = forward_inputs(cfg, input_ids, positions, segment_ids, compute_dtype)
    hidden = sg(final_hidden).astype(compute_dtype)
    ids = input_ids.astype(jnp.int32)
    outs = []
    for k in range(num_steps or cfg.num_steps):
        emb = sg(jnp.take(embed_table, shift_left(ids, k + 1), axis=0)).astype(compute_dtype)
        if k == 0 and masks_first_position(cfg):
            emb = jnp.where((positions == 0)[..., None], jnp.zeros((), emb.dtype), emb)
        hidden, normed, _ = mtp_step(params, cfg, emb, hidden, inputs)
        outs.append(normed)
    return outs


def mtp_loss(params: dict, cfg: MtpConfig, *, input_ids, loss_mask, segment_ids, positions, final_hidden, embed_table,
             lm_head, compute_dtype=jnp.float32, logit_softcap: Optional[float] = None):
    """(loss, metrics) of one packed batch (the module doc's loss)."""
    if not hasattr(final_hidden, "shape"):
        raise ValueError("draft.type=mtp reads the target's final hidden state; a state cache with a top-k teacher "
                         "(precompute.teacher_top_k > 0) does not hold it. Fix: build the cache with "
                         "precompute.teacher_top_k=0")
    sg = jax.lax.stop_gradient
    params = cast_params(params, cfg, compute_dtype)
    outs = mtp_forward(params, cfg, input_ids=input_ids, positions=positions, segment_ids=segment_ids,
                       final_hidden=final_hidden, embed_table=embed_table, compute_dtype=compute_dtype)
    ids = input_ids.astype(jnp.int32)
    seg = segment_ids.astype(jnp.int32)
    total = jnp.zeros((), jnp.float32)
    accs, counts, losses = [], [], []
    for k, (w, h) in enumerate(zip(step_weights(cfg.step_weight_beta, cfg.num_steps), outs)):
        labels = shift_left(ids, k + 2)
        ce, pred = token_ce(h, sg(lm_head), labels, logit_softcap)
        rows = (shift_left(loss_mask.astype(jnp.float32), k + 2) * (shift_left(seg, k + 2, fill=-1) == seg)
                * (seg > 0)).astype(jnp.float32)
        n = jnp.maximum(jnp.sum(rows), 1.0)
        step = jnp.sum(ce * rows) / n
        total = total + w * step
        losses.append(sg(step))
        accs.append(sg(jnp.sum((pred == labels) * rows) / n))
        counts.append(jnp.sum(rows))
    acc = jnp.stack(accs)
    metrics = {"loss": total, "acc_k": acc, "loss_k": jnp.stack(losses), "mask_tokens_k": jnp.stack(counts),
               "tau_sim": 1.0 + jnp.sum(jnp.cumprod(acc))}
    return total, metrics


# ---------------------------------------------------------------------------------------------
# speculative decoding (specjax.eval): the layer over a one-layer cache of the target's kind
# ---------------------------------------------------------------------------------------------
def init_decode_cache(cfg: MtpConfig, max_len: int, dtype):
    """One row's cache for the MTP layer: DeepSeek-V3's latent cache, else a KV cache, with one layer."""
    tc = cfg.target
    if cfg.layout == DEEPSEEK and not isinstance(tc, glm4_moe.Glm4MoeTargetConfig):
        return mla.init_cache(1, 1, max_len, tc.mla, dtype)
    return decoding.init_kv_cache(1, 1, max_len, tc.num_key_value_heads, tc.head_dim, dtype)


def decode_inputs(cfg: MtpConfig, cache, positions_bt, slots_bt, mask_bts, dtype):
    """StackInputs for rows written at `slots` attending per `mask` over the one-layer cache."""
    tc = cfg.target
    rope_dim = tc.qk_rope_head_dim if cfg.layout == DEEPSEEK and not isinstance(
        tc, glm4_moe.Glm4MoeTargetConfig) else tc.head_dim
    return StackInputs(mask_bts, rope_tables(tc.rope, rope_dim, positions_bt, dtype), slots=slots_bt)


def cache_slots(cache) -> int:
    return (cache["kv"] if "kv" in cache else cache["k"]).shape[2]


def uniform_dtype(dp):
    dt = jax.tree.leaves(dp)[0].dtype
    return jax.tree.map(lambda a: a.astype(dt), dp), dt


def draft_logits(dp, h_btd):
    return logits_of(h_btd, dp["target_lm_head"])


@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("dcache",))
def draft_chain(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, key, temperature, *, dcfg, k, sample):
    """K draft tokens from the one layer applied K times (vLLM's chain with num_nextn_predict_layers 1):
    the pending rows (tokens x_{t+1}, the target's final hidden at t) are written from slot `start`;
    each later step reads the previous step's next-step hidden and token. (target ids [K], draft
    probabilities [K, V] when sampling else [K, 1] zeros, cache)."""
    dp, dt = uniform_dtype(dp)
    (hidden,) = pend_aux
    tp = pend_tok.shape[1]
    pos = start + jnp.arange(tp, dtype=jnp.int32)[None, :]
    emb = jnp.take(embed, pend_tok, axis=0).astype(dt)
    if masks_first_position(dcfg):
        emb = jnp.where((pos == 0)[..., None], jnp.zeros((), dt), emb)
    causal = jnp.tril(jnp.ones((tp, tp), bool))[None]
    mask = cache_attention_mask(jnp.reshape(start, (1,)), cache_slots(dcache), causal)
    params = {n: v for n, v in dp.items() if n != "target_lm_head"}
    h, normed, dcache = mtp_step(params, dcfg, emb, hidden.astype(dt), decode_inputs(dcfg, dcache, pos, pos, mask, dt),
                                 dcache)
    h = jax.lax.dynamic_index_in_dim(h, pend_count - 1, axis=1, keepdims=True)
    normed = jax.lax.dynamic_index_in_dim(normed, pend_count - 1, axis=1, keepdims=True)
    toks, qs = [], []
    for j in range(k):
        logits = draft_logits(dp, normed)[:, 0]
        d, key = chain_draw(logits, key, temperature, sample, qs)
        tok = (d + d2t[d]).astype(jnp.int32)
        toks.append(tok[0])
        if j == k - 1:
            break
        slot = start + pend_count + j
        pos1 = jnp.reshape(slot, (1, 1))
        mask1 = (jnp.arange(cache_slots(dcache)) <= slot)[None, None, :]
        h, normed, dcache = mtp_step(params, dcfg, jnp.take(embed, tok, axis=0).astype(dt)[None], h,
                                     decode_inputs(dcfg, dcache, pos1, pos1, mask1, dt), dcache)
    q = jnp.stack(qs) if sample else jnp.zeros((k, 1), jnp.float32)
    return jnp.stack(toks), q, dcache


# ---------------------------------------------------------------------------------------------
# the checkpoint's MTP tensors
# ---------------------------------------------------------------------------------------------
def file_tensor_names(cfg: MtpConfig) -> list[str]:
    """Every tensor name the layer has in the target checkpoint (experts spelled out)."""
    out = []
    for w in mtp_weights(cfg):
        if w.expert_stacked:
            out += [w.file_name.replace("{e}", str(e)) for e in range(w.shape[0])]
        else:
            out.append(w.file_name)
    return out


def params_from_file_tensors(cfg: MtpConfig, get: Callable[[str], np.ndarray]) -> dict:
    """The param tree of the checkpoint's tensors (`get(name)` -> array; HF [out, in] transposed)."""
    out = []
    for w in mtp_weights(cfg):
        def one(name):
            a = np.asarray(get(name), np.float32)
            return a.T if w.transpose else a
        arr = np.stack([one(w.file_name.replace("{e}", str(e))) for e in range(w.shape[0])]) if w.expert_stacked \
            else one(w.file_name)
        if arr.shape != tuple(w.shape):
            raise ValueError(f"MTP tensor {w.file_name}: shape {arr.shape} in the checkpoint, expected {tuple(w.shape)} "
                             "(specjax layout) from the target's config")
        out.append((w.path, arr))
    return nest(out)


def file_tensors_of_params(params: dict, cfg: MtpConfig, np_dtype) -> dict[str, np.ndarray]:
    """The checkpoint-named tensors of the param tree (inverse of params_from_file_tensors)."""
    out = {}
    for w in mtp_weights(cfg):
        arr = np.asarray(leaf(params, w.path), np.float32)
        if arr.shape != tuple(w.shape):
            raise ValueError(f"MTP export: {'.'.join(w.path)} has shape {arr.shape}, expected {tuple(w.shape)}")
        parts = [(w.file_name.replace("{e}", str(e)), arr[e]) for e in range(w.shape[0])] if w.expert_stacked \
            else [(w.file_name, arr)]
        for name, a in parts:
            out[name] = np.ascontiguousarray((a.T if w.transpose else a).astype(np_dtype))
    return out

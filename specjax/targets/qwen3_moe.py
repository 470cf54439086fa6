"""Qwen3-MoE frozen target (``Qwen3MoeForCausalLM``) in plain JAX.

Read top to bottom: config -> HF weight map -> blocks (router, feed-forwards) -> forward -> cached
decoding -> Target class.

Layout (transformers' Qwen3MoeForCausalLM): Qwen3 attention (GQA, per-head q/k RMSNorm before RoPE,
explicit head_dim, no biases) in every layer; the feed-forward of layer i is
  * a sparse MoE block when ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``
    (and num_experts > 0): softmax router over the experts (fp32), top-k, optionally renormalised
    over the k picks (``norm_topk_prob``), then the k SwiGLU experts weighted by those probabilities.
    No shared expert (that is Qwen2-MoE).
  * otherwise a dense SwiGLU MLP of width ``intermediate_size``.

Params: attention and norms of all L layers are stacked under ``layers`` (same names as the Llama
target); the MoE layers' router and experts are stacked under ``moe_layers`` as [Lm, ...] and
[Lm, E, ...]; dense-MLP layers (if any) under ``mlp_layers`` as [Ld, ...]. A static per-layer
schedule maps layer i to its slot in one of the two stacks.

On disk transformers 5 writes one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, ...), even
though it fuses them in memory; the weight map reads that layout into the stacked [Lm, E, ...] leaves.
Expert dispatch goes through ``specjax_kernels.moe`` (grouped GEMMs over expert-sorted tokens).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from specjax_kernels.moe import moe_experts

from specjax.targets.base import Target, WeightSpec, resolve_hf_config, validate_aux_layer_ids
from specjax.targets.layers.attention import AttentionConfig, attention_block, attention_inputs
from specjax.targets.layers.decoding import chunk_inputs, init_kv_cache, picked_logits
from specjax.targets.layers.mlp import swiglu_mlp
from specjax.targets.layers.norms import rms_norm
from specjax.targets.layers.rope import RopeSpec, inverse_frequencies, rope_cos_sin, rope_spec_from_hf
from specjax.targets.layers.scan import index_layer, layer_scan, scan_at_taps
from specjax.targets.llama import embed_table, lm_head_weight  # same embedding / lm_head layout
from specjax.targets.registry import register

ARCH = "Qwen3MoeForCausalLM"


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class Qwen3MoeTargetConfig:
    """Hashable subset of the HF Qwen3MoeConfig that the forward needs (plus runtime knobs)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense-MLP layers (mlp_only_layers / decoder_sparse_step)
    moe_intermediate_size: int  # each expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    rope: RopeSpec = RopeSpec()
    # Runtime options, not part of the HF config.
    attention_q_block: int = 0  # see LlamaTargetConfig
    attention_implementation: str = "auto"  # runtime option, see LlamaTargetConfig
    decode_attention_implementation: str = "auto"  # runtime option, see LlamaTargetConfig
    moe_implementation: str = "auto"  # specjax_kernels.moe implementation (reference | xla | auto)

    qk_norm = True

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig.of(self, qk_norm=self.qk_norm)

    def is_moe(self, layer: int) -> bool:
        """transformers' Qwen3MoeDecoderLayer rule for a sparse (MoE) feed-forward."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe(i))

    @property
    def mlp_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe(i))

    def slot(self, layer: int) -> int:
        """Index of ``layer`` inside its stack (moe_layers or mlp_layers)."""
        ids = self.moe_layer_ids if self.is_moe(layer) else self.mlp_layer_ids
        return ids.index(layer)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "Qwen3MoeTargetConfig":
        hf, arch = resolve_hf_config(hf, (ARCH,), "Qwen3MoeTargetConfig",
                                     unsupported_flags=("attention_bias",), silu_keys=("hidden_act",))
        if hf.get("use_sliding_window"):
            raise ValueError(f"{ARCH} with use_sliding_window=true is not supported (full attention only)")
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError(
                f"{ARCH} has no shared expert but the config sets shared_expert_intermediate_size; "
                "is this a Qwen2-MoE checkpoint (Qwen2MoeForCausalLM, not supported)?"
            )
        heads = int(hf["num_attention_heads"])
        # config.json from transformers 5 spells the expert count num_local_experts (attribute_map);
        # Qwen's own checkpoints use num_experts.
        n_experts = hf.get("num_experts", hf.get("num_local_experts"))
        if n_experts is None:
            raise ValueError(f"{ARCH} config has neither num_experts nor num_local_experts")
        kw = dict(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            num_experts=int(n_experts),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(int(i) for i in (hf.get("mlp_only_layers") or ())),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            rope=rope_spec_from_hf(hf),
        )
        kw.update(overrides)
        cfg = cls(**kw)
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        if cfg.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={cfg.decoder_sparse_step} must be >= 1")
        if cfg.moe_layer_ids and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(
                f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..num_experts={cfg.num_experts}"
            )
        bad = [i for i in cfg.mlp_only_layers if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers {bad} outside 0..{cfg.num_hidden_layers - 1}")
        return cfg


# =============================================================================================
# HF weight map. "{i}" rows are stacked on a leading layer axis (only over `layer_ids` when given);
# "{e}" rows also stack experts on a second axis. transpose=True: HF [out, in] <-> kernel [in, out].
# =============================================================================================
def weight_specs(cfg: Qwen3MoeTargetConfig) -> list[WeightSpec]:
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    E, F, I = cfg.num_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    Lm, Ld = len(cfg.moe_layer_ids), len(cfg.mlp_layer_ids)
    q_dim, kv_dim, hd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim
    p = "model.layers.{i}."
    rows = [
        # hf name                               specjax path                                         T?     shape             logical axes
        ("model.embed_tokens.weight",           ("embed_tokens", "embedding"),                       False, (V, D),           ("vocab", "embed")),
        (p + "input_layernorm.weight",          ("layers", "input_layernorm", "scale"),              False, (L, D),           ("layers", "norm")),
        (p + "self_attn.q_proj.weight",         ("layers", "self_attn", "q_proj", "kernel"),         True,  (L, D, q_dim),    ("layers", "embed", "heads")),
        (p + "self_attn.k_proj.weight",         ("layers", "self_attn", "k_proj", "kernel"),         True,  (L, D, kv_dim),   ("layers", "embed", "kv_heads")),
        (p + "self_attn.v_proj.weight",         ("layers", "self_attn", "v_proj", "kernel"),         True,  (L, D, kv_dim),   ("layers", "embed", "kv_heads")),
        (p + "self_attn.o_proj.weight",         ("layers", "self_attn", "o_proj", "kernel"),         True,  (L, q_dim, D),    ("layers", "heads", "embed")),
        (p + "self_attn.q_norm.weight",         ("layers", "self_attn", "q_norm", "scale"),          False, (L, hd),          ("layers", "head_dim")),
        (p + "self_attn.k_norm.weight",         ("layers", "self_attn", "k_norm", "scale"),          False, (L, hd),          ("layers", "head_dim")),
        (p + "post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale"),     False, (L, D),           ("layers", "norm")),
        # MoE layers only (layer_ids = cfg.moe_layer_ids)
        (p + "mlp.gate.weight",                 ("moe_layers", "router", "kernel"),                  True,  (Lm, D, E),       ("layers", "embed", None)),
        (p + "mlp.experts.{e}.gate_proj.weight", ("moe_layers", "experts", "gate_proj", "kernel"),   True,  (Lm, E, D, F),    ("layers", "experts", "embed", "expert_mlp")),
        (p + "mlp.experts.{e}.up_proj.weight",  ("moe_layers", "experts", "up_proj", "kernel"),      True,  (Lm, E, D, F),    ("layers", "experts", "embed", "expert_mlp")),
        (p + "mlp.experts.{e}.down_proj.weight", ("moe_layers", "experts", "down_proj", "kernel"),   True,  (Lm, E, F, D),    ("layers", "experts", "expert_mlp", "embed")),
        # dense-MLP layers only (layer_ids = cfg.mlp_layer_ids)
        (p + "mlp.gate_proj.weight",            ("mlp_layers", "gate_proj", "kernel"),               True,  (Ld, D, I),       ("layers", "embed", "mlp")),
        (p + "mlp.up_proj.weight",              ("mlp_layers", "up_proj", "kernel"),                 True,  (Ld, D, I),       ("layers", "embed", "mlp")),
        (p + "mlp.down_proj.weight",            ("mlp_layers", "down_proj", "kernel"),               True,  (Ld, I, D),       ("layers", "mlp", "embed")),
        ("model.norm.weight",                   ("norm", "scale"),                                   False, (D,),             ("norm",)),
        ("lm_head.weight",                      ("lm_head", "kernel"),                               True,  (D, V),           ("embed", "vocab")),
    ]
    specs = []
    for hf_name, path, transpose, shape, axes in rows:
        layer_ids = {"moe_layers": cfg.moe_layer_ids, "mlp_layers": cfg.mlp_layer_ids}.get(path[0])
        if layer_ids is not None and not layer_ids:
            continue  # e.g. no dense-MLP layers at all (Qwen3-30B-A3B)
        if path[0] == "lm_head" and cfg.tie_word_embeddings:
            continue
        specs.append(WeightSpec(hf_name, path, transpose, shape, axes, layer_ids=layer_ids))
    return specs


# =============================================================================================
# Blocks: router, MoE and dense feed-forwards (attention: layers/attention.attention_block)
# =============================================================================================
def route(h_td, router_de, cfg: Qwen3MoeTargetConfig):
    """Softmax router (fp32) -> top-k expert ids [T, k] and weights [T, k] (in h's dtype)."""
    logits = h_td @ router_de
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights.astype(h_td.dtype)


def _moe_ffn(mp: dict, cfg: Qwen3MoeTargetConfig, h_btd):
    b, t, d = h_btd.shape
    h = h_btd.reshape(b * t, d)
    ids, weights = route(h, mp["router"]["kernel"], cfg)
    ex = mp["experts"]
    out = moe_experts(
        h, ids, weights, up_edf=ex["up_proj"]["kernel"], down_efd=ex["down_proj"]["kernel"],
        gate_edf=ex["gate_proj"]["kernel"], activation="silu", implementation=cfg.moe_implementation,
    )
    return out.reshape(b, t, d)


def _dense_ffn(mp: dict, h_btd):
    return swiglu_mlp(h_btd, mp["gate_proj"]["kernel"], mp["up_proj"]["kernel"], mp["down_proj"]["kernel"])


# =============================================================================================
# Forward
# =============================================================================================
def _run_layers(params: dict, cfg: Qwen3MoeTargetConfig, x_btd, layers: Sequence[int], rope, mask, *,
                cache: dict | None = None, slots_bt=None):
    """Apply decoder ``layers`` (consecutive ids) with one lax.scan over a static schedule:
    (new x, new cache or None).

    Each step reads its attention weights from ``layers`` and its feed-forward from the MoE or the
    dense stack at the scheduled slot. A segment with only one kind calls that kind directly; a
    mixed segment (interleaved MoE / dense layers) picks per layer with ``lax.cond``. ``cache`` /
    ``slots_bt``: cached decoding (layer i writes cache row i; see layers/attention.attention_block).
    """
    kinds = {cfg.is_moe(i) for i in layers}
    xs = (
        np.asarray(layers, np.int32),
        np.asarray([cfg.slot(i) for i in layers], np.int32),
        np.asarray([cfg.is_moe(i) for i in layers]),
    )

    def ffn(h, slot, is_moe):
        moe = lambda h, s: _moe_ffn(index_layer(params["moe_layers"], s), cfg, h)  # noqa: E731
        dense = lambda h, s: _dense_ffn(index_layer(params["mlp_layers"], s), h)  # noqa: E731
        if kinds == {True}:
            return moe(h, slot)
        if kinds == {False}:
            return dense(h, slot)
        return jax.lax.cond(is_moe, moe, dense, h, slot)

    def step(carry, layer):
        x, c = carry
        i, slot, is_moe = layer
        lp = index_layer(params["layers"], i)
        h = rms_norm(x, lp["input_layernorm"]["scale"], cfg.rms_norm_eps)
        o, c = attention_block(lp["self_attn"], cfg.attention, h, mask, rope, cache=c, layer=i, slots_bt=slots_bt)
        x = x + o
        h = rms_norm(x, lp["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
        return x + ffn(h, slot, is_moe), c

    return layer_scan(step, (x_btd, cache), xs)


def forward(
    params: dict,
    cfg: Qwen3MoeTargetConfig,
    input_ids_bt: jax.Array,
    *,
    aux_layer_ids: Sequence[int] = (),
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, tuple]:
    """Pure forward: (final_hidden [B,T,D] after the final norm, aux tuple of [B,T,D]).

    The layer stack is split at the aux taps (one scan per span), so only the three tapped states
    are kept, never every layer's output.
    """
    aux_ids = validate_aux_layer_ids(aux_layer_ids, cfg.num_hidden_layers)
    x = jnp.take(params["embed_tokens"]["embedding"], input_ids_bt, axis=0)
    mask, rope = attention_inputs(input_ids_bt.shape, positions, segment_ids, cfg.rope, cfg.head_dim, x.dtype)

    def run_span(x, a, b):
        return _run_layers(params, cfg, x, range(a, b), rope, mask)[0]

    x, aux = scan_at_taps(run_span, x, cfg.num_hidden_layers, aux_ids)
    return rms_norm(x, params["norm"]["scale"], cfg.rms_norm_eps), aux


# =============================================================================================
# Cached decoding (generation, regeneration, speculative decoding)
# =============================================================================================
# The Llama KV cache {"k", "v"} [L, B, S, Hkv, D] (one row per decoder layer; every layer has
# attention); the feed-forwards are per token, so nothing else is cached. Layout, slot rules and
# mask: layers/attention.py "KV cache"; rollback = a shorter valid length.
def init_cache(cfg: Qwen3MoeTargetConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed KV cache for `max_len` slots per row (rounded up by ``cache_size_for``)."""
    return init_kv_cache(cfg.num_hidden_layers, batch_size, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype)


def decode_chunk(
    params: dict,
    cfg: Qwen3MoeTargetConfig,
    cache: dict,
    input_ids_bt: jax.Array,
    positions_bt: jax.Array,
    start_b: jax.Array,
    *,
    aux_layer_ids: Sequence[int] = (),
    chunk_mask_btt: jax.Array | None = None,
    valid_from_b: jax.Array | None = None,
    logits_index: jax.Array | None = None,
) -> tuple[jax.Array, tuple, jax.Array, dict]:
    """PURE cached forward of a chunk of new tokens: (fp32 logits, aux tuple [B,T,D] at
    `aux_layer_ids` (output of layer k, as :func:`forward`), final hidden [B,T,D] after the final
    norm, new cache). Arguments and shapes as ``llama.decode_chunk``; same layers and op order as
    :func:`forward` (the router sees each token alone, so a chunk routes as the full sequence does)."""
    aux_ids = validate_aux_layer_ids(aux_layer_ids, cfg.num_hidden_layers)
    start_b, mask, slots = chunk_inputs(cache, input_ids_bt, start_b, chunk_mask_btt, valid_from_b, cfg.attention)
    x = jnp.take(params["embed_tokens"]["embedding"], input_ids_bt, axis=0)
    rope = rope_cos_sin(positions_bt, inverse_frequencies(cfg.rope, cfg.head_dim), x.dtype)

    def run_span(carry, a, b):
        return _run_layers(params, cfg, carry[0], range(a, b), rope, mask, cache=carry[1], slots_bt=slots)

    (x, cache), aux = scan_at_taps(run_span, (x, cache), cfg.num_hidden_layers, aux_ids, tapped=lambda c: c[0])
    final = rms_norm(x, params["norm"]["scale"], cfg.rms_norm_eps)
    return picked_logits(final, lm_head_weight(params, cfg), logits_index), aux, final, cache


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(ARCH)  # Qwen3 attention + softmax top-k routed SwiGLU experts
class Qwen3MoeTarget(Target):
    """Frozen Qwen3-MoE target (see module docstring)."""

    config_class = Qwen3MoeTargetConfig
    forward_fn = staticmethod(forward)
    embed_fn = staticmethod(embed_table)
    lm_head_fn = staticmethod(lm_head_weight)
    decode_fn, init_cache_fn = staticmethod(decode_chunk), staticmethod(init_cache)  # cached decoding

    @classmethod
    def weight_specs(cls, config: Qwen3MoeTargetConfig) -> list[WeightSpec]:
        return weight_specs(config)

    def active_params_per_token(self) -> int:
        """Parameters one token uses: everything but the E - k experts it is not routed to (the
        published "activated" count, embeddings included; Qwen3-30B-A3B: 3.3 B)."""
        total = 0
        for spec in self.weight_specs(self.config):
            n = int(np.prod(spec.shape))
            if spec.path[:2] == ("moe_layers", "experts"):
                n = n * self.config.num_experts_per_tok // self.config.num_experts
            total += n
        return total

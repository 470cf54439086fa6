"""Qwen3-MoE frozen target (``Qwen3MoeForCausalLM``) in plain JAX.

Read top to bottom: config -> HF weight map -> blocks (router, MoE feed-forward) -> layer schedule
-> Target class (the skeleton around the layers: decoder.py).

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

from specjax.layers.rope import RopeSpec, rope_spec_from_hf
from specjax.targets.base import Target, WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs, attention_ffn_block, swiglu, tap_split
from specjax.targets.hf_keys import HFKey, attention_keys, check_gqa, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers.attention import AttentionConfig
from specjax.targets.layers.scan import index_layer, layer_scan
from specjax.targets.quantized import Fp8BlockQuant, quantize_weight_specs, weight_quant_from_hf
from specjax.targets.registry import model_type_of, register

ARCH = "Qwen3MoeForCausalLM"
# config.json keys -> config fields (rope: layers/rope.py)
HF_KEYS = attention_keys(max_position_embeddings=32768) + (
    HFKey("num_hidden_layers"),
    HFKey("moe_intermediate_size"),
    HFKey("num_experts", default=lambda hf: hf["num_local_experts"]),
    HFKey("num_experts_per_tok"),
    HFKey("norm_topk_prob", bool, False),
    HFKey("decoder_sparse_step", int, 1),
    HFKey("mlp_only_layers", lambda ids: tuple(int(i) for i in ids), ()),
)


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
    weight_quant: Fp8BlockQuant | None = None  # an FP8 release's block-scaled weights (targets/quantized.py)
    kernels: KernelChoices = KernelChoices()  # runtime option (moe: the routed experts' kernel)

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
    def num_routed_experts(self) -> int:
        return self.num_experts

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
        # config.json from transformers 5 spells the expert count num_local_experts (attribute_map);
        # Qwen's own checkpoints use num_experts.
        if hf.get("num_experts", hf.get("num_local_experts")) is None:
            raise ValueError(f"{ARCH} config has neither num_experts nor num_local_experts")
        kw = dict(architecture=arch, rope=rope_spec_from_hf(hf), weight_quant=weight_quant_from_hf(hf, arch),
                  **read_hf_keys(HF_KEYS, hf))
        kw.update(overrides)
        cfg = cls(**kw)
        check_gqa(cfg)
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

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        d = {"architectures": [self.architecture], "model_type": model_type_of(self.architecture), "dtype": dtype,
             **hf_values(HF_KEYS, self), "rope_parameters": self.rope.to_hf(), "hidden_act": "silu",
             "attention_bias": False, "use_sliding_window": False}
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        if self.weight_quant is not None:
            d["quantization_config"] = self.weight_quant.to_hf()
        return d


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
    return quantize_weight_specs(specs, cfg.weight_quant)


# =============================================================================================
# Blocks: router and MoE feed-forward (dense: decoder.swiglu; attention: layers/attention.py)
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
        gate_edf=ex["gate_proj"]["kernel"], activation="silu", implementation=cfg.kernels.moe,
    )
    return out.reshape(b, t, d)


# =============================================================================================
# Layer schedule: attention in every layer, the feed-forward from the MoE or the dense stack
# =============================================================================================
def run_layers(params: dict, cfg: Qwen3MoeTargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """Every decoder layer, one lax.scan per span between taps over a static schedule; layer i uses
    cache row i. Each step reads its attention weights from ``layers`` and its feed-forward from the
    MoE or the dense stack at the scheduled slot. A span with only one kind calls that kind
    directly; a mixed span (interleaved MoE / dense layers) picks per layer with ``lax.cond``."""

    def run_span(carry, a, b):
        layers = range(a, b)
        kinds = {cfg.is_moe(i) for i in layers}
        xs = (
            np.asarray(layers, np.int32),
            np.asarray([cfg.slot(i) for i in layers], np.int32),
            np.asarray([cfg.is_moe(i) for i in layers]),
        )

        def ffn(h, slot, is_moe):
            moe = lambda h, s: _moe_ffn(index_layer(params["moe_layers"], s), cfg, h)  # noqa: E731
            dense = lambda h, s: swiglu(index_layer(params["mlp_layers"], s))(h)  # noqa: E731
            if kinds == {True}:
                return moe(h, slot)
            if kinds == {False}:
                return dense(h, slot)
            return jax.lax.cond(is_moe, moe, dense, h, slot)

        def step(carry, layer):
            (x, cache), (i, slot, is_moe) = carry, layer
            lp = index_layer(params["layers"], i)
            norms = (lp["input_layernorm"]["scale"], lp["post_attention_layernorm"]["scale"])
            return attention_ffn_block(lp["self_attn"], cfg, x, inputs, norms, lambda h: ffn(h, slot, is_moe),
                                       cache, i)

        return layer_scan(step, carry, xs)

    return tap_split(run_span, carry, cfg.num_hidden_layers, aux_ids)


# Cached decoding: the Llama KV cache {"k", "v"} [L, B, S, Hkv, D] (every layer has attention); the
# feed-forwards are per token (the router sees each token alone, so a chunk routes as the full
# sequence does), so nothing else is cached.
DECODER = Decoder(run_layers)


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(ARCH)  # Qwen3 attention + softmax top-k routed SwiGLU experts
class Qwen3MoeTarget(Target):
    """Frozen Qwen3-MoE target (see module docstring)."""

    config_class = Qwen3MoeTargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)

    routed_experts_path = ("moe_layers", "experts")  # Qwen3-30B-A3B: 3.3 B active

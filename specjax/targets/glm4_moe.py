"""GLM-4.x MoE frozen targets in plain JAX: ``Glm4MoeForCausalLM`` (GLM-4.5, GLM-4.5-Air, GLM-4.6,
GLM-4.7) and ``Glm4MoeLiteForCausalLM`` (GLM-4.7-Flash).

Read top to bottom: Glm4Moe (config + HF key table -> HF weight map -> layer schedule -> Target
class), then Glm4MoeLite (a config table over DeepSeek-V3's blocks).

Glm4Moe (transformers' Glm4MoeForCausalLM) is DeepSeek-V3's feed-forward under grouped-query
attention. Every layer is pre-norm attention followed by a pre-norm feed-forward:
  * attention: GQA with q/k/v biases (``attention_bias``; o_proj never has one), optional per-head
    q/k RMSNorm before RoPE (``use_qk_norm``, eps rms_norm_eps), an explicit ``head_dim``, and RoPE
    on the leading ``partial_rotary_factor`` share of each head in the half-split convention.
    transformers' Glm4MoeConfig defaults partial_rotary_factor to 0.5 when config.json names none
    (a rope-dict value wins over the top-level one), so an absent key means half-width RoPE here too.
  * feed-forward: DeepSeek-V3's, taken from ``deepseek_v3`` unchanged: a dense SwiGLU MLP in layers
    0 .. first_k_dense_replace - 1, then MoE layers with the sigmoid router (e_score_correction_bias
    for the choice only, group-limited top-k, norm_topk_prob, routed_scaling_factor; router weight
    and bias kept fp32), SwiGLU experts through ``specjax_kernels.moe`` and shared experts of width
    moe_intermediate_size * n_shared_experts. The published GLM configs use one group (n_group 1).
The checkpoints carry the multi-token-prediction layer after the decoder layers
(``num_nextn_predict_layers``: model.layers.46.* for GLM-4.5-Air, .92.* for GLM-4.5/4.6/4.7); like
transformers, the target ignores it (``DeepseekV3Target.ignored_hf_names``).

Params: attention and norms of all L layers under ``layers`` (the Llama names, plus "bias" leaves
on q/k/v_proj with attention_bias and q_norm/k_norm with use_qk_norm); the dense MLPs under
``mlp_layers`` [Ld, ...] and the MoE layers under ``moe_layers`` ([Lm, ...], experts [Lm, E, ...]),
exactly DeepSeek-V3's feed-forward leaves. Cached decoding: the Llama KV cache (every layer has
attention); the feed-forwards are per token.

Glm4MoeLite (GLM-4.7-Flash) is DeepSeek-V3's architecture: multi-head latent attention
(``layers/mla.py``) and the same MoE, read with deepseek_v3's weight map, decoder and cache. Its
config differs only in spelling and defaults: which layers are dense is ``mlp_layer_types`` (a
"dense"/"sparse" list, default one dense layer then sparse; transformers ignores
first_k_dense_replace), an absent q_lora_rank means 768, and the router defaults are one group,
x1.8. specjax accepts the layer lists whose dense layers all come first (DeepSeek's schedule).

Refused with a ValueError naming the key and the fix: quantization_config (dequantize to bf16
first), activations other than SiLU, RoPE types other than default / linear / llama3 (Glm4Moe; and
linear / llama3 only at full width) or default / yarn (Lite, full width only), DeepSeek router
switches transformers does not implement (scoring_func, topk_method, moe_layer_freq), and for the
Lite config attention_bias, num_key_value_heads != num_attention_heads, a head_dim that is not
qk_rope_head_dim and dense layers after a sparse one.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax.numpy as jnp

from specjax.layers.rope import RopeSpec, rope_spec_from_hf
from specjax.targets import deepseek_v3 as ds
from specjax.targets.base import WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs, attention_ffn_block
from specjax.targets.hf_keys import HFKey, check_gqa, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers.attention import AttentionConfig
from specjax.targets.layers.routers import check_grouped_topk
from specjax.targets.quantized import Fp8BlockQuant, quantize_weight_specs, weight_quant_from_hf
from specjax.targets.registry import model_type_of, register

ARCH = "Glm4MoeForCausalLM"
LITE_ARCH = "Glm4MoeLiteForCausalLM"
# transformers' Glm4MoeConfig: RoPE on half of each head unless config.json says otherwise
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def _head_dim(hf):
    return int(hf["hidden_size"]) // int(hf["num_attention_heads"])


def _mtp_layers(hf):
    # transformers 5 spells it num_nextn_predict_layers in config.json; num_mtp_layers is its alias
    return 1 if hf.get("num_mtp_layers") is None else hf["num_mtp_layers"]


# config.json keys <-> config fields. A key may be absent only where transformers' Glm4MoeConfig has
# a default; the default here is that one (so an absent key means what it means there).
HF_KEYS = (
    HFKey("vocab_size"),
    HFKey("hidden_size"),
    HFKey("intermediate_size"),
    HFKey("moe_intermediate_size"),
    HFKey("num_hidden_layers"),
    HFKey("num_attention_heads"),
    HFKey("num_key_value_heads", int, 8),
    HFKey("head_dim", default=_head_dim, zero_is_absent=True),
    HFKey("n_routed_experts", default=lambda hf: hf["num_local_experts"]),
    HFKey("num_experts_per_tok"),
    HFKey("n_shared_experts", int, 1),
    HFKey("n_group", int, 1),
    HFKey("topk_group", int, 1),
    HFKey("first_k_dense_replace", int, 1),
    HFKey("norm_topk_prob", bool, True),
    HFKey("routed_scaling_factor", float, 1.0),
    HFKey("attention_bias", bool, False),
    HFKey("use_qk_norm", bool, False),
    HFKey("num_nextn_predict_layers", int, _mtp_layers),
    HFKey("rms_norm_eps", float, 1e-5),
    HFKey("tie_word_embeddings", bool, False),
    HFKey("max_position_embeddings", int, 131072),
)


def _check_common(hf: Mapping[str, Any], arch: str) -> None:
    """The refusals both GLM configs share: router switches transformers ignores, no expert count
    (quantized weights: targets/quantized.py reads block-scaled FP8 and refuses the rest, e.g. the
    compressed-tensors GLM-4.x-FP8 releases)."""
    for key, want in ds.FIXED_KEYS.items():
        if hf.get(key, want) != want:
            raise ValueError(f"{arch} with {key}={hf[key]!r} is not supported: transformers' {arch} always routes "
                             f"as {key}={want!r}. Fix: set {key} to {want!r} or drop it from config.json")
    if hf.get("n_routed_experts", hf.get("num_local_experts")) is None:
        raise ValueError(f"{arch} config has neither n_routed_experts nor num_local_experts: set n_routed_experts")


# =============================================================================================
# Glm4Moe config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class Glm4MoeTargetConfig(ds.DenseThenMoeFields):
    """Hashable subset of the HF Glm4MoeConfig that the forward needs (plus runtime knobs)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int  # each routed expert (and each shared one)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    attention_bias: bool = False  # q/k/v biases (never on o_proj)
    use_qk_norm: bool = False
    num_nextn_predict_layers: int = 1  # MTP layers on disk after the decoder layers (ignored)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    rope: RopeSpec = RopeSpec(partial_rotary_factor=DEFAULT_PARTIAL_ROTARY_FACTOR)
    weight_quant: Fp8BlockQuant | None = None  # a block-scaled FP8 checkpoint (targets/quantized.py)
    kernels: KernelChoices = KernelChoices()  # runtime option (moe: the routed experts' kernel)

    @property
    def attention(self) -> AttentionConfig:
        return dataclasses.replace(AttentionConfig.of(self, qk_norm=self.use_qk_norm), bias=self.attention_bias)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "Glm4MoeTargetConfig":
        hf, arch = resolve_hf_config(hf, (ARCH,), "Glm4MoeTargetConfig", silu_keys=("hidden_act",))
        _check_common(hf, arch)
        params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if "partial_rotary_factor" not in params and hf.get("partial_rotary_factor") is None:
            hf["partial_rotary_factor"] = DEFAULT_PARTIAL_ROTARY_FACTOR  # transformers' default when unnamed
        try:
            rope = rope_spec_from_hf(hf, partial_rotary=True)
        except ValueError as e:
            raise ValueError(f"{arch}: {e}. specjax reads default RoPE (any partial_rotary_factor) and linear / "
                             "llama3 at full width; transformers' other rope types are not implemented") from None
        kw = dict(architecture=arch, rope=rope, weight_quant=weight_quant_from_hf(hf, arch), **read_hf_keys(HF_KEYS, hf))
        kw.update(overrides)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """ValueError naming the config key when the shapes or the routing cannot work."""
        check_gqa(self)
        sizes = ("head_dim", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")
        bad = [f"{k}={getattr(self, k)}" for k in sizes if getattr(self, k) < 1]
        if self.n_shared_experts < 0:
            bad.append(f"n_shared_experts={self.n_shared_experts}")
        if bad:
            raise ValueError(f"{self.architecture}: {', '.join(bad)} must be >= 1 (n_shared_experts >= 0)")
        rot = self.rope.rotary_dim(self.head_dim)
        if rot % 2 or rot < 2:
            raise ValueError(f"{self.architecture}: partial_rotary_factor={self.rope.partial_rotary_factor} of "
                             f"head_dim={self.head_dim} rotates {rot} dims; RoPE needs an even number >= 2")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(f"{self.architecture}: first_k_dense_replace={self.first_k_dense_replace} must be in "
                             f"0..num_hidden_layers={self.num_hidden_layers}")
        if self.moe_layer_ids:
            check_grouped_topk(self.n_routed_experts, self.num_experts_per_tok, self.n_group, self.topk_group,
                               self.architecture)

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        return {"architectures": [self.architecture], "model_type": model_type_of(self.architecture), "dtype": dtype,
                **hf_values(HF_KEYS, self), "rope_parameters": {"partial_rotary_factor": 1.0, **self.rope.to_hf()},
                "hidden_act": "silu", **({"quantization_config": self.weight_quant.to_hf()} if self.weight_quant else {})}


# =============================================================================================
# Glm4Moe HF weight map: GQA attention rows here, the feed-forward rows deepseek_v3's.
# "{i}" rows stack on a leading layer axis; transpose=True: HF [out, in] <-> kernel [in, out].
# =============================================================================================
def weight_specs(cfg: Glm4MoeTargetConfig) -> list[WeightSpec]:
    L, D, hd = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim
    q_dim, kv_dim = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    p, a = "model.layers.{i}.", ("layers", "self_attn")
    rows = [
        # hf name                                specjax path                                      T?     shape           logical axes
        (p + "input_layernorm.weight",           ("layers", "input_layernorm", "scale"),           False, (L, D),         ("layers", "norm")),
        (p + "self_attn.q_proj.weight",          a + ("q_proj", "kernel"),                         True,  (L, D, q_dim),  ("layers", "embed", "heads")),
        (p + "self_attn.k_proj.weight",          a + ("k_proj", "kernel"),                         True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        (p + "self_attn.v_proj.weight",          a + ("v_proj", "kernel"),                         True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        (p + "self_attn.o_proj.weight",          a + ("o_proj", "kernel"),                         True,  (L, q_dim, D),  ("layers", "heads", "embed")),
        (p + "post_attention_layernorm.weight",  ("layers", "post_attention_layernorm", "scale"),  False, (L, D),         ("layers", "norm")),
    ]
    if cfg.attention_bias:  # q/k/v only: GLM's o_proj has no bias
        rows += [
            (p + "self_attn.q_proj.bias",        a + ("q_proj", "bias"),                           False, (L, q_dim),     ("layers", "heads")),
            (p + "self_attn.k_proj.bias",        a + ("k_proj", "bias"),                           False, (L, kv_dim),    ("layers", "kv_heads")),
            (p + "self_attn.v_proj.bias",        a + ("v_proj", "bias"),                           False, (L, kv_dim),    ("layers", "kv_heads")),
        ]
    if cfg.use_qk_norm:
        rows += [
            (p + "self_attn.q_norm.weight",      a + ("q_norm", "scale"),                          False, (L, hd),        ("layers", "head_dim")),
            (p + "self_attn.k_norm.weight",      a + ("k_norm", "scale"),                          False, (L, hd),        ("layers", "head_dim")),
        ]
    attention = [WeightSpec(*row) for row in rows]
    # embedding, final norm, lm_head, dense MLPs and MoE: deepseek_v3's rows (its router rows fp32)
    return quantize_weight_specs(attention + ds.feedforward_weight_specs(cfg), cfg.weight_quant)


# =============================================================================================
# Layer schedule: dense layers, then MoE layers; layer i uses cache row i
# =============================================================================================
def attention_params(lp_attn: dict, cfg: Glm4MoeTargetConfig) -> dict:
    """One layer's attention params as layers/attention.attention_block takes them. Its ``bias``
    switch covers q/k/v and o_proj together, and GLM's o_proj has none: a zero bias stands in (adding
    zero changes nothing)."""
    if not cfg.attention_bias:
        return lp_attn
    o = lp_attn["o_proj"]
    return {**lp_attn, "o_proj": {**o, "bias": jnp.zeros(o["kernel"].shape[-1:], o["kernel"].dtype)}}


def decoder_layer(lp: dict, cfg: Glm4MoeTargetConfig, x_btd, inputs: StackInputs, ffn, cache=None, layer=None):
    """x + attn(norm(x)), then + ffn(norm(x)): (new x, new cache or None)."""
    norms = (lp["input_layernorm"]["scale"], lp["post_attention_layernorm"]["scale"])
    return attention_ffn_block(attention_params(lp["self_attn"], cfg), cfg, x_btd, inputs, norms, ffn, cache, layer)


def run_layers(params: dict, cfg: Glm4MoeTargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """deepseek_v3's schedule (dense layers, then MoE layers) around GLM's GQA layer."""
    return ds.dense_then_moe_layers(params, cfg, carry, inputs, aux_ids, decoder_layer)


# Cached decoding: the Llama KV cache {"k", "v"} [L, B, S, Hkv, head_dim] and RoPE hooks (the
# tables cover the rotary dims only; layers/rope.apply_rope passes the rest of each head through).
DECODER = Decoder(run_layers)


@register(ARCH)  # GQA (q/k/v biases, qk-norm, partial RoPE) + DeepSeek-V3's sigmoid-routed MoE
class Glm4MoeTarget(ds.DeepseekV3Target):
    """Frozen GLM-4.5 / 4.6 / 4.7 / 4.5-Air target (see module docstring): DeepSeek-V3's target with
    its attention and cache replaced (its MTP-layer rule and routed-experts path are kept)."""

    config_class = Glm4MoeTargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)


# =============================================================================================
# Glm4MoeLite (GLM-4.7-Flash): deepseek_v3's blocks under transformers' Glm4MoeLiteConfig keys
# =============================================================================================
# config.json keys <-> config fields, with Glm4MoeLiteConfig's defaults. first_k_dense_replace
# comes from mlp_layer_types (dense_prefix); q_lora_rank absent means 768 (from_hf), null a plain q_proj.
LITE_HF_KEYS = (
    HFKey("vocab_size"),
    HFKey("hidden_size"),
    HFKey("intermediate_size"),
    HFKey("moe_intermediate_size"),
    HFKey("num_hidden_layers"),
    HFKey("num_attention_heads"),
    HFKey("q_lora_rank", lambda v: None if v is None else int(v), None),
    HFKey("kv_lora_rank", int, 512),
    HFKey("qk_nope_head_dim", int, 192),
    HFKey("qk_rope_head_dim", int, 64),
    HFKey("v_head_dim", int, 256),
    HFKey("n_routed_experts", default=lambda hf: hf["num_local_experts"]),
    HFKey("num_experts_per_tok", int, 4),
    HFKey("n_shared_experts", int, 1),
    HFKey("n_group", int, 1),
    HFKey("topk_group", int, 1),
    HFKey("norm_topk_prob", bool, True),
    HFKey("routed_scaling_factor", float, 1.8),
    HFKey("rope_interleave", bool, True),
    # transformers' Glm4MoeLiteConfig has no such field; GLM-4.7-Flash's config.json sets 1
    HFKey("num_nextn_predict_layers", int, 0),
    HFKey("rms_norm_eps", float, 1e-5),
    HFKey("tie_word_embeddings", bool, False),
    HFKey("max_position_embeddings", int, 202752),
)
DEFAULT_Q_LORA_RANK = 768  # Glm4MoeLiteConfig's, when config.json has no q_lora_rank key


def dense_prefix(hf: Mapping[str, Any], arch: str) -> int:
    """How many leading layers are dense: transformers reads ``mlp_layer_types`` (default: layer 0
    dense, the rest sparse) and ignores first_k_dense_replace, so a config whose two disagree is
    refused, as is a list with a dense layer after a sparse one (DeepSeek's schedule has the dense
    layers first)."""
    n = int(hf["num_hidden_layers"])
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        kinds = ["dense"] + ["sparse"] * (n - 1)
    kinds = list(kinds)
    if len(kinds) != n or not set(kinds) <= {"dense", "sparse"}:
        raise ValueError(f"{arch}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                         f"num_hidden_layers={n} layers, got {kinds!r}")
    k = kinds.count("dense")
    if kinds != ["dense"] * k + ["sparse"] * (n - k):
        raise ValueError(f"{arch}: mlp_layer_types has a dense layer after a sparse one ({kinds!r}); specjax runs "
                         "the dense layers first (first_k_dense_replace) and does not implement other orders")
    given = hf.get("first_k_dense_replace")
    if given is not None and int(given) != k:
        raise ValueError(
            f"{arch}: first_k_dense_replace={given} but mlp_layer_types makes the first {k} layer(s) dense; "
            "transformers builds the model from mlp_layer_types (default: only layer 0 dense). Fix: make "
            "mlp_layer_types list first_k_dense_replace 'dense' entries, or drop first_k_dense_replace")
    return k


@dataclasses.dataclass(frozen=True)
class Glm4MoeLiteTargetConfig(ds.DeepseekV3TargetConfig):
    """DeepSeek-V3's config (every field and property) read from and written as a Glm4MoeLiteConfig."""

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "Glm4MoeLiteTargetConfig":
        hf, arch = resolve_hf_config(hf, (LITE_ARCH,), "Glm4MoeLiteTargetConfig", silu_keys=("hidden_act",))
        _check_common(hf, arch)
        if hf.get("attention_bias"):
            raise ValueError(f"{arch} with attention_bias=true (biases on q_a_proj, kv_a_proj_with_mqa and o_proj) "
                             "is not supported by specjax targets. Fix: a checkpoint without them "
                             "(GLM-4.7-Flash has none)")
        heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
        if kv_heads not in (None, heads):
            raise ValueError(f"{arch}: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} "
                             "(latent attention expands the shared latent into every head)")
        rope_dim = hf.get("qk_rope_head_dim", 64)
        if hf.get("head_dim") not in (None, rope_dim):
            raise ValueError(f"{arch}: head_dim={hf['head_dim']} but qk_rope_head_dim={rope_dim}; transformers "
                             "reads head_dim as another name for qk_rope_head_dim. Fix: make them equal or drop "
                             "head_dim")
        if "q_lora_rank" not in hf:
            hf["q_lora_rank"] = DEFAULT_Q_LORA_RANK
        rope = rope_spec_from_hf(hf, yarn=True)
        if rope.rope_type not in ds.ROPE_TYPES:
            raise ValueError(f"{arch} with rope type {rope.rope_type!r} is not supported (only {ds.ROPE_TYPES})")
        kw = dict(architecture=arch, rope=rope, first_k_dense_replace=dense_prefix(hf, arch),
                  weight_quant=weight_quant_from_hf(hf, arch), **read_hf_keys(LITE_HF_KEYS, hf))
        kw.update(overrides)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        kinds = ["dense" if i in self.mlp_layer_ids else "sparse" for i in range(self.num_hidden_layers)]
        return {"architectures": [self.architecture], "model_type": model_type_of(self.architecture), "dtype": dtype,
                **hf_values(LITE_HF_KEYS, self), "rope_parameters": self.rope.to_hf(), "hidden_act": "silu",
                "attention_bias": False, "num_key_value_heads": self.num_attention_heads, "mlp_layer_types": kinds,
                **({"quantization_config": self.weight_quant.to_hf()} if self.weight_quant else {})}


@register(LITE_ARCH)  # MLA + DeepSeek's sigmoid-routed MoE: DeepSeek-V3's target under GLM's config keys
class Glm4MoeLiteTarget(ds.DeepseekV3Target):
    """Frozen GLM-4.7-Flash target: deepseek_v3's weight map, decoder and latent cache."""

    config_class = Glm4MoeLiteTargetConfig

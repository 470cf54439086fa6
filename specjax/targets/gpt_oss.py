"""gpt-oss frozen target (``GptOssForCausalLM``: gpt-oss-20b / -120b) on the shared decoder.

Read top to bottom: config (+ its HF key table) -> HF weight map -> blocks (router, experts) ->
decoder layer and schedule -> Decoder hooks -> Target class.

What a gpt-oss layer is (transformers' GptOssModel):
  * pre-norm attention with biases on q/k/v/o, GQA, YaRN RoPE (``layers/rope.py``) on
    non-interleaved halves, and a learned per-head **attention sink**: one more logit in every
    softmax denominator, with no value (``layers/attention.py``; the flash kernels have no sink input,
    so attention runs the plain blocked path);
  * ``layer_types`` alternate "sliding_attention" (the last ``sliding_window`` = 128 positions) and
    "full_attention", in one scan with the kind as a scanned flag (``decoder.layer_mask``);
  * every feed-forward is a mixture of experts: router logits = h @ W + b, the top-k logits
    softmaxed (so the k weights sum to 1), each expert a clamped SwiGLU with biases:
    gate = min(g, limit), up = clip(u, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate), then
    the down projection + bias. Experts go through ``specjax_kernels.moe`` (gate columns first: the
    checkpoint interleaves gate and up columns; the weight map de-interleaves them at load,
    ``WeightSpec.deinterleave``);
  * RMSNorms multiply by the weight in fp32 and cast after (``layers/norms.py`` ``weight_in_fp32``).

Checkpoints, two layouts:
  * bf16 (what transformers writes): ``mlp.experts.gate_up_proj`` [E, D, 2F] with its bias,
    ``down_proj`` [E, F, D] with its bias, ``mlp.router.weight``/``bias``, ``self_attn.sinks``;
  * MXFP4 experts as OpenAI publishes them (config.json ``quantization_config.quant_method:
    "mxfp4"``): ``gate_up_proj_blocks`` [E, 2F, D/32, 16] uint8 + ``_scales`` [E, 2F, D/32] and the
    same for ``down_proj`` ([E, D, F/32, ...]); everything else bf16. These stay MXFP4 in device
    memory (4.25 bits a weight: gpt-oss-120b's experts take ~61 GB instead of ~230) and each layer's
    experts are dequantized inside the layer scan (``specjax_kernels.quant``) right before the grouped
    GEMMs, so no bf16 copy of the whole target exists.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import numpy as np
from specjax_kernels.moe import moe_experts
from specjax_kernels.quant import mxfp4_dequantize

from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, rope_spec_from_hf, rope_tables
from specjax.targets.base import Target, WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs, layer_mask, mixed_window_decode_masks
from specjax.targets.hf_keys import HFKey, attention_keys, check_gqa, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers.attention import AttentionConfig, attention_block, segment_causal_mask
from specjax.targets.layers.routers import router_logits, topk_softmax
from specjax.targets.layers.scan import index_layer, scan_layers
from specjax.targets.registry import model_type_of, register

GPT_OSS_ARCHS = ("GptOssForCausalLM",)
SLIDING, FULL = "sliding_attention", "full_attention"
# config.json keys <-> config fields (rope: layers/rope.py; layer_types below)
HF_KEYS = attention_keys(max_position_embeddings=131072) + (
    HFKey("num_hidden_layers"),
    HFKey("num_local_experts", field="num_experts"),
    HFKey("num_experts_per_tok"),
    HFKey("sliding_window", int, 128),
    HFKey("swiglu_alpha", float, 1.702),
    HFKey("swiglu_limit", float, 7.0),
)
EXPERT_FORMATS = ("bf16", "mxfp4")  # how the checkpoint stores (and the device keeps) the expert weights


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    types = tuple(hf.get("layer_types") or (SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)))
    bad = sorted(set(types) - {SLIDING, FULL})
    if bad or len(types) != num_layers:
        raise ValueError(f"layer_types must list {num_layers} entries of {SLIDING!r} / {FULL!r}; got {list(types)}")
    return types


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class GptOssTargetConfig:
    """Hashable subset of transformers' GptOssConfig that the forward needs (plus runtime knobs)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each expert's width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    sliding_window: int = 128
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    rope: RopeSpec = RopeSpec()
    expert_format: str = "bf16"  # EXPERT_FORMATS; from config.json's quantization_config
    kernels: KernelChoices = KernelChoices()  # runtime option (moe: the routed experts' kernel)

    @property
    def model_type(self) -> str:
        return model_type_of(self.architecture)

    @property
    def attention(self) -> AttentionConfig:
        return dataclasses.replace(AttentionConfig.of(self), bias=True, sinks=True)

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        return tuple(t == SLIDING for t in self.layer_types)

    @property
    def num_routed_experts(self) -> int:
        return self.num_experts

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "GptOssTargetConfig":
        """From an HF config dict (config.json contents, or ``PretrainedConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, GPT_OSS_ARCHS, "GptOssTargetConfig", silu_keys=("hidden_act",))
        if hf.get("attention_bias") is False:
            raise ValueError(f"{arch} with attention_bias=false: gpt-oss checkpoints have q/k/v/o biases; "
                             f"this config describes another model")
        keys = read_hf_keys(HF_KEYS, hf)
        kw = dict(architecture=arch, rope=rope_spec_from_hf(hf, yarn=True), expert_format=_expert_format(hf, arch),
                  layer_types=_layer_types(hf, keys["num_hidden_layers"]), **keys)
        kw.update(overrides)
        cfg = cls(**kw)
        check_gqa(cfg)
        if cfg.expert_format == "mxfp4" and (cfg.hidden_size % 32 or cfg.intermediate_size % 32):
            raise ValueError(f"{arch} MXFP4 experts need hidden_size and intermediate_size divisible by 32 (groups "
                             f"of 32 values); got {cfg.hidden_size} and {cfg.intermediate_size}")
        if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..num_local_experts="
                             f"{cfg.num_experts}")
        return cfg

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        d = {"architectures": [self.architecture], "model_type": self.model_type, **hf_values(HF_KEYS, self),
             "layer_types": list(self.layer_types), "rope_parameters": self.rope.to_hf(), "hidden_act": "silu",
             "attention_bias": True, "use_cache": True, "dtype": dtype}
        if self.expert_format == "mxfp4":
            d["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": list(MXFP4_NOT_CONVERTED)}
        return d


# what OpenAI's gpt-oss config.json lists as left unquantized (everything but the experts)
MXFP4_NOT_CONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")


def _expert_format(hf: Mapping[str, Any], arch: str) -> str:
    q = hf.get("quantization_config")
    if not q:
        return "bf16"
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    if method != "mxfp4":
        raise ValueError(f"{arch}: quantization_config.quant_method={method!r} is not supported; gpt-oss targets "
                         f"load bf16 checkpoints or OpenAI's MXFP4 experts (quant_method 'mxfp4')")
    return "mxfp4"


# =============================================================================================
# HF weight map ("{i}" rows stacked on a leading layer axis; expert tensors hold all experts)
# =============================================================================================
def weight_specs(cfg: GptOssTargetConfig) -> list[WeightSpec]:
    L, D, V, H = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    E, F = cfg.num_experts, cfg.intermediate_size
    q_dim, kv_dim = H * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    p = "model.layers.{i}."
    attn = ("layers", "self_attn")
    ex = ("layers", "experts")
    rows = [
        # hf name                              specjax path                          T?     shape           logical axes
        ("model.embed_tokens.weight",          ("embed_tokens", "embedding"),        False, (V, D),         ("vocab", "embed")),
        (p + "input_layernorm.weight",         ("layers", "input_layernorm", "scale"), False, (L, D),       ("layers", "norm")),
        (p + "self_attn.q_proj.weight",        attn + ("q_proj", "kernel"),          True,  (L, D, q_dim),  ("layers", "embed", "heads")),
        (p + "self_attn.q_proj.bias",          attn + ("q_proj", "bias"),            False, (L, q_dim),     ("layers", "heads")),
        (p + "self_attn.k_proj.weight",        attn + ("k_proj", "kernel"),          True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        (p + "self_attn.k_proj.bias",          attn + ("k_proj", "bias"),            False, (L, kv_dim),    ("layers", "kv_heads")),
        (p + "self_attn.v_proj.weight",        attn + ("v_proj", "kernel"),          True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        (p + "self_attn.v_proj.bias",          attn + ("v_proj", "bias"),            False, (L, kv_dim),    ("layers", "kv_heads")),
        (p + "self_attn.o_proj.weight",        attn + ("o_proj", "kernel"),          True,  (L, q_dim, D),  ("layers", "heads", "embed")),
        (p + "self_attn.o_proj.bias",          attn + ("o_proj", "bias"),            False, (L, D),         ("layers", "norm")),
        (p + "self_attn.sinks",                attn + ("sinks",),                    False, (L, H),         ("layers", None)),
        (p + "post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale"), False, (L, D), ("layers", "norm")),
        (p + "mlp.router.weight",              ("layers", "router", "kernel"),       True,  (L, D, E),      ("layers", "embed", None)),
        (p + "mlp.router.bias",                ("layers", "router", "bias"),         False, (L, E),         ("layers", None)),
        (p + "mlp.experts.gate_up_proj_bias",  ex + ("gate_up_proj", "bias"),        False, (L, E, 2 * F),  ("layers", "experts", "expert_mlp")),
        (p + "mlp.experts.down_proj_bias",     ex + ("down_proj", "bias"),           False, (L, E, D),      ("layers", "experts", "embed")),
        ("model.norm.weight",                  ("norm", "scale"),                    False, (D,),           ("norm",)),
        ("lm_head.weight",                     ("lm_head", "kernel"),                True,  (D, V),         ("embed", "vocab")),
    ]
    specs = []
    for hf_name, path, transpose, shape, axes in rows:
        if path[0] == "lm_head" and cfg.tie_word_embeddings:
            continue
        specs.append(WeightSpec(hf_name, path, transpose, shape, axes,
                                # the router in fp32: bf16 rounding of its logits changes which experts win
                                dtype="float32" if path[1] == "router" else None,
                                deinterleave_axis=-1 if path[-2] == "gate_up_proj" else None))
    return specs + _expert_specs(cfg)


def _expert_specs(cfg: GptOssTargetConfig) -> list[WeightSpec]:
    """The expert matrices: [E, D, 2F] / [E, F, D] in the load dtype, or MXFP4 blocks and scales
    (uint8, rows = output features) kept as stored; gate/up rows de-interleaved either way."""
    L, D, E, F = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.intermediate_size
    p, ex = "model.layers.{i}.mlp.experts.", ("layers", "experts")
    if cfg.expert_format == "bf16":
        return [WeightSpec(p + "gate_up_proj", ex + ("gate_up_proj", "kernel"), False, (L, E, D, 2 * F),
                           ("layers", "experts", "embed", "expert_mlp"), deinterleave_axis=-1),
                WeightSpec(p + "down_proj", ex + ("down_proj", "kernel"), False, (L, E, F, D),
                           ("layers", "experts", "expert_mlp", "embed"))]
    mx = dict(dtype="uint8")
    return [
        WeightSpec(p + "gate_up_proj_blocks", ex + ("gate_up_proj", "blocks"), False, (L, E, 2 * F, D // 32, 16),
                   ("layers", "experts", "expert_mlp", "embed", None), deinterleave_axis=1, values_per_element=2, **mx),
        WeightSpec(p + "gate_up_proj_scales", ex + ("gate_up_proj", "scales"), False, (L, E, 2 * F, D // 32),
                   ("layers", "experts", "expert_mlp", "embed"), deinterleave_axis=1, values_per_element=0, **mx),
        WeightSpec(p + "down_proj_blocks", ex + ("down_proj", "blocks"), False, (L, E, D, F // 32, 16),
                   ("layers", "experts", "embed", "expert_mlp", None), values_per_element=2, **mx),
        WeightSpec(p + "down_proj_scales", ex + ("down_proj", "scales"), False, (L, E, D, F // 32),
                   ("layers", "experts", "embed", "expert_mlp"), values_per_element=0, **mx),
    ]


# =============================================================================================
# Blocks: router and experts (attention: layers/attention.py with bias and sinks)
# =============================================================================================
def route(h_td, router: dict, cfg: GptOssTargetConfig):
    """Top-k of the router logits (fp32), then a softmax over those k: expert ids [T, k], weights [T, k]."""
    ids, weights = topk_softmax(router_logits(h_td, router["kernel"], router["bias"]), cfg.num_experts_per_tok)
    return ids, weights.astype(h_td.dtype)


def expert_matrices(ex: dict, cfg: GptOssTargetConfig, dtype):
    """(gate_up [E, D, 2F], down [E, F, D]) of one layer in ``dtype``; MXFP4 ones dequantized here,
    inside the layer scan (its [E, rows, in] -> the kernel's [E, in, rows])."""
    if cfg.expert_format == "bf16":
        return ex["gate_up_proj"]["kernel"], ex["down_proj"]["kernel"]
    gu, dn = (mxfp4_dequantize(ex[n]["blocks"], ex[n]["scales"], dtype, transposed=True)
              for n in ("gate_up_proj", "down_proj"))
    return gu, dn


def moe_ffn(lp: dict, cfg: GptOssTargetConfig, h_btd):
    b, t, d = h_btd.shape
    h = h_btd.reshape(b * t, d)
    ids, weights = route(h, lp["router"], cfg)
    ex = lp["experts"]
    gate_up, down = expert_matrices(ex, cfg, h.dtype)
    out = moe_experts(h, ids, weights, gate_up_edf=gate_up, down_efd=down,
                      gate_up_bias_ef=ex["gate_up_proj"]["bias"], down_bias_ed=ex["down_proj"]["bias"],
                      activation=("clamped_swiglu", cfg.swiglu_alpha, cfg.swiglu_limit),
                      implementation=cfg.kernels.moe)
    return out.reshape(b, t, d)


# =============================================================================================
# Decoder layer and schedule
# =============================================================================================
def norm(x, scale, cfg: GptOssTargetConfig):
    return rms_norm(x, scale, cfg.rms_norm_eps, weight_in_fp32=True)


def decoder_layer(lp: dict, cfg: GptOssTargetConfig, x_btd, inputs: StackInputs, sliding, cache=None, layer=None):
    """x + attn(norm(x)), then + MoE(norm(x)); ``sliding`` the scanned flag of this layer's kind."""
    h = norm(x_btd, lp["input_layernorm"]["scale"], cfg)
    o, cache = attention_block(lp["self_attn"], cfg.attention, h, layer_mask(inputs, sliding, cfg.sliding_window),
                               inputs.rope, cache=cache, layer=layer, slots_bt=inputs.slots)
    x_btd = x_btd + o
    return x_btd + moe_ffn(lp, cfg, norm(x_btd, lp["post_attention_layernorm"]["scale"], cfg)), cache


def run_layers(params: dict, cfg: GptOssTargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """Every layer once, one scan per span between taps; layer i uses cache row i."""

    def step(carry, xs):
        (x, cache), (i, sliding) = carry, xs
        return decoder_layer(index_layer(params["layers"], i), cfg, x, inputs, sliding, cache, i)

    xs = (np.arange(cfg.num_hidden_layers, dtype=np.int32), np.asarray(cfg.sliding_layers, bool))
    return scan_layers(step, carry, xs, aux_ids, tapped=lambda carry: carry[0])


# =============================================================================================
# Decoder hooks: RoPE tables (YaRN's attention factor included), masks; the cache is
# decoder.kv_cache_per_layer (a K/V row per layer and the slot positions the windows read)
# =============================================================================================
def forward_inputs(cfg: GptOssTargetConfig, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    b, t = input_ids_bt.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    return StackInputs(segment_causal_mask(segment_ids), rope_tables(cfg.rope, cfg.head_dim, positions, dtype))


def decode_inputs(cfg: GptOssTargetConfig, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt, valid_from_b,
                  logits_index, dtype):
    masks, slots, cache = mixed_window_decode_masks(cfg, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt,
                                                    valid_from_b)
    return StackInputs(masks, rope_tables(cfg.rope, cfg.head_dim, positions_bt, dtype), slots=slots), cache


def final_norm(params: dict, cfg: GptOssTargetConfig, x):
    return norm(x, params["norm"]["scale"], cfg)


DECODER = Decoder(run_layers, final_norm=final_norm, forward_inputs=forward_inputs, decode_inputs=decode_inputs)


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(*GPT_OSS_ARCHS)
class GptOssTarget(Target):
    """Frozen gpt-oss target (see module docstring)."""

    config_class = GptOssTargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)
    routed_experts_path = ("layers", "experts")  # gpt-oss-20b: 3.6 B active, 120b: 5.1 B

"""MiniMax-M2 frozen target (``MiniMaxM2ForCausalLM``: MiniMax-M2, M2.1, M2.5 text models) in plain JAX.

Read top to bottom: config + HF key table -> HF weight map -> blocks (attention with full-width
q/k norm, router, MoE feed-forward) -> decoder layer and schedule -> Target class (the skeleton
around the layers: decoder.py).

What a MiniMax-M2 layer is (transformers' MiniMaxM2Model); every layer is the same:
  * pre-norm grouped-query attention, no biases, softmax scale head_dim ** -0.5. The q and k
    projections are RMS-normalised over their **whole width** (num_heads * head_dim values at once,
    one statistic per token across all heads, a weight per value: the published ``qk_norm_type:
    "per_layer"``), not per head as Qwen3's; then split into heads and rotated. ``layers/attention``'s
    ``qk_norm`` is per head, so this file projects, normalises and rotates q/k itself and calls the
    shared attention functions (``dot_product_attention``, ``cached_attention``) on the result;
  * partial RoPE on the first ``rotary_dim`` dims of each head (half-split pairs), the rest passed
    through. Published configs spell it ``rotary_dim`` (64 of head_dim 128); transformers turns it
    into ``partial_rotary_factor = rotary_dim / head_dim`` unless ``rope_parameters`` (or a
    top-level ``partial_rotary_factor``) already sets one, and so does ``from_hf`` here. An absent
    ``rope_theta`` means transformers' default 5,000,000;
  * a pre-norm MoE feed-forward: router logits = h @ W (fp32 here), sigmoid scores; the k experts
    with the largest score + ``e_score_correction_bias`` are picked (the bias steers the choice
    only), weighted by their unbiased scores renormalised to sum to one (``layers/routers.sigmoid_topk``
    with one group, no scaling); each expert is a SwiGLU of width ``intermediate_size``
    (``specjax_kernels.moe``). No shared expert (``shared_intermediate_size`` 0).

Params: every layer's attention, norms, router and experts are stacked under ``layers`` ([L, ...],
experts [L, E, ...]). The router weight and its correction bias stay fp32 whatever the load dtype
(transformers rounds the router logits to the model dtype; a bf16-rounded router flips expert
choices, so a bf16 target here routes as MiniMax's fp32 router does, not as transformers' bf16 one).

On disk (the published checkpoints, and what transformers 5's save_pretrained writes): Mixtral's
names, ``block_sparse_moe.gate.weight``, ``block_sparse_moe.e_score_correction_bias`` and one tensor
per expert ``block_sparse_moe.experts.{e}.w1 / w3 / w2.weight`` (gate / up / down). Published
configs declare ``num_mtp_modules`` multi-token-prediction modules, stored (where present) as layers
num_hidden_layers .. + num_mtp_modules - 1; like transformers and vLLM, the target ignores them.
The published weights are FP8 (``quantization_config`` with block-scaled ``weight_scale_inv``): they
load as published and stay FP8 on the device (targets/quantized.py). ``router_jitter_noise`` acts only in training and so
never here.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import numpy as np
from specjax_kernels.moe import moe_experts

from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, apply_rope, rope_spec_from_hf
from specjax.targets.base import Target, WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs
from specjax.targets.hf_keys import HFKey, check_gqa, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers.attention import AttentionConfig, cached_attention, dot_product_attention, write_kv_cache
from specjax.targets.layers.routers import router_logits, sigmoid_topk
from specjax.targets.layers.scan import index_layer, scan_layers
from specjax.targets.quantized import Fp8BlockQuant, quantize_weight_specs, weight_quant_from_hf
from specjax.targets.registry import register

ARCH = "MiniMaxM2ForCausalLM"
MODEL_TYPE = "minimax_m2"
DEFAULT_THETA = 5_000_000.0  # transformers' MiniMaxM2Config.default_theta (no rope_theta anywhere)

# config.json keys <-> config fields. A key may be absent only where transformers' MiniMaxM2Config
# has a default; the default here is that one (so an absent key means what it means there).
HF_KEYS = (
    HFKey("vocab_size"),
    HFKey("hidden_size"),
    HFKey("intermediate_size"),  # each expert's width
    HFKey("num_hidden_layers"),
    HFKey("num_attention_heads"),
    HFKey("num_key_value_heads", int, 8),
    HFKey("head_dim", int, 128),
    HFKey("num_local_experts", default=lambda hf: hf["num_experts"], field="num_experts"),
    HFKey("num_experts_per_tok", int, 8),
    HFKey("rms_norm_eps", float, 1e-6),
    HFKey("tie_word_embeddings", bool, False),
    HFKey("max_position_embeddings", int, 196608),
    HFKey("num_mtp_modules", int, 0),  # MTP modules on disk after the decoder layers (ignored)
)
# keys of the published configs that transformers ignores, at the value its MiniMaxM2 implements;
# any other value describes another model
FIXED_KEYS = {"scoring_func": "sigmoid", "use_qk_norm": True, "qk_norm_type": "per_layer",
              "use_routing_bias": True, "shared_intermediate_size": 0}
FULL_ATTENTION = 1  # attn_type_list: 1 = softmax attention in every MiniMax-M2 layer (0 was
# MiniMax-Text-01's lightning attention, which MiniMaxM2ForCausalLM does not have)
ROUTER_DTYPE = "float32"


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class MiniMaxM2TargetConfig:
    """Hashable subset of transformers' MiniMaxM2Config that the forward needs (plus runtime knobs)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # each routed expert's SwiGLU width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 196608
    num_mtp_modules: int = 0
    rope: RopeSpec = RopeSpec("default", DEFAULT_THETA)
    weight_quant: Fp8BlockQuant | None = None  # the FP8 release's block-scaled weights (targets/quantized.py)
    kernels: KernelChoices = KernelChoices()  # runtime option (moe: the routed experts' kernel)

    @property
    def attention(self) -> AttentionConfig:
        """Shapes, scale and kernels of the attention; its per-head qk norm stays off (this file
        normalises q/k over the full width before the shared attention functions run)."""
        return AttentionConfig.of(self)

    @property
    def num_routed_experts(self) -> int:
        return self.num_experts

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim(self.head_dim)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "MiniMaxM2TargetConfig":
        """From an HF config dict (config.json contents, or ``PretrainedConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, (ARCH,), "MiniMaxM2TargetConfig", unsupported_flags=("attention_bias",),
                                     silu_keys=("hidden_act",))
        for key, want in FIXED_KEYS.items():
            if hf.get(key) is not None and hf[key] != want:
                raise ValueError(f"{arch} with {key}={hf[key]!r} is not supported (transformers' MiniMaxM2 "
                                 f"implements {key}={want!r} only)")
        kinds = hf.get("attn_type_list")
        if kinds is not None and (not isinstance(kinds, list) or any(k != FULL_ATTENTION for k in kinds)):
            raise ValueError(f"{arch}: attn_type_list must hold only {FULL_ATTENTION} (full attention in every "
                             f"layer; 0 is MiniMax-Text-01's lightning attention, another architecture); got {kinds}")
        if hf.get("num_local_experts", hf.get("num_experts")) is None:
            raise ValueError(f"{arch} config has neither num_local_experts nor num_experts")
        kw = dict(architecture=arch, rope=_rope_spec(hf, arch), weight_quant=weight_quant_from_hf(hf, arch),
                  **read_hf_keys(HF_KEYS, hf))
        kw.update(overrides)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """ValueError naming the config key when the shapes or the routing cannot work."""
        check_gqa(self)
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"{self.architecture}: num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_local_experts={self.num_experts}")
        rot = self.rotary_dim
        if rot < 2 or rot % 2:
            raise ValueError(f"{self.architecture}: the rotary width int(head_dim * partial_rotary_factor) = {rot} "
                             f"(head_dim={self.head_dim}) must be even and >= 2 (RoPE rotates pairs); fix "
                             "rotary_dim / partial_rotary_factor")
        if not 0 <= self.num_mtp_modules <= 64:
            raise ValueError(f"{self.architecture}: num_mtp_modules={self.num_mtp_modules} must be in 0..64")

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        return {"architectures": [self.architecture], "model_type": MODEL_TYPE, "dtype": dtype,
                **hf_values(HF_KEYS, self), "rope_parameters": self.rope.to_hf(), "hidden_act": "silu",
                **({"quantization_config": self.weight_quant.to_hf()} if self.weight_quant else {})}


def _rope_spec(hf: dict, arch: str) -> RopeSpec:
    """The RopeSpec transformers builds for this config: rope_parameters' (or rope_scaling's) values
    first, then the top-level rope_theta / partial_rotary_factor, then partial_rotary_factor =
    rotary_dim / head_dim (the published configs' spelling), then rope_theta 5e6."""
    rope = hf.get("rope_parameters")
    rope = dict(hf.get("rope_scaling") or {}) if rope is None else dict(rope)
    top = dict(hf)
    if "rope_theta" not in rope and top.get("rope_theta") is None:
        top["rope_theta"] = DEFAULT_THETA
    rotary_dim = hf.get("rotary_dim")
    if rotary_dim is not None and "partial_rotary_factor" not in rope and top.get("partial_rotary_factor") is None:
        head_dim = hf.get("head_dim") or 128
        if not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"{arch}: rotary_dim={rotary_dim!r} must be an integer in 1..head_dim={head_dim}")
        top["partial_rotary_factor"] = rotary_dim / head_dim
    return rope_spec_from_hf(top, partial_rotary=True)


# =============================================================================================
# HF weight map. "{i}" rows are stacked on a leading layer axis; "{e}" rows also stack experts on a
# second axis. transpose=True: HF [out, in] <-> kernel [in, out].
# =============================================================================================
def weight_specs(cfg: MiniMaxM2TargetConfig) -> list[WeightSpec]:
    L, D, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    E, F = cfg.num_experts, cfg.intermediate_size
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    p, a, moe = "model.layers.{i}.", ("layers", "self_attn"), "model.layers.{i}.block_sparse_moe."
    rows = [
        # hf name                               specjax path                                     T?     shape           logical axes
        ("model.embed_tokens.weight",           ("embed_tokens", "embedding"),                   False, (V, D),         ("vocab", "embed")),
        (p + "input_layernorm.weight",          ("layers", "input_layernorm", "scale"),          False, (L, D),         ("layers", "norm")),
        (p + "self_attn.q_proj.weight",         a + ("q_proj", "kernel"),                        True,  (L, D, q_dim),  ("layers", "embed", "heads")),
        (p + "self_attn.k_proj.weight",         a + ("k_proj", "kernel"),                        True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        (p + "self_attn.v_proj.weight",         a + ("v_proj", "kernel"),                        True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        (p + "self_attn.o_proj.weight",         a + ("o_proj", "kernel"),                        True,  (L, q_dim, D),  ("layers", "heads", "embed")),
        # full-width norms: one weight per projected value, laid out like the projection's output
        (p + "self_attn.q_norm.weight",         a + ("q_norm", "scale"),                         False, (L, q_dim),     ("layers", "heads")),
        (p + "self_attn.k_norm.weight",         a + ("k_norm", "scale"),                         False, (L, kv_dim),    ("layers", "kv_heads")),
        (p + "post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale"), False, (L, D),         ("layers", "norm")),
        (moe + "gate.weight",                   ("layers", "router", "kernel"),                  True,  (L, D, E),      ("layers", "embed", None)),
        (moe + "e_score_correction_bias",       ("layers", "router", "e_score_correction_bias"), False, (L, E),         ("layers", None)),
        (moe + "experts.{e}.w1.weight",         ("layers", "experts", "gate_proj", "kernel"),    True,  (L, E, D, F),   ("layers", "experts", "embed", "expert_mlp")),
        (moe + "experts.{e}.w3.weight",         ("layers", "experts", "up_proj", "kernel"),      True,  (L, E, D, F),   ("layers", "experts", "embed", "expert_mlp")),
        (moe + "experts.{e}.w2.weight",         ("layers", "experts", "down_proj", "kernel"),    True,  (L, E, F, D),   ("layers", "experts", "expert_mlp", "embed")),
        ("model.norm.weight",                   ("norm", "scale"),                               False, (D,),           ("norm",)),
        ("lm_head.weight",                      ("lm_head", "kernel"),                           True,  (D, V),         ("embed", "vocab")),
    ]
    specs = []
    for hf_name, path, transpose, shape, axes in rows:
        if path[0] == "lm_head" and cfg.tie_word_embeddings:
            continue
        extra = {"dtype": ROUTER_DTYPE} if path[:2] == ("layers", "router") else {}
        specs.append(WeightSpec(hf_name, path, transpose, shape, axes, **extra))
    return quantize_weight_specs(specs, cfg.weight_quant)


# =============================================================================================
# Blocks: attention (full-width q/k norm), router, MoE feed-forward
# =============================================================================================
def project_qkv(p: dict, cfg: MiniMaxM2TargetConfig, h_btd):
    """q [B,T,N,hd], k and v [B,T,Hkv,hd] of a normed hidden state, q and k RMS-normalised over
    their whole projected width (all heads together) and not yet rotated."""
    b, t, _ = h_btd.shape
    q = rms_norm(h_btd @ p["q_proj"]["kernel"], p["q_norm"]["scale"], cfg.rms_norm_eps)
    k = rms_norm(h_btd @ p["k_proj"]["kernel"], p["k_norm"]["scale"], cfg.rms_norm_eps)
    v = h_btd @ p["v_proj"]["kernel"]
    heads = (b, t, cfg.num_attention_heads, cfg.head_dim)
    kv_heads = (b, t, cfg.num_key_value_heads, cfg.head_dim)
    return q.reshape(heads), k.reshape(kv_heads), v.reshape(kv_heads)


def attention(p: dict, cfg: MiniMaxM2TargetConfig, h_btd, inputs: StackInputs, cache=None, layer=None):
    """Self-attention of a normed hidden state [B,T,D]: (o_proj output [B,T,D], new cache or None).
    Training forward: ``inputs.mask`` is the chunk's SegmentCausalMask; cached decoding: the chunk's
    K/V go to ``inputs.slots`` of cache row ``layer`` and attention reads the whole row (the same
    contract as layers/attention.attention_block)."""
    b, t, _ = h_btd.shape
    spec = cfg.attention
    q, k, v = project_qkv(p, cfg, h_btd)
    q, k = apply_rope(q, *inputs.rope), apply_rope(k, *inputs.rope)
    if cache is None:
        o = dot_product_attention(q, k, v, inputs.mask, scale=spec.scale, q_block=spec.q_block,
                                  implementation=spec.implementation)
    else:
        cache = write_kv_cache(cache, layer, inputs.slots, k, v)
        # the chunk's slots are contiguous, so nothing at or past its last slot + 1 is visible
        o = cached_attention(q, cache, layer, inputs.mask, inputs.slots[:, -1] + 1, spec)
    return o.reshape(b, t, -1) @ p["o_proj"]["kernel"], cache


def route(router: dict, cfg: MiniMaxM2TargetConfig, x_td):
    """MiniMax-M2's router on tokens [T, D]: (expert ids int32 [T, k], fp32 weights [T, k])."""
    return sigmoid_topk(router_logits(x_td, router["kernel"]), cfg.num_experts_per_tok,
                        correction_bias=router["e_score_correction_bias"], renormalize=True)


def moe_ffn(lp: dict, cfg: MiniMaxM2TargetConfig, h_btd):
    """The routed SwiGLU experts of one layer's params (router, experts) on a normed state [B,T,D]."""
    b, t, d = h_btd.shape
    x = h_btd.reshape(b * t, d)
    ids, weights = route(lp["router"], cfg, x)
    ex = lp["experts"]
    out = moe_experts(x, ids, weights, up_edf=ex["up_proj"]["kernel"], down_efd=ex["down_proj"]["kernel"],
                      gate_edf=ex["gate_proj"]["kernel"], activation="silu", implementation=cfg.kernels.moe)
    return out.reshape(b, t, d)


# =============================================================================================
# Decoder layer and schedule (every layer alike: one scan per span between taps)
# =============================================================================================
def decoder_layer(lp: dict, cfg: MiniMaxM2TargetConfig, x_btd, inputs: StackInputs, cache=None, layer=None):
    """x + attn(norm(x)), then + MoE(norm(x)): (new x, new cache or None)."""
    h = rms_norm(x_btd, lp["input_layernorm"]["scale"], cfg.rms_norm_eps)
    o, cache = attention(lp["self_attn"], cfg, h, inputs, cache, layer)
    x_btd = x_btd + o
    h = rms_norm(x_btd, lp["post_attention_layernorm"]["scale"], cfg.rms_norm_eps)
    return x_btd + moe_ffn(lp, cfg, h), cache


def run_layers(params: dict, cfg: MiniMaxM2TargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """Every layer once, one scan per span between taps; layer i uses cache row i."""

    def step(carry, i):
        x, cache = carry
        return decoder_layer(index_layer(params["layers"], i), cfg, x, inputs, cache, i)

    return scan_layers(step, carry, np.arange(cfg.num_hidden_layers, dtype=np.int32), aux_ids,
                       tapped=lambda carry: carry[0])


# Cached decoding: the Llama KV cache {"k", "v"} [L, B, S, Hkv, hd] (K after the norm and RoPE, as
# transformers caches it) and the Llama hooks, whose RoPE tables cover the rotary dims only; the
# feed-forwards are per token (the router sees each token alone, so a chunk routes as the full
# sequence does), so nothing else is cached.
DECODER = Decoder(run_layers)


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(ARCH)  # GQA with full-width q/k norm and partial RoPE + sigmoid-routed SwiGLU experts
class MiniMaxM2Target(Target):
    """Frozen MiniMax-M2 target (see module docstring)."""

    config_class = MiniMaxM2TargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)

    routed_experts_path = ("layers", "experts")  # MiniMax-M2: 11.0 B active of 228.7 B (9.8 B without embeddings)

    @classmethod
    def ignored_hf_names(cls, config: MiniMaxM2TargetConfig, name: str) -> bool:
        """Also the multi-token-prediction modules after the decoder layers (transformers ignores them)."""
        if super().ignored_hf_names(config, name):
            return True
        m = re.match(r"model\.layers\.(\d+)\.", name)
        n = config.num_hidden_layers
        return m is not None and n <= int(m.group(1)) < n + config.num_mtp_modules

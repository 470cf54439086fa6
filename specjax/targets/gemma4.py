"""Gemma 4 frozen target (``Gemma4ForCausalLM``, the text model, model_type ``gemma4_text``) on the
shared decoder.

Read top to bottom: RoPE per layer type -> config (+ its HF keys and refusals) -> HF weight map and
init -> the layer (attention, feed-forward, per-layer input) -> the layer schedule -> Decoder hooks
and the KV cache -> Target class.

What Gemma 4 keeps from Gemma 3 (``gemma3.py``): four norms per layer (input, post-attention,
pre- and post-feed-forward), GeGLU with tanh GELU (``gemma3.geglu``), the embedding times
sqrt(hidden_size) rounded to the weight dtype (``gemma3.scale_embeddings``), q/k RMSNorm per head
before RoPE, and ``layer_types``: "sliding_attention" layers see the last ``sliding_window``
positions, "full_attention" layers the whole prefix, each type with its own RoPE.

What is new in transformers' Gemma4TextModel, and how each config key turns it on:
  * every RMSNorm multiplies by ``weight`` (not 1 + weight) in fp32 and casts after
    (``layers/norms.py`` ``weight_in_fp32``); the values are RMS-normalised without a weight too;
  * attention scores are not scaled (scale 1.0: the q/k norms set their size);
  * full-attention layers have their own head shape: head_dim ``global_head_dim`` (default 512) and,
    with ``attention_k_eq_v``, ``num_global_key_value_heads`` KV heads. transformers' saved configs
    carry the same as ``per_layer_config`` ({layer index: {"head_dim", "num_key_value_heads"}}), which
    is read instead when present;
  * ``attention_k_eq_v``: full-attention layers have no v_proj; the values are the raw k_proj output
    (before k_norm and RoPE), RMS-normalised. Sliding layers keep their v_proj;
  * full-attention layers' RoPE is "proportional" by default: the first ``partial_rotary_factor`` of
    the frequencies of a full-width table (exponents over the whole head_dim) and zero frequency (no
    rotation) for the rest, in the half-split pairing (:class:`ProportionalRope`);
  * per-layer inputs (``hidden_size_per_layer_input`` P > 0): a second token table
    ``embed_tokens_per_layer`` [vocab_size_per_layer_input, L * P] (times sqrt(P)) plus a projection
    of the scaled embedding (``per_layer_model_projection`` times hidden_size^-0.5, RMSNormed per
    layer slice), summed and times 2^-0.5, give each layer a [B, T, P] input. After its
    feed-forward, layer i adds norm(proj(gelu_tanh(gate(x)) * input_i));
  * every layer ends by multiplying the residual stream by its ``layer_scalar`` (a stored [1] tensor);
  * ``enable_moe_block`` (26B-A4B): beside the dense GeGLU MLP every layer runs routed experts on the
    same residual: the router RMS-normalises it (no weight), times ``router.scale`` and
    hidden_size^-0.5, softmax over ``num_experts``, the top ``top_k_experts`` renormalised to sum to
    one and times their ``per_expert_scale``; the experts (fused gate_up [E, 2F, D], tanh-GELU GeGLU,
    F = ``moe_intermediate_size``, ``specjax_kernels.moe``) read pre_feedforward_layernorm_2(x). The
    MLP's output through post_feedforward_layernorm_1 plus the experts' through
    post_feedforward_layernorm_2 is the feed-forward output (then post_feedforward_layernorm as usual);
  * shared KV (``num_kv_shared_layers`` S): the last S layers compute no K/V; each uses the K/V of the
    last earlier layer of its own type (the "producer"). ``use_double_wide_mlp`` doubles those S
    layers' intermediate_size;
  * ``final_logit_softcapping`` c: logits = c * tanh(logits / c) (``specjax.layers.logits.soft_cap``;
    applied to the logits of ``Target.__call__`` and ``decode_chunk``, and by the training teachers
    through ``Target.logit_softcap``).
  * transformers forces the last layer to "full_attention" (with a warning); so does this config.

Params: one stacked group per (layer type, shared) pair, under ``layers`` ("sliding", "full",
"sliding_shared", "full_shared"), each holding its layers' whole weights (shared layers have no
k_proj / v_proj / k_norm), so every group has one shape; the MoE's router and experts of all layers are
stacked under ``moe`` ([L, ...]; ``routed_experts_path``). The layer stack runs as scans over the
repeating pattern of groups (:func:`periodic_runs`: one scan body holds one period, e.g. 5 sliding
layers and a full one), cut at the aux taps and where the shared layers start.

Cached decoding keeps one K/V row per layer that computes its own K/V (``num_attention_layers`` =
L - S rows; a shared layer reads its producer's row) and the slot positions the sliding window
reads. Sliding and full layers store different head shapes in one stacked cache: each row holds a
layer's K (or V) flattened, padded to the wider type, as [Hc, Dc] (:func:`cache_layout`); a type
whose heads are exactly [Hc, Dc] reads the stacked cache in place (the decode-attention kernel),
the other slices its row.

Refused with a ValueError naming the key: attention_bias, hidden_activation other than
gelu_pytorch_tanh, use_bidirectional_attention="all" (an encoder; "vision" changes only the
multimodal model's image tokens, so the text model reads it as causal), quantization_config, MoE sizes
out of range, per_layer_config overrides other than the full-attention layers' head_dim /
num_key_value_heads, RoPE types other than default / linear / llama3 / proportional,
num_kv_shared_layers whose shared layers have no producer, and a per-layer table smaller than the
vocabulary. Gemma4ForConditionalGeneration (the published multimodal
checkpoints, text weights under ``model.language_model.``) is not read here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.layers.logits import soft_cap
from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, apply_rope, inverse_frequencies, rope_cos_sin, rope_spec_from_hf
from specjax.targets.base import Target, WeightSpec, resolve_hf_config, tree_set
from specjax.targets.decoder import Decoder, StackInputs
from specjax.targets.gemma3 import DEFAULT_PATTERN, DEFAULT_THETA, FULL, SLIDING, geglu, scale_embeddings
from specjax.targets.hf_keys import HFKey, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers import decoding
from specjax.targets.layers.attention import (AttentionConfig, cached_attention, dot_product_attention,
                                              segment_causal_mask, write_kv_cache)
from specjax.targets.layers.routers import router_logits, softmax_topk
from specjax.targets.layers.scan import index_layer, layer_scan, scan_at_taps
from specjax.targets.registry import model_type_of, register
from specjax_kernels.decode_attention import api as decode_attention
from specjax_kernels.moe import moe_experts

GEMMA4_ARCHS = ("Gemma4ForCausalLM",)
KINDS = (SLIDING, FULL)
GROUP_OF = {SLIDING: "sliding", FULL: "full"}  # the param group of a layer type; shared layers add "_shared"
DEFAULT_GLOBAL_HEAD_DIM = 512  # transformers' Gemma4TextConfig when config.json names none
PER_LAYER_OVERRIDES = ("head_dim", "num_key_value_heads")  # the per_layer_config keys read (full layers only)
# transformers' defaults when config.json has no rope_parameters
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": DEFAULT_THETA[SLIDING]},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": DEFAULT_THETA[FULL]}}


# =============================================================================================
# RoPE of one layer type
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class ProportionalRope:
    """transformers' "proportional" RoPE: a full-width half-split table whose first
    int(partial_rotary_factor * head_dim // 2) frequencies are theta^(-2i / head_dim) and the rest 0
    (those dims pass unrotated), all divided by ``factor``."""

    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    def inverse_frequencies(self, head_dim: int) -> np.ndarray:
        """float32 [head_dim // 2]: the default table's leading frequencies, then zeros."""
        rotated = int(self.partial_rotary_factor * head_dim // 2)
        inv = np.zeros(head_dim // 2, np.float32)
        inv[:rotated] = inverse_frequencies(RopeSpec("default", self.theta), head_dim)[:rotated]
        return (inv / np.float32(self.factor)).astype(np.float32)

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": "proportional", "rope_theta": self.theta,
                               "partial_rotary_factor": self.partial_rotary_factor}
        if self.factor != 1.0:
            out["factor"] = self.factor
        return out


def _inverse_frequencies(rope, head_dim: int) -> np.ndarray:
    if isinstance(rope, ProportionalRope):
        return rope.inverse_frequencies(head_dim)
    return inverse_frequencies(rope, head_dim)


def _rope_of(arch: str, kind: str, params: Any, hf: Mapping[str, Any]):
    """One layer type's RoPE from its rope_parameters entry (transformers' keys)."""
    where = f"{arch}: rope_parameters[{kind!r}]"
    if not isinstance(params, Mapping):
        raise ValueError(f"{where} must be a dict of RoPE keys (rope_type, rope_theta, ...); got {params!r}")
    params = dict(params)
    params.setdefault("rope_theta", DEFAULT_THETA[kind])
    if params.get("rope_type", "default") == "proportional":
        partial = float(params.get("partial_rotary_factor", 1.0))
        if not 0.0 < partial <= 1.0:
            raise ValueError(f"{where}: partial_rotary_factor={partial} must be in (0, 1]")
        return ProportionalRope(float(params["rope_theta"]), partial, float(params.get("factor", 1.0)))
    try:
        return rope_spec_from_hf({"rope_parameters": params,
                                  "max_position_embeddings": hf.get("max_position_embeddings")})
    except ValueError as err:
        raise ValueError(f"{where}: {err} (Gemma 4 reads default, linear, llama3 and proportional)") from None


# =============================================================================================
# Config
# =============================================================================================
def _per_layer_default(key: str, when_absent: int):
    """An HFKey default for a key whose null means "off" (0) but whose absence means transformers' default."""
    return lambda hf: 0 if key in hf else when_absent


def _optional_float(value):
    return None if value is None else float(value)


# config.json keys <-> config fields (layer_types, the full layers' head shape and RoPE: read below)
HF_KEYS = (
    HFKey("vocab_size"),
    HFKey("hidden_size"),
    HFKey("intermediate_size"),
    HFKey("num_hidden_layers"),
    HFKey("num_attention_heads"),
    HFKey("num_key_value_heads", int, 4, zero_is_absent=True),  # transformers' Gemma4TextConfig defaults
    HFKey("head_dim", int, 256, zero_is_absent=True),
    HFKey("rms_norm_eps", float, 1e-6),
    HFKey("tie_word_embeddings", bool, True),
    HFKey("max_position_embeddings", int, 131072),
    HFKey("sliding_window", int, 512),
    HFKey("attention_k_eq_v", bool, False),
    HFKey("num_kv_shared_layers", int, 0),
    HFKey("use_double_wide_mlp", bool, False),
    HFKey("hidden_size_per_layer_input", int, _per_layer_default("hidden_size_per_layer_input", 256)),
    HFKey("vocab_size_per_layer_input", int, 262144),
    HFKey("final_logit_softcapping", _optional_float, None),
    HFKey("enable_moe_block", bool, False),
    HFKey("num_experts", int, 0),  # the MoE sizes: null (their default) when enable_moe_block is off
    HFKey("top_k_experts", int, 0),
    HFKey("moe_intermediate_size", int, 0),
)
MOE_SIZES = ("num_experts", "top_k_experts", "moe_intermediate_size")
# sizes transformers reads beside specjax.hf_config_checks' table: (lowest, highest)
EXTRA_INT_BOUNDS = {"global_head_dim": (1, 8192), "num_global_key_value_heads": (1, 4096),
                    "hidden_size_per_layer_input": (0, 1 << 14), "vocab_size_per_layer_input": (1, 1 << 24),
                    "num_kv_shared_layers": (0, 4096), "sliding_window": (1, 1 << 27), "top_k_experts": (1, 16384)}


def _check_extra_ints(arch: str, hf: Mapping[str, Any]) -> None:
    for key, (lo, hi) in EXTRA_INT_BOUNDS.items():
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi):
            raise ValueError(f"{arch}: {key}={value!r} must be an integer in [{lo}, {hi}]")


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types is None:  # transformers: every 6th layer full (it does not read sliding_window_pattern)
        types = [SLIDING if (i + 1) % DEFAULT_PATTERN else FULL for i in range(num_layers)]
    types = list(types)
    bad = sorted(set(types) - set(KINDS))
    if bad or len(types) != num_layers:
        raise ValueError(f"layer_types must list {num_layers} entries of {SLIDING!r} / {FULL!r}; got {types}")
    types[-1] = FULL  # as transformers' Gemma4TextConfig forces it
    return tuple(types)


def _full_layer_shape(arch: str, hf: Mapping[str, Any], layer_types, head_dim: int, kv_heads: int, k_eq_v: bool):
    """(head_dim, num_key_value_heads) of the full-attention layers, as transformers resolves them."""
    overrides = hf.get("per_layer_config")
    if overrides is None:  # the published config.json layout
        gd = hf.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM
        gk = (hf.get("num_global_key_value_heads") if k_eq_v else None) or kv_heads
        return int(gd), int(gk)
    # transformers' own saved layout: {layer index: {key: value}} (overrides equal to the global value dropped)
    if not isinstance(overrides, Mapping):
        raise ValueError(f"{arch}: per_layer_config must be a dict of layer index -> overrides; got {overrides!r}")
    full = {i for i, t in enumerate(layer_types) if t == FULL}
    shapes = {}
    for key, layer in overrides.items():
        i = int(key) if str(key).isdigit() else -1
        if not layer:
            continue
        if i not in full or not isinstance(layer, Mapping) or set(layer) - set(PER_LAYER_OVERRIDES):
            raise ValueError(
                f"{arch}: per_layer_config[{key!r}]={layer!r} is not supported: specjax reads only "
                f"{' / '.join(PER_LAYER_OVERRIDES)} overrides of full-attention layers (the shape transformers "
                f"gives every full layer)")
        shapes[i] = (int(layer.get("head_dim", head_dim)), int(layer.get("num_key_value_heads", kv_heads)))
    distinct = set(shapes.values()) | ({(head_dim, kv_heads)} if len(shapes) < len(full) else set())
    if len(distinct) > 1:
        raise ValueError(f"{arch}: per_layer_config={dict(overrides)} gives the full-attention layers "
                         f"{sorted(full)} different head shapes; specjax needs one shape for every full layer")
    gd, gk = distinct.pop()
    named = {k: hf[k] for k in ("global_head_dim", "num_global_key_value_heads") if hf.get(k) is not None}
    if named.get("global_head_dim", gd) != gd or (k_eq_v and named.get("num_global_key_value_heads", gk) != gk):
        raise ValueError(f"{arch}: per_layer_config gives the full layers head_dim={gd}, num_key_value_heads={gk}, "
                         f"but the config also names {named}: keep one of the two")
    return gd, gk


DEFAULT_ROPE_SPECS = {k: _rope_of(GEMMA4_ARCHS[0], k, DEFAULT_ROPE[k], {}) for k in KINDS}


@dataclasses.dataclass(frozen=True)
class Gemma4TargetConfig:
    """Hashable subset of transformers' Gemma4TextConfig that the forward needs (plus runtime knobs).
    head_dim / num_key_value_heads are the sliding layers'; global_head_dim / num_global_key_value_heads
    the full layers' (resolved: equal to the sliding ones when the config does not change them)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    global_head_dim: int
    num_global_key_value_heads: int
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0  # 0: no per-layer inputs
    vocab_size_per_layer_input: int = 262144
    final_logit_softcapping: float | None = None
    enable_moe_block: bool = False  # routed experts beside every layer's MLP (26B-A4B)
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131072
    sliding_window: int = 512
    rope_local: Any = DEFAULT_ROPE_SPECS[SLIDING]  # sliding layers (a RopeSpec or a ProportionalRope)
    rope_global: Any = DEFAULT_ROPE_SPECS[FULL]  # full-attention layers
    kernels: KernelChoices = KernelChoices()  # runtime option, not part of the HF config

    def __post_init__(self):
        n = self.num_hidden_layers
        if len(self.layer_types) != n or set(self.layer_types) - set(KINDS) or self.layer_types[-1] != FULL:
            raise ValueError(f"layer_types must list {n} entries of {SLIDING!r} / {FULL!r} ending with {FULL!r}; "
                             f"got {list(self.layer_types)}")
        if not 0 <= self.num_kv_shared_layers < n:
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers} must be in [0, num_hidden_layers="
                             f"{n}): the shared layers reuse the K/V of earlier layers, so one layer at least "
                             f"computes its own")
        own = set(self.layer_types[:self.first_shared_layer])
        if own != set(self.layer_types):
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers}: the layers before the shared ones "
                             f"({self.first_shared_layer}) have types {sorted(own)} but the model has "
                             f"{sorted(set(self.layer_types))}; every type needs a layer that computes its K/V")
        for kind in self.kinds:
            heads = self.kv_heads(kind)
            if self.num_attention_heads % heads:
                raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of the "
                                 f"{kind} layers' {heads} KV heads")
        moe_sizes_ok = self.moe_intermediate_size >= 1 and 1 <= self.top_k_experts <= self.num_experts
        if self.enable_moe_block and not moe_sizes_ok:
            raise ValueError(f"enable_moe_block=True needs num_experts >= 1, top_k_experts in 1..num_experts and "
                             f"moe_intermediate_size >= 1; got num_experts={self.num_experts}, top_k_experts="
                             f"{self.top_k_experts}, moe_intermediate_size={self.moe_intermediate_size}")
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input < self.vocab_size:
            raise ValueError(f"vocab_size_per_layer_input={self.vocab_size_per_layer_input} < vocab_size="
                             f"{self.vocab_size}: tokens past the per-layer table have no per-layer input "
                             f"(transformers fails on them)")

    # ---- derived facts of the layer stack ---------------------------------------------------------
    @property
    def model_type(self) -> str:
        return model_type_of(self.architecture)

    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def num_attention_layers(self) -> int:
        """Layers that compute (and cache) their own K/V: the cache rows (the shared layers read their
        producer's row)."""
        return self.first_shared_layer

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer types present, in KINDS order."""
        return tuple(k for k in KINDS if k in self.layer_types)

    def is_shared(self, layer: int) -> bool:
        return layer >= self.first_shared_layer

    def group(self, layer: int) -> str:
        """The param group (stack) of a layer: its type, "_shared" for a shared-KV layer."""
        return GROUP_OF[self.layer_types[layer]] + ("_shared" if self.is_shared(layer) else "")

    def group_layers(self, group: str) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.group(i) == group)

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.group(i) for i in range(self.num_hidden_layers)))

    def producer(self, kind: str) -> int:
        """The last layer of type ``kind`` before the shared ones: its K/V serve the shared layers of that type."""
        return max(i for i in range(self.first_shared_layer) if self.layer_types[i] == kind)

    def head_dim_of(self, kind: str) -> int:
        return self.global_head_dim if kind == FULL else self.head_dim

    def kv_heads(self, kind: str) -> int:
        return self.num_global_key_value_heads if kind == FULL else self.num_key_value_heads

    def has_v_proj(self, kind: str) -> bool:
        return not (self.attention_k_eq_v and kind == FULL)

    def intermediate(self, layer: int) -> int:
        return self.intermediate_size * (2 if self.use_double_wide_mlp and self.is_shared(layer) else 1)

    @property
    def num_experts_per_tok(self) -> int:  # the names Target.active_params_per_token reads
        return self.top_k_experts

    @property
    def num_routed_experts(self) -> int:
        return self.num_experts

    def rope_of(self, kind: str):
        return self.rope_global if kind == FULL else self.rope_local

    def attention(self, kind: str) -> AttentionConfig:
        """One layer type's attention shape (no score scale: the q/k norms set it)."""
        return AttentionConfig(num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads(kind),
                               head_dim=self.head_dim_of(kind), softmax_scale=1.0,
                               q_block=self.kernels.target_attention_q_block,
                               implementation=self.kernels.target_attention,
                               decode_implementation=self.kernels.decode_attention)

    @property
    def rope(self) -> RopeSpec:
        """The RoPE a draft head takes (drafts' ``config_from_target``): the sliding layers' (the full
        layers' proportional RoPE is no RopeSpec); a proportional sliding RoPE gives the default RoPE
        with its theta."""
        r = self.rope_local
        return r if isinstance(r, RopeSpec) else RopeSpec("default", r.theta)

    # ---- HF config -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "Gemma4TargetConfig":
        """From an HF config dict (config.json contents, or ``PretrainedConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, GEMMA4_ARCHS, "Gemma4TargetConfig")
        refused = {
            "attention_bias": (bool(hf.get("attention_bias")), "q/k/v/o biases"),
            "quantization_config": (hf.get("quantization_config") is not None, "dequantize the checkpoint to bf16 "
                                                                               "first"),
        }
        for key, (on, why) in refused.items():
            if on:
                raise ValueError(f"{arch}: {key}={hf[key]!r} is not supported by specjax's Gemma 4 target ({why})")
        act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{arch}: hidden_activation={act!r} is not supported (Gemma 4 uses gelu_pytorch_tanh)")
        bidir = hf.get("use_bidirectional_attention")
        if bidir not in (None, False, "vision"):
            raise ValueError(f"{arch}: use_bidirectional_attention={bidir!r} (every token attends both ways: an "
                             f"encoder) cannot be a causal target")
        _check_extra_ints(arch, hf)
        keys = read_hf_keys(HF_KEYS, hf)
        types = _layer_types(hf, keys["num_hidden_layers"])
        gd, gk = _full_layer_shape(arch, hf, types, keys["head_dim"], keys["num_key_value_heads"],
                                   keys["attention_k_eq_v"])
        rope = hf.get("rope_parameters")
        rope = DEFAULT_ROPE if rope is None else rope
        if not isinstance(rope, Mapping) or not set(rope) <= set(KINDS) or any(k not in rope for k in set(types)):
            raise ValueError(f"{arch}: rope_parameters must map each layer type in layer_types "
                             f"({sorted(set(types))}) to its RoPE dict; got {rope!r}")
        ropes = {**DEFAULT_ROPE_SPECS, **{k: _rope_of(arch, k, rope[k], hf) for k in set(types)}}  # types in use
        kw = dict(architecture=arch, layer_types=types, global_head_dim=gd, num_global_key_value_heads=gk,
                  rope_local=ropes[SLIDING], rope_global=ropes[FULL], **keys)
        kw.update(overrides)
        try:
            return cls(**kw)
        except ValueError as err:
            raise ValueError(f"{arch}: {err}") from None

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers' saved layout: the full layers' head shape as
        per_layer_config) that transformers and ``from_hf`` both read."""
        override = {k: v for k, v, base in (("head_dim", self.global_head_dim, self.head_dim),
                                             ("num_key_value_heads", self.num_global_key_value_heads,
                                              self.num_key_value_heads)) if v != base}
        per_layer = {str(i): dict(override) for i, t in enumerate(self.layer_types) if t == FULL and override}
        moe_sizes = {k: getattr(self, k) or None for k in MOE_SIZES}  # null without the MoE block, as transformers
        return {"architectures": [self.architecture], "model_type": self.model_type, **hf_values(HF_KEYS, self),
                **moe_sizes,
                "layer_types": list(self.layer_types), "per_layer_config": per_layer,
                "hidden_activation": "gelu_pytorch_tanh",
                "rope_parameters": {SLIDING: self.rope_local.to_hf(), FULL: self.rope_global.to_hf()},
                "attention_bias": False, "use_bidirectional_attention": None,
                "use_cache": True, "dtype": dtype}


# =============================================================================================
# HF weight map (one row per tensor; "{i}" rows stacked per group on a leading axis) and init
# =============================================================================================
def weight_specs(cfg: Gemma4TargetConfig) -> list[WeightSpec]:
    L, D, V, N = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    P, Vp = cfg.hidden_size_per_layer_input, cfg.vocab_size_per_layer_input
    rows = [WeightSpec("model.embed_tokens.weight", ("embed_tokens", "embedding"), False, (V, D), ("vocab", "embed"))]
    if P:
        rows += [
            WeightSpec("model.embed_tokens_per_layer.weight", ("embed_tokens_per_layer", "embedding"), False,
                       (Vp, L * P), ("vocab", None)),
            WeightSpec("model.per_layer_model_projection.weight", ("per_layer_model_projection", "kernel"), True,
                       (D, L * P), ("embed", None)),
            WeightSpec("model.per_layer_projection_norm.weight", ("per_layer_projection_norm", "scale"), False,
                       (P,), ("norm",)),
        ]
    layer = "model.layers.{i}."
    for group in cfg.groups:
        ids = cfg.group_layers(group)
        n, kind, shared = len(ids), cfg.layer_types[ids[0]], cfg.is_shared(ids[0])
        hd, kv, F = cfg.head_dim_of(kind), cfg.kv_heads(kind) * cfg.head_dim_of(kind), cfg.intermediate(ids[0])
        g = ("layers", group)
        table = [
            # hf name                          path under layers/<group>                   T?     shape           logical axes
            ("input_layernorm.weight",          ("input_layernorm", "scale"),               False, (n, D),         ("layers", "norm")),
            ("self_attn.q_proj.weight",         ("self_attn", "q_proj", "kernel"),          True,  (n, D, N * hd), ("layers", "embed", "heads")),
            ("self_attn.q_norm.weight",         ("self_attn", "q_norm", "scale"),           False, (n, hd),        ("layers", "head_dim")),
            ("self_attn.o_proj.weight",         ("self_attn", "o_proj", "kernel"),          True,  (n, N * hd, D), ("layers", "heads", "embed")),
            ("post_attention_layernorm.weight", ("post_attention_layernorm", "scale"),      False, (n, D),         ("layers", "norm")),
            ("pre_feedforward_layernorm.weight", ("pre_feedforward_layernorm", "scale"),    False, (n, D),         ("layers", "norm")),
            ("mlp.gate_proj.weight",            ("mlp", "gate_proj", "kernel"),             True,  (n, D, F),      ("layers", "embed", "mlp")),
            ("mlp.up_proj.weight",              ("mlp", "up_proj", "kernel"),               True,  (n, D, F),      ("layers", "embed", "mlp")),
            ("mlp.down_proj.weight",            ("mlp", "down_proj", "kernel"),             True,  (n, F, D),      ("layers", "mlp", "embed")),
            ("post_feedforward_layernorm.weight", ("post_feedforward_layernorm", "scale"),  False, (n, D),         ("layers", "norm")),
            # a [1] tensor per layer; named "scale" so random draws start it at one, as transformers does
            ("layer_scalar",                    ("layer_scalar", "scale"),                  False, (n, 1),         ("layers", None)),
        ]
        if not shared:
            table += [
                ("self_attn.k_proj.weight",     ("self_attn", "k_proj", "kernel"),          True,  (n, D, kv),     ("layers", "embed", "kv_heads")),
                ("self_attn.k_norm.weight",     ("self_attn", "k_norm", "scale"),           False, (n, hd),        ("layers", "head_dim")),
            ]
            if cfg.has_v_proj(kind):
                table.append(
                    ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"),          True,  (n, D, kv),     ("layers", "embed", "kv_heads")))
        if cfg.enable_moe_block:
            table += [
                ("pre_feedforward_layernorm_2.weight", ("pre_feedforward_layernorm_2", "scale"), False, (n, D),     ("layers", "norm")),
                ("post_feedforward_layernorm_1.weight", ("post_feedforward_layernorm_1", "scale"), False, (n, D),   ("layers", "norm")),
                ("post_feedforward_layernorm_2.weight", ("post_feedforward_layernorm_2", "scale"), False, (n, D),   ("layers", "norm")),
            ]
        if P:
            table += [
                ("per_layer_input_gate.weight", ("per_layer_input_gate", "kernel"),         True,  (n, D, P),      ("layers", "embed", None)),
                ("per_layer_projection.weight", ("per_layer_projection", "kernel"),         True,  (n, P, D),      ("layers", None, "embed")),
                ("post_per_layer_input_norm.weight", ("post_per_layer_input_norm", "scale"), False, (n, D),        ("layers", "norm")),
            ]
        rows += [WeightSpec(layer + name, g + path, t, shape, axes, layer_ids=ids)
                 for name, path, t, shape, axes in table]
    if cfg.enable_moe_block:  # every layer's router and experts, stacked [L, ...]; the router kept fp32
        E, Fm = cfg.num_experts, cfg.moe_intermediate_size
        rows += [
            WeightSpec(layer + "router.proj.weight", ("moe", "router", "kernel"), True, (L, D, E),
                       ("layers", "embed", None), dtype="float32"),
            WeightSpec(layer + "router.scale", ("moe", "router", "scale"), False, (L, D), ("layers", "norm"),
                       dtype="float32"),
            WeightSpec(layer + "router.per_expert_scale", ("moe", "router", "per_expert_scale"), False, (L, E),
                       ("layers", None), dtype="float32"),
            # [E, 2F, D] and [E, D, F] on disk (transformers' fused experts), [E, D, 2F] / [E, F, D] leaves
            WeightSpec(layer + "experts.gate_up_proj", ("moe", "experts", "gate_up_proj", "kernel"), False,
                       (L, E, D, 2 * Fm), ("layers", "experts", "embed", "expert_mlp"), hf_axes=(0, 2, 1)),
            WeightSpec(layer + "experts.down_proj", ("moe", "experts", "down_proj", "kernel"), False,
                       (L, E, Fm, D), ("layers", "experts", "expert_mlp", "embed"), hf_axes=(0, 2, 1)),
        ]
    rows.append(WeightSpec("model.norm.weight", ("norm", "scale"), False, (D,), ("norm",)))
    if not cfg.tie_word_embeddings:
        rows.append(WeightSpec("lm_head.weight", ("lm_head", "kernel"), True, (D, V), ("embed", "vocab")))
    return rows


def init_params(cfg: Gemma4TargetConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params: normal(0, 0.02) matrices; norm weights, layer scalars and the experts' scales
    1 + normal(0, 0.1)."""
    specs = weight_specs(cfg)
    params: dict = {}
    for spec, k in zip(specs, jax.random.split(key, len(specs))):
        noise = jax.random.normal(k, spec.shape, jnp.float32)
        value = 1.0 + 0.1 * noise if spec.path[-1] in ("scale", "per_expert_scale") else 0.02 * noise
        tree_set(params, spec.path, value.astype(spec.dtype or dtype))
    return params


# =============================================================================================
# The layer: attention (own or shared K/V), GeGLU, per-layer input, layer scalar
# =============================================================================================
def norm(x, scale, cfg: Gemma4TargetConfig):
    """Gemma 4's RMSNorm: times ``scale`` in fp32, cast after."""
    return rms_norm(x, scale, cfg.rms_norm_eps, weight_in_fp32=True)


def unit_norm(x, cfg: Gemma4TargetConfig):
    """Gemma 4's RMSNorm without a weight (the values')."""
    return rms_norm(x, jnp.ones((), x.dtype), cfg.rms_norm_eps, weight_in_fp32=True)


def project_kv(ap: dict, cfg: Gemma4TargetConfig, kind: str, h_btd, rope):
    """A layer's own K (normed, rotated) and V (the raw k_proj output with attention_k_eq_v), [B,T,Hkv,hd]."""
    b, t, _ = h_btd.shape
    shape = (b, t, cfg.kv_heads(kind), cfg.head_dim_of(kind))
    raw_k = (h_btd @ ap["k_proj"]["kernel"]).reshape(shape)
    raw_v = (h_btd @ ap["v_proj"]["kernel"]).reshape(shape) if cfg.has_v_proj(kind) else raw_k
    return apply_rope(norm(raw_k, ap["k_norm"]["scale"], cfg), *rope), unit_norm(raw_v, cfg)


def cache_layout(cfg: Gemma4TargetConfig) -> tuple[int, int]:
    """(Hc, Dc) of a KV cache row: every layer type's K (or V) flattened fits Hc * Dc values, in rows of
    Dc = the gcd of the types' head dims."""
    dc = math.gcd(*(cfg.head_dim_of(k) for k in cfg.kinds))
    width = max(cfg.kv_heads(k) * cfg.head_dim_of(k) for k in cfg.kinds)
    return width // dc, dc


def _stored_exactly(cfg: Gemma4TargetConfig, kind: str) -> bool:
    """This type's K/V are [Hc, Dc] as they are: attention may read the stacked cache in place."""
    return (cfg.kv_heads(kind), cfg.head_dim_of(kind)) == cache_layout(cfg)


def _to_cache_row(x_btkh, cfg: Gemma4TargetConfig):
    b, t = x_btkh.shape[:2]
    hc, dc = cache_layout(cfg)
    flat = x_btkh.reshape(b, t, -1)
    return jnp.pad(flat, ((0, 0), (0, 0), (0, hc * dc - flat.shape[-1]))).reshape(b, t, hc, dc)


def _from_cache_row(row_bshd, cfg: Gemma4TargetConfig, kind: str, dtype):
    b, s = row_bshd.shape[:2]
    width = cfg.kv_heads(kind) * cfg.head_dim_of(kind)
    flat = row_bshd.reshape(b, s, -1)[..., :width]
    return flat.reshape(b, s, cfg.kv_heads(kind), cfg.head_dim_of(kind)).astype(dtype)


def _cached(q, cache, row, mask, slots_bt, cfg: Gemma4TargetConfig, kind: str):
    """Attention of the chunk's queries over cache row ``row`` (its chunk K/V already written)."""
    spec = cfg.attention(kind)
    if _stored_exactly(cfg, kind):
        return cached_attention(q, cache, row, mask, slots_bt[:, -1] + 1, spec)
    k, v = (_from_cache_row(jax.lax.dynamic_index_in_dim(cache[n], row, axis=0, keepdims=False), cfg, kind, q.dtype)
            for n in ("k", "v"))
    return dot_product_attention(q, k, v, decode_attention.plain_mask(mask), scale=spec.scale, q_block=spec.q_block,
                                 implementation=spec.implementation)


def attention(lp: dict, cfg: Gemma4TargetConfig, kind: str, layer: int | jax.Array, shared: bool, h_btd,
              inputs: StackInputs, cache, store):
    """Self-attention of the normed hidden state: (o_proj output, cache, store). A layer with its own K/V
    writes them to cache row ``layer`` (decoding) or to ``store`` for the shared layers (the forward);
    a shared layer reads its producer's row / the stored K/V."""
    ap = lp["self_attn"]
    b, t, _ = h_btd.shape
    rope, mask = inputs.rope[kind], inputs.mask[kind]
    q = (h_btd @ ap["q_proj"]["kernel"]).reshape(b, t, cfg.num_attention_heads, cfg.head_dim_of(kind))
    q = apply_rope(norm(q, ap["q_norm"]["scale"], cfg), *rope)
    if cache is not None:
        if not shared:
            k, v = project_kv(ap, cfg, kind, h_btd, rope)
            cache = write_kv_cache(cache, layer, inputs.slots, _to_cache_row(k, cfg), _to_cache_row(v, cfg))
        row = cfg.producer(kind) if shared else layer
        o = _cached(q, cache, row, mask, inputs.slots, cfg, kind)
    else:
        if shared:
            k, v = store[kind]
        else:
            k, v = project_kv(ap, cfg, kind, h_btd, rope)
            if store is not None and kind in store:
                store = {**store, kind: (k, v)}
        spec = cfg.attention(kind)
        o = dot_product_attention(q, k, v, mask, scale=spec.scale, q_block=spec.q_block,
                                  implementation=spec.implementation)
    return o.reshape(b, t, -1) @ ap["o_proj"]["kernel"], cache, store


def routed_experts(mp: dict, cfg: Gemma4TargetConfig, residual_btd, h_btd):
    """The MoE block's experts on ``h`` (pre_feedforward_layernorm_2 of the residual), routed by the
    residual (module docstring); ``mp`` one layer's {"router", "experts"}."""
    b, t, d = residual_btd.shape
    r = mp["router"]
    scaled = unit_norm(residual_btd.reshape(b * t, d), cfg).astype(jnp.float32) * r["scale"].astype(jnp.float32)
    logits = router_logits(scaled * jnp.float32(d**-0.5), r["kernel"])
    ids, weights = softmax_topk(logits, cfg.top_k_experts, renormalize=True)
    weights = weights * jnp.take(r["per_expert_scale"].astype(weights.dtype), ids)
    ex = mp["experts"]
    out = moe_experts(h_btd.reshape(b * t, d), ids, weights, gate_up_edf=ex["gate_up_proj"]["kernel"],
                      down_efd=ex["down_proj"]["kernel"], activation="gelu_tanh", implementation=cfg.kernels.moe)
    return out.reshape(b, t, d).astype(h_btd.dtype)


def decoder_layer(lp: dict, cfg: Gemma4TargetConfig, kind: str, shared: bool, layer, x_btd, inputs: StackInputs,
                  per_layer_input, cache, store, moe=None):
    """One Gemma 4 layer (module docstring): (x, cache, store); ``moe`` this layer's router and experts."""
    h = norm(x_btd, lp["input_layernorm"]["scale"], cfg)
    o, cache, store = attention(lp, cfg, kind, layer, shared, h, inputs, cache, store)
    x_btd = x_btd + norm(o, lp["post_attention_layernorm"]["scale"], cfg)
    h = geglu(lp["mlp"], norm(x_btd, lp["pre_feedforward_layernorm"]["scale"], cfg))
    if moe is not None:
        routed = routed_experts(moe, cfg, x_btd, norm(x_btd, lp["pre_feedforward_layernorm_2"]["scale"], cfg))
        h = (norm(h, lp["post_feedforward_layernorm_1"]["scale"], cfg)
             + norm(routed, lp["post_feedforward_layernorm_2"]["scale"], cfg))
    x_btd = x_btd + norm(h, lp["post_feedforward_layernorm"]["scale"], cfg)
    if per_layer_input is not None:
        g = jax.nn.gelu(x_btd @ lp["per_layer_input_gate"]["kernel"], approximate=True) * per_layer_input
        x_btd = x_btd + norm(g @ lp["per_layer_projection"]["kernel"], lp["post_per_layer_input_norm"]["scale"], cfg)
    return x_btd * lp["layer_scalar"]["scale"].astype(x_btd.dtype), cache, store


def per_layer_inputs(params: dict, cfg: Gemma4TargetConfig, input_ids_bt, x_btd):
    """Every layer's per-layer input [L, B, T, P] from the token ids and the scaled embedding x (None
    without per-layer inputs)."""
    P, L = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
    if not P:
        return None
    b, t, _ = x_btd.shape
    table = params["embed_tokens_per_layer"]["embedding"]
    tokens = jnp.take(table, input_ids_bt, axis=0) * jnp.asarray(math.sqrt(P), jnp.float32).astype(table.dtype)
    proj = (x_btd @ params["per_layer_model_projection"]["kernel"]) * jnp.asarray(cfg.hidden_size**-0.5, x_btd.dtype)
    proj = norm(proj.reshape(b, t, L, P), params["per_layer_projection_norm"]["scale"], cfg)
    combined = (proj + tokens.reshape(b, t, L, P).astype(x_btd.dtype)) * jnp.asarray(2**-0.5, x_btd.dtype)
    return jnp.moveaxis(combined, 2, 0)


# =============================================================================================
# The layer schedule: scans over the repeating pattern of groups, cut at taps and at the shared layers
# =============================================================================================
def periodic_runs(signature: Sequence[Any], a: int, b: int) -> list[tuple[int, int, int]]:
    """Layers [a, b) as (start, period, repeats) runs: ``signature[a:b]`` repeats with its shortest period p,
    so [a, a + m p) is m repeats of one p-layer body (one scan), and the rest, a prefix of the period, one
    more run of one repeat."""
    n = b - a
    p = next(p for p in range(1, n + 1) if all(signature[a + i] == signature[a + i + p] for i in range(n - p)))
    m = n // p
    return [(a, p, m)] + ([(a + m * p, n - m * p, 1)] if n % p else [])


def run_layers(params: dict, cfg: Gemma4TargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """Every layer once (module docstring); the carry inside is (x, cache, stored K/V of each producer type)."""
    x, cache = carry
    ple = per_layer_inputs(params, cfg, inputs.extra, x)
    store = None
    if cache is None and cfg.num_kv_shared_layers:  # the forward: the producers' K/V, for the shared layers
        b, t, _ = x.shape
        consumed = {cfg.layer_types[i] for i in range(cfg.first_shared_layer, cfg.num_hidden_layers)}
        store = {k: (jnp.zeros((b, t, cfg.kv_heads(k), cfg.head_dim_of(k)), x.dtype),) * 2 for k in sorted(consumed)}
    signature = [(cfg.layer_types[i], cfg.is_shared(i)) for i in range(cfg.num_hidden_layers)]
    slot = {i: cfg.group_layers(cfg.group(i)).index(i) for i in range(cfg.num_hidden_layers)}

    def body(start: int, period: int):
        kinds = signature[start:start + period]

        def step(c, xs):
            x, cache, store = c
            for r, (kind, shared) in enumerate(kinds):
                lp = index_layer(params["layers"][cfg.group(start + r)], xs["slot"][r])
                pli = None if ple is None else jax.lax.dynamic_index_in_dim(ple, xs["layer"][r], 0, keepdims=False)
                moe = index_layer(params["moe"], xs["layer"][r]) if cfg.enable_moe_block else None
                x, cache, store = decoder_layer(lp, cfg, kind, shared, xs["layer"][r], x, inputs, pli, cache, store,
                                                moe)
            return x, cache, store

        return step

    def run_span(c, a, b):
        for lo, hi in ((a, min(b, cfg.first_shared_layer)), (max(a, cfg.first_shared_layer), b)):
            if lo >= hi:
                continue
            for start, period, repeats in periodic_runs(signature, lo, hi):
                layers = start + np.arange(repeats * period, dtype=np.int32).reshape(repeats, period)
                xs = {"layer": layers, "slot": np.vectorize(slot.get)(layers).astype(np.int32)}
                if repeats == 1:
                    c = body(start, period)(c, {k: v[0] for k, v in xs.items()})
                else:
                    c = layer_scan(body(start, period), c, xs)
        return c

    (x, cache, _), aux = scan_at_taps(run_span, (x, cache, store), cfg.num_hidden_layers, aux_ids,
                                      tapped=lambda c: c[0])
    return (x, cache), aux


# =============================================================================================
# Decoder hooks: the per-type masks and RoPE, the cache, the final norm and soft-capped logits
# =============================================================================================
def _ropes(cfg: Gemma4TargetConfig, positions_bt, dtype) -> dict:
    return {k: rope_cos_sin(positions_bt, _inverse_frequencies(cfg.rope_of(k), cfg.head_dim_of(k)), dtype)
            for k in cfg.kinds}


def forward_inputs(cfg: Gemma4TargetConfig, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    b, t = input_ids_bt.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    mask = segment_causal_mask(segment_ids)
    masks = {SLIDING: mask.with_window(cfg.sliding_window), FULL: mask}
    return StackInputs(masks, _ropes(cfg, positions, dtype), extra=input_ids_bt)


def decode_inputs(cfg: Gemma4TargetConfig, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt, valid_from_b,
                  logits_index, dtype):
    full, windowed, slots, cache = decoding.windowed_chunk_inputs(cache, input_ids_bt, positions_bt, start_b,
                                                                  cfg.sliding_window, chunk_mask_btt, valid_from_b)
    masks = {}
    for kind, mask in ((SLIDING, windowed), (FULL, full)):
        if kind in cfg.kinds and _stored_exactly(cfg, kind):  # the decode-attention kernel's operand, built once
            spec = cfg.attention(kind)
            mask = decode_attention.prepare_mask(mask, spec.num_heads, spec.head_dim, cache["k"].shape,
                                                 spec.decode_implementation)
        masks[kind] = mask
    return StackInputs(masks, _ropes(cfg, positions_bt, dtype), slots=slots, extra=input_ids_bt), cache


def init_cache(cfg: Gemma4TargetConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed {"k", "v"} [L - S, B, S_slots, Hc, Dc] (:func:`cache_layout`) and the slot positions {"pos"}."""
    hc, dc = cache_layout(cfg)
    cache = decoding.init_kv_cache(cfg.num_attention_layers, batch_size, max_len, hc, dc, dtype)
    cache["pos"] = decoding.init_positions(batch_size, max_len)
    return cache


def final_norm(params: dict, cfg: Gemma4TargetConfig, x):
    return norm(x, params["norm"]["scale"], cfg)


@dataclasses.dataclass(frozen=True)
class Gemma4Decoder(Decoder):
    """The shared decoder; decode_chunk's logits soft-capped (final_logit_softcapping)."""

    def decode_chunk(self, params: dict, cfg: Any, *args, **kwargs):
        logits, aux, final, cache = super().decode_chunk(params, cfg, *args, **kwargs)
        return soft_cap(logits, cfg.final_logit_softcapping), aux, final, cache


DECODER = Gemma4Decoder(run_layers, scale_embeddings=scale_embeddings, final_norm=final_norm,
                        forward_inputs=forward_inputs, decode_inputs=decode_inputs, init_cache=init_cache)


# =============================================================================================
# Target wrapper
# =============================================================================================
SHARED_LAYER_KV = ("k_proj.weight", "v_proj.weight", "k_norm.weight", "v_norm.weight")


@register(*GEMMA4_ARCHS)
class Gemma4Target(Target):
    """Frozen Gemma 4 text target (see module docstring)."""

    config_class = Gemma4TargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)
    init_params = staticmethod(init_params)
    routed_experts_path = ("moe", "experts")  # 26B-A4B

    def active_params_per_token(self) -> int | None:
        return super().active_params_per_token() if self.config.enable_moe_block else None

    @classmethod
    def ignored_hf_names(cls, config: Gemma4TargetConfig, name: str) -> bool:
        """Also the K/V projections a checkpoint may still hold for the shared-KV layers (transformers
        ignores them too: those layers use their producer's K/V)."""
        if super().ignored_hf_names(config, name):
            return True
        prefix, _, rest = name.partition(".self_attn.")
        index = prefix.removeprefix("model.layers.")
        return (rest in SHARED_LAYER_KV and prefix.startswith("model.layers.") and index.isdigit()
                and config.first_shared_layer <= int(index) < config.num_hidden_layers)

    @property
    def logit_softcap(self) -> float | None:
        return self.config.final_logit_softcapping

    def __call__(self, input_ids, aux_layer_ids=None, positions=None, segment_ids=None):
        out = super().__call__(input_ids, aux_layer_ids, positions, segment_ids)
        return out._replace(logits=soft_cap(out.logits, self.config.final_logit_softcapping))

"""Llama-family frozen target (``LlamaForCausalLM`` and ``Qwen3ForCausalLM``) in plain JAX.

Read top to bottom: config -> HF weight map (+ init and HF export) -> decoder layer and its
schedule -> Target class. Embedding, RoPE, the tap-split scan, final norm, logits and cached
decoding are the shared skeleton's (decoder.py).

Differences handled by one code path:
  * Qwen3 adds a per-head RMSNorm on q and k (``q_norm``/``k_norm`` over head_dim, before RoPE) and
    usually has ``head_dim != hidden_size / num_attention_heads``. Neither has attention biases.
  * GQA (num_key_value_heads <= num_attention_heads), tied or untied embeddings,
    RoPE default / linear / llama3 (see ``layers/rope.py``).
Not supported (rejected with a clear error): attention_bias / mlp_bias, activations other than
SiLU, sliding-window attention, partial rotary, other rope types.

Params are nested dicts; decoder layers are stacked along a leading layer axis so the forward can
``lax.scan`` spans of layers. Kernels use x@W layout [in, out] (HF weight transposed).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.layers.rope import RopeSpec, rope_spec_from_hf
from specjax.targets.base import Target, WeightSpec, resolve_hf_config, tree_get, tree_set
from specjax.targets.decoder import Decoder, StackInputs, attention_ffn_block, swiglu
from specjax.targets.hf_keys import HFKey, attention_keys, check_gqa, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers import decoding
from specjax.targets.layers.attention import AttentionConfig
from specjax.targets.layers.scan import index_layer, scan_layers
from specjax.targets.loading import write_safetensors
from specjax.targets.fp8_compute import checkpoint_config, device_weight_specs, fp8_compute_params, is_fp8
from specjax.targets.quantized import Fp8BlockQuant, weight_quant_from_hf
from specjax.targets.registry import model_type_of, register

LLAMA_ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
# config.json keys <-> config fields (from_hf reads them, to_hf writes them; rope: layers/rope.py)
HF_KEYS = (HFKey("num_hidden_layers"),) + attention_keys(max_position_embeddings=2048)


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class LlamaTargetConfig:
    """Hashable subset of the HF config that the forward needs (plus one runtime knob)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    rope: RopeSpec = RopeSpec()
    # every layer attends to the last sliding_window positions (Mistral, Phi-3; None = full causal)
    sliding_window: int | None = None
    weight_quant: Fp8BlockQuant | None = None  # an FP8 release's block-scaled weights (targets/quantized.py)
    kernels: KernelChoices = KernelChoices()  # runtime option, not part of the HF config
    compute_dtype: str = "bfloat16"  # runtime option: "fp8" = FP8 projection GEMMs (targets/fp8_compute.py)

    @property
    def base_architecture(self) -> str:
        """The dense architecture whose layers run (a looped config names its loop's)."""
        return self.architecture

    @property
    def qk_norm(self) -> bool:
        return self.base_architecture == "Qwen3ForCausalLM"

    @property
    def model_type(self) -> str:
        return model_type_of(self.base_architecture)

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig.of(self, qk_norm=self.qk_norm)

    @property
    def num_virtual_layers(self) -> int:
        return self.num_hidden_layers

    def virtual_layers(self) -> tuple[int, ...]:
        """Physical layer id of each layer application, in order (looped.py repeats a span)."""
        return tuple(range(self.num_hidden_layers))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "LlamaTargetConfig":
        """From an HF config dict (config.json contents, or ``PretrainedConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, LLAMA_ARCHS, "LlamaTargetConfig",
                                     unsupported_flags=("attention_bias", "mlp_bias"), silu_keys=("hidden_act",))
        layer_types = hf.get("layer_types") or []
        if hf.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{arch} with sliding-window attention layers is not supported")
        kw = dict(architecture=arch, rope=rope_spec_from_hf(hf), weight_quant=weight_quant_from_hf(hf, arch),
                  **read_hf_keys(HF_KEYS, hf))
        kw.update(overrides)
        cfg = cls(**kw)
        check_gqa(cfg)
        return cfg

    @classmethod
    def create(cls, **kwargs) -> "LlamaTargetConfig":
        """A config for a new (toy) model from keyword args; see :func:`hf_config_dict`."""
        return cls.from_hf(hf_config_dict(**kwargs))

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        d = hf_config_dict(self.architecture, **hf_values(HF_KEYS, self), rope_parameters=self.rope.to_hf(),
                           dtype=dtype)
        if self.weight_quant is not None:
            d["quantization_config"] = self.weight_quant.to_hf()
        return d


def hf_config_dict(
    architecture: str = "LlamaForCausalLM",
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    rms_norm_eps: float = 1e-6,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    rope_theta: float = 10000.0,
    rope_parameters: Mapping[str, Any] | None = None,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Write an HF config.json dict without torch/transformers (architectures + model_type set).

    ``rope_parameters`` is the transformers-5 dict, e.g. ``{"rope_type": "llama3", "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``;
    its ``rope_theta`` defaults to ``rope_theta``.
    """
    if architecture not in LLAMA_ARCHS:
        raise ValueError(f"hf_config_dict supports {LLAMA_ARCHS}, got {architecture!r}")
    rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    rope.update(rope_parameters or {})
    d: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type_of(architecture),
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads or num_attention_heads,
        "head_dim": head_dim or hidden_size // num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": rope,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": dtype,
    }
    if architecture == "LlamaForCausalLM":
        d["mlp_bias"] = False
    else:
        d["use_sliding_window"] = False
        d["sliding_window"] = None
    rope_spec_from_hf(d)  # fail early on a bad rope dict
    return d


# =============================================================================================
# HF weight map: one row per tensor. "{i}" rows are stacked on a leading layer axis.
# transpose=True: HF nn.Linear weight [out, in] <-> specjax kernel [in, out].
# =============================================================================================
def weight_specs(cfg: LlamaTargetConfig) -> list[WeightSpec]:
    L, D, F, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    hd = cfg.head_dim
    rows = [
        # hf name                                    specjax path                                     T?     shape          logical axes
        ("model.embed_tokens.weight",                ("embed_tokens", "embedding"),                   False, (V, D),        ("vocab", "embed")),
        ("model.layers.{i}.input_layernorm.weight",  ("layers", "input_layernorm", "scale"),          False, (L, D),        ("layers", "norm")),
        ("model.layers.{i}.self_attn.q_proj.weight", ("layers", "self_attn", "q_proj", "kernel"),     True,  (L, D, q_dim), ("layers", "embed", "heads")),
        ("model.layers.{i}.self_attn.k_proj.weight", ("layers", "self_attn", "k_proj", "kernel"),     True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        ("model.layers.{i}.self_attn.v_proj.weight", ("layers", "self_attn", "v_proj", "kernel"),     True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        ("model.layers.{i}.self_attn.o_proj.weight", ("layers", "self_attn", "o_proj", "kernel"),     True,  (L, q_dim, D), ("layers", "heads", "embed")),
        ("model.layers.{i}.self_attn.q_norm.weight", ("layers", "self_attn", "q_norm", "scale"),      False, (L, hd),       ("layers", "head_dim")),
        ("model.layers.{i}.self_attn.k_norm.weight", ("layers", "self_attn", "k_norm", "scale"),      False, (L, hd),       ("layers", "head_dim")),
        ("model.layers.{i}.post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale"), False, (L, D), ("layers", "norm")),
        ("model.layers.{i}.mlp.gate_proj.weight",    ("layers", "mlp", "gate_proj", "kernel"),        True,  (L, D, F),     ("layers", "embed", "mlp")),
        ("model.layers.{i}.mlp.up_proj.weight",      ("layers", "mlp", "up_proj", "kernel"),          True,  (L, D, F),     ("layers", "embed", "mlp")),
        ("model.layers.{i}.mlp.down_proj.weight",    ("layers", "mlp", "down_proj", "kernel"),        True,  (L, F, D),     ("layers", "mlp", "embed")),
        ("model.norm.weight",                        ("norm", "scale"),                               False, (D,),          ("norm",)),
        ("lm_head.weight",                           ("lm_head", "kernel"),                           True,  (D, V),        ("embed", "vocab")),
    ]
    specs = []
    for hf_name, path, transpose, shape, axes in rows:
        if path[-2] in ("q_norm", "k_norm") and not cfg.qk_norm:
            continue  # q_norm / k_norm exist only in Qwen3
        if path[0] == "lm_head" and cfg.tie_word_embeddings:
            continue  # tied: logits use the embedding table, nothing on disk
        specs.append(WeightSpec(hf_name, path, transpose, shape, axes))
    return device_weight_specs(specs, cfg)


# =============================================================================================
# Init (toy targets for tests and smoke runs) and HF export (the inverse of the weight map)
# =============================================================================================
def init_params(cfg: LlamaTargetConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params: normal(0, 0.02) matrices, ones for norm scales (with fp8 compute: those, then
    quantized as a loaded checkpoint is)."""
    specs = weight_specs(checkpoint_config(cfg))
    keys = jax.random.split(key, len(specs))
    params: dict = {}
    for spec, k in zip(specs, keys):
        if spec.path[-1] == "scale":
            value = jnp.ones(spec.shape, dtype)
        else:
            value = (0.02 * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)
        tree_set(params, spec.path, value)
    return fp8_compute_params(params, weight_specs(cfg), cfg.weight_quant) if is_fp8(cfg) else params


def save_hf_checkpoint(
    params: dict, cfg: LlamaTargetConfig, out_dir: str | os.PathLike, hf_config: Mapping[str, Any] | None = None
) -> None:
    """Write ``config.json`` + ``model.safetensors`` (HF names and layouts) that transformers loads.

    ``hf_config`` (e.g. ``target.hf_config``) is written when given, else ``cfg.to_hf()``; its dtype
    field is set to the params dtype. Tensors are streamed one at a time (single-host params).
    """

    specs = weight_specs(cfg)
    dtype = np.dtype(params["embed_tokens"]["embedding"].dtype)
    config = dict(hf_config) if hf_config is not None else cfg.to_hf()
    config.pop("torch_dtype", None)
    config["dtype"] = dtype.name
    config.setdefault("architectures", [cfg.architecture])
    config.setdefault("model_type", cfg.model_type)

    entries = []  # (hf name, spec, layer index or None)
    for spec in specs:
        leaf_shape = tuple(tree_get(params, spec.path).shape)
        if leaf_shape != spec.shape:
            raise ValueError(f"param {'/'.join(spec.path)} has shape {leaf_shape}, config expects {spec.shape}")
        layers = range(cfg.num_hidden_layers) if spec.stacked else [None]
        entries += [(spec.hf_name.format(i=i), spec, i) for i in layers]

    def arrays():
        for spec in specs:
            leaf = np.asarray(jax.device_get(tree_get(params, spec.path)))
            for i in range(cfg.num_hidden_layers) if spec.stacked else [None]:
                a = leaf if i is None else leaf[i]
                yield np.ascontiguousarray(a.T if spec.transpose else a)

    os.makedirs(out_dir, exist_ok=True)
    header = [(name, spec.hf_shape, np.dtype(tree_get(params, spec.path).dtype)) for name, spec, _ in entries]
    write_safetensors(os.path.join(out_dir, "model.safetensors"), header, arrays(), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


# =============================================================================================
# Decoder layer and schedule (the skeleton around them: decoder.py)
# =============================================================================================
def decoder_layer(lp: dict, cfg: LlamaTargetConfig, x_btd, inputs: StackInputs, cache=None, layer=None):
    """x + attn(norm(x)), then + SwiGLU(norm(x)): (new x, new cache or None)."""
    norms = (lp["input_layernorm"]["scale"], lp["post_attention_layernorm"]["scale"])
    return attention_ffn_block(lp["self_attn"], cfg, x_btd, inputs, norms, swiglu(lp["mlp"]), cache, layer)


def run_layers(params: dict, cfg: LlamaTargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """The decoder layers in ``cfg.virtual_layers()`` order (every layer once for Llama; the unroll
    for a looped target), one scan per span between taps; virtual layer v uses cache row v."""

    def step(carry, layer):
        (x, cache), (i, v) = carry, layer  # physical layer i applied as virtual layer v
        return decoder_layer(index_layer(params["layers"], i), cfg, x, inputs, cache, v)

    xs = (np.asarray(cfg.virtual_layers(), np.int32), np.arange(cfg.num_virtual_layers, dtype=np.int32))
    return scan_layers(step, carry, xs, aux_ids, tapped=lambda carry: carry[0])


# Cached decoding: a static-size KV cache {"k", "v"} [Lv, B, S, Hkv, D] with one row per (virtual)
# layer; rollback = a shorter valid length (layers/attention.py "KV cache").
DECODER = Decoder(run_layers)
forward, decode_chunk, init_cache = DECODER.forward, DECODER.decode_chunk, DECODER.init_cache
embed_table, lm_head_weight = DECODER.embed_table, DECODER.lm_head_weight


def logits(params: dict, cfg: LlamaTargetConfig, final_hidden_btd: jax.Array) -> jax.Array:
    """fp32 logits with fp32 accumulation."""
    return decoding.picked_logits(final_hidden_btd, lm_head_weight(params, cfg))


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(*LLAMA_ARCHS)  # Qwen3 = Llama + per-head q/k RMSNorm, explicit head_dim
class LlamaTarget(Target):
    """Frozen Llama / Qwen3 target (see module docstring)."""

    config_class = LlamaTargetConfig
    decoder = DECODER
    fp8_compute = True  # attention and MLP projections go through layers/linear.dense
    weight_specs = staticmethod(weight_specs)
    init_params = staticmethod(init_params)

    def save_hf_checkpoint(self, out_dir: str | os.PathLike) -> None:
        save_hf_checkpoint(self.params, self.config, out_dir, hf_config=self.hf_config)

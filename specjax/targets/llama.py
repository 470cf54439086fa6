"""Llama-family frozen target (``LlamaForCausalLM`` and ``Qwen3ForCausalLM``) in plain JAX.

Read top to bottom: config -> HF weight map (+ init and HF export) -> decoder layer -> forward ->
cached decoding -> Target class.

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

from specjax.targets.base import Target, WeightSpec, resolve_hf_config, tree_get, tree_set, validate_aux_layer_ids
from specjax.targets.layers import decoding
from specjax.targets.layers.attention import AttentionConfig, attention_block, attention_inputs
from specjax.targets.layers.mlp import swiglu_mlp
from specjax.targets.layers.norms import rms_norm
from specjax.targets.layers.rope import RopeSpec, inverse_frequencies, rope_cos_sin, rope_spec_from_hf
from specjax.targets.layers.scan import index_layer, scan_layers
from specjax.targets.loading import write_safetensors
from specjax.targets.registry import model_type_of, register

LLAMA_ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")


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
    # Runtime option, not part of the HF config: split attention queries into blocks of this many
    # tokens (0 = never) to bound the [B, N, Tq, T] score buffer on long sequences.
    attention_q_block: int = 0
    # Runtime option (kernels.target_attention): the training forward's self-attention path, "auto",
    # "plain" or a specjax_kernels.ttt_attention implementation (see layers/attention.py)
    attention_implementation: str = "auto"
    # Runtime option (kernels.decode_attention): cached decoding's attention (layers/attention.py)
    decode_attention_implementation: str = "auto"

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "Qwen3ForCausalLM"

    @property
    def model_type(self) -> str:
        return model_type_of(self.architecture)

    @property
    def attention(self) -> AttentionConfig:
        return AttentionConfig.of(self, qk_norm=self.qk_norm)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "LlamaTargetConfig":
        """From an HF config dict (config.json contents, or ``PretrainedConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, LLAMA_ARCHS, "LlamaTargetConfig",
                                     unsupported_flags=("attention_bias", "mlp_bias"), silu_keys=("hidden_act",))
        layer_types = hf.get("layer_types") or []
        if hf.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise ValueError(f"{arch} with sliding-window attention layers is not supported")
        heads = int(hf["num_attention_heads"])
        kw = dict(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rope=rope_spec_from_hf(hf),
        )
        kw.update(overrides)
        cfg = cls(**kw)
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={cfg.num_key_value_heads}"
            )
        return cfg

    @classmethod
    def create(cls, **kwargs) -> "LlamaTargetConfig":
        """A config for a new (toy) model from keyword args; see :func:`hf_config_dict`."""
        return cls.from_hf(hf_config_dict(**kwargs))

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        return hf_config_dict(
            architecture=self.architecture,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=self.rope.to_hf(),
            dtype=dtype,
        )


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
    return specs


# =============================================================================================
# Init (toy targets for tests and smoke runs) and HF export (the inverse of the weight map)
# =============================================================================================
def init_params(cfg: LlamaTargetConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params: normal(0, 0.02) matrices, ones for norm scales."""
    specs = weight_specs(cfg)
    keys = jax.random.split(key, len(specs))
    params: dict = {}
    for spec, k in zip(specs, keys):
        if spec.path[-1] == "scale":
            value = jnp.ones(spec.shape, dtype)
        else:
            value = (0.02 * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)
        tree_set(params, spec.path, value)
    return params


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
# Decoder layer
# =============================================================================================
def decoder_layer(lp: dict, cfg: LlamaTargetConfig, x_btd, rope, mask, *, cache: dict | None = None, layer=None,
                  slots_bt=None):
    """x + attn(norm(x)), then + SwiGLU(norm(x)): (new x, new cache or None). ``cache``/``layer``/
    ``slots_bt``: cached decoding (see layers/attention.attention_block)."""
    eps = cfg.rms_norm_eps
    h = rms_norm(x_btd, lp["input_layernorm"]["scale"], eps)
    o, cache = attention_block(lp["self_attn"], cfg.attention, h, mask, rope, cache=cache, layer=layer,
                               slots_bt=slots_bt)
    x_btd = x_btd + o
    h = rms_norm(x_btd, lp["post_attention_layernorm"]["scale"], eps)
    mlp = lp["mlp"]
    x_btd = x_btd + swiglu_mlp(h, mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"], mlp["down_proj"]["kernel"])
    return x_btd, cache


# =============================================================================================
# Forward
# =============================================================================================
def forward(
    params: dict,
    cfg: LlamaTargetConfig,
    input_ids_bt: jax.Array,
    *,
    aux_layer_ids: Sequence[int] = (),
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, tuple]:
    """Pure forward. Returns (final_hidden [B,T,D] after the final norm, aux tuple of [B,T,D]).

    aux id k is the residual stream after decoder layer k (HF ``hidden_states[k+1]``; for
    k = L-1 this is the pre-final-norm state, whereas HF's last hidden_states entry is post-norm).
    The layer stack is split at the taps, so only the tapped states are kept, not all L outputs.
    Compute runs in the params dtype; RMSNorm statistics and the softmax run in fp32.
    """
    aux_ids = validate_aux_layer_ids(aux_layer_ids, cfg.num_hidden_layers)
    return forward_over(params, cfg, input_ids_bt, range(cfg.num_hidden_layers), aux_ids, positions, segment_ids)


def forward_over(params: dict, cfg: LlamaTargetConfig, input_ids_bt: jax.Array, layer_ids: Sequence[int],
                 aux_ids: Sequence[int], positions: jax.Array | None, segment_ids: jax.Array | None):
    """:func:`forward` through the decoder layers ``layer_ids`` in this order (every layer once for
    Llama; the unroll for a looped target); aux id k is the state after the k-th of them."""
    x = jnp.take(params["embed_tokens"]["embedding"], input_ids_bt, axis=0)
    mask, rope = attention_inputs(input_ids_bt.shape, positions, segment_ids, cfg.rope, cfg.head_dim, x.dtype)

    def step(x, i):
        return decoder_layer(index_layer(params["layers"], i), cfg, x, rope, mask)[0]

    x, aux = scan_layers(step, x, np.asarray(layer_ids, np.int32), aux_ids)
    return rms_norm(x, params["norm"]["scale"], cfg.rms_norm_eps), aux


def embed_table(params: dict, cfg: LlamaTargetConfig | None = None) -> jax.Array:
    """[V, D] token embedding table."""
    return params["embed_tokens"]["embedding"]


def lm_head_weight(params: dict, cfg: LlamaTargetConfig) -> jax.Array:
    """[V, D] output projection in HF layout (tied -> the embedding table)."""
    if cfg.tie_word_embeddings:
        return params["embed_tokens"]["embedding"]
    return params["lm_head"]["kernel"].T


def logits(params: dict, cfg: LlamaTargetConfig, final_hidden_btd: jax.Array) -> jax.Array:
    """fp32 logits with fp32 accumulation."""
    return jnp.einsum(
        "btd,vd->btv", final_hidden_btd, lm_head_weight(params, cfg), preferred_element_type=jnp.float32
    )


# =============================================================================================
# Cached decoding (generation, regeneration, speculative decoding)
# =============================================================================================
# A static-size KV cache {"k", "v"} [L, B, S, Hkv, D]; rollback = a shorter valid length. The
# layout, the slot rules and the mask: layers/attention.py "KV cache".
def init_kv_cache(cfg: LlamaTargetConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed KV cache for `max_len` slots per row (rounded up by ``layers.attention.cache_size_for``)."""
    return decoding.init_kv_cache(cfg.num_hidden_layers, batch_size, max_len, cfg.num_key_value_heads, cfg.head_dim,
                                  dtype)


def decode_chunk(
    params: dict,
    cfg: LlamaTargetConfig,
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
    """PURE cached forward of a chunk of new tokens. Returns (fp32 logits, aux tuple [B,T,D] at
    `aux_layer_ids`, final hidden [B,T,D] after the final norm, new cache).

    input_ids/positions [B,T] int (positions are the RoPE positions, independent of slots);
    start [B]: the row's valid cache length, where the chunk is written. chunk_mask [B,T,T] bool
    (default causal). logits [B,T,V], or [B,n,V] at chunk indices `logits_index` [B,n] (a prefill
    then never forms [B,T,V]). Same layers and op order as :func:`forward`.
    """
    aux_ids = validate_aux_layer_ids(aux_layer_ids, cfg.num_hidden_layers)
    start_b, mask, slots = decoding.chunk_inputs(cache, input_ids_bt, start_b, chunk_mask_btt, valid_from_b,
                                                 cfg.attention)
    x = jnp.take(params["embed_tokens"]["embedding"], input_ids_bt, axis=0)
    rope = rope_cos_sin(positions_bt, inverse_frequencies(cfg.rope, cfg.head_dim), x.dtype)

    def step(carry, i):
        x, c = carry
        return decoder_layer(index_layer(params["layers"], i), cfg, x, rope, mask, cache=c, layer=i, slots_bt=slots)

    (x, cache), aux = scan_layers(step, (x, cache), np.arange(cfg.num_hidden_layers, dtype=np.int32), aux_ids,
                                  tapped=lambda carry: carry[0])
    final = rms_norm(x, params["norm"]["scale"], cfg.rms_norm_eps)
    return decoding.picked_logits(final, lm_head_weight(params, cfg), logits_index), aux, final, cache


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(*LLAMA_ARCHS)  # Qwen3 = Llama + per-head q/k RMSNorm, explicit head_dim
class LlamaTarget(Target):
    """Frozen Llama / Qwen3 target (see module docstring)."""

    config_class = LlamaTargetConfig
    forward_fn = staticmethod(forward)
    embed_fn = staticmethod(embed_table)
    lm_head_fn = staticmethod(lm_head_weight)
    decode_fn, init_cache_fn = staticmethod(decode_chunk), staticmethod(init_kv_cache)  # cached decoding

    @classmethod
    def weight_specs(cls, config: LlamaTargetConfig) -> list[WeightSpec]:
        return weight_specs(config)

    @classmethod
    def init(cls, config: LlamaTargetConfig, key: jax.Array, dtype=jnp.float32) -> "LlamaTarget":
        """A random toy target (hf_config = ``config.to_hf()``)."""
        return cls(config, config.to_hf(np.dtype(dtype).name), init_params(config, key, dtype))

    def save_hf_checkpoint(self, out_dir: str | os.PathLike) -> None:
        save_hf_checkpoint(self.params, self.config, out_dir, hf_config=self.hf_config)

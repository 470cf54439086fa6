"""Llama-family frozen target (``LlamaForCausalLM`` and ``Qwen3ForCausalLM``) in plain JAX.

Read top to bottom: config -> HF weight map -> init -> forward -> HF export -> Target class.

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

from specjax.targets.base import Target, WeightSpec, tree_get, tree_set, validate_aux_layer_ids, split_at_taps
from specjax.targets.layers.attention import dot_product_attention, segment_causal_mask
from specjax.targets.layers.mlp import swiglu_mlp
from specjax.targets.layers.norms import rms_norm
from specjax.targets.layers.rope import RopeSpec, apply_rope, inverse_frequencies, rope_cos_sin, rope_spec_from_hf

LLAMA_ARCHS = ("LlamaForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}


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

    @property
    def qk_norm(self) -> bool:
        return self.architecture == "Qwen3ForCausalLM"

    @property
    def model_type(self) -> str:
        return _MODEL_TYPES[self.architecture]

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "LlamaTargetConfig":
        """From an HF config dict (config.json contents, or ``PretrainedConfig.to_dict()``)."""
        if not isinstance(hf, Mapping) and hasattr(hf, "to_dict"):
            hf = hf.to_dict()
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(
            hf.get("model_type"), hf.get("model_type")
        )
        if arch not in LLAMA_ARCHS:
            raise ValueError(f"LlamaTargetConfig handles {LLAMA_ARCHS}, got architecture {arch!r}")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{arch} with {flag}=true is not supported by specjax targets")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (only 'silu')")
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
        "model_type": _MODEL_TYPES[architecture],
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


def param_logical_axes(cfg: LlamaTargetConfig) -> dict:
    tree: dict = {}
    for spec in weight_specs(cfg):
        tree_set(tree, spec.path, spec.axes)
    return tree


# =============================================================================================
# Init (toy targets for tests and smoke runs)
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


# =============================================================================================
# Forward
# =============================================================================================
def _decoder_layer(lp: dict, cfg: LlamaTargetConfig, x_btd, cos_bth, sin_bth, mask_btt):
    b, t, _ = x_btd.shape
    eps = cfg.rms_norm_eps
    attn = lp["self_attn"]
    h = rms_norm(x_btd, lp["input_layernorm"]["scale"], eps)
    q = (h @ attn["q_proj"]["kernel"]).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    k = (h @ attn["k_proj"]["kernel"]).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    v = (h @ attn["v_proj"]["kernel"]).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    if cfg.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
        q = rms_norm(q, attn["q_norm"]["scale"], eps)
        k = rms_norm(k, attn["k_norm"]["scale"], eps)
    q = apply_rope(q, cos_bth, sin_bth)
    k = apply_rope(k, cos_bth, sin_bth)
    o = dot_product_attention(q, k, v, mask_btt, scale=cfg.head_dim**-0.5, q_block=cfg.attention_q_block,
                              implementation=cfg.attention_implementation)
    x_btd = x_btd + o.reshape(b, t, -1) @ attn["o_proj"]["kernel"]
    h = rms_norm(x_btd, lp["post_attention_layernorm"]["scale"], eps)
    mlp = lp["mlp"]
    return x_btd + swiglu_mlp(h, mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"], mlp["down_proj"]["kernel"])


def _run_layers(layers: dict, cfg: LlamaTargetConfig, x_btd, start: int, stop: int, cos, sin, mask):
    """Apply decoder layers [start, stop) with one lax.scan.

    The scan runs over layer *indices* and slices the full stacked weights inside the body, rather
    than scanning over ``layers[start:stop]``: a static slice of the stack fed to a loop would make
    XLA materialise a copy of those weights, while a per-step dynamic index reads one layer in place.
    """
    if stop <= start:
        return x_btd

    def body(x, i):
        lp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), layers)
        return _decoder_layer(lp, cfg, x, cos, sin, mask), None

    x_btd, _ = jax.lax.scan(body, x_btd, jnp.arange(start, stop, dtype=jnp.int32))
    return x_btd


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
    x = jnp.take(params["embed_tokens"]["embedding"], input_ids_bt, axis=0)
    mask, cos, sin = attention_inputs(cfg, input_ids_bt.shape, positions, segment_ids, x.dtype)
    aux = []
    for a, b, tapped in split_at_taps(0, cfg.num_hidden_layers, aux_ids):
        x = _run_layers(params["layers"], cfg, x, a, b, cos, sin, mask)
        if tapped:
            aux.append(x)
    return rms_norm(x, params["norm"]["scale"], cfg.rms_norm_eps), tuple(aux)


def attention_inputs(cfg, shape_bt, positions, segment_ids, dtype):
    """(segment-causal mask, RoPE cos, sin) shared by every layer; positions default to arange and
    segment ids to one segment per row. Used by all RoPE targets of the Llama family."""
    b, t = shape_bt
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    cos, sin = rope_cos_sin(positions, inverse_frequencies(cfg.rope, cfg.head_dim), dtype)
    return segment_causal_mask(segment_ids), cos, sin


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
# HF export: the inverse of the weight map
# =============================================================================================
def save_hf_checkpoint(
    params: dict, cfg: LlamaTargetConfig, out_dir: str | os.PathLike, hf_config: Mapping[str, Any] | None = None
) -> None:
    """Write ``config.json`` + ``model.safetensors`` (HF names and layouts) that transformers loads.

    ``hf_config`` (e.g. ``target.hf_config``) is written when given, else ``cfg.to_hf()``; its dtype
    field is set to the params dtype. Tensors are streamed one at a time (single-host params).
    """
    from specjax.targets.loading import write_safetensors

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
# Cached decoding (generation, regeneration, speculative decoding)
# =============================================================================================
# The cache is a fixed-size buffer {"k", "v"}: [L, B, S, Hkv, D] each, S static. A call runs a
# chunk of T new tokens per row, writes their K/V at slots start[b] .. start[b]+T-1 and attends to
# every slot < start[b] (the row's valid prefix) plus the chunk itself under `chunk_mask`
# (causal by default; a tree mask for tree verification). Slots >= start + T are never read, so
# rolling back rejected draft tokens is just passing a smaller `start` next time: the stale
# entries are masked, then overwritten. Writes past S are dropped (never clamped onto live slots).
CACHE_MULTIPLE = 256  # static cache sizes are rounded up to this, so few distinct shapes compile


def cache_size_for(max_len: int, multiple: int = CACHE_MULTIPLE) -> int:
    """The static cache length for `max_len` slots (rounded up to a multiple, at least one)."""
    if max_len < 1:
        raise ValueError(f"cache max_len must be >= 1, got {max_len}")
    return -(-int(max_len) // multiple) * multiple


def init_kv_cache(cfg: LlamaTargetConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed KV cache for `max_len` slots per row (rounded up by :func:`cache_size_for`)."""
    shape = (cfg.num_hidden_layers, int(batch_size), cache_size_for(max_len), cfg.num_key_value_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def cache_attention_mask(start_b: jax.Array, num_slots: int, chunk_mask_btt: jax.Array,
                         valid_from_b: jax.Array | None = None) -> jax.Array:
    """bool [B, T, S]: slot j is visible to chunk query i iff valid_from[b] <= j < start[b], or j is
    chunk slot start[b]+c with chunk_mask[b, i, c]. (valid_from > 0 skips left padding.)"""
    b, t, _ = chunk_mask_btt.shape
    rel = jnp.arange(num_slots, dtype=jnp.int32)[None, :] - start_b[:, None]  # [B, S] slot - start
    prefix = rel < 0
    if valid_from_b is not None:
        prefix = prefix & (jnp.arange(num_slots, dtype=jnp.int32)[None, :] >= valid_from_b[:, None])
    in_chunk = (rel >= 0) & (rel < t)
    idx = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (b, t, num_slots))
    chunk = jnp.take_along_axis(chunk_mask_btt, idx, axis=2)
    return prefix[:, None, :] | (in_chunk[:, None, :] & chunk)


def _cached_decoder_layer(lp: dict, cfg: LlamaTargetConfig, x_btd, cos_bth, sin_bth, cache, layer, slots_bt, mask_bts):
    """`_decoder_layer` with the new K/V written into the cache at `slots` and attention over the
    whole cache row (same math and op order as the uncached layer)."""
    b, t, _ = x_btd.shape
    eps = cfg.rms_norm_eps
    attn = lp["self_attn"]
    h = rms_norm(x_btd, lp["input_layernorm"]["scale"], eps)
    q = (h @ attn["q_proj"]["kernel"]).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
    k = (h @ attn["k_proj"]["kernel"]).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    v = (h @ attn["v_proj"]["kernel"]).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, attn["q_norm"]["scale"], eps)
        k = rms_norm(k, attn["k_norm"]["scale"], eps)
    q = apply_rope(q, cos_bth, sin_bth)
    k = apply_rope(k, cos_bth, sin_bth)
    rows = jnp.arange(b)[:, None]
    # scatter into the carried full cache (in place inside the layer loop); out-of-range slots drop
    kc = cache["k"].at[layer, rows, slots_bt].set(k.astype(cache["k"].dtype), mode="drop")
    vc = cache["v"].at[layer, rows, slots_bt].set(v.astype(cache["v"].dtype), mode="drop")
    k_all = jax.lax.dynamic_index_in_dim(kc, layer, axis=0, keepdims=False).astype(q.dtype)
    v_all = jax.lax.dynamic_index_in_dim(vc, layer, axis=0, keepdims=False).astype(q.dtype)
    o = dot_product_attention(q, k_all, v_all, mask_bts, scale=cfg.head_dim**-0.5, q_block=cfg.attention_q_block)
    x_btd = x_btd + o.reshape(b, t, -1) @ attn["o_proj"]["kernel"]
    h = rms_norm(x_btd, lp["post_attention_layernorm"]["scale"], eps)
    mlp = lp["mlp"]
    x_btd = x_btd + swiglu_mlp(h, mlp["gate_proj"]["kernel"], mlp["up_proj"]["kernel"], mlp["down_proj"]["kernel"])
    return x_btd, {"k": kc, "v": vc}


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
    then never forms [B,T,V]).
    """
    aux_ids = validate_aux_layer_ids(aux_layer_ids, cfg.num_hidden_layers)
    b, t = input_ids_bt.shape
    num_slots = cache["k"].shape[2]
    start_b = jnp.asarray(start_b, jnp.int32).reshape(b)
    if chunk_mask_btt is None:
        chunk_mask_btt = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    mask = cache_attention_mask(start_b, num_slots, chunk_mask_btt, valid_from_b)
    slots = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    x = jnp.take(params["embed_tokens"]["embedding"], input_ids_bt, axis=0)
    cos, sin = rope_cos_sin(positions_bt, inverse_frequencies(cfg.rope, cfg.head_dim), x.dtype)
    layers = params["layers"]

    def body(carry, i):
        x, c = carry
        lp = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), layers)
        return _cached_decoder_layer(lp, cfg, x, cos, sin, c, i, slots, mask), None

    aux = []
    for a, bnd, tapped in split_at_taps(0, cfg.num_hidden_layers, aux_ids):
        (x, cache), _ = jax.lax.scan(body, (x, cache), jnp.arange(a, bnd, dtype=jnp.int32))
        if tapped:
            aux.append(x)
    final = rms_norm(x, params["norm"]["scale"], cfg.rms_norm_eps)
    picked = final if logits_index is None else jnp.take_along_axis(final, logits_index[:, :, None], axis=1)
    logits_btv = logits(params, cfg, picked)
    return logits_btv, tuple(aux), final, cache


# =============================================================================================
# Target wrapper
# =============================================================================================
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

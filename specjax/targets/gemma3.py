"""Gemma 3 frozen target (``Gemma3ForCausalLM``, the text model) on the shared decoder.

Read top to bottom: config (+ its HF key table and RoPE pair) -> HF weight map and init -> decoder
layer and schedule -> Decoder hooks -> Target class.

What a Gemma 3 layer is (transformers' Gemma3TextModel):
  * every RMSNorm multiplies by ``1 + weight`` in fp32 and casts after (``layers/norms.py``
    ``unit_offset``), including the per-head q/k norms before RoPE;
  * four norms per layer: input, post-attention (on the attention output, before the residual
    add), pre-feed-forward and post-feed-forward (on the MLP output, before the residual add);
  * the feed-forward is GeGLU with tanh-approximated GELU (``gelu_pytorch_tanh``);
  * attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not head_dim ** -0.5;
  * the embedding is multiplied by sqrt(hidden_size), rounded to the weight dtype as transformers
    does (bf16: sqrt(3072) = 55.5);
  * ``layer_types``: "sliding_attention" layers attend to the last ``sliding_window`` positions and
    use the local RoPE (``rope_local_base_freq``, default 10k); "full_attention" layers attend to the
    whole prefix with the global RoPE (theta 1M; linear scaling 8 on the 4B-27B models). Without
    ``layer_types``, every ``sliding_window_pattern``-th layer (default 6) is global.
The layers share one scan: each carries its kind as a scanned flag that picks the mask's window and
the RoPE table (``decoder.layer_mask``: in training a traced window on the lazy mask; in decoding the
full or the windowed cache mask).

Refused with an error naming the key: attention or final-logit soft-capping (Gemma 2; Gemma 3 sets
neither), bidirectional attention, attention biases, activations other than gelu_pytorch_tanh.
Gemma3ForConditionalGeneration (the multimodal 4B-27B checkpoints) is not read yet: its text weights
sit under another prefix and its config under ``text_config``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec, inverse_frequencies, rope_cos_sin, rope_spec_from_hf
from specjax.targets.base import Target, WeightSpec, resolve_hf_config, tree_set
from specjax.targets.decoder import (Decoder, StackInputs, layer_mask, mixed_window_decode_masks, pick_by_layer)
from specjax.targets.hf_keys import HFKey, attention_keys, check_gqa, hf_values, read_hf_keys
from specjax.targets.kernel_choices import KernelChoices
from specjax.targets.layers.attention import AttentionConfig, attention_block, segment_causal_mask
from specjax.targets.layers.scan import index_layer, scan_layers
from specjax.targets.registry import model_type_of, register

GEMMA3_ARCHS = ("Gemma3ForCausalLM",)
SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_PATTERN = 6  # transformers' Gemma3TextConfig: every 6th layer global when layer_types is absent
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
# config.json keys <-> config fields (RoPE and layer_types: read below)
HF_KEYS = (
    HFKey("num_hidden_layers"),
    HFKey("query_pre_attn_scalar", int, 256),
    HFKey("sliding_window", int, 4096),
) + tuple(HFKey(r.key, r.convert, True) if r.key == "tie_word_embeddings" else r
          for r in attention_keys(max_position_embeddings=131072))
REFUSED_SET = ("attn_logit_softcapping", "final_logit_softcapping")  # must be null


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types is None:
        pattern = int(hf.get("sliding_window_pattern") or DEFAULT_PATTERN)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    types = tuple(types)
    bad = sorted(set(types) - {SLIDING, FULL})
    if bad or len(types) != num_layers:
        raise ValueError(f"layer_types must list {num_layers} entries of {SLIDING!r} / {FULL!r}; got {list(types)}")
    return types


def _rope_pair(hf: Mapping[str, Any]) -> tuple[RopeSpec, RopeSpec]:
    """(global, local) RopeSpecs from either layout: transformers 5's rope_parameters per layer type,
    or the legacy rope_theta + rope_scaling (global) and rope_local_base_freq (local)."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and (FULL in params or SLIDING in params):
        def one(kind):
            p = dict(params.get(kind) or {"rope_type": "default"})
            p.setdefault("rope_theta", DEFAULT_THETA[kind])
            return rope_spec_from_hf({"rope_parameters": p, "max_position_embeddings": hf.get("max_position_embeddings")})
        return one(FULL), one(SLIDING)
    legacy = {k: hf[k] for k in ("rope_scaling", "max_position_embeddings") if hf.get(k) is not None}
    glob = rope_spec_from_hf({**legacy, "rope_theta": hf.get("rope_theta") or DEFAULT_THETA[FULL]})
    local = RopeSpec("default", float(hf.get("rope_local_base_freq") or DEFAULT_THETA[SLIDING]))
    return glob, local


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class Gemma3TargetConfig:
    """Hashable subset of transformers' Gemma3TextConfig that the forward needs (plus runtime knobs)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131072
    query_pre_attn_scalar: int = 256
    sliding_window: int = 4096
    rope: RopeSpec = RopeSpec("default", DEFAULT_THETA[FULL])  # full-attention layers
    rope_local: RopeSpec = RopeSpec("default", DEFAULT_THETA[SLIDING])  # sliding layers
    kernels: KernelChoices = KernelChoices()  # runtime option, not part of the HF config

    @property
    def model_type(self) -> str:
        return model_type_of(self.architecture)

    @property
    def attention(self) -> AttentionConfig:
        return dataclasses.replace(AttentionConfig.of(self, qk_norm=True), qk_norm_unit_offset=True,
                                   softmax_scale=self.query_pre_attn_scalar**-0.5)

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        return tuple(t == SLIDING for t in self.layer_types)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "Gemma3TargetConfig":
        """From an HF config dict (config.json contents, or ``PretrainedConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, GEMMA3_ARCHS, "Gemma3TargetConfig", unsupported_flags=("attention_bias",))
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"{arch}: hidden_activation={act!r} is not supported (Gemma 3 uses gelu_pytorch_tanh)")
        for key in REFUSED_SET:
            if hf.get(key) is not None:
                raise ValueError(f"{arch}: {key}={hf[key]} (Gemma 2's soft-capping) is not supported; Gemma 3 "
                                 f"configs set it to null")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{arch}: use_bidirectional_attention=true (an encoder) cannot be a causal target")
        keys = read_hf_keys(HF_KEYS, hf)
        glob, local = _rope_pair(hf)
        kw = dict(architecture=arch, layer_types=_layer_types(hf, keys["num_hidden_layers"]), rope=glob,
                  rope_local=local, **keys)
        kw.update(overrides)
        cfg = cls(**kw)
        check_gqa(cfg)
        return cfg

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        return {"architectures": [self.architecture], "model_type": self.model_type, **hf_values(HF_KEYS, self),
                "layer_types": list(self.layer_types), "hidden_activation": "gelu_pytorch_tanh",
                "rope_parameters": {FULL: self.rope.to_hf(), SLIDING: self.rope_local.to_hf()},
                "attention_bias": False, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                "use_bidirectional_attention": False, "use_cache": True, "dtype": dtype}


# =============================================================================================
# HF weight map (one row per tensor; "{i}" rows stacked on a leading layer axis) and init
# =============================================================================================
def weight_specs(cfg: Gemma3TargetConfig) -> list[WeightSpec]:
    L, D, F, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim, hd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim
    layer = "model.layers.{i}."
    rows = [
        # hf name                              specjax path                                  T?     shape          logical axes
        ("model.embed_tokens.weight",          ("embed_tokens", "embedding"),                False, (V, D),        ("vocab", "embed")),
        (layer + "input_layernorm.weight",     ("layers", "input_layernorm", "scale"),       False, (L, D),        ("layers", "norm")),
        (layer + "self_attn.q_proj.weight",    ("layers", "self_attn", "q_proj", "kernel"),  True,  (L, D, q_dim), ("layers", "embed", "heads")),
        (layer + "self_attn.k_proj.weight",    ("layers", "self_attn", "k_proj", "kernel"),  True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        (layer + "self_attn.v_proj.weight",    ("layers", "self_attn", "v_proj", "kernel"),  True,  (L, D, kv_dim), ("layers", "embed", "kv_heads")),
        (layer + "self_attn.o_proj.weight",    ("layers", "self_attn", "o_proj", "kernel"),  True,  (L, q_dim, D), ("layers", "heads", "embed")),
        (layer + "self_attn.q_norm.weight",    ("layers", "self_attn", "q_norm", "scale"),   False, (L, hd),       ("layers", "head_dim")),
        (layer + "self_attn.k_norm.weight",    ("layers", "self_attn", "k_norm", "scale"),   False, (L, hd),       ("layers", "head_dim")),
        (layer + "post_attention_layernorm.weight", ("layers", "post_attention_layernorm", "scale"), False, (L, D), ("layers", "norm")),
        (layer + "pre_feedforward_layernorm.weight", ("layers", "pre_feedforward_layernorm", "scale"), False, (L, D), ("layers", "norm")),
        (layer + "post_feedforward_layernorm.weight", ("layers", "post_feedforward_layernorm", "scale"), False, (L, D), ("layers", "norm")),
        (layer + "mlp.gate_proj.weight",       ("layers", "mlp", "gate_proj", "kernel"),     True,  (L, D, F),     ("layers", "embed", "mlp")),
        (layer + "mlp.up_proj.weight",         ("layers", "mlp", "up_proj", "kernel"),       True,  (L, D, F),     ("layers", "embed", "mlp")),
        (layer + "mlp.down_proj.weight",       ("layers", "mlp", "down_proj", "kernel"),     True,  (L, F, D),     ("layers", "mlp", "embed")),
        ("model.norm.weight",                  ("norm", "scale"),                            False, (D,),          ("norm",)),
        ("lm_head.weight",                     ("lm_head", "kernel"),                        True,  (D, V),        ("embed", "vocab")),
    ]
    return [WeightSpec(*row) for row in rows if not (row[1][0] == "lm_head" and cfg.tie_word_embeddings)]


def init_params(cfg: Gemma3TargetConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params: normal(0, 0.02) matrices; norm weights normal(0, 0.1) (the norm multiplies by
    1 + weight, so 0 is the identity scale)."""
    specs = weight_specs(cfg)
    params: dict = {}
    for spec, k in zip(specs, jax.random.split(key, len(specs))):
        std = 0.1 if spec.path[-1] == "scale" else 0.02
        tree_set(params, spec.path, (std * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype))
    return params


# =============================================================================================
# Decoder layer and schedule
# =============================================================================================
def gemma_norm(x, scale, cfg: Gemma3TargetConfig):
    return rms_norm(x, scale, cfg.rms_norm_eps, unit_offset=True)


def geglu(p: dict, h):
    """down(gelu_tanh(h @ gate) * (h @ up))."""
    return (jax.nn.gelu(h @ p["gate_proj"]["kernel"], approximate=True) * (h @ p["up_proj"]["kernel"])) @ \
        p["down_proj"]["kernel"]


def decoder_layer(lp: dict, cfg: Gemma3TargetConfig, x_btd, inputs: StackInputs, sliding, cache=None, layer=None):
    """One Gemma 3 layer (module docstring); ``sliding`` the scanned bool flag of this layer's kind."""
    rope = pick_by_layer(sliding, inputs.rope[1], inputs.rope[0])
    h = gemma_norm(x_btd, lp["input_layernorm"]["scale"], cfg)
    o, cache = attention_block(lp["self_attn"], cfg.attention, h, layer_mask(inputs, sliding, cfg.sliding_window),
                               rope, cache=cache, layer=layer,
                               slots_bt=inputs.slots)
    x_btd = x_btd + gemma_norm(o, lp["post_attention_layernorm"]["scale"], cfg)
    h = geglu(lp["mlp"], gemma_norm(x_btd, lp["pre_feedforward_layernorm"]["scale"], cfg))
    return x_btd + gemma_norm(h, lp["post_feedforward_layernorm"]["scale"], cfg), cache


def run_layers(params: dict, cfg: Gemma3TargetConfig, carry, inputs: StackInputs, aux_ids: Sequence[int]):
    """Every layer once, in one scan per span between taps; layer i uses cache row i."""

    def step(carry, xs):
        (x, cache), (i, sliding) = carry, xs
        return decoder_layer(index_layer(params["layers"], i), cfg, x, inputs, sliding, cache, i)

    xs = (np.arange(cfg.num_hidden_layers, dtype=np.int32), np.asarray(cfg.sliding_layers, bool))
    return scan_layers(step, carry, xs, aux_ids, tapped=lambda carry: carry[0])


# =============================================================================================
# Decoder hooks: embedding scale, final norm, the (global, local) RoPE pair and masks, the cache
# =============================================================================================
def _ropes(cfg: Gemma3TargetConfig, positions_bt, dtype):
    return tuple(rope_cos_sin(positions_bt, inverse_frequencies(spec, cfg.head_dim), dtype)
                 for spec in (cfg.rope, cfg.rope_local))


def forward_inputs(cfg: Gemma3TargetConfig, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    b, t = input_ids_bt.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    return StackInputs(segment_causal_mask(segment_ids), _ropes(cfg, positions, dtype))


def decode_inputs(cfg: Gemma3TargetConfig, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt, valid_from_b,
                  logits_index, dtype):
    masks, slots, cache = mixed_window_decode_masks(cfg, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt,
                                                    valid_from_b)
    return StackInputs(masks, _ropes(cfg, positions_bt, dtype), slots=slots), cache


def scale_embeddings(cfg: Gemma3TargetConfig, x):
    return x * jnp.asarray(math.sqrt(cfg.hidden_size), jnp.float32).astype(x.dtype)


def final_norm(params: dict, cfg: Gemma3TargetConfig, x):
    return gemma_norm(x, params["norm"]["scale"], cfg)


# the cache: decoder.kv_cache_per_layer, a K/V row for every layer and the slot positions the windows read
DECODER = Decoder(run_layers, scale_embeddings=scale_embeddings, final_norm=final_norm, forward_inputs=forward_inputs,
                  decode_inputs=decode_inputs)


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(*GEMMA3_ARCHS)
class Gemma3Target(Target):
    """Frozen Gemma 3 text target (see module docstring)."""

    config_class = Gemma3TargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)
    init_params = staticmethod(init_params)

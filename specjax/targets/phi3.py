"""Phi-3 / Phi-4 frozen target (``Phi3ForCausalLM``) on the Llama decoder.

Read top to bottom: config -> HF weight map -> RoPE inputs -> Target class. The decoder layer, its
schedule, init and cached decoding are Llama's (``llama.py``): a Phi-3 layer is a pre-norm
attention + SwiGLU block with two RMSNorms, no biases and SiLU. What differs:
  * On disk the attention projections are one ``qkv_proj`` ([q; k; v] rows) and the feed-forward
    input one ``gate_up_proj`` ([gate; up] rows). Loading reads each part into the separate
    q/k/v and gate/up leaves every Llama-shaped target has (rows of the fused tensor, see
    :class:`FusedRowsSpec`); nothing else changes. Targets are never written back as HF tensors by
    the pipeline, so this family has no HF export.
  * ``head_dim`` is always hidden_size / num_attention_heads (transformers' Phi3Attention).
  * RoPE: ``partial_rotary_factor`` < 1 (Phi-4-mini: 0.75) rotates only the leading dims of each
    head, and LongRoPE (``rope_scaling`` type ``longrope``, or ``su`` in older configs) picks short or
    long factors per call from the largest position and scales cos / sin by the attention factor, as
    transformers does (``layers/rope.py`` module docstring). Both come from ``rope.rope_tables``
    through this family's two input hooks.
  * ``sliding_window``: mistral.py's rule (every layer slides; none when the window is no shorter
    than max_position_embeddings: Phi-3-mini-4k's 2047 slides, Phi-3-mini-128k's and Phi-4-mini's
    262144 do not). transformers' Phi3Config has no window unless config.json sets one.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from specjax.layers.rope import rope_spec_from_hf, rope_tables
from specjax.targets import llama
from specjax.targets.base import Target, WeightSpec, resolve_hf_config
from specjax.targets.decoder import Decoder, StackInputs
from specjax.targets.hf_keys import HFKey, attention_keys, check_gqa, hf_values, read_hf_keys
from specjax.targets.layers import decoding
from specjax.targets.layers.attention import segment_causal_mask
from specjax.targets.mistral import read_sliding_window
from specjax.targets.registry import model_type_of, register

PHI3_ARCHS = ("Phi3ForCausalLM",)
# config.json keys <-> config fields (rope: layers/rope.py). No head_dim row: Phi-3 derives it.
HF_KEYS = (HFKey("num_hidden_layers"),) + tuple(
    HFKey("rms_norm_eps", float, 1e-5) if row.key == "rms_norm_eps" else row
    for row in attention_keys(max_position_embeddings=4096) if row.key != "head_dim")


# =============================================================================================
# Config: Llama's fields and properties; from_hf / to_hf read and write Phi-3's keys
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class Phi3TargetConfig(llama.LlamaTargetConfig):
    """Hashable subset of a Phi-3 HF config (the fields of LlamaTargetConfig; ``rope`` may be
    longrope and partial)."""

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "Phi3TargetConfig":
        """From an HF config dict (config.json contents, or ``PretrainedConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, PHI3_ARCHS, "Phi3TargetConfig",
                                     unsupported_flags=("attention_bias", "mlp_bias", "lm_head_bias"),
                                     silu_keys=("hidden_act",))
        keys = read_hf_keys(HF_KEYS, hf)
        head_dim = keys["hidden_size"] // keys["num_attention_heads"]
        if hf.get("head_dim") not in (None, head_dim):
            raise ValueError(f"{arch}: head_dim={hf['head_dim']} differs from hidden_size / num_attention_heads = "
                             f"{head_dim}, which Phi-3 attention always uses; remove head_dim from config.json")
        rope = rope_spec_from_hf(hf, longrope=True, partial_rotary=True)
        if (head_dim - rope.rotary_dim(head_dim)) % 2 or rope.rotary_dim(head_dim) % 2:
            raise ValueError(f"{arch}: partial_rotary_factor={rope.partial_rotary_factor} gives an odd rotary "
                             f"or pass-through width of head_dim {head_dim}")
        kw = dict(architecture=arch, head_dim=head_dim, rope=rope, sliding_window=read_sliding_window(hf, None), **keys)
        kw.update(overrides)
        cfg = cls(**kw)
        check_gqa(cfg)
        rope_tables(cfg.rope, cfg.head_dim, jnp.zeros((1, 1), jnp.int32), jnp.float32)  # fail early: factor lengths
        return cfg

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        d: dict[str, Any] = {"architectures": [self.architecture], "model_type": model_type_of(self.architecture),
                             **hf_values(HF_KEYS, self), "hidden_act": "silu", "rope_parameters": self.rope.to_hf(),
                             "partial_rotary_factor": self.rope.partial_rotary_factor, "sliding_window": self.sliding_window,
                             "attention_bias": False, "use_cache": True, "dtype": dtype}
        if self.rope.rope_type == "longrope":  # transformers prefers the top-level key (rope.py)
            d["original_max_position_embeddings"] = self.rope.original_max_position_embeddings
        return d


# =============================================================================================
# HF weight map: Llama's rows, with q/k/v and gate/up read from rows of the fused tensors
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class FusedRowsSpec(WeightSpec):
    """A WeightSpec whose leaf is rows ``hf_chunk[0] * n .. (hf_chunk[0] + 1) * n`` (n = the leaf's
    on-disk rows) of a fused tensor of ``fused_rows`` rows. Unlike a plain ``hf_chunk`` the parts
    may differ in size (q is larger than k and v under GQA), as long as each part starts at a
    multiple of its own size, which holds for [q; k; v] (q = g k-sized parts) and [gate; up]."""

    fused_rows: int = 0

    @property
    def hf_file_shape(self) -> tuple[int, ...]:
        return (self.fused_rows,) + tuple(self.hf_shape[1:])


def weight_specs(cfg: Phi3TargetConfig) -> list[WeightSpec]:
    groups = cfg.num_attention_heads // cfg.num_key_value_heads  # q is `groups` kv-sized parts
    qkv_rows = (groups + 2) * cfg.num_key_value_heads * cfg.head_dim
    fused = {  # leaf -> (fused HF tensor, part index in units of the leaf's rows, fused rows)
        "q_proj": ("model.layers.{i}.self_attn.qkv_proj.weight", 0, qkv_rows),
        "k_proj": ("model.layers.{i}.self_attn.qkv_proj.weight", groups, qkv_rows),
        "v_proj": ("model.layers.{i}.self_attn.qkv_proj.weight", groups + 1, qkv_rows),
        "gate_proj": ("model.layers.{i}.mlp.gate_up_proj.weight", 0, 2 * cfg.intermediate_size),
        "up_proj": ("model.layers.{i}.mlp.gate_up_proj.weight", 1, 2 * cfg.intermediate_size),
    }
    specs = []
    for spec in llama.weight_specs(cfg):
        if spec.path[-2] in fused:
            name, part, rows = fused[spec.path[-2]]
            fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
            spec = FusedRowsSpec(**{**fields, "hf_name": name, "hf_chunk": (part, rows // spec.hf_shape[0])},
                                 fused_rows=rows)
        specs.append(spec)
    return specs


# =============================================================================================
# RoPE inputs (the Llama hooks with rope.rope_tables: longrope's per-call choice, partial rotary)
# =============================================================================================
def forward_inputs(cfg: Phi3TargetConfig, input_ids_bt, positions, segment_ids, dtype) -> StackInputs:
    """The training forward's segment-causal mask and RoPE (positions default to arange, segments to one)."""
    b, t = input_ids_bt.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
        segment_ids = jnp.ones((b, t), jnp.int32)
    return StackInputs(segment_causal_mask(segment_ids).with_window(cfg.sliding_window),
                       rope_tables(cfg.rope, cfg.head_dim, positions, dtype))


def decode_inputs(cfg: Phi3TargetConfig, cache, input_ids_bt, positions_bt, start_b, chunk_mask_btt, valid_from_b,
                  logits_index, dtype):
    """A chunk's cache mask, write slots and RoPE: (StackInputs, cache; with a window its slot positions)."""
    if cfg.sliding_window is None:
        _, mask, slots = decoding.chunk_inputs(cache, input_ids_bt, start_b, chunk_mask_btt, valid_from_b,
                                               cfg.attention)
    else:
        _, mask, slots, cache = decoding.windowed_chunk_inputs(cache, input_ids_bt, positions_bt, start_b,
                                                               cfg.sliding_window, chunk_mask_btt, valid_from_b,
                                                               cfg.attention)
    return StackInputs(mask, rope_tables(cfg.rope, cfg.head_dim, positions_bt, dtype), slots=slots), cache


DECODER = Decoder(llama.run_layers, forward_inputs=forward_inputs, decode_inputs=decode_inputs)


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(*PHI3_ARCHS)
class Phi3Target(Target):
    """Frozen Phi-3 / Phi-4 target (see module docstring)."""

    config_class = Phi3TargetConfig
    decoder = DECODER
    weight_specs = staticmethod(weight_specs)
    init_params = staticmethod(llama.init_params)  # same leaves as Llama's

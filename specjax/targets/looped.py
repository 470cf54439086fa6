"""Looped (weight-shared) Llama / Qwen3 targets: the decoder stack, or a span of it, runs several times.

Aux layer ids of a looped target address the unrolled **virtual depth** Lv (every layer
application counts once, output-of-virtual-layer-k convention), e.g. [2, 22, 40] on 22 layers x 2
loops (Lv = 44), which the export writes as vLLM's [3, 23, 41], the key the Nanbeige4.2-3B EAGLE-3
card gives; the default is [1, Lv//2-1, Lv-4]. The
training target (final_hidden) is the state after the last virtual layer and the final norm.
The forward walks a static list of physical layer ids (the unroll) with one ``lax.scan`` per span
between aux taps, so only the tapped states are kept. (HRM-Text, transformers' looped
architecture, is ``hrm_text.py``.)

``LoopedLlamaForCausalLM`` / ``LoopedQwen3ForCausalLM`` (specjax's generic looped Llama): a Llama
or Qwen3 checkpoint (same tensors on disk) whose config.json adds the loop fields::

    "architectures": ["LoopedLlamaForCausalLM"],   # or LoopedQwen3ForCausalLM (q/k norm)
    "model_type": "llama",                          # the base family's, so transformers reads it
    "num_hidden_layers": 22,                        # physical layers = tensors on disk
    "num_loops": 2,                                 # passes over the looped span (>= 1)
    "loop_start": 0, "loop_end": 22                 # optional span [loop_start, loop_end)

Unroll: layers [0, loop_start), then [loop_start, loop_end) num_loops times, then [loop_end, L).
Lv = L + (num_loops - 1) * (loop_end - loop_start). Positions, RoPE and the segment mask are the
same on every pass; the final norm runs once at the end. Cached decoding keeps one KV cache row per
virtual layer (each application of a shared layer sees different inputs, so its K/V differ). Read
top to bottom: config -> weight map (the Llama one) -> forward (``llama.forward_over`` the unroll)
-> cached decoding -> Target class.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.targets import llama
from specjax.targets.base import Target, WeightSpec, resolve_hf_config, validate_aux_layer_ids
from specjax.targets.layers.decoding import chunk_inputs, init_kv_cache, picked_logits
from specjax.targets.layers.norms import rms_norm
from specjax.targets.layers.rope import inverse_frequencies, rope_cos_sin
from specjax.targets.layers.scan import index_layer, scan_layers
from specjax.targets.registry import model_type_of, register

# looped architecture name -> the dense architecture whose layers it loops
LOOPED_LLAMA_ARCHS = {"LoopedLlamaForCausalLM": "LlamaForCausalLM", "LoopedQwen3ForCausalLM": "Qwen3ForCausalLM"}


# =============================================================================================
# Config
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class LoopedLlamaConfig(llama.LlamaTargetConfig):
    """A LlamaTargetConfig (physical layers, as on disk) plus the loop: span [loop_start, loop_end)
    runs ``num_loops`` times. ``architecture`` is the looped name."""

    num_loops: int = 1
    loop_start: int = 0
    loop_end: int = -1  # -1 -> num_hidden_layers (set by from_hf)

    @property
    def base_architecture(self) -> str:
        return LOOPED_LLAMA_ARCHS[self.architecture]

    @property
    def qk_norm(self) -> bool:
        return self.base_architecture == "Qwen3ForCausalLM"

    @property
    def model_type(self) -> str:
        return model_type_of(self.base_architecture)

    @property
    def num_virtual_layers(self) -> int:
        return self.num_hidden_layers + (self.num_loops - 1) * (self.loop_end - self.loop_start)

    def virtual_layers(self) -> tuple[int, ...]:
        """Physical layer id of each virtual layer (length num_virtual_layers)."""
        span = tuple(range(self.loop_start, self.loop_end))
        head, tail = tuple(range(self.loop_start)), tuple(range(self.loop_end, self.num_hidden_layers))
        return head + span * self.num_loops + tail

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "LoopedLlamaConfig":
        hf, arch = resolve_hf_config(hf, tuple(LOOPED_LLAMA_ARCHS), "LoopedLlamaConfig")  # the rest: Llama's
        loop = {k: overrides.pop(k, hf.get(k)) for k in ("num_loops", "loop_start", "loop_end")}
        if loop["num_loops"] is None:
            raise ValueError(f"{arch} config.json needs 'num_loops' (how many times the looped span runs)")
        base = llama.LlamaTargetConfig.from_hf({**hf, "architectures": [LOOPED_LLAMA_ARCHS[arch]]}, **overrides)
        L = base.num_hidden_layers
        num_loops = int(loop["num_loops"])
        start = 0 if loop["loop_start"] is None else int(loop["loop_start"])
        end = L if loop["loop_end"] is None else int(loop["loop_end"])
        if num_loops < 1:
            raise ValueError(f"{arch}: num_loops={num_loops} must be >= 1")
        if not 0 <= start < end <= L:
            raise ValueError(
                f"{arch}: loop span [loop_start, loop_end) = [{start}, {end}) must satisfy "
                f"0 <= loop_start < loop_end <= num_hidden_layers={L}"
            )
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return cls(**{**fields, "architecture": arch, "num_loops": num_loops, "loop_start": start, "loop_end": end})

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        base = dataclasses.replace(self, architecture=self.base_architecture)
        d = llama.LlamaTargetConfig.to_hf(base, dtype)
        d.update(architectures=[self.architecture], num_loops=self.num_loops,
                 loop_start=self.loop_start, loop_end=self.loop_end)
        return d


# =============================================================================================
# HF weight map
# =============================================================================================
def looped_llama_weight_specs(cfg: LoopedLlamaConfig) -> list[WeightSpec]:
    """Exactly the Llama / Qwen3 tensors: the loop reuses the physical layers' weights."""
    return llama.weight_specs(cfg)


# =============================================================================================
# Forward: the Llama decoder layers in the unrolled order
# =============================================================================================
def looped_llama_forward(
    params: dict,
    cfg: LoopedLlamaConfig,
    input_ids_bt: jax.Array,
    *,
    aux_layer_ids: Sequence[int] = (),
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, tuple]:
    """Pure forward: (final_hidden after the last virtual layer and the final norm, aux tuple)."""
    aux_ids = validate_aux_layer_ids(aux_layer_ids, cfg.num_virtual_layers)
    return llama.forward_over(params, cfg, input_ids_bt, cfg.virtual_layers(), aux_ids, positions, segment_ids)


# =============================================================================================
# Cached decoding: the Llama KV cache with one row per virtual layer
# =============================================================================================
# {"k", "v"} [Lv, B, S, Hkv, D]: virtual layer v (physical layer virtual_layers()[v]) writes and
# reads row v. Layout, slot rules and mask: layers/attention.py "KV cache"; rollback = a shorter
# valid length.
def looped_llama_init_cache(cfg: LoopedLlamaConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> dict:
    """Zeroed KV cache for `max_len` slots per row (rounded up), one row per virtual layer."""
    return init_kv_cache(cfg.num_virtual_layers, batch_size, max_len, cfg.num_key_value_heads, cfg.head_dim, dtype)


def looped_llama_decode_chunk(
    params: dict,
    cfg: LoopedLlamaConfig,
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
    """PURE cached forward of a chunk: ``llama.decode_chunk`` over the unroll. Returns (fp32 logits,
    aux tuple at virtual `aux_layer_ids`, final hidden after the final norm, new cache); arguments
    as ``llama.decode_chunk``. Same layers and op order as :func:`looped_llama_forward`."""
    aux_ids = validate_aux_layer_ids(aux_layer_ids, cfg.num_virtual_layers)
    start_b, mask, slots = chunk_inputs(cache, input_ids_bt, start_b, chunk_mask_btt, valid_from_b, cfg.attention)
    x = jnp.take(params["embed_tokens"]["embedding"], input_ids_bt, axis=0)
    rope = rope_cos_sin(positions_bt, inverse_frequencies(cfg.rope, cfg.head_dim), x.dtype)

    def step(carry, layer):
        (x, c), (i, v) = carry, layer  # physical layer i applied as virtual layer v
        return llama.decoder_layer(index_layer(params["layers"], i), cfg, x, rope, mask, cache=c, layer=v,
                                   slots_bt=slots)

    xs = (np.asarray(cfg.virtual_layers(), np.int32), np.arange(cfg.num_virtual_layers, dtype=np.int32))
    (x, cache), aux = scan_layers(step, (x, cache), xs, aux_ids, tapped=lambda carry: carry[0])
    final = rms_norm(x, params["norm"]["scale"], cfg.rms_norm_eps)
    return picked_logits(final, llama.lm_head_weight(params, cfg), logits_index), aux, final, cache


# =============================================================================================
# Target wrapper
# =============================================================================================
@register(*LOOPED_LLAMA_ARCHS)  # aux ids address the unrolled virtual depth
class LoopedLlamaTarget(Target):
    """Frozen looped Llama / Qwen3 target (see module docstring)."""

    config_class = LoopedLlamaConfig
    forward_fn = staticmethod(looped_llama_forward)
    embed_fn = staticmethod(llama.embed_table)
    lm_head_fn = staticmethod(llama.lm_head_weight)
    decode_fn = staticmethod(looped_llama_decode_chunk)  # cached decoding, a cache row per virtual layer
    init_cache_fn = staticmethod(looped_llama_init_cache)

    @classmethod
    def weight_specs(cls, config: LoopedLlamaConfig) -> list[WeightSpec]:
        return looped_llama_weight_specs(config)

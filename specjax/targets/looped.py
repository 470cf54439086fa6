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
virtual layer (each application of a shared layer sees different inputs, so its K/V differ). Only
the config is this file's: the weight map, the decoder layer and its schedule are Llama's
(``llama.run_layers`` walks ``config.virtual_layers()``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from specjax.targets import llama
from specjax.targets.base import Target, resolve_hf_config
from specjax.targets.registry import register

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
# Target wrapper: the Llama / Qwen3 weight map and decoder (llama.run_layers walks
# config.virtual_layers(); the KV cache has a row per virtual layer, each application of a shared
# layer seeing different inputs)
# =============================================================================================
@register(*LOOPED_LLAMA_ARCHS)  # aux ids address the unrolled virtual depth
class LoopedLlamaTarget(Target):
    """Frozen looped Llama / Qwen3 target (see module docstring)."""

    config_class = LoopedLlamaConfig
    decoder = llama.DECODER
    weight_specs = staticmethod(llama.weight_specs)  # the loop reuses the physical layers' weights

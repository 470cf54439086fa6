"""Mistral frozen target (``MistralForCausalLM``): the Llama decoder under Mistral's config.

Read top to bottom: config (+ the sliding-window rule, shared with phi3.py) -> Target class. The HF
tensor names, the weight table, init, HF export, decoder layer, schedule and cached decoding are
Llama's (``llama.py``): a Mistral checkpoint has the same tensors (q/k/v/o, gate/up/down, two
RMSNorms per layer), no biases, SiLU, and possibly ``head_dim != hidden_size / num_attention_heads``
(Mistral-NeMo / Mistral-Small), which the shared attention already takes.

Sliding-window attention (Mistral 7B v0.1's ``sliding_window: 4096``): every layer attends to the
last ``sliding_window`` positions (the query's own included), in the training forward and in cached
decoding (``layers/attention.py``, ``layers/decoding.py``). A window at least as long as
``max_position_embeddings`` never hides a key and is kept as None (plain causal attention, the
fast kernels), as is ``sliding_window: null`` (v0.2 and later). transformers' MistralConfig defaults
a missing ``sliding_window`` key to 4096, so a config.json without the key is read that way.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from specjax.targets import llama
from specjax.targets.base import resolve_hf_config
from specjax.targets.hf_keys import hf_values
from specjax.targets.registry import model_type_of, register

MISTRAL_ARCHS = ("MistralForCausalLM",)
MISTRAL_DEFAULT_WINDOW = 4096  # transformers' MistralConfig.sliding_window when config.json omits it
# config.json keys <-> config fields (rope: layers/rope.py; sliding_window: read_sliding_window)
MISTRAL_MAX_POSITIONS = 4096 * 32  # transformers' MistralConfig.max_position_embeddings default
HF_KEYS = llama.HF_KEYS  # the same keys (from_hf reads them through Llama's; its default context differs)


def read_sliding_window(hf: Mapping[str, Any], default: int | None) -> int | None:
    """The config's ``sliding_window`` (``default`` when the key is absent) as the window every layer
    slides, or None when there is none or it is no shorter than max_position_embeddings."""
    window = hf.get("sliding_window", default)
    max_pos = hf.get("max_position_embeddings")
    if window is None or (max_pos is not None and int(window) >= int(max_pos)):
        return None
    if int(window) < 1:
        raise ValueError(f"sliding_window={window}: must be >= 1 (or null for full causal attention)")
    return int(window)


# =============================================================================================
# Config: Llama's fields and properties; only from_hf / to_hf (Mistral's keys) differ
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class MistralTargetConfig(llama.LlamaTargetConfig):
    """Hashable subset of a Mistral HF config (the fields of LlamaTargetConfig)."""

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, **overrides) -> "MistralTargetConfig":
        """From an HF config dict (config.json contents, or ``PretrainedConfig.to_dict()``)."""
        hf, arch = resolve_hf_config(hf, MISTRAL_ARCHS, "MistralTargetConfig")  # the rest: Llama's checks
        if hf.get("max_position_embeddings") is None:  # MistralConfig's default, not Llama's
            hf["max_position_embeddings"] = MISTRAL_MAX_POSITIONS
        window = read_sliding_window(hf, MISTRAL_DEFAULT_WINDOW)
        base = llama.LlamaTargetConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"]})
        kw = {**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, "architecture": arch,
              "sliding_window": window}
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def create(cls, **kwargs) -> "MistralTargetConfig":
        """A config for a new (toy) model from keyword args; see :func:`hf_config_dict`."""
        return cls.from_hf(hf_config_dict(**kwargs))

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        d = hf_config_dict(**hf_values(HF_KEYS, self), rope_parameters=self.rope.to_hf(), dtype=dtype)
        d["sliding_window"] = self.sliding_window
        return d


def hf_config_dict(**kwargs) -> dict[str, Any]:
    """Llama's config.json dict (``llama.hf_config_dict``, same keywords) as a Mistral one: its
    architecture and model_type, ``sliding_window: null``, no ``mlp_bias`` key."""
    d = llama.hf_config_dict("LlamaForCausalLM", **kwargs)
    d.pop("mlp_bias")
    d.update(architectures=list(MISTRAL_ARCHS), model_type=model_type_of(MISTRAL_ARCHS[0]), sliding_window=None)
    return d


# =============================================================================================
# Target wrapper: Llama's weight table, init, export and decoder
# =============================================================================================
@register(*MISTRAL_ARCHS)
class MistralTarget(llama.LlamaTarget):
    """Frozen Mistral target (see module docstring)."""

    config_class = MistralTargetConfig

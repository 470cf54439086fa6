"""Mistral frozen target (``MistralForCausalLM``): the Llama decoder under Mistral's config.

Read top to bottom: config (+ the sliding-window rule, shared with phi3.py) -> Target class. The HF
tensor names, the weight table, init, HF export, decoder layer, schedule and cached decoding are
Llama's (``llama.py``): a Mistral checkpoint has the same tensors (q/k/v/o, gate/up/down, two
RMSNorms per layer), no biases, SiLU, and possibly ``head_dim != hidden_size / num_attention_heads``
(Mistral-NeMo / Mistral-Small), which the shared attention already takes.

Sliding-window attention (Mistral 7B v0.1's ``sliding_window: 4096``) is refused when the window is
shorter than ``max_position_embeddings``: every attention path (the plain reference, the
ttt_attention kernels of the training forward, context parallelism, the decode_attention kernels
and their cache masks) is causal over the whole prefix, and a window would have to reach each of
them. A window at least as long as ``max_position_embeddings`` never hides a key, so it is accepted;
``sliding_window: null`` (v0.2 and later) is plain causal attention. transformers' MistralConfig
defaults a missing ``sliding_window`` key to 4096, so a config.json without the key is read that way.
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
# config.json keys <-> config fields (rope: layers/rope.py; sliding_window: checked, not kept)
MISTRAL_MAX_POSITIONS = 4096 * 32  # transformers' MistralConfig.max_position_embeddings default
HF_KEYS = llama.HF_KEYS  # the same keys (from_hf reads them through Llama's; its default context differs)


def check_sliding_window(hf: Mapping[str, Any], arch: str, default: int | None) -> None:
    """ValueError when ``sliding_window`` (``default`` when the key is absent) would hide a key from
    some query at a position below max_position_embeddings (module docstring)."""
    window = hf.get("sliding_window", default)
    max_pos = hf.get("max_position_embeddings")
    if window is None or (max_pos is not None and int(window) >= int(max_pos)):
        return
    raise ValueError(
        f"{arch} with sliding_window={window} < max_position_embeddings={max_pos} is not supported: specjax "
        f"targets attend to the whole causal prefix. Use a checkpoint revision without the window (e.g. Mistral "
        f"7B v0.2+ has 'sliding_window': null), or, if no sequence you train or decode on is longer than "
        f"{window} tokens (where full causal attention equals the window), set 'sliding_window': null in the "
        f"target's config.json.")


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
        check_sliding_window(hf, arch, MISTRAL_DEFAULT_WINDOW)
        if hf.get("max_position_embeddings") is None:  # MistralConfig's default, not Llama's
            hf["max_position_embeddings"] = MISTRAL_MAX_POSITIONS
        base = llama.LlamaTargetConfig.from_hf({**hf, "architectures": ["LlamaForCausalLM"]}, **overrides)
        return cls(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, "architecture": arch})

    @classmethod
    def create(cls, **kwargs) -> "MistralTargetConfig":
        """A config for a new (toy) model from keyword args; see :func:`hf_config_dict`."""
        return cls.from_hf(hf_config_dict(**kwargs))

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """An HF config dict (transformers-5 layout) that transformers and ``from_hf`` both read."""
        return hf_config_dict(**hf_values(HF_KEYS, self), rope_parameters=self.rope.to_hf(), dtype=dtype)


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

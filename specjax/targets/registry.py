"""Target registry keyed by HF ``config.architectures[0]`` (``model_type`` as fallback)."""
from __future__ import annotations

from typing import Any, Mapping

from specjax.targets.base import Target
from specjax.targets.llama import LlamaTarget

ARCHITECTURES: dict[str, type[Target]] = {
    "LlamaForCausalLM": LlamaTarget,
    "Qwen3ForCausalLM": LlamaTarget,  # Llama + per-head q/k RMSNorm, explicit head_dim
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(ARCHITECTURES))

# Configs saved without a model (config.save_pretrained) carry no "architectures" field.
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def architecture_of(hf_config: Mapping[str, Any]) -> str:
    """HF architecture name of a config dict: architectures[0], else mapped from model_type."""
    archs = hf_config.get("architectures") or []
    if archs:
        return archs[0]
    model_type = hf_config.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(
        f"config has no 'architectures' and unknown model_type {model_type!r}; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def get_target_class(arch_or_config: str | Mapping[str, Any]) -> type[Target]:
    """Target class for an architecture name or an HF config dict; ValueError if unsupported."""
    arch = arch_or_config if isinstance(arch_or_config, str) else architecture_of(arch_or_config)
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(
            f"unsupported target architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from None

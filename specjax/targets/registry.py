"""Target registry: HF ``config.architectures[0]`` -> Target class, and the one model_type map.

Every architecture file registers its Target class with ``@register(<architecture names>)``;
``specjax/targets/__init__.py`` imports every architecture file, and Python runs that package file
before any of its modules, so the table is complete wherever it is read. This module imports no
target code, not even for annotations (``base.py`` and the architecture files import it), so there is
no import cycle.
"""
from __future__ import annotations

from typing import Any, Mapping

# HF architecture -> Target class (a specjax.targets.base.Target subclass), filled by @register (see
# specjax/targets/__init__.py for the files)
ARCHITECTURES: dict[str, type] = {}

# Configs saved without a model (config.save_pretrained) carry no "architectures" field; their
# model_type names the architecture. Looped Llama configs keep their base model_type (so that
# transformers reads them) and must name their architecture.
MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "hrm_text": "HrmTextForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",  # Kimi K2's config.json model_type (the same architecture)
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "mistral4": "Mistral4ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    # the multimodal checkpoints, read as their text targets (multimodal.py)
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "kimi_k25": "Kimi_K25ForConditionalGeneration",
}


def register(*architectures: str):
    """Class decorator: ``cls`` serves these HF architecture names."""

    def add(cls):
        for arch in architectures:
            if arch in ARCHITECTURES and ARCHITECTURES[arch] is not cls:
                raise ValueError(f"{arch} is registered twice: {ARCHITECTURES[arch].__name__} and {cls.__name__}")
            ARCHITECTURES[arch] = cls
        return cls

    return add


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(ARCHITECTURES))


def model_type_of(architecture: str) -> str:
    """The model_type config.json carries for a (non-looped) architecture."""
    for model_type, arch in MODEL_TYPE_TO_ARCH.items():
        if arch == architecture:
            return model_type
    raise ValueError(f"no model_type known for architecture {architecture!r}")


def architecture_of(hf_config: Mapping[str, Any], *, strict: bool = True) -> str | None:
    """HF architecture name of a config dict: architectures[0], else mapped from model_type. An
    unknown model_type raises ValueError, or with ``strict=False`` is returned as it is (so the
    caller's own "handles X, got Y" error names it)."""
    archs = hf_config.get("architectures") or []
    if archs:
        return archs[0]
    model_type = hf_config.get("model_type")
    if model_type in MODEL_TYPE_TO_ARCH:
        return MODEL_TYPE_TO_ARCH[model_type]
    if not strict:
        return model_type
    raise ValueError(
        f"config has no 'architectures' and unknown model_type {model_type!r}; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


def get_target_class(arch_or_config: str | Mapping[str, Any]) -> type:
    """Target class for an architecture name or an HF config dict; ValueError if unsupported."""
    arch = arch_or_config if isinstance(arch_or_config, str) else architecture_of(arch_or_config)
    try:
        return ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(
            f"unsupported target architecture {arch!r}; supported: {', '.join(supported_architectures())}"
        ) from None

"""Target registry keyed by HF ``config.architectures[0]`` (``model_type`` as fallback)."""
from __future__ import annotations

from typing import Any, Mapping

from specjax.targets.base import Target
from specjax.targets.llama import LlamaTarget
from specjax.targets.looped import HrmTextTarget, LoopedLlamaTarget
from specjax.targets.nemotron_h import NemotronHTarget
from specjax.targets.qwen3_moe import Qwen3MoeTarget

ARCHITECTURES: dict[str, type[Target]] = {
    # dense
    "LlamaForCausalLM": LlamaTarget,
    "Qwen3ForCausalLM": LlamaTarget,  # Llama + per-head q/k RMSNorm, explicit head_dim
    # mixture of experts
    "Qwen3MoeForCausalLM": Qwen3MoeTarget,  # Qwen3 attention + softmax top-k routed SwiGLU experts
    # looped / weight-shared (aux ids address the unrolled virtual depth)
    "LoopedLlamaForCausalLM": LoopedLlamaTarget,  # Llama config + num_loops / loop_start / loop_end
    "LoopedQwen3ForCausalLM": LoopedLlamaTarget,  # the same over Qwen3 layers
    "HrmTextForCausalLM": HrmTextTarget,  # transformers' HRM-Text: H/L stacks, H_cycles x L_cycles
    # hybrid Mamba-2 / attention / MoE
    "NemotronHForCausalLM": NemotronHTarget,  # Mamba-2 / attention / MoE / MLP blocks
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(ARCHITECTURES))

# Configs saved without a model (config.save_pretrained) carry no "architectures" field.
# (Looped Llama configs keep their base model_type, so they must name their architecture.)
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "hrm_text": "HrmTextForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
}


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

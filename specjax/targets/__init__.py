"""Frozen target LLMs in JAX (forward-only), loaded from HF safetensors checkpoints without torch."""
# Every architecture file, imported here so that each registers its Target class (registry.py).
from specjax.targets import deepseek_v3, deepseek_v32, gemma3, gemma4, glm4_moe, gpt_oss, hrm_text, kimi_linear, llama, looped, minimax_m2, mistral, mistral4, multimodal, nemotron_h, phi3, qwen3_moe, qwen3_next  # noqa: F401
from specjax.targets.base import Target, TargetOutput, default_aux_layer_ids, validate_aux_layer_ids
from specjax.targets.loading import load_target
from specjax.targets.registry import ARCHITECTURES, get_target_class, supported_architectures

SUPPORTED_ARCHITECTURES: tuple[str, ...] = supported_architectures()

__all__ = [
    "ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "Target",
    "TargetOutput",
    "default_aux_layer_ids",
    "get_target_class",
    "load_target",
    "validate_aux_layer_ids",
]

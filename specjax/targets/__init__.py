"""Frozen target LLMs in JAX (forward-only), loaded from HF safetensors checkpoints without torch."""
from specjax.targets.base import Target, TargetOutput, default_aux_layer_ids, validate_aux_layer_ids
from specjax.targets.loading import load_target
from specjax.targets.registry import ARCHITECTURES, SUPPORTED_ARCHITECTURES, get_target_class

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

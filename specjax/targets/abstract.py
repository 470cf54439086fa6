"""Abstract and random target params built from an architecture's weight map, for any registered
architecture, without reading a checkpoint: ``abstract_params`` (ShapeDtypeStructs, nothing
allocated; the tree --compile-only and the memory report lower with), ``random_params`` /
``random_params_on_device`` (toy and full-size random weights), ``make_target`` (a Target for an HF
config dict) and ``reduced_hf_config`` (the same architecture at tiny widths, for CPU checks).

The memory-report CLI built on these is ``python -m specjax.shapes``.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from specjax.targets.base import Target, tree_set
from specjax.targets.registry import get_target_class


# ---------------------------------------------------------------------------------------------
def abstract_params(cls: type[Target], config: Any, dtype: Any = "bfloat16") -> dict:
    """The param tree as ShapeDtypeStructs (full size, nothing allocated): the tree the loader fills,
    leaf for leaf (a leaf whose weight spec pins a dtype keeps it, as in ``load_params``). The one
    way to build abstract target params for any registered architecture (also --compile-only's)."""
    tree: dict = {}
    for spec in cls.weight_specs(config):
        tree_set(tree, spec.path, jax.ShapeDtypeStruct(spec.shape, jnp.dtype(spec.dtype or dtype)))
    return tree


def random_params(cls: type[Target], config: Any, seed: int = 0, dtype: Any = jnp.float32, std: float = 0.02) -> dict:
    """Random params for any architecture: normal(0, std) matrices and embeddings, ones for norm
    scales. Drawn with numpy (one jax op per leaf would compile once per distinct shape)."""
    rng = np.random.default_rng(seed)
    tree: dict = {}
    for spec in cls.weight_specs(config):
        if spec.path[-1] == "scale" or spec.values_per_element == 0:  # norm weights, quantization scales
            value = np.ones(spec.shape, np.float32)
        else:
            value = std * rng.standard_normal(spec.shape, dtype=np.float32)
        tree_set(tree, spec.path, jnp.asarray(value, spec.dtype or dtype))
    return tree


def random_params_on_device(cls: type[Target], config: Any, seed: int = 0, dtype: Any = jnp.bfloat16,
                            std: float = 0.02) -> dict:
    """`random_params`' law drawn on the default device in the leaf's dtype: for full-size targets
    (tens of GB), which a host numpy draw in fp32 would take minutes and host memory for."""
    key = jax.random.key(seed)
    normal = jax.jit(lambda k, shape, dt: std * jax.random.normal(k, shape, dt), static_argnums=(1, 2))
    tree: dict = {}
    for i, spec in enumerate(cls.weight_specs(config)):
        dt = jnp.dtype(spec.dtype or dtype)
        ones = spec.path[-1] == "scale" or spec.values_per_element == 0  # norm weights, quantization scales
        value = jnp.ones(spec.shape, dt) if ones else normal(jax.random.fold_in(key, i), spec.shape, dt)
        tree_set(tree, spec.path, value)
    return tree


def make_target(hf_config: Mapping[str, Any], params: Any = None, **overrides) -> Target:
    """A Target for an HF config dict; ``params`` may be real arrays, ShapeDtypeStructs or None."""
    cls = get_target_class(hf_config)
    return cls(cls.config_from_hf(hf_config, **overrides), hf_config, params)


# Widths shrunk by reduced_hf_config; depth, loop spans, sparsity schedules and vocab are kept unless
# given, so aux ids written for the full model stay valid.
_REDUCED = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rotary_dim=8, num_experts=8, num_local_experts=8, num_experts_per_tok=2)


def reduced_hf_config(hf: Mapping[str, Any], **overrides) -> dict:
    """The same architecture with tiny widths (for CPU build/compile checks at reduced size)."""
    out = dict(hf)
    for key, value in _REDUCED.items():
        if key in out:
            out[key] = value
    if "num_key_value_heads" in out:
        out["num_key_value_heads"] = min(int(hf["num_key_value_heads"]), _REDUCED["num_key_value_heads"])
    out.update(overrides)
    return out

"""Gated SiLU MLP (Llama / Qwen3 style): down(silu(x @ gate) * (x @ up))."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.targets.layers.linear import dense


def swiglu_mlp(x_btd: jnp.ndarray, gate: dict, up: dict, down: dict) -> jnp.ndarray:
    """Over the projections' param nodes: {"kernel"} [in, out], or an FP8 kernel with its scale
    (layers/linear.dense)."""
    return dense(jax.nn.silu(dense(x_btd, gate)) * dense(x_btd, up), down)

"""Gated SiLU MLP (Llama / Qwen3 style): down(silu(x @ gate) * (x @ up))."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def swiglu_mlp(x_btd: jnp.ndarray, gate_df: jnp.ndarray, up_df: jnp.ndarray, down_fd: jnp.ndarray) -> jnp.ndarray:
    gate = x_btd @ gate_df
    up = x_btd @ up_df
    return (jax.nn.silu(gate) * up) @ down_fd

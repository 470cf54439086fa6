"""Pieces shared by the MoE implementations: activations, the expert sort, the weighted unsort."""
from __future__ import annotations

import jax
import jax.numpy as jnp

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # squared ReLU (Nemotron-H experts)
    "relu": jax.nn.relu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def activation_fn(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"moe: unknown activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}") from None


def sort_by_expert(expert_ids_tk, n_experts: int):
    """(order, group_sizes): ``order`` lists the T*k flattened assignments grouped by expert (stable,
    so token order is kept inside a group); ``group_sizes[e]`` counts expert e's assignments."""
    flat = expert_ids_tk.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    return order, group_sizes


def combine(ys_sorted, order, weights_tk, dtype):
    """Undo the sort, weight each assignment and sum the k choices of every token (fp32 sum)."""
    t, k = weights_tk.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    ys = jnp.take(ys_sorted, inverse, axis=0).reshape(t, k, -1)
    out = jnp.einsum("tkd,tk->td", ys.astype(jnp.float32), weights_tk.astype(jnp.float32))
    return out.astype(dtype)

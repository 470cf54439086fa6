"""Routed experts, the definition: sort token->expert assignments by expert, grouped GEMMs with
``jax.lax.ragged_dot``, unsort, weighted sum over the k choices (plain jnp, forward and backward).

For token t with choices (e_j, w_j), j < k:
    out[t] = sum_j w_j * FFN_{e_j}(x[t])
    FFN_e(x) = act(x @ gate[e]) * (x @ up[e]) @ down[e]     (gated, e.g. Qwen3-MoE SwiGLU experts)
    FFN_e(x) = act(x @ up[e]) @ down[e]                      (gate=None, e.g. Nemotron-H relu^2 experts)

Note: off TPU, XLA expands ragged_dot into a masked dense product over all groups (E times the
FLOPs and an [E, rows, D] intermediate), so ``xla.py`` is the CPU/GPU path; this file defines the math.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.moe.common import activation_fn, combine, sort_by_expert


def moe_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf=None, activation="silu"):
    """x [T, D], expert ids int [T, k], weights [T, k] -> [T, D] in x's dtype."""
    act = activation_fn(activation)
    n_experts = up_edf.shape[0]
    order, group_sizes = sort_by_expert(expert_ids_tk, n_experts)
    k = expert_ids_tk.shape[1]
    xs = jnp.take(x_td, order // k, axis=0)  # row r = the token of the r-th assignment in expert order
    up = jax.lax.ragged_dot(xs, up_edf, group_sizes)
    h = act(jax.lax.ragged_dot(xs, gate_edf, group_sizes)) * up if gate_edf is not None else act(up)
    ys = jax.lax.ragged_dot(h.astype(x_td.dtype), down_efd, group_sizes)
    return combine(ys, order, weights_tk, x_td.dtype)

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

from specjax_kernels.moe.common import grouped_experts


def moe_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf=None, activation="silu"):
    """x [T, D], expert ids int [T, k], weights [T, k] -> [T, D] in x's dtype."""
    return grouped_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation,
                           lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes))

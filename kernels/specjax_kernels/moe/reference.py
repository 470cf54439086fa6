"""Routed experts, the definition: sort token->expert assignments by expert, grouped GEMMs with
``jax.lax.ragged_dot``, unsort, weighted sum over the k choices (plain jnp, forward and backward).

For token t with choices (e_j, w_j), j < k:
    out[t] = sum_j w_j * FFN_{e_j}(x[t])
    FFN_e(x) = act(x @ gate[e]) * (x @ up[e]) @ down[e]     (gated, e.g. Qwen3-MoE SwiGLU experts)
    FFN_e(x) = act(x @ up[e]) @ down[e]                      (gate=None, e.g. Nemotron-H relu^2 experts)
With biases (gate_up_bias [E, 2F] only with the fused gate_up [E, D, 2F] = [gate | up]; down_bias [E, D]
with any form) and a GLU-level activation unit(gate, up) (activation=("clamped_swiglu", alpha, limit),
gpt-oss's experts; gated forms only):
    gu = x @ gate_up[e] + gate_up_bias[e];  g, u = gu[:F], gu[F:]
    FFN_e(x) = unit(g, u) @ down[e] + down_bias[e]
    clamped_swiglu: unit(g, u) = (clip(u, -limit, limit) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))
The GEMMs accumulate in fp32 and return x's dtype; the bias adds, whatever activation follows a gate_up
bias, and the clamped SwiGLU run in fp32 (fp64 for fp64 inputs); the hidden activations are cast to x's
dtype before the down GEMM; the weighted sum over the k choices (with the down bias) is fp32.

Note: off TPU, XLA expands ragged_dot into a masked dense product over all groups (E times the
FLOPs and an [E, rows, D] intermediate), so ``xla.py`` is the CPU/GPU path; this file defines the math.
"""
from __future__ import annotations

import jax

from specjax_kernels.moe.common import grouped_experts


def moe_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf=None, activation="silu", *,
                gate_up_bias=None, down_bias=None):
    """x [T, D], expert ids int [T, k], weights [T, k] -> [T, D] in x's dtype."""
    return grouped_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation,
                           lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes),
                           gate_up_bias=gate_up_bias, down_bias=down_bias)

"""Gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3-Next / Qwen3.5), the
definition: a plain sequential recurrence over time.

Per batch row and value head h (head h reads query/key head h // (Hv / Hk): consecutive value heads
share one query/key head, as transformers' ``repeat_interleave`` over the head axis maps them):

    q_t, k_t <- l2norm(q_t), l2norm(k_t)     (use_qk_l2norm; x * rsqrt(sum x^2 + 1e-6), in fp32)
    S  <- exp(g_t) * S                                          decay, g_t <= 0 (log space)
    S  <- S + beta_t * k_t (v_t - S^T k_t)^T                    delta-rule write, S is [Dk, Dv]
    o_t = S^T q_t * scale                                       scale defaults to Dk ** -0.5

The decay g_t is one number per value head ([B, T, Hv]: Gated DeltaNet, Qwen3-Next / Qwen3.5), or
one per value head and key channel ([B, T, Hv, Dk]: Kimi Delta Attention, Kimi Linear), where
``exp(g_t) * S`` scales row c of S (key channel c) by exp(g_t[c]): S <- diag(exp(g_t)) S. A per-key-
channel g that is the same on every channel is the per-head rule.

``S`` before t = 0 is ``initial_state`` (zeros when None). Packed documents: wherever
``segment_ids[t] != segment_ids[t-1]`` the carried state is dropped (S := 0 before the decay), exactly
as if the new document were run on its own; padding (id 0) is a segment like any other, so the state
after trailing padding is the padding run's own state (the state a document ends in is the one at its
last position). Everything is computed in fp32 (fp64 for fp64 inputs: the tests' exact references,
see dtypes.accum_dtype). This is O(T) sequential steps: the spec and the test oracle, not a fast path
(see xla.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype

_HI = jax.lax.Precision.HIGHEST
L2NORM_EPS = 1e-6  # inside the rsqrt, as transformers' l2norm


def segment_starts(segment_ids_bt, shape_bt):
    """bool [B, T]: True where a new packed segment begins (never at t = 0)."""
    if segment_ids_bt is None:
        return jnp.zeros(shape_bt, bool)
    seg = jnp.asarray(segment_ids_bt)
    return jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)


def l2norm(x, eps: float = L2NORM_EPS):
    """x / sqrt(sum(x^2) + eps) over the last axis."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(q, k, acc, *, scale=None, use_qk_l2norm=True):
    """(q * scale, k) in ``acc``, both L2-normalised first when ``use_qk_l2norm``; the step every
    implementation applies before the recurrence. ``scale`` None = Dk ** -0.5."""
    q, k = q.astype(acc), k.astype(acc)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * jnp.asarray(scale, acc), k


def decay_factor(g_t):
    """exp(g_t) shaped to multiply a state [B, H, Dk, Dv]: g_t [B, H] (per head) or [B, H, Dk] (per key
    channel: the rows of the state)."""
    e = jnp.exp(g_t)
    return e[..., None] if g_t.ndim == 3 else e[:, :, None, None]


def delta_rule_step(state, q_t, k_t, v_t, g_t, beta_t):
    """One token of the recurrence for all heads: state [B, H, Dk, Dv]; q_t, k_t [B, H, Dk] (already
    prepared and expanded to the H value heads); v_t [B, H, Dv]; g_t [B, H] or [B, H, Dk] (per key
    channel); beta_t [B, H]. Returns (new state, o_t [B, H, Dv])."""
    state = state * decay_factor(g_t)
    read = jnp.einsum("bhkv,bhk->bhv", state, k_t, precision=_HI)
    delta = beta_t[..., None] * (v_t - read)
    state = state + k_t[..., :, None] * delta[..., None, :]
    return state, jnp.einsum("bhkv,bhk->bhv", state, q_t, precision=_HI)


def expand_heads(x_bthd, num_v_heads: int):
    """[B, T, Hk, D] -> [B, T, Hv, D]: value head h reads query/key head h // (Hv / Hk)."""
    return jnp.repeat(x_bthd, num_v_heads // x_bthd.shape[2], axis=2)


def gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None, scale=None,
                     use_qk_l2norm=True, chunk_size=None):
    """Returns (o [B, T, Hv, Dv] fp32, final state [B, Hv, Dk, Dv] fp32). ``chunk_size`` is ignored."""
    del chunk_size
    bsz, t, hv, dv = v.shape
    dk = k.shape[-1]
    acc = accum_dtype(q, k, v, g, beta)
    q, k = prepare_qk(q, k, acc, scale=scale, use_qk_l2norm=use_qk_l2norm)
    q, k = expand_heads(q, hv), expand_heads(k, hv)
    reset = segment_starts(segment_ids, (bsz, t))
    state0 = jnp.zeros((bsz, hv, dk, dv), acc) if initial_state is None else initial_state.astype(acc)

    def step(state, inp):
        q_t, k_t, v_t, g_t, b_t, r_t = inp
        state = jnp.where(r_t[:, None, None, None], 0.0, state)
        return delta_rule_step(state, q_t, k_t, v_t, g_t, b_t)

    seq = (q, k, v.astype(acc), g.astype(acc), beta.astype(acc), reset)
    final, os_ = jax.lax.scan(step, state0, [jnp.moveaxis(x, 1, 0) for x in seq])
    return jnp.moveaxis(os_, 0, 1), final

"""Mamba-2 selective state-space scan (SSD), the definition: a plain sequential recurrence.

Per batch row, head h (head dim P, state size N, head h reads B/C group h // (H / G)):

    state_t = exp(dt_t[h] * A[h]) * state_{t-1}  +  dt_t[h] * x_t[h] (outer) B_t[g]     [P, N]
    y_t[h]  = state_t @ C_t[g]  +  D[h] * x_t[h]                                       [P]

``state_{-1}`` is ``initial_state`` (zeros when None). Packed documents: wherever
``segment_ids[t] != segment_ids[t-1]`` the carried state is dropped (state_{t-1} := 0), exactly as
if the new document were run on its own. Everything is computed in fp32; ``dt`` is the final
(positive) step size, i.e. the caller has already applied dt_bias, softplus and the dt limits.
(fp64 inputs are computed in fp64 instead: the tests' exact references, see dtypes.accum_dtype.)
This is O(T) sequential steps: the spec and the test oracle, not a fast path (see xla.py).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype

_HI = jax.lax.Precision.HIGHEST


def segment_starts(segment_ids_bt, shape_bt):
    """bool [B, T]: True where a new packed segment begins (never at t = 0)."""
    if segment_ids_bt is None:
        return jnp.zeros(shape_bt, bool)
    seg = jnp.asarray(segment_ids_bt)
    return jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)


def ssd(x_bthp, dt_bth, a_h, b_btgn, c_btgn, *, d_h=None, initial_state=None, segment_ids=None,
        chunk_size=None):
    """Returns (y [B, T, H, P] fp32, final state [B, H, P, N] fp32). ``chunk_size`` is ignored."""
    del chunk_size
    bsz, t, h, p = x_bthp.shape
    g, n = b_btgn.shape[2], b_btgn.shape[3]
    acc = accum_dtype(x_bthp, dt_bth, a_h, b_btgn, c_btgn)  # fp32, or fp64 for fp64 inputs
    x = x_bthp.astype(acc)
    dt = dt_bth.astype(acc)
    # expand the G groups of B and C to the H heads (head h uses group h // (H // G))
    bh = jnp.repeat(b_btgn.astype(acc), h // g, axis=2)
    ch = jnp.repeat(c_btgn.astype(acc), h // g, axis=2)
    reset = segment_starts(segment_ids, (bsz, t))
    state0 = jnp.zeros((bsz, h, p, n), acc) if initial_state is None else initial_state.astype(acc)
    a = a_h.astype(acc)

    def step(state, inp):
        x_t, dt_t, b_t, c_t, r_t = inp
        state = jnp.where(r_t[:, None, None, None], 0.0, state)
        decay = jnp.exp(dt_t * a)[:, :, None, None]
        state = state * decay + (dt_t[:, :, None] * x_t)[..., None] * b_t[:, :, None, :]
        y_t = jnp.einsum("bhpn,bhn->bhp", state, c_t, precision=_HI)
        return state, y_t

    time_major = [jnp.moveaxis(v, 1, 0) for v in (x, dt, bh, ch, reset)]
    final, ys = jax.lax.scan(step, state0, time_major)
    y = jnp.moveaxis(ys, 0, 1)
    if d_h is not None:
        y = y + d_h.astype(acc)[:, None] * x
    return y, final

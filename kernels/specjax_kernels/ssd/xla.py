"""Chunked SSD (state-space duality, Mamba-2 paper §6) in plain XLA: the default fast path.

The sequence is cut into chunks of Q positions (T padded up to a multiple of Q with dt = 0, which
neither decays nor feeds the state). Per chunk, with a_t = dt_t * A and running sums cs of a:
  1. intra-chunk: y_l += sum_{s<=l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s   (a masked
     "attention" with a decay kernel, one [Q, Q] matrix per head);
  2. chunk states: S_c = sum_s exp(a_{s+1} + ... + a_Q) dt_s B_s (outer) x_s;
  3. inter-chunk: the state entering each chunk is a decayed sum of the earlier S_c and the initial
     state (one [nc+1, nc+1] matrix per head, as the chunk count is small);
  4. y_l += exp(a_1 + ... + a_l) C_l . (state entering the chunk).
Sums of decays over a span are taken as masked cumulative sums over that span (never as a
difference of two long prefix sums, which would cancel catastrophically in fp32 on long inputs).

Packed documents: positions are labelled with a run id (number of segment starts so far); a
contribution from position s to position l (or to/from a chunk state) is kept only when both carry
the same run id, i.e. no segment start lies between them. That is the reference's reset rule.
B and C stay per group (G) and heads are split as (group, head-in-group) so C.B is computed
once per group, not once per head. All math in fp32 (fp64 for fp64 inputs, dtypes.accum_dtype).
"""
from __future__ import annotations

import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.ssd.reference import segment_starts


def _segsum(a):
    """[..., m] -> [..., m, m]: out[..., i, j] = a[j+1] + ... + a[i] for i >= j, -inf above the diagonal."""
    m = a.shape[-1]
    rows = jnp.broadcast_to(a[..., :, None], a.shape + (m,))  # rows[..., i, j] = a[i]
    idx = jnp.arange(m)
    strict = idx[:, None] > idx[None, :]
    sums = jnp.cumsum(jnp.where(strict, rows, 0.0), axis=-2)
    return jnp.where(idx[:, None] >= idx[None, :], sums, -jnp.inf)


def ssd(x_bthp, dt_bth, a_h, b_btgn, c_btgn, *, d_h=None, initial_state=None, segment_ids=None,
        chunk_size=128):
    """Same contract as reference.ssd; ``chunk_size`` (Q) trades [Q, Q] work for fewer chunks."""
    bsz, t, h, p = x_bthp.shape
    g, n = b_btgn.shape[2], b_btgn.shape[3]
    k = h // g
    q = int(chunk_size)
    nc = -(-t // q)
    pad = nc * q - t
    acc = accum_dtype(x_bthp, dt_bth, a_h, b_btgn, c_btgn)  # fp32, or fp64 for fp64 inputs

    run = jnp.cumsum(segment_starts(segment_ids, (bsz, t)).astype(jnp.int32), axis=1)  # [B, T]

    def chunks(v, fill_edge=False):
        if pad:
            widths = [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2)
            v = jnp.pad(v, widths, mode="edge" if fill_edge else "constant")
        return v.reshape((bsz, nc, q) + v.shape[2:])

    x = chunks(x_bthp.astype(acc)).reshape(bsz, nc, q, g, k, p)
    dt = chunks(dt_bth.astype(acc)).reshape(bsz, nc, q, g, k)
    bm = chunks(b_btgn.astype(acc))  # [B, c, Q, G, N]
    cm = chunks(c_btgn.astype(acc))
    run = chunks(run, fill_edge=True)  # [B, c, Q]; padding continues the last run

    a = jnp.moveaxis(dt * a_h.astype(acc).reshape(g, k), 2, -1)  # [B, c, G, K, Q]
    cs = jnp.cumsum(a, axis=-1)
    xdt = x * dt[..., None]  # [B, c, Q, G, K, P]

    # 1. intra-chunk (diagonal blocks)
    same = run[:, :, :, None] == run[:, :, None, :]  # [B, c, l, s]
    decay_ls = jnp.where(same[:, :, None, None], jnp.exp(_segsum(a)), 0.0)  # [B, c, G, K, l, s]
    cb = jnp.einsum("bclgn,bcsgn->bcgls", cm, bm)
    y = jnp.einsum("bcgkls,bcsgkp->bclgkp", cb[:, :, :, None] * decay_ls, xdt)

    # 2. each chunk's own contribution to the state at its end (same run as its last position only)
    to_end = jnp.exp(cs[..., -1:] - cs)  # within one chunk: short sums, no cancellation issue
    to_end = jnp.where((run == run[:, :, -1:])[:, :, None, None, :], to_end, 0.0)  # [B, c, G, K, Q]
    states = jnp.einsum("bcgkl,bclgn,bclgkp->bcgkpn", to_end, bm, xdt)

    # 3. states entering each chunk: index 0 = the initial state, index c+1 = after chunk c
    if initial_state is None:
        h0 = jnp.zeros((bsz, 1, g, k, p, n), acc)
    else:
        h0 = initial_state.astype(acc).reshape(bsz, 1, g, k, p, n)
    states = jnp.concatenate([h0, states], axis=1)  # [B, nc+1, G, K, P, N]
    a_chunk = jnp.pad(cs[..., -1], [(0, 0), (1, 0), (0, 0), (0, 0)])  # [B, nc+1, G, K]
    run_end = jnp.concatenate([run[:, :1, 0], run[:, :, -1]], axis=1)  # [B, nc+1] (init joins run 0)
    decay_cz = jnp.exp(_segsum(jnp.moveaxis(a_chunk, 1, -1)))  # [B, G, K, nc+1, nc+1]
    linked = run_end[:, :, None] == run_end[:, None, :]
    decay_cz = jnp.where(linked[:, None, None], decay_cz, 0.0)
    entering = jnp.einsum("bgkcz,bzgkpn->bcgkpn", decay_cz, states)
    final = entering[:, -1].reshape(bsz, h, p, n)

    # 4. the entering state's contribution inside each chunk
    from_start = jnp.exp(cs)  # [B, c, G, K, Q]
    from_start = jnp.where((run == run_end[:, :-1, None])[:, :, None, None, :], from_start, 0.0)
    y_off = jnp.einsum("bclgn,bcgkpn->bclgkp", cm, entering[:, :-1])
    y = y + y_off * jnp.moveaxis(from_start, -1, 2)[..., None]

    y = y.reshape(bsz, nc * q, h, p)[:, :t]
    if d_h is not None:
        y = y + d_h.astype(acc)[:, None] * x_bthp.astype(acc)
    return y, final

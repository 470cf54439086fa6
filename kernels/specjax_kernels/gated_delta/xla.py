"""Chunked gated delta rule in plain XLA (the WY / UT form of Gated DeltaNet): the default fast path.

The sequence is cut into chunks of C positions (T padded up to a multiple of C with g = 0, beta = 0,
k = v = 0: steps that leave the state as it is). Within a chunk, with gam_i = g_1 + ... + g_i (the
log decay from the chunk start to position i) and S_0 the state entering the chunk, the recurrence
unrolls to

    S_i = exp(gam_i) S_0 + sum_{j<=i} exp(gam_i - gam_j) k_j u_j^T

where the pseudo-values u solve the unit lower-triangular system (UT transform)

    u_i + beta_i sum_{j<i} exp(gam_i - gam_j) (k_i . k_j) u_j = beta_i v_i - beta_i exp(gam_i) S_0^T k_i,

i.e. u = W_v - W_k S_0 with [W_v | W_k] = (I + A)^-1 [beta v | beta exp(gam) k] (both right-hand
sides at once). ``solve="blocked"`` (default) inverts I + A blockwise: forward
substitution inside 16 x 16 diagonal blocks (15 vectorised row steps for all blocks at once), then
merging pairs of blocks, [[X1, 0], [L21, X2]]^-1 = [[X1, 0], [-X2 L21 X1, X2]], with matmuls
(log2(C / 16) levels), and multiplies. ``solve="lax"`` calls lax.linalg.triangular_solve instead:
cuBLAS trsm on GPUs (H100, C = 64: 4.2 ms vs 3.7 ms blocked at the benchmark's shape), but XLA:CPU
expands it into a slow loop (64 x 64: ~70 ms for 4 matrices), so it is not the default.

Then, per chunk, in order (a lax.scan over the T / C chunks; the state transition is a [Dk, Dk]
matrix, not a diagonal, so unlike SSD's chunk states it cannot be folded in closed form):

    u    = W_v - W_k S_0
    o_i  = exp(gam_i) S_0^T q_i + sum_{j<=i} exp(gam_i - gam_j) (q_i . k_j) u_j
    S_C  = exp(gam_C) S_0 + sum_j exp(gam_C - gam_j) k_j u_j^T

All [C, C] matrices (K K^T, Q K^T, the decays, the solve) are built for every chunk at once, before
the scan. Decays are exp of masked differences of in-chunk cumulative sums (never a positive
exponent, so nothing overflows; sums restart at every chunk, so their magnitudes stay those of one
chunk), as transformers' torch path does.

Packed documents: positions carry a run id (the number of segment starts so far). A decay from j to
i is kept only when both have the same run id (a reset between them multiplies by exp(-inf) = 0),
S_0 reaches position i only when i is still in the run that entered the chunk, and S_C keeps only
the last run's writes. That is the reference's reset rule, so nothing crosses a boundary.
Query/key heads stay un-repeated (Hk of them): K K^T and Q K^T are computed once per key head and
shared by its Hv / Hk value heads. Accumulation in fp32 (fp64 for fp64 inputs); the matmuls run at
``precision`` (HIGHEST by default: fp32 products, so results match the reference to ~1e-5).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.gated_delta.reference import prepare_qk, segment_starts

DEFAULT_CHUNK = 64
BASE_BLOCK = 16
SOLVES = ("blocked", "lax")


def unit_lower_inverse(a, *, precision=jax.lax.Precision.HIGHEST, base: int = BASE_BLOCK):
    """(I + a)^-1 for ``a`` [..., m, m] strictly lower triangular (what lies on or above the diagonal
    is ignored): blocked inversion, see the module docstring."""
    m = a.shape[-1]
    lead = a.shape[:-2]
    a = jnp.tril(a, -1)
    nb = 1
    while nb * base < m:
        nb *= 2
    size = min(base, m)
    if nb * size > m:  # zero rows/columns: identity rows of I + a, dropped again at the end
        a = jnp.pad(a, [(0, 0)] * len(lead) + [(0, nb * size - m)] * 2)
    mp = nb * size
    # the nb diagonal blocks, batched: [..., nb, size, size]
    blocks = jnp.moveaxis(jnp.diagonal(a.reshape(lead + (nb, size, nb, size)), axis1=-4, axis2=-2), -1, -3)
    eye = jnp.broadcast_to(jnp.eye(size, dtype=a.dtype), blocks.shape)
    rows = [eye[..., 0, :]]
    for i in range(1, size):  # row i of the inverse: e_i - sum_{j<i} a[i, j] x[j]
        done = jnp.stack(rows, axis=-2)  # [..., i, size]
        rows.append(eye[..., i, :] - jnp.einsum("...j,...jk->...k", blocks[..., i, :i], done, precision=precision))
    x = jnp.stack(rows, axis=-2)
    s = size
    while s < mp:
        pairs = mp // (2 * s)
        x = x.reshape(lead + (pairs, 2, s, s))
        x1, x2 = x[..., 0, :, :], x[..., 1, :, :]
        diag2 = jnp.diagonal(a.reshape(lead + (pairs, 2 * s, pairs, 2 * s)), axis1=-4, axis2=-2)
        diag2 = jnp.moveaxis(diag2, -1, -3)  # [..., pairs, 2s, 2s]
        l21 = diag2[..., s:, :s]
        off = -jnp.einsum("...ij,...jk,...kl->...il", x2, l21, x1, precision=precision)
        top = jnp.concatenate([x1, jnp.zeros_like(x1)], axis=-1)
        bottom = jnp.concatenate([off, x2], axis=-1)
        x = jnp.concatenate([top, bottom], axis=-2)  # [..., pairs, 2s, 2s]
        s *= 2
    return x.reshape(lead + (mp, mp))[..., :m, :m]


def gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None, scale=None,
                     use_qk_l2norm=True, chunk_size=DEFAULT_CHUNK, precision=jax.lax.Precision.HIGHEST,
                     solve: str = "blocked"):
    """Same contract as reference.gated_delta_rule; ``chunk_size`` (C) trades [C, C] work for fewer
    sequential steps; ``precision`` of the matmuls; ``solve`` one of SOLVES (module docstring)."""
    if solve not in SOLVES:
        raise ValueError(f"gated_delta xla: unknown solve {solve!r}; choose one of {SOLVES}")
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    c = int(chunk_size)
    nc = -(-t // c)
    pad = nc * c - t
    acc = accum_dtype(q, k, v, g, beta)
    ein = lambda spec, *xs: jnp.einsum(spec, *xs, precision=precision)  # noqa: E731

    q, k = prepare_qk(q, k, acc, scale=scale, use_qk_l2norm=use_qk_l2norm)
    run = jnp.cumsum(segment_starts(segment_ids, (bsz, t)).astype(jnp.int32), axis=1)  # [B, T]

    def chunks(x, edge=False):
        if pad:
            widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
            x = jnp.pad(x, widths, mode="edge" if edge else "constant")
        return x.reshape((bsz, nc, c) + x.shape[2:])

    qc = jnp.moveaxis(chunks(q), 2, 3)  # [B, n, Hk, C, Dk]
    kc = jnp.moveaxis(chunks(k), 2, 3)
    vc = jnp.transpose(chunks(v.astype(acc)).reshape(bsz, nc, c, hk, r, dv), (0, 1, 3, 4, 2, 5))  # [B,n,Hk,r,C,Dv]
    gc = jnp.moveaxis(chunks(g.astype(acc)).reshape(bsz, nc, c, hk, r), 2, -1)  # [B, n, Hk, r, C]
    bc = jnp.moveaxis(chunks(beta.astype(acc)).reshape(bsz, nc, c, hk, r), 2, -1)
    run = chunks(run, edge=True)  # [B, n, C]; padding continues the last run

    run_in = jnp.concatenate([jnp.zeros((bsz, 1), run.dtype), run[:, :-1, -1]], axis=1)  # [B, n]
    run_last = run[:, :, -1]
    gam = jnp.cumsum(gc, axis=-1)  # [B, n, Hk, r, C]

    idx = jnp.arange(c)
    keep = (run[:, :, :, None] == run[:, :, None, :]) & (idx[:, None] >= idx[None, :])  # [B, n, l, s]
    keep = keep[:, :, None, None]
    decay = jnp.exp(jnp.where(keep, gam[..., :, None] - gam[..., None, :], -jnp.inf))  # [B,n,Hk,r,l,s]
    kk = ein("bnhld,bnhsd->bnhls", kc, kc)[:, :, :, None]
    qk = ein("bnhld,bnhsd->bnhls", qc, kc)[:, :, :, None]
    strict = idx[:, None] > idx[None, :]
    a_mat = jnp.where(strict, bc[..., :, None] * decay * kk, 0.0)  # strictly lower; unit diagonal implied
    attn = qk * decay  # [B, n, Hk, r, C, C]

    from_start = jnp.exp(gam) * (run == run_in[:, :, None])[:, :, None, None, :]  # [B, n, Hk, r, C]
    to_end = jnp.exp(gam[..., -1:] - gam) * (run == run_last[:, :, None])[:, :, None, None, :]
    chunk_decay = jnp.exp(gam[..., -1]) * (run_last == run_in)[:, :, None, None]  # [B, n, Hk, r]

    rhs = jnp.concatenate([vc * bc[..., None], kc[:, :, :, None] * (bc * from_start)[..., None]], axis=-1)
    if solve == "lax":
        w = jax.lax.linalg.triangular_solve(a_mat, rhs, left_side=True, lower=True, unit_diagonal=True)
    else:
        w = ein("...ls,...sd->...ld", unit_lower_inverse(a_mat, precision=precision), rhs)
    w_v, w_k = w[..., :dv], w[..., dv:]

    def body(state, xs):  # state [B, Hk, r, Dk, Dv]
        w_v, w_k, q_c, k_c, attn, fs, te, cd = xs
        u = w_v - ein("bhrlk,bhrkv->bhrlv", w_k, state)
        o = ein("bhlk,bhrkv->bhrlv", q_c, state) * fs[..., None] + ein("bhrls,bhrsv->bhrlv", attn, u)
        state = state * cd[..., None, None] + ein("bhsk,bhrsv->bhrkv", k_c, u * te[..., None])
        return state, o

    if initial_state is None:
        state0 = jnp.zeros((bsz, hk, r, dk, dv), acc)
    else:
        state0 = initial_state.astype(acc).reshape(bsz, hk, r, dk, dv)
    xs = [jnp.moveaxis(x, 1, 0) for x in (w_v, w_k, qc, kc, attn, from_start, to_end, chunk_decay)]
    final, o = jax.lax.scan(body, state0, xs)  # o [n, B, Hk, r, C, Dv]
    o = jnp.transpose(o, (1, 0, 4, 2, 3, 5)).reshape(bsz, nc * c, hv, dv)[:, :t]
    return o, final.reshape(bsz, hv, dk, dv)

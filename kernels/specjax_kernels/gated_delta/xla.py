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

Per-key-channel decay (g [B, T, Hv, Dk], Kimi Delta Attention). gam_i is then a vector over the key
channels, the scalar exp(gam_i - gam_j) becomes the diagonal diag(exp(gam_i - gam_j)), and the same
unrolling holds with every decayed product taken channel by channel:

    A[i, j]    = beta_i sum_c k_i[c] k_j[c] exp(gam_i[c] - gam_j[c])      (j < i)
    attn[i, j] =        sum_c q_i[c] k_j[c] exp(gam_i[c] - gam_j[c])      (j <= i)
    W_k rows beta_i exp(gam_i) * k_i,  o_i = S_0^T (exp(gam_i) * q_i) + sum_j attn[i, j] u_j,
    S_C = diag(exp(gam_C)) S_0 + sum_j (exp(gam_C - gam_j) * k_j) u_j^T.

The decay no longer factors out of the dot products, and splitting it as exp(gam_i) exp(-gam_j)
would overflow (gam falls with every step), so :func:`decayed_scores` forms every factor as the exp
of a difference that is <= 0: inside sub-chunks of SUB_CHUNK rows the exact pairwise decays
([.., s, s, Dk] per sub-chunk), and between sub-chunks through a reference row r (the last row
before row i's sub-chunk, so j <= r < i): exp(gam_i - gam_j) = exp(gam_i - gam_r) exp(gam_r - gam_j),
two decays <= 1 that scale the two vectors before one matmul. Transient memory per chunk and value
head: about C (s + C / s) Dk values (C = 64, s = 16: 20 C Dk, where the per-head path forms C^2).
q and k are expanded to the Hv value heads first (their decays differ per value head). Resets,
padding and the scan are the per-head path's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.gated_delta.reference import expand_heads, prepare_qk, segment_starts

DEFAULT_CHUNK = 64
BASE_BLOCK = 16
SUB_CHUNK = 16  # rows whose pairwise per-channel decays are formed exactly (decayed_scores)
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
    if g.ndim == 4:
        return _per_channel_rule(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state,
                                 scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                                 precision=precision, solve=solve)
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


# =============================================================================================
# Per-key-channel decay (module docstring, last section)
# =============================================================================================
def decayed_scores(x, y, gam, *, precision=jax.lax.Precision.HIGHEST, sub: int = SUB_CHUNK):
    """M[..., i, j] = sum_c x[..., i, c] y[..., j, c] exp(gam[..., i, c] - gam[..., j, c]) for j <= i,
    zero above the diagonal. x, y, gam [..., C, Dk]; gam non-increasing along C (cumulative log decays
    <= 0), so every exp below has an argument <= 0. Rows come in sub-chunks of ``sub``: pairs inside
    one get their exact decays, pairs across go through the reference row before row i's sub-chunk."""
    c, dk = x.shape[-2:]
    lead = x.shape[:-2]
    s = min(int(sub), c)
    n = -(-c // s)
    cp = n * s
    if cp > c:  # zero rows add nothing; the edge value keeps gam non-increasing (every exp stays <= 1)
        widths = [(0, 0)] * len(lead) + [(0, cp - c), (0, 0)]
        x, y = jnp.pad(x, widths), jnp.pad(y, widths)
        gam = jnp.pad(gam, widths, mode="edge")
    xs, ys, gs = (a.reshape(lead + (n, s, dk)) for a in (x, y, gam))
    i = jnp.arange(s)
    lower = (i[:, None] >= i[None, :])[:, :, None]
    inside = jnp.exp(jnp.where(lower, gs[..., :, None, :] - gs[..., None, :, :], -jnp.inf))  # [.., n, s, s, Dk]
    intra = jnp.sum(xs[..., :, None, :] * ys[..., None, :, :] * inside, axis=-1)  # [.., n, s, s]
    # reference row of sub-chunk J: the last row of sub-chunk J-1 (sub-chunk 0 has no earlier rows)
    ref = jnp.concatenate([gs[..., :1, 0, :], gs[..., :-1, -1, :]], axis=-2)  # [.., n, Dk]
    x_ref = xs * jnp.exp(gs - ref[..., :, None, :])  # rows i of J: decay from r_J to i
    before = jnp.arange(cp)[None, :] < (jnp.arange(n) * s)[:, None]  # [n, Cp]: row j lies before J
    to_ref = jnp.where(before[:, :, None], ref[..., :, None, :] - gam[..., None, :, :], -jnp.inf)
    y_ref = y[..., None, :, :] * jnp.exp(to_ref)  # [.., n, Cp, Dk]: decay from j to r_J
    inter = jnp.einsum("...nid,...njd->...nij", x_ref, y_ref, precision=precision).reshape(lead + (cp, cp))
    diag = jnp.einsum("...nij,nm->...nimj", intra, jnp.eye(n, dtype=intra.dtype)).reshape(lead + (cp, cp))
    return (inter + diag)[..., :c, :c]


def _per_channel_rule(q, k, v, g, beta, *, segment_ids, initial_state, scale, use_qk_l2norm, chunk_size,
                      precision, solve):
    """gated_delta_rule with g [B, T, Hv, Dk]: same contract and chunking as the per-head path."""
    bsz, t, _, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    c = int(chunk_size)
    nc = -(-t // c)
    pad = nc * c - t
    acc = accum_dtype(q, k, v, g, beta)
    ein = lambda spec, *xs: jnp.einsum(spec, *xs, precision=precision)  # noqa: E731

    q, k = prepare_qk(q, k, acc, scale=scale, use_qk_l2norm=use_qk_l2norm)
    q, k = expand_heads(q, hv), expand_heads(k, hv)
    run = jnp.cumsum(segment_starts(segment_ids, (bsz, t)).astype(jnp.int32), axis=1)  # [B, T]

    def chunks(x, edge=False):
        if pad:
            widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
            x = jnp.pad(x, widths, mode="edge" if edge else "constant")
        return x.reshape((bsz, nc, c) + x.shape[2:])

    qc, kc = jnp.moveaxis(chunks(q), 2, 3), jnp.moveaxis(chunks(k), 2, 3)  # [B, n, Hv, C, Dk]
    vc = jnp.moveaxis(chunks(v.astype(acc)), 2, 3)  # [B, n, Hv, C, Dv]
    gam = jnp.cumsum(jnp.moveaxis(chunks(g.astype(acc)), 2, 3), axis=-2)  # [B, n, Hv, C, Dk]
    bc = jnp.moveaxis(chunks(beta.astype(acc)), 2, -1)  # [B, n, Hv, C]
    run = chunks(run, edge=True)  # [B, n, C]
    run_in = jnp.concatenate([jnp.zeros((bsz, 1), run.dtype), run[:, :-1, -1]], axis=1)  # [B, n]
    run_last = run[:, :, -1]

    idx = jnp.arange(c)
    same = (run[:, :, :, None] == run[:, :, None, :])[:, :, None]  # [B, n, 1, C, C]
    kk = decayed_scores(kc, kc, gam, precision=precision)
    qk = decayed_scores(qc, kc, gam, precision=precision)
    a_mat = jnp.where(same & (idx[:, None] > idx[None, :]), bc[..., :, None] * kk, 0.0)
    attn = jnp.where(same & (idx[:, None] >= idx[None, :]), qk, 0.0)

    in_first = (run == run_in[:, :, None])[:, :, None, :, None]  # [B, n, 1, C, 1]: S_0 reaches the row
    in_last = (run == run_last[:, :, None])[:, :, None, :, None]  # the row's writes reach S_C
    q_start = qc * jnp.exp(gam) * in_first
    k_start = kc * jnp.exp(gam) * in_first * bc[..., None]
    k_end = kc * jnp.exp(gam[..., -1:, :] - gam) * in_last
    chunk_decay = jnp.exp(gam[..., -1, :]) * (run_last == run_in)[:, :, None, None]  # [B, n, Hv, Dk]

    rhs = jnp.concatenate([vc * bc[..., None], k_start], axis=-1)
    if solve == "lax":
        w = jax.lax.linalg.triangular_solve(a_mat, rhs, left_side=True, lower=True, unit_diagonal=True)
    else:
        w = ein("...ls,...sd->...ld", unit_lower_inverse(a_mat, precision=precision), rhs)
    w_v, w_k = w[..., :dv], w[..., dv:]

    def body(state, xs):  # state [B, Hv, Dk, Dv]
        w_v, w_k, q_s, k_e, attn, cd = xs
        u = w_v - ein("bhlk,bhkv->bhlv", w_k, state)
        o = ein("bhlk,bhkv->bhlv", q_s, state) + ein("bhls,bhsv->bhlv", attn, u)
        state = state * cd[..., None] + ein("bhsk,bhsv->bhkv", k_e, u)
        return state, o

    state0 = jnp.zeros((bsz, hv, dk, dv), acc) if initial_state is None else initial_state.astype(acc)
    xs = [jnp.moveaxis(x, 1, 0) for x in (w_v, w_k, q_start, k_end, attn, chunk_decay)]
    final, o = jax.lax.scan(body, state0, xs)  # o [n, B, Hv, C, Dv]
    o = jnp.transpose(o, (1, 0, 3, 2, 4)).reshape(bsz, nc * c, hv, dv)[:, :t]
    return o, final

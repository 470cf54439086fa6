"""`pallas_gpu` fused soft-CE: Pallas kernels lowered through Pallas' Triton backend (interpret mode on CPU).

Same algorithm as triton_kernels.py, in the house Pallas style of ttt_attention/pallas_gpu.py (loops over
blocks inside the kernel, pl.ds slices of full-array refs):
  stats kernel, grid (row blocks, vocab splits): per program a fori_loop over its vocab tiles; each tile
    d = h[rows] @ w[tile].T is a K-loop over H in BLOCK_K chunks (f32 accumulation), the teacher tile is
    loaded (logits) or computed the same way (th @ tw.T, its own K-loop over Ht). Online (max, sum) for
    the draft and the teacher, s = sum exp(t - m_t) d, and the running argmax (first index on ties).
    The splits' partial statistics are combined in JAX (O(N) work); splitting the vocab keeps the SMs
    busy when N / BLOCK_N alone is small.
  dlogits kernel, grid (row blocks, vocab tiles): recomputes both tiles and writes
    dd = g * (softmax(d) - softmax(t)) in the input dtype. dh = dd @ W (a reduction over the vocab) and
    dW = dd.T @ h (a reduction over the rows) are then two separate GEMMs, as in triton_gpu.py, over row
    chunks of <= ROW_CHUNK_BYTES so dd never exists for all rows at once and never in f32.
N, Vd, H (and Ht) are zero-padded to the blocks in the wrapper; padded vocab columns are masked to NEG
(-1e30: acts as -inf in exp, without the inf - inf NaNs of a literal -inf), padded rows get g = 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax_kernels._pallas_gpu import compiler_params, dot_nt
from specjax_kernels.soft_ce.common import (Backend, combine_split_stats, f32, fused_with, heads_like_hidden,
                                            row_chunked_grads)
from specjax_kernels.soft_ce.common import cdiv as _cdiv, pad_to as _pad

NEG = -1.0e30
BLOCK_N = 64   # rows per program
BLOCK_V = 128  # vocab tile (vocab_block overrides it)
BLOCK_K = 64   # K-loop chunk over H (and Ht)
TARGET_PROGRAMS = 4 * 132  # H100/H200: 132 SMs, a few waves of stats programs


_compiler_params, _dot = compiler_params, dot_nt


def _pow2(n):
    return n >= 16 and not n & (n - 1)


def _mm_tile(a_ref, b_ref, rows, cols, bn, bv, bk, nk):
    """a[rows, :] @ b[cols, :].T in f32, a K-loop over nk chunks of bk."""
    def body(k, acc):
        ks = pl.ds(k * bk, bk)
        return acc + _dot(a_ref[rows, ks], b_ref[cols, ks])
    return lax.fori_loop(0, nk, body, jnp.zeros((bn, bv), f32))


def _tiles(refs, rows, c, *, bn, bv, bk, nk, nkt, V, t_logits):
    """(d, t, ok) for vocab tile c: f32 [bn, bv] each, columns >= V set to NEG, ok = the valid columns."""
    cols = pl.ds(c * bv, bv)
    if t_logits:
        h_ref, w_ref, t_ref = refs
        t = t_ref[rows, cols].astype(f32)
    else:
        h_ref, w_ref, th_ref, tw_ref = refs
        t = _mm_tile(th_ref, tw_ref, rows, cols, bn, bv, bk, nkt)
    d = _mm_tile(h_ref, w_ref, rows, cols, bn, bv, bk, nk)
    col = c * bv + lax.broadcasted_iota(jnp.int32, (bn, bv), 1)
    ok = col < V
    return jnp.where(ok, d, NEG), jnp.where(ok, t, NEG), ok, col


def _stats_kernel(*refs, bn, bv, bk, nk, nkt, V, nv, tiles, t_logits):
    n_in = 3 if t_logits else 4
    ins, (md_ref, ld_ref, mt_ref, lt_ref, s_ref, bval_ref, bidx_ref) = refs[:n_in], refs[n_in:]
    i, sp = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * bn, bn)
    tile = functools.partial(_tiles, ins, rows, bn=bn, bv=bv, bk=bk, nk=nk, nkt=nkt, V=V, t_logits=t_logits)

    def body(c, carry):
        md, ld, mt, lt, s, bval, bidx = carry
        d, t, ok, col = tile(c)
        # the tile's argmax, first index on ties; an earlier tile keeps ties (strict >)
        tmax = jnp.max(d, axis=1)
        targ = jnp.min(jnp.where(d == tmax[:, None], col, jnp.iinfo(jnp.int32).max), axis=1)
        better = tmax > bval
        bidx = jnp.where(better, targ, bidx)
        bval = jnp.where(better, tmax, bval)
        md_new = jnp.maximum(md, tmax)
        ld = ld * jnp.exp(md - md_new) + jnp.sum(jnp.exp(d - md_new[:, None]), axis=1)
        mt_new = jnp.maximum(mt, jnp.max(t, axis=1))
        a = jnp.exp(mt - mt_new)
        pt = jnp.exp(t - mt_new[:, None])
        s = s * a + jnp.sum(jnp.where(ok, pt * d, 0.0), axis=1)
        lt = lt * a + jnp.sum(pt, axis=1)
        return md_new, ld, mt_new, lt, s, bval, bidx

    z = jnp.zeros((bn,), f32)
    init = (z + NEG, z, z + NEG, z, z, z - jnp.inf, jnp.zeros((bn,), jnp.int32))
    lo = sp * tiles
    out = lax.fori_loop(lo, jnp.minimum(lo + tiles, nv), body, init)
    for ref, x in zip((md_ref, ld_ref, mt_ref, lt_ref, s_ref, bval_ref, bidx_ref), out):
        ref[...] = x


def _dlogits_kernel(*refs, bn, bv, bk, nk, nkt, V, t_logits):
    n_in = 3 if t_logits else 4
    ins, (g_ref, lsed_ref, lset_ref, dd_ref) = refs[:n_in], refs[n_in:]
    i, c = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * bn, bn)
    d, t, ok, _ = _tiles(ins, rows, c, bn=bn, bv=bv, bk=bk, nk=nk, nkt=nkt, V=V, t_logits=t_logits)
    g, lse_d, lse_t = g_ref[rows], lsed_ref[rows], lset_ref[rows]
    dd = g[:, None] * (jnp.exp(d - lse_d[:, None]) - jnp.exp(t - lse_t[:, None]))
    dd_ref[...] = jnp.where(ok, dd, 0.0).astype(dd_ref.dtype)


def _call(kernel, grid, out_specs, out_shape, interpret, name, warps, stages):
    kw = {} if interpret else {"compiler_params": _compiler_params(warps, stages)}
    return pl.pallas_call(kernel, grid=grid, out_specs=out_specs, out_shape=out_shape, interpret=interpret,
                          name=name, **kw)


def _prepare(h, w, t, th, tw, bn, bv, bk):
    """Blocks clamped to the problem (powers of two >= 16), inputs zero-padded to them."""
    N, H = h.shape
    V = w.shape[0]
    bn = min(bn, max(16, 1 << (N - 1).bit_length()))
    bk = min(bk, max(16, 1 << (H - 1).bit_length()))
    Np, Vp, Hp = _cdiv(N, bn) * bn, _cdiv(V, bv) * bv, _cdiv(H, bk) * bk
    ins = [_pad(h, (Np, Hp)), _pad(w, (Vp, Hp))]
    if t is not None:
        ins.append(_pad(t, (Np, Vp)))
        nkt = 0
    else:
        Htp = _cdiv(th.shape[1], bk) * bk
        ins += [_pad(th, (Np, Htp)), _pad(tw, (Vp, Htp))]
        nkt = Htp // bk
    kw = dict(bn=bn, bv=bv, bk=bk, nk=Hp // bk, nkt=nkt, V=V, t_logits=t is not None)
    return ins, kw, (N, V, H, Np, Vp, Hp)


def stats(h, w, t, th, tw, *, bn, bv, bk, interpret):
    ins, kw, (N, V, H, Np, Vp, Hp) = _prepare(h, w, t, th, tw, bn, bv, bk)
    bn = kw["bn"]
    nb, nv = Np // bn, Vp // bv
    nsplit = max(1, min(nv, _cdiv(TARGET_PROGRAMS, nb)))
    tiles = _cdiv(nv, nsplit)
    nsplit = _cdiv(nv, tiles)
    spec = pl.BlockSpec((None, bn), lambda i, s: (s, i))
    shp = jax.ShapeDtypeStruct((nsplit, Np), f32)
    md, ld, mt, lt, s, bval, bidx = _call(
        functools.partial(_stats_kernel, nv=nv, tiles=tiles, **kw), (nb, nsplit), [spec] * 7,
        [shp] * 6 + [jax.ShapeDtypeStruct((nsplit, Np), jnp.int32)], interpret, "soft_ce_stats", 8, 3)(*ins)
    return tuple(x[:N] for x in combine_split_stats(md, ld, mt, lt, s, bval, bidx))


def grads(h, w, t, th, tw, g, lse_d, lse_t, *, bn, bv, bk, interpret):
    ins, kw, (N, V, H, Np, Vp, Hp) = _prepare(h, w, t, th, tw, bn, bv, bk)
    bn = kw["bn"]
    g, lse_d, lse_t = (_pad(x.astype(f32), (Np,)) for x in (g, lse_d, lse_t))  # padded rows: g = 0
    hp, wp = ins[0], ins[1]
    kern = functools.partial(_dlogits_kernel, **kw)

    def dlogits(r0, r1):
        n = r1 - r0
        cut = lambda x: x[r0:r1]
        chunk = [cut(hp), wp] + ([cut(ins[2])] if t is not None else [cut(ins[2]), ins[3]])
        return _call(kern, (n // bn, Vp // bv), pl.BlockSpec((bn, bv), lambda i, c: (i, c)),
                     jax.ShapeDtypeStruct((n, Vp), h.dtype), interpret, "soft_ce_dlogits", 8, 3)(
                         *chunk, cut(g), cut(lse_d), cut(lse_t))

    dh, dw = row_chunked_grads(hp, wp, dlogits, bn)
    return dh[:N, :H], dw[:V, :H]


@functools.lru_cache(maxsize=None)
def backend(bn: int, bv: int, bk: int, interpret: bool) -> Backend:
    kw = dict(bn=bn, bv=bv, bk=bk, interpret=interpret)
    return Backend("pallas_gpu", functools.partial(stats, **kw), functools.partial(grads, **kw))


def fused_linear_soft_ce(hidden, lm_head, teacher_logits=None, teacher_hidden=None, teacher_head=None, mask=None,
                         *, vocab_block=None, interpret=False):
    bv = vocab_block or BLOCK_V
    if not interpret and not (_pow2(bv) and _pow2(BLOCK_N) and _pow2(BLOCK_K)):
        raise ValueError(f"pallas_gpu soft_ce needs vocab_block, BLOCK_N and BLOCK_K powers of two >= 16, got "
                         f"{bv}, {BLOCK_N}, {BLOCK_K}; use implementation='xla'.")
    lm_head, teacher_head = heads_like_hidden(hidden, lm_head, teacher_hidden, teacher_head)
    return fused_with(backend(BLOCK_N, bv, BLOCK_K, interpret), hidden, lm_head, teacher_logits, teacher_hidden,
                      teacher_head, mask)

"""`pallas_gpu` TTT attention: Pallas kernels for block 0, lowered through Pallas' Triton backend.

jax 0.11 still ships the Pallas Triton lowering (deprecated in 0.11.0 in favour of Mosaic GPU);
`compiler_params=pltriton.CompilerParams(...)` selects it. On CPU the same kernels run with
`interpret=True` (that is how the CPU tests check them). The algorithm of triton_kernels.py:
the forward walks the key blocks below the diagonal unmasked, then the diagonal blocks masked;
the backward is a dq kernel (per query block) and a dk/dv kernel (per key block and query head;
the G heads of a group are summed afterwards, O(T*Hq*D) f32 extra). As there, with segment ids
each tile's walk starts (forward, dq) or stops (dk/dv) at the first (last) tile that
shares a segment with it (`common.segment_block_bounds`), so a packed row of short documents costs
about the sum of its documents' triangles, not the whole row's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax_kernels._pallas_gpu import compiler_params, dot_nt, mm
from specjax_kernels.ttt_attention.common import Backend, f32, segment_block_bounds, ttt_attention_with

MASK = -1.0e30
DEFAULT_BLOCK = 64  # query and key tile (a power of two >= 16 for the Triton lowering)


_compiler_params, _dot, _mm = compiler_params, dot_nt, mm


def _causal_walk(q, k_ref, v_ref, o_ref, lse_ref, q0, qseg, kseg_ref, *, bm, bn, scale, lo=0):
    """Online-softmax forward of the query tile whose first row is global row `q0` (may be traced):
    the key blocks wholly below it from block `lo` on (earlier ones share no segment with the tile,
    `common.segment_block_bounds`) unmasked, then the blocks the diagonal crosses with the causal
    mask; segment ids (query tile `qseg`, keys from `kseg_ref`) when given."""
    qpos = q0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)

    def body(j, carry, causal):
        acc, m, l = carry
        k = k_ref[pl.ds(j * bn, bn), :]
        v = v_ref[pl.ds(j * bn, bn), :]
        s = _dot(q, k) * scale
        if causal:
            kpos = j * bn + lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
            s = jnp.where(qpos >= kpos, s, MASK)
        if qseg is not None:
            kseg = kseg_ref[pl.ds(j * bn, bn)]
            s = jnp.where(qseg[:, None] == kseg[None, :], s, MASK)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + _mm(p.astype(v.dtype), v)
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    carry = (jnp.zeros(q.shape, f32), jnp.full((bm,), MASK, f32), jnp.zeros((bm,), f32))
    below = q0 // bn
    carry = lax.fori_loop(jnp.minimum(lo, below), below, functools.partial(body, causal=False), carry)
    acc, m, l = lax.fori_loop(below, (q0 + bm + bn - 1) // bn, functools.partial(body, causal=True), carry)
    o_ref[...] = acc / l[:, None]
    lse_ref[...] = m + jnp.log(l)


def _fwd_kernel(q_ref, k_ref, v_ref, seg_ref, lo_ref, o_ref, lse_ref, *, bm, bn, scale, has_seg):
    i = pl.program_id(0)
    qseg = seg_ref[pl.ds(i * bm, bm)] if has_seg else None
    lo = lo_ref[i] if has_seg else 0
    _causal_walk(q_ref[...], k_ref, v_ref, o_ref, lse_ref, i * bm, qseg, seg_ref, bm=bm, bn=bn, scale=scale,
                 lo=lo)


def _fwd_offset_kernel(off_ref, q_ref, k_ref, v_ref, segq_ref, segk_ref, o_ref, lse_ref, *, bm, bn, scale):
    """`_fwd_kernel` for query rows that start at global row `off` of a key sequence that starts at 0
    (a context-parallel shard's queries against the all-gathered keys): the causal bound and the
    unmasked / diagonal split are global, the query segment ids local."""
    i = pl.program_id(0)
    _causal_walk(q_ref[...], k_ref, v_ref, o_ref, lse_ref, off_ref[0] + i * bm, segq_ref[pl.ds(i * bm, bm)],
                 segk_ref, bm=bm, bn=bn, scale=scale)


def fwd0_offset(q, k, v, seg_q, seg_k, q_block0, scale, *, block, interpret=False):
    """Same contract as `xla.fwd0_offset` (o f32 [B,Tq,Hq,D], lse [B,Tq,Hq]): queries starting at global
    block `q_block0` (traced) of keys [B,Tk,Hkv,D] that start at 0; Tq, Tk multiples of `block`."""
    B, Tq, HQ, D = q.shape
    Tk = k.shape[1]
    G = HQ // k.shape[2]
    bm = bn = block
    off = (jnp.asarray(q_block0, jnp.int32) * block).reshape(1)
    kern = functools.partial(_fwd_offset_kernel, bm=bm, bn=bn, scale=scale)
    o, lse = _call(
        kern, (Tq // bm, B, HQ),
        [pl.BlockSpec((1,), lambda i, b, h: (0,)),
         pl.BlockSpec((None, bm, None, D), lambda i, b, h: (b, i, h, 0)),
         pl.BlockSpec((None, Tk, None, D), lambda i, b, h: (b, 0, h // G, 0)),
         pl.BlockSpec((None, Tk, None, D), lambda i, b, h: (b, 0, h // G, 0)),
         pl.BlockSpec((None, Tq), lambda i, b, h: (b, 0)),
         pl.BlockSpec((None, Tk), lambda i, b, h: (b, 0))],
        [pl.BlockSpec((None, bm, None, D), lambda i, b, h: (b, i, h, 0)),
         pl.BlockSpec((None, None, bm), lambda i, b, h: (b, h, i))],
        [jax.ShapeDtypeStruct((B, Tq, HQ, D), f32), jax.ShapeDtypeStruct((B, HQ, Tq), f32)],
        interpret, "ttt_block0_fwd_offset", warps=4, stages=3)(off, q, k, v, seg_q, seg_k)
    return o, lse.transpose(0, 2, 1)


def _dq_kernel(q_ref, k_ref, v_ref, seg_ref, lo_ref, do_ref, lse_ref, delta_ref, dq_ref, *, bm, bn, scale,
               has_seg):
    i = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qpos = i * bm + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
    qseg = seg_ref[pl.ds(i * bm, bm)] if has_seg else None

    def body(j, dq, causal):
        k = k_ref[pl.ds(j * bn, bn), :]
        v = v_ref[pl.ds(j * bn, bn), :]
        p = jnp.exp(_dot(q, k) * scale - lse[:, None])
        if causal:
            kpos = j * bn + lax.broadcasted_iota(jnp.int32, (bm, bn), 1)
            p = jnp.where(qpos >= kpos, p, 0.0)
        if has_seg:
            p = jnp.where(qseg[:, None] == seg_ref[pl.ds(j * bn, bn)][None, :], p, 0.0)
        ds = p * (_dot(do, v) - delta[:, None])
        return dq + _mm(ds.astype(k.dtype), k)

    below = (i * bm) // bn
    lo = jnp.minimum(lo_ref[i], below) if has_seg else 0  # key blocks before lo share no segment
    dq = lax.fori_loop(lo, below, functools.partial(body, causal=False), jnp.zeros(q.shape, f32))
    dq = lax.fori_loop(below, ((i + 1) * bm) // bn, functools.partial(body, causal=True), dq)
    dq_ref[...] = dq * scale


def _dkdv_kernel(q_ref, k_ref, v_ref, seg_ref, hi_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, bm, bn,
                 scale, has_seg, T):
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    kpos = j * bn + lax.broadcasted_iota(jnp.int32, (bn, bm), 0)
    kseg = seg_ref[pl.ds(j * bn, bn)] if has_seg else None

    def body(i, carry, causal):
        dk, dv = carry
        q = q_ref[pl.ds(i * bm, bm), :]
        do = do_ref[pl.ds(i * bm, bm), :]
        lse = lse_ref[pl.ds(i * bm, bm)]
        delta = delta_ref[pl.ds(i * bm, bm)]
        pT = jnp.exp(_dot(k, q) * scale - lse[None, :])  # [bn, bm]
        if causal:
            qpos = i * bm + lax.broadcasted_iota(jnp.int32, (bn, bm), 1)
            pT = jnp.where(qpos >= kpos, pT, 0.0)
        if has_seg:
            pT = jnp.where(kseg[:, None] == seg_ref[pl.ds(i * bm, bm)][None, :], pT, 0.0)
        dv = dv + _mm(pT.astype(do.dtype), do)
        dsT = pT * (_dot(v, do) - delta[None, :])
        return dk + _mm(dsT.astype(q.dtype), q), dv

    lo = (j * bn) // bm
    hi = ((j + 1) * bn + bm - 1) // bm
    carry = (jnp.zeros(k.shape, f32), jnp.zeros(k.shape, f32))
    carry = lax.fori_loop(lo, hi, functools.partial(body, causal=True), carry)
    end = jnp.maximum(hi_ref[j], hi) if has_seg else T // bm  # later query blocks share no segment
    dk, dv = lax.fori_loop(hi, end, functools.partial(body, causal=False), carry)
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _call(kernel, grid, in_specs, out_specs, out_shape, interpret, name, warps=4, stages=2):
    kw = {} if interpret else {"compiler_params": _compiler_params(warps, stages)}
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                          interpret=interpret, name=name, **kw)


def _block_bounds(seg, block, has_seg):
    """(kv_lo, q_hi) per tile (`common.segment_block_bounds`; zeros without segment ids, when the
    kernels ignore them), padded along the tiles to a power of two (a Triton block shape) -> [B, n]."""
    B, T = seg.shape
    n = T // block
    if has_seg:
        lo, hi = segment_block_bounds(seg, block, block)
    else:
        lo = hi = jnp.zeros((B, n), jnp.int32)
    width = 1 << max(n - 1, 0).bit_length()
    pad = lambda x: jnp.pad(x, ((0, 0), (0, width - n)))  # noqa: E731
    return pad(lo), pad(hi)


def _bounds_spec(width):
    return pl.BlockSpec((None, width), lambda i, b, h: (b, 0))


def fwd0(q, k, v, seg, scale, *, block, has_seg, interpret):
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    bm = bn = block
    lo, _ = _block_bounds(seg, block, has_seg)
    kern = functools.partial(_fwd_kernel, bm=bm, bn=bn, scale=scale, has_seg=has_seg)
    o, lse = _call(
        kern, (T // bm, B, HQ),
        [pl.BlockSpec((None, bm, None, D), lambda i, b, h: (b, i, h, 0)),
         pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0)),
         pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0)),
         pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
         _bounds_spec(lo.shape[1])],
        [pl.BlockSpec((None, bm, None, D), lambda i, b, h: (b, i, h, 0)),
         pl.BlockSpec((None, None, bm), lambda i, b, h: (b, h, i))],
        [jax.ShapeDtypeStruct((B, T, HQ, D), f32), jax.ShapeDtypeStruct((B, HQ, T), f32)],
        interpret, "ttt_block0_fwd", warps=4, stages=3)(q, k, v, seg, lo)
    return o, lse.transpose(0, 2, 1)


def bwd0(q, k, v, seg, do, lse, delta, scale, *, block, has_seg, interpret):
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    G = HQ // HKV
    bm = bn = block
    do = do.astype(q.dtype)
    lse_t, delta_t = lse.transpose(0, 2, 1), delta.transpose(0, 2, 1)  # [B,HQ,T]
    kw = dict(bm=bm, bn=bn, scale=scale, has_seg=has_seg)
    lo, hi = _block_bounds(seg, block, has_seg)
    full_kv = pl.BlockSpec((None, T, None, D), lambda i, b, h: (b, 0, h // G, 0))
    seg_spec = pl.BlockSpec((None, T), lambda i, b, h: (b, 0))
    qblk = pl.BlockSpec((None, bm, None, D), lambda i, b, h: (b, i, h, 0))
    rowblk = pl.BlockSpec((None, None, bm), lambda i, b, h: (b, h, i))
    dq = _call(functools.partial(_dq_kernel, **kw), (T // bm, B, HQ),
               [qblk, full_kv, full_kv, seg_spec, _bounds_spec(lo.shape[1]), qblk, rowblk, rowblk], qblk,
               jax.ShapeDtypeStruct((B, T, HQ, D), f32), interpret, "ttt_block0_dq")(
                   q, k, v, seg, lo, do, lse_t, delta_t)
    full_q = pl.BlockSpec((None, T, None, D), lambda j, b, h: (b, 0, h, 0))
    kblk = pl.BlockSpec((None, bn, None, D), lambda j, b, h: (b, j, h // G, 0))
    row_full = pl.BlockSpec((None, None, T), lambda j, b, h: (b, h, 0))
    dkh_blk = pl.BlockSpec((None, bn, None, D), lambda j, b, h: (b, j, h, 0))
    dk, dv = _call(functools.partial(_dkdv_kernel, T=T, **kw), (T // bn, B, HQ),
                   [full_q, kblk, kblk, seg_spec, _bounds_spec(hi.shape[1]), full_q, row_full, row_full],
                   [dkh_blk, dkh_blk], [jax.ShapeDtypeStruct((B, T, HQ, D), f32)] * 2, interpret,
                   "ttt_block0_dkdv")(q, k, v, seg, hi, do, lse_t, delta_t)
    # per-query-head dk/dv -> sum over the G heads of each kv group
    dk = dk.reshape(B, T, HKV, G, D).sum(3)
    dv = dv.reshape(B, T, HKV, G, D).sum(3)
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def backend(block: int, has_seg: bool, interpret: bool) -> Backend:
    kw = dict(block=block, has_seg=has_seg, interpret=interpret)
    return Backend("pallas_gpu", functools.partial(fwd0, **kw), functools.partial(bwd0, **kw), block)


def _pow2(n):
    return n >= 16 and not n & (n - 1)


def ttt_attention(q, k0, v0, k_diag=None, v_diag=None, segment_ids=None, scale=None, *, block_size=None, sinks=None,
                  interpret=False):
    D = q.shape[-1]
    # fp32 at D = 256 asked an H100 for 344,832 B of shared memory with 64-row tiles (232,448 B exist)
    block = block_size or (DEFAULT_BLOCK if D * q.dtype.itemsize <= 512 else 32)
    if not interpret and not (_pow2(D) and _pow2(block)):
        raise ValueError(f"pallas_gpu ttt_attention needs head_dim and block_size powers of two >= 16, got "
                         f"{D} and {block}; use implementation='xla'.")
    return ttt_attention_with(backend(block, segment_ids is not None, interpret), q, k0, v0, k_diag, v_diag,
                              segment_ids, scale, sinks)

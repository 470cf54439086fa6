"""`pallas_tpu` fused soft-CE: Pallas TPU kernels (Pallas interpret mode on CPU).

Same algorithm as pallas_gpu.py, in the TPU conventions of ttt_attention/pallas_tpu.py: the loops are
grid axes, reductions last and "arbitrary", accumulators in f32 VMEM scratch.
  stats kernel, grid (row blocks i, vocab tiles c, K chunks k): d_sc += h[i,k] @ w[c,k].T over k (and
    t_sc += th[i,k] @ tw[c,k].T for a hidden-state teacher; logits are one (i,c) block). At the last k
    the tile updates the online statistics in scratch (m_d, l_d, m_t, l_t, s = sum exp(t - m_t) d, the
    running argmax, first index on ties); at the last (c, k) they are written out. Statistics are kept
    lane-replicated ([block_n, 128]) like the TPU flash kernels.
  dlogits kernel, grid (i, c, k): the same two tiles, then dd = g * (softmax(d) - softmax(t)) in the
    input dtype. dh = dd @ W (over the vocab) and dW = dd.T @ h (over the rows) are two separate GEMMs
    (XLA's), over row chunks of <= ROW_CHUNK_BYTES, so dd never exists in f32.
H and Ht have their own K chunk counts: the k axis runs to the larger, and each operand's index_map is
clamped to its last chunk (no DMA is issued for a repeated block index) while pl.when skips its work.
Blocks are the full dim when the dim fits in one, else BLOCK_N / vocab_block / BLOCK_K (multiples of 8,
128, 128 on a TPU), with N, Vd, H, Ht zero-padded to them; padded vocab columns are masked to NEG.

`interpret=None` (what the api passes) decides at lowering: the Mosaic kernels when lowering for a TPU
(from any host: tests/kernels/test_tpu_lowering.py lowers both at N = 32768, Vd = 32000, H = 4096 on the
CPU), Pallas's interpreter elsewhere (specjax_kernels.tpu_lowering.mosaic_or_interpret).

On a mesh of several devices (specjax_kernels.tpu_lowering.kernel_mesh) both run under shard_map with the
rows split (the heads replicated, dW summed over the shards); XLA cannot partition a Mosaic call itself.

Tested on CPU in interpret mode and lowered for a TPU from the CPU; never compiled or run on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from specjax_kernels.soft_ce.common import Backend, f32, fused_with, heads_like_hidden, row_chunked_grads
from specjax_kernels.soft_ce.common import cdiv as _cdiv, pad_to as _pad
from specjax_kernels.tpu_lowering import (active_kernel_mesh, axes_dividing, dim_spec, mosaic_or_interpret,
                                          resolve_interpret, shard_kernel)

NEG = -1.0e30
LANES = 128
BLOCK_N = 256   # rows per block (multiple of 8)
BLOCK_V = 512   # vocab tile (multiple of 128; vocab_block overrides it)
BLOCK_K = 512   # K chunk over H and Ht (multiple of 128)

_NT = (((1,), (1,)), ((), ()))  # a @ b.T


def _params(sem):
    return pltpu.CompilerParams(dimension_semantics=sem)


def _dot(a, b):
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, _NT, precision=prec, preferred_element_type=f32)


def _accumulate(refs, scratch, *, nk, nkt, t_logits):
    """K step k of the (i, c) tile: d_sc (and t_sc) += the chunk's partial logits."""
    k = pl.program_id(2)
    if t_logits:
        (h_ref, w_ref, _), (d_sc,) = refs, scratch
    else:
        (h_ref, w_ref, th_ref, tw_ref), (d_sc, t_sc) = refs, scratch

    @pl.when(k == 0)
    def _():
        for sc in scratch:
            sc[...] = jnp.zeros(sc.shape, f32)

    @pl.when(k < nk)
    def _():
        d_sc[...] += _dot(h_ref[...], w_ref[...])

    if not t_logits:
        @pl.when(k < nkt)
        def _():
            t_sc[...] += _dot(th_ref[...], tw_ref[...])


def _finished_tile(refs, scratch, c, *, bv, V, t_logits):
    """(d, t, ok, col) of the accumulated tile c: f32 [bn, bv], columns >= V set to NEG. (The caller
    reads the program id at the kernel's top level: Pallas's generic interpreter substitutes program
    ids there only, not inside a pl.when body.)"""
    d = scratch[0][...]
    t = refs[2][...].astype(f32) if t_logits else scratch[1][...]
    col = c * bv + jax.lax.broadcasted_iota(jnp.int32, d.shape, 1)
    ok = col < V
    return jnp.where(ok, d, NEG), jnp.where(ok, t, NEG), ok, col


def _stats_kernel(*refs, bv, nk, nkt, V, t_logits):
    n_in, n_sc = (3, 1) if t_logits else (4, 2)
    ins, outs = refs[:n_in], refs[n_in:n_in + 4]
    tile_sc, (md, ld, mt, lt, s, bval, bidx) = refs[n_in + 4:n_in + 4 + n_sc], refs[n_in + 4 + n_sc:]
    c, k = pl.program_id(1), pl.program_id(2)
    last_k = pl.num_programs(2) - 1

    @pl.when((c == 0) & (k == 0))
    def _():
        for ref, v in ((md, NEG), (ld, 0.0), (mt, NEG), (lt, 0.0), (s, 0.0), (bval, -jnp.inf)):
            ref[...] = jnp.full(ref.shape, v, f32)
        bidx[...] = jnp.zeros(bidx.shape, jnp.int32)

    _accumulate(ins, tile_sc, nk=nk, nkt=nkt, t_logits=t_logits)

    @pl.when(k == last_k)
    def _():
        d, t, ok, col = _finished_tile(ins, tile_sc, c, bv=bv, V=V, t_logits=t_logits)
        # the tile's argmax, first index on ties; an earlier tile keeps ties (strict >)
        tmax = jnp.max(d, axis=1, keepdims=True)  # [bn, 1]
        # (the index reduction runs in f32, exact below 2**24 columns, so Mosaic needs no int lane reduce)
        targ = jnp.min(jnp.where(d == tmax, col.astype(f32), jnp.inf), axis=1, keepdims=True).astype(jnp.int32)
        better = tmax > bval[...]  # [bn, LANES], all lanes equal
        bidx[...] = jnp.where(better, targ, bidx[...])
        bval[...] = jnp.where(better, tmax, bval[...])
        md_prev = md[...]
        md_new = jnp.maximum(md_prev, tmax)
        ld[...] = ld[...] * jnp.exp(md_prev - md_new) + jnp.sum(jnp.exp(d - md_new[:, :1]), axis=1, keepdims=True)
        md[...] = md_new
        mt_prev = mt[...]
        mt_new = jnp.maximum(mt_prev, jnp.max(t, axis=1, keepdims=True))
        a = jnp.exp(mt_prev - mt_new)
        pt = jnp.exp(t - mt_new[:, :1])
        s[...] = s[...] * a + jnp.sum(jnp.where(ok, pt * d, 0.0), axis=1, keepdims=True)
        lt[...] = lt[...] * a + jnp.sum(pt, axis=1, keepdims=True)
        mt[...] = mt_new

    @pl.when((c == pl.num_programs(1) - 1) & (k == last_k))
    def _():
        lse_d_ref, lse_t_ref, spd_ref, amax_ref = outs
        lse_d_ref[...] = md[...] + jnp.log(ld[...])
        lse_t_ref[...] = mt[...] + jnp.log(lt[...])
        spd_ref[...] = s[...] / lt[...]
        amax_ref[...] = bidx[...]


def _dlogits_kernel(*refs, bv, nk, nkt, V, t_logits):
    n_in = 3 if t_logits else 4
    ins, (g_ref, lsed_ref, lset_ref, dd_ref), tile_sc = refs[:n_in], refs[n_in:n_in + 4], refs[n_in + 4:]
    _accumulate(ins, tile_sc, nk=nk, nkt=nkt, t_logits=t_logits)

    c = pl.program_id(1)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        d, t, ok, _ = _finished_tile(ins, tile_sc, c, bv=bv, V=V, t_logits=t_logits)
        dd = g_ref[...] * (jnp.exp(d - lsed_ref[...]) - jnp.exp(t - lset_ref[...]))  # [bn,1] columns broadcast
        dd_ref[...] = jnp.where(ok, dd, 0.0).astype(dd_ref.dtype)


def _block(n, target):
    """(block, padded n): the full dim when it fits in one block, else target."""
    return (n, n) if n <= target else (target, _cdiv(n, target) * target)


def _prepare(h, w, t, th, tw, bn, bv, bk):
    N, H = h.shape
    V = w.shape[0]
    (bn, Np), (bv, Vp), (bk, Hp) = _block(N, bn), _block(V, bv), _block(H, bk)
    nk = Hp // bk
    ins = [_pad(h, (Np, Hp)), _pad(w, (Vp, Hp))]
    kmap = lambda n: (lambda i, c, k: (i, jnp.minimum(k, n - 1)))
    vmap_ = lambda n: (lambda i, c, k: (c, jnp.minimum(k, n - 1)))
    specs = [pl.BlockSpec((bn, bk), kmap(nk)), pl.BlockSpec((bv, bk), vmap_(nk))]
    scratch = [pltpu.VMEM((bn, bv), f32)]
    if t is not None:
        ins.append(_pad(t, (Np, Vp)))
        specs.append(pl.BlockSpec((bn, bv), lambda i, c, k: (i, c)))
        nkt = 0
    else:
        bkt, Htp = _block(th.shape[1], bk)
        nkt = Htp // bkt
        ins += [_pad(th, (Np, Htp)), _pad(tw, (Vp, Htp))]
        specs += [pl.BlockSpec((bn, bkt), kmap(nkt)), pl.BlockSpec((bv, bkt), vmap_(nkt))]
        scratch.append(pltpu.VMEM((bn, bv), f32))
    kw = dict(bv=bv, nk=nk, nkt=nkt, V=V, t_logits=t is not None)
    grid = (Np // bn, Vp // bv, max(nk, nkt))
    return ins, specs, scratch, kw, grid, (N, V, H, Np, Vp, Hp, bn)


def stats(h, w, t, th, tw, *, bn, bv, bk, interpret):
    ins, specs, scratch, kw, grid, (N, V, H, Np, Vp, Hp, bn) = _prepare(h, w, t, th, tw, bn, bv, bk)
    row = pl.BlockSpec((bn, LANES), lambda i, c, k: (i, 0))
    shp = jax.ShapeDtypeStruct((Np, LANES), f32)
    lse_d, lse_t, spd, amax = mosaic_or_interpret(lambda interp, *xs: pl.pallas_call(
        functools.partial(_stats_kernel, **kw), grid=grid, in_specs=specs, out_specs=[row] * 4,
        out_shape=[shp] * 3 + [jax.ShapeDtypeStruct((Np, LANES), jnp.int32)],
        scratch_shapes=scratch + [pltpu.VMEM((bn, LANES), f32)] * 6 + [pltpu.VMEM((bn, LANES), jnp.int32)],
        compiler_params=_params(("parallel", "arbitrary", "arbitrary")),
        interpret=interp, name="soft_ce_stats_tpu",
    )(*xs), *ins, interpret=interpret)
    return lse_d[:N, 0], lse_t[:N, 0], spd[:N, 0], amax[:N, 0]


def grads(h, w, t, th, tw, g, lse_d, lse_t, *, bn, bv, bk, interpret):
    ins, specs, scratch, kw, grid, (N, V, H, Np, Vp, Hp, bn) = _prepare(h, w, t, th, tw, bn, bv, bk)
    col = lambda x: _pad(x.astype(f32), (Np,))[:, None]  # [Np, 1]; padded rows: g = 0
    g, lse_d, lse_t = col(g), col(lse_d), col(lse_t)
    hp, wp = ins[0], ins[1]
    bv = kw["bv"]
    call = lambda n, grid, interp: pl.pallas_call(
        functools.partial(_dlogits_kernel, **kw), grid=grid,
        in_specs=specs + [pl.BlockSpec((bn, 1), lambda i, c, k: (i, 0))] * 3,
        out_specs=pl.BlockSpec((bn, bv), lambda i, c, k: (i, c)),
        out_shape=jax.ShapeDtypeStruct((n, Vp), h.dtype), scratch_shapes=scratch,
        compiler_params=_params(("parallel", "parallel", "arbitrary")),
        interpret=interp, name="soft_ce_dlogits_tpu")

    def dlogits(r0, r1):
        cut = lambda x: x[r0:r1]
        chunk = [cut(hp), wp] + ([cut(ins[2])] if t is not None else [cut(ins[2]), ins[3]])
        n_grid = ((r1 - r0) // bn,) + grid[1:]
        return mosaic_or_interpret(lambda interp, *xs: call(r1 - r0, n_grid, interp)(*xs),
                                   *chunk, cut(g), cut(lse_d), cut(lse_t), interpret=interpret)

    dh, dw = row_chunked_grads(hp, wp, dlogits, bn)
    return dh[:N, :H], dw[:V, :H]


def _split(fn, args, specs, out_specs, mesh):
    """fn(*args) under shard_map, the None args (the unused teacher form) passed through as None."""
    keep = [i for i, a in enumerate(args) if a is not None]

    def run(*xs):
        full = [None] * len(args)
        for i, x in zip(keep, xs):
            full[i] = x
        return fn(*full)
    return shard_kernel(run, mesh, [specs[i] for i in keep], out_specs, *[args[i] for i in keep])


def _row_axes(n_rows):
    """(mesh, row axes) to split the kernels' rows over, or None (specjax_kernels.tpu_lowering.kernel_mesh):
    every named axis (batch, then heads) that divides the row count; the heads are replicated."""
    km = active_kernel_mesh()
    if km is None:
        return None
    mesh, batch_axes, head_axes = km
    return mesh, axes_dividing(mesh, batch_axes + head_axes, n_rows)


def split_stats(h, w, t, th, tw, **kw):
    split = _row_axes(h.shape[0])
    if split is None:
        return stats(h, w, t, th, tw, **kw)
    mesh, axes = split
    r = dim_spec(axes)
    rows, rep = P(r, None), P()
    return _split(lambda *a: stats(*a, **kw), [h, w, t, th, tw], [rows, rep, rows, rows, rep], (P(r),) * 4, mesh)


def split_grads(h, w, t, th, tw, g, lse_d, lse_t, **kw):
    split = _row_axes(h.shape[0])
    if split is None:
        return grads(h, w, t, th, tw, g, lse_d, lse_t, **kw)
    mesh, axes = split
    r = dim_spec(axes)
    rows, rep = P(r, None), P()

    def fn(*a):
        dh, dw = grads(*a, **kw)
        return dh, (jax.lax.psum(dw, axes) if axes else dw)  # dW sums over every row
    return _split(fn, [h, w, t, th, tw, g, lse_d, lse_t], [rows, rep, rows, rows, rep, P(r), P(r), P(r)],
                  (rows, rep), mesh)


@functools.lru_cache(maxsize=None)
def backend(bn: int, bv: int, bk: int, interpret: bool | None) -> Backend:
    kw = dict(bn=bn, bv=bv, bk=bk, interpret=interpret)
    return Backend("pallas_tpu", functools.partial(split_stats, **kw), functools.partial(split_grads, **kw))


def fused_linear_soft_ce(hidden, lm_head, teacher_logits=None, teacher_hidden=None, teacher_head=None, mask=None,
                         *, vocab_block=None, interpret: bool | None = None):
    """interpret: True = Pallas's TPU interpreter, False = the Mosaic kernels, None = decided by the platform
    lowered for (Mosaic for a TPU, Pallas's interpreter elsewhere). Blocks that are not legal on a TPU
    run the TPU interpreter off TPU and are an error for a TPU."""
    bv = vocab_block or BLOCK_V
    interpret = resolve_interpret(
        interpret, not (bv % 128 or BLOCK_K % 128 or BLOCK_N % 8),
        f"pallas_tpu soft_ce needs vocab_block and BLOCK_K multiples of 128 and BLOCK_N of 8 on TPU, got {bv}, "
        f"{BLOCK_K}, {BLOCK_N}.")
    lm_head, teacher_head = heads_like_hidden(hidden, lm_head, teacher_hidden, teacher_head)
    return fused_with(backend(BLOCK_N, bv, BLOCK_K, interpret), hidden, lm_head, teacher_logits, teacher_hidden,
                      teacher_head, mask)

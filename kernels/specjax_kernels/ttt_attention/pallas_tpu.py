"""`pallas_tpu` TTT attention: flash-style Pallas TPU kernels for block 0 (forward, dq, dk/dv).

Layout [B,H,T,D] (heads before T so a block's last two dims are (block, D), lane/sublane aligned).
Square tiles (block_q == block_k == `block`, a multiple of 128 on TPU). Grids put the reduction
axis last ("arbitrary") with f32 VMEM scratch accumulators; a (query, key) block pair above the
diagonal is skipped with pl.when, and its index_map is clamped to an already-resident block so no
DMA is issued for it either. m/l/lse are kept lane-replicated ([block,128]) like the reference
TPU flash kernel in jax.experimental.pallas.ops.tpu (layout fact only). Segment ids go in as
[B,T,1] (queries) and [B,1,T] (keys) so the mask is a broadcast compare.

`interpret=None` (what the api passes) decides at lowering: the Mosaic kernels when lowering for a TPU
(from any host: tests/kernels/test_tpu_lowering.py lowers fwd and bwd at T = 32768 on the CPU), the TPU
interpreter elsewhere. Index maps divide with lax.div, not `//`: jnp's floor division lowers through
lax.sign, whose Mosaic rule needs the chip's identity, which a CPU host does not have.

On a mesh of several devices (specjax_kernels.tpu_lowering.kernel_mesh) the three kernels run under
shard_map, batch and heads split; XLA cannot partition a Mosaic call itself.

Tested on CPU in interpret mode and lowered for a TPU from the CPU; never compiled or run on a TPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from specjax_kernels.tpu_lowering import (active_kernel_mesh, axes_dividing, dim_spec, mosaic_or_interpret,
                                          resolve_interpret, shard_kernel)
from specjax_kernels.ttt_attention.common import Backend, f32, ttt_attention_with

MASK = -1.0e30
LANES = 128
DEFAULT_BLOCK = 128

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _params(sem):
    return pltpu.CompilerParams(dimension_semantics=sem)


def _masked(s, i, j, bs, qseg_ref, kseg_ref, has_seg, value):
    """Causal inside the diagonal pair (i == j), same segment everywhere."""
    qpos = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
    kpos = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    keep = (i > j) | (qpos >= kpos)
    if has_seg:
        keep = keep & (qseg_ref[...] == kseg_ref[...])  # [bs,1] == [1,bs]
    return jnp.where(keep, s, value)


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, bs, scale,
                has_seg):
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, MASK, f32)
        l_sc[...] = jnp.zeros(l_sc.shape, f32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, f32)

    @pl.when(j <= i)
    def _():
        s = jax.lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=f32) * scale
        s = _masked(s, i, j, bs, qseg_ref, kseg_ref, has_seg, MASK)
        m_prev = m_sc[...]  # [bs, LANES], all lanes equal
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new[:, :1])
        alpha = jnp.exp(m_prev - m_new)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        pv = jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=f32)
        acc_sc[...] = acc_sc[...] * alpha[:, :1] + pv

    @pl.when(j == i)
    def _():
        l = l_sc[...]
        o_ref[...] = acc_sc[...] / l[:, :1]
        lse_ref[...] = m_sc[...] + jnp.log(l)


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_sc, *, bs, scale,
               has_seg):
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        dq_sc[...] = jnp.zeros(dq_sc.shape, f32)

    @pl.when(j <= i)
    def _():
        k = k_ref[...]
        s = jax.lax.dot_general(q_ref[...], k, _NT, preferred_element_type=f32) * scale
        p = _masked(jnp.exp(s - lse_ref[...][:, :1]), i, j, bs, qseg_ref, kseg_ref, has_seg, 0.0)
        dp = jax.lax.dot_general(do_ref[...], v_ref[...], _NT, preferred_element_type=f32)
        ds = p * (dp - delta_ref[...][:, :1])
        dq_sc[...] += jnp.dot(ds.astype(k.dtype), k, preferred_element_type=f32)

    @pl.when(j == i)
    def _():
        dq_ref[...] = dq_sc[...] * scale


def _dkdv_kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc,
                 *, bs, scale, has_seg):
    j, i = pl.program_id(2), pl.program_id(3)  # key block j outer, query block i inner (reduction)

    @pl.when(i == 0)
    def _():
        dk_sc[...] = jnp.zeros(dk_sc.shape, f32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, f32)

    @pl.when(i >= j)
    def _():
        q, do = q_ref[...], do_ref[...]
        s = jax.lax.dot_general(q, k_ref[...], _NT, preferred_element_type=f32) * scale  # [bq, bk]
        p = _masked(jnp.exp(s - lse_ref[...][:, :1]), i, j, bs, qseg_ref, kseg_ref, has_seg, 0.0)
        dv_sc[...] += jax.lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=f32)
        dp = jax.lax.dot_general(do, v_ref[...], _NT, preferred_element_type=f32)
        ds = p * (dp - delta_ref[...][:, :1])
        dk_sc[...] += jax.lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=f32)

    @pl.when(i == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = dk_sc[...] * scale
        dv_ref[...] = dv_sc[...]


def _prep(q, k, v, seg):
    t = lambda x: x.transpose(0, 2, 1, 3)
    return t(q), t(k), t(v), seg[:, :, None], seg[:, None, :]


def _lanes(x_bth):  # [B,T,H] -> [B,H,T,LANES]
    return jnp.broadcast_to(x_bth.transpose(0, 2, 1)[..., None], x_bth.shape[:1] + x_bth.shape[2:] + x_bth.shape[1:2]
                            + (LANES,))


def fwd0(q, k, v, seg, scale, *, block, has_seg, interpret):
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    bs = min(block, T)
    n = T // bs
    qt, kt, vt, qseg, kseg = _prep(q, k, v, seg)
    kern = functools.partial(_fwd_kernel, bs=bs, scale=scale, has_seg=has_seg)
    kv_map = lambda b, h, i, j: (b, jax.lax.div(h, G), jnp.minimum(j, i), 0)
    o, lse = mosaic_or_interpret(lambda interp, *xs: pl.pallas_call(
        kern, grid=(B, HQ, n, n),
        in_specs=[pl.BlockSpec((None, None, bs, D), lambda b, h, i, j: (b, h, i, 0)),
                  pl.BlockSpec((None, None, bs, D), kv_map), pl.BlockSpec((None, None, bs, D), kv_map),
                  pl.BlockSpec((None, bs, 1), lambda b, h, i, j: (b, i, 0)),
                  pl.BlockSpec((None, 1, bs), lambda b, h, i, j: (b, 0, jnp.minimum(j, i)))],
        out_specs=[pl.BlockSpec((None, None, bs, D), lambda b, h, i, j: (b, h, i, 0)),
                   pl.BlockSpec((None, None, bs, LANES), lambda b, h, i, j: (b, h, i, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, HQ, T, D), f32), jax.ShapeDtypeStruct((B, HQ, T, LANES), f32)],
        scratch_shapes=[pltpu.VMEM((bs, LANES), f32), pltpu.VMEM((bs, LANES), f32), pltpu.VMEM((bs, D), f32)],
        compiler_params=_params(("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interp, name="ttt_block0_fwd_tpu",
    )(*xs), qt, kt, vt, qseg, kseg, interpret=interpret)
    return o.transpose(0, 2, 1, 3), lse[..., 0].transpose(0, 2, 1)


def bwd0(q, k, v, seg, do, lse, delta, scale, *, block, has_seg, interpret):
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    G = HQ // HKV
    bs = min(block, T)
    n = T // bs
    qt, kt, vt, qseg, kseg = _prep(q, k, v, seg)
    dot_ = do.astype(q.dtype).transpose(0, 2, 1, 3)
    lse_l, delta_l = _lanes(lse), _lanes(delta)
    kw = dict(bs=bs, scale=scale, has_seg=has_seg)
    sem = _params(("parallel", "parallel", "parallel", "arbitrary"))
    # dq: query block i (grid axis 2), key block j (axis 3, clamped to <= i)
    qrow = lambda b, h, i, j: (b, h, i, 0)
    kv_map = lambda b, h, i, j: (b, jax.lax.div(h, G), jnp.minimum(j, i), 0)
    blk = lambda m: pl.BlockSpec((None, None, bs, D), m)
    lrow = pl.BlockSpec((None, None, bs, LANES), qrow)
    dq = mosaic_or_interpret(lambda interp, *xs: pl.pallas_call(
        functools.partial(_dq_kernel, **kw), grid=(B, HQ, n, n),
        in_specs=[blk(qrow), blk(kv_map), blk(kv_map),
                  pl.BlockSpec((None, bs, 1), lambda b, h, i, j: (b, i, 0)),
                  pl.BlockSpec((None, 1, bs), lambda b, h, i, j: (b, 0, jnp.minimum(j, i))),
                  blk(qrow), lrow, lrow],
        out_specs=blk(qrow), out_shape=jax.ShapeDtypeStruct((B, HQ, T, D), f32),
        scratch_shapes=[pltpu.VMEM((bs, D), f32)], compiler_params=sem,
        interpret=interp, name="ttt_block0_dq_tpu",
    )(*xs), qt, kt, vt, qseg, kseg, dot_, lse_l, delta_l, interpret=interpret)
    # dk/dv: key block j (axis 2), query block i (axis 3, clamped to >= j); per query head, summed below
    q_map = lambda b, h, j, i: (b, h, jnp.maximum(i, j), 0)
    k_map = lambda b, h, j, i: (b, jax.lax.div(h, G), j, 0)
    out_map = lambda b, h, j, i: (b, h, j, 0)
    lq = pl.BlockSpec((None, None, bs, LANES), q_map)
    dk, dv = mosaic_or_interpret(lambda interp, *xs: pl.pallas_call(
        functools.partial(_dkdv_kernel, **kw), grid=(B, HQ, n, n),
        in_specs=[blk(q_map), blk(k_map), blk(k_map),
                  pl.BlockSpec((None, bs, 1), lambda b, h, j, i: (b, jnp.maximum(i, j), 0)),
                  pl.BlockSpec((None, 1, bs), lambda b, h, j, i: (b, 0, j)),
                  blk(q_map), lq, lq],
        out_specs=[blk(out_map), blk(out_map)],
        out_shape=[jax.ShapeDtypeStruct((B, HQ, T, D), f32)] * 2,
        scratch_shapes=[pltpu.VMEM((bs, D), f32), pltpu.VMEM((bs, D), f32)], compiler_params=sem,
        interpret=interp, name="ttt_block0_dkdv_tpu",
    )(*xs), qt, kt, vt, qseg, kseg, dot_, lse_l, delta_l, interpret=interpret)
    back = lambda x: x.transpose(0, 2, 1, 3)
    dk = back(dk).reshape(B, T, HKV, G, D).sum(3)
    dv = back(dv).reshape(B, T, HKV, G, D).sum(3)
    return back(dq), dk, dv


def _split_specs(q, k):
    """(mesh, [B,T,H,D] spec, [B,T] spec, [B,T,H] spec) to split the kernels over, or None (see
    specjax_kernels.tpu_lowering.kernel_mesh): batch over the batch axes, heads over the head axes
    when both Hq and Hkv divide (query head h reads kv head h // G, so equal splits of both agree)."""
    km = active_kernel_mesh()
    if km is None:
        return None
    mesh, batch_axes, head_axes = km
    b = dim_spec(axes_dividing(mesh, batch_axes, q.shape[0]))
    h = dim_spec(axes_dividing(mesh, head_axes, q.shape[2], k.shape[2]))
    return mesh, P(b, None, h, None), P(b, None), P(b, None, h)


def split_fwd0(q, k, v, seg, scale, *, block, has_seg, interpret):
    fwd = lambda q, k, v, seg: fwd0(q, k, v, seg, scale, block=block, has_seg=has_seg, interpret=interpret)
    split = _split_specs(q, k)
    if split is None:
        return fwd(q, k, v, seg)
    mesh, x4, x2, x3 = split
    return shard_kernel(fwd, mesh, (x4, x4, x4, x2), (x4, x3), q, k, v, seg)


def split_bwd0(q, k, v, seg, do, lse, delta, scale, *, block, has_seg, interpret):
    bwd = lambda q, k, v, seg, do, lse, delta: bwd0(q, k, v, seg, do, lse, delta, scale, block=block,
                                                    has_seg=has_seg, interpret=interpret)
    split = _split_specs(q, k)
    if split is None:
        return bwd(q, k, v, seg, do, lse, delta)
    mesh, x4, x2, x3 = split
    return shard_kernel(bwd, mesh, (x4, x4, x4, x2, x4, x3, x3), (x4, x4, x4), q, k, v, seg, do, lse, delta)


@functools.lru_cache(maxsize=None)
def backend(block: int, has_seg: bool, interpret: bool | None) -> Backend:
    kw = dict(block=block, has_seg=has_seg, interpret=interpret)
    return Backend("pallas_tpu", functools.partial(split_fwd0, **kw), functools.partial(split_bwd0, **kw), block)


def ttt_attention(q, k0, v0, k_diag=None, v_diag=None, segment_ids=None, scale=None, *, block_size=None, sinks=None,
                  interpret: bool | None = None):
    """interpret: True = Pallas's TPU interpreter, False = the Mosaic kernels, None = decided by the platform
    lowered for (Mosaic for a TPU, Pallas's interpreter elsewhere). A block that is not legal on a TPU
    runs the TPU interpreter off TPU and is an error for a TPU."""
    block = block_size or DEFAULT_BLOCK
    interpret = resolve_interpret(interpret, block % 128 == 0,
                                  f"pallas_tpu ttt_attention block_size must be a multiple of 128 on TPU, got {block}.")
    return ttt_attention_with(backend(block, segment_ids is not None, interpret), q, k0, v0, k_diag, v_diag,
                              segment_ids, scale, sinks)

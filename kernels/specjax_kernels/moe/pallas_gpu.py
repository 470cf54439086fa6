"""Routed experts through a grouped GEMM written in Pallas for GPUs (Pallas' Triton lowering), for the
GPUs `mgpu` does not serve (A100, L40S, Blackwell without Mosaic GPU's Hopper kernel); interpret mode
on CPU, which is how the CPU tests compare it with ``jax.lax.ragged_dot``.

    gmm(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]:  rows of group g times rhs[g]

Rows are sorted by expert (``common.grouped_experts``); no expert is padded to a capacity. The rows
are cut into tiles of BLOCK_M; a tile that straddles a group boundary is computed once per group it
holds, each time storing only that group's rows (masked stores into disjoint rows, so programs never
write the same element). `group_metadata` lists these (group, tile) work items before the kernel:
  group g owns rows [start_g, end_g); it touches tiles start_g // bm .. (end_g - 1) // bm (none when
  empty); item w, in group order, is (g, tile, start_g, end_g). There are at most M/bm + G of them
  (each group boundary adds one), so the grid is static: (M/bm + G, N/bn); items past the real count
  have g = G + 1 and return at once. The rows no group owns (padding up to a tile, or past
  sum(group_sizes)) form a virtual group G whose rows are written as zeros, as ragged_dot gives them.
Each program runs a K-loop of BLOCK_K chunks, bf16/fp16 operands (fp32 asks for IEEE fp32), fp32
accumulation, output in the operands' dtype.

Backward (``jax.custom_vjp``):
  dlhs = dout @ rhs[g]^T per group: the same kernel reading rhs[g] transposed (same work items);
  drhs[g] = lhs[rows of g]^T @ dout[rows of g]: a second kernel, grid (G, K/bk, N/bn), each program
  looping over its group's row tiles (rows outside the group masked to 0); an empty group's gradient
  is 0.
Widths that no power of two >= 16 divides are zero-padded to a multiple of 16 (and M to the tile).

Blocks and warps are not tuned (not measured on a GPU yet; `python -m specjax_kernels.moe.bench
--pallas-gpu-sweep` times a few). The idea of a precomputed tile -> group table is megablox's
(``make_group_metadata``); the code here is this project's own.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax_kernels._pallas_gpu import compiler_params, precision
from specjax_kernels.moe.common import grouped_experts

f32 = jnp.float32

# rows per tile, output columns per program, contraction chunk; Triton warps and pipeline stages
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
NUM_WARPS, NUM_STAGES = 8, 3
# the weight-gradient kernel's output tile [bk, bn] and its row chunk
TGMM_BLOCK_K, TGMM_BLOCK_N, TGMM_BLOCK_M = 64, 128, 64


def _cdiv(a, b):
    return -(-a // b)


def _stages(dtype) -> int:
    """Pipeline stages: fp32 tiles are twice the bytes, so 2 stages (128x64 + 64x128 fp32 tiles x 2 =
    128 KiB of shared memory, under an A100's 164 KiB; 3 bf16 stages take 96 KiB)."""
    return NUM_STAGES if jnp.dtype(dtype).itemsize <= 2 else min(NUM_STAGES, 2)


def _block(width: int, pref: int) -> int:
    """The largest power of two in [16, pref] dividing `width` (callers pad widths to a multiple of 16)."""
    b = pref
    while b > 16 and width % b:
        b //= 2
    return b


def _row_block(m: int, pref: int) -> int:
    """Tile rows: `pref`, or the next power of two >= 16 above a smaller M (fewer padded rows)."""
    return min(pref, max(16, 1 << max(m - 1, 1).bit_length()))


def group_metadata(group_sizes, m_pad: int, bm: int):
    """(items [M/bm + G, 4] int32: (group, tile, row start, row end) of the forward's work items;
    bounds [G, 2] int32: each group's (row start, row end), for the weight gradient).
    Rows [sum(sizes), m_pad) form the virtual group G (written as zeros); unused items have group G+1."""
    g_n = group_sizes.shape[0]
    sizes = jnp.concatenate([group_sizes.astype(jnp.int32),
                             (m_pad - jnp.sum(group_sizes.astype(jnp.int32)))[None]])  # + the virtual group
    sizes = jnp.maximum(sizes, 0)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // bm
    n_tiles = jnp.where(sizes > 0, (ends - 1) // bm - first + 1, 0)
    item_end = jnp.cumsum(n_tiles)  # group g's items are [item_end[g] - n_tiles[g], item_end[g])
    n_items = m_pad // bm + g_n
    w = jnp.arange(n_items, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(item_end, w, side="right").astype(jnp.int32), g_n)
    live = w < item_end[-1]
    tile = jnp.where(live, first[g] + w - (item_end[g] - n_tiles[g]), 0)
    items = jnp.stack([jnp.where(live, g, g_n + 1), tile, jnp.where(live, starts[g], 0),
                       jnp.where(live, ends[g], 0)], axis=1).astype(jnp.int32)
    bounds = jnp.stack([starts, ends], axis=1)[:g_n].astype(jnp.int32)
    return items, bounds


def _dot_tn(a, b):  # a[m,k]^T @ b[m,n] -> [k,n], f32
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision(a), preferred_element_type=f32)


def _dot(a, b, trans_b):  # a @ b (b [k,n]) or a @ b^T (b [n,k]), f32
    dims = (((1,), (1,)) if trans_b else ((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision(a), preferred_element_type=f32)


def _store(ref, value, mask):
    from jax.experimental.pallas import triton as pltriton
    pltriton.store(ref, value, mask=mask)


def _gmm_kernel(items_ref, lhs_ref, rhs_ref, out_ref, *, bm, bn, bk, nk, n_groups, trans_rhs):
    w, j = pl.program_id(0), pl.program_id(1)
    g = items_ref[w, 0]

    @pl.when(g <= n_groups)  # a real work item (the virtual group G included)
    def _():
        row0 = pl.multiple_of(items_ref[w, 1] * bm, bm)
        start, end = items_ref[w, 2], items_ref[w, 3]
        gi = jnp.minimum(g, n_groups - 1)
        rows, cols = pl.ds(row0, bm), pl.ds(pl.multiple_of(j * bn, bn), bn)

        def body(kk, acc):
            ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
            b = rhs_ref[gi, cols, ks] if trans_rhs else rhs_ref[gi, ks, cols]
            return acc + _dot(lhs_ref[rows, ks], b, trans_rhs)

        acc = lax.fori_loop(0, nk, body, jnp.zeros((bm, bn), f32))
        r = row0 + lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
        acc = jnp.where(g < n_groups, acc, 0.0)  # the virtual group's rows are zeros
        _store(out_ref.at[rows, cols], acc.astype(out_ref.dtype), (r >= start) & (r < end))


def _gmm_call(lhs, rhs, items, *, n_out, trans_rhs, bm, interpret):
    """lhs [Mp, Kc] (Kc the contraction), rhs [G, Kc, n_out] (or [G, n_out, Kc] with trans_rhs)."""
    m_pad, kc = lhs.shape
    bn, bk = _block(n_out, BLOCK_N), _block(kc, BLOCK_K)
    kern = functools.partial(_gmm_kernel, bm=bm, bn=bn, bk=bk, nk=kc // bk, n_groups=rhs.shape[0],
                             trans_rhs=trans_rhs)
    kw = {} if interpret else {"compiler_params": compiler_params(NUM_WARPS, _stages(lhs.dtype))}
    return pl.pallas_call(kern, grid=(items.shape[0], n_out // bn),
                          out_shape=jax.ShapeDtypeStruct((m_pad, n_out), lhs.dtype), interpret=interpret,
                          name="moe_gmm_t" if trans_rhs else "moe_gmm", **kw)(items, lhs, rhs)


def _tgmm_kernel(bounds_ref, lhs_ref, dout_ref, out_ref, *, bm, bk, bn):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = bounds_ref[g, 0], bounds_ref[g, 1]
    ks, ns = pl.ds(pl.multiple_of(i * bk, bk), bk), pl.ds(pl.multiple_of(j * bn, bn), bn)
    row_lo = start // bm * bm  # the group's rows in chunks of bm from the chunk holding its first row
    n_chunks = jnp.where(end > start, (end - row_lo + bm - 1) // bm, 0)

    def body(c, acc):
        row0 = pl.multiple_of(row_lo + c * bm, bm)
        r = row0 + lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
        a = lhs_ref[pl.ds(row0, bm), ks]
        a = jnp.where((r >= start) & (r < end), a, jnp.zeros_like(a))
        return acc + _dot_tn(a, dout_ref[pl.ds(row0, bm), ns])

    acc = lax.fori_loop(0, n_chunks, body, jnp.zeros((bk, bn), f32))
    out_ref[...] = acc.astype(out_ref.dtype)


def _tgmm_call(lhs, dout, bounds, *, bm, interpret):
    """drhs [G, Kp, Np]: per group, lhs[rows]^T @ dout[rows]."""
    (m_pad, kp), n = lhs.shape, dout.shape[1]
    g_n = bounds.shape[0]
    bm_t, bk, bn = min(TGMM_BLOCK_M, bm), _block(kp, TGMM_BLOCK_K), _block(n, TGMM_BLOCK_N)
    kern = functools.partial(_tgmm_kernel, bm=bm_t, bk=bk, bn=bn)
    kw = {} if interpret else {"compiler_params": compiler_params(NUM_WARPS, _stages(lhs.dtype))}
    return pl.pallas_call(kern, grid=(g_n, kp // bk, n // bn),
                          out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
                          out_shape=jax.ShapeDtypeStruct((g_n, kp, n), lhs.dtype), interpret=interpret,
                          name="moe_tgmm", **kw)(bounds, lhs, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_padded(lhs, rhs, group_sizes, bm, interpret):
    """The grouped GEMM on padded operands: lhs [Mp, Kp] (Mp a multiple of bm), rhs [G, Kp, Np]."""
    items, _ = group_metadata(group_sizes, lhs.shape[0], bm)
    return _gmm_call(lhs, rhs, items, n_out=rhs.shape[2], trans_rhs=False, bm=bm, interpret=interpret)


def _gmm_fwd(lhs, rhs, group_sizes, bm, interpret):
    return _gmm_padded(lhs, rhs, group_sizes, bm, interpret), (lhs, rhs, group_sizes)


def _gmm_bwd(bm, interpret, res, dout):
    lhs, rhs, group_sizes = res
    items, bounds = group_metadata(group_sizes, lhs.shape[0], bm)
    dout = dout.astype(lhs.dtype)
    dlhs = _gmm_call(dout, rhs, items, n_out=rhs.shape[1], trans_rhs=True, bm=bm, interpret=interpret)
    drhs = _tgmm_call(lhs, dout, bounds, bm=bm, interpret=interpret)
    return dlhs, drhs.astype(rhs.dtype), None


_gmm_padded.defvjp(_gmm_fwd, _gmm_bwd)


def _pad_to(x, shape):
    pads = [(0, t - s) for s, t in zip(x.shape, shape)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def gmm(lhs, rhs, group_sizes, *, interpret: bool = False, block_m: int | None = None):
    """lhs [M, K] (rows grouped by expert, sum(group_sizes) <= M) @ rhs[g] [K, N] per group -> [M, N]
    in lhs's dtype (rhs is cast to it); rows past sum(group_sizes) are 0, as in ragged_dot.
    Differentiable in lhs and rhs."""
    m, k = lhs.shape
    n = rhs.shape[2]
    bm = block_m or _row_block(m, BLOCK_M)
    m_pad, k_pad, n_pad = _cdiv(m, bm) * bm, _cdiv(k, 16) * 16, _cdiv(n, 16) * 16
    out = _gmm_padded(_pad_to(lhs, (m_pad, k_pad)), _pad_to(rhs.astype(lhs.dtype), (rhs.shape[0], k_pad, n_pad)),
                      group_sizes.astype(jnp.int32), bm, interpret)
    return out[:m, :n] if (m_pad, n_pad) != (m, n) else out


def moe_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf=None, activation="silu",
                interpret: bool = False, *, gate_up_bias=None, down_bias=None):
    return grouped_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation,
                           functools.partial(gmm, interpret=interpret), gate_up_bias=gate_up_bias,
                           down_bias=down_bias)


def available() -> str | None:
    """None on an NVIDIA GPU (the Triton lowering), else why the compiled kernel cannot run here."""
    if jax.default_backend() != "gpu":
        return f"needs an NVIDIA GPU (backend is {jax.default_backend()}); CPU runs it in interpret mode"
    return None

"""`triton` TTT attention: the kernels of triton_kernels.py called through jax_triton.triton_call.

Importing this module imports jax_triton (GPU-only, optional: `pip install specjax[gpu]`); api.py only
imports it when `triton` is asked for on a GPU, so CPU installs never need it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax_triton as jt

from specjax_kernels.ttt_attention import triton_kernels as K
from specjax_kernels.ttt_attention.common import Backend, f32, segment_block_bounds, ttt_attention_with

# H100/H200 starting points (FlashAttention-2 Triton tutorial ranges); D=128, bf16
FWD = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
DQ = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
DKDV = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)
# Wider heads (D > 128: DeepSeek-V3's MLA attends at 256) need smaller tiles: FWD above asked an H100 for
# 263,168 B of shared memory at D = 256 bf16 (the q tile plus 3 stages of k and v tiles; 232,448 B exist).
# These keep every kernel's tiles at about 192 KiB there (WIDE: 2-byte inputs; WIDER: fp32, twice the bytes).
WIDE = {"FWD": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
        "DQ": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
        "DKDV": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2)}
WIDER = {"FWD": dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
         "DQ": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2),
         "DKDV": dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=2)}
MULTIPLE = 128


def _check(q):
    D = q.shape[-1]
    if D & (D - 1) or D < 16:
        raise ValueError(f"triton ttt_attention needs head_dim a power of two >= 16, got {D}; use 'xla'.")


def _meta(q, k, scale, seg_is_real):
    B, T, HQ, D = q.shape
    return dict(T=T, HQ=HQ, HKV=k.shape[2], D=D, SCALE=scale, HAS_SEG=seg_is_real,
                IEEE=q.dtype == jnp.float32)


def _blocks(kind: str, T: int, D: int, itemsize: int):
    tiles = {"FWD": FWD, "DQ": DQ, "DKDV": DKDV} if D <= 128 else WIDE if itemsize <= 2 else WIDER
    c = dict(tiles[kind])
    c["BLOCK_M"], c["BLOCK_N"] = min(c["BLOCK_M"], T), min(c["BLOCK_N"], T)
    return c


def _bounds(seg, c, has_seg):
    """(kv_lo, q_hi) for the kernel's tiles (`segment_block_bounds`); unread zeros without segment ids."""
    B, T = seg.shape
    if has_seg:
        return segment_block_bounds(seg, c["BLOCK_M"], c["BLOCK_N"])
    return jnp.zeros((B, T // c["BLOCK_M"]), jnp.int32), jnp.zeros((B, T // c["BLOCK_N"]), jnp.int32)


def fwd0(q, k, v, seg, scale, *, has_seg):
    _check(q)
    B, T, HQ, D = q.shape
    c = _blocks("FWD", T, D, q.dtype.itemsize)
    lo, _ = _bounds(seg, c, has_seg)
    o, lse = jt.triton_call(
        q, k, v, seg, lo, kernel=K.fwd_kernel,
        out_shape=[jax.ShapeDtypeStruct((B, T, HQ, D), f32), jax.ShapeDtypeStruct((B, T, HQ), f32)],
        grid=(T // c["BLOCK_M"], B * HQ), **_meta(q, k, scale, has_seg), **c)
    return o, lse


def bwd0(q, k, v, seg, do, lse, delta, scale, *, has_seg):
    B, T, HQ, D = q.shape
    HKV = k.shape[2]
    do = do.astype(q.dtype)
    meta = _meta(q, k, scale, has_seg)
    c = _blocks("DQ", T, D, q.dtype.itemsize)
    lo, _ = _bounds(seg, c, has_seg)
    dq = jt.triton_call(q, k, v, seg, lo, do, lse, delta, kernel=K.dq_kernel,
                        out_shape=jax.ShapeDtypeStruct((B, T, HQ, D), f32),
                        grid=(T // c["BLOCK_M"], B * HQ), **meta, **c)
    c = _blocks("DKDV", T, D, q.dtype.itemsize)
    _, hi = _bounds(seg, c, has_seg)
    dk, dv = jt.triton_call(q, k, v, seg, hi, do, lse, delta, kernel=K.dkdv_kernel,
                            out_shape=[jax.ShapeDtypeStruct((B, T, HKV, D), f32)] * 2,
                            grid=(T // c["BLOCK_N"], B * HKV), **meta, **c)
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def backend(has_seg: bool) -> Backend:
    return Backend("triton", functools.partial(fwd0, has_seg=has_seg), functools.partial(bwd0, has_seg=has_seg),
                   MULTIPLE)


def ttt_attention(q, k0, v0, k_diag=None, v_diag=None, segment_ids=None, scale=None, *, block_size=None,
                  sinks=None):
    del block_size  # tiles are fixed per kernel and head width (FWD/DQ/DKDV, WIDE above)
    return ttt_attention_with(backend(segment_ids is not None), q, k0, v0, k_diag, v_diag, segment_ids, scale,
                              sinks)

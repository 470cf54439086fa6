"""`triton` fused soft-CE: triton_kernels.py through jax_triton (imports jax_triton: GPU installs only)."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import jax_triton as jt

from specjax_kernels.soft_ce import triton_kernels as K
from specjax_kernels.soft_ce.common import (Backend, combine_split_stats, f32, fused_with, heads_like_hidden,
                                            row_chunked_grads)

STATS = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)
DLOGITS = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)
TARGET_PROGRAMS = 4 * 132  # H100/H200 have 132 SMs; a few waves of programs


def _dummy(x):
    return jnp.zeros((1,), x.dtype)


def _teacher_args(h, t, th, tw):
    if t is not None:
        return t, _dummy(h), _dummy(h), dict(T_LOGITS=True, HT=16)
    return _dummy(h), th, tw, dict(T_LOGITS=False, HT=th.shape[1])


def stats(h, w, t, th, tw):
    N, H = h.shape
    V = w.shape[0]
    c = STATS
    n_blocks = -(-N // c["BLOCK_N"])
    n_tiles = -(-V // c["BLOCK_V"])
    nsplit = max(1, min(n_tiles, -(-TARGET_PROGRAMS // n_blocks)))
    vsplit = -(-n_tiles // nsplit) * c["BLOCK_V"]
    nsplit = -(-V // vsplit)
    t_, th_, tw_, tk = _teacher_args(h, t, th, tw)
    shp = jax.ShapeDtypeStruct((nsplit, N), f32)
    md, ld, mt, lt, s, bval, bidx = jt.triton_call(
        h, w, t_, th_, tw_, kernel=K.stats_kernel,
        out_shape=[shp] * 6 + [jax.ShapeDtypeStruct((nsplit, N), jnp.int32)],
        grid=(n_blocks, nsplit), N=N, V=V, H=H, VSPLIT=vsplit, IEEE=h.dtype == jnp.float32, **tk, **c)
    return combine_split_stats(md, ld, mt, lt, s, bval, bidx)


def grads(h, w, t, th, tw, g, lse_d, lse_t):
    N, H = h.shape
    V = w.shape[0]
    c = DLOGITS

    def dlogits(r0, r1):
        n = r1 - r0
        t_, th_, tw_, tk = _teacher_args(h, None if t is None else t[r0:r1], None if th is None else th[r0:r1], tw)
        return jt.triton_call(
            h[r0:r1], w, t_, th_, tw_, g[r0:r1], lse_d[r0:r1], lse_t[r0:r1], kernel=K.dlogits_kernel,
            out_shape=jax.ShapeDtypeStruct((n, V), h.dtype),
            grid=(-(-n // c["BLOCK_N"]), -(-V // c["BLOCK_V"])), N=n, V=V, H=H, IEEE=h.dtype == jnp.float32,
            **tk, **c)

    return row_chunked_grads(h, w, dlogits, c["BLOCK_N"])


BACKEND = Backend("triton", stats, grads)


def fused_linear_soft_ce(hidden, lm_head, teacher_logits=None, teacher_hidden=None, teacher_head=None, mask=None,
                         *, vocab_block=None):
    del vocab_block  # tiles are fixed (STATS / DLOGITS)
    lm_head, teacher_head = heads_like_hidden(hidden, lm_head, teacher_hidden, teacher_head)
    return fused_with(BACKEND, hidden, lm_head, teacher_logits, teacher_hidden, teacher_head, mask)

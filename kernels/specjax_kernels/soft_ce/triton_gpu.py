"""`triton` fused soft-CE: triton_kernels.py through jax_triton (imports jax_triton: GPU installs only)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax_triton as jt

from specjax_kernels.soft_ce import triton_kernels as K
from specjax_kernels.soft_ce.common import Backend, f32, fused_with

STATS = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)
DLOGITS = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3)
TARGET_PROGRAMS = 4 * 132  # H100/H200 have 132 SMs; a few waves of programs
ROW_CHUNK_BYTES = 1 << 30  # the backward's dd [rows, Vd] (input dtype) is built in row chunks of <= 1 GiB


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
    # combine the splits' partial statistics
    Md = md.max(0)
    lse_d = Md + jnp.log(jnp.sum(ld * jnp.exp(md - Md), 0))
    Mt = mt.max(0)
    a = jnp.exp(mt - Mt)
    Lt = jnp.sum(lt * a, 0)
    spd = jnp.sum(s * a, 0) / Lt
    win = jnp.argmax(bval, 0)  # first split on ties = lowest index
    amax = jnp.take_along_axis(bidx, win[None], 0)[0]
    return lse_d, Mt + jnp.log(Lt), spd, amax


def grads(h, w, t, th, tw, g, lse_d, lse_t):
    N, H = h.shape
    V = w.shape[0]
    c = DLOGITS
    rows = max(c["BLOCK_N"], (ROW_CHUNK_BYTES // (V * h.dtype.itemsize)) // c["BLOCK_N"] * c["BLOCK_N"])
    dh_parts, dw = [], jnp.zeros((V, H), f32)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        n = r1 - r0
        hc = h[r0:r1]
        t_, th_, tw_, tk = _teacher_args(h, None if t is None else t[r0:r1], None if th is None else th[r0:r1], tw)
        dd = jt.triton_call(
            hc, w, t_, th_, tw_, g[r0:r1], lse_d[r0:r1], lse_t[r0:r1], kernel=K.dlogits_kernel,
            out_shape=jax.ShapeDtypeStruct((n, V), h.dtype),
            grid=(-(-n // c["BLOCK_N"]), -(-V // c["BLOCK_V"])), N=n, V=V, H=H, IEEE=h.dtype == jnp.float32,
            **tk, **c)
        dh_parts.append(jnp.dot(dd, w, preferred_element_type=f32))
        dw = dw + jnp.einsum("nv,nh->vh", dd, hc, preferred_element_type=f32)
    return jnp.concatenate(dh_parts, 0), dw


BACKEND = Backend("triton", stats, grads)


def fused_linear_soft_ce(hidden, lm_head, teacher_logits=None, teacher_hidden=None, teacher_head=None, mask=None,
                         *, vocab_block=None):
    del vocab_block  # tiles are fixed (STATS / DLOGITS)
    # tl.dot wants both operands in one dtype: the heads follow their hidden states
    lm_head = lm_head.astype(hidden.dtype)
    if teacher_hidden is not None and teacher_head is not None:
        teacher_head = teacher_head.astype(teacher_hidden.dtype)
    return fused_with(BACKEND, hidden, lm_head, teacher_logits, teacher_hidden, teacher_head, mask)

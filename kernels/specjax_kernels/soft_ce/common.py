"""Shared custom VJP for the fused linear + soft-target cross-entropy.

Per row r, with draft logits d = hidden @ lm_head.T and teacher logits t (given, or teacher_hidden @
teacher_head.T), p = softmax(t):
  loss_r = mask_r * (lse(d_r) - sum_v p_rv d_rv)          (sum_v p_rv = 1)
  dloss_r/dd_rv = mask_r * (softmax(d_r)_v - p_rv)       (the teacher gets no gradient)
A backend supplies
  stats(h, w, t, th, tw) -> (lse_d, lse_t, spd = sum_v p d, argmax_d)   one streaming pass over Vd
  grads(h, w, t, th, tw, g, lse_d, lse_t) -> (dh f32 [N,H], dw f32 [Vd,H])
and recomputes the logits tile by tile in both, so only O(N) statistics are saved between the two.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    stats: Callable
    grads: Callable


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(be, h, w, t, th, tw, mask):
    out, _ = _fused_fwd(be, h, w, t, th, tw, mask)
    return out


def _fused_fwd(be, h, w, t, th, tw, mask):
    lse_d, lse_t, spd, amax = be.stats(h, w, t, th, tw)
    loss = (lse_d - spd) * mask
    return (loss, amax), (h, w, t, th, tw, mask, lse_d, lse_t)


def _fused_bwd(be, res, cts):
    h, w, t, th, tw, mask, lse_d, lse_t = res
    g = cts[0].astype(accum_dtype(h)) * mask
    dh, dw = be.grads(h, w, t, th, tw, g, lse_d, lse_t)
    return dh.astype(h.dtype), dw.astype(w.dtype), None, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def check_inputs(hidden, lm_head, teacher_logits, teacher_hidden, teacher_head, mask):
    if hidden.ndim < 2 or lm_head.ndim != 2 or lm_head.shape[1] != hidden.shape[-1]:
        raise ValueError(f"fused_linear_soft_ce wants hidden [...,H] and lm_head [Vd,H]; got {hidden.shape} and "
                         f"{lm_head.shape} (a [H,Vd] kernel needs a .T).")
    lead, V = hidden.shape[:-1], lm_head.shape[0]
    if (teacher_logits is None) == (teacher_hidden is None):
        raise ValueError("pass exactly one of teacher_logits [...,Vd] or teacher_hidden [...,Ht] (+ teacher_head).")
    if teacher_logits is not None and teacher_logits.shape != lead + (V,):
        raise ValueError(f"teacher_logits must be {lead + (V,)}; got {teacher_logits.shape}.")
    if teacher_hidden is not None:
        if teacher_head is None or teacher_head.ndim != 2 or teacher_head.shape[0] != V:
            raise ValueError(f"teacher_hidden needs teacher_head [Vd={V},Ht]; got "
                             f"{None if teacher_head is None else teacher_head.shape}.")
        if teacher_hidden.shape != lead + (teacher_head.shape[1],):
            raise ValueError(f"teacher_hidden must be {lead + (teacher_head.shape[1],)}; got {teacher_hidden.shape}.")
    if mask is not None and mask.shape != lead:
        raise ValueError(f"mask must be {lead} (one weight per row); got {mask.shape}.")


def fused_with(be: Backend, hidden, lm_head, teacher_logits=None, teacher_hidden=None, teacher_head=None, mask=None):
    check_inputs(hidden, lm_head, teacher_logits, teacher_hidden, teacher_head, mask)
    lead, H = hidden.shape[:-1], hidden.shape[-1]
    N = 1
    for n in lead:
        N *= n
    flat = lambda x: None if x is None else x.reshape(N, x.shape[-1])
    acc = accum_dtype(hidden)
    m = jnp.ones((N,), acc) if mask is None else mask.reshape(N).astype(acc)
    sg = jax.lax.stop_gradient
    t = None if teacher_logits is None else sg(flat(teacher_logits))
    th = None if teacher_hidden is None else sg(flat(teacher_hidden))
    tw = None if teacher_head is None else sg(teacher_head)
    loss, amax = _fused(be, hidden.reshape(N, H), lm_head, t, th, tw, m)
    return loss.reshape(lead), amax.reshape(lead)


# ---- pieces shared by the kernel backends (triton, pallas_gpu, pallas_tpu) ----

ROW_CHUNK_BYTES = 1 << 30  # the backward's dd [rows, Vd] (input dtype) is built in row chunks of <= 1 GiB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pad_to(x, shape):
    """Zero-pad x at the end of each axis up to ``shape`` (no copy when it already has it)."""
    if x.shape == tuple(shape):
        return x
    return jnp.pad(x, [(0, s - n) for n, s in zip(x.shape, shape)])


def heads_like_hidden(hidden, lm_head, teacher_hidden, teacher_head):
    """The kernels' dots want both operands in one dtype: each head follows its hidden states."""
    lm_head = lm_head.astype(hidden.dtype)
    if teacher_hidden is not None and teacher_head is not None:
        teacher_head = teacher_head.astype(teacher_hidden.dtype)
    return lm_head, teacher_head


def combine_split_stats(md, ld, mt, lt, s, bval, bidx):
    """Merge per-vocab-split partial statistics [nsplit, N] (running max and sum for the draft and
    the teacher, s = sum exp(t - m_t) d, best value and index) into (lse_d, lse_t, spd, argmax)."""
    Md = md.max(0)
    lse_d = Md + jnp.log(jnp.sum(ld * jnp.exp(md - Md), 0))
    Mt = mt.max(0)
    a = jnp.exp(mt - Mt)
    Lt = jnp.sum(lt * a, 0)
    spd = jnp.sum(s * a, 0) / Lt
    win = jnp.argmax(bval, 0)  # first split on ties = lowest index
    return lse_d, Mt + jnp.log(Lt), spd, jnp.take_along_axis(bidx, win[None], 0)[0]


def row_chunked_grads(h, w, dlogits, block_n, chunk_bytes=ROW_CHUNK_BYTES):
    """dh = dd @ W (a reduction over the vocab) and dW = dd.T @ h (over the rows) as XLA GEMMs, with
    dd [rows, V] in h's dtype made by ``dlogits(r0, r1)`` for row chunks of <= chunk_bytes, so dd
    never exists for all rows at once. h [N, H], w [V, H]; returns (dh f32 [N, H], dw f32 [V, H])."""
    N, V = h.shape[0], w.shape[0]
    rows = max(block_n, (chunk_bytes // (V * h.dtype.itemsize)) // block_n * block_n)
    dh_parts, dw = [], jnp.zeros(w.shape, f32)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        dd = dlogits(r0, r1)
        dh_parts.append(jnp.dot(dd, w, preferred_element_type=f32))
        dw = dw + jnp.einsum("nv,nh->vh", dd, h[r0:r1], preferred_element_type=f32)
    return jnp.concatenate(dh_parts, 0), dw

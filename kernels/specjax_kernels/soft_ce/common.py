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
    g = cts[0].astype(f32) * mask
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
    m = jnp.ones((N,), f32) if mask is None else mask.reshape(N).astype(f32)
    sg = jax.lax.stop_gradient
    t = None if teacher_logits is None else sg(flat(teacher_logits))
    th = None if teacher_hidden is None else sg(flat(teacher_hidden))
    tw = None if teacher_head is None else sg(teacher_head)
    loss, amax = _fused(be, hidden.reshape(N, H), lm_head, t, th, tw, m)
    return loss.reshape(lead), amax.reshape(lead)

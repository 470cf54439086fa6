"""`xla_saved` soft-CE: the draft logits are computed once, stored in the input dtype, and reused.

Forward: one GEMM d = hidden @ lm_head.T (f32 accumulation, the result written in hidden's dtype),
the teacher logits t (given, or teacher_hidden @ teacher_head.T computed once, also in hidden's
dtype), then per row in f32 (each reduction upcasts its tile inside the fusion):
  lse_d = logsumexp(d), lse_t = logsumexp(t), s = sum softmax(t) * d, argmax d (first index on ties)
  loss = (lse_d - s) * mask
Backward: dd = (g * mask)[:, None] * (exp(d - lse_d) - exp(t - lse_t)) in hidden's dtype,
dh = dd @ lm_head, dW = dd.T @ hidden (f32 accumulation). Three GEMMs of N*H*Vd in all (plus the
teacher GEMM in the forward when the teacher comes as hidden states), against four for `xla`,
which recomputes the logits tile by tile in the backward.

Memory: the trade is the recompute for one saved [N, Vd] buffer in the input dtype (bf16: 2 bytes
per element; with f32 inputs it is f32), plus the teacher logits: the caller's array when given
(held anyway), or a second [N, Vd] buffer in hidden's dtype when computed from teacher_hidden.
No f32 [N, Vd] buffer is saved for the backward when the inputs are bf16; the other residuals are
O(N) (lse_d, lse_t, mask) and the inputs. The loss and gradients are those of the logits rounded to
the input dtype (exact for f32 inputs; bf16 rounding, 2^-8 relative per logit, otherwise).
`vocab_block` is accepted for a uniform signature and ignored (nothing is tiled).
On XLA:CPU the compiled plan still holds f32 logits (see _logits); the saving is expected where the
GEMM writes bf16 itself (GPU), and is for benchmarks/kernel_speed.py's plan bytes (mem_gib) to confirm.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.soft_ce.common import check_inputs, f32


def _logits(a, b, dtype):
    """a [N,K] @ b [V,K].T with f32 accumulation, returned in `dtype`.

    When both operands are `dtype`, the dot itself writes `dtype` (bf16 GEMMs accumulate in f32; on
    GPU one cuBLAS call with a bf16 output), so the program never holds an f32 [N,V] product. An f32
    dot followed by a cast would rely on fusion, and XLA's excess-precision rewrite
    (xla_allow_excess_precision, on by default) may remove a cast-down/cast-up pair and keep the f32
    product instead. XLA:CPU upcasts bf16 dots itself and then does exactly that (its plan keeps f32
    logits and skips the rounding), so the CPU plan says nothing about the GPU one. Mixed dtypes: an
    f32 dot, then a cast."""
    if a.dtype == b.dtype == dtype:
        return jnp.einsum("nk,vk->nv", a, b, preferred_element_type=dtype)
    return jnp.einsum("nk,vk->nv", a, b, preferred_element_type=f32).astype(dtype)


def _lse(x):  # [N, V] any float dtype -> [N] f32; the upcast stays inside the reductions
    x = x.astype(f32)
    m = x.max(1)
    return m + jnp.log(jnp.exp(x - m[:, None]).sum(1))


def _stats(d, t):
    lse_d = _lse(d)
    tf = t.astype(f32)
    mt = tf.max(1)
    e = jnp.exp(tf - mt[:, None])
    lt = e.sum(1)
    s = jnp.sum(e * d.astype(f32), 1) / lt  # sum_v softmax(t)_v d_v
    return lse_d, mt + jnp.log(lt), s, jnp.argmax(d, 1).astype(jnp.int32)


@jax.custom_vjp
def _fused(h, w, t, mask):
    out, _ = _fused_fwd(h, w, t, mask)
    return out


def _fused_fwd(h, w, t, mask):
    d = _logits(h, w, h.dtype)
    lse_d, lse_t, s, amax = _stats(d, t)
    return ((lse_d - s) * mask, amax), (d, t, lse_d, lse_t, h, w, mask)


def _fused_bwd(res, cts):
    d, t, lse_d, lse_t, h, w, mask = res
    g = cts[0].astype(f32) * mask
    p_d = jnp.exp(d.astype(f32) - lse_d[:, None])
    p_t = jnp.exp(t.astype(f32) - lse_t[:, None])
    dd = (g[:, None] * (p_d - p_t)).astype(h.dtype)
    dh = jnp.einsum("nv,vh->nh", dd, w, preferred_element_type=f32).astype(h.dtype)
    dw = jnp.einsum("nv,nh->vh", dd, h, preferred_element_type=f32).astype(w.dtype)
    return dh, dw, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_linear_soft_ce(hidden, lm_head, teacher_logits=None, teacher_hidden=None, teacher_head=None, mask=None,
                         *, vocab_block=None):
    """Same contract as xla.fused_linear_soft_ce: hidden [...,H], lm_head [Vd,H], teacher_logits [...,Vd]
    or teacher_hidden [...,Ht] + teacher_head [Vd,Ht], mask [...]. Returns (loss [...] f32 with the
    mask applied, argmax [...] int32). Gradients reach hidden and lm_head only."""
    del vocab_block  # no tiling here
    check_inputs(hidden, lm_head, teacher_logits, teacher_hidden, teacher_head, mask)
    lead, H = hidden.shape[:-1], hidden.shape[-1]
    N = 1
    for n in lead:
        N *= n
    sg = jax.lax.stop_gradient
    if teacher_logits is not None:
        t = sg(teacher_logits.reshape(N, teacher_logits.shape[-1]))
    else:
        t = _logits(sg(teacher_hidden.reshape(N, teacher_hidden.shape[-1])), sg(teacher_head), hidden.dtype)
    m = jnp.ones((N,), f32) if mask is None else mask.reshape(N).astype(f32)
    loss, amax = _fused(hidden.reshape(N, H), lm_head, t, m)
    return loss.reshape(lead), amax.reshape(lead)

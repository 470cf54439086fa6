"""Soft-target cross-entropy over the draft vocab, the definition (plain jnp, fp32).

loss[row] = -sum_v softmax(teacher)[v] * log_softmax(draft)[v]
          = logsumexp(draft) - sum_v p_v * draft_v
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def soft_cross_entropy(draft_logits: jnp.ndarray, teacher_logits: jnp.ndarray) -> jnp.ndarray:
    """[..., Vd] x [..., Vd] -> [...] per-row loss in fp32. The teacher gets no gradient."""
    d = draft_logits.astype(jnp.float32)
    p = jax.nn.softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), axis=-1)
    return jax.nn.logsumexp(d, axis=-1) - jnp.sum(p * d, axis=-1)


def fused_linear_soft_ce(hidden, lm_head, teacher_logits=None, teacher_hidden=None, teacher_head=None, mask=None,
                         softcap=None):
    """The fused op's definition: logits = hidden @ lm_head.T materialised in fp32.

    hidden [N,H], lm_head [Vd,H]; the teacher is teacher_logits [N,Vd], or teacher_hidden [N,Ht] @
    teacher_head[Vd,Ht].T. `softcap` c: the logits computed here (not given teacher logits) are
    c * tanh(logits / c). Returns (loss [N] fp32, zero where mask == 0; argmax of the draft logits [N])."""
    f32 = jnp.float32
    cap = (lambda x: x) if softcap is None else (lambda x: softcap * jnp.tanh(x / softcap))
    d = cap(jnp.einsum("nh,vh->nv", hidden, lm_head, preferred_element_type=f32))
    if teacher_logits is None:
        teacher_logits = cap(jnp.einsum("nh,vh->nv", teacher_hidden, teacher_head, preferred_element_type=f32))
    loss = soft_cross_entropy(d, teacher_logits)
    if mask is not None:
        loss = loss * mask.astype(f32)
    return loss, jnp.argmax(d, axis=-1).astype(jnp.int32)

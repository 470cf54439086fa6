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

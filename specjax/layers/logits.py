"""Output-logit transforms a target applies after its lm_head, shared by the targets that have them
and by the training teachers that must see the same distribution."""
from __future__ import annotations

import jax.numpy as jnp


def soft_cap(logits, cap: float | None):
    """cap * tanh(logits / cap) (transformers' final_logit_softcapping: Gemma 2 / 4); None leaves the
    logits as they are."""
    if cap is None:
        return logits
    c = jnp.asarray(cap, logits.dtype)
    return jnp.tanh(logits / c) * c

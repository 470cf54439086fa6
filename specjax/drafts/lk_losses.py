"""LK losses: per-step objectives that optimise the draft's acceptance rate directly instead of only
its soft cross entropy (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for
Speculative Decoding", arXiv 2602.23881). With draft distribution q and target distribution p over
the draft vocab, the expected acceptance of one drafted token under rejection sampling is
alpha = sum_v min(p_v, q_v) = 1 - TV(p, q).

`train.loss` (docs/eagle3-format.md, "LK losses"):
- `soft_ce` (default): the EAGLE-3 soft cross entropy, no LK term.
- `lk_alpha`: -(masked mean over the step's rows of log alpha_t), with p the target's *full-vocab*
  probabilities of the draft-vocab tokens (not renormalised, so alpha is the acceptance the served
  draft gets) -- SpecForge's `lk_loss_type: alpha`.
- `lk_lambda`: w * CE + (1 - w) * (1 - mean alpha), w = kl_scale * exp(-kl_decay * sg(mean alpha)),
  CE the step's soft cross entropy (sum over rows / (B*T)), alpha as for lk_alpha -- SpecForge's
  `lk_loss_type: lambda`.
- `lk_hybrid`: per row w_t * KL(p||q) + (1 - w_t) * TV(p, q), w_t = exp(-eta * sg(alpha_t)), p the
  target renormalised over the draft vocab, reduced by the masked mean (sum / (mask sum + 1e-5)) --
  speculators' `lk_hybrid_loss`.
The masked means run over the step's position mask (loss mask, same document, target argmax in the
draft vocab), the rows the soft CE is taken over.
"""
from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp

LossName = Literal["soft_ce", "lk_alpha", "lk_lambda", "lk_hybrid"]
LOSSES = ("soft_ce", "lk_alpha", "lk_lambda", "lk_hybrid")

_MEAN_EPS = 1e-8  # SpecForge's clamp of the mask sum
HYBRID_EPS = 1e-5  # speculators' reduction epsilon


def expected_acceptance(draft_logits: jnp.ndarray, target_probs: jnp.ndarray) -> jnp.ndarray:
    """alpha = sum_v min(p_v, softmax(draft_logits)_v) over the last axis (fp32)."""
    q = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.minimum(target_probs.astype(jnp.float32), q), axis=-1)


def _masked_mean(x, mask, eps):
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), eps)


def step_loss(
    loss: str,
    draft_logits: jnp.ndarray,  # [B,T,Vd] the draft's logits of this step (loss frame)
    teacher_logits: jnp.ndarray,  # [B,T,Vd] the target's logits of the draft-vocab tokens, same rows
    target_lse: Optional[jnp.ndarray],  # [B,T] logsumexp of the target's full-vocab logits (lk_alpha/lambda)
    mask: jnp.ndarray,  # [B,T] the step's position mask
    *,
    kl_scale: float = 1.0,
    kl_decay: float = 1.0,
    eta: float = 3.0,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """(the step's objective, its soft CE (sum over rows / (B*T)), the masked mean acceptance
    alpha, detached). The soft CE is the EAGLE-3 loss of the step whatever `loss` is."""
    B, T = mask.shape
    mask = mask.astype(jnp.float32)
    logq = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    teacher = teacher_logits.astype(jnp.float32)
    p_draft_vocab = jax.nn.softmax(teacher, axis=-1)  # renormalised over the draft vocab
    ce = jnp.sum(mask * -jnp.sum(p_draft_vocab * logq, axis=-1)) / (B * T)
    if loss == "soft_ce":
        alpha = jnp.sum(jnp.minimum(p_draft_vocab, jnp.exp(logq)), axis=-1)
        return ce, ce, jax.lax.stop_gradient(_masked_mean(alpha, mask, _MEAN_EPS))
    if loss in ("lk_alpha", "lk_lambda"):
        if target_lse is None:
            raise ValueError(f"train.loss={loss} needs the target's full-vocab logsumexp")
        p_full = jnp.exp(teacher - target_lse[..., None].astype(jnp.float32))
        alpha = jnp.sum(jnp.minimum(p_full, jnp.exp(logq)), axis=-1)
        acc = _masked_mean(alpha, mask, _MEAN_EPS)
        if loss == "lk_alpha":
            # log alpha where alpha > 0, else 0 (the inner where keeps the unused branch's gradient finite)
            log_alpha = jnp.where(alpha > 0, jnp.log(jnp.where(alpha > 0, alpha, 1.0)), 0.0)
            obj = -_masked_mean(log_alpha, mask, _MEAN_EPS)
        else:
            w = kl_scale * jnp.exp(-kl_decay * jax.lax.stop_gradient(acc))
            obj = w * ce + (1.0 - w) * (1.0 - acc)
        return obj, ce, jax.lax.stop_gradient(acc)
    if loss == "lk_hybrid":
        alpha = jnp.sum(jnp.minimum(p_draft_vocab, jnp.exp(logq)), axis=-1)
        logp = jax.nn.log_softmax(teacher, axis=-1)
        kl = jnp.sum(p_draft_vocab * (logp - logq), axis=-1)
        w = jnp.exp(-eta * jax.lax.stop_gradient(alpha))
        per_row = w * kl + (1.0 - w) * (1.0 - alpha)
        obj = jnp.sum(per_row * mask) / (jnp.sum(mask) + HYBRID_EPS)
        return obj, ce, jax.lax.stop_gradient(_masked_mean(alpha, mask, _MEAN_EPS))
    raise ValueError(f"train.loss={loss!r}: expected one of {LOSSES}")

"""Optimizer: AdamW with linear warmup then cosine decay, global-norm clipping
(docs/eagle3-format.md, "Optimizer recipe")."""
from __future__ import annotations

import jax
import optax

from specjax.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    total_steps = max(int(total_steps), 1)
    warmup = min(int(round(cfg.warmup_ratio * total_steps)), total_steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup > 0 else cfg.lr,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=total_steps,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _decay_mask(params):
    # no weight decay on norm scales (1-D); matrices decay when weight_decay > 0
    return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    chain = []
    if cfg.grad_clip and cfg.grad_clip > 0:
        chain.append(optax.clip_by_global_norm(cfg.grad_clip))
    chain.append(
        optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay, mask=_decay_mask)
    )
    return optax.chain(*chain)

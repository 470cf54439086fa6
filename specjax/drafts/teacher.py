"""A top-k teacher: the target's k largest logits over the draft vocabulary, per token, as a state cache
can hold them instead of the final hidden state (precompute.teacher_top_k; specjax.data.state_cache).

A draft's loss takes the teacher either as the target's final hidden state (the logits computed from it
and the lm_head, every draft-vocab entry) or as a `TopKTeacher`; `dense_logits` turns the latter into
[B, T, Vd] logits whose entries outside the top k are far below the largest (exp underflows to exactly 0
in float32), so the softmax over them is the teacher restricted to its top k and renormalised. The
target's full-vocab argmax and logsumexp are kept exactly (the accuracy metrics and the LK losses' p).

The bound (docs/training.md, "A top-k teacher instead of the final hidden state"): with p the draft-vocab teacher, p_k its top-k
renormalisation and m = 1 - sum of p's top k (the tail mass), for any draft distribution q:
|CE(p, q) - CE(p_k, q)| <= m * max_i(-log q_i), and the gradient in the draft's logits, q - p, moves by
p - p_k, whose L1 norm is exactly 2m.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["TOPK_STATE_KEYS", "TopKTeacher", "dense_logits", "tail_mass", "top_k_of"]

# the batch keys a top-k state cache feeds the step (beside aux_hidden)
TOPK_STATE_KEYS = ("teacher_ids", "teacher_logits", "target_argmax", "target_lse")
# how far below a token's largest kept logit the others sit: exp(-1e4) is 0 in float32, and the gap
# stays small enough that squares and products of logits remain finite
_GAP = 1e4


class TopKTeacher(NamedTuple):
    ids: jax.Array  # [B, T, k] int32: draft-vocab indices of the k largest teacher logits, largest first
    logits: jax.Array  # [B, T, k] float32: those logits (after the target's soft-cap, if it has one)
    argmax: jax.Array  # [B, T] int32: the target's full-vocab argmax
    lse: jax.Array  # [B, T] float32: the target's full-vocab logsumexp

    @classmethod
    def from_batch(cls, batch) -> "TopKTeacher":
        return cls(*(batch[k] for k in TOPK_STATE_KEYS))


def top_k_of(teacher_logits, argmax, lse, k: int) -> TopKTeacher:
    """The top-k teacher of dense draft-vocab logits [..., Vd] (and the full-vocab argmax / lse)."""
    values, ids = jax.lax.top_k(teacher_logits.astype(jnp.float32), k)
    return TopKTeacher(ids.astype(jnp.int32), values, argmax.astype(jnp.int32), lse.astype(jnp.float32))


def dense_logits(t: TopKTeacher, draft_vocab_size: int) -> jax.Array:
    """[B, T, Vd] float32 logits: the kept ones in place, every other entry _GAP below the largest."""
    B, T, _ = t.ids.shape
    floor = jnp.max(t.logits, axis=-1, keepdims=True) - _GAP
    dense = jnp.broadcast_to(floor, (B, T, draft_vocab_size))
    return dense.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], t.ids].set(t.logits)


def tail_mass(teacher_logits, k: int) -> jax.Array:
    """1 - (the draft-vocab teacher's probability on its top k), per token: the m of the bound."""
    p = jax.nn.softmax(teacher_logits.astype(jnp.float32), axis=-1)
    return 1.0 - jnp.sum(jax.lax.top_k(p, k)[0], axis=-1)

"""Row batching shared by the batched generators (`generate`, `continuous`) and the speculative loop
(`spec_loop`): the static shapes their compiled programs see (prompt buckets, output buffers rounded
up, the EOS list padded), the checks of a request (prompts, sampling settings), cutting an answer at
its EOS, and the rows of a target's KV cache (each leaf's batch and slot axes, and writing a few rows
into a batch's cache).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.targets.layers.attention import CACHE_MULTIPLE

_PROMPT_BUCKET_MIN = 16
OUT_MULTIPLE = 32
_EOS_SLOTS = 8  # the EOS list is padded to a multiple of this (one compile for 1..8 EOS ids)


def prompt_bucket(n: int) -> int:
    """Static chunk length for a prompt of n tokens: the next power of two, at least 16."""
    return max(_PROMPT_BUCKET_MIN, 1 << max(0, int(n) - 1).bit_length())


def round_up(n: int, m: int) -> int:
    """n rounded up to a multiple of m."""
    return -(-int(n) // m) * m


def is_eos(tok_b, eos_e):
    """bool [B]: whether each token is one of the EOS ids `eos_e` (an `eos_array`)."""
    return jnp.any(tok_b[:, None] == eos_e[None, :], axis=-1)


def eos_array(eos_token_ids: Sequence[int]) -> np.ndarray:
    """The EOS ids as int32, padded with -1 (never a token) to a multiple of _EOS_SLOTS: one compiled
    shape for 1..8 EOS ids."""
    eos = [int(e) for e in eos_token_ids]
    arr = np.full(round_up(max(len(eos), 1), _EOS_SLOTS), -1, np.int32)
    arr[: len(eos)] = eos
    return arr


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """The prompts as lists of int; ValueError for an empty prompt or a token id outside the vocab."""
    out = []
    for i, p in enumerate(prompts):
        ids = [int(x) for x in p]
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
        bad = [x for x in ids if not 0 <= x < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the target vocab [0, {vocab_size})")
        out.append(ids)
    return out


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    if int(max_new_tokens) < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not float(temperature) >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def cut_at_eos(tokens: Sequence[int], eos_token_ids: Sequence[int]) -> list[int]:
    """Tokens before the first EOS (the EOS itself dropped)."""
    eos = set(int(e) for e in eos_token_ids)
    out = []
    for tok in tokens:
        if int(tok) in eos:
            break
        out.append(int(tok))
    return out


def _axis_that_changes(small, large, what: str, optional: bool) -> dict:
    """Per leaf of two caches of the same tree, the one axis whose size differs (-1 when none differs
    and `optional`)."""
    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if len(diff) > 1 or (not diff and not optional):
            raise ValueError(f"cannot find the {what} axis of a cache leaf: {a.shape} vs {b.shape}")
        return diff[0] if diff else -1

    return jax.tree.map(axis, small, large)


def cache_batch_axes(target_cls, config, dtype) -> dict:
    """The batch axis of every cache leaf (same tree as the cache), found by comparing the cache
    shapes for one and for two rows: targets lay their caches out differently ([L, B, ...] KV and
    SSM states, [B, W] slot labels)."""
    one = jax.eval_shape(lambda: target_cls.decoder.init_cache(config, 1, 16, dtype))
    two = jax.eval_shape(lambda: target_cls.decoder.init_cache(config, 2, 16, dtype))
    return _axis_that_changes(one, two, "batch", optional=False)


def cache_slot_axes(target_cls, config, dtype) -> dict:
    """The axis of every cache leaf that grows with the cache length (KV slots, Nemotron-H's conv
    inputs by slot), or -1 for a leaf of fixed size (SSM states and their slot labels); found by
    comparing the caches for two lengths."""
    short = jax.eval_shape(lambda: target_cls.decoder.init_cache(config, 1, CACHE_MULTIPLE, dtype))
    long = jax.eval_shape(lambda: target_cls.decoder.init_cache(config, 1, 2 * CACHE_MULTIPLE, dtype))
    return _axis_that_changes(short, long, "slot", optional=True)


def scatter_rows(big, small, rows_n, axes, slot_axes):
    """Write the n rows of `small` into `big` at `rows_n` along each leaf's batch axis (rows past the
    end, the padding of a refill group, are dropped). A leaf with slots writes `small`'s first slots
    only: the row's later slots keep the last request's entries, which no query sees before its own
    step has overwritten them (a row's mask ends at its position)."""
    def put(b, s, ax, sx):
        idx = (slice(None),) * ax + (rows_n,)
        if sx >= 0:
            idx = idx + (slice(0, s.shape[sx]),)
        return b.at[idx].set(s, mode="drop")

    return jax.tree.map(put, big, small, axes, slot_axes)

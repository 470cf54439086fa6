"""Batched autoregressive generation with the JAX target and a KV cache.

Used by regeneration (the target answers the prompts it will be trained against) and as a plain
decoding reference. One jitted program per (batch, prompt bucket, output bucket, greedy/sampling):
a prefill of the right-padded prompts, then a `lax.while_loop` of one-token steps that stops when
every row has produced an EOS or `max_new_tokens` is reached. Prompt lengths are padded to powers of
two (>= 16) and the output buffer to a multiple of 32, so the number of compilations stays small.

Row layout in the cache: prompt b occupies slots 0..len_b-1 at positions 0..len_b-1; generated token
k sits at slot/position len_b+k. Padding after a short prompt is written by the prefill, but it lies
at or after the row's valid length, so it is masked and later overwritten (targets.llama.decode_chunk).

`generate(..., refill=True)` (greedy): every prompt through `batch_size` cache rows in one device
program (`_greedy_stream`): after each step a row whose answer ended hands it back and takes the next
waiting prompt (its prefill runs for that row alone, inside the loop), so no row waits for a batch's
longest answer. It is the greedy side of `SpecLoop.generate(..., refill=True)`, built the same way, so
a refill speedup compares like with like (`eval.continuous.ContinuousGenerator` refills from the host
between segments of steps).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.eval.batching import (OUT_MULTIPLE, cache_batch_axes, check_prompts, check_sampling, cut_at_eos,
                                   eos_array, is_eos, prompt_bucket, round_up, scatter_rows)


def sample_token(logits_bv: jax.Array, key: jax.Array, temperature, top_p, *, sample: bool) -> jax.Array:
    """[B] int32: argmax when not `sample`; else a draw from softmax(logits / temperature) restricted
    to the smallest top set of tokens whose mass reaches top_p (nucleus; the top token always stays)."""
    if not sample:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits = logits_bv.astype(jnp.float32) / temperature
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly better tokens
    keep = mass_before < top_p
    keep = keep.at[:, 0].set(True)
    choice = jax.random.categorical(key, jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _prefill(params, ids_bt, lens_b, *, target_cls, config, cache_len):
    """The right-padded prompts [B, T] into a fresh B-row cache of `cache_len` slots: (fp32 logits
    [B, 1, V] at each prompt's last token, the cache)."""
    b, t = ids_bt.shape
    cache = target_cls.decoder.init_cache(config, b, cache_len, target_cls.decoder.embed_table(params, config).dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _, _, cache = target_cls.decoder.decode_chunk(
        params, config, cache, ids_bt, positions, jnp.zeros((b,), jnp.int32), logits_index=(lens_b - 1)[:, None])
    return logits, cache


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "cache_len", "n_out", "sample"))
def _generate_batch(params, ids_bt, lens_b, max_new, key, temperature, top_p, eos_e, *,
                    target_cls, config, cache_len, n_out, sample):
    b = ids_bt.shape[0]
    logits, cache = _prefill(params, ids_bt, lens_b, target_cls=target_cls, config=config, cache_len=cache_len)
    key, sub = jax.random.split(key)
    tok = sample_token(logits[:, 0], sub, temperature, top_p, sample=sample)
    out = jnp.zeros((b, n_out), jnp.int32).at[:, 0].set(tok)
    done = is_eos(tok, eos_e)

    def cond(state):
        step, _, _, done, _ = state
        return (step < max_new) & ~jnp.all(done)

    def body(state):
        step, cache, out, done, key = state
        prev = jax.lax.dynamic_index_in_dim(out, step - 1, axis=1, keepdims=True)  # [B, 1]
        pos = lens_b + step - 1  # slot == position of the previous token
        logits, _, _, cache = target_cls.decoder.decode_chunk(params, config, cache, prev, pos[:, None], pos)
        key, sub = jax.random.split(key)
        tok = sample_token(logits[:, 0], sub, temperature, top_p, sample=sample)
        tok = jnp.where(done, 0, tok)
        out = jax.lax.dynamic_update_slice_in_dim(out, tok[:, None], step, axis=1)
        return step + 1, cache, out, done | is_eos(tok, eos_e), key

    state = (jnp.int32(1), cache, out, done, key)
    _, _, out, _, _ = jax.lax.while_loop(cond, body, state)
    return out


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "cache_len", "n_out", "slots"))
def _greedy_stream(params, ids_nt, lens_n, max_new, eos_e, *, target_cls, config, cache_len, n_out, slots):
    """Greedy answers [N, n_out] of all N prompts through `slots` rows (see the module docstring). A row
    holds request `req` (-1: none) with `count` tokens so far; a stopped row (EOS or max_new) is
    handed back after the step that stopped it and refilled at once. Each answer's tokens are the
    same argmaxes as `_generate_batch`'s (greedy decoding does not depend on the batch)."""
    n = ids_nt.shape[0]
    axes = cache_batch_axes(target_cls, config, target_cls.decoder.embed_table(params, config).dtype)
    whole_rows = jax.tree.map(lambda _: -1, axes)

    def prefill(ids, lens):
        """The first tokens [m] of m prompts and their m-row cache."""
        logits, cache = _prefill(params, ids, lens, target_cls=target_cls, config=config, cache_len=cache_len)
        return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), cache

    def fresh(first, lens, req):
        """Row states of requests `req` whose prefill drew `first`."""
        m = first.shape[0]
        return dict(req=req, lens=lens, count=jnp.ones((m,), jnp.int32), last=first,
                    out=jnp.zeros((m, n_out), jnp.int32).at[:, 0].set(first),
                    stop=is_eos(first, eos_e) | (max_new <= 1))

    first, cache = prefill(ids_nt[:slots], lens_n[:slots])
    rows = fresh(first, lens_n[:slots], jnp.arange(slots, dtype=jnp.int32))
    outs = jnp.zeros((n, n_out), jnp.int32)

    def hand_back_and_refill(c):
        rows, cache, nxt, outs = c
        done = rows["stop"] & (rows["req"] >= 0)
        outs = outs.at[jnp.where(done, rows["req"], n)].set(rows["out"], mode="drop")
        rows = dict(rows, req=jnp.where(done, -1, rows["req"]))

        def refill(rc):
            rows, cache, q = rc
            r = jnp.argmax(rows["req"] < 0)
            first1, cache1 = prefill(ids_nt[q][None], lens_n[q][None])
            one = fresh(first1, lens_n[q][None], q[None])
            rows = jax.tree.map(lambda a, x: a.at[r].set(x[0]), rows, one)
            return rows, scatter_rows(cache, cache1, jnp.reshape(r, (1,)), axes, whole_rows), q + 1

        rows, cache, nxt = jax.lax.while_loop(lambda rc: jnp.any(rc[0]["req"] < 0) & (rc[2] < n), refill,
                                              (rows, cache, nxt))
        return rows, cache, nxt, outs

    def step(c):
        rows, cache, nxt, outs = c
        go = ~rows["stop"] & (rows["req"] >= 0)
        pos = rows["lens"] + rows["count"] - 1  # slot == position of the newest token
        logits, _, _, cache = target_cls.decoder.decode_chunk(params, config, cache, rows["last"][:, None], pos[:, None], pos)
        tok = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        b = jnp.arange(slots)
        out = rows["out"].at[b, jnp.where(go, rows["count"], n_out)].set(tok, mode="drop")
        count = rows["count"] + go.astype(jnp.int32)
        stop = rows["stop"] | (go & (is_eos(tok, eos_e) | (count >= max_new)))
        rows = dict(rows, out=out, count=count, last=jnp.where(go, tok, rows["last"]), stop=stop)
        return hand_back_and_refill((rows, cache, nxt, outs))

    carry = hand_back_and_refill((rows, cache, jnp.int32(slots), outs))
    # while any row holds a request (a request can stop on its first token, right after its refill)
    carry = jax.lax.while_loop(lambda c: jnp.any(c[0]["req"] >= 0), step, carry)
    return carry[-1]


def generate(
    target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    batch_size: int = 16,
    refill: bool = False,
) -> list[list[int]]:
    """Continue each prompt with the target; returns the new tokens only, per prompt in input
    order, cut before the first EOS (EOS not included), at most `max_new_tokens`.

    Greedy when temperature == 0 (batch-independent). With temperature > 0 tokens are drawn with
    nucleus (top_p) sampling from a jax PRNG seeded by `seed`; prompts are grouped by length into
    batches of `batch_size`, and the draws depend on that grouping.

    refill (greedy only): all prompts in one device program of `batch_size` rows, each row taking the
    next prompt as soon as its answer ends (`_greedy_stream`); the same answers.
    """
    target.require_decoding()
    check_sampling(max_new_tokens, temperature, top_p)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if refill and float(temperature) > 0.0:
        raise ValueError("refill=True decodes greedily (temperature 0); for sampled answers with refill use "
                         "specjax.eval.continuous.ContinuousGenerator")
    prompts = check_prompts(prompts, int(target.config.vocab_size))
    results: list[list[int]] = [[] for _ in prompts]
    if not prompts or int(max_new_tokens) == 0:
        return results
    max_new = int(max_new_tokens)
    n_out = round_up(max_new, OUT_MULTIPLE)
    eos = [int(e) for e in eos_token_ids]
    eos_arr = eos_array(eos)
    sample = float(temperature) > 0.0
    if refill:
        t = prompt_bucket(max(len(p) for p in prompts))
        ids = np.zeros((len(prompts), t), np.int32)
        for r, p in enumerate(prompts):
            ids[r, : len(p)] = p
        out = _greedy_stream(target.params, jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32),
                             jnp.int32(max_new), jnp.asarray(eos_arr), target_cls=type(target), config=target.config,
                             cache_len=t + n_out, n_out=n_out, slots=min(int(batch_size), len(prompts)))
        out = np.asarray(jax.device_get(out))
        return [cut_at_eos(out[r, :max_new].tolist(), eos) for r in range(len(prompts))]
    # the batch is padded to a power of two (>= 8, <= batch_size): regeneration with turns="all" calls
    # this once per round with ever fewer prompts, and each distinct batch would compile anew
    b = min(int(batch_size), max(8, 1 << (len(prompts) - 1).bit_length()))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    root = jax.random.PRNGKey(int(seed))
    for batch_no, lo in enumerate(range(0, len(order), b)):
        idx = order[lo: lo + b]
        rows = [prompts[i] for i in idx]
        rows += [rows[0]] * (b - len(rows))  # pad the last batch: one compiled shape
        t = prompt_bucket(max(len(r) for r in rows))
        ids = np.zeros((b, t), np.int32)
        for r, p in enumerate(rows):
            ids[r, : len(p)] = p
        lens = np.array([len(p) for p in rows], np.int32)
        out = _generate_batch(
            target.params, jnp.asarray(ids), jnp.asarray(lens), jnp.int32(max_new),
            jax.random.fold_in(root, batch_no), jnp.float32(max(float(temperature), 1e-6)),
            jnp.float32(top_p), jnp.asarray(eos_arr),
            target_cls=type(target), config=target.config, cache_len=t + n_out, n_out=n_out, sample=sample,
        )
        out = np.asarray(jax.device_get(out))
        for r, i in enumerate(idx):
            results[i] = cut_at_eos(out[r, :max_new].tolist(), eos)
    return results

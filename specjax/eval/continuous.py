"""Continuous batching: a fixed set of cache rows, each refilled with the next prompt as soon as
its answer ends.

`generate.generate` runs a batch until its longest answer ends, so a batch of 512 prompts whose
answers mostly stop after a couple of hundred tokens keeps decoding every row until the one that
reaches `max_new_tokens`; and regeneration with `turns: all` has to wait for a whole round before
any conversation's next turn can start. Here every row of one KV cache holds one request; the
device runs segments of `segment_steps` one-token steps (one `lax.while_loop`), and between
segments the rows whose answers ended are handed back and refilled with waiting prompts (one
prefill per refill, scattered into those rows). Follow-up requests (a conversation's next turn)
join the queue as soon as the answer they need exists.

Requests carry a priority (smaller first): regeneration gives a conversation's later turns the
priority of its shard, so earlier shards finish, and are written, first.

Greedy answers equal `generate.generate`'s (tests/eval/test_continuous.py). Sampled tokens use a
key per (request `sample_id`, token index), so they do not depend on the batch size or on which
row or segment a request lands in.

Host work overlaps the device: the next segment is dispatched before the answers of the last one
are decoded and their follow-ups prepared.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.eval.batching import (OUT_MULTIPLE, cache_batch_axes, cache_slot_axes, check_sampling, cut_at_eos,
                                   eos_array, is_eos, prompt_bucket, round_up, scatter_rows)
from specjax.eval.generate import sample_token

__all__ = ["Request", "ContinuousGenerator"]


@dataclasses.dataclass(frozen=True)
class Request:
    key: Hashable  # handed back to on_done with the answer
    ids: tuple  # prompt token ids
    priority: tuple = ()  # smaller runs first (then arrival order)
    sample_id: int = 0  # with the token index, seeds this request's draws (temperature > 0)


def _row_keys(seed, sample_id_b, index_b):
    base = jax.random.PRNGKey(seed)
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(base, s), i))(sample_id_b, index_b)


def _sample_rows(logits_bv, keys_b, temperature, top_p, sample: bool):
    """[B] int32: argmax, or a nucleus draw per row with that row's key (generate.sample_token per row)."""
    if not sample:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    one = lambda lg, k: sample_token(lg[None], k, temperature, top_p, sample=True)[0]  # noqa: E731
    return jax.vmap(one)(logits_bv, keys_b)


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "sample", "axes_def", "num_slots"),
                   donate_argnums=(1,))
def _refill(params, cache, out, gen, lens, done, sid, rows_n, ids_nt, lens_n, sid_n, max_new, seed, temperature,
            top_p, eos_e, *, target_cls, config, sample, axes_def, num_slots):
    """Prefill the n new prompts into a fresh n-row cache of the prompt chunk's length (attention over
    t slots, not the whole row's), scatter it into rows `rows_n`, and draw each row's first token."""
    n, t = ids_nt.shape
    axes = jax.tree.unflatten(axes_def[0], [a for a, _ in axes_def[1]])
    slot_axes = jax.tree.unflatten(axes_def[0], [sx for _, sx in axes_def[1]])
    dtype = target_cls.decoder.embed_table(params, config).dtype
    small = target_cls.decoder.init_cache(config, n, min(t, num_slots), dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    logits, _, _, small = target_cls.decoder.decode_chunk(params, config, small, ids_nt, positions, jnp.zeros((n,), jnp.int32),
                                               logits_index=(lens_n - 1)[:, None])
    tok = _sample_rows(logits[:, 0], _row_keys(seed, sid_n, jnp.zeros_like(sid_n)), temperature, top_p, sample)
    cache = scatter_rows(cache, small, rows_n, axes, slot_axes)
    first = jnp.zeros((n, out.shape[1]), jnp.int32).at[:, 0].set(tok)
    out = out.at[rows_n].set(first, mode="drop")
    gen = gen.at[rows_n].set(1, mode="drop")
    lens = lens.at[rows_n].set(lens_n, mode="drop")
    done = done.at[rows_n].set(is_eos(tok, eos_e) | (max_new <= 1), mode="drop")
    sid = sid.at[rows_n].set(sid_n, mode="drop")
    return cache, out, gen, lens, done, sid


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "steps", "sample"), donate_argnums=(1,))
def _segment(params, cache, out, gen, lens, done, sid, max_new, seed, temperature, top_p, eos_e, *,
             target_cls, config, steps, sample):
    """Up to `steps` one-token steps of every live row (stops early when no row is live). A row that
    is done (or empty) still runs, at its last slot, and keeps nothing: one static shape."""
    b, n_out = out.shape
    rows = jnp.arange(b)

    def cond(state):
        i, _, _, _, done = state
        return (i < steps) & ~jnp.all(done)

    def body(state):
        i, cache, out, gen, done = state
        live = ~done
        prev = out[rows, jnp.maximum(gen - 1, 0)]
        pos = jnp.maximum(lens + gen - 1, 0)  # slot == position of the previous token
        logits, _, _, cache = target_cls.decoder.decode_chunk(params, config, cache, prev[:, None], pos[:, None], pos)
        tok = _sample_rows(logits[:, 0], _row_keys(seed, sid, gen), temperature, top_p, sample)
        out = out.at[rows, jnp.where(live, gen, n_out)].set(tok, mode="drop")
        gen = gen + live.astype(gen.dtype)
        done = done | (live & (is_eos(tok, eos_e) | (gen >= max_new)))
        return i + 1, cache, out, gen, done

    _, cache, out, gen, done = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, out, gen, done))
    return cache, out, gen, done


class ContinuousGenerator:
    """`batch_size` cache rows decoding requests as they come (see the module docstring).

    run(requests, on_done): `requests` is iterated lazily (pulled while fewer than two batches wait);
    `on_done(key, tokens)` gets each answer (cut before its first EOS, at most `max_new_tokens`) and
    returns follow-up requests (or None)."""

    def __init__(self, target, *, batch_size: int, max_prompt_tokens: int, max_new_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, eos_token_ids: Sequence[int] = (), seed: int = 0,
                 segment_steps: int = 16, min_refill: int | None = None):
        target.require_decoding()
        check_sampling(max_new_tokens, temperature, top_p)
        if batch_size < 1 or max_prompt_tokens < 1 or max_new_tokens < 1 or segment_steps < 1:
            raise ValueError(f"batch_size ({batch_size}), max_prompt_tokens ({max_prompt_tokens}), max_new_tokens "
                             f"({max_new_tokens}) and segment_steps ({segment_steps}) must be >= 1")
        self.target = target
        self.batch = int(batch_size)
        self.max_prompt = int(max_prompt_tokens)
        self.max_new = int(max_new_tokens)
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.sample = self.temperature > 0.0
        self.eos = [int(e) for e in eos_token_ids]
        self.seed = int(seed) % 2**31
        self.segment_steps = int(segment_steps)
        # a refill waits until this many rows are free (or nothing else will free them): fewer, larger
        # prefills and fewer distinct prefill shapes to compile
        self.min_refill = max(1, int(min_refill if min_refill is not None else self.batch // 8))
        self.n_out = round_up(self.max_new, OUT_MULTIPLE)
        self.num_slots = max(prompt_bucket(self.max_prompt), self.max_prompt + self.n_out)
        # refill chunk lengths: few of them, since each (rows, length) pair is one more compiled prefill
        # (powers of two would be 7 lengths up to 1024); padding a refill costs a little prefill work
        cap = prompt_bucket(self.max_prompt)
        self.refill_lengths = sorted({min(128, cap), min(512, cap), cap})
        self.eos_arr = jnp.asarray(eos_array(self.eos))
        # host_s: answers handed back and their follow-ups prepared (overlaps the running segment);
        # wait_s: blocked on a segment's end (and its answers' copy). wait_s near 0 means the host, not
        # the device, sets the pace.
        self.stats = {"segments": 0, "refills": 0, "answers": 0, "tokens": 0, "host_s": 0.0, "wait_s": 0.0}

    def _check(self, req: Request) -> None:
        if not req.ids:
            raise ValueError(f"request {req.key!r} has an empty prompt; every prompt needs at least one token")
        if len(req.ids) > self.max_prompt:
            raise ValueError(f"request {req.key!r} has {len(req.ids)} prompt tokens, more than max_prompt_tokens="
                             f"{self.max_prompt}; fit prompts before submitting them")
        vocab = int(self.target.config.vocab_size)
        ids = np.asarray(req.ids, np.int64)  # one check per request: regeneration sends tens of thousands
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise ValueError(f"request {req.key!r} has token id {int(bad[0])} outside the target vocab [0, {vocab})")

    def run(self, requests: Iterable[Request], on_done: Callable[[Hashable, list[int]], Iterable[Request] | None]):
        target, cls, cfg = self.target, type(self.target), self.target.config
        params = target.params
        dtype = target.embed_table(params).dtype
        b = self.batch
        axes = cache_batch_axes(cls, cfg, dtype)
        slot_axes = cache_slot_axes(cls, cfg, dtype)
        pairs = tuple(zip(jax.tree.leaves(axes), jax.tree.leaves(slot_axes)))
        if any(sx >= 0 and sx != ax + 1 for ax, sx in pairs):
            raise ValueError(f"{cls.__name__}: continuous batching needs each cache leaf's slot axis right after its "
                             f"batch axis; got (batch, slot) axes {pairs}")
        axes_def = (jax.tree.structure(axes), pairs)
        cache = cls.decoder.init_cache(cfg, b, self.num_slots, dtype)
        out = jnp.zeros((b, self.n_out), jnp.int32)
        gen = jnp.zeros((b,), jnp.int32)
        lens = jnp.zeros((b,), jnp.int32)
        done = jnp.ones((b,), bool)
        sid = jnp.zeros((b,), jnp.int32)
        scalars = dict(max_new=jnp.int32(self.max_new), seed=jnp.int32(self.seed),
                       temperature=jnp.float32(max(self.temperature, 1e-6)), top_p=jnp.float32(self.top_p))

        source: Iterator[Request] = iter(requests)
        exhausted = False
        heap: list = []
        order = itertools.count()
        busy: dict[int, Request] = {}  # row -> its request
        free = list(range(b))

        def push(reqs):
            for r in reqs or ():
                self._check(r)
                heapq.heappush(heap, (tuple(r.priority), next(order), r))

        def pull():
            nonlocal exhausted
            while not exhausted and len(heap) < 2 * b:
                nxt = next(source, None)
                if nxt is None:
                    exhausted = True
                else:
                    push([nxt])

        finished: list = []  # (out array, [(row's request, answer length)]) of the last segment
        while True:
            pull()
            # refill: when enough rows are free, or when nothing running would free more
            if heap and free and (len(free) >= min(self.min_refill, len(heap)) or not busy):
                take = [heapq.heappop(heap)[2] for _ in range(min(len(free), len(heap)))]
                rows = [free.pop(0) for _ in take]
                n = min(b, max(8, 1 << (len(take) - 1).bit_length()))
                longest = max(len(r.ids) for r in take)
                t = next(c for c in self.refill_lengths if c >= longest)
                ids = np.zeros((n, t), np.int32)
                lens_n = np.ones((n,), np.int32)
                sid_n = np.zeros((n,), np.int32)
                rows_n = np.full((n,), b, np.int32)  # padding rows point past the end: dropped
                for j, (row, r) in enumerate(zip(rows, take)):
                    ids[j, : len(r.ids)] = r.ids
                    lens_n[j], sid_n[j], rows_n[j] = len(r.ids), int(r.sample_id) % 2**31, row
                    busy[row] = r
                cache, out, gen, lens, done, sid = _refill(
                    params, cache, out, gen, lens, done, sid, jnp.asarray(rows_n), jnp.asarray(ids),
                    jnp.asarray(lens_n), jnp.asarray(sid_n), scalars["max_new"], scalars["seed"],
                    scalars["temperature"], scalars["top_p"], self.eos_arr,
                    target_cls=cls, config=cfg, sample=self.sample, axes_def=axes_def,
                    num_slots=self.num_slots)
                self.stats["refills"] += 1
            if busy:  # dispatch the next segment before the host decodes the last one's answers
                cache, out, gen, done = _segment(
                    params, cache, out, gen, lens, done, sid, scalars["max_new"], scalars["seed"],
                    scalars["temperature"], scalars["top_p"], self.eos_arr,
                    target_cls=cls, config=cfg, steps=self.segment_steps, sample=self.sample)
                self.stats["segments"] += 1
            t0 = time.perf_counter()
            self._hand_back(finished, on_done, push)
            self.stats["host_s"] += time.perf_counter() - t0
            finished = []
            if not busy:
                pull()
                if not heap and exhausted:
                    return
                continue
            t0 = time.perf_counter()
            # the answers come to the host here, with the flags, before the next segment is queued: a read
            # of `out` issued after that segment would wait for it (one device stream), and the host's
            # work on the answers would no longer overlap the device's
            done_np, gen_np, out_np = jax.device_get((done, gen, out))
            self.stats["wait_s"] += time.perf_counter() - t0
            ended = [row for row in busy if done_np[row]]
            if ended:
                finished = [(out_np, [(row, busy.pop(row), int(gen_np[row])) for row in ended])]
                free.extend(ended)
                free.sort()

    def _hand_back(self, finished, on_done, push):
        """Answers of the last segment to `on_done`, on host copies only: this runs while the next
        segment computes."""
        for out_np, rows in finished:
            for row, req, n in rows:
                toks = out_np[row]
                ans = cut_at_eos(toks[: min(n, self.max_new)].tolist(), self.eos)
                self.stats["answers"] += 1
                self.stats["tokens"] += len(ans)
                push(on_done(req.key, ans))

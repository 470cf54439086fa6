"""Speculative decoding as one device program: a whole generation inside one jitted `lax.while_loop`,
each step a `jax.vmap` over the batch's rows of one row's draft + verify step.

`SpecDecoder.generate` (spec_decode.py) drives each step from Python: one jitted draft call, one
jitted verification, and one device -> host read of the accepted count per step. At batch 1 on a
small target that host round trip costs more than the math (H200, SmolLM2-135M: 7.01 ms per
speculative step against 2.95 ms per greedy token, benchmarks/results/smollm2_eagle3.md). Here the
same step functions (`_draft_chain`, `_draft_parallel`, `_draft_block`, `_draft_tree`,
`_verify_chain`, `_verify_tree`) run inside the loop body, so nothing returns to the host until the
generation ends; the greedy side of a speedup is `generate._generate_batch`, the same kind of loop.

One row's program, in order:
  prefill -> the first token (its EOS or a length of 1 ends the row);
  the first draft + verify step, whose pending rows are the prompt's (shape [1, prompt bucket]);
  then `while not stopped and emitted < max_new_tokens`: draft + verify with K+1 pending rows.
The first step is traced apart from the loop because its pending rows have the prompt's shape.
Emission inside the loop follows SpecDecoder exactly: the accepted tokens and the bonus are emitted
in order; an EOS ends the row (counted in the step's accept length, not kept), so does reaching
max_new_tokens; accepted_per_position counts every accepted draft of a step, as vLLM does.
PRNG keys are fold_in(root, 0) for the first token, 2*step for the draft and 2*step+1 for the
verification, as in SpecDecoder, so a row draws the same samples as `SpecDecoder.generate` with
the same seed.

Batching: the prefill and the step are `jax.vmap`ped over rows (params shared); the `while_loop`
runs outside vmap until every row has stopped. A stopped row's tokens, counts and positions are held,
so each row gets its own acceptance and its own stop; its caches are not held (they are never read
again), which spares a select and a copy of every row's whole KV cache per iteration. The prompts
share one static prompt bucket and cache length (the longest row's).

Refill (`generate(..., refill=True)`, `_spec_stream`): every prompt in one program of `batch_size`
rows. After each step, the rows whose request stopped write its results to that request's output row
and take the next waiting prompt; its prefill and first step run for that row alone (an inner
`while_loop` fills every free row), with fresh caches and the request's own key. The loop runs while
any row holds a request.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.eval.generate import _OUT_MULTIPLE, _check_prompts, _round_up, check_sampling, eos_array, prompt_bucket
from specjax.eval.spec_decode import (SpecDecoder, SpecResult, _draft_block, _draft_chain, _draft_parallel, _draft_tree,
                                      _prefill, _verify_chain, _verify_tree, init_draft_cache)
from specjax.drafts import dflash
from specjax.targets.layers.attention import cache_size_for


@dataclasses.dataclass(frozen=True)
class _Static:
    """What one compiled program is specialised on (hashable: a jit static argument)."""

    target_cls: type
    config: object
    aux_ids: tuple
    dcfg: object
    k: int
    mode: str
    widths: tuple
    top_k: int
    block: bool
    parallel: bool
    sample: bool
    cache_len: int
    n_out: int


def _emit(new_k1, a, count, max_new, eos_e):
    """SpecDecoder's emission rule for one step, vectorised. new_k1 [K+1]: the accepted tokens then
    the bonus at index a. Returns (kept tokens, tokens processed incl. a stopping EOS, stopped)."""
    i = jnp.arange(new_k1.shape[0], dtype=jnp.int32)
    big = jnp.int32(new_k1.shape[0] + 1)
    is_eos = jnp.any(new_k1[:, None] == eos_e[None, :], axis=-1) & (i <= a)
    i_eos = jnp.where(jnp.any(is_eos), jnp.argmax(is_eos).astype(jnp.int32), big)
    i_len = max_new - count - 1  # the token that reaches max_new_tokens
    s = jnp.minimum(jnp.minimum(i_eos, i_len), a)
    stop = (i_eos <= a) | (i_len <= a)
    kept = jnp.where(i_eos == s, s, s + 1)
    return kept, s + 1, stop


def _row_start(params, dp, embed, d2t, draft_ids, ids_p, length, root, temperature, eos_e, max_new, *, st: _Static):
    """One prompt's prefill and the state before its first draft + verify step (vmapped over rows)."""
    tkw = dict(target_cls=st.target_cls, config=st.config)
    k = st.k
    ids = ids_p[None]
    tcache = st.target_cls.init_cache_fn(st.config, 1, st.cache_len, embed.dtype)
    first, aux, tcache = _prefill(params, tcache, ids, length, jax.random.fold_in(root, 0), temperature,
                                  aux_ids=st.aux_ids, sample=st.sample, **tkw)
    p = ids.shape[1]
    col = jnp.arange(p, dtype=jnp.int32)[None]
    pend_tok = jnp.where(col < length - 1, jnp.roll(ids, -1, axis=1), 0)
    pend_tok = jnp.where(col == length - 1, first, pend_tok)
    dcache = (dflash.init_context_cache(st.dcfg, 1, cache_size_for(st.cache_len)) if st.block
              else init_draft_cache(st.dcfg, st.cache_len))
    first_eos = jnp.any(first == eos_e)
    out = jnp.zeros((st.n_out + k + 1,), jnp.int32).at[0].set(jnp.where(first_eos, 0, first))
    state = dict(tcache=tcache, dcache=dcache, last=first, n=length + 1, dstart=jnp.int32(0),
                 pend_count=length.astype(jnp.int32), step=jnp.int32(0), count=jnp.where(first_eos, 0, 1).astype(jnp.int32),
                 stop=first_eos, out=out, acc_len=jnp.zeros((st.n_out + 1,), jnp.int32),
                 acc_pos=jnp.zeros((k,), jnp.int32))
    return state, pend_tok, aux


def _row_step(params, dp, embed, d2t, draft_ids, root, temperature, eos_e, max_new, s, pend_tok, pend_aux, *,
              st: _Static):
    """One draft + verify step of one row (vmapped over rows)."""
    tkw = dict(target_cls=st.target_cls, config=st.config)
    k = st.k
    stepno = s["step"] + 1
    kd, kv = jax.random.fold_in(root, 2 * stepno), jax.random.fold_in(root, 2 * stepno + 1)
    if st.block:
        drafts, q, dcache = _draft_block(dp, embed, d2t, s["dcache"], pend_aux, s["pend_count"], s["dstart"],
                                         s["last"], kd, temperature, dcfg=st.dcfg, k=k, sample=st.sample)
    elif st.mode == "chain":
        propose = _draft_parallel if st.parallel else _draft_chain
        drafts, q, dcache = propose(dp, embed, d2t, s["dcache"], pend_tok, pend_aux, s["pend_count"], s["dstart"],
                                    kd, temperature, dcfg=st.dcfg, k=k, sample=st.sample)
    else:
        nodes, parents, dcache = _draft_tree(dp, embed, d2t, s["dcache"], pend_tok, pend_aux, s["pend_count"],
                                             s["dstart"], dcfg=st.dcfg, widths=st.widths, top_k=st.top_k)
    if st.mode == "chain":
        a, _, pend_dev, aux, tcache = _verify_chain(params, s["tcache"], s["last"], drafts, s["n"] - 1, q, draft_ids,
                                                    kv, temperature, aux_ids=st.aux_ids, sample=st.sample, **tkw)
    else:
        a, _, pend_dev, aux, tcache = _verify_tree(params, s["tcache"], s["last"], nodes, parents, s["n"] - 1,
                                                   aux_ids=st.aux_ids, depth=k, **tkw)
    new = pend_dev[0]
    kept, processed, stop = _emit(new, a, s["count"], max_new, eos_e)
    i = jnp.arange(k + 1, dtype=jnp.int32)
    out = s["out"].at[jnp.where(i < kept, s["count"] + i, st.n_out + k + 1)].set(new, mode="drop")
    acc_len = s["acc_len"].at[s["step"]].set(processed, mode="drop")
    acc_pos = s["acc_pos"] + (jnp.arange(k) < a).astype(jnp.int32)
    nxt = dict(tcache=tcache, dcache=dcache, last=new[a], n=s["n"] + a + 1, dstart=s["n"] - 1,
               pend_count=(a + 1).astype(jnp.int32), step=stepno, count=s["count"] + kept, stop=stop, out=out,
               acc_len=acc_len, acc_pos=acc_pos)
    return nxt, pend_dev, aux


def _active(s, max_new):
    return ~s["stop"] & (s["count"] < max_new)


# A stopped row's caches are never read again, so they take the step's writes instead of being held:
# holding them would select (and copy) every row's whole KV cache on every iteration.
_NOT_HELD = ("tcache", "dcache")


def _hold_stopped(go, nxt, old):
    """The batch's state after a step: rows with go[b] False keep their old state (all but caches)."""
    def pick(new, prev):
        return jnp.where(go.reshape(go.shape + (1,) * (new.ndim - 1)), new, prev)
    return {key: nxt[key] if key in _NOT_HELD else jax.tree.map(pick, nxt[key], old[key]) for key in nxt}


@functools.partial(jax.jit, static_argnames=("st",))
def _spec_batch(params, dp, embed, d2t, draft_ids, ids_bp, lens_b, roots_b, temperature, eos_e, max_new, *, st):
    shared = (params, dp, embed, d2t, draft_ids)
    start = jax.vmap(functools.partial(_row_start, st=st), in_axes=(None,) * 5 + (0, 0, 0) + (None,) * 3)
    row_step = jax.vmap(functools.partial(_row_step, st=st), in_axes=(None,) * 5 + (0,) + (None,) * 3 + (0, 0, 0))

    def advance(c):
        s, pend_tok, pend_aux = c
        nxt, pend_tok, pend_aux = row_step(*shared, roots_b, temperature, eos_e, max_new, s, pend_tok, pend_aux)
        return _hold_stopped(_active(s, max_new), nxt, s), pend_tok, pend_aux

    # the loop runs while any row is active, outside vmap, so its predicate is one scalar; the first
    # step reads the prompt-shaped pending rows and is traced apart from the loop
    carry = advance(start(*shared, ids_bp, lens_b, roots_b, temperature, eos_e, max_new))
    state, _, _ = jax.lax.while_loop(lambda c: jnp.any(_active(c[0], max_new)), advance, carry)
    return state["out"][:, : st.n_out], state["count"], state["acc_len"][:, : st.n_out], state["step"], state["acc_pos"]


def _put_row(tree, i, row):
    return jax.tree.map(lambda a, r: a.at[i].set(r), tree, row)


@functools.partial(jax.jit, static_argnames=("st", "slots"))
def _spec_stream(params, dp, embed, d2t, draft_ids, ids_np, lens_n, roots_n, temperature, eos_e, max_new, *, st,
                 slots):
    """All N prompts through `slots` rows in one device program: a row whose request has stopped hands
    its results to the request's output row and takes the next waiting prompt (its prefill and first
    step run for that row alone, inside the loop), so no row idles while prompts wait. Each request's
    steps are `_spec_batch`'s, with its own caches and key: the results equal SpecDecoder's."""
    shared = (params, dp, embed, d2t, draft_ids)
    n = ids_np.shape[0]
    start_one = functools.partial(_row_start, st=st)
    step_one = functools.partial(_row_step, st=st)
    row_step = jax.vmap(step_one, in_axes=(None,) * 5 + (0,) + (None,) * 3 + (0, 0, 0))

    def first_step(q):
        """Request q's prefill and first draft + verify step (one row)."""
        s0, tok0, aux0 = start_one(*shared, ids_np[q], lens_n[q], roots_n[q], temperature, eos_e, max_new)
        nxt = step_one(*shared, roots_n[q], temperature, eos_e, max_new, s0, tok0, aux0)
        return _hold_stopped(_active(s0, max_new), nxt[0], s0), nxt[1], nxt[2]

    # the slots start on the first `slots` requests, as a batch
    first = jax.vmap(first_step)(jnp.arange(slots, dtype=jnp.int32))
    outs = dict(out=jnp.zeros((n, st.n_out), jnp.int32), count=jnp.zeros((n,), jnp.int32),
                acc_len=jnp.zeros((n, st.n_out), jnp.int32), step=jnp.zeros((n,), jnp.int32),
                acc_pos=jnp.zeros((n, st.k), jnp.int32))

    def hand_back_and_refill(c):
        (s, pend_tok, pend_aux), req, roots, nxt_req, outs = c
        done = ~_active(s, max_new) & (req >= 0)
        at = jnp.where(done, req, n)  # n: out of range, dropped
        outs = dict(out=outs["out"].at[at].set(s["out"][:, : st.n_out], mode="drop"),
                    count=outs["count"].at[at].set(s["count"], mode="drop"),
                    acc_len=outs["acc_len"].at[at].set(s["acc_len"][:, : st.n_out], mode="drop"),
                    step=outs["step"].at[at].set(s["step"], mode="drop"),
                    acc_pos=outs["acc_pos"].at[at].set(s["acc_pos"], mode="drop"))
        req = jnp.where(done, -1, req)

        def refill(rc):
            row, req, roots, q = rc
            r = jnp.argmax(req < 0)
            row = _put_row(row, r, first_step(q))
            return row, req.at[r].set(q), roots.at[r].set(roots_n[q]), q + 1

        row, req, roots, nxt_req = jax.lax.while_loop(lambda rc: jnp.any(rc[1] < 0) & (rc[3] < n), refill,
                                                      ((s, pend_tok, pend_aux), req, roots, nxt_req))
        return row, req, roots, nxt_req, outs

    def advance(c):
        (s, pend_tok, pend_aux), req, roots, nxt_req, outs = c
        nxt, pend_tok, pend_aux = row_step(*shared, roots, temperature, eos_e, max_new, s, pend_tok, pend_aux)
        return hand_back_and_refill(((_hold_stopped(_active(s, max_new), nxt, s), pend_tok, pend_aux),
                                     req, roots, nxt_req, outs))

    carry = hand_back_and_refill((first, jnp.arange(slots, dtype=jnp.int32), roots_n[:slots], jnp.int32(slots), outs))
    # while any row holds a request: running, or stopped and not yet handed back (a request can stop
    # in its first step, right after its refill)
    carry = jax.lax.while_loop(lambda c: jnp.any(c[1] >= 0), advance, carry)
    outs = carry[-1]
    return outs["out"], outs["count"], outs["acc_len"], outs["step"], outs["acc_pos"]


class SpecLoop:
    """Batched speculative generation with a SpecDecoder's target, head and settings, each batch one
    device program (see the module docstring). Results are SpecDecoder's: a row's tokens, accept
    lengths and per-position counts equal `SpecDecoder.generate`'s for the same prompt and seed up to
    floating-point reassociation in batched matmuls (exact in the tests: CPU, fp32)."""

    def __init__(self, decoder: SpecDecoder):
        self.dec = decoder

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 eos_token_ids: Sequence[int] = (), seed: int = 0, batch_size: int | None = None,
                 refill: bool = False) -> list[SpecResult]:
        """One SpecResult per prompt, in order. Row r of the whole call uses seed `seed + r`. Rows are
        run `batch_size` at a time (default: all); every result's wall_s is its batch's wall time,
        so a batch's tokens / wall_s is the batch throughput.

        refill: all prompts in one device program of `batch_size` rows, each row taking the next prompt
        as soon as its request stops (a static batch waits for its slowest row: 19% of the row-steps of
        decode_speed.md's run 4 at batch 8). Same results; every wall_s is the whole call's."""
        dec = self.dec
        check_sampling(max_new_tokens, temperature, 1.0)
        sample = float(temperature) > 0.0
        if sample and dec.mode == "tree":
            raise ValueError("tree mode verifies greedily; use mode='chain' for temperature > 0")
        prompts = _check_prompts(prompts, int(dec.target.config.vocab_size))
        results: list[SpecResult] = []
        if not prompts:
            return results
        max_new = int(max_new_tokens)
        if max_new == 0:
            return [SpecResult([], [], [0] * dec.k, 0, 0.0, 0.0, 0.0) for _ in prompts]
        eos = [int(e) for e in eos_token_ids]
        eos_arr = eos_array(eos)
        n_out = _round_up(max_new, _OUT_MULTIPLE)
        b = len(prompts) if batch_size is None else max(1, min(int(batch_size), len(prompts)))
        if refill:
            return self._stream(prompts, b, max_new, float(temperature), eos_arr, seed, n_out, sample)
        for lo in range(0, len(prompts), b):
            rows = prompts[lo: lo + b]
            seeds = list(range(seed + lo, seed + lo + len(rows)))
            pad = b - len(rows)  # one compiled shape per batch size: pad with the first row
            rows_p, seeds_p = rows + [rows[0]] * pad, seeds + [seeds[0]] * pad
            bucket = prompt_bucket(max(len(r) for r in rows_p))
            ids = np.zeros((b, bucket), np.int32)
            for r, pr in enumerate(rows_p):
                ids[r, : len(pr)] = pr
            st = self._static(bucket, n_out, sample)
            roots = jnp.stack([jax.random.PRNGKey(s) for s in seeds_p])
            t0 = time.perf_counter()
            with dec._precision():
                got = _spec_batch(dec.target.params, dec.draft_params, dec.embed, dec.d2t, dec.draft_ids,
                                  jnp.asarray(ids), jnp.asarray([len(r) for r in rows_p], jnp.int32), roots,
                                  jnp.float32(max(float(temperature), 1e-6)), jnp.asarray(eos_arr), jnp.int32(max_new),
                                  st=st)
                out, count, acc_len, steps, acc_pos = (np.asarray(x) for x in jax.device_get(got))
            wall = time.perf_counter() - t0
            for r in range(len(rows)):
                n = int(steps[r])
                results.append(SpecResult(out[r, : int(count[r])].tolist(), acc_len[r, :n].tolist(),
                                          acc_pos[r].tolist(), n, 0.0, 0.0, wall))
        return results

    def _static(self, bucket: int, n_out: int, sample: bool) -> _Static:
        dec = self.dec
        # as SpecDecoder._setup: > bucket, and room for the last verification chunk
        cache_len = max(bucket + 1, bucket + n_out + dec.verify_len + 2)
        return _Static(type(dec.target), dec.target.config, dec.aux_ids, dec.draft.config, dec.k, dec.mode,
                       dec.widths, dec.top_k, dec.block_drafter, bool(getattr(dec.draft.config, "parallel_drafting", False)),
                       sample, cache_len, n_out)

    def _stream(self, prompts, slots, max_new, temperature, eos_arr, seed, n_out, sample) -> list[SpecResult]:
        dec = self.dec
        bucket = prompt_bucket(max(len(r) for r in prompts))
        ids = np.zeros((len(prompts), bucket), np.int32)
        for r, pr in enumerate(prompts):
            ids[r, : len(pr)] = pr
        roots = jnp.stack([jax.random.PRNGKey(seed + r) for r in range(len(prompts))])
        t0 = time.perf_counter()
        with dec._precision():
            got = _spec_stream(dec.target.params, dec.draft_params, dec.embed, dec.d2t, dec.draft_ids, jnp.asarray(ids),
                               jnp.asarray([len(r) for r in prompts], jnp.int32), roots,
                               jnp.float32(max(temperature, 1e-6)), jnp.asarray(eos_arr), jnp.int32(max_new),
                               st=self._static(bucket, n_out, sample), slots=slots)
            out, count, acc_len, steps, acc_pos = (np.asarray(x) for x in jax.device_get(got))
        wall = time.perf_counter() - t0
        return [SpecResult(out[r, : int(count[r])].tolist(), acc_len[r, : int(steps[r])].tolist(), acc_pos[r].tolist(),
                           int(steps[r]), 0.0, 0.0, wall) for r in range(len(prompts))]


class DeviceLoopDecoder:
    """`SpecDecoder`'s per-prompt interface (`generate`, `greedy`) on the device loops, so the measuring
    code (`measure.run_prompt`, `specjax.eval --device-loop`) runs every turn as one device program
    per side: SpecLoop for the speculative side, `generate.generate` for greedy. Outputs equal
    SpecDecoder's (same step functions and keys); only the timings change (no host round trip per
    step). `draft_time_s` / `target_time_s` are 0: one program has no split between them."""

    def __init__(self, decoder: SpecDecoder):
        self.dec = decoder
        self.loop = SpecLoop(decoder)

    @property
    def matmul_precision(self):
        return self.dec.matmul_precision

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                 eos_token_ids=(), seed: int = 0) -> SpecResult:
        return self.loop.generate([list(prompt_ids)], max_new_tokens=max_new_tokens, temperature=temperature,
                                  eos_token_ids=eos_token_ids, seed=seed, batch_size=1)[0]

    def greedy(self, prompt_ids: Sequence[int], *, max_new_tokens: int, eos_token_ids=()) -> SpecResult:
        return self.greedy_many([prompt_ids], max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)[0]

    def generate_many(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_ids=()
                      ) -> list[SpecResult]:
        """Greedy speculative decoding of several prompts as one batched device program (rows are
        independent: each equals `generate` of that prompt alone). Every result's wall_s is the batch's
        wall time divided by the number of rows (an equal share, so per-prompt sums add up to the wall)."""
        res = self.loop.generate([list(p) for p in prompts], max_new_tokens=max_new_tokens,
                                 eos_token_ids=eos_token_ids, batch_size=len(prompts))
        return [dataclasses.replace(r, wall_s=r.wall_s / len(prompts)) for r in res]

    def greedy_many(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_token_ids=()
                    ) -> list[SpecResult]:
        """Plain greedy decoding of several prompts as one batched program (wall_s shared as above)."""
        from specjax.eval.generate import generate

        t0 = time.perf_counter()
        with self.dec._precision():
            outs = generate(self.dec.target, [list(p) for p in prompts], max_new_tokens=max_new_tokens,
                            eos_token_ids=eos_token_ids, batch_size=len(prompts))
        wall = (time.perf_counter() - t0) / len(prompts)
        results = []
        for toks in outs:
            # target calls after the prefill, as SpecDecoder.greedy counts them: none after a length stop
            steps = len(toks) - 1 if len(toks) == int(max_new_tokens) else len(toks)
            results.append(SpecResult(toks, [1] * max(steps, 0), [0] * self.dec.k, max(steps, 0), 0.0, wall, wall))
        return results

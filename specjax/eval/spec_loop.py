"""Speculative decoding as one device program: a whole generation inside one jitted `lax.while_loop`;
each step drafts per row (`jax.vmap`), verifies every row's chunk in one batched target call, and
accepts and emits per row.

`SpecDecoder.generate` (spec_decode.py) drives each step from Python: one jitted draft call, one
jitted verification, and one device -> host read of the accepted count per step. At batch 1 on a
small target that host round trip costs more than the math (H200, SmolLM2-135M: 7.01 ms per
speculative step against 2.95 ms per greedy token, benchmarks/results/smollm2_eagle3.md). Here the
same pieces (the draft family's `propose_chain` / `propose_tree`: drafts.eagle3_decoding, drafts.dflash_decoding;
the verification's `chain_chunk` / `accept_chain` and `tree_chunk` / `accept_tree` of verify.py around
the target's `decoder.decode_chunk`) run inside the loop body, so nothing returns to the host until the generation ends;
the greedy side of a speedup is `generate._generate_batch`, the same kind of loop.

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

Batching: the drafters, acceptance and emission are written for one row and `jax.vmap`ped over rows
(their caches and states are small); the target is not. The prefill and every verification are one
`decoder.decode_chunk` call over all rows, with the target cache in the target's own batched layout: each row's
chunk goes to its own slots, as in a batched greedy step. (Vmapping the target call per row, as this
loop first did, also copied each layer's whole cache for all rows in the compiled program:
decode_speed.md, "Changed since run 6".) The `while_loop` runs until every row has
stopped, on one scalar predicate. A stopped row's tokens, counts and positions are held, so each
row gets its own acceptance and its own stop; its caches are not held (they are never read again),
which spares a select and a copy of every row's whole cache per iteration. The prompts share one
static prompt bucket and cache length (the longest row's).

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
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.eval.batching import (OUT_MULTIPLE, cache_batch_axes, check_prompts, check_sampling, eos_array,
                                   prompt_bucket, round_up, scatter_rows)
from specjax.eval.spec_decode import SpecDecoder, SpecResult
from specjax.eval.verify import accept_chain, accept_tree, chain_chunk, drafter_states, prefill, tree_chunk


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
    tree_total: Optional[int]  # EAGLE-2's re-ranking: the best nodes kept of the expanded tree (None: all)
    family: object  # the draft family (specjax.drafts.family): its proposers and draft cache
    sample: bool
    cache_len: int
    n_out: int
    draft_dtype: str = "float32"
    with_final: bool = False  # the drafter reads the target's final hidden after the taps


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


def _row_init(ids_p, length, first, eos_e, *, st: _Static):
    """One row's state before its first draft + verify step, after the prefill drew `first` (vmapped
    over rows). The pending rows are the prompt's: tokens x_1..x_P (x_P = first)."""
    k = st.k
    ids = ids_p[None]
    col = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    pend_tok = jnp.where(col < length - 1, jnp.roll(ids, -1, axis=1), 0)
    pend_tok = jnp.where(col == length - 1, first, pend_tok)
    dcache = st.family.init_decode_cache(st.dcfg, st.cache_len, jnp.dtype(st.draft_dtype))
    first_eos = jnp.any(first == eos_e)
    out = jnp.zeros((st.n_out + k + 1,), jnp.int32).at[0].set(jnp.where(first_eos, 0, first))
    state = dict(dcache=dcache, last=first, n=length + 1, dstart=jnp.int32(0), pend_count=length.astype(jnp.int32),
                 step=jnp.int32(0), count=jnp.where(first_eos, 0, 1).astype(jnp.int32), stop=first_eos, out=out,
                 acc_len=jnp.zeros((st.n_out + 1,), jnp.int32), acc_pos=jnp.zeros((k,), jnp.int32))
    return state, pend_tok


def _per_row(aux):
    """The target's aux states [B, T, D] as the rows' pending aux ([B] x [1, T, D], the shape the
    vmapped drafters read)."""
    return tuple(x[:, None] for x in aux)


def _start(params, embed, ids_bp, lens_b, roots_b, temperature, eos_e, *, st: _Static):
    """The batch's prefill (one target call over every row's padded prompt) and each row's first token
    and state. Returns the loop's carry: (row states, target cache, pending tokens, pending aux)."""
    tcache = st.target_cls.decoder.init_cache(st.config, ids_bp.shape[0], st.cache_len, embed.dtype)
    keys = jax.vmap(lambda r: jax.random.fold_in(r, 0))(roots_b)
    first, aux, tcache = prefill(params, tcache, ids_bp, lens_b, keys, temperature, target_cls=st.target_cls,
                                  config=st.config, aux_ids=st.aux_ids, sample=st.sample,
                                  with_final=st.with_final)
    state, pend_tok = jax.vmap(functools.partial(_row_init, st=st), in_axes=(0, 0, 0, None))(ids_bp, lens_b, first,
                                                                                              eos_e)
    return state, tcache, pend_tok, _per_row(aux)


def _row_draft(dp, embed, d2t, root, temperature, s, pend_tok, pend_aux, *, st: _Static):
    """One row's proposal for its next step (vmapped over rows): ((drafts [K], q) for a chain, (nodes,
    parents) for a tree) and the row's new draft cache."""
    kd = jax.random.fold_in(root, 2 * (s["step"] + 1))
    if st.mode == "chain":
        drafts, q, dcache = st.family.propose_chain(dp, embed, d2t, s["dcache"], pend_tok, pend_aux, s["pend_count"],
                                                    s["dstart"], s["last"], kd, temperature, dcfg=st.dcfg, k=st.k,
                                                    sample=st.sample)
    else:
        nodes, parents, dcache = st.family.propose_tree(dp, embed, d2t, s["dcache"], pend_tok, pend_aux,
                                                        s["pend_count"], s["dstart"], dcfg=st.dcfg, widths=st.widths,
                                                        top_k=st.top_k, total=st.tree_total)
        return (nodes, parents), dcache
    return (drafts, q), dcache


def _commit_rows(st: _Static, tcache, start_b, path_b, a_b):
    """Tree verification's commit for every row: the target's commit_path_fn (written for one row,
    batch row 0) run per row along each cache leaf's own batch axis."""
    axes = cache_batch_axes(st.target_cls, st.config, jnp.float32)

    def one(cache, start, path, a):
        cache = jax.tree.map(jnp.expand_dims, cache, axes)
        cache = st.target_cls.commit_path_fn(cache, start, path, a)
        return jax.tree.map(jnp.squeeze, cache, axes)

    return jax.vmap(one, in_axes=(axes, 0, 0, 0), out_axes=axes)(tcache, start_b, path_b, a_b)


def _row_emit(s, dcache, a, pend, max_new, eos_e, *, st: _Static):
    """One row's state after its step accepted `a` drafts (vmapped over rows); `pend` [1, K+1] holds the
    accepted tokens then the bonus."""
    k = st.k
    new = pend[0]
    kept, processed, stop = _emit(new, a, s["count"], max_new, eos_e)
    i = jnp.arange(k + 1, dtype=jnp.int32)
    out = s["out"].at[jnp.where(i < kept, s["count"] + i, st.n_out + k + 1)].set(new, mode="drop")
    acc_len = s["acc_len"].at[s["step"]].set(processed, mode="drop")
    acc_pos = s["acc_pos"] + (jnp.arange(k) < a).astype(jnp.int32)
    return dict(dcache=dcache, last=new[a], n=s["n"] + a + 1, dstart=s["n"] - 1, pend_count=(a + 1).astype(jnp.int32),
                step=s["step"] + 1, count=s["count"] + kept, stop=stop, out=out, acc_len=acc_len, acc_pos=acc_pos)


def _step(shared, roots_b, temperature, eos_e, max_new, carry, *, st: _Static):
    """One draft + verify step of every row: the drafts per row (vmapped), ONE target call that
    verifies every row's chunk (the cache stays in the target's own batched layout, so its writes are
    the same per-row slot writes as a batched greedy step's), then acceptance and emission per row."""
    params, dp, embed, d2t, draft_ids = shared
    s, tcache, pend_tok, pend_aux = carry
    proposal, dcache = jax.vmap(functools.partial(_row_draft, st=st), in_axes=(None, None, None, 0, None, 0, 0, 0))(
        dp, embed, d2t, roots_b, temperature, s, pend_tok, pend_aux)
    start = s["n"] - 1
    kv = jax.vmap(lambda r, i: jax.random.fold_in(r, 2 * i + 1))(roots_b, s["step"] + 1)
    decode = functools.partial(st.target_cls.decoder.decode_chunk, params, st.config, aux_layer_ids=st.aux_ids)
    if st.mode == "chain":
        drafts, q = proposal
        chunk, pos = jax.vmap(chain_chunk)(s["last"], drafts, start)
        logits, aux, final, tcache = decode(tcache, chunk, pos, start)
        aux = drafter_states(aux, final, st.with_final)
        a, _, pend = jax.vmap(functools.partial(accept_chain, sample=st.sample), in_axes=(0, 0, 0, None, 0, None))(
            logits, drafts, q, draft_ids, kv, temperature)
    else:
        nodes, parents = proposal
        toks, parent, pos, mask = jax.vmap(functools.partial(tree_chunk, depth=st.k))(s["last"], nodes, parents, start)
        logits, aux, final, tcache = decode(tcache, toks, pos, start, chunk_mask_btt=mask)
        aux = drafter_states(aux, final, st.with_final)
        a, _, path, pend = jax.vmap(functools.partial(accept_tree, depth=st.k))(logits, toks, parent)
        tcache = _commit_rows(st, tcache, start, path, a)
        aux = tuple(jnp.take_along_axis(x, path[:, :, None], axis=1) for x in aux)
    nxt = jax.vmap(functools.partial(_row_emit, st=st), in_axes=(0, 0, 0, 0, None, None))(s, dcache, a, pend, max_new,
                                                                                        eos_e)
    return nxt, tcache, pend, _per_row(aux)


def _active(s, max_new):
    return ~s["stop"] & (s["count"] < max_new)


def _hold_stopped(go, nxt, old):
    """The batch's state after a step: rows with go[b] False keep their old state, all but their draft
    cache. A stopped row's caches are never read again, so they take the step's writes instead of being
    held: holding them would select (and copy) every row's whole cache on every iteration. (The target
    cache is carried apart from the row states and is never held.)"""
    def pick(new, prev):
        return jnp.where(go.reshape(go.shape + (1,) * (new.ndim - 1)), new, prev)
    return {key: nxt[key] if key == "dcache" else jax.tree.map(pick, nxt[key], old[key]) for key in nxt}


def _advance(shared, roots_b, temperature, eos_e, max_new, carry, *, st: _Static):
    """A step of every row, with stopped rows' states held."""
    nxt, tcache, pend_tok, pend_aux = _step(shared, roots_b, temperature, eos_e, max_new, carry, st=st)
    return _hold_stopped(_active(carry[0], max_new), nxt, carry[0]), tcache, pend_tok, pend_aux


@functools.partial(jax.jit, static_argnames=("st",))
def _spec_batch(params, dp, embed, d2t, draft_ids, ids_bp, lens_b, roots_b, temperature, eos_e, max_new, *, st):
    shared = (params, dp, embed, d2t, draft_ids)
    advance = functools.partial(_advance, shared, roots_b, temperature, eos_e, max_new, st=st)
    # the loop's predicate is one scalar (any row active); the first step reads the prompt-shaped
    # pending rows and is traced apart from the loop
    carry = advance(_start(params, embed, ids_bp, lens_b, roots_b, temperature, eos_e, st=st))
    state = jax.lax.while_loop(lambda c: jnp.any(_active(c[0], max_new)), advance, carry)[0]
    return state["out"][:, : st.n_out], state["count"], state["acc_len"][:, : st.n_out], state["step"], state["acc_pos"]


def _put_row(rows, r, one, cache_axes):
    """Row r of the batch's carry replaced by the one-row carry `one` (row states and pending rows on
    axis 0, the target cache along each leaf's batch axis, every slot)."""
    s, tcache, pend_tok, pend_aux = rows
    s1, tcache1, pend_tok1, pend_aux1 = one
    put = lambda a, x: a.at[r].set(x[0])  # noqa: E731
    whole_rows = jax.tree.map(lambda _: -1, cache_axes)
    tcache = scatter_rows(tcache, tcache1, jnp.reshape(r, (1,)), cache_axes, whole_rows)
    return (jax.tree.map(put, s, s1), tcache, put(pend_tok, pend_tok1), jax.tree.map(put, pend_aux, pend_aux1))


@functools.partial(jax.jit, static_argnames=("st", "slots"))
def _spec_stream(params, dp, embed, d2t, draft_ids, ids_np, lens_n, roots_n, temperature, eos_e, max_new, *, st,
                 slots):
    """All N prompts through `slots` rows in one device program: a row whose request has stopped hands
    its results to the request's output row and takes the next waiting prompt (its prefill and first
    step run for that row alone, inside the loop), so no row idles while prompts wait. Each request's
    steps are `_spec_batch`'s, with its own caches and key: the results equal SpecDecoder's."""
    shared = (params, dp, embed, d2t, draft_ids)
    n = ids_np.shape[0]
    cache_axes = cache_batch_axes(st.target_cls, st.config, jnp.float32)

    def first_steps(ids, lens, roots):
        """Prefill and first draft + verify step of requests (a batch of rows)."""
        carry = _start(params, embed, ids, lens, roots, temperature, eos_e, st=st)
        return _advance(shared, roots, temperature, eos_e, max_new, carry, st=st)

    # the slots start on the first `slots` requests, as a batch
    first = first_steps(ids_np[:slots], lens_n[:slots], roots_n[:slots])
    outs = dict(out=jnp.zeros((n, st.n_out), jnp.int32), count=jnp.zeros((n,), jnp.int32),
                acc_len=jnp.zeros((n, st.n_out), jnp.int32), step=jnp.zeros((n,), jnp.int32),
                acc_pos=jnp.zeros((n, st.k), jnp.int32))

    def hand_back_and_refill(c):
        rows, req, roots, nxt_req, outs = c
        s = rows[0]
        done = ~_active(s, max_new) & (req >= 0)
        at = jnp.where(done, req, n)  # n: out of range, dropped
        outs = dict(out=outs["out"].at[at].set(s["out"][:, : st.n_out], mode="drop"),
                    count=outs["count"].at[at].set(s["count"], mode="drop"),
                    acc_len=outs["acc_len"].at[at].set(s["acc_len"][:, : st.n_out], mode="drop"),
                    step=outs["step"].at[at].set(s["step"], mode="drop"),
                    acc_pos=outs["acc_pos"].at[at].set(s["acc_pos"], mode="drop"))
        req = jnp.where(done, -1, req)

        def refill(rc):
            rows, req, roots, q = rc
            r = jnp.argmax(req < 0)
            one = first_steps(ids_np[q][None], lens_n[q][None], roots_n[q][None])
            return _put_row(rows, r, one, cache_axes), req.at[r].set(q), roots.at[r].set(roots_n[q]), q + 1

        rows, req, roots, nxt_req = jax.lax.while_loop(lambda rc: jnp.any(rc[1] < 0) & (rc[3] < n), refill,
                                                       (rows, req, roots, nxt_req))
        return rows, req, roots, nxt_req, outs

    def advance(c):
        rows, req, roots, nxt_req, outs = c
        rows = _advance(shared, roots, temperature, eos_e, max_new, rows, st=st)
        return hand_back_and_refill((rows, req, roots, nxt_req, outs))

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
        prompts = check_prompts(prompts, int(dec.target.config.vocab_size))
        results: list[SpecResult] = []
        if not prompts:
            return results
        max_new = int(max_new_tokens)
        if max_new == 0:
            return [SpecResult([], [], [0] * dec.k, 0, 0.0, 0.0, 0.0) for _ in prompts]
        eos = [int(e) for e in eos_token_ids]
        eos_arr = eos_array(eos)
        n_out = round_up(max_new, OUT_MULTIPLE)
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
            with dec.matmul_precision_context():
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
                       dec.widths, dec.top_k, dec.tree_total, dec.family, sample, cache_len, n_out, dec.draft_dtype, dec.with_final)

    def _stream(self, prompts, slots, max_new, temperature, eos_arr, seed, n_out, sample) -> list[SpecResult]:
        dec = self.dec
        bucket = prompt_bucket(max(len(r) for r in prompts))
        ids = np.zeros((len(prompts), bucket), np.int32)
        for r, pr in enumerate(prompts):
            ids[r, : len(pr)] = pr
        roots = jnp.stack([jax.random.PRNGKey(seed + r) for r in range(len(prompts))])
        t0 = time.perf_counter()
        with dec.matmul_precision_context():
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
        with self.dec.matmul_precision_context():
            outs = generate(self.dec.target, [list(p) for p in prompts], max_new_tokens=max_new_tokens,
                            eos_token_ids=eos_token_ids, batch_size=len(prompts))
        wall = (time.perf_counter() - t0) / len(prompts)
        results = []
        for toks in outs:
            # target calls after the prefill, as SpecDecoder.greedy counts them: none after a length stop
            steps = len(toks) - 1 if len(toks) == int(max_new_tokens) else len(toks)
            results.append(SpecResult(toks, [1] * max(steps, 0), [0] * self.dec.k, max(steps, 0), 0.0, wall, wall))
        return results

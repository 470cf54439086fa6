"""Lossless speculative decoding with an EAGLE-3 (or DFlash) draft and the JAX target (batch size 1).

How one step runs (as vLLM / SGLang run EAGLE-3; docs/eagle3-format.md, "Speculative decoding step and
acceptance length"; drafts/eagle3.py, drafts/ttt.py):
  sequence x_0 .. x_{N-1}; the target cache holds slots 0..N-2, x_{N-1} is the newest token.
  draft row t (slot t, RoPE position t) reads [embed(x_{t+1}), fc(target aux at t)]. The rows the
    last target call produced ("pending": the accepted tokens and the bonus) are written into the
    draft's own KV cache from the TARGET's aux states; the last one predicts d_1.
  chain: draft step j >= 2 reads [embed(d_{j-1}), next_step_hidden(h of step j-1)] at the next slot
    (its own hidden; norm(h) with norm_output), so K tokens take K draft calls inside one jit.
    A P-EAGLE head (parallel drafting) instead reads [embed(mask token), fc(mask_hidden)] at slots
    +1..+K-1 and gives d_2..d_K in one forward after the pending rows (_draft_parallel).
  DFlash (a block drafter, drafts/dflash.py; chain only): the pending rows are context rows, the
    target's taps at their positions (no token: the accepted tokens and the aux states of the SAME
    position) appended to the draft's context cache; then one block [x_{N-1}, mask, ..., mask] at
    positions N-1.. attends to the cache and its own slots and slots 1..K give d_1..d_K
    (K <= block_size - 1; _draft_block). The newest token x_{N-1} has no target state yet: it is
    the block's slot 0, exactly where training puts the anchor.
  verify: the target runs [x_{N-1}, d_1..d_K] at positions N-1..N-1+K in one call; greedy accepts
    the longest prefix equal to the target's argmax, then the target's token after it (the bonus);
    temperature > 0 uses speculative rejection sampling (accept d_i with prob min(1, p/q), else draw
    from norm(max(p - q, 0))), so outputs are distributed exactly as the target's samples.
  rollback: both caches just treat the slots past the accepted length as stale (masked, then
    overwritten: targets.llama.decode_chunk).
  tree (greedy only): the root's top-k children, then level by level each node's top-k children,
    keeping the `tree_max_width` best by cumulative draft log-probability (depth num_spec_tokens).
    Draft tree rows attend to the prefix and their own ancestors; the target verifies all nodes in
    one call with an ancestor mask; the longest path that matches the target's argmax is accepted
    and its KV entries are moved to the slots of a linear sequence.

Draft ids map to target ids with d2t: target id = i + d2t[i]. Draft math runs in fp32.

"Lossless" is exact in fp32 (tested, CPU and H200). With a bf16 target on a GPU, verifying a chunk of
K+1 tokens and decoding one token at a time round differently, so a near-tie argmax can flip and the
output can leave the one-token greedy output (measured on H200: a random bf16 1.1B-shaped target
diverged at its 4th token); serving engines have the same property.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafts import dflash
from specjax.drafts.eagle3 import (Eagle3Config, attention_qkv, config_from_target, draft_logits, init_draft_params,
                                   layer_output, mask_hidden_projected, next_step_hidden, project_aux)
from specjax.drafts.vocab import DraftVocab
from specjax.eval.generate import check_sampling, prompt_bucket
from specjax.targets.base import validate_aux_layer_ids
from specjax.targets.layers.attention import dot_product_attention
from specjax.targets.layers.attention import cache_attention_mask, cache_size_for
from specjax_converters.dflash_import import is_dflash_folder, read_dflash_head
from specjax_converters.eagle3_import import read_head

MODES = ("chain", "tree")


# =============================================================================================
# Public types
# =============================================================================================
@dataclasses.dataclass(frozen=True)
class Draft:
    """A draft head: params pytree (docs/INTERFACES.md layout), its config (an Eagle3Config, or a
    DFlashConfig for a DFlash block drafter) and draft vocab."""

    params: Any
    config: Any  # Eagle3Config | dflash.DFlashConfig
    vocab: DraftVocab


def load_draft(draft_dir: str) -> Draft:
    """Read an exported head folder (specjax export, SpecForge or speculators layout; a DFlash
    export: config.json architectures ["DFlashDraftModel"])."""

    head = read_dflash_head(draft_dir) if is_dflash_folder(draft_dir) else read_head(draft_dir)
    params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float32)), head.params)
    return Draft(params=params, config=head.config, vocab=head.vocab)


def random_draft(target, seed: int = 0) -> Draft:
    """An untrained EAGLE-3 head (random init) drafting over the target's whole vocabulary, at the
    target's default aux taps: what the decoding benchmarks time or check without a trained head."""
    v = int(target.config.vocab_size)
    cfg = config_from_target(target.config, draft_vocab_size=v, aux_layer_ids=target.default_aux_layer_ids())
    return Draft(init_draft_params(cfg, jax.random.key(seed)), cfg, DraftVocab.identity(v))


@dataclasses.dataclass
class SpecResult:
    tokens: list[int]  # new tokens, cut before the first EOS
    accept_lengths: list[int]  # tokens emitted per verification step incl. the bonus, cut at EOS / the length limit
    # [num_spec_tokens]: steps whose draft token i was accepted by the target, counted as vLLM counts
    # them: every accepted draft of the step, also past an EOS or the length limit that ends the output
    accepted_per_position: list[int]
    num_steps: int  # verification steps (target calls after the prefill) = vLLM's "drafts"
    draft_time_s: float
    target_time_s: float
    wall_s: float

    @property
    def tau(self) -> float:
        """Acceptance length as vLLM reports it: 1 + accepted draft tokens / drafts (nan with no step).
        See docs/eagle3-format.md, "Speculative decoding step and acceptance length"."""
        if not self.num_steps:
            return float("nan")
        return 1.0 + sum(self.accepted_per_position) / self.num_steps

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification step (the output's own count: an EOS or the length limit
        ends a step early, so this is <= tau)."""
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")


# =============================================================================================
# Draft layer with a KV cache (the same math as drafts.eagle3.decoder_layer)
# =============================================================================================
def init_draft_cache(cfg: Eagle3Config, max_len: int, dtype=jnp.float32) -> dict:
    """One KV cache per draft layer: k / v [num_layers, 1, slots, nKV, hd], in the draft's compute dtype."""
    shape = (cfg.num_layers, 1, cache_size_for(max_len), cfg.num_key_value_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def _num_slots(dcache) -> int:
    return dcache["k"].shape[2]


def draft_layer_cached(params, cfg: Eagle3Config, cache, emb_btd, hidden_btd, positions_bt, slots_bt, mask_bts):
    """Every draft decoder layer for rows written at `slots` and attending per `mask` [B,T,S] over
    each layer's whole cache. Returns (pre-norm h [B,T,H], new cache)."""
    b, t, _ = hidden_btd.shape
    rows = jnp.arange(b)[:, None]
    h, ks, vs = hidden_btd, [], []
    for layer in range(cfg.num_layers):
        q, k, v = attention_qkv(params, cfg, emb_btd, h, positions_bt, layer=layer)
        kc = cache["k"][layer].at[rows, slots_bt].set(k, mode="drop")
        vc = cache["v"][layer].at[rows, slots_bt].set(v, mode="drop")
        o = dot_product_attention(q, kc, vc, mask_bts, scale=cfg.head_dim**-0.5)
        h = layer_output(params, cfg, h, o, layer=layer)
        ks.append(kc)
        vs.append(vc)
    return h, {"k": jnp.stack(ks), "v": jnp.stack(vs)}


def _draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start):
    """Write the pending rows (tokens x_{t+1}, target aux at t) from slot `start`; return the last
    pending row's pre-norm hidden [1,1,H] and the cache."""
    tp = pend_tok.shape[1]
    num_slots = _num_slots(dcache)
    dt = _dtype_of(dp)
    pos = start + jnp.arange(tp, dtype=jnp.int32)[None, :]
    emb = jnp.take(embed, pend_tok, axis=0).astype(dt)
    h0 = project_aux(dp, pend_aux, dcfg, dt)
    causal = jnp.tril(jnp.ones((tp, tp), bool))[None]
    mask = cache_attention_mask(jnp.reshape(start, (1,)), num_slots, causal)
    h, dcache = draft_layer_cached(dp, dcfg, dcache, emb, h0, pos, pos, mask)
    return jax.lax.dynamic_index_in_dim(h, pend_count - 1, axis=1, keepdims=True), dcache


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


# The dtype an EAGLE-3 draft computes in: float32, or bfloat16 as a serving engine runs a head beside
# a bf16 target (SpecDecoder's draft_dtype). Its logits are accumulated in fp32 either way. "auto" takes
# the target's dtype (bf16 for a bf16 target; float32 otherwise and for a DFlash head): at batch 8 on an
# H100 the bf16 draft made a speculative loop iteration 4% cheaper at the same tau
# (benchmarks/results/decode_speed.md, run 10).
DRAFT_DTYPES = ("auto", "float32", "bfloat16")


def _dtype_of(dp):
    return jax.tree.leaves(dp)[0].dtype


def _uniform(dp):
    """The draft params all in one compute dtype, that of their first leaf (SpecDecoder casts them
    once, to its draft_dtype)."""
    dt = _dtype_of(dp)
    return jax.tree.map(lambda a: a.astype(dt), dp)


@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("dcache",))
def _draft_chain(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, key, temperature, *, dcfg, k, sample):
    """Chain drafting: returns (K target ids [K], draft probs over the draft vocab [K, Vd] (sampling)
    or [K, 1] zeros (greedy), cache)."""
    dp = _uniform(dp)
    num_slots = _num_slots(dcache)
    h, dcache = _draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start)
    toks, qs = [], []
    for j in range(k):
        logits = draft_logits(dp, dcfg, h)[:, 0]  # [1, Vd]
        if sample:
            key, sub = jax.random.split(key)
            scaled = logits / temperature
            d = jax.random.categorical(sub, scaled, axis=-1)
            qs.append(jax.nn.softmax(scaled, axis=-1)[0])
        else:
            d = jnp.argmax(logits, axis=-1)
        tok = (d + d2t[d]).astype(jnp.int32)  # [1] target id
        toks.append(tok[0])
        if j == k - 1:
            break
        slot = start + pend_count + j  # the row that reads d_{j+1}
        emb = jnp.take(embed, tok, axis=0).astype(_dtype_of(dp))[None]  # [1, 1, H]
        mask = (jnp.arange(num_slots) <= slot)[None, None, :]
        h, dcache = draft_layer_cached(dp, dcfg, dcache, emb, next_step_hidden(dp, dcfg, h),
                                       jnp.reshape(slot, (1, 1)), jnp.reshape(slot, (1, 1)), mask)
    q = jnp.stack(qs) if sample else jnp.zeros((k, 1), jnp.float32)
    return jnp.stack(toks), q, dcache


@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("dcache",))
def _draft_parallel(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, key, temperature, *, dcfg, k,
                    sample):
    """P-EAGLE drafting (dcfg.parallel_drafting): the pending rows as for a chain; the last one gives
    d_1, and K-1 rows at the next slots (RoPE positions +1..+K-1) that read the mask token's embedding
    and fc(mask_hidden) give d_2..d_K in one more forward, each attending to the prefix and to the mask
    rows before it (the training pattern, drafts/ttt.py). Their cache slots are stale after the step
    (the next pending rows overwrite them). Returns what _draft_chain returns."""
    dp = _uniform(dp)
    num_slots = _num_slots(dcache)
    h, dcache = _draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start)
    if k > 1:
        slot0 = start + pend_count  # the first mask row
        slots = (slot0 + jnp.arange(k - 1, dtype=jnp.int32))[None, :]
        dt = _dtype_of(dp)
        emb = jnp.broadcast_to(embed[int(dcfg.mask_token_id)].astype(dt), (1, k - 1, dcfg.hidden_size))
        hid = jnp.broadcast_to(mask_hidden_projected(dp, dcfg, dt), (1, k - 1, dcfg.hidden_size))
        mask = (jnp.arange(num_slots)[None, None, :] <= slots[..., None])
        hm, dcache = draft_layer_cached(dp, dcfg, dcache, emb, hid, slots, slots, mask)
        h = jnp.concatenate([h, hm], axis=1)
    logits = draft_logits(dp, dcfg, h)[0]  # [K, Vd]
    if sample:
        scaled = logits / temperature
        d = jax.random.categorical(key, scaled, axis=-1)
        q = jax.nn.softmax(scaled, axis=-1)
    else:
        d = jnp.argmax(logits, axis=-1)
        q = jnp.zeros((k, 1), jnp.float32)
    return (d + d2t[d]).astype(jnp.int32), q, dcache


@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("ccache",))
def _draft_block(dp, embed, d2t, ccache, pend_aux, pend_count, start, last_tok, key, temperature, *, dcfg, k,
                 sample):
    """DFlash drafting: append the pending context rows (the target's taps at positions
    start..start+pend_count-1; rows past pend_count are not counted and get overwritten), then one
    block of k drafted slots after the newest token `last_tok` at position start+pend_count: d_1..d_k.
    Returns what _draft_chain returns (the cache is the context cache)."""
    dp = _f32(dp)
    tp = pend_aux[0].shape[1]
    pos = start + jnp.arange(tp, dtype=jnp.int32)[None, :]
    ccache = dflash.append_context(dp, dcfg, ccache, pend_aux, pos, jnp.reshape(pend_count, (1,)))
    # a block of exactly the k drafted slots (+ the anchor), as vLLM builds it for
    # num_speculative_tokens = k: the slots attend to each other, so a longer block would change them
    dcfg = dataclasses.replace(dcfg, block_size=k + dcfg.first_trained_slot)
    greedy, logits = dflash.propose_block(dp, dcfg, ccache, embed_table=embed, last_token_b=jnp.reshape(last_tok, (1,)),
                                          last_position_b=jnp.reshape(start + pend_count, (1,)), d2t=d2t)
    logits = logits[0, :k]  # [k, Vd]
    if sample:
        scaled = logits / temperature
        # each slot is drafted from its own marginal (no slot reads another's token), so q_i does not
        # depend on d_1..d_{i-1} and the rejection rule stays exact
        d = jax.random.categorical(key, scaled, axis=-1)
        return (d + d2t[d]).astype(jnp.int32), jax.nn.softmax(scaled, axis=-1), ccache
    return greedy[0, :k], jnp.zeros((k, 1), jnp.float32), ccache


def tree_widths(depth: int, top_k: int, max_width: int) -> tuple[int, ...]:
    """Nodes per tree level: top_k at level 1, then at most top_k per parent, capped at max_width."""
    widths, w = [], 1
    for _ in range(depth):
        w = min(w * top_k, max(max_width, top_k))
        widths.append(w)
    return tuple(widths)


@functools.partial(jax.jit, static_argnames=("dcfg", "widths", "top_k"), donate_argnames=("dcache",))
def _draft_tree(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, *, dcfg, widths, top_k):
    """Tree drafting. Returns (node target ids [Nn], parent node index [Nn] (-1 = root), cache);
    nodes are ordered level by level, each level by descending cumulative draft log-prob."""
    dp = _uniform(dp)
    num_slots = _num_slots(dcache)
    h_root, dcache = _draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start)
    base = start + pend_count  # first free slot; the root row sits at base - 1
    lp = jax.nn.log_softmax(draft_logits(dp, dcfg, h_root)[0, 0])  # [Vd]
    scores, ids = jax.lax.top_k(lp, widths[0])
    toks = (ids + d2t[ids]).astype(jnp.int32)
    all_toks, all_parents = [toks], [jnp.full((widths[0],), -1, jnp.int32)]
    hid = jnp.broadcast_to(h_root[0], (widths[0], h_root.shape[-1]))  # parent's h per node
    anc = (base + jnp.arange(widths[0], dtype=jnp.int32))[:, None]  # slots of ancestors + self
    offset = 0
    for d in range(1, len(widths)):
        w, w_next = widths[d - 1], widths[d]
        slots = base + offset + jnp.arange(w, dtype=jnp.int32)
        pos = jnp.full((1, w), base - 1 + d, jnp.int32)  # level-d rows sit d after the root row
        j = jnp.arange(num_slots, dtype=jnp.int32)
        mask = (j[None, :] < base) | jnp.any(j[None, None, :] == anc[:, :, None], axis=1)  # [w, S]
        emb = jnp.take(embed, toks, axis=0).astype(_dtype_of(dp))[None]
        h, dcache = draft_layer_cached(dp, dcfg, dcache, emb, next_step_hidden(dp, dcfg, hid[None]),
                                       pos, slots[None], mask[None])
        lp = jax.nn.log_softmax(draft_logits(dp, dcfg, h)[0], axis=-1)  # [w, Vd]
        child_lp, child_ids = jax.lax.top_k(lp, top_k)  # [w, k]
        cum = (scores[:, None] + child_lp).reshape(-1)
        scores, sel = jax.lax.top_k(cum, w_next)
        parent_local = (sel // top_k).astype(jnp.int32)
        ids = child_ids.reshape(-1)[sel]
        toks = (ids + d2t[ids]).astype(jnp.int32)
        all_toks.append(toks)
        all_parents.append(offset + parent_local)
        own = base + offset + w + jnp.arange(w_next, dtype=jnp.int32)
        anc = jnp.concatenate([anc[parent_local], own[:, None]], axis=1)
        hid = h[0, parent_local]
        offset += w
    return jnp.concatenate(all_toks), jnp.concatenate(all_parents), dcache


# =============================================================================================
# Target side: prefill, verification, acceptance
# =============================================================================================
def greedy_accept(logits_tv: jax.Array, drafts_k: jax.Array):
    """(accepted count a, bonus token): longest draft prefix equal to the target argmax."""
    tgt = jnp.argmax(logits_tv, axis=-1).astype(jnp.int32)
    k = drafts_k.shape[0]
    a = jnp.sum(jnp.cumprod((tgt[:k] == drafts_k).astype(jnp.int32)))
    return a, tgt[a]


def speculative_sample(p_tv: jax.Array, q_kv: jax.Array, drafts_k: jax.Array, key: jax.Array):
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

    p [K+1, V]: target probabilities at the K draft positions and after them; q [K, V]: the draft
    probabilities the drafts were sampled from. Draft i is accepted with prob min(1, p_i/q_i); at the
    first rejection a token is drawn from norm(max(p_i - q_i, 0)); if all K are accepted the bonus
    is drawn from p_K. Returns (accepted count a, the token emitted after them)."""
    k = drafts_k.shape[0]
    k_acc, k_res = jax.random.split(key)
    rows = jnp.arange(k)
    pd = p_tv[rows, drafts_k]
    qd = q_kv[rows, drafts_k]
    u = jax.random.uniform(k_acc, (k,))
    acc = u * qd < pd  # u < p/q without dividing (q(d) > 0: d was drawn from q)
    a = jnp.sum(jnp.cumprod(acc.astype(jnp.int32)))
    q_ext = jnp.concatenate([q_kv, jnp.zeros_like(p_tv[:1])], axis=0)  # row K: nothing to subtract
    resid = jnp.maximum(p_tv[a] - q_ext[a], 0.0)
    resid = jnp.where(jnp.sum(resid) > 0, resid, p_tv[a])  # p == q exactly: p itself
    tok = jax.random.categorical(k_res, jnp.log(resid))
    return a, tok.astype(jnp.int32)


def _sample_first(logits_v, key, temperature, sample):
    if not sample:
        return jnp.argmax(logits_v).astype(jnp.int32)
    return jax.random.categorical(key, logits_v / temperature).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "aux_ids", "sample"), donate_argnames=("cache",))
def _prefill(params, cache, ids_bt, lens_b, keys_b, temperature, *, target_cls, config, aux_ids, sample):
    """Prefill of B padded prompts from slot 0 in one target call: (each row's first token [B], drawn
    with its own key, aux [B,T,D], cache). SpecDecoder passes one row; SpecLoop a batch."""
    b, t = ids_bt.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, aux, _, cache = target_cls.decode_fn(
        params, config, cache, ids_bt, pos, jnp.zeros((b,), jnp.int32), aux_layer_ids=aux_ids,
        logits_index=(lens_b - 1)[:, None])
    first = jax.vmap(lambda lg, key: _sample_first(lg, key, temperature, sample))(logits[:, 0], keys_b)
    return first, aux, cache


@functools.partial(jax.jit, static_argnames=("target_cls", "config"), donate_argnames=("cache",))
def _greedy_step(params, cache, tok, pos, *, target_cls, config):
    p = jnp.reshape(pos, (1,))
    logits, _, _, cache = target_cls.decode_fn(params, config, cache, jnp.reshape(tok, (1, 1)), p[:, None], p)
    return jnp.argmax(logits[0, 0]).astype(jnp.int32), cache


def chain_chunk(last_tok, drafts_k, start):
    """One row's chain verification input: tokens [K+1] (the newest token, then the drafts) and their
    RoPE positions [K+1] from `start` (the newest token's slot)."""
    chunk = jnp.concatenate([jnp.reshape(last_tok, (1,)), drafts_k])
    return chunk, start + jnp.arange(chunk.shape[0], dtype=jnp.int32)


def accept_chain(logits_tv, drafts_k, q_kvd, draft_ids, key, temperature, *, sample):
    """One row's acceptance of a verified chain from the target's fp32 logits [K+1, V]: (accepted
    count a, bonus, pending rows [1, K+1])."""
    if sample:
        p = jax.nn.softmax(logits_tv / temperature, axis=-1)
        q = jnp.zeros((drafts_k.shape[0], p.shape[-1]), jnp.float32).at[:, draft_ids].set(q_kvd)
        a, bonus = speculative_sample(p, q, drafts_k, key)
    else:
        a, bonus = greedy_accept(logits_tv, drafts_k)
    return a, bonus, _pending(drafts_k, a, bonus)


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "aux_ids", "sample"), donate_argnames=("cache",))
def _verify_chain(params, cache, last_tok, drafts, start, q_kvd, draft_ids, key, temperature, *,
                  target_cls, config, aux_ids, sample):
    chunk, pos = chain_chunk(last_tok, drafts, start)
    logits, aux, _, cache = target_cls.decode_fn(
        params, config, cache, chunk[None], pos[None], jnp.reshape(start, (1,)), aux_layer_ids=aux_ids)
    a, bonus, pending = accept_chain(logits[0], drafts, q_kvd, draft_ids, key, temperature, sample=sample)
    return a, bonus, pending, aux, cache


def _pending(path_toks_k, a, bonus):
    """[1, K+1]: the accepted draft tokens then the bonus (the next draft rows' input tokens)."""
    return jnp.concatenate([path_toks_k, jnp.zeros((1,), jnp.int32)]).at[a].set(bonus)[None]


def tree_ancestor_mask(parent_chunk: jax.Array, depth: int) -> jax.Array:
    """bool [T, T]: chunk row i sees row j iff j is i or an ancestor (row 0 = the root)."""
    t = parent_chunk.shape[0]
    cur = jnp.arange(t)
    mask = jnp.eye(t, dtype=bool)
    for _ in range(depth):
        cur = parent_chunk[cur]
        mask = mask.at[jnp.arange(t), cur].set(True)
    return mask


def tree_chunk(last_tok, node_toks, node_parents, start, depth: int):
    """One row's tree verification input: tokens [T] (row 0 = the root, the newest token, then the
    nodes), each row's parent row [T] (the root's is itself), RoPE positions [T] (start + depth) and
    the ancestor mask [T, T]."""
    n = node_toks.shape[0]
    toks = jnp.concatenate([jnp.reshape(last_tok, (1,)), node_toks])
    parent = jnp.concatenate([jnp.zeros((1,), jnp.int32), node_parents + 1])
    node_depth = jnp.zeros((n + 1,), jnp.int32)
    cur = jnp.arange(n + 1)
    for _ in range(depth):  # depth = number of steps to reach the root
        node_depth = node_depth + (cur != 0)
        cur = parent[cur]
    return toks, parent, start + node_depth, tree_ancestor_mask(parent, depth)


def accept_tree(logits_tv, toks, parent, depth: int):
    """One row's walk down a verified tree: (accepted count a, bonus, path [depth+1] of the accepted
    chunk rows (0 past the end), pending rows [1, depth+1])."""
    tgt = jnp.argmax(logits_tv, axis=-1).astype(jnp.int32)
    rows = jnp.arange(toks.shape[0])
    cur, a, alive, path = jnp.int32(0), jnp.int32(0), jnp.bool_(True), [jnp.int32(0)]
    for _ in range(depth):  # walk down the tree while a child carries the target's argmax
        cand = (parent == cur) & (rows > 0) & (toks == tgt[cur])
        found = alive & jnp.any(cand)
        nxt = jnp.argmax(cand).astype(jnp.int32)
        cur = jnp.where(found, nxt, cur)
        a = a + found.astype(jnp.int32)
        alive = found
        path.append(jnp.where(found, nxt, 0))
    path = jnp.stack(path)
    bonus = tgt[cur]
    return a, bonus, path, _pending(toks[path[1:]], a, bonus)


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "aux_ids", "depth"), donate_argnames=("cache",))
def _verify_tree(params, cache, last_tok, node_toks, node_parents, start, *, target_cls, config, aux_ids, depth):
    toks, parent, pos, mask = tree_chunk(last_tok, node_toks, node_parents, start, depth)
    logits, aux, _, cache = target_cls.decode_fn(
        params, config, cache, toks[None], pos[None], jnp.reshape(start, (1,)), aux_layer_ids=aux_ids,
        chunk_mask_btt=mask[None])
    a, bonus, path, pending = accept_tree(logits[0], toks, parent, depth)
    # Move the accepted nodes' K/V to the slots of a linear sequence (start+i); other slots are stale
    # (targets.base.commit_tree_path; a recurrent target also re-labels its per-node states).
    cache = target_cls.commit_path_fn(cache, start, path, a)
    aux_path = tuple(jnp.take(x, path, axis=1) for x in aux)
    return a, bonus, pending, aux_path, cache


# =============================================================================================
# The decoder
# =============================================================================================
class SpecDecoder:
    """Speculative decoding of one prompt at a time with `target` and an EAGLE-3 `draft` (or a DFlash
    block drafter: chain only, num_spec_tokens <= its block's drafted slots).

    mode "chain": K = num_spec_tokens drafted autoregressively, verified in one call of K+1 tokens.
    mode "tree": depth K, tree_top_k children per node, at most tree_max_width nodes per level
    (default tree_top_k**2); temperature 0 only.
    """

    def __init__(self, target, draft: Draft, *, num_spec_tokens: int = 5, mode: str = "chain",
                 tree_top_k: int = 2, tree_max_width: int | None = None, matmul_precision: str | None = "auto",
                 draft_dtype: str = "auto"):
        target.require_decoding()
        if draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"draft_dtype must be one of {DRAFT_DTYPES}, got {draft_dtype!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if int(num_spec_tokens) < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        cfg, vocab = draft.config, draft.vocab
        tcfg = target.config
        self.block_drafter = isinstance(cfg, dflash.DFlashConfig)
        if self.block_drafter:
            if mode != "chain":
                raise ValueError("a DFlash head drafts one block (a chain) per step; use mode='chain'")
            if int(num_spec_tokens) > cfg.num_draft_tokens:
                raise ValueError(f"num_spec_tokens={num_spec_tokens} exceeds the {cfg.num_draft_tokens} tokens one block "
                                 f"of this DFlash head drafts (block_size={cfg.block_size}); use num_spec_tokens <= "
                                 f"{cfg.num_draft_tokens}")
        target_hidden = cfg.hidden_size if self.block_drafter else cfg.target_hidden_size
        if cfg.hidden_size != tcfg.hidden_size or target_hidden != tcfg.hidden_size:
            raise ValueError(
                f"draft hidden_size {cfg.hidden_size} / target_hidden_size {target_hidden} must equal the "
                f"target's hidden_size {tcfg.hidden_size}: this head was trained for another target")
        if vocab.vocab_size != tcfg.vocab_size or cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(
                f"draft vocab maps into {vocab.vocab_size} target ids (config vocab_size {cfg.vocab_size}) but the "
                f"target has {tcfg.vocab_size}: this head was trained for another target")
        if vocab.draft_vocab_size != cfg.draft_vocab_size:
            raise ValueError(f"draft vocab has {vocab.draft_vocab_size} ids but the config says "
                             f"draft_vocab_size={cfg.draft_vocab_size}")
        if getattr(cfg, "parallel_drafting", False) and mode != "chain":
            raise ValueError("a P-EAGLE head drafts one chain in one forward (parallel drafting); use mode='chain'")
        if int(tree_top_k) < 1 or int(tree_top_k) > cfg.draft_vocab_size:
            raise ValueError(f"tree_top_k must be in [1, {cfg.draft_vocab_size}], got {tree_top_k}")

        taps = cfg.target_layer_ids if self.block_drafter else cfg.aux_layer_ids
        self.aux_ids = validate_aux_layer_ids(taps, target.num_layers)
        self.target, self.draft = target, draft
        self.k = int(num_spec_tokens)
        self.mode = mode
        self.top_k = int(tree_top_k)
        self.widths = tree_widths(self.k, self.top_k, int(tree_max_width or self.top_k**2))
        self.embed = target.embed_table(target.params)
        # "auto": a float32 target gets true fp32 matmuls. On GPU the default for f32 dots is TF32
        # (10-bit mantissa); then the K+1-token verification call and a 1-token greedy step round
        # differently and break near-ties the other way, so speculative output stops being equal to
        # greedy output (measured on an H200: 39 of 324 SmolLM2 turns). It is not free: on the H200
        # a `highest` eval looked ~4-5x slower than a TF32 one beside it (not measured cleanly).
        if matmul_precision == "auto":
            matmul_precision = "highest" if self.embed.dtype == jnp.float32 else None
        if matmul_precision not in (None, "default", "high", "highest", "bfloat16", "tensorfloat32", "float32"):
            raise ValueError(f"matmul_precision must be 'auto', None or a jax precision name, got {matmul_precision!r}")
        self.matmul_precision = matmul_precision
        if draft_dtype == "auto":
            draft_dtype = ("bfloat16" if self.embed.dtype == jnp.bfloat16 and not self.block_drafter
                           else "float32")
        if self.block_drafter and draft_dtype != "float32":
            raise ValueError(f"draft_dtype={draft_dtype!r}: a DFlash head drafts in float32 here; use "
                             "draft_dtype='float32'")
        # on the device once, in the draft's compute dtype (a trainer may hand host numpy arrays; re-sent
        # every call otherwise)
        self.draft_dtype = draft_dtype
        self.draft_params = jax.tree.map(lambda a: jnp.asarray(a, jnp.dtype(draft_dtype)), draft.params)
        self.d2t = jnp.asarray(vocab.d2t, jnp.int32)
        self.draft_ids = jnp.asarray(vocab.draft_ids, jnp.int32)

    @property
    def verify_len(self) -> int:
        """Tokens per target verification call."""
        return 1 + (self.k if self.mode == "chain" else sum(self.widths))

    def _tkw(self):
        return dict(target_cls=type(self.target), config=self.target.config)

    def _setup(self, prompt_ids, max_new_tokens, temperature):
        check_sampling(max_new_tokens, temperature, 1.0)
        prompt = [int(x) for x in prompt_ids]
        vsize = int(self.target.config.vocab_size)
        if not prompt:
            raise ValueError("prompt_ids is empty; the prompt needs at least one token (e.g. BOS)")
        if any(not 0 <= x < vsize for x in prompt):
            raise ValueError(f"prompt_ids has token ids outside the target vocab [0, {vsize})")
        bucket = prompt_bucket(len(prompt))
        ids = np.zeros((1, bucket), np.int32)
        ids[0, : len(prompt)] = prompt
        # > bucket: a cache never has the prefill chunk's length (attention.py treats S == T as self-attention)
        max_len = max(bucket + 1, len(prompt) + int(max_new_tokens) + self.verify_len + 2)
        return prompt, jnp.asarray(ids), max_len

    def _precision(self):
        if self.matmul_precision is None:
            return contextlib.nullcontext()
        return jax.default_matmul_precision(self.matmul_precision)

    def greedy(self, prompt_ids: Sequence[int], *, max_new_tokens: int, eos_token_ids=()) -> SpecResult:
        """Plain greedy decoding through the same cache code: the speedup baseline."""
        with self._precision():
            return self._greedy(prompt_ids, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)

    def _greedy(self, prompt_ids: Sequence[int], *, max_new_tokens: int, eos_token_ids=()) -> SpecResult:
        t0 = time.perf_counter()
        prompt, ids, max_len = self._setup(prompt_ids, max_new_tokens, 0.0)
        eos = set(int(e) for e in eos_token_ids)
        out: list[int] = []
        steps = 0
        if max_new_tokens > 0:
            cache = self.target.init_cache(1, max_len)
            tok, _, cache = _prefill(self.target.params, cache, ids, jnp.asarray([len(prompt)], jnp.int32),
                                     jax.random.PRNGKey(0)[None], jnp.float32(1.0), aux_ids=(), sample=False,
                                     **self._tkw())
            tok = int(tok[0])
            while True:
                if tok in eos:
                    break
                out.append(tok)
                if len(out) >= max_new_tokens:
                    break
                tok, cache = _greedy_step(self.target.params, cache, jnp.int32(tok),
                                          jnp.int32(len(prompt) + len(out) - 1), **self._tkw())
                tok = int(tok)
                steps += 1
        wall = time.perf_counter() - t0
        return SpecResult(out, [1] * steps, [0] * self.k, steps, 0.0, wall, wall)

    def generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                 eos_token_ids=(), seed: int = 0) -> SpecResult:
        with self._precision():
            return self._generate(prompt_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                  eos_token_ids=eos_token_ids, seed=seed)

    def _generate(self, prompt_ids: Sequence[int], *, max_new_tokens: int, temperature: float = 0.0,
                  eos_token_ids=(), seed: int = 0) -> SpecResult:
        t0 = time.perf_counter()
        prompt, ids, max_len = self._setup(prompt_ids, max_new_tokens, temperature)
        sample = float(temperature) > 0.0
        if sample and self.mode == "tree":
            raise ValueError("tree mode verifies greedily; use mode='chain' for temperature > 0")
        eos = set(int(e) for e in eos_token_ids)
        k, dcfg = self.k, self.draft.config
        temp = jnp.float32(max(float(temperature), 1e-6))
        root = jax.random.PRNGKey(int(seed))
        res = SpecResult([], [], [0] * k, 0, 0.0, 0.0, 0.0)
        if max_new_tokens == 0:
            res.wall_s = time.perf_counter() - t0
            return res
        params = self.target.params

        tt = time.perf_counter()
        tcache = self.target.init_cache(1, max_len)
        first, aux, tcache = _prefill(params, tcache, ids, jnp.asarray([len(prompt)], jnp.int32),
                                      jax.random.fold_in(root, 0)[None], temp, aux_ids=self.aux_ids, sample=sample,
                                      **self._tkw())
        first = int(first[0])
        res.target_time_s += time.perf_counter() - tt
        if first in eos:
            res.wall_s = time.perf_counter() - t0
            return res
        res.tokens.append(first)
        # pending draft rows 0..P-1 read tokens x_1..x_P (x_P = first) and the prefill's aux states
        pend = np.zeros((1, ids.shape[1]), np.int32)
        pend[0, : len(prompt)] = prompt[1:] + [first]
        pend_tok, pend_aux, pend_count, dstart = jnp.asarray(pend), aux, len(prompt), 0
        n = len(prompt) + 1  # sequence length; target cache valid for slots 0..n-2
        # DFlash: one context row per position instead of draft rows (max_len covers every write:
        # the prefill's bucket, then K+1 rows after at most prompt + max_new_tokens - 1 valid ones)
        dcache = (dflash.init_context_cache(dcfg, 1, cache_size_for(max_len)) if self.block_drafter
                  else init_draft_cache(dcfg, max_len, jnp.dtype(self.draft_dtype)))
        step = 0
        while len(res.tokens) < max_new_tokens:
            step += 1
            last = jnp.int32(res.tokens[-1])
            td = time.perf_counter()
            if self.block_drafter:
                drafts, q, dcache = _draft_block(
                    self.draft_params, self.embed, self.d2t, dcache, pend_aux, jnp.int32(pend_count),
                    jnp.int32(dstart), last, jax.random.fold_in(root, 2 * step), temp, dcfg=dcfg, k=k, sample=sample)
            elif self.mode == "chain":
                propose = _draft_parallel if dcfg.parallel_drafting else _draft_chain
                drafts, q, dcache = propose(
                    self.draft_params, self.embed, self.d2t, dcache, pend_tok, pend_aux, jnp.int32(pend_count),
                    jnp.int32(dstart), jax.random.fold_in(root, 2 * step), temp, dcfg=dcfg, k=k, sample=sample)
            else:
                nodes, parents, dcache = _draft_tree(
                    self.draft_params, self.embed, self.d2t, dcache, pend_tok, pend_aux, jnp.int32(pend_count),
                    jnp.int32(dstart), dcfg=dcfg, widths=self.widths, top_k=self.top_k)
                drafts = nodes
            jax.block_until_ready(drafts)
            res.draft_time_s += time.perf_counter() - td
            tt = time.perf_counter()
            if self.mode == "chain":
                drafts, q = self._override_chain(drafts, q, res.tokens, prompt)
                a, bonus, pend_dev, aux, tcache = _verify_chain(
                    params, tcache, last, drafts, jnp.int32(n - 1), q, self.draft_ids,
                    jax.random.fold_in(root, 2 * step + 1), temp, aux_ids=self.aux_ids, sample=sample, **self._tkw())
            else:
                nodes, parents = self._override_tree(nodes, parents, res.tokens, prompt)
                a, bonus, pend_dev, aux, tcache = _verify_tree(
                    params, tcache, last, nodes, parents, jnp.int32(n - 1), aux_ids=self.aux_ids, depth=k,
                    **self._tkw())
            a, pend_host = jax.device_get((a, pend_dev))  # the step's one device -> host read
            a = int(a)
            res.target_time_s += time.perf_counter() - tt
            new = [int(x) for x in pend_host[0, : a + 1]]
            # emit, stopping at EOS (counted, not kept) and at max_new_tokens
            emitted, stop = 0, False
            for tok in new:
                emitted += 1
                if tok in eos:
                    stop = True
                    break
                res.tokens.append(tok)
                if len(res.tokens) >= max_new_tokens:
                    stop = True
                    break
            res.accept_lengths.append(emitted)
            for i in range(a):  # vLLM counts the step's accepted drafts before its stop check
                res.accepted_per_position[i] += 1
            res.num_steps = step
            if stop:
                break
            pend_tok, pend_aux, pend_count, dstart = pend_dev, aux, a + 1, n - 1
            n += a + 1
        res.wall_s = time.perf_counter() - t0
        return res

    # Test seams: a subclass may replace the proposals before verification (e.g. an oracle draft).
    def _override_chain(self, drafts, q, tokens, prompt):
        return drafts, q

    def _override_tree(self, nodes, parents, tokens, prompt):
        return nodes, parents

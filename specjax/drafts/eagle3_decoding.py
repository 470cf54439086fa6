"""EAGLE-3's side of speculative decoding (draft.type eagle3 and p_eagle): the proposers that draft
a step's tokens from the pending rows (the accepted tokens and the target's aux states of the last
verification), each one jitted call, and the draft layer with a KV cache they run on.

`draft_chain` (EAGLE-3: K autoregressive draft steps), `draft_parallel` (P-EAGLE: the last pending row
and K-1 mask rows in one forward) and `draft_tree` (top-k tree, level by level). The families
(`eagle3_family`) hand them to `specjax.eval.spec_decode.SpecDecoder`, which calls them once per step
from the host, and to `specjax.eval.spec_loop.SpecLoop`, which vmaps them over rows inside its device
loop. How a step uses them: the spec_decode module docstring.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from specjax.drafts.eagle3 import (Eagle3Config, attention_qkv, draft_logits, layer_output, mask_hidden_projected,
                                   next_step_hidden, project_aux)
from specjax.targets.layers.attention import cache_attention_mask, cache_size_for, dot_product_attention


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


def draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start):
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



def _dtype_of(dp):
    return jax.tree.leaves(dp)[0].dtype


def _uniform(dp):
    """The draft params all in one compute dtype, that of their first leaf (SpecDecoder casts them
    once, to its draft_dtype)."""
    dt = _dtype_of(dp)
    return jax.tree.map(lambda a: a.astype(dt), dp)


@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("dcache",))
def draft_chain(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, key, temperature, *, dcfg, k, sample):
    """Chain drafting: returns (K target ids [K], draft probs over the draft vocab [K, Vd] (sampling)
    or [K, 1] zeros (greedy), cache)."""
    dp = _uniform(dp)
    num_slots = _num_slots(dcache)
    h, dcache = draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start)
    toks, qs = [], []
    for j in range(k):
        logits = draft_logits(dp, dcfg, h)[:, 0]  # [1, Vd]
        d, key = chain_draw(logits, key, temperature, sample, qs)
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
def draft_parallel(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, key, temperature, *, dcfg, k,
                    sample):
    """P-EAGLE drafting (dcfg.parallel_drafting): the pending rows as for a chain; the last one gives
    d_1, and K-1 rows at the next slots (RoPE positions +1..+K-1) that read the mask token's embedding
    and fc(mask_hidden) give d_2..d_K in one more forward, each attending to the prefix and to the mask
    rows before it (the training pattern, drafts/ttt.py). Their cache slots are stale after the step
    (the next pending rows overwrite them). Returns what draft_chain returns."""
    dp = _uniform(dp)
    num_slots = _num_slots(dcache)
    h, dcache = draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start)
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


def chain_draw(logits, key, temperature, sample: bool, qs: list):
    """One chain step's draft-vocab pick from logits [1, Vd]: argmax, or with `sample` a draw from
    softmax(logits / temperature) whose distribution row is appended to `qs` (the q of rejection
    sampling). Returns (draft ids [1], the key for the next step)."""
    if not sample:
        return jnp.argmax(logits, axis=-1), key
    key, sub = jax.random.split(key)
    scaled = logits / temperature
    qs.append(jax.nn.softmax(scaled, axis=-1)[0])
    return jax.random.categorical(sub, scaled, axis=-1), key


def rerank_tree(toks, parents, scores, total: int):
    """EAGLE-2's re-ranking: of the expanded nodes (level by level, parent index -1 = root) keep the
    `total` of highest cumulative draft log-prob `scores`, in their original order, with parent indices
    renumbered. A child's score is its parent's plus a log-prob <= 0, and ties go to the earlier
    (shallower) node (stable sort), so every kept node's ancestors are kept too."""
    order = jnp.argsort(-scores, stable=True)
    sel = jnp.sort(order[:total])
    new_index = jnp.full(toks.shape, -1, jnp.int32).at[sel].set(jnp.arange(total, dtype=jnp.int32))
    par = parents[sel]
    return toks[sel], jnp.where(par < 0, -1, new_index[jnp.maximum(par, 0)]).astype(jnp.int32)


def tree_walk(root_logits, h_root, d2t, dcache, base, num_slots: int, *, widths, top_k: int, expand,
              total: Optional[int] = None):
    """The draft tree grown from the root row's logits [Vd] and hidden h_root [1, H] (base = the first
    free cache slot; the root row sits at base - 1): the root's widths[0] best children, then per level
    each node's top_k children, keeping the widths[d] nodes of highest cumulative draft log-prob.
    `expand(toks [w], parent hidden [w, H], pos [1, w], slots [1, w], mask [1, w, S], cache)` runs the
    head on one level and returns (its logits [w, Vd], its hidden [1, w, H], the cache). Returns (node
    target ids [Nn], parent node index [Nn] (-1 = root), cache), nodes level by level, each level by
    descending cumulative log-prob; with `total` (< sum(widths)) only the `total` best nodes of the whole
    tree (rerank_tree), so the target verifies `total` tokens."""
    scores, ids = jax.lax.top_k(jax.nn.log_softmax(root_logits), widths[0])
    toks = (ids + d2t[ids]).astype(jnp.int32)
    all_toks, all_parents, all_scores = [toks], [jnp.full((widths[0],), -1, jnp.int32)], [scores]
    hid = jnp.broadcast_to(h_root[0], (widths[0], h_root.shape[-1]))  # parent's h per node
    anc = (base + jnp.arange(widths[0], dtype=jnp.int32))[:, None]  # slots of ancestors + self
    offset = 0
    for d in range(1, len(widths)):
        w, w_next = widths[d - 1], widths[d]
        slots = base + offset + jnp.arange(w, dtype=jnp.int32)
        pos = jnp.full((1, w), base - 1 + d, jnp.int32)  # level-d rows sit d after the root row
        j = jnp.arange(num_slots, dtype=jnp.int32)
        mask = (j[None, :] < base) | jnp.any(j[None, None, :] == anc[:, :, None], axis=1)  # [w, S]
        logits, h, dcache = expand(toks, hid, pos, slots[None], mask[None], dcache)
        child_lp, child_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), top_k)  # [w, k]
        cum = (scores[:, None] + child_lp).reshape(-1)
        scores, sel = jax.lax.top_k(cum, w_next)
        parent_local = (sel // top_k).astype(jnp.int32)
        ids = child_ids.reshape(-1)[sel]
        toks = (ids + d2t[ids]).astype(jnp.int32)
        all_toks.append(toks)
        all_parents.append(offset + parent_local)
        all_scores.append(scores)
        own = base + offset + w + jnp.arange(w_next, dtype=jnp.int32)
        anc = jnp.concatenate([anc[parent_local], own[:, None]], axis=1)
        hid = h[0, parent_local]
        offset += w
    toks, parents = jnp.concatenate(all_toks), jnp.concatenate(all_parents)
    if total is not None and total < toks.shape[0]:
        toks, parents = rerank_tree(toks, parents, jnp.concatenate(all_scores), total)
    return toks, parents, dcache


@functools.partial(jax.jit, static_argnames=("dcfg", "widths", "top_k", "total"), donate_argnames=("dcache",))
def draft_tree(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, *, dcfg, widths, top_k, total=None):
    """Tree drafting (tree_walk). Returns (node target ids [Nn], parent node index [Nn] (-1 = root),
    cache); nodes are ordered level by level, each level by descending cumulative draft log-prob."""
    dp = _uniform(dp)
    h_root, dcache = draft_prefill(dp, dcfg, embed, dcache, pend_tok, pend_aux, pend_count, start)

    def expand(toks, hid, pos, slots, mask, dcache):
        emb = jnp.take(embed, toks, axis=0).astype(_dtype_of(dp))[None]
        h, dcache = draft_layer_cached(dp, dcfg, dcache, emb, next_step_hidden(dp, dcfg, hid[None]), pos, slots, mask)
        return draft_logits(dp, dcfg, h)[0], h, dcache

    return tree_walk(draft_logits(dp, dcfg, h_root)[0, 0], h_root, d2t, dcache, start + pend_count,
                     _num_slots(dcache), widths=widths, top_k=top_k, expand=expand, total=total)

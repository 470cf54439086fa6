"""The target side of speculative decoding: the jitted target calls (the prefill that draws the
first token, a plain greedy step, chain and tree verification) and the acceptance rules they apply to
the target's logits (greedy prefix match, speculative rejection sampling, the walk down a verified
tree), each written for one row so `SpecLoop` can vmap them over a batch. `tree_widths` gives the
nodes per level of a draft tree, the shape both sides of a tree step share.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def tree_widths(depth: int, top_k: int, max_width: int) -> tuple[int, ...]:
    """Nodes per tree level: top_k at level 1, then at most top_k per parent, capped at max_width."""
    widths, w = [], 1
    for _ in range(depth):
        w = min(w * top_k, max(max_width, top_k))
        widths.append(w)
    return tuple(widths)


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


def drafter_states(aux, final, with_final: bool) -> tuple:
    """What a target call hands the drafter: the aux taps, then the final hidden state (after the
    final norm) when the draft family reads it (DraftFamily.reads_final_hidden)."""
    return tuple(aux) + ((final,) if with_final else ())


def sample_first(logits_v, key, temperature, sample):
    if not sample:
        return jnp.argmax(logits_v).astype(jnp.int32)
    return jax.random.categorical(key, logits_v / temperature).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "aux_ids", "sample", "with_final"),
                   donate_argnames=("cache",))
def prefill(params, cache, ids_bt, lens_b, keys_b, temperature, *, target_cls, config, aux_ids, sample,
            with_final=False):
    """Prefill of B padded prompts from slot 0 in one target call: (each row's first token [B], drawn
    with its own key, aux [B,T,D], cache). SpecDecoder passes one row; SpecLoop a batch."""
    b, t = ids_bt.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, aux, final, cache = target_cls.decoder.decode_chunk(
        params, config, cache, ids_bt, pos, jnp.zeros((b,), jnp.int32), aux_layer_ids=aux_ids,
        logits_index=(lens_b - 1)[:, None])
    first = jax.vmap(lambda lg, key: sample_first(lg, key, temperature, sample))(logits[:, 0], keys_b)
    return first, drafter_states(aux, final, with_final), cache


@functools.partial(jax.jit, static_argnames=("target_cls", "config"), donate_argnames=("cache",))
def greedy_step(params, cache, tok, pos, *, target_cls, config):
    p = jnp.reshape(pos, (1,))
    logits, _, _, cache = target_cls.decoder.decode_chunk(params, config, cache, jnp.reshape(tok, (1, 1)), p[:, None], p)
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
    return a, bonus, pending_rows(drafts_k, a, bonus)


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "aux_ids", "sample", "with_final"),
                   donate_argnames=("cache",))
def verify_chain(params, cache, last_tok, drafts, start, q_kvd, draft_ids, key, temperature, *,
                  target_cls, config, aux_ids, sample, with_final=False):
    chunk, pos = chain_chunk(last_tok, drafts, start)
    logits, aux, final, cache = target_cls.decoder.decode_chunk(
        params, config, cache, chunk[None], pos[None], jnp.reshape(start, (1,)), aux_layer_ids=aux_ids)
    a, bonus, pending = accept_chain(logits[0], drafts, q_kvd, draft_ids, key, temperature, sample=sample)
    return a, bonus, pending, drafter_states(aux, final, with_final), cache


def pending_rows(path_toks_k, a, bonus):
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
    return a, bonus, path, pending_rows(toks[path[1:]], a, bonus)


@functools.partial(jax.jit, static_argnames=("target_cls", "config", "aux_ids", "depth", "with_final"),
                   donate_argnames=("cache",))
def verify_tree(params, cache, last_tok, node_toks, node_parents, start, *, target_cls, config, aux_ids, depth,
                with_final=False):
    toks, parent, pos, mask = tree_chunk(last_tok, node_toks, node_parents, start, depth)
    logits, aux, final, cache = target_cls.decoder.decode_chunk(
        params, config, cache, toks[None], pos[None], jnp.reshape(start, (1,)), aux_layer_ids=aux_ids,
        chunk_mask_btt=mask[None])
    a, bonus, path, pending = accept_tree(logits[0], toks, parent, depth)
    # Move the accepted nodes' K/V to the slots of a linear sequence (start+i); other slots are stale
    # (targets.base.commit_tree_path; a recurrent target also re-labels its per-node states).
    cache = target_cls.commit_path_fn(cache, start, path, a)
    aux_path = tuple(jnp.take(x, path, axis=1) for x in drafter_states(aux, final, with_final))
    return a, bonus, pending, aux_path, cache

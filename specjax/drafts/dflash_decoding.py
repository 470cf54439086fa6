"""DFlash's side of speculative decoding: the block proposer over the draft's context cache.

`draft_block` appends the pending context rows (the target's taps of the accepted positions) to the
context cache (`dflash.init_context_cache`), then drafts one block after the newest token. The DFlash
family (`dflash_family`) hands it to `specjax.eval.spec_decode.SpecDecoder` and `SpecLoop`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from specjax.drafts import dflash


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


@functools.partial(jax.jit, static_argnames=("dcfg", "k", "sample"), donate_argnames=("ccache",))
def draft_block(dp, embed, d2t, ccache, pend_aux, pend_count, start, last_tok, key, temperature, *, dcfg, k,
                 sample):
    """DFlash drafting: append the pending context rows (the target's taps at positions
    start..start+pend_count-1; rows past pend_count are not counted and get overwritten), then one
    block of k drafted slots after the newest token `last_tok` at position start+pend_count: d_1..d_k.
    Returns what draft_chain returns (the cache is the context cache)."""
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

"""Speculative decoding with a DFlash block drafter (specjax.drafts.dflash_decoding.draft_block).

Bars: (1) lossless: greedy speculative output equals the target's greedy output token for token
(fp32) with a random head and with a hand-perturbed one (two layers, large weights, jittered norm
scales, slot 0 drafting, full vocab), for K = 1 and K = block_size - 1 (and an EOS cut); (2) every
proposal is the training forward's (drafts.dflash.draft_forward) argmax at that anchor: an uncached
forward over the whole sequence with the anchor at the newest token's position, the context rows
from the target's taps of every earlier position -- checked at every step while a partial oracle
makes the target accept 0, 1, 2, ... drafts, so the context cache's appends after every accepted
length are covered; (3) sampling runs, tree mode and K > block_size - 1 are refused.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts import dflash
from specjax.drafts.vocab import DraftVocab
from specjax.eval.spec_decode import Draft, SpecDecoder

from eval._models import assert_samples_in_chain_mode_only, target_draft_and_reference

PROMPT = [5, 17, 3, 9, 11, 2, 40]
MAX_NEW = 13
MASK_ID = 3
BLOCK = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    def make_draft(target, vocab):
        dcfg = dflash.config_from_target(target.config, draft_vocab_size=48, mask_token_id=MASK_ID, num_layers=1,
                                         block_size=BLOCK, aux_layer_ids=(0, 2))
        # std 0.1: with the 0.02 init a block's argmax hardly depends on its context (a weak check)
        return Draft(dflash.init_draft_params(dcfg, jax.random.key(0), std=0.1), dcfg, vocab)

    # the oracle looks up to K ahead
    return target_draft_and_reference(tmp_path_factory.mktemp("spec_df"), make_draft, PROMPT, MAX_NEW + 20)


def perturbed(draft, target):
    """Two layers, kernels std 0.2, norm scales 1 +- 0.3, slot 0 drafting, the full target vocab."""
    V = target.config.vocab_size
    cfg = dataclasses.replace(draft.config, num_layers=2, draft_vocab_size=V, sample_from_anchor=True)
    params = dflash.init_draft_params(cfg, jax.random.key(7), std=0.2)
    rng = np.random.default_rng(7)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.asarray(1.0 + 0.3 * rng.standard_normal(x.shape), jnp.float32) if p[-1].key == "scale" else x,
        params)
    return Draft(params, cfg, DraftVocab.identity(V))


@pytest.mark.parametrize("head", ["random", "perturbed"])
def test_lossless_dflash(setup, head):
    target, draft, ref = setup
    draft = draft if head == "random" else perturbed(draft, target)
    for k in (1, draft.config.num_draft_tokens):
        dec = SpecDecoder(target, draft, num_spec_tokens=k)
        res = dec.generate(PROMPT, max_new_tokens=MAX_NEW)
        assert res.tokens == ref[:MAX_NEW], (head, k)
        assert sum(res.accept_lengths) == MAX_NEW - 1 and len(res.accepted_per_position) == k
    eos = ref[7]
    assert dec.generate(PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[eos]).tokens == ref[: ref.index(eos)]


class PartialOracle(SpecDecoder):
    """Records the draft's own proposals, then replaces them by the target's greedy continuation
    with the first `step % (k + 1)` right and the rest wrong, so the target accepts 0, 1, ..., k."""

    def _override_chain(self, drafts, q, tokens, prompt):
        self.seen.append((list(tokens), [int(x) for x in np.asarray(drafts)]))
        n, right = len(tokens), (len(self.seen) - 1) % (self.k + 1)
        truth = self.ref[n: n + self.k]
        fake = [t if i < right else (t + 1) % self.vocab for i, t in enumerate(truth)]
        return jnp.asarray(fake, jnp.int32), q


@pytest.mark.parametrize("head", ["random", "perturbed"])
@pytest.mark.parametrize("short", [False, True])
def test_proposals_follow_the_training_forward(setup, head, short):
    """With K < the block's drafted slots the block is K slots long (+ the anchor), as vLLM builds
    it for num_speculative_tokens = K: the reference is the training forward of that shorter block."""
    target, draft, ref = setup
    draft = draft if head == "random" else perturbed(draft, target)
    cfg, p = draft.config, draft.params
    K = 2 if short else cfg.num_draft_tokens
    cfg = dataclasses.replace(cfg, block_size=K + cfg.first_trained_slot)
    dec = PartialOracle(target, draft, num_spec_tokens=K)
    dec.seen, dec.ref, dec.vocab = [], ref, target.config.vocab_size
    max_new = sum(range(1, K + 2)) + 2
    res = dec.generate(PROMPT, max_new_tokens=max_new)
    assert res.tokens == ref[:max_new]
    assert set(range(1, K + 2)) <= set(res.accept_lengths)  # 0..K drafts accepted, each at least once
    embed = target.embed_table(target.params)
    d2t = np.asarray(draft.vocab.d2t)
    T = len(PROMPT) + max_new + 1

    @jax.jit
    def block_logits(x, aux, anchor):
        h = dflash.draft_forward(p, cfg, aux_hidden=aux, input_ids=x, positions=jnp.arange(T)[None],
                                 segment_ids=jnp.ones((1, T), jnp.int32), anchors=jnp.reshape(anchor, (1, 1)),
                                 embed_table=embed, attention="reference")
        return dflash.draft_logits(p, cfg, h)[0, 0, cfg.first_trained_slot:]  # [K, Vd]

    for tokens, drafts in dec.seen:
        seq = PROMPT + tokens
        x = jnp.asarray([seq + [0] * (T - len(seq))], jnp.int32)
        aux = target(x, aux_layer_ids=cfg.aux_layer_ids).aux_hidden
        logits = np.asarray(block_logits(x, aux, len(seq) - 1))  # the anchor: the newest token
        for j in range(K):
            row = int(np.flatnonzero(drafts[j] - d2t == np.arange(len(d2t)))[0])
            assert logits[j, row] >= logits[j].max() - 1e-4, (head, tokens, j)


def test_dflash_sampling_runs_and_refusals(setup):
    target, draft, _ = setup
    assert_samples_in_chain_mode_only(target, draft, PROMPT)
    with pytest.raises(ValueError, match="block_size=5"):
        SpecDecoder(target, draft, num_spec_tokens=BLOCK)

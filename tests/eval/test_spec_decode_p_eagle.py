"""Speculative decoding with a P-EAGLE head (parallel drafting; specjax.drafts.eagle3_decoding.draft_parallel).

Bars: (1) every proposal is what the trained P-EAGLE forward predicts: depth 0 at the last accepted row
reads its token and the target's aux state, depth d >= 1 reads the mask token and fc(mask_hidden) at
position +d and attends to the prefix and its own earlier depths -- the proposed token's draft logit
is the maximum of an uncached forward of the training function (drafts.ttt / drafts.eagle3) at that
row, within 1e-4; (2) lossless: greedy speculative output equals the target's greedy output (fp32,
random one- and two-layer heads); (3) a P-EAGLE head refuses tree mode.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts.eagle3 import config_from_target, draft_logits, draft_step, init_draft_params, mask_hidden_projected, \
    project_aux
from specjax.eval.spec_decode import Draft, SpecDecoder

from eval._models import assert_samples_in_chain_mode_only, target_draft_and_reference

PROMPT = [5, 17, 3, 9, 11, 2, 40]
MAX_NEW = 13
MASK_ID = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    def make_draft(target, vocab):
        dcfg = config_from_target(target.config, draft_vocab_size=48, aux_layer_ids=target.default_aux_layer_ids(),
                                  parallel_drafting=True, mask_token_id=MASK_ID)
        return Draft(init_draft_params(dcfg, jax.random.key(0)), dcfg, vocab)

    return target_draft_and_reference(tmp_path_factory.mktemp("spec_pe"), make_draft, PROMPT, MAX_NEW + 8)


def _with_layers(draft, n):
    cfg = dataclasses.replace(draft.config, num_layers=n)
    return Draft(init_draft_params(cfg, jax.random.key(3), std=0.05), cfg, draft.vocab)


class Capture(SpecDecoder):
    def _override_chain(self, drafts, q, tokens, prompt):
        self.seen.append((list(tokens), [int(x) for x in np.asarray(drafts)]))
        return drafts, q


@pytest.mark.parametrize("num_layers", [1, 2])
def test_parallel_proposals_follow_the_training_forward(setup, num_layers):
    target, draft, _ = setup
    draft = draft if num_layers == 1 else _with_layers(draft, 2)
    cfg, p = draft.config, draft.params
    K = 4
    cap = Capture(target, draft, num_spec_tokens=K)
    cap.seen = []
    cap.generate(PROMPT, max_new_tokens=8)
    embed = target.embed_table(target.params)
    d2t = np.asarray(draft.vocab.d2t)
    T = len(PROMPT) + 8

    @jax.jit
    def depth_logits(x, aux, row):
        pos = jnp.arange(T)[None]
        h = project_aux(p, tuple(a[:, :T] for a in aux), cfg)
        mask_emb = jnp.broadcast_to(embed[MASK_ID], h.shape)
        mask_h = jnp.broadcast_to(mask_hidden_projected(p, cfg), h.shape)
        caches, out = [[] for _ in range(cfg.num_layers)], []
        for d in range(K):
            h, kvs = draft_step(p, cfg, embed[x[:, 1:T + 1]] if d == 0 else mask_emb, h if d == 0 else mask_h,
                                pos, None, caches)
            for c, kv in zip(caches, kvs):
                c.append(kv)
            out.append(draft_logits(p, cfg, h)[0, row])
        return jnp.stack(out)

    assert len(cap.seen) >= 2
    for tokens, drafts in cap.seen[:3]:
        seq = PROMPT + tokens
        row = len(seq) - 2  # the last accepted row: reads the newest token and the aux state before it
        x = jnp.asarray([seq + [0] * (T + 1 - len(seq))], jnp.int32)
        logits = np.asarray(depth_logits(x, target(x, aux_layer_ids=cfg.aux_layer_ids).aux_hidden, row))
        for j in range(K):
            row_d = int(np.flatnonzero(drafts[j] - d2t == np.arange(len(d2t)))[0])
            assert logits[j, row_d] >= logits[j].max() - 1e-4, (tokens, j)


@pytest.mark.parametrize("num_layers,k", [(1, 4), (2, 3)])
def test_lossless_p_eagle(setup, num_layers, k):
    target, draft, ref = setup
    draft = draft if num_layers == 1 else _with_layers(draft, num_layers)
    dec = SpecDecoder(target, draft, num_spec_tokens=k)
    res = dec.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == ref[:MAX_NEW]
    assert sum(res.accept_lengths) == MAX_NEW - 1 and len(res.accepted_per_position) == k
    eos = ref[7]
    assert dec.generate(PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[eos]).tokens == ref[: ref.index(eos)]


def test_p_eagle_sampling_runs_and_refuses_tree(setup):
    target, draft, _ = setup
    assert_samples_in_chain_mode_only(target, draft, PROMPT)

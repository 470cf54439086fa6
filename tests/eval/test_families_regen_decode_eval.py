"""Regeneration (the JAX back end) and decode_eval (backend jax) on the decoding families other than
Llama / Qwen3 (which tests/data/test_regenerate.py and tests/train cover): by default the DRIVER_FAMILIES
of tests/parity/test_decoding_families.py (mixed-window KV, Gated DeltaNet, Nemotron-H's Mamba states),
every family under `-m slow`; tiny random targets with the tiny tokenizer's vocab (320). CPU, fp32.

  regeneration: `JaxBackend.answer` on three chat prompts of different lengths (one batch of 2 and one
    of 1) gives, per prompt, the decoded text of the target's own greedy continuation computed by an
    uncached loop over the full forward (exact token equality, then the same decode).
  decode_eval: `JaxDecodeEval` with a random EAGLE-3 head runs MT-bench's first prompt (both turns)
    and reports tau in [1, 1 + K] with as many verification steps as the records hold.
"""
import os
import sys

import jax
import pytest
from transformers import AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))
import test_decoding_families as fam  # noqa: E402  (the family builders; the Nemotron-H file imports it so)
import test_decoding_nemotron_h as nemo  # noqa: E402

VOCAB = 320  # the tiny tokenizer's (tests/conftest.py tiny_target)
NEW = 6
FAMILIES = [*fam.FAMILIES, "nemotron_h"]


def _target(name):
    return nemo.build(vocab=VOCAB) if name == "nemotron_h" else fam.build(name, vocab=VOCAB)


@pytest.fixture(scope="module")
def tok(tiny_target):
    return AutoTokenizer.from_pretrained(tiny_target)


@pytest.mark.parametrize("name", fam.driver_family_params(FAMILIES))
def test_regeneration_answers_are_the_targets_greedy_text(name, tok):
    from specjax.regen.common import Item
    from specjax.regen.jax_backend import JaxBackend

    target = _target(name)
    backend = JaxBackend(target, tok, chat_template=None, eos_ids=[tok.eos_token_id], max_new_tokens=NEW,
                         temperature=0.0, top_p=1.0, max_prompt_tokens=200, batch_size=2, seed=0,
                         keep_reasoning=True)
    prompts = [({"role": "user", "content": "Name three colours."},),
               ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}),
               ({"role": "user", "content": "Hi"},)]
    answers = backend.answer([Item(i, p) for i, p in enumerate(prompts)])
    assert sum(a.content is not None for a in answers) >= 2  # text to compare, not only empty answers
    for p, ans in zip(prompts, answers):
        ids = backend.encode(p)
        want = fam.naive_greedy(target, ids, NEW)  # the uncached full forward, one padded shape
        if tok.eos_token_id in want:
            want = want[:want.index(tok.eos_token_id)]
        text = tok.decode(want, skip_special_tokens=True)
        if text.strip():
            assert ans.content == text.strip(), (name, ans.content, text)
            assert ans.new_tokens == len(want)
        else:
            assert ans.content is None and ans.skip_reason == "empty answer"


@pytest.mark.parametrize("name", fam.driver_family_params(FAMILIES))
def test_decode_eval_runs(name, tok, tiny_target):
    from specjax.config import load_config
    from specjax.drafts.eagle3 import config_from_target, init_draft_params
    from specjax.drafts.vocab import DraftVocab
    from specjax.train.decode_eval import JaxDecodeEval

    target = _target(name)
    cfg = load_config(None, [f"target.path={tiny_target}", "decode_eval.at_end=true", "decode_eval.limit=1",
                             "decode_eval.max_new_tokens=6", "decode_eval.num_spec_tokens=3"])
    dcfg = config_from_target(target.config, draft_vocab_size=VOCAB, aux_layer_ids=target.default_aux_layer_ids())
    params = init_draft_params(dcfg, jax.random.key(0))
    ev = JaxDecodeEval(cfg, target, tok, dcfg, DraftVocab.identity(VOCAB))
    flat, short = ev(params, step=0)
    s = short["mtbench"]
    assert s["n_prompts"] == 1 and s["steps"] > 0
    assert 1.0 <= s["tau"] <= 4.0 and len(s["accept"]) == 3
    assert any(k.startswith("decode_eval/") or "tau" in k for k in flat)

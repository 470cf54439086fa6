"""Continuous batching (specjax.eval.continuous) against references that share none of its code.

CPU, fp32, tiny random targets. Llama / Qwen3 (eval._models, weights scaled so greedy argmaxes are
not near-ties): transformers' own `generate`, one unpadded prompt at a time. The other decoding families
(tests/parity builders; DRIVER_FAMILIES of test_decoding_families.py by default, every family under
`-m slow`, and every family's cache axes): the greedy continuation by the target's uncached full
forward (`naive_greedy`, no KV or SSM cache). The bar is
exact token equality."""
import os
import sys

import numpy as np
import pytest

from specjax.eval.batching import cache_batch_axes, cache_slot_axes
from specjax.eval.continuous import ContinuousGenerator, Request
from specjax.targets.loading import load_target

from eval._models import build_target
from eval.test_generate import hf_greedy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))
import test_decoding_families as fam  # noqa: E402
import test_decoding_nemotron_h as nemo  # noqa: E402

PROMPTS = [[5, 17, 3], [9, 1, 2, 44, 60, 7, 8], list(range(10, 22)), [3] * 5 + list(range(30, 50)), [7],
           list(range(40, 49)), [11, 12]]


def _run(target, prompts, *, follow=None, **kw):
    """Answers by key; `follow(key, tokens)` may return follow-up requests."""
    got = {}

    def on_done(key, tokens):
        got[key] = tokens
        return follow(key, tokens) if follow else None

    gen = ContinuousGenerator(target, **kw)
    gen.run((Request(i, tuple(p), sample_id=i) for i, p in enumerate(prompts)), on_done)
    return got, gen


@pytest.fixture(scope="module", params=[("LlamaForCausalLM", False), ("Qwen3ForCausalLM", True)], ids=["llama", "qwen3"])
def model(request, tmp_path_factory):
    """(HF folder, the specjax target loaded from it)"""
    path = build_target(tmp_path_factory.mktemp("cont"), *request.param)
    return path, load_target(path, dtype="float32")


@pytest.fixture(scope="module")
def target(model):
    return model[1]


def test_greedy_equals_transformers(model):
    path, target = model
    want = hf_greedy(path, PROMPTS, 10)
    # 3 rows for 7 prompts, segments of 4 steps: rows are refilled mid-run, one at a time (min_refill 1)
    got, gen = _run(target, PROMPTS, batch_size=3, max_prompt_tokens=32, max_new_tokens=10, segment_steps=4,
                    min_refill=1)
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert gen.stats["answers"] == len(PROMPTS) and gen.stats["refills"] > 2
    # EOS ends a row early (cut before it) and frees the row; max_new_tokens 1 ends every row at refill
    eos = want[1][3]
    got, _ = _run(target, PROMPTS, batch_size=2, max_prompt_tokens=32, max_new_tokens=10, segment_steps=3,
                  eos_token_ids=[eos])
    assert [got[i] for i in range(len(PROMPTS))] == [w[: w.index(eos)] if eos in w else w for w in want]
    got, _ = _run(target, PROMPTS, batch_size=4, max_prompt_tokens=32, max_new_tokens=1)
    assert [got[i] for i in range(len(PROMPTS))] == [w[:1] for w in want]
    # a longer prompt limit pads refills to 128 tokens (its refill lengths are 128 and 256): same answers
    gen = ContinuousGenerator(target, batch_size=3, max_prompt_tokens=200, max_new_tokens=10)
    assert gen.refill_lengths == [128, 256]
    got, _ = _run(target, PROMPTS, batch_size=3, max_prompt_tokens=200, max_new_tokens=10, segment_steps=4)
    assert [got[i] for i in range(len(PROMPTS))] == want
    # a refill's cache is as long as its chunk (256 slots for a 128-token chunk) and fills the first
    # slots of a 512-slot row; a row that held a 280-token prompt keeps that prompt's K/V past slot
    # 256, which its next occupant never sees
    long_prompt = [(7 * i) % 50 + 1 for i in range(280)]
    mixed = [long_prompt, *PROMPTS[:3], long_prompt[:270], *PROMPTS[3:]]
    got, gen = _run(target, mixed, batch_size=2, max_prompt_tokens=300, max_new_tokens=10, segment_steps=4,
                    min_refill=1)
    assert gen.num_slots == 512 and gen.refill_lengths == [128, 512]
    assert [got[i] for i in range(len(mixed))] == hf_greedy(path, mixed, 10)


def test_follow_ups_and_priority(model):
    """A request's answer can queue the next one (a conversation's next turn): prompt + answer +
    more tokens; every follow-up is answered as transformers answers that prompt, and a lower
    priority value is served first."""
    path, target = model
    turns = {}

    def follow(key, tokens):
        i, turn = key
        turns[key] = tokens
        if turn < 2:
            nxt = list(prompts[i]) + tokens + [20 + turn]
            prompts_at[(i, turn + 1)] = nxt
            return [Request((i, turn + 1), tuple(nxt), priority=(0,))]
        return None

    prompts = PROMPTS[:4]
    prompts_at = {(i, 0): p for i, p in enumerate(prompts)}
    gen = ContinuousGenerator(target, batch_size=1, max_prompt_tokens=64, max_new_tokens=6, segment_steps=2)
    order = []
    gen.run((Request((i, 0), tuple(p), priority=(1,)) for i, p in enumerate(prompts)),
            lambda k, t: (order.append(k), follow(k, t))[1])
    assert len(turns) == 12
    keys = sorted(turns)
    assert [turns[k] for k in keys] == hf_greedy(path, [prompts_at[k] for k in keys], 6)
    # follow-ups (priority 0) go before waiting first turns (priority 1). A follow-up joins the queue
    # one refill late (the host prepares it while the next segment runs), so with one row conversation
    # 1's first turn comes before conversation 0's second, and then every later turn before (2, 0)
    assert order[:3] == [(0, 0), (1, 0), (0, 1)] and order.index((1, 2)) < order.index((2, 0))


def test_answers_reach_the_host_without_a_device_read(model, monkeypatch):
    """The answers of a segment are handed back while the next segment runs, from host copies made
    with the end-of-segment flags: a device read there would queue behind the running segment and
    serialise host and device (197 s of the 833 s H200 regeneration of 2026-12-03 went there). The
    hand-back gets numpy arrays, and any transfer inside it raises."""
    import jax

    path, target = model
    real = ContinuousGenerator._hand_back

    def guarded(self, finished, on_done, push):
        assert all(isinstance(out, np.ndarray) for out, _ in finished), "the hand-back got device arrays"
        with jax.transfer_guard("disallow"):
            return real(self, finished, on_done, push)

    monkeypatch.setattr(ContinuousGenerator, "_hand_back", guarded)
    got, gen = _run(target, PROMPTS, batch_size=3, max_prompt_tokens=32, max_new_tokens=10, segment_steps=4,
                    min_refill=1)
    assert [got[i] for i in range(len(PROMPTS))] == hf_greedy(path, PROMPTS, 10)
    assert gen.stats["answers"] == len(PROMPTS)


def test_sampling_does_not_depend_on_batching(target):
    kw = dict(max_prompt_tokens=32, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    a, _ = _run(target, PROMPTS, batch_size=2, segment_steps=3, **kw)
    b, _ = _run(target, PROMPTS, batch_size=8, segment_steps=5, **kw)
    assert a == b
    c, _ = _run(target, PROMPTS, batch_size=8, segment_steps=5, **{**kw, "seed": 4})
    assert c != a  # the seed matters
    # a nucleus that only holds the top token is greedy
    g, _ = _run(target, PROMPTS, batch_size=3, max_prompt_tokens=32, max_new_tokens=8)
    t, _ = _run(target, PROMPTS, batch_size=3, max_prompt_tokens=32, max_new_tokens=8, temperature=1.0, top_p=1e-6)
    assert g == t


def test_errors(target):
    gen = ContinuousGenerator(target, batch_size=2, max_prompt_tokens=8, max_new_tokens=4)
    with pytest.raises(ValueError, match="more than max_prompt_tokens"):
        gen.run([Request(0, tuple(range(9)))], lambda k, t: None)
    with pytest.raises(ValueError, match="outside the target vocab"):
        gen.run([Request(0, (10**6,))], lambda k, t: None)
    with pytest.raises(ValueError, match="empty prompt"):
        gen.run([Request(0, ())], lambda k, t: None)
    with pytest.raises(ValueError, match="must be >= 1"):
        ContinuousGenerator(target, batch_size=0, max_prompt_tokens=8, max_new_tokens=4)


GATED_DELTA_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear")  # Kimi Linear: KDA, the same state window


@pytest.mark.parametrize("name", [*fam.FAMILIES, "nemotron_h"])
def test_every_family_has_cache_batch_and_slot_axes(name):
    """Each family's cache leaves name their batch axis (0 or 1: Nemotron-H's differs) and their slot axis
    (right after the batch axis; none for fixed-size leaves), which continuous batching refills along."""
    if name == "nemotron_h":
        nemotron = nemo.build(vocab=128)
        cls, cfg = type(nemotron), nemotron.config
    else:
        cls, cfg = fam.FAMILIES[name]()  # the class and config, no parameters
    axes = cache_batch_axes(cls, cfg, np.float32)
    assert set(jax_leaves(axes)) <= {0, 1}
    slots = cache_slot_axes(cls, cfg, np.float32)
    # slots right after the batch axis; fixed-size leaves (Nemotron-H's SSM states and labels) have none
    assert all(sx in (-1, ax + 1) for ax, sx in zip(jax_leaves(axes), jax_leaves(slots)))
    if name == "nemotron_h":
        assert {k for k, sx in slots.items() if sx >= 0} == {"conv", "k", "v"}
    elif name in GATED_DELTA_FAMILIES:  # conv windows and delta states are fixed-size, labelled by state_slot
        assert {k for k, sx in slots.items() if sx < 0} == {"conv", "delta", "state_slot"}
        assert {sx for sx in slots.values() if sx >= 0} == {2}  # the attention layers' K/V (or MLA latent)
    else:
        assert set(jax_leaves(slots)) == {2}


@pytest.mark.parametrize("name", fam.driver_family_params([*fam.FAMILIES, "nemotron_h"]))
def test_every_family_equals_uncached_greedy(name):
    """Each family's cache (KV per virtual layer, Nemotron-H's conv / SSM states and slot labels,
    whose batch axis differs) is refilled row by row and still decodes as the uncached forward does."""
    target = nemo.build(vocab=128) if name == "nemotron_h" else fam.build(name, vocab=128)
    prompts = [[p % 128 for p in q] for q in PROMPTS[:5]]
    want = [fam.naive_greedy(target, p, 5) for p in prompts]
    got, _ = _run(target, prompts, batch_size=2, max_prompt_tokens=32, max_new_tokens=5, segment_steps=2,
                  min_refill=1)
    assert [got[i] for i in range(len(prompts))] == want
    # rows of 512 slots refilled from 256-slot chunk caches after a 280-token prompt filled them: the
    # stale K/V (and Nemotron-H's stale conv inputs) past slot 256 stay hidden
    long_prompt = [(7 * i) % 127 + 1 for i in range(280)]
    mixed = [long_prompt, *prompts[:2], long_prompt[:270], *prompts[2:]]
    got, gen = _run(target, mixed, batch_size=2, max_prompt_tokens=300, max_new_tokens=5, segment_steps=2,
                    min_refill=1)
    assert gen.refill_lengths == [128, 512]
    assert [got[i] for i in range(len(mixed))] == [fam.naive_greedy(target, p, 5) for p in mixed]


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)

"""Speculative decoding as one device program (specjax.eval.spec_loop.SpecLoop).

Bar: every row of a batched device-loop generation equals `SpecDecoder.generate` (the host-driven
decoder, itself tested lossless in test_spec_decode*.py) on that prompt alone: the same tokens,
accept lengths, per-position accepted counts and step count, exactly (CPU, fp32), for EAGLE-3
chain and tree, P-EAGLE and DFlash heads, greedy and sampled (same seeds, so the same draws), with
ragged prompts, an EOS, and max_new_tokens limits; and greedy rows equal the target's own greedy
output. The target has a 6-token vocabulary so that random heads get drafts accepted at every
position (the counts are checked to be non-zero: a comparison of all-rejected runs would not test
the acceptance path)."""
import jax
import numpy as np
import pytest

from specjax.drafts import dflash
from specjax.drafts.eagle3 import config_from_target, init_draft_params
from specjax.drafts.vocab import DraftVocab
from specjax.eval.generate import generate
from specjax.eval.spec_decode import Draft, SpecDecoder
from specjax.eval.spec_loop import SpecLoop
from specjax.targets.loading import load_target

from eval._models import build_target

V = 6
PROMPTS = [[1, 2, 3], [4, 0, 2, 5, 1, 3, 3, 0, 2], [5], [3] * 17]
EOS = [4]
MAX_NEW = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(build_target(tmp_path_factory.mktemp("loop"), "LlamaForCausalLM", False, seed=1,
                                    vocab_size=V), dtype="float32")


def _head(target, kind):
    tc = target.config
    if kind == "dflash":
        cfg = dflash.config_from_target(tc, draft_vocab_size=V, mask_token_id=0, num_layers=1, block_size=4,
                                        aux_layer_ids=(0, 2))
        return Draft(dflash.init_draft_params(cfg, jax.random.key(0), std=0.1), cfg, DraftVocab.identity(V))
    extra = dict(parallel_drafting=True, mask_token_id=0) if kind == "p_eagle" else {}
    cfg = config_from_target(tc, draft_vocab_size=4, aux_layer_ids=target.default_aux_layer_ids(), **extra)
    # a reduced draft vocab (ids 0, 2, 3, 5): the d2t mapping is on the path
    return Draft(init_draft_params(cfg, jax.random.key(0)), cfg, DraftVocab.from_ids(np.array([0, 2, 3, 5]), V))


def _same(got, ref):
    assert got.tokens == ref.tokens
    assert got.accept_lengths == ref.accept_lengths
    assert got.accepted_per_position == ref.accepted_per_position
    assert got.num_steps == ref.num_steps


@pytest.mark.parametrize("kind,mode,k", [("eagle3", "chain", 3), ("eagle3", "tree", 3), ("p_eagle", "chain", 3),
                                         ("dflash", "chain", 3)])
def test_loop_equals_host_decoder_greedy(target, kind, mode, k):
    dec = SpecDecoder(target, _head(target, kind), num_spec_tokens=k, mode=mode)
    got = SpecLoop(dec).generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=EOS)
    naive = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=EOS)
    accepted = 0
    for row, prompt, want in zip(got, PROMPTS, naive):
        _same(row, dec.generate(prompt, max_new_tokens=MAX_NEW, eos_token_ids=EOS))
        assert row.tokens == want  # lossless
        accepted += sum(row.accepted_per_position)
    assert accepted > 0


def test_reranked_tree_loop_equals_host_decoder(target):
    """EAGLE-2's re-ranking (tree_total_tokens): the target verifies the 5 best of the 2 + 4 + 4 expanded
    nodes; lossless, the device loop equal to the host decoder row by row, and a verification call of 6."""
    dec = SpecDecoder(target, _head(target, "eagle3"), num_spec_tokens=3, mode="tree", tree_total_tokens=5)
    assert dec.widths == (2, 4, 4) and dec.verify_len == 6
    got = SpecLoop(dec).generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=EOS)
    naive = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=EOS)
    for row, prompt, want in zip(got, PROMPTS, naive):
        _same(row, dec.generate(prompt, max_new_tokens=MAX_NEW, eos_token_ids=EOS))
        assert row.tokens == want
    assert sum(sum(row.accepted_per_position) for row in got) > 0
    for bad, match in (({"mode": "chain", "tree_total_tokens": 4}, "use it with mode='tree'"),
                       ({"mode": "tree", "tree_total_tokens": 11}, r"must be in \[1, 10\]")):
        with pytest.raises(ValueError, match=match):
            SpecDecoder(target, _head(target, "eagle3"), num_spec_tokens=3, **bad)


# P-EAGLE's sampled step is the greedy test's step with the sampler of the other two: -m slow (is_slow_case)
@pytest.mark.parametrize("kind", ["eagle3", "p_eagle", "dflash"])
def test_loop_equals_host_decoder_sampled(target, kind):
    dec = SpecDecoder(target, _head(target, kind), num_spec_tokens=3)
    got = SpecLoop(dec).generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=1.0, eos_token_ids=EOS, seed=5)
    for r, (row, prompt) in enumerate(zip(got, PROMPTS)):
        _same(row, dec.generate(prompt, max_new_tokens=MAX_NEW, temperature=1.0, eos_token_ids=EOS, seed=5 + r))
    assert sum(sum(row.accepted_per_position) for row in got) > 0


def test_loop_limits_eos_and_batching(target):
    dec = SpecDecoder(target, _head(target, "eagle3"), num_spec_tokens=3)
    loop = SpecLoop(dec)
    first = generate(target, [PROMPTS[0]], max_new_tokens=1)[0][0]
    for max_new, eos in ((1, []), (2, []), (5, EOS), (MAX_NEW, [first])):  # the last: the first token is an EOS
        got = loop.generate(PROMPTS, max_new_tokens=max_new, eos_token_ids=eos)
        for row, prompt in zip(got, PROMPTS):
            _same(row, dec.generate(prompt, max_new_tokens=max_new, eos_token_ids=eos))
            assert len(row.tokens) <= max_new
    assert loop.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=[first])[0].tokens == []
    # rows in batches of 3 (the last padded) equal the rows of one batch of 4
    whole = loop.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=EOS)
    split = loop.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=EOS, batch_size=3)
    for a, b in zip(whole, split):
        _same(a, b)
    assert [r.tokens for r in loop.generate(PROMPTS, max_new_tokens=0)] == [[]] * len(PROMPTS)
    with pytest.raises(ValueError, match="tree mode verifies greedily"):
        SpecLoop(SpecDecoder(target, _head(target, "eagle3"), mode="tree")).generate(PROMPTS, max_new_tokens=4,
                                                                                    temperature=1.0)
    with pytest.raises(ValueError, match="outside the target vocab"):
        loop.generate([[V]], max_new_tokens=4)


# the stream's hand-back and refill are the same for every drafter; tree mode and P-EAGLE change only the
# step, which test_loop_equals_host_decoder_greedy covers (CI time)
@pytest.mark.parametrize("kind,mode,slots", [("eagle3", "chain", 2), ("dflash", "chain", 1)])
def test_refill_stream_equals_host_decoder(target, kind, mode, slots):
    """refill=True: every prompt through `slots` rows of one device program, a row taking the next prompt
    as soon as its request stops. Each result equals SpecDecoder.generate on its prompt alone (tokens,
    accept lengths, per-position counts, steps) and the target's own greedy output, with requests that stop
    early (EOS) and at the length limit, and more prompts than rows."""
    dec = SpecDecoder(target, _head(target, kind), num_spec_tokens=3, mode=mode)
    prompts = PROMPTS + [[2, 4], [0, 5, 5, 1], [3, 1]]  # more requests than rows, short ones among them
    got = SpecLoop(dec).generate(prompts, max_new_tokens=MAX_NEW, eos_token_ids=EOS, batch_size=slots, refill=True)
    naive = generate(target, prompts, max_new_tokens=MAX_NEW, eos_token_ids=EOS)  # the target's own greedy
    assert len(got) == len(prompts)
    for row, prompt, want in zip(got, prompts, naive):
        _same(row, dec.generate(prompt, max_new_tokens=MAX_NEW, eos_token_ids=EOS))
        assert row.tokens == want  # lossless
    lengths = [len(row.tokens) for row in got]
    assert min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, lengths  # rows stop at different steps
    assert sum(sum(row.accepted_per_position) for row in got) > 0


def test_refill_stream_sampled_and_first_token_eos(target):
    """Sampled rows draw with their own seed (seed + index), whatever row they run in; a request whose
    first token is an EOS (or max_new_tokens 1) is handed back right after its refill."""
    dec = SpecDecoder(target, _head(target, "eagle3"), num_spec_tokens=3)
    got = SpecLoop(dec).generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=1.0, eos_token_ids=EOS, seed=5,
                                 batch_size=2, refill=True)
    for r, (row, prompt) in enumerate(zip(got, PROMPTS)):
        _same(row, dec.generate(prompt, max_new_tokens=MAX_NEW, temperature=1.0, eos_token_ids=EOS, seed=5 + r))
    first = generate(target, PROMPTS, max_new_tokens=1)
    eos_now = [[t[0]] for t in first]  # each prompt's own first token as its EOS: every request stops at once
    for eos in eos_now[:2]:
        got = SpecLoop(dec).generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=eos, batch_size=2, refill=True)
        for row, prompt in zip(got, PROMPTS):
            _same(row, dec.generate(prompt, max_new_tokens=MAX_NEW, eos_token_ids=eos))
    got = SpecLoop(dec).generate(PROMPTS, max_new_tokens=1, batch_size=3, refill=True)
    assert [len(r.tokens) for r in got] == [1] * len(PROMPTS)


# bf16 changes the draft's dtype, not the step: the default run keeps a static tree batch and a refill
# stream; the chain and P-EAGLE static batches run under -m slow (is_slow_case)
@pytest.mark.parametrize("kind,mode,refill", [("eagle3", "chain", False), ("eagle3", "tree", False),
                                              ("p_eagle", "chain", False), ("eagle3", "chain", True)])
def test_bf16_draft_stays_lossless(target, kind, mode, refill):
    """draft_dtype="bfloat16" (the draft computing as a serving engine runs it beside a bf16 target):
    the loop (static batches and refill) still equals the host decoder and the fp32 target's own greedy
    output, the draft params, its cache and its hidden states are bf16, and its logits are fp32."""
    import jax.numpy as jnp

    from specjax.drafts.eagle3 import draft_logits
    from specjax.drafts.eagle3_decoding import draft_prefill, init_draft_cache

    dec = SpecDecoder(target, _head(target, kind), num_spec_tokens=3, mode=mode, draft_dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(dec.draft_params)} == {jnp.dtype(jnp.bfloat16)}
    got = SpecLoop(dec).generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=EOS, batch_size=2, refill=refill)
    naive = generate(target, PROMPTS, max_new_tokens=MAX_NEW, eos_token_ids=EOS)
    for row, prompt, want in zip(got, PROMPTS, naive):
        _same(row, dec.generate(prompt, max_new_tokens=MAX_NEW, eos_token_ids=EOS))
        assert row.tokens == want
    assert sum(sum(row.accepted_per_position) for row in got) > 0
    dcfg = dec.draft.config
    dcache = init_draft_cache(dcfg, 16, jnp.bfloat16)
    aux = tuple(jnp.ones((1, 4, target.config.hidden_size), jnp.float32) for _ in dcfg.aux_layer_ids)
    h, dcache = draft_prefill(dec.draft_params, dcfg, dec.embed, dcache, jnp.asarray([[1, 2, 3, 0]]), aux,
                               jnp.int32(3), jnp.int32(0))
    assert h.dtype == jnp.bfloat16 and dcache["k"].dtype == jnp.bfloat16
    logits = draft_logits(dec.draft_params, dcfg, h)
    assert logits.dtype == jnp.float32
    # the same math as the fp32 draft (the one tested against SpecForge / speculators): hidden state and
    # logits within bf16 rounding (8 mantissa bits: 2e-2 of the fp32 values' scale)
    dec32 = SpecDecoder(target, _head(target, kind), num_spec_tokens=3, mode=mode)
    h32, _ = draft_prefill(dec32.draft_params, dcfg, dec32.embed, init_draft_cache(dcfg, 16), jnp.asarray([[1, 2, 3, 0]]),
                           aux, jnp.int32(3), jnp.int32(0))
    logits32 = draft_logits(dec32.draft_params, dcfg, h32)
    for got, want in ((h, h32), (logits, logits32)):
        scale = float(jnp.abs(want).max())
        assert float(jnp.abs(got.astype(jnp.float32) - want).max()) <= 2e-2 * scale, (scale,)


def is_slow_case(test_name: str, params: dict) -> bool:
    """tests/conftest.py marks these cases slow (a faster case of the same code stays in the default run)."""
    if test_name == "test_bf16_draft_stays_lossless":
        return not params["refill"] and (params["kind"], params["mode"]) != ("eagle3", "tree")
    return test_name == "test_loop_equals_host_decoder_sampled" and params["kind"] == "p_eagle"


def test_auto_draft_dtype_follows_the_target(target):
    """draft_dtype="auto" (the default): bf16 for a bf16 target's EAGLE-3 or P-EAGLE head, float32 for an
    fp32 target's and for a DFlash head (which drafts in float32 here)."""
    import jax.numpy as jnp

    bf16 = type(target)(target.config, target.hf_config,
                        jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), target.params))
    assert bf16.embed_table(bf16.params).dtype == jnp.bfloat16
    dec = SpecDecoder(target, _head(target, "eagle3"), num_spec_tokens=3)
    assert dec.draft_dtype == "float32"
    assert {x.dtype for x in jax.tree.leaves(dec.draft_params)} == {jnp.dtype(jnp.float32)}
    for kind in ("eagle3", "p_eagle"):
        dec = SpecDecoder(bf16, _head(bf16, kind), num_spec_tokens=3)
        assert dec.draft_dtype == "bfloat16"
        assert {x.dtype for x in jax.tree.leaves(dec.draft_params)} == {jnp.dtype(jnp.bfloat16)}
    assert SpecDecoder(bf16, _head(bf16, "dflash"), num_spec_tokens=3).draft_dtype == "float32"


def test_draft_dtype_is_checked(target):
    with pytest.raises(ValueError, match="draft_dtype must be one of"):
        SpecDecoder(target, _head(target, "eagle3"), draft_dtype="float16")
    with pytest.raises(ValueError, match="DFlash head drafts in float32"):
        SpecDecoder(target, _head(target, "dflash"), num_spec_tokens=3, draft_dtype="bfloat16")

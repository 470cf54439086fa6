"""Batched KV-cache generation (specjax.eval.generate) against transformers' own generate.

Tiny random Llama / Qwen3 targets are built locally in fp32; weights are scaled up (x8) so the
logits are peaked and greedy argmaxes are not near-ties (exact token equality is the bar)."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.eval.batching import prompt_bucket
from specjax.eval.generate import generate
from specjax.targets.base import Target
from specjax.targets.loading import load_target

from eval._models import VOCAB, build_target

PROMPTS = [[5, 17, 3], [9, 1, 2, 44, 60, 7, 8], list(range(10, 22)), [3] * 5 + list(range(30, 50))]


@pytest.fixture(scope="module", params=[("LlamaForCausalLM", False), ("Qwen3ForCausalLM", True)], ids=["llama", "qwen3"])
def model_dir(request, tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("gen"), *request.param)


def hf_greedy(path, prompts, max_new):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:  # unpadded, one prompt at a time: the reference is free of padding effects
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             min_new_tokens=max_new, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


def test_greedy_equals_transformers(model_dir):
    target = load_target(model_dir, dtype="float32")
    ref = hf_greedy(model_dir, PROMPTS, 12)
    # batch_size 3: two batches (the second padded with a dummy row), prompts of 3..25 tokens
    got = generate(target, PROMPTS, max_new_tokens=12, batch_size=3)
    assert got == ref
    # EOS: cut before the first EOS per row (EOS itself dropped); other rows unaffected
    eos = ref[1][4]
    cut = [r[: r.index(eos)] if eos in r else r for r in ref]
    got_eos = generate(target, PROMPTS, max_new_tokens=12, eos_token_ids=[eos], batch_size=4)
    assert got_eos == cut
    # max_new_tokens edge cases
    assert generate(target, PROMPTS[:2], max_new_tokens=1) == [r[:1] for r in ref[:2]]
    assert generate(target, PROMPTS[:2], max_new_tokens=0) == [[], []]


def test_sampling(model_dir):
    target = load_target(model_dir, dtype="float32")
    greedy = generate(target, PROMPTS, max_new_tokens=10)
    # a nucleus that only ever holds the top token is greedy decoding
    assert generate(target, PROMPTS, max_new_tokens=10, temperature=1.0, top_p=1e-6) == greedy
    a = generate(target, PROMPTS, max_new_tokens=10, temperature=1.5, seed=1)
    b = generate(target, PROMPTS, max_new_tokens=10, temperature=1.5, seed=1)
    c = generate(target, PROMPTS, max_new_tokens=10, temperature=1.5, seed=2)
    assert a == b  # seeded
    assert a != c and a != greedy  # P(equal by chance) is negligible at temperature 1.5
    assert all(len(r) == 10 and all(0 <= t < VOCAB for t in r) for r in a)


def test_decode_chunk_matches_full_forward(tmp_path):
    # A prefill split into two chunks, with stale garbage left past the valid length, must give
    # the uncached forward's logits and aux states (1e-5 relative, fp32).
    path = build_target(tmp_path, "Qwen3ForCausalLM", False, seed=3)
    target = load_target(path, dtype="float32")
    ids = jnp.asarray(np.random.RandomState(0).randint(0, VOCAB, (2, 11)), jnp.int32)
    full = target(ids, aux_layer_ids=(0, 2))
    cache = target.init_cache(2, 40)
    assert cache["k"].shape == (4, 2, 256, 2, 16)
    pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
    decode = jax.jit(lambda c, i, p, s: target.decode_chunk(target.params, c, i, p, s, aux_layer_ids=(0, 2)))
    # write a wrong 8-token chunk first, then roll back to 0 and prefill 7 + 4 tokens
    _, _, _, cache = decode(cache, ids[:, ::-1][:, :8], pos[:, :8], jnp.zeros(2, jnp.int32))
    l1, a1, f1, cache = decode(cache, ids[:, :7], pos[:, :7], jnp.zeros(2, jnp.int32))
    l2, a2, f2, cache = decode(cache, ids[:, 7:], pos[:, 7:], jnp.full(2, 7, jnp.int32))
    np.testing.assert_allclose(np.concatenate([l1, l2], 1), full.logits, rtol=1e-5, atol=1e-5)
    for k in range(2):
        np.testing.assert_allclose(np.concatenate([a1[k], a2[k]], 1), full.aux_hidden[k], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([f1, f2], 1), full.final_hidden, rtol=1e-5, atol=1e-5)


def test_errors(model_dir):
    target = load_target(model_dir, dtype="float32")
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(target, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"token id 500 outside the target vocab \[0, 96\)"):
        generate(target, [[1, 500]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        generate(target, [[1]], max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(target, [[1]], max_new_tokens=2, temperature=-1.0)
    other = Target(types.SimpleNamespace(architecture="NemotronHForCausalLM", num_hidden_layers=4), {}, {})
    with pytest.raises(NotImplementedError, match=r"supports .*LlamaForCausalLM.*Qwen3ForCausalLM.*Qwen3MoeForCausalLM.*; got NemotronH"):
        generate(other, [[1]], max_new_tokens=2)
    assert [prompt_bucket(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, 128]


def test_refill_equals_static_batches(tmp_path):
    """generate(..., refill=True): every prompt through `batch_size` rows of one device program, each row
    refilled as soon as its answer ends. On a 6-token vocab (EOS ids 4 and 1 end many answers early, some
    on their first token) the answers equal the static batches' for 1, 2 and 3 rows and for every
    max_new_tokens edge, and HF transformers' greedy continuation (one prompt at a time, cut at the first
    EOS); sampling is refused."""
    from specjax.eval.batching import cut_at_eos

    path = build_target(tmp_path, "LlamaForCausalLM", False, seed=1, vocab_size=6)
    target = load_target(path, dtype="float32")
    prompts = [[1, 2, 3], [4, 0, 2, 5, 1, 3, 3, 0, 2], [5], [3] * 17, [0, 0], [2, 5, 5, 1], [1], [3, 2]]
    hf = hf_greedy(path, prompts, 24)
    for eos in ([4], [4, 1]):
        for max_new in (1, 2, 24):
            want = generate(target, prompts, max_new_tokens=max_new, eos_token_ids=eos, batch_size=8)
            assert want == [cut_at_eos(h[:max_new], eos) for h in hf], (eos, max_new)
            for slots in (1, 2, 3):
                got = generate(target, prompts, max_new_tokens=max_new, eos_token_ids=eos, batch_size=slots,
                               refill=True)
                assert got == want, (eos, max_new, slots)
    want = generate(target, prompts, max_new_tokens=24, eos_token_ids=[4, 1], batch_size=8)
    lengths = [len(w) for w in want]
    assert 0 in lengths and 24 in lengths and any(0 < n < 24 for n in lengths), lengths  # every kind of stop
    with pytest.raises(ValueError, match="refill=True decodes greedily"):
        generate(target, prompts, max_new_tokens=4, temperature=1.0, refill=True)

"""Tiny random Llama / Qwen3 targets for the eval tests (fp32, weights x8 so logits are peaked), and
what the spec-decode tests share: their target/draft/reference fixture and the chain-only check."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts.vocab import DraftVocab
from specjax.eval.generate import generate
from specjax.eval.spec_decode import SpecDecoder
from specjax.targets import llama
from specjax.targets.loading import load_target

VOCAB = 96


def peak_weights_(params, cfg, seed):
    """In place, every weight of a Llama/Qwen3 params tree far from init_params' std 0.02 (so
    attention is far from uniform): matrices x8, norm scales redrawn as 1 + 0.2 N(0, 1) (numpy
    RandomState(seed)), fp32."""
    rng = np.random.RandomState(seed)
    for spec in llama.weight_specs(cfg):
        leaf = llama.tree_get(params, spec.path)
        new = 1.0 + 0.2 * rng.randn(*leaf.shape) if spec.path[-1] == "scale" else 8.0 * np.asarray(leaf)
        llama.tree_set(params, spec.path, jnp.asarray(new, jnp.float32))


def build_target(tmp_path, arch, tied, seed=0, vocab_size=VOCAB):
    cfg = llama.LlamaTargetConfig.create(
        architecture=arch, vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16 if arch.startswith("Qwen3") else None,
        tie_word_embeddings=tied, rope_theta=1000.0,
    )
    params = llama.init_params(cfg, jax.random.key(seed))
    peak_weights_(params, cfg, seed)
    path = str(tmp_path / f"{arch}_{tied}_{vocab_size}")
    llama.save_hf_checkpoint(params, cfg, path)
    return path


def target_draft_and_reference(folder, make_draft, prompt, max_new_tokens):
    """The spec-decode tests' module fixture: the tiny Llama target (seed 1) loaded fp32, the draft
    `make_draft(target, vocab)` builds over the even token ids, and the target's greedy continuation
    of `prompt` (max_new_tokens long: longer than the tests decode, so an oracle can look ahead)."""
    target = load_target(build_target(folder, "LlamaForCausalLM", False, seed=1), dtype="float32")
    V = target.config.vocab_size
    draft = make_draft(target, DraftVocab.from_ids(np.arange(0, V, 2), V))
    ref = generate(target, [prompt], max_new_tokens=max_new_tokens)[0]
    return target, draft, ref


def assert_samples_in_chain_mode_only(target, draft, prompt):
    """A chain-only draft (P-EAGLE, DFlash): sampled speculative decoding (temperature 0.8) runs and
    gives in-vocabulary tokens, and tree mode is refused with an error naming mode='chain'."""
    res = SpecDecoder(target, draft, num_spec_tokens=3).generate(prompt, max_new_tokens=6, temperature=0.8, seed=1)
    assert len(res.tokens) <= 6 and all(0 <= t < target.config.vocab_size for t in res.tokens)
    with pytest.raises(ValueError, match="mode='chain'"):
        SpecDecoder(target, draft, num_spec_tokens=3, mode="tree")

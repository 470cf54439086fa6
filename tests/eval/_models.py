"""Tiny random Llama / Qwen3 targets for the eval tests (fp32, weights x8 so logits are peaked)."""
import jax
import jax.numpy as jnp
import numpy as np

from specjax.targets import llama

VOCAB = 96


def build_target(tmp_path, arch, tied, seed=0, vocab_size=VOCAB):
    cfg = llama.LlamaTargetConfig.create(
        architecture=arch, vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16 if arch.startswith("Qwen3") else None,
        tie_word_embeddings=tied, rope_theta=1000.0,
    )
    params = llama.init_params(cfg, jax.random.key(seed))
    rng = np.random.RandomState(seed)
    for spec in llama.weight_specs(cfg):
        leaf = llama.tree_get(params, spec.path)
        new = 1.0 + 0.2 * rng.randn(*leaf.shape) if spec.path[-1] == "scale" else 8.0 * np.asarray(leaf)
        llama.tree_set(params, spec.path, jnp.asarray(new, jnp.float32))
    path = str(tmp_path / f"{arch}_{tied}_{vocab_size}")
    llama.save_hf_checkpoint(params, cfg, path)
    return path

"""Switching kernel implementations does not change training (issue "Kernels", item 7), on CPU.

A tiny EAGLE-3 draft trains for a few SGD steps on random target states through the public
`specjax.drafts.ttt.ttt_loss` (K = 4 TTT steps, GQA, two packed documents plus padding). The loss
curve and the final parameters with ttt_attention/soft_ce = xla (the CPU default) must equal the
reference implementations' to f32 rounding: rtol 1e-4 on the losses (measured ~1e-6), 1e-4 absolute
on the parameters. A wrong mask or gradient in a kernel moves the curve by far more than that.
The Pallas kernels (interpret mode, slow) take one step with K = 2 against the same reference."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig, ttt_loss
from specjax.layers.rope import RopeSpec

H, V, VD, T = 32, 97, 40, 24
CFG = eagle3.Eagle3Config(hidden_size=H, target_hidden_size=H, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=V, draft_vocab_size=VD,
                          aux_layer_ids=(0, 1, 2), rope=RopeSpec("default", 10000.0))


def _batch(seed=0):
    ks = jax.random.split(jax.random.key(seed), 10)
    draft_ids = jnp.asarray(np.sort(np.random.default_rng(seed).choice(V, VD, replace=False)), jnp.int32)
    seg = jnp.asarray([[1] * 11 + [2] * 9 + [0] * 4, [1] * 24], jnp.int32)
    pos = jnp.asarray([list(range(11)) + list(range(9)) + list(range(4)), list(range(24))], jnp.int32)
    return dict(
        input_ids=jax.random.randint(ks[0], (2, T), 0, V),
        loss_mask=(jax.random.uniform(ks[1], (2, T)) > 0.2).astype(jnp.int32) * (seg > 0),
        segment_ids=seg, positions=pos,
        aux_hidden=tuple(jax.random.normal(ks[2 + i], (2, T, H)) for i in range(3)),
        final_hidden=3 * jax.random.normal(ks[5], (2, T, H)),
        embed_table=jax.random.normal(ks[6], (V, H)), lm_head=jax.random.normal(ks[7], (V, H)),
        draft_ids=draft_ids, t2d=jnp.zeros((V,), bool).at[draft_ids].set(True), d2t=draft_ids - jnp.arange(VD))


@functools.lru_cache(maxsize=None)
def _train(attn, ce, steps, K=4, lr=0.5):
    params = eagle3.init_draft_params(CFG, jax.random.key(1), std=0.2)
    batch = _batch()
    ttt = TTTConfig(ttt_steps=K, vocab_chunk=16, attention_impl=attn, soft_ce_impl=ce)

    @jax.jit
    def step(p):
        (loss, m), g = jax.value_and_grad(lambda p: ttt_loss(p, CFG, ttt, **batch), has_aux=True)(p)
        return jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g), loss, m["acc_k"]

    losses, accs = [], []
    for _ in range(steps):
        params, loss, acc = step(params)
        losses.append(float(loss))
        accs.append(np.asarray(acc))
    return np.asarray(losses), np.asarray(accs), params


def _close_params(a, b, atol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def test_loss_curve_unchanged_xla_vs_reference():
    ref_l, ref_a, ref_p = _train("reference", "reference", steps=6)
    assert ref_l[-1] < ref_l[0]  # it trains: the comparison is over a moving curve
    l, a, p = _train("xla", "xla", steps=6)  # xla is also what auto picks on CPU
    np.testing.assert_allclose(l, ref_l, rtol=1e-4)
    np.testing.assert_array_equal(a, ref_a)
    _close_params(p, ref_p, atol=1e-4)


@pytest.mark.parametrize("attn", ["pallas_tpu", "pallas_gpu"])
def test_one_step_with_pallas_interpret(attn):
    ref_l, _, ref_p = _train("reference", "reference", steps=1, K=2)
    l, _, p = _train(attn, "xla", steps=1, K=2)
    np.testing.assert_allclose(l, ref_l, rtol=1e-4)
    _close_params(p, ref_p, atol=1e-4)

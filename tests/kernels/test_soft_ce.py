"""Soft cross-entropy reference vs the textbook formula, and its gradient softmax(d) - p."""
import jax
import jax.numpy as jnp
import numpy as np

from specjax_kernels.soft_ce import soft_cross_entropy


def test_matches_formula_and_grad():
    kd, kt = jax.random.split(jax.random.key(0))
    d = 3 * jax.random.normal(kd, (5, 7, 33))
    t = 3 * jax.random.normal(kt, (5, 7, 33))
    loss = soft_cross_entropy(d, t, implementation="reference")
    p = np.exp(np.asarray(t, np.float64))
    p /= p.sum(-1, keepdims=True)
    logq = np.asarray(d, np.float64) - np.log(np.exp(np.asarray(d, np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(loss, -(p * logq).sum(-1), rtol=1e-5)
    g = jax.grad(lambda d: soft_cross_entropy(d, t).sum())(d)
    np.testing.assert_allclose(g, jax.nn.softmax(d, -1) - p, atol=1e-5)
    # the teacher gets no gradient
    gt = jax.grad(lambda t: soft_cross_entropy(d, t).sum())(t)
    assert float(jnp.abs(gt).max()) == 0.0


def test_bf16_inputs_accumulate_in_fp32():
    d = jax.random.normal(jax.random.key(1), (4, 1000)).astype(jnp.bfloat16)
    t = jax.random.normal(jax.random.key(2), (4, 1000)).astype(jnp.bfloat16)
    loss = soft_cross_entropy(d, t)
    assert loss.dtype == jnp.float32
    ref = soft_cross_entropy(d.astype(jnp.float32), t.astype(jnp.float32))
    np.testing.assert_allclose(loss, ref, rtol=1e-6)

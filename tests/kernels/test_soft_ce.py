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


# ---- vocab-tiled `xla` paths: the logits API and the fused linear + soft-CE ----
# f32 inputs: tiled and dense sums differ by rounding only (measured ~1e-6); tolerances 2e-5.
import pytest  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

from specjax_kernels.soft_ce import fused_linear_soft_ce  # noqa: E402

N, H, V, HT = 2 * 9, 16, 300, 12  # V = 300 is not a multiple of the 64-wide tiles used below


def _world(seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    return dict(h=jax.random.normal(ks[0], (2, 9, H)), w=0.5 * jax.random.normal(ks[1], (V, H)),
                tl=3 * jax.random.normal(ks[2], (2, 9, V)), th=jax.random.normal(ks[3], (2, 9, HT)),
                tw=jax.random.normal(ks[4], (V, HT)), mask=(jax.random.uniform(ks[5], (2, 9)) > 0.3) * 1.0)


def _teacher(wd, kind):
    return dict(teacher_logits=wd["tl"]) if kind == "logits" else dict(teacher_hidden=wd["th"], teacher_head=wd["tw"])


@pytest.mark.parametrize("kind", ["logits", "hidden"])
def test_fused_xla_matches_reference(kind):
    wd = _world()
    wd["w"] = wd["w"].at[77].set(wd["w"][13])  # an exact tie in every row: the lower index must win

    def run(impl):
        def f(h, w):
            loss, amax = fused_linear_soft_ce(h, w, mask=wd["mask"], return_argmax=True, implementation=impl,
                                              vocab_block=64, **_teacher(wd, kind))
            return jnp.sum(jnp.sin(loss)), (loss, amax)
        (_, (loss, amax)), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(wd["h"], wd["w"])
        return loss, amax, g

    loss, amax, (dh, dw) = run("xla")
    rloss, ramax, (rdh, rdw) = run("reference")
    assert loss.shape == (2, 9) and loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, rloss, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(amax, ramax)
    np.testing.assert_allclose(dh, rdh, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dw, rdw, rtol=2e-5, atol=2e-5)
    assert float(jnp.abs(jnp.where(wd["mask"] == 0, loss, 0)).max()) == 0.0  # masked rows drop out
    # the same value as the logits API on materialised logits
    d = jnp.einsum("btd,vd->btv", wd["h"], wd["w"])
    t = wd["tl"] if kind == "logits" else jnp.einsum("btd,vd->btv", wd["th"], wd["tw"])
    np.testing.assert_allclose(loss, soft_cross_entropy(d, t) * wd["mask"], rtol=2e-5, atol=2e-5)


def test_fused_xla_check_grads_and_no_teacher_gradient():
    wd = _world(1)
    h, w = wd["h"][:1, :3], wd["w"][:40]
    tl = wd["tl"][:1, :3, :40]
    f = jax.jit(lambda h, w: fused_linear_soft_ce(h, w, teacher_logits=tl, implementation="xla", vocab_block=16))
    check_grads(f, (h, w), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)
    gt = jax.grad(lambda t: jnp.sum(fused_linear_soft_ce(h, w, teacher_logits=t, implementation="xla")))(tl)
    assert float(jnp.abs(gt).max()) == 0.0


def _avals(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


@pytest.mark.parametrize("impl,expect_full", [("xla", False), ("reference", True)])
def test_fused_never_builds_full_f32_logits(impl, expect_full):
    """No f32 intermediate of the xla forward+backward is [N, Vd] (its tiles are [N, 64]); the
    reference does build one, so the check can fail."""
    wd = _world()
    h, w = wd["h"].reshape(N, H), wd["w"]
    f = lambda h, w: jnp.sum(fused_linear_soft_ce(h, w, teacher_hidden=wd["th"].reshape(N, HT),
                                                  teacher_head=wd["tw"], implementation=impl, vocab_block=64))
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(h, w)
    full = [a for a in _avals(jaxpr.jaxpr) if getattr(a, "shape", None) == (N, V) and a.dtype == jnp.float32]
    assert bool(full) == expect_full


def test_logits_api_xla_matches_reference_with_grads():
    wd = _world(2)
    d = 2 * jax.random.normal(jax.random.key(7), (2, 9, V))
    loss = jax.jit(lambda d: soft_cross_entropy(d, wd["tl"], implementation="xla"))(d)
    np.testing.assert_allclose(loss, soft_cross_entropy(d, wd["tl"], implementation="reference"), rtol=2e-5,
                               atol=2e-5)
    g = jax.jit(jax.grad(lambda d: jnp.sum(jnp.sin(soft_cross_entropy(d, wd["tl"], implementation="xla")))))(d)
    r = jax.grad(lambda d: jnp.sum(jnp.sin(soft_cross_entropy(d, wd["tl"], implementation="reference"))))(d)
    np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)
    lb = soft_cross_entropy(d.astype(jnp.bfloat16), wd["tl"].astype(jnp.bfloat16), implementation="xla")
    assert lb.dtype == jnp.float32


def test_fused_bad_inputs_name_the_problem():
    wd = _world()
    with pytest.raises(ValueError, match="exactly one of teacher_logits"):
        fused_linear_soft_ce(wd["h"], wd["w"], implementation="xla")
    with pytest.raises(ValueError, match=r"needs a \.T"):
        fused_linear_soft_ce(wd["h"], wd["w"].T, teacher_logits=wd["tl"], implementation="xla")
    with pytest.raises(ValueError, match="mask must be"):
        fused_linear_soft_ce(wd["h"], wd["w"], teacher_logits=wd["tl"], mask=jnp.ones((3,)), implementation="xla")
    with pytest.raises(ValueError, match="unknown implementation"):
        fused_linear_soft_ce(wd["h"], wd["w"], teacher_logits=wd["tl"], implementation="cuda_magic")

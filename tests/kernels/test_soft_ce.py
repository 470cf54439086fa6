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
from _jaxpr_avals import jaxpr_avals  # noqa: E402
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


@pytest.mark.parametrize("impl", ["xla", "xla_saved"])
@pytest.mark.parametrize("kind", ["logits", "hidden"])
def test_fused_xla_matches_reference(kind, impl):
    wd = _world()
    wd["w"] = wd["w"].at[77].set(wd["w"][13])  # an exact tie in every row: the lower index must win

    def run(impl):
        def f(h, w):
            loss, amax = fused_linear_soft_ce(h, w, mask=wd["mask"], return_argmax=True, implementation=impl,
                                              vocab_block=64, **_teacher(wd, kind))
            return jnp.sum(jnp.sin(loss)), (loss, amax)
        (_, (loss, amax)), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(wd["h"], wd["w"])
        return loss, amax, g

    loss, amax, (dh, dw) = run(impl)
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


@pytest.mark.parametrize("impl", ["xla", "xla_saved"])
def test_fused_xla_check_grads_and_no_teacher_gradient(impl):
    wd = _world(1)
    h, w = wd["h"][:1, :3], wd["w"][:40]
    tl = wd["tl"][:1, :3, :40]
    f = jax.jit(lambda h, w: fused_linear_soft_ce(h, w, teacher_logits=tl, implementation=impl, vocab_block=16))
    check_grads(f, (h, w), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)
    gt = jax.grad(lambda t: jnp.sum(fused_linear_soft_ce(h, w, teacher_logits=t, implementation=impl)))(tl)
    assert float(jnp.abs(gt).max()) == 0.0
    th, tw = wd["th"][:1, :3], wd["tw"][:40]
    gth, gtw = jax.grad(lambda th, tw: jnp.sum(fused_linear_soft_ce(h, w, teacher_hidden=th, teacher_head=tw,
                                                                    implementation=impl)), argnums=(0, 1))(th, tw)
    assert float(jnp.abs(gth).max()) == 0.0 and float(jnp.abs(gtw).max()) == 0.0


@pytest.mark.parametrize("impl,expect_full", [("xla", False), ("reference", True)])
def test_fused_never_builds_full_f32_logits(impl, expect_full):
    """No f32 intermediate of the xla forward+backward is [N, Vd] (its tiles are [N, 64]); the
    reference does build one, so the check can fail."""
    wd = _world()
    h, w = wd["h"].reshape(N, H), wd["w"]
    f = lambda h, w: jnp.sum(fused_linear_soft_ce(h, w, teacher_hidden=wd["th"].reshape(N, HT),
                                                  teacher_head=wd["tw"], implementation=impl, vocab_block=64))
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(h, w)
    full = [a for a in jaxpr_avals(jaxpr.jaxpr) if getattr(a, "shape", None) == (N, V) and a.dtype == jnp.float32]
    assert bool(full) == expect_full


# ---- `xla_saved`: the logits saved in the input dtype (bf16 in training) ----
U_BF16 = 2.0 ** -8  # bf16 round-to-nearest: |round(x) - x| <= 2^-8 |x| (8 significand bits)


@pytest.mark.parametrize("kind", ["logits", "hidden"])
def test_fused_xla_saved_bf16_within_logit_rounding(kind):
    """bf16 inputs: xla_saved works on logits rounded to bf16 (the teacher's too when it is computed
    from hidden states), the reference on the f32 products of the same bf16 inputs. First-order bounds,
    per row r, with q = softmax(d), p = softmax(t), s = sum p d, and |dd| <= u max|d|, |dt| <= u max|t|:
      loss:  |d lse(d)| + |sum p dd| <= 2 u max|d|;   |sum dp d| = |cov_p(dt, d)| <= 2 u max|t| E_p|d - s|
      grads: the row factor g (q - p) moves by |g| (2 u max|d| q + 2 u max|t| p) elementwise, and is
             rounded to bf16 (u |g (q - p)|); dh = dd @ W and dW = dd.T @ h add those through |W|, |h|,
             and both sides round their bf16 output (2 u |grad|).
    The test allows twice each bound (second order, f32 reductions). Where the teacher comes as logits,
    both sides read the same bf16 array, so the teacher terms are 0. Run under jit, where XLA:CPU may
    keep the f32 product (excess precision), so the result may sit anywhere inside the bounds."""
    wd = {k: v.astype(jnp.bfloat16) for k, v in _world(3).items()}
    wd["mask"] = wd["mask"].astype(jnp.float32)
    wd["w"] = wd["w"].at[77].set(wd["w"][13])
    c = jax.random.uniform(jax.random.key(9), (2, 9)) + 0.5  # the loss cotangent, the same on both sides

    def run(impl):
        def f(h, w):
            loss, amax = fused_linear_soft_ce(h, w, mask=wd["mask"], return_argmax=True, implementation=impl,
                                              **_teacher(wd, kind))
            return jnp.sum(loss * c), (loss, amax)
        (_, (loss, amax)), g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(wd["h"], wd["w"])
        return loss, amax, g

    loss, amax, (dh, dw) = run("xla_saved")
    rloss, ramax, (rdh, rdw) = run("reference")
    assert loss.dtype == jnp.float32 and amax.dtype == jnp.int32 and dh.dtype == dw.dtype == jnp.bfloat16
    h, w = wd["h"].reshape(N, H).astype(jnp.float32), wd["w"].astype(jnp.float32)
    d = h @ w.T
    t = (wd["tl"].reshape(N, V).astype(jnp.float32) if kind == "logits"
         else wd["th"].reshape(N, HT).astype(jnp.float32) @ wd["tw"].astype(jnp.float32).T)
    q, p = jax.nn.softmax(d, -1), jax.nn.softmax(t, -1)
    ud = U_BF16 * jnp.abs(d).max(1, keepdims=True)
    ut = 0.0 if kind == "logits" else U_BF16 * jnp.abs(t).max(1, keepdims=True)
    s = jnp.sum(p * d, 1, keepdims=True)
    tol_loss = (2 * ud + 2 * ut * jnp.sum(p * jnp.abs(d - s), 1, keepdims=True))[:, 0]
    np.testing.assert_array_less(jnp.abs(loss - rloss).reshape(N), 2 * tol_loss + 1e-6)
    assert float(jnp.abs(jnp.where(wd["mask"] == 0, loss, 0)).max()) == 0.0
    g = (c * wd["mask"]).reshape(N, 1)
    err_dd = jnp.abs(g) * (2 * ud * q + 2 * ut * p + U_BF16 * jnp.abs(q - p))
    tol_dh = err_dd @ jnp.abs(w) + 2 * U_BF16 * jnp.abs(rdh.reshape(N, H).astype(jnp.float32))
    tol_dw = err_dd.T @ jnp.abs(h) + 2 * U_BF16 * jnp.abs(rdw.astype(jnp.float32))
    np.testing.assert_array_less(jnp.abs(dh.astype(jnp.float32) - rdh.astype(jnp.float32)).reshape(N, H),
                                 2 * tol_dh + 1e-6)
    np.testing.assert_array_less(jnp.abs(dw.astype(jnp.float32) - rdw.astype(jnp.float32)), 2 * tol_dw + 1e-6)
    # argmax: the chosen logit is the maximum up to the draft's rounding (bf16 can merge near-ties; the
    # exact tie 13/77 stays a tie and the lower index wins)
    amax = amax.reshape(N)
    picked = jnp.take_along_axis(d, amax[:, None], 1)[:, 0]
    np.testing.assert_array_less(d.max(1) - picked, 2 * ud[:, 0] + 1e-6)
    assert not bool(jnp.any(amax == 77))


@pytest.mark.parametrize("kind", ["logits", "hidden"])
@pytest.mark.parametrize("impl,expect_f32", [("xla_saved", False), ("reference", True)])
def test_fused_bf16_residuals_hold_no_f32_logits(kind, impl, expect_f32):
    """What the backward keeps (the leaves of jax.vjp's function): with bf16 inputs xla_saved keeps the
    draft logits and the teacher logits as bf16 [N, Vd] arrays, no f32 [N, Vd] one; the reference
    keeps f32 ones, so the check can fail."""
    wd = {k: v.astype(jnp.bfloat16) for k, v in _world().items()}
    teacher = _teacher(wd, kind)
    _, vjp = jax.vjp(lambda h, w: fused_linear_soft_ce(h, w, implementation=impl, **teacher), wd["h"], wd["w"])
    big = [x for x in jax.tree_util.tree_leaves(vjp) if x.size >= N * V]
    assert big and all(x.shape[-1] == V for x in big)
    assert any(x.dtype == jnp.float32 for x in big) == expect_f32
    if impl == "xla_saved":
        assert len(big) == 2 and all(x.dtype == jnp.bfloat16 for x in big)  # draft + teacher logits


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


@pytest.mark.parametrize("impl", ["xla", "xla_saved"])
def test_fused_bad_inputs_name_the_problem(impl):
    wd = _world()
    with pytest.raises(ValueError, match="exactly one of teacher_logits"):
        fused_linear_soft_ce(wd["h"], wd["w"], implementation=impl)
    with pytest.raises(ValueError, match=r"needs a \.T"):
        fused_linear_soft_ce(wd["h"], wd["w"].T, teacher_logits=wd["tl"], implementation=impl)
    with pytest.raises(ValueError, match="mask must be"):
        fused_linear_soft_ce(wd["h"], wd["w"], teacher_logits=wd["tl"], mask=jnp.ones((3,)), implementation=impl)
    with pytest.raises(ValueError, match="teacher_head"):
        fused_linear_soft_ce(wd["h"], wd["w"], teacher_hidden=wd["th"], implementation=impl)
    with pytest.raises(ValueError, match="unknown implementation"):
        fused_linear_soft_ce(wd["h"], wd["w"], teacher_logits=wd["tl"], implementation="cuda_magic")


@pytest.mark.parametrize("kind", ["logits", "hidden"])
def test_fused_softcap_xla_matches_the_capped_definition(kind):
    """softcap c: the logits made from hidden states are c * tanh(z / c) (a given teacher's logits are
    taken as they are); xla over 64-wide tiles equals the dense capped soft CE, loss and grads (f32,
    2e-5 like the uncapped case), and a backend without the cap refuses it by name."""
    wd = _world(2)
    c = 2.5
    cap = lambda z: c * jnp.tanh(z / c)

    def f(h, w):
        loss, amax = fused_linear_soft_ce(h, w, mask=wd["mask"], return_argmax=True, implementation="xla",
                                          vocab_block=64, softcap=c, **_teacher(wd, kind))
        return jnp.sum(jnp.sin(loss)), (loss, amax)

    def dense(h, w):
        d = cap(jnp.einsum("btd,vd->btv", h, w))
        t = wd["tl"] if kind == "logits" else cap(jnp.einsum("btd,vd->btv", wd["th"], wd["tw"]))
        loss = soft_cross_entropy(d, t, implementation="reference") * wd["mask"]
        return jnp.sum(jnp.sin(loss)), (loss, jnp.argmax(d, -1))

    (_, (loss, amax)), g = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(wd["h"], wd["w"])
    (_, (rloss, ramax)), rg = jax.value_and_grad(dense, argnums=(0, 1), has_aux=True)(wd["h"], wd["w"])
    np.testing.assert_allclose(loss, rloss, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(amax, ramax)
    for a, b in zip(g, rg):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    ref = fused_linear_soft_ce(wd["h"], wd["w"], mask=wd["mask"], implementation="reference", softcap=c,
                               **_teacher(wd, kind))
    np.testing.assert_allclose(ref, rloss, rtol=2e-5, atol=2e-5)
    assert not np.allclose(fused_linear_soft_ce(wd["h"], wd["w"], mask=wd["mask"], **_teacher(wd, kind)), rloss,
                           rtol=1e-3)  # the cap changes the value at these logit sizes
    with pytest.raises(ValueError, match="soft-cap"):
        fused_linear_soft_ce(wd["h"], wd["w"], implementation="xla_saved", softcap=c, **_teacher(wd, kind))

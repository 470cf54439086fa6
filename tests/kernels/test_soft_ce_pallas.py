"""The Pallas fused soft-CE backends on CPU in interpret mode (pallas_tpu with TPU interpret semantics,
pallas_gpu with the generic interpreter): loss, argmax and the gradients for hidden and lm_head against
the jnp reference.

Leading dims [3, 13] (N = 39 rows), Vd = 300, H = 72, Ht = 40 with 16-row blocks, 32-wide K chunks and
64 / 128-wide vocab tiles: none of N, Vd, H, Ht is a multiple of its block (padded rows, vocab columns and
K chunks; pallas_tpu's two K-chunk counts differ). The mask has zeros; lm_head rows 7 and 250 copy row 5
and rows 0..3 of hidden point along it, so the argmax has exact ties within a tile and across tiles
(first index wins). f32: rtol 1e-5 (measured ~5e-7 in relative norm; a dropped tile or K chunk is O(1e-1)).
bf16: loss rtol 1e-4, gradients 2e-2 in relative norm (dd is rounded to bf16 before the dh / dW GEMMs;
measured ~2e-3)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax_kernels.selection import select
from specjax_kernels.soft_ce import api, fused_linear_soft_ce, pallas_gpu, pallas_tpu

MODS = {"pallas_gpu": pallas_gpu, "pallas_tpu": pallas_tpu}
VOCAB_BLOCK = {"pallas_gpu": 64, "pallas_tpu": 128}
LEAD, V, H, HT = (3, 13), 300, 72, 40


@pytest.fixture
def small_blocks(monkeypatch):
    for mod in MODS.values():
        monkeypatch.setattr(mod, "BLOCK_N", 16)
        monkeypatch.setattr(mod, "BLOCK_K", 32)


def _inputs(dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 7)
    h = jax.random.normal(ks[0], LEAD + (H,))
    w = 0.3 * jax.random.normal(ks[1], (V, H))
    w = w.at[jnp.array([7, 250])].set(w[5])
    h = h.at[0, :4].set(2.0 * w[5])
    c = lambda x: x.astype(dtype)
    teachers = {"logits": dict(teacher_logits=c(2 * jax.random.normal(ks[2], LEAD + (V,)))),
                "hidden": dict(teacher_hidden=c(jax.random.normal(ks[3], LEAD + (HT,))),
                               teacher_head=c(0.3 * jax.random.normal(ks[4], (V, HT))))}
    mask = (jax.random.uniform(ks[5], LEAD) > 0.3).astype(jnp.float32)
    return c(h), c(w), teachers, mask, jax.random.normal(ks[6], LEAD)


def _run(impl, h, w, teacher, mask, g, vocab_block=None):
    def f(h, w):
        return fused_linear_soft_ce(h, w, mask=mask, return_argmax=True, implementation=impl,
                                    vocab_block=vocab_block, **teacher)

    def go():
        (loss, amax), vjp = jax.vjp(f, h, w)
        return loss, amax, vjp((g, np.zeros(amax.shape, jax.dtypes.float0)))
    return jax.jit(go)()


def _up(teacher):
    return {k: v.astype(jnp.float32) for k, v in teacher.items()}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("teacher", ["logits", "hidden"])
def test_pallas_soft_ce_matches_reference(small_blocks, impl, teacher):
    h, w, teachers, mask, g = _inputs(jnp.float32)
    loss, amax, (dh, dw) = _run(impl, h, w, teachers[teacher], mask, g, VOCAB_BLOCK[impl])
    rloss, ramax, (rdh, rdw) = _run("reference", h, w, teachers[teacher], mask, g)
    assert loss.shape == amax.shape == LEAD and loss.dtype == jnp.float32 and amax.dtype == jnp.int32
    assert dh.shape == h.shape and dw.shape == w.shape
    np.testing.assert_allclose(loss, rloss, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(loss * (mask == 0)).max()) == 0.0
    np.testing.assert_array_equal(amax, ramax)
    assert (np.asarray(amax[0, :4]) == 5).all()  # ties with rows 7 and 250: the first index
    for x, r, name in ((dh, rdh, "dh"), (dw, rdw, "dw")):
        np.testing.assert_allclose(x, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()), err_msg=name)


@pytest.mark.parametrize("impl,teacher", [("pallas_gpu", "hidden"), ("pallas_tpu", "logits")])
def test_pallas_soft_ce_bf16(small_blocks, impl, teacher):
    h, w, teachers, mask, g = _inputs(jnp.bfloat16, seed=1)
    loss, amax, (dh, dw) = _run(impl, h, w, teachers[teacher], mask, g, VOCAB_BLOCK[impl])
    rloss, ramax, (rdh, rdw) = _run("reference", h.astype(jnp.float32), w.astype(jnp.float32),
                                    _up(teachers[teacher]), mask, g)
    assert dh.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_allclose(loss, rloss, rtol=1e-4, atol=1e-4)
    assert float(jnp.mean(amax == ramax)) > 0.95  # bf16-exact products, f32 sums: near-ties may reorder
    assert _rel(dh, rdh) < 2e-2 and _rel(dw, rdw) < 2e-2


def test_pallas_soft_ce_default_blocks_and_selection():
    """Default blocks (one full-dim block per axis for pallas_tpu at this size) on [N, H] inputs; on CPU
    `auto` does not pick a Pallas backend."""
    h, w, teachers, mask, g = _inputs(jnp.float32, seed=2)
    h, mask, g = h[0], mask[0], g[0]
    tl = dict(teacher_logits=teachers["logits"]["teacher_logits"][0])
    rloss, ramax, (rdh, rdw) = _run("reference", h, w, tl, mask, g)
    for impl in MODS:
        loss, amax, (dh, dw) = _run(impl, h, w, tl, mask, g)
        np.testing.assert_allclose(loss, rloss, rtol=1e-5, atol=1e-5, err_msg=impl)
        np.testing.assert_array_equal(amax, ramax)
        assert _rel(dh, rdh) < 1e-5 and _rel(dw, rdw) < 1e-5, impl
    if jax.default_backend() == "cpu":
        assert select("soft_ce", api.IMPLEMENTATIONS, api.PREFERENCE, None)[0] == "xla"

"""TTT attention reference vs an independent dense formulation.

The independent version concatenates the keys of all steps along the key axis ([T, (k+1)T]) and
builds the mask the way the flex-attention trainers describe it (docs/eagle3-format.md, "TTT training semantics"):
  block 0: kv <= q within the same segment;  block i >= 1: kv position == q position.
It is the naive O(T * (k+1)T) form the reference avoids; both must agree."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxpr_avals import jaxpr_avals
from jax.test_util import check_grads

from specjax_kernels.ttt_attention import ttt_attention


def dense_ttt(q, k0, v0, kd, vd, seg):
    B, T, Hq, D = q.shape
    Hkv = k0.shape[2]
    rep = Hq // Hkv
    ks = [k0] + ([kd[i] for i in range(kd.shape[0])] if kd is not None else [])
    vs = [v0] + ([vd[i] for i in range(vd.shape[0])] if vd is not None else [])
    K = jnp.repeat(jnp.concatenate(ks, axis=1), rep, axis=2)  # [B, (k+1)T, Hq, D]
    V = jnp.repeat(jnp.concatenate(vs, axis=1), rep, axis=2)
    n = len(ks)
    qpos = np.arange(T)[:, None]
    kvpos = np.arange(n * T)[None, :]
    block, s = kvpos // T, kvpos % T
    causal = (block == 0) & (s <= qpos)
    diag = (block >= 1) & (s == qpos)
    mask = jnp.asarray(causal | diag)[None]  # [1, T, nT]
    if seg is not None:
        seg_kv = jnp.tile(seg, (1, n))
        mask = mask & ((seg[:, :, None] == seg_kv[:, None, :]) | jnp.asarray(diag)[None])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, K) / np.sqrt(D)
    scores = jnp.where(mask[:, None], scores, -1e30)
    w = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", w, V)


def rand_inputs(key, B, T, Hq, Hkv, D, k):
    ks = jax.random.split(key, 5)
    q = jax.random.normal(ks[0], (B, T, Hq, D))
    k0 = jax.random.normal(ks[1], (B, T, Hkv, D))
    v0 = jax.random.normal(ks[2], (B, T, Hkv, D))
    kd = jax.random.normal(ks[3], (k, B, T, Hkv, D)) if k else None
    vd = jax.random.normal(ks[4], (k, B, T, Hkv, D)) if k else None
    return q, k0, v0, kd, vd


@pytest.mark.parametrize("k", [0, 1, 3, 6])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (6, 1)])
def test_reference_matches_dense(k, Hq, Hkv):
    q, k0, v0, kd, vd = rand_inputs(jax.random.key(k + Hq), 2, 13, Hq, Hkv, 8, k)
    out = jax.jit(lambda *a: ttt_attention(*a, None, implementation="reference"))(q, k0, v0, kd, vd)
    ref = jax.jit(dense_ttt)(q, k0, v0, kd, vd, None)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_packed_segments(k):
    q, k0, v0, kd, vd = rand_inputs(jax.random.key(7), 2, 17, 4, 2, 8, k)
    seg = jnp.asarray([[1] * 6 + [2] * 8 + [0] * 3, [1] * 17], jnp.int32)
    out = jax.jit(lambda *a: ttt_attention(*a, implementation="reference"))(q, k0, v0, kd, vd, seg)
    np.testing.assert_allclose(out, jax.jit(dense_ttt)(q, k0, v0, kd, vd, seg), rtol=1e-5, atol=1e-5)
    # the second document alone gives the same rows: nothing leaks across the boundary
    sl = slice(6, 14)
    alone = jax.jit(ttt_attention, static_argnames="implementation")(q[:1, sl], k0[:1, sl], v0[:1, sl],
                          None if kd is None else kd[:, :1, sl], None if vd is None else vd[:, :1, sl],
                          None, implementation="reference")
    np.testing.assert_allclose(out[:1, sl], alone, rtol=1e-5, atol=1e-5)


def test_gradients():
    q, k0, v0, kd, vd = rand_inputs(jax.random.key(3), 1, 6, 2, 1, 4, 2)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2]], jnp.int32)
    f = jax.jit(lambda q, k0, v0, kd, vd: ttt_attention(q, k0, v0, kd, vd, seg, implementation="reference"))
    check_grads(f, (q, k0, v0, kd, vd), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_selection_errors():
    q, k0, v0, _, _ = rand_inputs(jax.random.key(0), 1, 4, 2, 1, 4, 0)
    with pytest.raises(ValueError, match="unknown implementation"):
        ttt_attention(q, k0, v0, implementation="cuda_magic")
    assert ttt_attention(q, k0, v0, implementation="auto").shape == q.shape


# ---- the `xla` implementation (blockwise online softmax + LSE-merged diagonal, custom VJP) ----
# Tolerances: f32 everywhere; the blockwise sums differ from the dense reference only by rounding
# (measured ~1e-6), so 2e-5 absolute on unit-scale inputs leaves room without hiding a wrong mask.

def _xla(block):
    return lambda *a: ttt_attention(*a, implementation="xla", block_size=block)


SEG13 = jnp.asarray([[1] * 5 + [2] * 6 + [0] * 2, [3] * 13], jnp.int32)


@pytest.mark.parametrize("k,Hq,Hkv", [(0, 4, 4), (1, 4, 2), (2, 6, 1), (3, 4, 2), (4, 4, 4), (5, 6, 1), (6, 4, 2)])
def test_xla_forward_matches_reference(k, Hq, Hkv):
    # every k = 0..6 and each head layout (MHA, GQA 2:1, MQA 6:1) at least twice
    # T = 13 with blocks of 4: a padded last block; two packed documents plus padding in row 0
    q, k0, v0, kd, vd = rand_inputs(jax.random.key(10 * k + Hq + Hkv), 2, 13, Hq, Hkv, 8, k)
    out = jax.jit(_xla(4))(q, k0, v0, kd, vd, SEG13)
    ref = jax.jit(dense_ttt)(q, k0, v0, kd, vd, SEG13)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("k,packed", [(0, False), (1, True), (4, False), (6, True)])
def test_xla_gradients_match_reference(k, packed):
    q, k0, v0, kd, vd = rand_inputs(jax.random.key(k), 2, 13, 6, 2, 8, k)
    seg = SEG13 if packed else None
    cot = jax.random.normal(jax.random.key(99), q.shape)

    def grads(impl, block=None):
        f = lambda *a: jnp.sum(cot * ttt_attention(*a, seg, implementation=impl, block_size=block))
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4) if k else (0, 1, 2)))(q, k0, v0, kd, vd)

    for g, r, name in zip(grads("xla", 4), grads("reference"), ["dq", "dk0", "dv0", "dk_diag", "dv_diag"]):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5, err_msg=name)


def test_xla_check_grads():
    q, k0, v0, kd, vd = rand_inputs(jax.random.key(5), 1, 5, 2, 1, 4, 2)
    seg = jnp.asarray([[1, 1, 2, 2, 2]], jnp.int32)
    f = jax.jit(lambda *a: ttt_attention(*a, seg, implementation="xla", block_size=2))
    check_grads(f, (q, k0, v0, kd, vd), order=1, modes=("rev",), atol=1e-2, rtol=1e-2)


def test_xla_memory_is_linear_in_T():
    """No intermediate of the xla forward+backward has two axes of length T (no [T,T] scores)."""
    T = 64
    q, k0, v0, kd, vd = rand_inputs(jax.random.key(1), 1, T, 4, 2, 8, 3)
    f = lambda *a: jnp.sum(ttt_attention(*a, implementation="xla", block_size=16) ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2, 3, 4)))(q, k0, v0, kd, vd)
    worst = [a.shape for a in jaxpr_avals(jaxpr.jaxpr) if hasattr(a, "shape") and sum(d >= T for d in a.shape) >= 2]
    assert not worst, worst
    # the reference does build [T,T] (the check can fail)
    g = lambda *a: jnp.sum(ttt_attention(*a, implementation="reference") ** 2)
    ref = jax.make_jaxpr(jax.grad(g))(q, k0, v0, kd, vd)
    assert any(sum(d >= T for d in a.shape) >= 2 for a in jaxpr_avals(ref.jaxpr) if hasattr(a, "shape"))


def test_bad_inputs_name_the_problem():
    q, k0, v0, kd, vd = rand_inputs(jax.random.key(0), 1, 8, 4, 2, 8, 2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ttt_attention(q, k0[:, :, :1].repeat(3, 2), v0[:, :, :1].repeat(3, 2), implementation="xla")
    with pytest.raises(ValueError, match="both k_diag and v_diag"):
        ttt_attention(q, k0, v0, kd, None, implementation="xla")
    with pytest.raises(ValueError, match="segment_ids must be"):
        ttt_attention(q, k0, v0, kd, vd, jnp.zeros((1, 5), jnp.int32), implementation="xla")


def test_auto_is_xla_on_cpu_and_unavailable_falls_back(caplog):
    from specjax_kernels.selection import select
    from specjax_kernels.ttt_attention import api
    assert select("ttt_attention", api.IMPLEMENTATIONS, api.PREFERENCE, None)[0] == "xla"
    with caplog.at_level("WARNING", logger="specjax_kernels"):
        name, _ = select("ttt_attention", api.IMPLEMENTATIONS, api.PREFERENCE, "triton")
    assert name == "xla" and "not available" in caplog.text

"""specjax_kernels.moe: every implementation that runs here vs a dense per-expert loop written here in numpy.

Tolerance: rel = max|ours - ref| / max|ref| <= 1e-5 in fp32 (float64 reference); bf16 inputs
within 2e-2 of the fp32 result. Cases include experts that get no token, one expert taking every
token, non-gated (relu^2) experts, and tiny blocks so the blocked path spans many blocks per expert.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax_kernels import moe
from specjax_kernels.moe import api, moe_experts, xla

IMPLS = ("reference", "xla", "pallas_tpu")  # pallas_tpu in interpret mode off TPU; mgpu: tests/kernels/test_kernels_gpu.py


def dense_loop(x, ids, w, up, down, gate=None, act="silu"):
    """out[t] = sum_j w[t, j] * FFN_{ids[t, j]}(x[t]), one token and one choice at a time (float64)."""
    x, ids, w, up, down = (np.asarray(a, np.float64) if a.dtype != np.int32 else np.asarray(a)
                           for a in map(np.asarray, (x, ids, w, up, down)))
    gate = None if gate is None else np.asarray(gate, np.float64)
    f = {"silu": lambda z: z / (1.0 + np.exp(-z)), "relu2": lambda z: np.maximum(z, 0.0) ** 2}[act]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            h = f(x[t] @ gate[e]) * (x[t] @ up[e]) if gate is not None else f(x[t] @ up[e])
            out[t] += w[t, j] * (h @ down[e])
    return out


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def make_case(seed, T, k, E, D, F, skew=None, gated=True):
    """numpy inputs (no eager jax ops to compile): x, top-k ids/weights of a softmax router, weights."""
    rng = np.random.RandomState(seed)
    x = rng.randn(T, D).astype(np.float32)
    logits = rng.randn(T, E)
    if skew is not None:  # push every token towards the experts in `skew`
        logits[:, skew] += 20.0
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(probs, ids, axis=-1).astype(np.float32)
    up = (0.2 * rng.randn(E, D, F)).astype(np.float32)
    down = (0.2 * rng.randn(E, F, D)).astype(np.float32)
    gate = (0.2 * rng.randn(E, D, F)).astype(np.float32) if gated else None
    return x, ids, w, up, down, gate


CASES = {
    "balanced": dict(T=40, k=2, E=8, D=16, F=12),
    "top1_many_experts": dict(T=24, k=1, E=16, D=8, F=8),  # most experts get no token
    "one_hot_expert": dict(T=32, k=2, E=8, D=8, F=8, skew=[3, 5]),  # experts 3 and 5 take every token
    "relu2_ungated": dict(T=30, k=3, E=6, D=8, F=16, gated=False),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_dense_loop(impl, case):
    kw = dict(CASES[case])
    gated = kw.pop("gated", True)
    x, ids, w, up, down, gate = make_case(0, gated=gated, **kw)
    act = "silu" if gated else "relu2"
    fn = jax.jit(lambda x, ids, w, up, down, gate: moe_experts(
        x, ids, w, up_edf=up, down_efd=down, gate_edf=gate, activation=act, implementation=impl))
    out = fn(x, ids, w, up, down, gate)
    assert out.shape == x.shape and out.dtype == x.dtype
    err = rel(out, dense_loop(x, ids, w, up, down, gate, act))
    assert err <= 1e-5, f"{impl}/{case}: rel err {err:.2e}"
    if case == "one_hot_expert":
        assert set(np.unique(np.asarray(ids))) == {3, 5}  # the skew really concentrated the load


@pytest.mark.parametrize("block", [8, 16, 64])
def test_xla_block_sizes_agree(block):
    x, ids, w, up, down, gate = make_case(1, T=50, k=2, E=4, D=8, F=8)  # ~25 rows per expert
    out = jax.jit(lambda *a: xla.moe_experts(*a, block=block))(x, ids, w, up, down, gate)
    assert rel(out, dense_loop(x, ids, w, up, down, gate)) <= 1e-5
    assert xla.default_block(100, 4) == 16 and xla.default_block(10, 64) == 8 and xla.default_block(10**6, 8) == 128


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_close_to_fp32(impl):
    x, ids, w, up, down, gate = make_case(2, T=32, k=2, E=8, D=32, F=16)
    f32 = moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_edf=gate, implementation=impl)
    bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
    b16 = moe_experts(bf(x), ids, bf(w), up_edf=bf(up), down_efd=bf(down), gate_edf=bf(gate), implementation=impl)
    assert b16.dtype == jnp.bfloat16
    assert rel(b16, f32) <= 2e-2


def test_gradients_agree():
    x, ids, w, up, down, gate = make_case(3, T=16, k=2, E=4, D=8, F=8)

    def loss(impl):
        return lambda x, up: jnp.sum(jnp.sin(moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_edf=gate,
                                                         implementation=impl)))

    g_ref = jax.grad(loss("reference"), argnums=(0, 1))(x, up)
    for impl in ("xla", "pallas_tpu"):  # pallas_tpu: megablox's own VJP, interpret mode
        for a, b in zip(jax.grad(loss(impl), argnums=(0, 1))(x, up), g_ref):
            assert rel(a, b) <= 1e-5, impl


@pytest.mark.parametrize("impl", IMPLS + ("pallas_gpu",))
def test_fused_gate_up_equals_separate(impl):
    """gate_up [E, D, 2F] (gate columns first) is the same experts as separate gate / up [E, D, F]:
    against the dense loop (1e-5, fp32) and its gradient w.r.t. the fused weight against the two
    separate gradients side by side (1e-5)."""
    x, ids, w, up, down, gate = make_case(6, T=40, k=2, E=8, D=16, F=12)
    gate_up = np.concatenate([gate, up], axis=-1)
    fused = lambda x, gu: moe_experts(x, ids, w, gate_up_edf=gu, down_efd=down, implementation=impl)  # noqa: E731
    out = jax.jit(fused)(x, gate_up)
    assert rel(out, dense_loop(x, ids, w, up, down, gate)) <= 1e-5
    g_fused = jax.grad(lambda gu: jnp.sum(jnp.sin(fused(x, gu))))(gate_up)
    g_gate, g_up = jax.grad(lambda g, u: jnp.sum(jnp.sin(moe_experts(
        x, ids, w, up_edf=u, gate_edf=g, down_efd=down, implementation="reference"))), argnums=(0, 1))(gate, up)
    assert rel(g_fused, np.concatenate([g_gate, g_up], axis=-1)) <= 1e-5


@pytest.mark.parametrize("n_experts", [8, 2**20])
def test_sort_by_expert_is_a_stable_argsort(n_experts):
    """The packed-key sort (expert * rows + row, when it fits int32) and the argsort fallback (2**20
    experts x 600 rows does not fit) both give the stable argsort's order and the bincount."""
    from specjax_kernels.moe.common import sort_by_expert

    ids = np.random.RandomState(0).randint(0, 8, size=(300, 2)).astype(np.int32)
    order, sizes = jax.jit(sort_by_expert, static_argnums=1)(ids, n_experts)
    np.testing.assert_array_equal(order, np.argsort(ids.reshape(-1), kind="stable"))
    np.testing.assert_array_equal(sizes, np.bincount(ids.reshape(-1), minlength=n_experts))


def test_map_under_vmap_runs_each_member():
    """The vmap rule mgpu's kernel gets (it has none of its own): each batch member is one call of the
    unbatched function (counted at trace time), shared arguments stay unbatched; values equal the
    members' own calls, also under a nested vmap and under jit."""
    from specjax_kernels.moe.common import map_under_vmap

    shapes = []

    def gmm(lhs, rhs, sizes):
        shapes.append((lhs.shape, rhs.shape, sizes.shape))
        return jax.lax.ragged_dot(lhs, rhs, sizes)

    f = map_under_vmap(gmm)
    rng = np.random.RandomState(0)
    lhs, rhs = rng.randn(3, 2, 10, 4).astype(np.float32), rng.randn(5, 4, 6).astype(np.float32)
    sizes = np.array([[[2, 0, 3, 4, 1], [10, 0, 0, 0, 0]]] * 3, np.int32)
    out = jax.jit(jax.vmap(jax.vmap(f, in_axes=(0, None, 0)), in_axes=(0, None, 0)))(lhs, rhs, sizes)
    assert set(shapes) == {((10, 4), (5, 4, 6), (5,))}  # only unbatched calls were traced
    for i in range(3):
        for j in range(2):
            np.testing.assert_allclose(out[i, j], jax.lax.ragged_dot(lhs[i, j], rhs, sizes[i, j]), rtol=1e-6)


def test_gpu_choice_rules():
    """auto on a GPU: mgpu (Hopper) or pallas_gpu (other NVIDIA GPUs) for bf16/fp16 on one device; xla
    for fp32 or several devices; mgpu's shape limits move auto to pallas_gpu and an explicit mgpu to
    xla; an explicit pallas_gpu stays (it pads any width, takes fp32)."""
    bf, f32 = jnp.bfloat16, jnp.float32
    one = dict(n_devices=1, mgpu_shape_issue=None)
    assert api.gpu_choice("mgpu", auto=True, dtype=bf, **one) == ("mgpu", None)
    assert api.gpu_choice("pallas_gpu", auto=True, dtype=bf, **one) == ("pallas_gpu", None)
    assert api.gpu_choice("mgpu", auto=True, dtype=f32, **one)[0] == "xla"
    assert api.gpu_choice("pallas_gpu", auto=True, dtype=f32, **one)[0] == "xla"
    name, why = api.gpu_choice("pallas_gpu", auto=True, dtype=bf, n_devices=2, mgpu_shape_issue=None)
    assert name == "xla" and "2 devices" in why and "kernels.moe=pallas_gpu" in why
    narrow = dict(n_devices=1, mgpu_shape_issue="width 96 is not a multiple of 64")
    assert api.gpu_choice("mgpu", auto=True, dtype=bf, **narrow) == ("pallas_gpu", narrow["mgpu_shape_issue"])
    assert api.gpu_choice("mgpu", auto=False, dtype=bf, **narrow) == ("xla", narrow["mgpu_shape_issue"])
    assert api.gpu_choice("mgpu", auto=False, dtype=f32, **one)[0] == "xla"
    assert api.gpu_choice("pallas_gpu", auto=False, dtype=f32, n_devices=2, mgpu_shape_issue=None) == ("pallas_gpu", None)
    assert api.gpu_choice("xla", auto=True, dtype=bf, **one) == ("xla", None)
    assert api.PREFERENCE["gpu"][:3] == ["mgpu", "pallas_gpu", "xla"]


def test_selection_and_errors(caplog):
    assert api.PREFERENCE["cpu"][0] == "xla" and api.PREFERENCE["tpu"][0] == "reference"
    x, ids, w, up, down, gate = make_case(4, T=8, k=2, E=4, D=8, F=8)
    auto = moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_edf=gate)
    ref = moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_edf=gate, implementation="reference")
    assert rel(auto, ref) <= 1e-5
    with pytest.raises(ValueError, match=r"unknown implementation 'triton'.*reference.*xla"):
        moe_experts(x, ids, w, up_edf=up, down_efd=down, implementation="triton")
    with pytest.raises(ValueError, match=r"unknown activation 'swish'.*relu2.*silu"):
        moe_experts(x, ids, w, up_edf=up, down_efd=down, activation="swish", implementation="reference")
    with pytest.raises(ValueError, match=r"want up/gate \[E, D, F\] or gate_up \[E, D, 2F\], down \[E, F, D\]"):
        moe_experts(x, ids, w, up_edf=up, down_efd=up[:, :, :4])
    with pytest.raises(ValueError, match=r"gate_up \(4, 8, 8\).*want"):  # fused weight of width F, not 2F
        moe_experts(x, ids, w, gate_up_edf=up, down_efd=down)
    with pytest.raises(ValueError, match=r"pass up_edf .* or gate_up_edf, not both"):
        moe_experts(x, ids, w, up_edf=up, gate_up_edf=np.concatenate([gate, up], -1), down_efd=down)
    with pytest.raises(ValueError, match=r"ids/weights \[T, k\]"):
        moe_experts(x, ids[:, :1], w, up_edf=up, down_efd=down)
    assert "relu2" in moe.ACTIVATIONS


@pytest.mark.parametrize("impl", IMPLS)
def test_cpu_benchmark_case_matches_dense_loop(impl):
    """The case that decides `auto` = xla on CPU (512 tokens, k=2, 32 experts; `benchmarks/kernel_speed.py
    --small --ops moe --T 512` times both implementations on it): exact against the dense loop, and
    xla equal to the reference ragged_dot. Speed is measured in the benchmark, not asserted here."""
    x, ids, w, up, down, gate = make_case(5, T=512, k=2, E=32, D=64, F=64)
    assert len(np.unique(ids)) == 32  # every expert gets tokens: all groups of the grouped GEMM are used
    fn = jax.jit(lambda x: moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_edf=gate, implementation=impl))
    out = fn(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    err = rel(out, dense_loop(x, ids, w, up, down, gate))
    assert err <= 1e-5, f"{impl}: rel err {err:.2e}"
    if impl == "xla":
        ref = moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_edf=gate, implementation="reference")
        assert rel(out, ref) <= 1e-5


def test_bench_layer_variants_compute_the_same_layer():
    """`python -m specjax_kernels.moe.bench --layer-variants` times the layer's non-GEMM parts
    (`moe.common`: counts by compare-and-sum, rows as uint32 pairs, multiply + sum combine) against
    alternatives (the old bincount sort and einsum combine, a sort-free one-hot placement, a scatter
    combine). Each is checked against numpy written here: the stable argsort and the bincount exactly,
    the gathered rows bit for bit (bf16), and the combine against a float64 loop over tokens and
    choices within 1e-6 relative."""
    from specjax_kernels.moe import bench, common

    rs = np.random.RandomState(3)
    ids = rs.randint(0, 8, size=(300, 2)).astype(np.int32)
    ids[:40] = 5  # one expert much larger than the others; expert 8 of 9 gets no row
    order, sizes = jax.jit(common.sort_by_expert, static_argnums=1)(ids, 9)
    np.testing.assert_array_equal(order, np.argsort(ids.reshape(-1), kind="stable"))
    np.testing.assert_array_equal(sizes, np.bincount(ids.reshape(-1), minlength=9))
    order1, sizes1, inverse1 = jax.jit(bench._sort_onehot, static_argnums=1)(ids, 9)
    np.testing.assert_array_equal(order1, np.argsort(ids.reshape(-1), kind="stable"))
    np.testing.assert_array_equal(sizes1, np.bincount(ids.reshape(-1), minlength=9))
    order0, sizes0 = jax.jit(bench._sort_bincount, static_argnums=1)(ids, 9)
    np.testing.assert_array_equal(order0, np.argsort(ids.reshape(-1), kind="stable"))
    np.testing.assert_array_equal(sizes0, np.bincount(ids.reshape(-1), minlength=9))
    np.testing.assert_array_equal(np.asarray(order1)[np.asarray(inverse1)], np.arange(600))

    x = jnp.asarray(rs.randn(300, 24), jnp.bfloat16)
    rows = order // 2
    ref_rows = np.asarray(x.astype(jnp.float32))[np.asarray(rows)]
    for mode in ("fill", "promise_in_bounds", "u32"):
        got = jax.jit(lambda x, r, mode=mode: bench._gather_rows(x, r, mode))(x, rows)
        assert got.dtype == jnp.bfloat16 and got.shape == (600, 24)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), ref_rows)

    ys = rs.randn(600, 24).astype(np.float32)
    w = rs.rand(300, 2).astype(np.float32)
    want = np.zeros((300, 24))
    order_np = np.asarray(order)
    for r in range(600):  # sorted row r is assignment order[r] = (token, choice)
        t, j = divmod(int(order_np[r]), 2)
        want[t] += float(w[t, j]) * ys[r].astype(np.float64)
    for fn in (common.combine, bench._combine_scatter, bench._combine_einsum):
        got = jax.jit(fn, static_argnums=3)(jnp.asarray(ys), order, jnp.asarray(w), jnp.float32)
        assert rel(got, want) <= 1e-6
    got = jax.jit(bench._combine_inverse, static_argnums=3)(jnp.asarray(ys), inverse1, jnp.asarray(w), jnp.float32)
    assert rel(got, want) <= 1e-6


def test_gather_rows_moves_the_same_bits_and_has_the_take_gradient():
    """`common.gather_rows` moves 16-bit rows as uint32 pairs (a custom VJP, since a bitcast has no
    gradient): same bits as numpy indexing for bf16 and fp16, the plain path for fp32 and odd widths, and
    the gradient of ``jnp.take`` (a scatter-add; repeated rows add up), exactly."""
    from specjax_kernels.moe.common import gather_rows

    rs = np.random.RandomState(5)
    rows = jnp.asarray(rs.randint(0, 40, size=130), jnp.int32)
    for dtype, width in ((jnp.bfloat16, 24), (jnp.float16, 24), (jnp.float32, 24), (jnp.bfloat16, 7)):
        x = jnp.asarray(rs.randn(40, width), dtype)
        got = jax.jit(gather_rows)(x, rows)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(x.astype(jnp.float32))[np.asarray(rows)])
        ct = jnp.asarray(rs.randn(130, width), dtype)
        grad = jax.grad(lambda x: jnp.sum((gather_rows(x, rows) * ct).astype(jnp.float32)))(x)
        want = np.zeros((40, width))
        np.add.at(want, np.asarray(rows), np.asarray(ct.astype(jnp.float32), np.float64))
        tol = 1e-6 if dtype == jnp.float32 else 2e-2  # the cotangent sums in the input dtype, as jnp.take's does
        np.testing.assert_allclose(np.asarray(grad.astype(jnp.float32)), want, rtol=tol, atol=tol)
        ref = jax.grad(lambda x: jnp.sum((jnp.take(x, rows, axis=0) * ct).astype(jnp.float32)))(x)
        np.testing.assert_array_equal(np.asarray(grad.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)))

"""specjax_kernels.moe with expert biases and the GLU-level clamped SwiGLU (gpt-oss's experts).

Every backend that runs on CPU (reference, xla, pallas_gpu and pallas_tpu in Pallas's interpreter; mgpu
only on a Hopper GPU) against `gpt_oss_loop`, numpy written here that loops over tokens and their k
experts in float64: rel = max|ours - loop| / max|loop| <= 1e-5 in fp32; bf16 experts within 2e-2 of
the fp32 result. The inputs are scaled so the pre-activations cross both clamps (asserted, with a margin
so fp32 rounding cannot move a value across a clamp between backends). The loop itself is checked
against transformers' GptOssExperts (torch, fp64, HF's interleaved gate/up columns) within 1e-10.
Also: the bias / activation ValueErrors, vmap over batch rows (the per_token fold and, with a batched
bias, the per-member map) equal to the unbatched calls within 1e-5, gradients (x, gate_up, both
biases) of xla and pallas_tpu against the reference within 1e-5, the pre-existing silu path unchanged
by passing zero biases, and the pallas_tpu path with biases lowering to Mosaic for a TPU.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax_kernels.moe import moe_experts

CPU_IMPLS = ("reference", "xla", "pallas_gpu", "pallas_tpu")  # the last two in interpret mode on CPU
ALPHA, LIMIT = 1.702, 1.5  # gpt-oss's alpha; a limit the scaled inputs below exceed both ways
ACT = ("clamped_swiglu", ALPHA, LIMIT)
TOL = 1e-5
T, K, E, D, F = 12, 2, 4, 16, 8


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _np_unit(gate, up, act):
    if isinstance(act, tuple):  # ("clamped_swiglu", alpha, limit)
        _, alpha, limit = act
        g = np.minimum(gate, limit)
        u = np.clip(up, -limit, limit)
        return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
    return gate / (1.0 + np.exp(-gate)) * up  # silu


def gpt_oss_loop(x, ids, w, down, *, gate_up=None, gate=None, up=None, gate_up_bias=None, down_bias=None,
                 act=ACT):
    """out[t] = sum_j w[t, j] * (unit(gate, up) @ down[e] + down_bias[e]), e = ids[t, j], with
    [gate | up] = x[t] @ gate_up[e] + gate_up_bias[e] (fused) or x[t] @ gate[e], x[t] @ up[e]; for
    ungated experts (only up) relu(x @ up[e])^2. One token and one choice at a time, float64."""
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    x, w, down, gate_up, gate, up, gub, db = map(f64, (x, w, down, gate_up, gate, up, gate_up_bias, down_bias))
    ids = np.asarray(ids)
    f = down.shape[1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = ids[t, j]
            if gate_up is not None:
                gu = x[t] @ gate_up[e] + (0.0 if gub is None else gub[e])
                h = _np_unit(gu[:f], gu[f:], act)
            elif gate is not None:
                h = _np_unit(x[t] @ gate[e], x[t] @ up[e], act)
            else:
                h = np.maximum(x[t] @ up[e], 0.0) ** 2
            y = h @ down[e] + (0.0 if db is None else db[e])
            out[t] += w[t, j] * y
    return out


def make_case(seed, T=T, k=K, E=E, D=D, F=F):
    """numpy fp32: x, top-k ids / softmax weights, gate_up [E, D, 2F] = [gate | up], down, biases."""
    rng = np.random.RandomState(seed)
    x = rng.randn(T, D).astype(np.float32)
    logits = rng.randn(T, E)
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :k].astype(np.int32)
    top = np.take_along_axis(logits, ids, axis=-1)
    w = (np.exp(top) / np.exp(top).sum(-1, keepdims=True)).astype(np.float32)
    gate_up = (0.6 * rng.randn(E, D, 2 * F)).astype(np.float32)  # pre-activations of std ~2.4 > LIMIT
    down = (0.3 * rng.randn(E, F, D)).astype(np.float32)
    gate_up_bias = (0.8 * rng.randn(E, 2 * F)).astype(np.float32)
    down_bias = (0.5 * rng.randn(E, D)).astype(np.float32)
    return x, ids, w, gate_up, down, gate_up_bias, down_bias


def pre_activations(x, ids, gate_up, gate_up_bias):
    """float64 [T, k, 2F]: the fused gate/up values each (token, choice) feeds the unit."""
    x, gate_up, b = (np.asarray(a, np.float64) for a in (x, gate_up, gate_up_bias))
    return np.einsum("td,tkdf->tkf", x, gate_up[ids]) + b[ids]


def test_case_hits_both_clamps_with_a_margin():
    """The shared case really exercises the clamps: some gates above LIMIT, some ups above LIMIT and
    some below -LIMIT, and none within 1e-3 of a clamp (where fp32 rounding could differ by backend)."""
    x, ids, w, gate_up, down, gub, db = make_case(0)
    gu = pre_activations(x, ids, gate_up, gub)
    g, u = gu[..., :F], gu[..., F:]
    assert (g > LIMIT).mean() > 0.1 and (u > LIMIT).mean() > 0.1 and (u < -LIMIT).mean() > 0.1
    assert (g < 0).mean() > 0.1  # the sigmoid's lower half too
    assert np.abs(np.abs(gu) - LIMIT).min() > 1e-3


def test_loop_matches_transformers_gpt_oss_experts():
    """gpt_oss_loop (specjax's [gate | up] layout) equals transformers' GptOssExperts (torch, fp64)
    with the same weights in HF's layout (gate in the even columns, up in the odd ones): 1e-10."""
    torch = pytest.importorskip("torch")
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    x, ids, w, gate_up, down, gub, db = make_case(0)
    cfg = GptOssConfig(hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K,
                       swiglu_alpha=ALPHA, swiglu_limit=LIMIT)
    mod = GptOssExperts(cfg).double()
    interleave = lambda a: np.stack([a[..., :F], a[..., F:]], axis=-1).reshape(*a.shape[:-1], 2 * F)  # noqa: E731
    with torch.no_grad():
        for name, value in (("gate_up_proj", interleave(gate_up)), ("gate_up_proj_bias", interleave(gub)),
                            ("down_proj", down), ("down_proj_bias", db)):
            getattr(mod, name).copy_(torch.from_numpy(np.asarray(value, np.float64)))
        hf = mod(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(ids.astype(np.int64)),
                 torch.from_numpy(w.astype(np.float64))).numpy()
    ours = gpt_oss_loop(x, ids, w, down, gate_up=gate_up, gate_up_bias=gub, down_bias=db)
    assert rel(ours, hf) <= 1e-10


def _impls():
    from specjax_kernels.moe import mgpu

    hopper = mgpu.available() is None
    return [*CPU_IMPLS, pytest.param("mgpu", marks=pytest.mark.skipif(not hopper, reason="mgpu needs a Hopper GPU"))]


VARIANTS = {
    # name: (form, with biases)
    "fused_biases": ("fused", True),
    "fused_no_bias": ("fused", False),
    "separate_down_bias": ("separate", True),  # separate gate / up take the down bias only
    "ungated_down_bias": ("ungated", True),
}


def _call(variant, impl, act=ACT):
    """f(x, ids, w, gate_up, down, gate_up_bias, down_bias) for one expert form."""
    form, biased = VARIANTS[variant]

    def f(x, ids, w, gate_up, down, gub, db):
        db = db if biased else None
        if form == "fused":
            return moe_experts(x, ids, w, gate_up_edf=gate_up, down_efd=down, gate_up_bias_ef=gub if biased else None,
                               down_bias_ed=db, activation=act, implementation=impl)
        if form == "separate":
            return moe_experts(x, ids, w, gate_edf=gate_up[..., :F], up_edf=gate_up[..., F:], down_efd=down,
                               down_bias_ed=db, activation=act, implementation=impl)
        return moe_experts(x, ids, w, up_edf=gate_up[..., F:], down_efd=down, down_bias_ed=db,
                           activation="relu2", implementation=impl)
    return f


def _want(variant, x, ids, w, gate_up, down, gub, db, act=ACT):
    form, biased = VARIANTS[variant]
    db = db if biased else None
    if form == "fused":
        return gpt_oss_loop(x, ids, w, down, gate_up=gate_up, gate_up_bias=gub if biased else None, down_bias=db,
                            act=act)
    if form == "separate":
        return gpt_oss_loop(x, ids, w, down, gate=gate_up[..., :F], up=gate_up[..., F:], down_bias=db, act=act)
    return gpt_oss_loop(x, ids, w, down, up=gate_up[..., F:], down_bias=db)


@pytest.mark.parametrize("impl", _impls())
def test_backends_match_the_loop(impl):
    """Each backend, each expert form (fused with both biases, fused without, separate gate/up with the
    down bias, ungated relu^2 with the down bias), clamped SwiGLU for the gated ones: fp32 within 1e-5
    of the float64 loop (one jit per backend, the four forms in it). bf16 inputs and biases (fused
    with biases) within 2e-2 of the fp32 result."""
    args = make_case(0)
    on_gpu = impl == "mgpu"
    if on_gpu:  # the Hopper kernel multiplies bf16 / fp16 in widths of 64: compare bf16 at 2e-2
        args = make_case(0, T=64, D=128, F=128)

    def all_forms(*a):
        return [_call(v, impl)(*a) for v in VARIANTS]

    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    cast = lambda a, dt=dtype: a if a.dtype == np.int32 else jnp.asarray(a, dt)  # noqa: E731
    outs = jax.jit(all_forms)(*map(cast, args))
    for variant, out in zip(VARIANTS, outs):
        assert out.shape == args[0].shape and out.dtype == dtype
        err = rel(out, _want(variant, *args))
        assert err <= (2e-2 if on_gpu else TOL), f"{impl}/{variant}: rel err {err:.2e}"
    if not on_gpu:
        bf = jax.jit(_call("fused_biases", impl))(*(cast(a, jnp.bfloat16) for a in args))
        assert bf.dtype == jnp.bfloat16 and rel(bf, outs[0]) <= 2e-2, f"{impl}: bf16 {rel(bf, outs[0]):.2e}"


def test_xla_small_blocks_with_biases():
    """xla's block loop with blocks of 8 rows (experts spanning several blocks, padded rows carrying a
    bias that must be dropped): the fused biased case within 1e-5 of the loop."""
    from specjax_kernels.moe import xla

    x, ids, w, gate_up, down, gub, db = make_case(1, T=30, k=2, E=3)
    out = jax.jit(lambda *a: xla.moe_experts(*a[:5], None, ACT, block=8, gate_up_bias=a[5], down_bias=a[6]))(
        x, ids, w, gate_up, down, gub, db)
    assert rel(out, gpt_oss_loop(x, ids, w, down, gate_up=gate_up, gate_up_bias=gub, down_bias=db)) <= TOL


def test_string_activation_without_bias_keeps_its_dtype_and_zero_biases_are_a_no_op():
    """A call without biases and with an elementwise activation (Qwen3-MoE's silu) computes its hidden
    rows in the GEMM's dtype as before biases existed: with bf16 experts the jaxpr holds no fp32 array of
    the hidden widths F or 2F (D = 24 differs from both); the biased path upcasts (the same check finds
    one). Zero biases give the no-bias values within 1e-6 in fp32, both within 1e-5 of the loop."""
    x, ids, w, gate_up, down, gub, db = make_case(2, T=10, D=24)
    hidden_f32 = re.compile(rf"f32\[\d+,(?:{F}|{2 * F})\]")
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    for impl in ("reference", "xla"):
        plain = lambda x, gu, dn: moe_experts(x, ids, w, gate_up_edf=gu, down_efd=dn, implementation=impl)  # noqa: E731
        zero = lambda x, gu, dn: moe_experts(x, ids, w, gate_up_edf=gu, down_efd=dn, implementation=impl,  # noqa: E731
                                             gate_up_bias_ef=jnp.zeros((E, 2 * F), x.dtype),
                                             down_bias_ed=jnp.zeros((E, 24), x.dtype))
        a, b = jax.jit(plain)(x, gate_up, down), jax.jit(zero)(x, gate_up, down)
        assert rel(a, b) <= 1e-6
        assert rel(a, gpt_oss_loop(x, ids, w, down, gate_up=gate_up, act="silu")) <= TOL
        assert not hidden_f32.search(str(jax.make_jaxpr(plain)(bf(x), bf(gate_up), bf(down)))), impl
        assert hidden_f32.search(str(jax.make_jaxpr(zero)(bf(x), bf(gate_up), bf(down)))), impl


def test_errors_name_the_fix():
    x, ids, w, gate_up, down, gub, db = make_case(3)
    gate, up = gate_up[..., :F], gate_up[..., F:]
    with pytest.raises(ValueError, match=r"gate_up_bias_ef needs the fused gate_up_edf.*separate.*concatenate"):
        moe_experts(x, ids, w, gate_edf=gate, up_edf=up, down_efd=down, gate_up_bias_ef=gub, activation=ACT)
    with pytest.raises(ValueError, match=r"gate_up_bias_ef needs the fused gate_up_edf.*ungated"):
        moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_up_bias_ef=gub, activation="relu2")
    with pytest.raises(ValueError, match=r"gate_up_bias_ef has shape \(4, 8\), want \[E, 2F\] = \(4, 16\)"):
        moe_experts(x, ids, w, gate_up_edf=gate_up, down_efd=down, gate_up_bias_ef=gub[:, :F], activation=ACT)
    with pytest.raises(ValueError, match=r"down_bias_ed has shape \(4, 8\), want \[E, D\] = \(4, 16\)"):
        moe_experts(x, ids, w, gate_up_edf=gate_up, down_efd=down, down_bias_ed=db[:, :8], activation=ACT)
    with pytest.raises(ValueError, match=r"'clamped_swiglu' acts on a gate and an up.*ungated.*pass gate_up_edf="):
        moe_experts(x, ids, w, up_edf=up, down_efd=down, activation=ACT)
    with pytest.raises(ValueError, match=r"takes \('clamped_swiglu', alpha, limit\)"):
        moe_experts(x, ids, w, gate_up_edf=gate_up, down_efd=down, activation=("clamped_swiglu", ALPHA))
    with pytest.raises(ValueError, match=r"unknown activation \('swiglu', 1.0\).*silu.*clamped_swiglu"):
        moe_experts(x, ids, w, gate_up_edf=gate_up, down_efd=down, activation=("swiglu", 1.0))
    with pytest.raises(ValueError, match=r"must be Python numbers"):
        jax.jit(lambda a: moe_experts(x, ids, w, gate_up_edf=gate_up, down_efd=down,
                                      activation=("clamped_swiglu", a, LIMIT)))(1.0)
    # a list is accepted as the tuple (a config may hold one)
    out = moe_experts(x, ids, w, gate_up_edf=gate_up, down_efd=down, activation=["clamped_swiglu", ALPHA, LIMIT],
                      implementation="reference")
    assert rel(out, gpt_oss_loop(x, ids, w, down, gate_up=gate_up)) <= TOL


@pytest.mark.parametrize("impl", ("xla", "reference"))
def test_vmap_over_rows_equals_unbatched_calls(impl):
    """The batched decoders vmap the op over rows: x / ids / w batched with shared experts and biases
    (per_token folds the rows into one call), and with a batched down bias (each member its own call):
    both within 1e-5 of a loop of unbatched calls."""
    x, ids, w, gate_up, down, gub, db = make_case(4, T=3 * 5)
    x, ids, w = x.reshape(3, 5, D), ids.reshape(3, 5, K), w.reshape(3, 5, K)
    f = jax.jit(_call("fused_biases", impl))
    loop = np.stack([f(x[i], ids[i], w[i], gate_up, down, gub, db) for i in range(3)])
    out = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None, None, None, None)))(x, ids, w, gate_up, down, gub, db)
    assert rel(out, loop) <= TOL
    dbs = np.stack([db, 2 * db, -db])
    loop = np.stack([f(x[i], ids[i], w[i], gate_up, down, gub, dbs[i]) for i in range(3)])
    out = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None, None, None, 0)))(x, ids, w, gate_up, down, gub, dbs)
    assert rel(out, loop) <= TOL


def test_gradients_match_the_reference():
    """jax.grad of sum(sin(out)) w.r.t. x, gate_up and both biases (fused, clamped SwiGLU): xla and
    pallas_tpu (megablox's VJP, interpreted) within 1e-5 of the reference; the bias gradients are not
    zero (they flow)."""
    x, ids, w, gate_up, down, gub, db = make_case(0)

    def grads(impl):
        f = _call("fused_biases", impl)
        loss = lambda x, gu, b1, b2: jnp.sum(jnp.sin(f(x, ids, w, gu, down, b1, b2)))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, gate_up, gub, db)

    ref = grads("reference")
    assert all(float(jnp.abs(g).max()) > 0 for g in ref)
    for impl in ("xla", "pallas_tpu"):
        for name, a, b in zip(("x", "gate_up", "gate_up_bias", "down_bias"), grads(impl), ref):
            assert rel(a, b) <= TOL, f"{impl}/{name}: {rel(a, b):.2e}"


def test_pallas_tpu_with_biases_lowers_for_tpu():
    """The pallas_tpu path with biases and the clamped SwiGLU lowers for a TPU from this host
    (`jax.export(..., platforms=["tpu"])`, Mosaic's TPU lowering): two grouped GEMMs (fused gate_up,
    down), both Mosaic calls, so the bias adds and the unit stay outside the kernels."""
    from specjax_kernels.moe import pallas_tpu
    from specjax_kernels.tpu_lowering import mosaic_call_count

    t, k, e, d, f = 256, 4, 8, 256, 128
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((t, d), bf), jax.ShapeDtypeStruct((t, k), jnp.int32),
            jax.ShapeDtypeStruct((t, k), bf), jax.ShapeDtypeStruct((e, d, 2 * f), bf),
            jax.ShapeDtypeStruct((e, f, d), bf), jax.ShapeDtypeStruct((e, 2 * f), bf), jax.ShapeDtypeStruct((e, d), bf))

    def layer(x, ids, w, gate_up, down, gub, db):
        return pallas_tpu.moe_experts(x, ids, w, gate_up, down, None, ACT, interpret=False, gate_up_bias=gub,
                                      down_bias=db)

    text = jax.export.export(jax.jit(layer), platforms=["tpu"])(*args).mlir_module()
    assert mosaic_call_count(text) >= 2 and len(re.findall(r"call @gmm\w*\(", text)) == 2

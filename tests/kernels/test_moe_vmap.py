"""specjax_kernels.moe under jax.vmap (the batched decoders vmap whole target decodes over rows).

moe_experts is per token, so with only x / ids / weights batched its vmap rule folds the vmapped axes
into the token axis (one call on [V*T] rows); with a batched expert weight each member runs on its own.
Both must equal a Python loop over the members: rel = max|vmap - loop| / max|loop| <= 1e-5 in fp32 (the
loop calls the same implementation unbatched; pallas_gpu in interpret mode on CPU), for gated (separate
gate/up and fused gate_up) and ungated relu^2 experts, one and two vmapped axes. Gradients (grad,
vmap-of-grad, grad-of-vmap) stay those of the unbatched function within 1e-5. mgpu cannot run on CPU: a
stand-in grouped GEMM in its place checks that a vmapped call reaches the kernel once, on the folded rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax_kernels.moe import moe_experts
from test_moe import make_case, rel

IMPLS = ("xla", "reference", "pallas_gpu")
TOL = 1e-5
T, K, E, D, F = 6, 2, 8, 16, 12


def batch(lead, seed=0, gated=True, T=T, D=D, F=F, dtype=np.float32):
    """x [*lead, T, D], ids / w [*lead, T, k] of independent members; one set of expert weights."""
    n = int(np.prod(lead))
    cases = [make_case(seed + i, T=T, k=K, E=E, D=D, F=F, gated=gated) for i in range(n)]
    x, ids, w = (np.stack([c[j] for c in cases]).reshape(*lead, *cases[0][j].shape) for j in range(3))
    up, down, gate = cases[0][3:]
    return x.astype(dtype), ids, w.astype(dtype), up.astype(dtype), down.astype(dtype), \
        None if gate is None else gate.astype(dtype)


def experts(variant, impl):
    """moe_experts(x, ids, w, up, down, gate) for one expert layout: separate gate/up, fused gate_up
    [gate | up], or ungated relu^2 (gate unused)."""
    def f(x, ids, w, up, down, gate):
        if variant == "fused":
            return moe_experts(x, ids, w, gate_up_edf=jnp.concatenate([gate, up], -1), down_efd=down,
                               implementation=impl)
        if variant == "relu2":
            return moe_experts(x, ids, w, up_edf=up, down_efd=down, activation="relu2", implementation=impl)
        return moe_experts(x, ids, w, up_edf=up, gate_edf=gate, down_efd=down, implementation=impl)
    return f


def loop(f, x, ids, w, *weights, weight_axes=None):
    """f member by member over the leading axes of x / ids / w (and of the weights in weight_axes)."""
    lead = x.shape[:-2]
    out = np.zeros(x.shape, np.float32)
    for i in np.ndindex(*lead):
        ws = [a[i] if weight_axes and j in weight_axes else a for j, a in enumerate(weights)]
        out[i] = f(x[i], ids[i], w[i], *ws)
    return out


@pytest.mark.parametrize("variant", ["separate", "fused", "relu2"])
@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_equals_loop(impl, variant):
    x, ids, w, up, down, gate = batch((3,), gated=variant != "relu2")
    gate = up if gate is None else gate  # relu2 ignores it
    f = experts(variant, impl)
    out = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, None, None, None)))(x, ids, w, up, down, gate)
    err = rel(out, loop(jax.jit(f), x, ids, w, up, down, gate))
    assert out.shape == x.shape and err <= TOL, f"{impl}/{variant}: rel err {err:.2e}"


@pytest.mark.parametrize("impl", IMPLS)
def test_nested_vmap_and_partly_batched(impl):
    """Two vmapped axes fold into one call; ids / weights batched with x shared (broadcast first)."""
    x, ids, w, up, down, gate = batch((2, 3), seed=10)
    f = experts("separate", impl)
    inner = jax.vmap(f, in_axes=(0, 0, 0, None, None, None))
    out = jax.jit(jax.vmap(inner, in_axes=(0, 0, 0, None, None, None)))(x, ids, w, up, down, gate)
    assert rel(out, loop(jax.jit(f), x, ids, w, up, down, gate)) <= TOL
    shared_x = jax.jit(jax.vmap(f, in_axes=(None, 0, 0, None, None, None)))(x[0, 0], ids[0], w[0], up, down, gate)
    assert rel(shared_x, loop(jax.jit(f), np.broadcast_to(x[0, 0], x[0].shape), ids[0], w[0], up, down, gate)) <= TOL


@pytest.mark.parametrize("impl", IMPLS)
def test_batched_expert_weights_run_each_member(impl):
    """A batched expert weight cannot fold: each member runs with its own weights (lax.map); also
    with weights batched on the outer of two axes and x on both (inner fold inside the outer map)."""
    x, ids, w, up, down, gate = batch((3,), seed=20)
    ups = np.stack([up, 0.5 * up, -up])
    f = experts("separate", impl)
    out = jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None, None)))(x, ids, w, ups, down, gate)
    assert rel(out, loop(jax.jit(f), x, ids, w, ups, down, gate, weight_axes={0})) <= TOL

    x2, ids2, w2 = (np.stack([a, a[::-1]], axis=1) for a in (x, ids, w))  # [3, 2, T, ...]
    inner = jax.vmap(f, in_axes=(0, 0, 0, None, None, None))
    out = jax.jit(jax.vmap(inner, in_axes=(0, 0, 0, 0, None, None)))(x2, ids2, w2, ups, down, gate)
    want = np.stack([loop(jax.jit(f), x2[i], ids2[i], w2[i], ups[i], down, gate) for i in range(3)])
    assert rel(out, want) <= TOL


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
def test_gradients_through_the_vmap_rule(impl):
    """grad of a function calling moe_experts equals the reference's (ragged_dot's own autodiff), and
    vmap-of-grad / grad-of-vmap equal the members' own gradients (custom_vmap alone has no reverse mode;
    moe_experts differentiates the plain function)."""
    x, ids, w, up, down, gate = batch((2,), seed=30)

    def loss(impl):
        return lambda x, ids, w, up: jnp.sum(jnp.sin(experts("separate", impl)(x, ids, w, up, down, gate)))

    grad = jax.jit(jax.grad(loss(impl), argnums=(0, 3)))
    ref = jax.jit(jax.grad(loss("reference"), argnums=(0, 3)))
    for a, b in zip(grad(x[0], ids[0], w[0], up), ref(x[0], ids[0], w[0], up)):
        assert rel(a, b) <= TOL
    members = [grad(x[i], ids[i], w[i], up) for i in range(2)]
    gx = jax.jit(jax.vmap(jax.grad(loss(impl)), in_axes=(0, 0, 0, None)))(x, ids, w, up)
    assert rel(gx, np.stack([m[0] for m in members])) <= TOL
    total = lambda x, up: jnp.sum(jax.vmap(loss(impl), in_axes=(0, 0, 0, None))(x, ids, w, up))  # noqa: E731
    gx, gup = jax.jit(jax.grad(total, argnums=(0, 1)))(x, up)
    assert rel(gx, np.stack([m[0] for m in members])) <= TOL
    assert rel(gup, members[0][1] + members[1][1]) <= TOL


def test_mgpu_kernel_called_once_on_folded_rows(monkeypatch):
    """mgpu (no batching rule of its own) with a stand-in grouped GEMM in place of the Hopper kernel (a
    host callback, which sees each call the compiled program makes): a vmap over 2 x 3 members runs the
    kernel once per projection, on all 2*3*T*k rows, and equals
    the members' own calls (bf16 in, fp32 accumulation as the kernel: 1e-5 of the same stand-in's loop);
    a batched weight sends each member to the kernel on its own T*k rows."""
    from specjax_kernels.moe import mgpu

    rows = []  # lhs rows of each kernel call, recorded when the compiled program runs it

    def host_gmm(lhs, rhs, group_sizes):
        rows.append(lhs.shape[0])
        out, start = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32), 0
        for g, n in enumerate(group_sizes):
            out[start:start + n] = lhs[start:start + n].astype(np.float32) @ rhs[g].astype(np.float32)
            start += n
        return out.astype(lhs.dtype)

    def stand_in(lhs, rhs, group_sizes, blocks=None):
        shape = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[2]), lhs.dtype)
        return jax.pure_callback(host_gmm, shape, lhs, rhs.astype(lhs.dtype), group_sizes)

    monkeypatch.setattr(mgpu, "available", lambda: None)
    monkeypatch.setattr(mgpu, "_gmm", stand_in)
    x, ids, w, up, down, gate = batch((2, 3), seed=40, D=64, F=64, dtype=jnp.bfloat16)
    f = experts("separate", "mgpu")
    inner = jax.vmap(f, in_axes=(0, 0, 0, None, None, None))
    out = np.asarray(jax.jit(jax.vmap(inner, in_axes=(0, 0, 0, None, None, None)))(x, ids, w, up, down, gate))
    assert rows == [2 * 3 * T * K] * 3  # gate, up, down: one call each on the folded rows
    rows.clear()
    assert rel(out, loop(jax.jit(f), x, ids, w, up, down, gate)) <= TOL
    rows.clear()
    ups = np.stack([up, up[::-1]])
    np.asarray(jax.jit(jax.vmap(f, in_axes=(0, 0, 0, 0, None, None)))(x[:, 0], ids[:, 0], w[:, 0], ups, down, gate))
    assert rows == [T * K] * 3 * 2  # each member on its own rows (lax.map)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_mgpu_vmap_equals_loop_on_gpu():
    """The real Hopper kernel (bf16) under vmap, folded into one call, against the members' own calls:
    the same rows through the same kernel tiles, so within bf16 rounding (1e-2 relative)."""
    from specjax_kernels.moe import mgpu

    if mgpu.available():
        pytest.skip(mgpu.available())
    x, ids, w, up, down, gate = batch((2, 4), seed=50, D=256, F=128, dtype=jnp.bfloat16)
    for variant in ("separate", "fused", "relu2"):
        f = experts(variant, "mgpu")
        inner = jax.vmap(f, in_axes=(0, 0, 0, None, None, None))
        out = jax.jit(jax.vmap(inner, in_axes=(0, 0, 0, None, None, None)))(x, ids, w, up, down, gate)
        err = rel(out, loop(jax.jit(f), x, ids, w, up, down, gate))
        assert err <= 1e-2, f"{variant}: rel err {err:.2e}"

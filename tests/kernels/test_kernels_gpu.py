"""GPU-only kernel checks (pallas_gpu, triton) against the jnp reference; run on the H200:

    JAX_PLATFORMS=cuda PYTHONPATH=kernels:. python -m pytest tests/kernels/test_kernels_gpu.py -m gpu

The reference runs in f32 on the same (upcast) inputs. Errors are ||out - ref|| / ||ref|| over the whole
tensor: f32 inputs must land under 1e-4 (the kernels use IEEE f32 dots then), bf16 inputs under 2e-2
(bf16 operands, f32 accumulation). Skipped when there is no GPU (CPU CI)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax_kernels.soft_ce import fused_linear_soft_ce
from specjax_kernels.ttt_attention import ttt_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")]

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "non-finite values in the kernel output"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def ttt_inputs(seed, B, T, Hq, Hkv, D, k, dtype):
    ks = jax.random.split(jax.random.key(seed), 6)
    n = lambda key, s: jax.random.normal(key, s, jnp.float32).astype(dtype)
    kd = n(ks[3], (k, B, T, Hkv, D)) if k else None
    vd = n(ks[4], (k, B, T, Hkv, D)) if k else None
    return n(ks[0], (B, T, Hq, D)), n(ks[1], (B, T, Hkv, D)), n(ks[2], (B, T, Hkv, D)), kd, vd, \
        n(ks[5], (B, T, Hq, D))


def up(x):
    return None if x is None else x.astype(jnp.float32)


@pytest.mark.parametrize("impl", ["triton", "pallas_gpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
# D = 256: the width DeepSeek-V3's MLA attends at (the wide-head tiles)
@pytest.mark.parametrize("k,Hq,Hkv,D,packed", [(0, 4, 4, 64, False), (3, 8, 2, 128, True), (6, 4, 1, 64, True),
                                               (0, 4, 2, 256, True)])
def test_ttt_attention_gpu(impl, dtype, k, Hq, Hkv, D, packed):
    B, T = 2, 300  # T not a multiple of any kernel block
    q, k0, v0, kd, vd, do = ttt_inputs(k + D, B, T, Hq, Hkv, D, k, dtype)
    seg = jnp.asarray(np.repeat([[1, 2, 3, 0]], B, 0).repeat([90, 120, 80, 10], 1), jnp.int32) if packed else None

    def f(impl, *a):
        return ttt_attention(*a, seg, implementation=impl)

    out, vjp = jax.vjp(jax.jit(lambda *a: f(impl, *a)), q, k0, v0, kd, vd)
    assert out.dtype == dtype
    ref, ref_vjp = jax.vjp(jax.jit(lambda *a: f("reference", *a)), *map(up, (q, k0, v0, kd, vd)))
    assert rel(out, ref) < TOL[dtype]
    for name, g, r in zip(["dq", "dk0", "dv0", "dk_diag", "dv_diag"], vjp(do), ref_vjp(up(do))):
        if r is not None:
            assert rel(g, r) < TOL[dtype], name


@pytest.mark.parametrize("impl", ["triton", "pallas_gpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("teacher", ["logits", "hidden"])
def test_fused_soft_ce_gpu(impl, dtype, teacher):
    N, H, V, Ht = 300, 256, 1000, 192  # N, V not multiples of the 128 tiles
    ks = jax.random.split(jax.random.key(1), 6)
    h = jax.random.normal(ks[0], (N, H)).astype(dtype)
    w = (0.1 * jax.random.normal(ks[1], (V, H))).astype(dtype)
    mask = (jax.random.uniform(ks[5], (N,)) > 0.2).astype(jnp.float32)
    if teacher == "logits":
        kw = dict(teacher_logits=3 * jax.random.normal(ks[2], (N, V)))
        kw_ref = kw
    else:
        th = jax.random.normal(ks[3], (N, Ht)).astype(dtype)
        tw = (0.1 * jax.random.normal(ks[4], (V, Ht))).astype(dtype)
        kw, kw_ref = dict(teacher_hidden=th, teacher_head=tw), dict(teacher_hidden=up(th), teacher_head=up(tw))
    g = jax.random.normal(ks[5], (N,))

    def run(impl, h, w, kw):
        f = jax.jit(lambda h, w: fused_linear_soft_ce(h, w, mask=mask, return_argmax=True, implementation=impl, **kw))
        (loss, amax), vjp = jax.vjp(f, h, w)
        return loss, amax, vjp((g, np.zeros(amax.shape, jax.dtypes.float0)))

    loss, amax, (dh, dw) = run(impl, h, w, kw)
    rloss, ramax, (rdh, rdw) = run("reference", up(h), up(w), kw_ref)
    assert rel(loss, rloss) < TOL[dtype]
    assert rel(dh, rdh) < TOL[dtype] and rel(dw, rdw) < TOL[dtype]
    if dtype == jnp.float32:  # bf16 logits can legitimately reorder near-ties
        assert float(jnp.mean(amax == ramax)) > 0.99


# ---- routed experts: JAX's Hopper grouped GEMM (specjax_kernels.moe, implementation="mgpu") ------------
MOE_CASES = {
    # name: T, k, E, D, F, skew (experts every token is pushed to)
    "balanced": (300, 4, 16, 256, 128, None),  # 1200 rows: not a multiple of the 128-row tile
    "empty_experts": (64, 1, 64, 128, 256, None),  # most experts get no row
    "one_expert_takes_all": (257, 2, 8, 128, 128, [3, 5]),
    "narrow_width": (200, 6, 16, 192, 320, None),  # widths that are multiples of 64, not 128 (Nemotron-H's 1856)
}


@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_mgpu_matches_reference(case):
    from specjax_kernels.moe import moe_experts

    if not str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9."):
        pytest.skip("mgpu needs a Hopper GPU")
    T, k, E, D, F, skew = MOE_CASES[case]
    rng = np.random.RandomState(0)
    logits = rng.randn(T, E)
    if skew:
        logits[:, skew] += 20.0
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = jnp.asarray(np.argsort(-probs, -1, kind="stable")[:, :k], jnp.int32)
    w = jnp.asarray(np.take_along_axis(probs, np.asarray(ids), -1), jnp.bfloat16)
    bf = lambda *s: jnp.asarray(rng.randn(*s) * s[-2] ** -0.5, jnp.bfloat16)  # noqa: E731
    x, up, gate, down = jnp.asarray(rng.randn(T, D), jnp.bfloat16), bf(E, D, F), bf(E, D, F), bf(E, F, D)
    run = lambda impl: jax.jit(lambda x, ids, w: moe_experts(  # noqa: E731
        x, ids, w, up_edf=up, down_efd=down, gate_edf=gate, implementation=impl))(x, ids, w)
    out = run("mgpu")
    assert out.dtype == jnp.bfloat16
    assert rel(out, run("reference").astype(jnp.float32)) < TOL[jnp.bfloat16]
    # the fused [gate | up] weight: one grouped GEMM of width 2F, same experts
    gate_up = jnp.concatenate([gate, up], axis=-1)
    fused = jax.jit(lambda x, ids, w: moe_experts(x, ids, w, gate_up_edf=gate_up, down_efd=down,
                                                  implementation="mgpu"))(x, ids, w)
    assert rel(fused, run("reference").astype(jnp.float32)) < TOL[jnp.bfloat16]


def test_moe_auto_takes_mgpu_on_one_hopper_gpu(monkeypatch):
    """auto = mgpu for bf16 on one Hopper GPU (the measured train-step win), xla for fp32 (the kernel
    multiplies bf16/fp16) and xla when several devices are visible (not partitioned)."""
    from specjax_kernels.moe import api, mgpu, xla

    if not str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9."):
        pytest.skip("mgpu needs a Hopper GPU")
    used = []
    monkeypatch.setattr(mgpu, "moe_experts", lambda *a: used.append("mgpu") or a[0])
    monkeypatch.setattr(xla, "moe_experts", lambda *a: used.append("xla") or a[0])
    E, D, F, T = 4, 128, 128, 8
    ids, w = jnp.zeros((T, 1), jnp.int32), jnp.ones((T, 1), jnp.bfloat16)
    for dtype in (jnp.bfloat16, jnp.float32):
        ws = [jnp.zeros(s, dtype) for s in ((E, D, F), (E, F, D))]
        api.moe_experts(jnp.zeros((T, D), dtype), ids, w.astype(dtype), up_edf=ws[0], down_efd=ws[1])
    monkeypatch.setattr(jax, "device_count", lambda: 2)
    ws = [jnp.zeros(s, jnp.bfloat16) for s in ((E, D, F), (E, F, D))]
    api.moe_experts(jnp.zeros((T, D), jnp.bfloat16), ids, w, up_edf=ws[0], down_efd=ws[1])
    api.moe_experts(jnp.zeros((T, D), jnp.bfloat16), ids, w, up_edf=ws[0], down_efd=ws[1], implementation="mgpu")
    assert used == ["mgpu", "xla", "xla", "mgpu"]


# ---- cached decoding's attention over the stacked KV cache (specjax_kernels.decode_attention) ----------
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype,T", [(jnp.bfloat16, 1), (jnp.bfloat16, 6), (jnp.float32, 6)])
def test_decode_attention_pallas_gpu(dtype, T, splits):
    from specjax_kernels.decode_attention import pallas_gpu, reference

    rng = np.random.default_rng(T)
    L, B, S, K, H, G = 4, 5, 1536, 3, 64, 3
    k = jnp.asarray(rng.normal(size=(L, B, S, K, H)), dtype)
    v = jnp.asarray(rng.normal(size=(L, B, S, K, H)), dtype)
    q = jnp.asarray(rng.normal(size=(B, T, K * G, H)), dtype)
    start = np.array([0, 63, 64, 700, S - T])
    mask = np.zeros((B, T, S), bool)
    for b in range(B):
        mask[b, :, : start[b]] = True
        mask[b, :, start[b]: start[b] + T] = np.tril(np.ones((T, T), bool))
    mask, limit = jnp.asarray(mask), jnp.asarray(start + T, jnp.int32)
    with jax.default_matmul_precision("highest"):
        want = reference.decode_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), 2,
                                          mask, limit, 0.125)
        got = jax.jit(lambda *a: pallas_gpu.decode_attention(*a, 0.125, splits=splits))(q, k, v, jnp.int32(2), mask,
                                                                                         limit)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    assert float(jnp.abs(got.astype(jnp.float32) - want).max()) < tol


# ---- the context-parallel block-0 forward with a global query offset (issue 23) --------------------------
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_ttt_fwd0_offset_pallas_gpu(dtype):
    """pallas_gpu.fwd0_offset (a shard's queries against all-gathered keys) equals xla.fwd0_offset at
    query offsets 0, a middle shard and the last shard; packed segments."""
    from specjax_kernels.ttt_attention import pallas_gpu, xla

    rng = np.random.default_rng(0)
    B, Tk, Hq, Hkv, D, bs = 2, 1024, 8, 2, 64, 64
    k = jnp.asarray(rng.normal(size=(B, Tk, Hkv, D)), dtype)
    v = jnp.asarray(rng.normal(size=(B, Tk, Hkv, D)), dtype)
    seg = jnp.asarray(np.sort(rng.integers(1, 5, size=(B, Tk)), axis=1), jnp.int32)
    for shard in (0, 1, 3):  # 4 shards of 256 query rows
        q = jnp.asarray(rng.normal(size=(B, 256, Hq, D)), dtype)
        sq = seg[:, shard * 256:(shard + 1) * 256]
        with jax.default_matmul_precision("highest"):
            o_x, l_x = xla.fwd0_offset(q, k, v, sq, seg, shard * 256 // bs, 0.125, block=bs)
            o_p, l_p = jax.jit(lambda *a: pallas_gpu.fwd0_offset(*a, 0.125, block=bs))(q, k, v, sq, seg,
                                                                                       jnp.int32(shard * 256 // bs))
        tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
        assert float(jnp.abs(o_p - o_x).max()) < tol and float(jnp.abs(l_p - l_x).max()) < tol, shard


@pytest.mark.parametrize("impl", ["triton", "pallas_gpu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ttt_attention_sinks_gpu(impl, dtype):
    """Attention sinks (gpt-oss) merged with the kernels' logsumexp: forward and dq/dk/dv/dsinks."""
    B, T, Hq, Hkv, D = 2, 300, 8, 2, 64
    q, k0, v0, _, _, do = ttt_inputs(11, B, T, Hq, Hkv, D, 0, dtype)
    seg = jnp.asarray(np.repeat([[1, 2, 3, 0]], B, 0).repeat([90, 120, 80, 10], 1), jnp.int32)
    sinks = 3.0 * jax.random.normal(jax.random.key(4), (Hq,), jnp.float32)

    def f(impl, q, k, v, s):
        return ttt_attention(q, k, v, None, None, seg, implementation=impl, sinks=s)

    out, vjp = jax.vjp(jax.jit(lambda *a: f(impl, *a)), q, k0, v0, sinks)
    ref, ref_vjp = jax.vjp(jax.jit(lambda *a: f("reference", *a)), *map(up, (q, k0, v0)), sinks)
    assert rel(out, ref) < TOL[dtype]
    for name, g, r in zip(["dq", "dk0", "dv0", "dsinks"], vjp(do), ref_vjp(up(do))):
        assert rel(g, r) < TOL[dtype], name

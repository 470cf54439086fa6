"""The target's training-time self-attention through the TTT-attention kernels (k = 0, no diagonal
keys) equals the plain segment-causal GQA path. On GPU `implementation=None` picks the kernel; on CPU
the kernels run as `xla` and Pallas GPU in interpret mode (triton needs a GPU: run this file on the
device with JAX_PLATFORMS=cuda). Tolerance: 2e-5 absolute (fp32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.targets.layers.attention import dot_product_attention, segment_causal_mask


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu", "triton", None])
def test_kernel_path_matches_plain(impl):
    if impl in ("triton", None) and jax.default_backend() != "gpu":
        pytest.skip("triton needs an NVIDIA GPU; None is the kernel only on GPU (CPU: the test below)")
    B, T, Hq, Hkv, D = 2, 80, 4, 2, 16  # T not a multiple of the kernels' blocks
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32)
    k = jax.random.normal(kk, (B, T, Hkv, D), jnp.float32)
    v = jax.random.normal(kv, (B, T, Hkv, D), jnp.float32)
    seg = np.ones((B, T), np.int32)
    seg[0, 30:] = 2  # two packed documents in row 0
    seg[1, 70:] = 0  # padding tail in row 1
    mask = segment_causal_mask(jnp.asarray(seg))
    plain = dot_product_attention(q, k, v, mask, scale=D**-0.5, implementation="plain")
    fast = dot_product_attention(q, k, v, mask, scale=D**-0.5, implementation=impl)
    valid = seg > 0  # padded rows are garbage by contract
    np.testing.assert_allclose(np.asarray(fast)[valid], np.asarray(plain)[valid], atol=2e-5, rtol=0)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU default")
def test_cpu_default_is_the_plain_path():
    B, T, H, D = 1, 16, 2, 8
    q = k = v = jax.random.normal(jax.random.key(1), (B, T, H, D), jnp.float32)
    mask = segment_causal_mask(jnp.ones((B, T), jnp.int32))
    a = dot_product_attention(q, k, v, mask, scale=D**-0.5)
    b = dot_product_attention(q, k, v, mask, scale=D**-0.5, implementation="plain")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_selects_the_target_attention_path(tiny_target, monkeypatch):
    """kernels.target_attention / target_attention_q_block reach the target's forward: the loaded
    target calls the chosen kernel (seen by wrapping the ttt_attention entry point), and its logits
    equal the plain path's (2e-5, fp32)."""
    from specjax.config import load_config
    from specjax.targets.layers import attention as attn_mod  # the module whose attention block calls the kernel
    from specjax.train import setup

    def build(*overrides):
        cfg = load_config(None, [f"target.path={tiny_target}", "target.dtype=float32", *overrides])
        return setup.build_target(cfg)

    plain = build("kernels.target_attention=plain", "kernels.target_attention_q_block=8")
    fast = build("kernels.target_attention=xla")
    assert (plain.config.kernels.target_attention, plain.config.kernels.target_attention_q_block) == ("plain", 8)
    assert fast.config.kernels.target_attention == "xla"
    calls = []
    real = attn_mod.ttt_attention

    def spy(*a, **k):
        calls.append(k.get("implementation"))
        return real(*a, **k)

    monkeypatch.setattr(attn_mod, "ttt_attention", spy)
    ids = jnp.asarray(np.arange(1, 33, dtype=np.int32)[None] % 300)
    seg = jnp.ones_like(ids)
    want = plain(ids, segment_ids=seg).logits
    assert calls == []  # the plain path builds its own scores
    got = fast(ids, segment_ids=seg).logits
    assert calls and set(calls) == {"xla"}
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=0)


def _numpy_window_attention(q, k, v, seg, window, scale):
    """Independent reference: per row, query i sees key j iff j <= i, same segment, i - window < j."""
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros_like(q)
    for r in range(b):
        for h in range(hq):
            s = (q[r, :, h] @ k[r, :, h // g].T) * scale
            i, j = np.arange(t)[:, None], np.arange(t)[None, :]
            ok = (j <= i) & (seg[r][:, None] == seg[r][None, :]) & (j > i - window)
            s = np.where(ok, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[r, :, h] = (p / p.sum(-1, keepdims=True)) @ v[r, :, h // g]
    return out


@pytest.mark.parametrize("impl", ["plain", "xla"])
@pytest.mark.parametrize("window", [5, 200])  # 200 >= T: the window hides nothing (the kernel runs)
@pytest.mark.parametrize("traced", [False, True])  # a per-layer window in a scan is a traced scalar
def test_sliding_window_mask_on_every_path(impl, window, traced):
    """Sliding-window self-attention (Mistral, Gemma 3 local layers) equals a NumPy reference on packed
    rows: plain blocked path, and the kernel setting (which runs the kernel where the window covers the
    sequence and the plain path where it cuts; a traced window picks with lax.cond). 2e-5 absolute."""
    B, T, Hq, Hkv, D = 2, 40, 4, 2, 8
    kq, kk, kv = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32)
    k = jax.random.normal(kk, (B, T, Hkv, D), jnp.float32)
    v = jax.random.normal(kv, (B, T, Hkv, D), jnp.float32)
    seg = np.ones((B, T), np.int32)
    seg[0, 17:] = 2
    ref = _numpy_window_attention(*(np.asarray(x, np.float64) for x in (q, k, v)), seg, window, D**-0.5)

    def run(w):
        mask = segment_causal_mask(jnp.asarray(seg)).with_window(w)
        return dot_product_attention(q, k, v, mask, scale=D**-0.5, q_block=8, implementation=impl)

    got = jax.jit(run)(jnp.int32(window)) if traced else run(window)
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5, rtol=0)
    if window < T:  # the window matters here: without it the result is far off
        assert np.abs(np.asarray(run(None)) - ref).max() > 1e-2

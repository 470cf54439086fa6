"""Pallas kernels on CPU in interpret mode (pallas_tpu with TPU interpret semantics, pallas_gpu with the
generic interpreter), forward and all five gradients against the jnp reference.

T = 40 with 16-wide tiles: 3 blocks, the last one padded; GQA 4:2; packed segments with padding.
f32 throughout; tolerance 2e-5 (measured ~1e-6; a wrong mask or a dropped block is O(1e-1))."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax_kernels.ttt_attention import ttt_attention

SEG = jnp.asarray([[1] * 13 + [2] * 20 + [0] * 7, [4] * 40], jnp.int32)


def _inputs(k, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    B, T, Hq, Hkv, D = 2, 40, 4, 2, 16
    kd = jax.random.normal(ks[3], (k, B, T, Hkv, D)) if k else None
    vd = jax.random.normal(ks[4], (k, B, T, Hkv, D)) if k else None
    return (jax.random.normal(ks[0], (B, T, Hq, D)), jax.random.normal(ks[1], (B, T, Hkv, D)),
            jax.random.normal(ks[2], (B, T, Hkv, D)), kd, vd), jax.random.normal(ks[5], (B, T, Hq, D))


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("k,packed", [(3, True), (0, False)])
def test_pallas_interpret_matches_reference(impl, k, packed):
    args, cot = _inputs(k)
    seg = SEG if packed else None
    argnums = (0, 1, 2, 3, 4) if k else (0, 1, 2)

    def run(impl, block):
        f = lambda *a: ttt_attention(*a, seg, implementation=impl, block_size=block)
        out, vjp = jax.vjp(f, *args[:len(argnums)])
        return out, vjp(cot)

    out, grads = jax.jit(lambda: run(impl, 16))()
    ref, rgrads = jax.jit(lambda: run("reference", None))()
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    for g, r, name in zip(grads, rgrads, ["dq", "dk0", "dv0", "dk_diag", "dv_diag"]):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("impl", ["xla", "pallas_gpu"])
def test_attention_sinks_match_the_reference_and_the_plain_path(impl):
    """Attention sinks (gpt-oss: one more logit per head in the softmax denominator, no value): the kernels
    merge them with their logsumexp. Forward, dq/dk/dv and the sinks' own gradient against the reference
    (its sink is a softmax column), and the reference against the target's plain path (specjax.targets
    attention's `_attend`, the sink in its denominator), f32, 2e-5. The sinks are large enough (+-3) to
    take a visible share of the mass: dropping them moves the output by O(1e-1)."""
    from specjax.targets.layers.attention import SegmentCausalMask, dot_product_attention

    args, cot = _inputs(0, seed=3)
    q, k0, v0 = args[:3]
    sinks = 3.0 * jax.random.normal(jax.random.key(9), (q.shape[2],))

    def run(impl, block):
        f = lambda q, k, v, s: ttt_attention(q, k, v, None, None, SEG, implementation=impl, block_size=block,
                                             sinks=s)
        out, vjp = jax.vjp(f, q, k0, v0, sinks)
        return out, vjp(cot)

    out, grads = jax.jit(lambda: run(impl, 16))()
    ref, rgrads = jax.jit(lambda: run("reference", None))()
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    for g, r, name in zip(grads, rgrads, ["dq", "dk0", "dv0", "dsinks"]):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5, err_msg=name)
    plain = dot_product_attention(q, k0, v0, SegmentCausalMask(SEG), scale=q.shape[-1] ** -0.5,
                                  implementation="plain", sinks=sinks)
    valid = np.asarray(SEG > 0)[:, :, None, None]
    np.testing.assert_allclose(np.where(valid, ref, 0), np.where(valid, plain, 0), rtol=2e-5, atol=2e-5)
    no_sink = ttt_attention(q, k0, v0, None, None, SEG, implementation="reference")
    assert float(jnp.max(jnp.abs(no_sink - ref))) > 1e-1


@pytest.mark.parametrize("traced", [False, True])
def test_banded_window_reads_only_its_keys_and_equals_the_full_rows(traced):
    """A sliding window with a static band (SegmentCausalMask.band: the config's window when the layer
    scan traces it): each query block reads q_block + band keys; the output equals the mask materialised
    over all keys (plain path, sinks on), and a full-attention layer of the same scan (window past the
    band) is not banded."""
    from specjax.targets.layers.attention import SegmentCausalMask, dot_product_attention

    args, _ = _inputs(0, seed=5)
    q, k0, v0 = args[:3]
    sinks = jax.random.normal(jax.random.key(2), (q.shape[2],))
    scale = q.shape[-1] ** -0.5
    for window in (5, 2**30):
        w = jnp.int32(window) if traced else window
        lazy = SegmentCausalMask(SEG).with_window(w, band=5)
        full = SegmentCausalMask(SEG).with_window(window).materialize()
        f = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, lazy, scale=scale, q_block=8,
                                                          implementation="plain", sinks=sinks))
        g = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, full, scale=scale, q_block=8,
                                                          implementation="plain", sinks=sinks))
        np.testing.assert_allclose(f(q, k0, v0), g(q, k0, v0), rtol=2e-6, atol=2e-6, err_msg=str(window))

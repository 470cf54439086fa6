"""specjax_kernels.quant: the dequantizers of published checkpoint formats, against independent decoders.

MXFP4 against (a) a NumPy decoder written from the OCP Microscaling definition (E2M1 bit fields,
E8M0 exponent; per element, no lookup table) and (b) transformers' own gpt-oss loader
(integrations.mxfp4.convert_moe_packed_tensors, torch), on random bytes covering every code and a
range of scales: exact in fp32 (every value is a small integer times a power of two). FP8 block
scales against a NumPy loop over the 128x128 blocks (ml_dtypes decodes e4m3fn): exact in fp32.
"""
import numpy as np
import pytest
import jax.numpy as jnp
import ml_dtypes

from specjax_kernels.quant import fp8_block_dequantize, mxfp4_dequantize


def _e2m1(code: int) -> float:
    """E2M1 from its bits: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0); exponent 0 is subnormal."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 1
    mag = man * 0.5 if exp == 0 else (1.0 + man * 0.5) * 2.0 ** (exp - 1)
    return sign * mag


def _numpy_mxfp4(blocks, scales):
    out = np.zeros(blocks.shape[:-2] + (blocks.shape[-2] * 32,), np.float32)
    for idx in np.ndindex(*blocks.shape[:-1]):
        scale = 2.0 ** (int(scales[idx]) - 127)
        for byte_i, byte in enumerate(blocks[idx]):
            for half, code in enumerate((int(byte) & 0xF, int(byte) >> 4)):
                out[idx[:-1] + (idx[-1] * 32 + 2 * byte_i + half,)] = _e2m1(code) * scale
    return out


def _random_mxfp4(shape_groups, seed=0):
    r = np.random.default_rng(seed)
    blocks = r.integers(0, 256, shape_groups + (16,), dtype=np.uint8)
    scales = r.integers(127 - 6, 127 + 6, shape_groups, dtype=np.uint8)
    return blocks, scales


def test_mxfp4_matches_the_bit_level_decoder():
    blocks, scales = _random_mxfp4((2, 3, 2))
    got = np.asarray(mxfp4_dequantize(jnp.asarray(blocks), jnp.asarray(scales), jnp.float32))
    assert got.shape == (2, 3, 64)
    np.testing.assert_array_equal(got, _numpy_mxfp4(blocks, scales))
    assert len(np.unique(np.abs(got[got != 0]) / 2.0 ** np.floor(np.log2(np.abs(got[got != 0]))))) >= 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_mxfp4_transposed_writes_the_in_out_layout(dtype):
    """transposed=True (the [in, out] operand gpt-oss's layer scan feeds the grouped GEMM) equals the
    bit-level decoder's [..., R, in] swapped, exactly: bf16 holds every E2M1 value times 2^k exactly;
    float16 goes through fp32 and rounds once."""
    blocks, scales = _random_mxfp4((2, 3, 5, 2), seed=1)  # [E, R, G] with R = 5 rows
    want = np.swapaxes(_numpy_mxfp4(blocks, scales), -1, -2)
    got = mxfp4_dequantize(jnp.asarray(blocks), jnp.asarray(scales), dtype, transposed=True)
    assert got.shape == (2, 3, 64, 5) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(dtype).astype(np.float32))
    plain = mxfp4_dequantize(jnp.asarray(blocks), jnp.asarray(scales), dtype)
    np.testing.assert_array_equal(np.asarray(jnp.swapaxes(plain, -1, -2), np.float32), np.asarray(got, np.float32))


def test_mxfp4_matches_transformers_gpt_oss_loader():
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = _random_mxfp4((3, 8, 2), seed=1)  # [E, rows, G]: an expert tensor as gpt-oss stores it
    ref = mx.convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
    got = np.asarray(mxfp4_dequantize(jnp.asarray(blocks), jnp.asarray(scales), jnp.float32))
    np.testing.assert_array_equal(np.swapaxes(got, 1, 2), ref)  # transformers returns [E, in, rows]


def test_mxfp4_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="blocks .* and scales .* do not match"):
        mxfp4_dequantize(jnp.zeros((2, 3, 16), jnp.uint8), jnp.zeros((2, 4), jnp.uint8))


def test_fp8_block_scales_match_a_loop_over_blocks():
    r = np.random.default_rng(2)
    o, i = 200, 300  # not multiples of 128: the last blocks are partial
    w = (r.normal(size=(o, i)) * 50).astype(ml_dtypes.float8_e4m3fn)
    s = r.uniform(0.001, 0.1, size=(2, 3)).astype(np.float32)
    want = np.zeros((o, i), np.float32)
    for a in range(2):
        for b in range(3):
            rows, cols = slice(a * 128, (a + 1) * 128), slice(b * 128, (b + 1) * 128)
            want[rows, cols] = w[rows, cols].astype(np.float32) * s[a, b]
    got = np.asarray(fp8_block_dequantize(jnp.asarray(w), jnp.asarray(s), dtype=jnp.float32))
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="do not fit weight"):
        fp8_block_dequantize(jnp.asarray(w), jnp.asarray(s[:1]))

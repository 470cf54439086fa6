"""The target's dense projections: ``dense(x, node)`` is ``x @ node["kernel"]``, or an FP8 GEMM when
the node holds an FP8 kernel with its per-output-channel scale (``target.compute_dtype: fp8``).

FP8 compute (``specjax.targets.fp8_compute`` builds the weights at load):
  * weight ``kernel`` float8_e4m3fn [in, out] and ``kernel_fp8_scale`` float32 [out]: the weight is
    ``float(kernel) * kernel_fp8_scale`` (scale = the output channel's amax / 448, :func:`quantize_columns`);
  * activation: a dynamic scale per token (amax over the feature axis / 448), x / scale rounded to e4m3;
  * the product: ``jax.lax.dot_general`` on the two float8 operands with
    ``preferred_element_type=float32``, then times the token scale and the channel scale, cast back to
    x's dtype.

A dot of two f8e4m3fn operands is what XLA's GPU GEMM rewriter turns into a cuBLASLt FP8 matmul on
Hopper (XLA's ``gpu/transforms/gemm_rewriter_fp8_test.cc``, test ``UnscaledABUnscaledDF8``: ``dot(f8e4m3fn
[16,32], f8e4m3fn[32,16])`` becomes one ``__cublas$lt$matmul$f8`` call); the per-row and per-column
rescale after it is an elementwise epilogue XLA fuses. cuBLASLt's FP8 path wants the contracted and
output sizes in multiples of 16 (every benchmark target's are). On CPU the same HLO runs as an
upcast dot, which is what the unit tests check against a NumPy reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
FP8_SCALE = "kernel_fp8_scale"  # the float32 [.., out] scale leaf beside an FP8 kernel


def fp8_scale_of(amax):
    """amax / 448, with 1 where the amax is 0 (an all-zero row or column quantizes to zeros either way)."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0)


def quantize_columns(w_io):
    """A [.., in, out] weight as (float8_e4m3fn [.., in, out], float32 scale [.., out]): each output
    channel scaled by its amax / 448 (so its largest entry maps to 448), rounded to nearest e4m3."""
    w = w_io.astype(jnp.float32)
    scale = fp8_scale_of(jnp.max(jnp.abs(w), axis=-2))
    return (w / scale[..., None, :]).astype(FP8), scale


def quantize_rows(x):
    """Activations [.., K] as (float8_e4m3fn [.., K], float32 scale [.., 1]): one scale per token."""
    x = x.astype(jnp.float32)
    scale = fp8_scale_of(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    return (x / scale).astype(FP8), scale


def fp8_matmul(x, w_fp8, w_scale):
    """x [.., K] (any float dtype) times the FP8 weight [K, N] with its [N] scale, in x's dtype."""
    xq, x_scale = quantize_rows(x)
    y = jax.lax.dot_general(xq, w_fp8, (((xq.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * x_scale * w_scale).astype(x.dtype)


def dense(x, node: dict):
    """x @ node's kernel: an FP8 GEMM (module docstring) when the node carries ``kernel_fp8_scale``."""
    if FP8_SCALE in node:
        return fp8_matmul(x, node["kernel"], node[FP8_SCALE])
    return x @ node["kernel"]

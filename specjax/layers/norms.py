"""RMSNorm matching transformers' LlamaRMSNorm / Qwen3RMSNorm numerics, and Gemma's (1 + weight) form."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype


def rms_norm(x: jnp.ndarray, scale: jnp.ndarray, eps: float, *, unit_offset: bool = False,
             weight_in_fp32: bool = False) -> jnp.ndarray:
    """Normalise over the last axis.

    Like HF: upcast to fp32 for the variance and the normalisation, cast back to the input dtype,
    then multiply by the weight (so a bf16 model rounds once before the weight multiply). fp64
    input stays fp64 (the tests' exact references).

    ``unit_offset`` (Gemma's RMSNorm): multiply by ``1 + scale`` in fp32 and cast after, as
    transformers' Gemma3RMSNorm does (one rounding, after the weight). ``weight_in_fp32`` (gpt-oss):
    multiply by ``scale`` in fp32 and cast after.
    """
    acc = accum_dtype(x)
    x32 = x.astype(acc)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(var + eps)
    if unit_offset or weight_in_fp32:
        return (normed * ((1.0 if unit_offset else 0.0) + scale.astype(acc))).astype(x.dtype)
    return scale * normed.astype(x.dtype)

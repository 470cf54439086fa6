"""RMSNorm matching transformers' LlamaRMSNorm / Qwen3RMSNorm numerics."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype


def rms_norm(x: jnp.ndarray, scale: jnp.ndarray, eps: float) -> jnp.ndarray:
    """Normalise over the last axis.

    Like HF: upcast to fp32 for the variance and the normalisation, cast back to the input dtype,
    then multiply by the weight (so a bf16 model rounds once before the weight multiply). fp64
    input stays fp64 (the tests' exact references).
    """
    x32 = x.astype(accum_dtype(x))
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normed = (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return scale * normed

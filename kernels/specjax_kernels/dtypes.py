"""The accumulation dtype shared by the XLA backends and the references."""
from __future__ import annotations

import jax.numpy as jnp


def accum_dtype(*xs):
    """fp32, or fp64 when an input is fp64: statistics, scores and gradients accumulate in it, so
    the tests' exact references can run the same code in fp64 (summation order then stops mattering)."""
    dt = jnp.float32
    for x in xs:
        if x is not None:
            dt = jnp.promote_types(dt, x.dtype)
    return dt

"""Helpers shared by the Pallas GPU kernels (Pallas' Triton lowering): compiler parameters and dots
with f32 accumulation that ask for IEEE f32 when the operands are f32."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

f32 = jnp.float32


def compiler_params(num_warps, num_stages):
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def precision(a):
    # f32 operands: ask for IEEE f32 (the Triton lowering maps DEFAULT to TF32)
    return lax.Precision.HIGHEST if a.dtype == jnp.float32 else None


def dot_nt(a, b):  # a [m,k] @ b[n,k]^T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision(a), preferred_element_type=f32)


def mm(a, b):  # a [m,k] @ b[k,n]
    return jnp.dot(a, b, precision=precision(a), preferred_element_type=f32)

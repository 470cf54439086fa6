"""The pallas_tpu MoE backend (megablox gmm) lowers for a TPU from this CPU host
(`jax.export(..., platforms=["tpu"])` runs Mosaic's TPU lowering and its block-shape checks) at the
Qwen3-30B-A3B layer shape users train with (bf16, 4096 tokens, top-8 of 128 experts, D 2048,
F 768): forward, and the backward through megablox's own VJP. The test counts the Mosaic custom calls,
so a silent fallback to XLA cannot pass it."""
import re

import jax
import jax.numpy as jnp

from specjax_kernels.moe import pallas_tpu
from specjax_kernels.tpu_lowering import mosaic_call_count

T, K, E, D, F = 4096, 8, 128, 2048, 768
ARGS = (jax.ShapeDtypeStruct((T, D), jnp.bfloat16), jax.ShapeDtypeStruct((T, K), jnp.int32),
        jax.ShapeDtypeStruct((T, K), jnp.bfloat16), jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16),
        jax.ShapeDtypeStruct((E, F, D), jnp.bfloat16), jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16))


def _layer(x, ids, w, up, down, gate):
    return pallas_tpu.moe_experts(x, ids, w, up, down, gate, "silu", interpret=False)


def _mosaic_calls(fn):
    """(Mosaic TPU custom calls in the module, call sites of megablox's gmm / tgmm functions)."""
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*ARGS).mlir_module()
    return (mosaic_call_count(text),
            len(re.findall(r"call @(?:gmm|tgmm)\w*\(", text)))


def test_forward_lowers_to_three_grouped_gemms():
    n_kernels, n_calls = _mosaic_calls(_layer)
    assert n_kernels >= 2 and n_calls == 3  # gate and up share one kernel (same shapes), down is the other


def test_backward_lowers_through_megablox():
    def grads(x, ids, w, up, down, gate):
        f = lambda x, up: jnp.sum(_layer(x, ids, w, up, down, gate).astype(jnp.float32))  # noqa: E731
        return jax.grad(f, argnums=(0, 1))(x, up)

    text = jax.export.export(jax.jit(grads), platforms=["tpu"])(*ARGS).mlir_module()
    called = re.findall(r"call @(\w*gmm\w*)\(", text)
    assert "tgmm" in called  # the weight gradient is megablox's transposed grouped GEMM
    assert mosaic_call_count(text) >= 3 and len(called) >= 4

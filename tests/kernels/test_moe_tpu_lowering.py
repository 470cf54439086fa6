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


def test_split_over_a_mesh_matches_the_reference():
    """Under kernel_mesh (what specjax.mesh.use_mesh sets in the train step) the routed experts run
    under shard_map, each device its own tokens with every expert: on the 8 CPU devices (Pallas's
    interpreter) forward and gradients equal the reference (ragged_dot) within 2e-5, with the expert
    weights sharded over an axis the tokens are not split over (so shard_map must gather them)."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from specjax_kernels.moe import moe_experts
    from specjax_kernels.tpu_lowering import kernel_mesh

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "expert"))
    ks = jax.random.split(jax.random.key(1), 6)
    t, k, e, d, f = 64, 2, 4, 16, 24
    x = jax.random.normal(ks[0], (t, d))
    ids = jax.random.randint(ks[1], (t, k), 0, e)
    w = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), axis=-1)
    up, gate = (0.3 * jax.random.normal(ks[i], (e, d, f)) for i in (3, 4))
    down = 0.3 * jax.random.normal(ks[5], (e, f, d))
    up, gate, down = (jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in (up, gate, down))

    def run(impl, split):
        def loss(x, up, down, gate):
            return jnp.sum(jnp.sin(moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_edf=gate, activation="silu",
                                               implementation=impl)))

        with kernel_mesh(mesh if split else None, batch_axes=("data",)):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, up, down, gate)

    got, ref = run("pallas_tpu", True), run("reference", False)
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)

    def lowered(split):  # a fresh function each time: jit's trace cache does not see kernel_mesh
        f = lambda x, up, down, gate: moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_edf=gate,  # noqa: E731
                                                  implementation="pallas_tpu")
        with kernel_mesh(mesh if split else None, batch_axes=("data",)):
            return jax.jit(f).lower(x, up, down, gate).as_text()
    manual = lambda text: "sdy.manual_computation" in text or "SPMDFullToShardShape" in text  # noqa: E731
    assert manual(lowered(True)) and not manual(lowered(False))

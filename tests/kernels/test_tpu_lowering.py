"""Every pallas_tpu backend of ttt_attention and soft_ce lowers for a TPU from this CPU host, forward and
backward, at the shapes of a Llama-3.1-8B EAGLE-3 draft (32 query / 8 KV heads, head_dim 128, T = 32768,
K = 7 TTT steps, so 6 diagonal key sets; Vd = 32000, H = 4096; bf16), through the public API
(`implementation="pallas_tpu"`) and plain `jax.export(..., platforms=["tpu"])`: no context, no chip
named. The assertions count the Mosaic custom calls per kernel name (specjax_kernels.tpu_lowering.
mosaic_kernels), so a fallback to XLA or to the interpreter cannot pass. What lowering checks and what
only a TPU can: see specjax_kernels/tpu_lowering.py. (MoE megablox: tests/kernels/test_moe_tpu_lowering.py;
SSD has no Pallas backend.)

Also: how the chip is named (a kernel with lax.sign needs it), `auto` on TPU, the errors, and that the
kernels split over a multi-device mesh (shard_map; XLA cannot partition a Mosaic call) still match the
reference when run on 8 CPU devices in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import Mesh

from specjax_kernels import tpu_lowering
from specjax_kernels.selection import select
from specjax_kernels.soft_ce import api as soft_ce_api
from specjax_kernels.soft_ce import fused_linear_soft_ce
from specjax_kernels.ttt_attention import api as ttt_api
from specjax_kernels.ttt_attention import pallas_tpu as ttt_pallas_tpu
from specjax_kernels.ttt_attention import ttt_attention
from specjax_kernels.tpu_lowering import kernel_mesh, lowering_for, mosaic_kernels

BF16, F32 = jnp.bfloat16, jnp.float32
S = jax.ShapeDtypeStruct
B, T, HQ, HKV, D, KDIAG = 1, 32768, 32, 8, 128, 6  # Llama-3.1-8B draft, K = 7
N, H, VD = B * T, 4096, 32000


def _export(fn, *args):
    """Plain jax.export for a TPU: no lowering_for, no chip named (issue 24's (a) and (b))."""
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


def _ttt(*a):
    q, k0, v0, kd, vd, seg = a
    return ttt_attention(q, k0, v0, kd, vd, seg, implementation="pallas_tpu")


TTT_ARGS = (S((B, T, HQ, D), BF16), S((B, T, HKV, D), BF16), S((B, T, HKV, D), BF16),
            S((KDIAG, B, T, HKV, D), BF16), S((KDIAG, B, T, HKV, D), BF16), S((B, T), jnp.int32))


@pytest.fixture(scope="module")
def ttt_grad_module():
    def grads(q, k0, v0, kd, vd, seg):
        f = lambda *x: jnp.sum(_ttt(*x, seg).astype(F32))  # noqa: E731
        return jax.grad(f, argnums=(0, 1, 2, 3, 4))(q, k0, v0, kd, vd)
    return _export(grads, *TTT_ARGS)


def test_ttt_attention_forward_lowers_at_32k():
    assert mosaic_kernels(_export(_ttt, *TTT_ARGS)) == {"ttt_block0_fwd_tpu": 1}


def test_ttt_attention_backward_lowers_at_32k(ttt_grad_module):
    assert mosaic_kernels(ttt_grad_module) == {"ttt_block0_fwd_tpu": 1, "ttt_block0_dq_tpu": 1,
                                               "ttt_block0_dkdv_tpu": 1}
    assert "jax.result_info" in ttt_grad_module  # an ordinary exported module otherwise


def test_target_attention_form_lowers():
    """k = 0 (the target's own causal self-attention on the same kernel): no diagonal keys."""
    args = (S((2, 8192, HQ, D), BF16), S((2, 8192, HKV, D), BF16), S((2, 8192, HKV, D), BF16), S((2, 8192), jnp.int32))
    f = lambda q, k, v, seg: ttt_attention(q, k, v, None, None, seg, implementation="pallas_tpu")  # noqa: E731
    assert mosaic_kernels(_export(f, *args)) == {"ttt_block0_fwd_tpu": 1}


SCE_LOGITS = (S((N, H), BF16), S((VD, H), BF16), S((N, VD), F32), S((N,), F32))
SCE_HIDDEN = (S((N, H), BF16), S((VD, H), BF16), S((N, H), BF16), S((VD, H), BF16), S((N,), F32))


def _sce_grad(teacher):
    def loss(h, w, *rest):
        *t, m = rest
        kw = dict(teacher_logits=t[0]) if teacher == "logits" else dict(teacher_hidden=t[0], teacher_head=t[1])
        return jnp.sum(fused_linear_soft_ce(h, w, mask=m, implementation="pallas_tpu", **kw))
    return lambda h, w, *rest: jax.grad(loss, argnums=(0, 1))(h, w, *rest)


@pytest.mark.parametrize("teacher", ["logits", "hidden"])
def test_soft_ce_forward_and_backward_lower(teacher):
    args = SCE_LOGITS if teacher == "logits" else SCE_HIDDEN
    counts = mosaic_kernels(_export(_sce_grad(teacher), *args))
    # the backward builds dlogits in row chunks of <= 1 GiB ([N, Vd] bf16 = 2 GiB here: 2 chunks)
    assert counts == {"soft_ce_stats_tpu": 1, "soft_ce_dlogits_tpu": 2}


def test_chip_is_named_for_mosaic_rules_that_need_it():
    """lax.sign's Mosaic rule asks the chip's generation; on a CPU host the default device says "cpu".
    lowering_for names the chip through an abstract mesh's AbstractDevice (the specjax kernels avoid
    such rules: ttt_attention's index maps use lax.div, not `//`, which lowers through sign)."""
    def sign_kernel(x_ref, o_ref):
        o_ref[...] = jnp.sign(x_ref[...])

    x = S((8, 128), F32)
    f = lambda x: pl.pallas_call(sign_kernel, out_shape=x)(x)  # noqa: E731
    with pytest.raises(ValueError, match="Unsupported TPU device kind: cpu"):
        _export(f, x)
    for chip in ("v5e", "v6e"):
        assert tpu_lowering.mosaic_call_count(tpu_lowering.export_for_tpu(f, x, chip=chip)) == 1


def test_auto_picks_pallas_tpu_when_choosing_for_a_tpu():
    with lowering_for("tpu"):
        assert select("ttt_attention", ttt_api.IMPLEMENTATIONS, ttt_api.PREFERENCE, None)[0] == "pallas_tpu"
        assert select("soft_ce", soft_ce_api.IMPLEMENTATIONS, soft_ce_api.PREFERENCE, None)[0] == "pallas_tpu"
    assert select("ttt_attention", ttt_api.IMPLEMENTATIONS, ttt_api.PREFERENCE, None)[0] == "xla"


def test_errors_name_the_problem_and_the_fix():
    with pytest.raises(ValueError, match="unknown TPU chip 'v9'.*v5e, v5p, v6e"):
        with lowering_for("tpu", chip="v9"):
            pass
    with pytest.raises(ValueError, match="unknown platform 'tpuu'"):
        with lowering_for("tpuu"):
            pass
    q = jnp.zeros((1, 64, 2, 128))
    with pytest.raises(ValueError, match="multiple of 128 on TPU, got 64"):
        ttt_pallas_tpu.ttt_attention(q, q, q, block_size=64, interpret=False)
    with lowering_for("tpu"), pytest.raises(ValueError, match="multiple of 128 on TPU, got 64"):
        ttt_attention(q, q, q, implementation="pallas_tpu", block_size=64)


def test_split_over_a_mesh_matches_the_reference():
    """Under kernel_mesh (what specjax.mesh.use_mesh sets in the train step) each kernel runs under
    shard_map: batch over (data, fsdp), heads over tensor; soft_ce rows over all three, dW summed.
    Run on the 8 CPU devices (Pallas's interpreter) against the reference, forward and gradients."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
    ks = jax.random.split(jax.random.key(0), 8)
    b, t, hq, hkv, d, k = 4, 128, 4, 2, 16, 2
    q = jax.random.normal(ks[0], (b, t, hq, d))
    kv = [jax.random.normal(ks[i], (b, t, hkv, d)) for i in (1, 2)]
    diag = [jax.random.normal(ks[i], (k, b, t, hkv, d)) for i in (3, 4)]
    seg = jnp.asarray(np.repeat([[1] * 50 + [2] * 78], b, 0), jnp.int32)
    h = jax.random.normal(ks[5], (b * 16, 72))
    w = 0.3 * jax.random.normal(ks[6], (300, 72))
    tl = 2 * jax.random.normal(ks[7], (b * 16, 300))

    def run(impl):
        def attn(q, k0, v0, kd, vd):
            return jnp.sum(jnp.sin(ttt_attention(q, k0, v0, kd, vd, seg, implementation=impl)))

        def sce(h, w):
            return jnp.sum(fused_linear_soft_ce(h, w, teacher_logits=tl, implementation=impl))

        with kernel_mesh(mesh, batch_axes=("data", "fsdp"), head_axes=("tensor",)):
            return (jax.jit(jax.value_and_grad(attn, argnums=(0, 1, 2, 3, 4)))(q, *kv, *diag),
                    jax.jit(jax.value_and_grad(sce, argnums=(0, 1)))(h, w))

    got, ref = run("pallas_tpu"), run("reference")
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-5)

    def lowered(split):  # a fresh function each time: jit's trace cache does not see kernel_mesh
        f = lambda q, k0, v0: ttt_attention(q, k0, v0, implementation="pallas_tpu")  # noqa: E731
        with kernel_mesh(mesh if split else None, batch_axes=("data", "fsdp"), head_axes=("tensor",)):
            return jax.jit(f).lower(q, *kv).as_text()
    manual = lambda text: "sdy.manual_computation" in text or "SPMDFullToShardShape" in text  # noqa: E731
    assert manual(lowered(True)) and not manual(lowered(False))

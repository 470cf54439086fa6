"""Context parallelism (the sequence split over the `context` mesh axis) is exact.

* the draft's TTT attention (explicit K/V all-gather in shard_map): output and gradients vs the
  reference definition within 1e-5 (fp32), packed segments crossing shard boundaries, GQA,
  k = 0..3 diagonal keys, with batch/heads also sharded (fsdp, tensor);
* the Mamba-2 scan split over 4 and 8 shards (state passing, a document starting exactly on a
  shard edge) and the target attention (lazy and materialised masks, with/without query blocks)
  vs their one-device results within 1e-5;
* the full train step (target forward with context-parallel attention and Mamba-2, the TTT loss,
  the update), 3 steps: loss, grad norm and updated draft params vs one device within 1e-5 (rtol,
  atol 1e-5 on params), for the Llama tiny target (several packed documents per row, boundaries
  inside shards and on shard edges) with fsdp=2 x context=4 and fsdp=2 x tensor=2 x context=2, and
  for a tiny Nemotron-H hybrid (Mamba-2 + attention + MLP): the target forward with context=2 (its
  HLO has the explicit all-gathers and halo permutes), exact in fp64 (rtol 1e-10) and within 1e-5
  of each output's norm in fp32, and the train step with fsdp=2 x context=4;
* memory: compiled per-device temp memory of the TTT attention's forward+backward under context=C
  drops with C for long T (memory_analysis on the fake CPU mesh).

The step is traced under `mesh.use_mesh(mesh)`: that is what turns the explicit shard_map paths on.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _sharded_training import TOL, assert_same_training, packed_batch, train_3_steps
from specjax import mesh as meshlib
from specjax.targets.llama import LlamaTarget, LlamaTargetConfig
from specjax_kernels.ttt_attention.context_parallel import ttt_attention_context_parallel
from specjax_kernels.ttt_attention.reference import ttt_attention as ttt_reference

T = 32


# ------------------------------------------------------------------------------------------
# the kernel alone
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("C,extra,k,forward", [(4, {}, 3, "xla"), (8, {}, 0, "xla"), (2, {"fsdp": 2, "tensor": 2}, 2, "xla"),
                                               (4, {}, 3, "pallas_gpu"), (8, {}, 0, "pallas_gpu")])
def test_ttt_attention_cp_matches_reference(C, extra, k, forward):
    # forward="pallas_gpu": the Triton forward with a global query offset, in interpret mode here
    B, Hq, Hkv, D = 2, 4, 2, 8
    n = C * int(np.prod(list(extra.values()) or [1]))
    mesh = meshlib.make_mesh({"context": C, **extra}, jax.devices()[:n])
    r = np.random.default_rng(k)
    f = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
    q, k0, v0, w = f(B, T, Hq, D), f(B, T, Hkv, D), f(B, T, Hkv, D), f(B, T, Hq, D)
    kd, vd = (f(k, B, T, Hkv, D), f(k, B, T, Hkv, D)) if k else (None, None)
    seg = jnp.asarray(packed_batch(B, T, 10)["segment_ids"])
    qs = meshlib.spec_for(q.shape, ("batch", "seq", "heads", None), mesh)
    ks = meshlib.spec_for(k0.shape, ("batch", "seq", "kv_heads", None), mesh)

    def run(fn):
        def loss(q, k0, v0, kd, vd):
            out = fn(q, k0, v0, kd, vd)
            return jnp.sum(out * w), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(q, k0, v0, kd, vd)

    g_ref, o_ref = run(lambda q, k0, v0, kd, vd: ttt_reference(q, k0, v0, kd, vd, seg))
    g_cp, o_cp = run(lambda q, k0, v0, kd, vd: ttt_attention_context_parallel(
        q, k0, v0, kd, vd, seg, mesh=mesh, q_spec=qs, kv_spec=ks, block_size=4, forward=forward))
    np.testing.assert_allclose(o_cp, o_ref, atol=TOL, rtol=TOL)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL), g_cp, g_ref)


def test_ttt_attention_cp_rejects_indivisible_length():
    mesh = meshlib.make_mesh({"context": 4}, jax.devices()[:4])
    x = jnp.zeros((1, 30, 2, 8))
    with pytest.raises(ValueError, match="not divisible"):
        ttt_attention_context_parallel(x, x, x, mesh=mesh, q_spec=jax.sharding.PartitionSpec(None, "context"),
                                       kv_spec=jax.sharding.PartitionSpec(None, "context"))


@pytest.mark.parametrize("C", [4, 8])
def test_ssd_context_parallel_matches_single_device(C):
    """Mamba-2 scan with T split over C shards (documents start inside shards and exactly on the
    shard edge t=8 for C=4; shards of 4 rows for C=8) equals the one-device scan within 1e-5."""
    from specjax_kernels.ssd import ssd
    from specjax_kernels.ssd.context_parallel import ssd_context_parallel

    r = np.random.default_rng(C)
    B, H, Pd, G, N = 2, 4, 4, 2, 4
    x = jnp.asarray(r.normal(size=(B, T, H, Pd)), jnp.float32)
    dt = jnp.asarray(r.uniform(0.05, 0.5, size=(B, T, H)), jnp.float32)
    a = -jnp.asarray(r.uniform(0.2, 1.0, size=(H,)), jnp.float32)  # slow decay: state matters far away
    bm, cm = (jnp.asarray(r.normal(size=(B, T, G, N)), jnp.float32) for _ in range(2))
    d = jnp.asarray(r.normal(size=(H,)), jnp.float32)
    seg = jnp.asarray(packed_batch(B, T, 10)["segment_ids"])
    want = ssd(x, dt, a, bm, cm, D=d, chunk_size=4, segment_ids=seg, implementation="reference")
    mesh = meshlib.make_mesh({"context": C}, jax.devices()[:C])
    got = jax.jit(lambda *xs: ssd_context_parallel(*xs, D=d, chunk_size=4, segment_ids=seg, mesh=mesh))(
        x, dt, a, bm, cm)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_target_attention_cp_lazy_and_array_masks():
    """Target attention: the lazy SegmentCausalMask and the materialised bool mask, with and without
    query blocks, on one device and under context=4, all give the plain dense result (fp32, 1e-5)."""
    from specjax.targets.layers.attention import _attend, dot_product_attention, segment_causal_mask

    r = np.random.default_rng(5)
    B, Hq, Hkv, D = 2, 4, 2, 8
    q = jnp.asarray(r.normal(size=(B, T, Hq, D)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(B, T, Hkv, D)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(packed_batch(B, T, 10)["segment_ids"])
    lazy = segment_causal_mask(seg)
    dense = lazy.materialize()
    assert dense.shape == (B, T, T) and bool(dense[0, 5, 5]) and not bool(dense[0, 5, 4])  # doc starts at 5
    want = _attend(q.reshape(B, T, Hkv, 2, D), k, v, dense, D**-0.5).reshape(B, T, Hq, D)
    mesh = meshlib.make_mesh({"context": 4}, jax.devices()[:4])
    for cp in (None, mesh):
        for mask in (lazy, dense):
            for qb in (0, 8):
                with meshlib.use_mesh(cp):
                    got = jax.jit(lambda q, k, v, m, qb=qb: dot_product_attention(q, k, v, m, scale=D**-0.5,
                                                                                   q_block=qb))(q, k, v, mask)
                np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)
    # kernels.target_attention=pallas_gpu under context parallelism: the offset Triton forward (interpreted)
    from specjax_kernels.selection import recording_choices
    with meshlib.use_mesh(mesh), recording_choices() as chosen:
        got = jax.jit(lambda q, k, v, m: dot_product_attention(q, k, v, m, scale=D**-0.5, q_block=16,
                                                               implementation="pallas_gpu"))(q, k, v, lazy)
    assert chosen["target_attention"] == {"ttt_attention context parallel (pallas_gpu)"}
    np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


def test_target_attention_cp_sliding_window():
    """A sliding-window mask (Mistral, Gemma 3's local layers) under context=4: each shard's rows see the
    window across the shard boundary, for a static and a traced window, equal to the single-device
    dense result (fp32, 1e-5)."""
    from specjax.targets.layers.attention import dot_product_attention, segment_causal_mask

    r = np.random.default_rng(6)
    B, Hq, Hkv, D, W = 2, 4, 2, 8, 6
    q = jnp.asarray(r.normal(size=(B, T, Hq, D)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(B, T, Hkv, D)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(packed_batch(B, T, 10)["segment_ids"])
    dense = segment_causal_mask(seg).with_window(W).materialize()
    assert not bool(dense[0, T - 1, T - 1 - W]) and bool(dense[0, T - 1, T - W])
    want = dot_product_attention(q, k, v, dense, scale=D**-0.5)  # one device, the materialised mask
    mesh = meshlib.make_mesh({"context": 4}, jax.devices()[:4])
    with meshlib.use_mesh(mesh):
        static = jax.jit(lambda q, k, v, s: dot_product_attention(
            q, k, v, segment_causal_mask(s).with_window(W), scale=D**-0.5, q_block=8))(q, k, v, seg)
        traced = jax.jit(lambda q, k, v, s, w: dot_product_attention(
            q, k, v, segment_causal_mask(s).with_window(w), scale=D**-0.5, q_block=8))(q, k, v, seg, jnp.int32(W))
    np.testing.assert_allclose(static, want, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(traced, want, atol=TOL, rtol=TOL)


# ------------------------------------------------------------------------------------------
# the full train step
# ------------------------------------------------------------------------------------------
def _llama():
    cfg = LlamaTargetConfig.create(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    return LlamaTarget.init(cfg, jax.random.key(0), jnp.float32)


@pytest.fixture(scope="module")
def llama_single():
    target = _llama()
    return train_3_steps(target, {"data": 1}, 1, packed_batch(4, T, 256), 256)


@pytest.mark.parametrize("sizes", [{"fsdp": 2, "context": 4}, {"fsdp": 2, "tensor": 2, "context": 2}])
def test_llama_train_step_context_parallel(llama_single, sizes):
    n = int(np.prod(list(sizes.values())))
    got = train_3_steps(_llama(), sizes, n, packed_batch(4, T, 256), 256)
    assert got[2].batch_sharding.spec[1] == "context"
    assert_same_training(got, llama_single)


# ------------------------------------------------------------------------------------------
# the Nemotron-H hybrid: Mamba-2 (halo conv + cross-shard state passing) and attention
# ------------------------------------------------------------------------------------------
def _nemotron():
    from specjax.targets import nemotron_h as nh

    hf = dict(nh.NEMOTRON_3_NANO_30B_A3B_HF_CONFIG, vocab_size=256, hidden_size=32, hybrid_override_pattern="M*M-",
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
              mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=4,
              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
              moe_shared_expert_intermediate_size=16)
    cfg = nh.NemotronHTargetConfig.from_hf(hf)
    # larger than HF's init so the SSM state and the conv carry real signal across shard edges
    params = nh.init_params(cfg, jax.random.key(3), std=0.3)
    return nh.NemotronHTarget(cfg, cfg.to_hf(), params)


def _nemotron_forward_pair(C, dtype):
    """(context-parallel, one-device) forward outputs of the tiny Nemotron-H and the CP HLO text, with
    params cast to `dtype` (the caller turns x64 on for fp64)."""
    target = _nemotron()
    b = packed_batch(2, T, 256)
    params = jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                    target.params)
    # a fresh function per jit: jit's trace cache does not see the active mesh
    fwd = lambda: lambda p, ids, pos, seg: target.forward(p, ids, aux_layer_ids=(0, 1, 2), positions=pos,
                                                          segment_ids=seg)
    args = (params, b["input_ids"], b["positions"], b["segment_ids"])
    ref = jax.jit(fwd())(*args)
    mesh = meshlib.make_mesh({"context": C}, jax.devices()[:C])
    with meshlib.use_mesh(mesh):
        lowered = jax.jit(fwd()).lower(*args)
    got = lowered.compile()(*args)
    got, ref = ([np.asarray(x) for x in jax.tree_util.tree_leaves(o)] for o in (got, ref))
    assert len(got) == len(ref) == 4  # final hidden + 3 aux taps
    for x, y in zip(got, ref):
        assert x.dtype == y.dtype == dtype, (x.dtype, y.dtype)  # nothing ran below `dtype`
    return got, ref, lowered.as_text()


@pytest.mark.parametrize("C", [2])  # context=4 runs in the train-step test below
def test_nemotron_forward_context_parallel_exact_fp64(C):
    """Exactness in fp64 (x64 on, params cast to fp64; the Mamba-2 conv/SSD/gated norm, the RMSNorms,
    the router and the attention all compute in fp64 then): one device and context=C run the same
    math in a different order (local scans + cross-shard state passing, conv halo, gathered K/V), so
    every entry must agree to rtol 1e-10 with atol 1e-13 of the output's largest magnitude (the
    floor for entries near zero). Measured: |diff| <= 1e-14 on outputs of magnitude up to 15, i.e.
    about 1e-15 of the scale; any fp32 rounding left on either path gives ~1e-7, a wrong state,
    halo or mask far more."""
    with jax.enable_x64(True):
        got, ref, hlo = _nemotron_forward_pair(C, jnp.float64)
    assert "all-gather" in hlo or "all_gather" in hlo  # attention's K/V and the SSM summaries
    assert "collective_permute" in hlo or "collective-permute" in hlo  # conv halo, segment edge
    for x, y in zip(got, ref):
        np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-13 * float(np.abs(y).max()))


@pytest.mark.parametrize("C", [2])
def test_nemotron_forward_context_parallel_fp32(C):
    """The production dtype (fp32): the same comparison, each output array to 1e-5 of its norm
    (||cp - ref|| <= 1e-5 ||ref||). Exactness is the fp64 test's job; here the two sides differ by
    fp32 reassociation (the summation order depends on the split and on the host CPU's vector
    width), whose error is bounded relative to the magnitude of the summed terms, not to each
    result: an entry that ends near zero by cancellation can differ by more than 1e-5 of itself
    (one entry of 2,048 at 1.16e-5 elementwise on an AMD EPYC), so an elementwise rtol is not a
    sound fp32 statement. Measured: <= 7e-7 of the norm."""
    got, ref, hlo = _nemotron_forward_pair(C, jnp.float32)
    assert "all-gather" in hlo or "all_gather" in hlo
    assert "collective_permute" in hlo or "collective-permute" in hlo
    for x, y in zip(got, ref):
        assert np.linalg.norm(x - y) <= TOL * np.linalg.norm(y), (np.linalg.norm(x - y) / np.linalg.norm(y))


@pytest.fixture(scope="module")
def nemotron_single():
    return train_3_steps(_nemotron(), {"data": 1}, 1, packed_batch(4, T, 256), 256)


def test_nemotron_train_step_context_parallel(nemotron_single):
    got = train_3_steps(_nemotron(), {"fsdp": 2, "context": 4}, 8, packed_batch(4, T, 256), 256)
    assert_same_training(got, nemotron_single)


# ------------------------------------------------------------------------------------------
# memory: the TTT attention's per-device temp buffers shrink with C (compiled, not run)
# ------------------------------------------------------------------------------------------
def _ttt_attention_temp_bytes(T_long, C):
    from jax.sharding import NamedSharding, PartitionSpec as P
    from specjax_kernels.ttt_attention import ttt_attention

    B, Hq, Hkv, D, k = 1, 8, 2, 64, 2
    mesh = meshlib.make_mesh({"context": C}, jax.devices()[:C])
    seq, diag = NamedSharding(mesh, P(None, "context")), NamedSharding(mesh, P(None, None, "context"))
    sds = lambda shape, sh, dt=jnp.float32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    args = (sds((B, T_long, Hq, D), seq), sds((B, T_long, Hkv, D), seq), sds((B, T_long, Hkv, D), seq),
            sds((k, B, T_long, Hkv, D), diag), sds((k, B, T_long, Hkv, D), diag), sds((B, T_long), seq, jnp.int32))

    def fwd_bwd(q, k0, v0, kd, vd, seg):
        def loss(q, k0, v0, kd, vd):
            if C > 1:
                out = ttt_attention_context_parallel(q, k0, v0, kd, vd, seg, mesh=mesh, q_spec=P(None, "context"),
                                                     kv_spec=P(None, "context"))
            else:
                out = ttt_attention(q, k0, v0, kd, vd, seg, implementation="xla")
            return jnp.sum(out * out)
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k0, v0, kd, vd)

    compiled = jax.jit(fwd_bwd).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_ttt_attention_memory_scales_down_with_context():
    """T = 16k, GQA 8/2 heads, k = 2, fp32, forward + backward: measured on the fake CPU mesh
    (jax 0.10.2) C=1 275 MB, C=2 161 MB (0.59), C=4 107 MB (0.39) of temp per device. The floor
    above 1/C is the all-gathered K0/V0 with their f32 gradient buffers (O(T*Hkv*D), GQA-small) plus
    the constant per-block score tiles; we require at most 1/C + 0.2."""
    t1 = _ttt_attention_temp_bytes(16384, 1)
    t2 = _ttt_attention_temp_bytes(16384, 2)
    t4 = _ttt_attention_temp_bytes(16384, 4)
    assert t2 / t1 < 0.5 + 0.2 and t4 / t1 < 0.25 + 0.2, (t1, t2, t4)

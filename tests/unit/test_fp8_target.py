"""``target.compute_dtype: fp8`` (specjax/targets/fp8_compute.py, layers/linear.py): the target's dense
projections as e4m3 GEMMs with a per-token activation scale and a per-output-channel weight scale.

Checked (CPU, fp32 activations so only the FP8 rounding differs):
  * the FP8 linear equals a NumPy reference written from the definition (ml_dtypes e4m3 rounding of
    x / its row scale and w / its column scale, products summed in float64, rescaled): rel 1e-6;
  * the quantized weights are NumPy's codes exactly and the scales equal amax / 448; a block-scaled FP8
    checkpoint's kernels are dequantized with their own scales and requantized per channel (NumPy);
  * a tiny Llama and a tiny Qwen3 under fp8 against the same weights in fp32: aux states and final
    hidden within rel 0.1 (observed 0.02-0.07), and above 0.005 (the FP8 path really ran); the
    projection weights take about a quarter of their fp32 bytes (FP8 + one float32 per column);
  * EAGLE-3 training steps through the normal set-up (sharded load on 8 devices) against the fp8
    target lower the loss at every step (8 steps: 13.20 -> 11.99);
  * a family without FP8 projections, and an unknown value, are refused naming the fix; the
    bfloat16 default keeps plain kernels (no scale leaves).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from specjax.targets import llama
from specjax.targets.fp8_compute import fp8_compute_params, param_bytes
from specjax.targets.layers.linear import FP8_SCALE, fp8_matmul, quantize_columns
from specjax.targets.llama import LlamaTarget, LlamaTargetConfig
from specjax.targets.phi3 import Phi3Target
from specjax.targets.quantized import Fp8BlockQuant

LINEAR_TOL = 1e-6  # f32 accumulation of exact e4m3 products vs float64
SCALE_ULP = 2.5e-7  # amax / 448 within one float32 ulp
FP8_VS_FP32_MAX = 0.1  # observed 0.02-0.07 on these tiny targets
FP8_VS_FP32_MIN = 0.005  # an error this small would mean the FP8 path did not run
AUX = (0, 1, 3)
V = 64


def np_scale(amax):
    amax = amax.astype(np.float32)
    return np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)


def np_e4m3(x):
    return x.astype(ml_dtypes.float8_e4m3fn)


def np_fp8_linear(x, w):
    """The definition: per-token and per-output-channel scales, e4m3 rounding, float64 products."""
    sx = np_scale(np.abs(x).max(-1, keepdims=True))
    sw = np_scale(np.abs(w).max(0))
    xq = np_e4m3(x / sx).astype(np.float64)
    wq = np_e4m3(w / sw[None]).astype(np.float64)
    return (xq @ wq) * sx * sw[None]


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fp8_linear_equals_the_numpy_definition():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((3, 5, 96)) * np.exp(rng.standard_normal((3, 5, 1)))).astype(np.float32)
    x[1, 2] = 0.0  # an all-zero token: scale 1, output 0
    w = (0.05 * rng.standard_normal((96, 48)) * np.exp(rng.standard_normal(48))).astype(np.float32)
    wq, ws = quantize_columns(jnp.asarray(w))
    got = np.asarray(fp8_matmul(jnp.asarray(x), wq, ws))
    want = np_fp8_linear(x.reshape(-1, 96), w).reshape(3, 5, 48)
    assert got.dtype == np.float32
    assert rel(got, want) < LINEAR_TOL
    assert np.all(got[1, 2] == 0)
    assert rel(got, x @ w) > 1e-3  # and it is not the fp32 product
    # bf16 activations come back in bf16
    assert fp8_matmul(jnp.asarray(x, jnp.bfloat16), wq, ws).dtype == jnp.bfloat16


def test_quantized_weights_and_scales_equal_numpy():
    rng = np.random.default_rng(1)
    w = (0.02 * rng.standard_normal((2, 40, 24))).astype(np.float32)
    w[0, :, 3] = 0.0
    q, s = quantize_columns(jnp.asarray(w))
    want_s = np_scale(np.abs(w).max(-2))
    np.testing.assert_allclose(np.asarray(s), want_s, rtol=SCALE_ULP)  # XLA divides by 448 as * (1 / 448)
    assert want_s[0, 3] == 1.0 and np.asarray(s)[0, 3] == 1.0
    assert q.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8),
                                  np_e4m3(w / np.asarray(s)[:, None, :]).view(np.uint8))
    assert float(np.abs(np.asarray(q, np.float32)).max()) == 448.0


def test_block_scaled_checkpoint_is_requantized_per_channel_with_its_own_scales():
    block = (8, 16)  # (out, in)
    cfg = LlamaTargetConfig.create(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    cfg_q = dataclasses.replace(cfg, weight_quant=Fp8BlockQuant(block))
    stored = llama.init_params(cfg_q, jax.random.key(0))
    node = stored["layers"]["mlp"]["down_proj"]  # kernel [L, in=48, out=32], scale_inv [L, 48/16, 32/8]
    node["kernel_scale_inv"] = jnp.abs(node["kernel_scale_inv"]) + 0.5
    specs = llama.weight_specs(dataclasses.replace(cfg_q, compute_dtype="fp8"))
    assert not any(s.path[-1] == "kernel_scale_inv" for s in specs)
    out = fp8_compute_params(stored, specs, cfg_q.weight_quant)["layers"]["mlp"]["down_proj"]
    assert set(out) == {"kernel", FP8_SCALE} and out["kernel"].dtype == jnp.float8_e4m3fn
    k = np.asarray(node["kernel"], np.float32)
    s = np.repeat(np.repeat(np.asarray(node["kernel_scale_inv"]), block[1], 1), block[0], 2)
    w = k * s  # the checkpoint's weight, dequantized with its own block scales
    want_s = np_scale(np.abs(w).max(-2))
    np.testing.assert_allclose(np.asarray(out[FP8_SCALE]), want_s, rtol=SCALE_ULP)
    np.testing.assert_array_equal(np.asarray(out["kernel"]).view(np.uint8),
                                  np_e4m3(w / np.asarray(out[FP8_SCALE])[:, None, :]).view(np.uint8))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_fp8_target_states_against_fp32(arch):
    cfg = LlamaTargetConfig.create(architecture=arch, vocab_size=V, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=24 if arch == "Qwen3ForCausalLM" else None)
    ref = LlamaTarget.init(cfg, jax.random.key(0))
    cfg8 = LlamaTarget.config_from_hf(cfg.to_hf(), compute_dtype="fp8")
    assert cfg8.compute_dtype == "fp8"
    t8 = LlamaTarget.init(cfg8, jax.random.key(0))  # the same weights, quantized
    layers = t8.params["layers"]
    for block, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                         ("mlp", ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            assert layers[block][name]["kernel"].dtype == jnp.float8_e4m3fn and FP8_SCALE in layers[block][name]
    # the embedding, lm_head and norms stay as loaded
    assert t8.params["lm_head"]["kernel"].dtype == jnp.float32
    assert t8.params["embed_tokens"]["embedding"].dtype == jnp.float32
    fp32_layers, fp8_layers = param_bytes(ref.params["layers"]), param_bytes(layers)
    assert fp8_layers < 0.3 * fp32_layers, (fp32_layers, fp8_layers)
    ids = jax.random.randint(jax.random.key(1), (2, 24), 0, V)
    f32, a32 = ref.forward(ref.params, ids, aux_layer_ids=AUX)
    f8, a8 = jax.jit(lambda p, i: t8.forward(p, i, aux_layer_ids=AUX))(t8.params, ids)
    errs = [rel(b, a) for a, b in zip(a32 + (f32,), a8 + (f8,))]
    print(arch, "fp8 vs fp32 rel err (aux..., final):", [f"{e:.4f}" for e in errs])
    assert all(FP8_VS_FP32_MIN < e < FP8_VS_FP32_MAX for e in errs), errs


def test_unsupported_family_and_value_are_refused():
    with pytest.raises(ValueError, match=r"compute_dtype=fp8 is not implemented for Phi3Target: the FP8 target "
                                         r"GEMMs run for .*LlamaForCausalLM.*Qwen3ForCausalLM.*Fix: set "
                                         r"target.compute_dtype: bfloat16"):
        Phi3Target.config_from_hf({}, compute_dtype="fp8")
    with pytest.raises(ValueError, match=r"compute_dtype='fp16': expected one of \('bfloat16', 'fp8'\)"):
        LlamaTarget.config_from_hf({}, compute_dtype="fp16")


def test_default_keeps_plain_kernels():
    cfg = LlamaTargetConfig.create(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4)
    assert cfg.compute_dtype == "bfloat16"
    assert not any(s.path[-1] == FP8_SCALE for s in llama.weight_specs(cfg))
    params = llama.init_params(cfg, jax.random.key(0))
    assert params["layers"]["mlp"]["up_proj"].keys() == {"kernel"}


def test_eagle3_trains_against_the_fp8_target(tmp_path):
    from specjax.config import load_config
    from specjax.train.setup import build_run_setup, load_prepared_target, make_mesh
    from specjax.train.step import init_state

    cfg_t = LlamaTargetConfig.create(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, rope_theta=1000.0)
    path = str(tmp_path / "target")
    params = llama.init_params(cfg_t, jax.random.key(0))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 200.0  # a peaked teacher: the loss has room to fall
    llama.save_hf_checkpoint(params, cfg_t, path)
    cfg = load_config(None, [f"target.path={path}", "target.dtype=float32", "target.compute_dtype=fp8",
                             "draft.type=eagle3", f"draft.draft_vocab_size={V}", "train.steps=8",
                             "optim.lr=3e-3", "optim.warmup_ratio=0"])
    mesh = make_mesh(cfg)
    target = load_prepared_target(cfg, mesh)  # sharded load, then quantized on the device
    assert target.config.compute_dtype == "fp8"
    assert target.params["layers"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.float8_e4m3fn
    setup = build_run_setup(cfg, target, mesh)
    state = init_state(setup.init_draft_params(), setup.optimizer)
    rows = jax.device_count()
    ids = jnp.asarray(np.random.RandomState(0).randint(0, V, (rows, 16)), jnp.int32)
    batch = {"input_ids": ids, "loss_mask": jnp.ones_like(ids), "segment_ids": jnp.ones_like(ids),
             "positions": jnp.tile(jnp.arange(16, dtype=jnp.int32)[None], (rows, 1))}
    vocab = {"draft_ids": jnp.arange(V, dtype=jnp.int32), "t2d": jnp.ones(V, bool), "d2t": jnp.zeros(V, jnp.int32)}
    losses = []
    for _ in range(8):
        state, metrics = setup.fns.train_step(state, target.params, vocab, batch)
        losses.append(float(metrics["loss"]))
    print("eagle3 loss against the fp8 target:", [f"{x:.4f}" for x in losses])
    # observed 13.20 -> 11.99 (0.908 of the first) in 8 steps, falling at every step
    assert np.all(np.isfinite(losses)) and np.all(np.diff(losses) < 0) and losses[-1] < 0.95 * losses[0], losses

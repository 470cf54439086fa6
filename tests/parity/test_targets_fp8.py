"""FP8 block-scaled checkpoints (the DeepSeek-V3 / Kimi / GLM / MiniMax / Qwen FP8 releases) load as
published and stay FP8 in device memory (specjax/targets/quantized.py), checked against transformers'
own FP8 reader on CPU (which dequantizes ``weight * weight_scale_inv`` per block when it loads).

A tiny random DeepSeek-V3 (fp32) is quantized here with torch: each decoder-layer linear weight
(attention, dense MLP, routed and shared experts; not the router, norms, embeddings or lm_head)
to float8_e4m3fn with one float32 scale per 8 x 16 tile (out x in; a non-square block, so a transposed
scale grid cannot pass), then written as the FP8 releases are (``X.weight`` F8_E4M3 +
``X.weight_scale_inv`` F32, quantization_config with weight_block_size).

Checked: the kernels stay float8 with scale leaves beside them (the params' bytes are the FP8
checkpoint's, not an fp32 copy's); logits, the final hidden state and three aux states equal
transformers' on the same file within rel 1e-4 (fp32 compute); cached decoding equals the forward
(1e-4); a bf16 load equals a bf16 load of the dequantized weights (rel 1e-6); FP8 tensors without
the quantization_config, a config whose module list disagrees with the file, and other quant
methods are refused with the fix named.
"""
from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from specjax.targets import load_target  # noqa: E402
from specjax.targets.quantized import Fp8BlockQuant, quantize_weight_specs, weight_quant_from_hf  # noqa: E402
from specjax.targets import deepseek_v3 as ds  # noqa: E402

from parity._hf_weights import hf_run, randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
BF16_SAME_TOL = 1e-6  # bf16 FP8 load vs bf16 load of the dequantized weights: the same bf16 weights and ops
BLOCK = (8, 16)  # (out, in)
VOCAB = 128
AUX = (0, 1, 3)
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=12, v_head_dim=12, q_lora_rank=32, first_k_dense_replace=1, n_group=4, topk_group=2,
              num_experts_per_tok=4, n_shared_experts=1, max_position_embeddings=256, rms_norm_eps=1e-5)
QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def quantized_by_release(name: str, t) -> bool:
    """The tensors DeepSeek's FP8 release stores in FP8: decoder-layer linear weights but the router."""
    return name.startswith("model.layers.") and name.endswith(".weight") and t.ndim == 2 \
        and not name.endswith("mlp.gate.weight")


def fp8_block_dequantize(q, scale):
    """torch: the float32 weight an FP8 reader computes (float(q) * scale of q's tile)."""
    bo, bi = BLOCK
    s = scale.repeat_interleave(bo, 0)[:q.shape[0]].repeat_interleave(bi, 1)[:, :q.shape[1]]
    return q.float() * s


def fp8_block_quantize(w):
    """torch: [out, in] -> (float8_e4m3fn weight, float32 scale_inv [ceil(out/bo), ceil(in/bi)])."""
    bo, bi = BLOCK
    o, i = w.shape
    so, si = -(-o // bo), -(-i // bi)
    pad = torch.zeros(so * bo, si * bi, dtype=torch.float32)
    pad[:o, :i] = w.float()
    tiles = pad.reshape(so, bo, si, bi)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).reshape(so * bo, si * bi)[:o, :i].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def write_fp8_release(model, root):
    """Save ``model`` under root/fp32, its FP8 release under root/fp8 and the release's dequantized
    weights under root/dequantized: (fp8 tensors by name, number of quantized tensors)."""
    plain = root / "fp32"
    model.save_pretrained(str(plain))
    tensors = safetensors_torch.load_file(str(plain / "model.safetensors"))
    out, n_fp8 = {}, 0
    for name, t in tensors.items():
        if quantized_by_release(name, t):
            out[name], out[name + "_scale_inv"] = fp8_block_quantize(t)
            n_fp8 += 1
        else:
            out[name] = t
    fp8, dequantized = root / "fp8", root / "dequantized"
    fp8.mkdir()
    safetensors_torch.save_file(out, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((plain / "config.json").read_text())
    (dequantized / "config.json").parent.mkdir()
    (dequantized / "config.json").write_text(json.dumps(cfg))
    cfg["quantization_config"] = QCONFIG
    (fp8 / "config.json").write_text(json.dumps(cfg))
    safetensors_torch.save_file(
        {n: fp8_block_dequantize(t, out[n + "_scale_inv"]) if n + "_scale_inv" in out else t
         for n, t in out.items() if not n.endswith("_scale_inv")},
        str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    return out, n_fp8


@pytest.fixture(scope="module")
def fp8_case(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**CONFIG)).eval()
    randomize_(model, 3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
    out, n_fp8 = write_fp8_release(model, root)
    fp8, dequantized = root / "fp8", root / "dequantized"
    # transformers' FP8 reader, on CPU: dequantizes weight * weight_scale_inv per block while loading
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.float32).eval()
    return dict(root=root, fp8=str(fp8), model=model, dequantized=str(dequantized), ref=ref, n_fp8=n_fp8, tensors=out,
                target=load_target(str(fp8), dtype="float32"))


def test_weights_stay_fp8_on_the_device(fp8_case):
    target = fp8_case["target"]
    assert target.config.weight_quant == Fp8BlockQuant(block=BLOCK)
    leaves = jax.tree_util.tree_leaves_with_path(target.params)
    fp8 = [jax.tree_util.keystr(k) for k, v in leaves if v.dtype == jnp.float8_e4m3fn]
    scales = [jax.tree_util.keystr(k) for k, v in leaves if jax.tree_util.keystr(k).endswith("_scale_inv']")]
    # every quantized file tensor is one stacked float8 row of one leaf: 5 attention + 3 dense-MLP +
    # 3 expert + 3 shared-expert kernels, each with its scale leaf
    assert len(fp8) == len(scales) == 14, fp8
    att = target.params["layers"]["self_attn"]["kv_b_proj"]
    assert att["kernel"].dtype == jnp.float8_e4m3fn and att["kernel"].shape == (4, 16, 4 * 24)
    assert att["kernel_scale_inv"].shape == (4, 1, 12)  # [L, in/16, out/8], float32
    ex = target.params["moe_layers"]["experts"]["down_proj"]
    assert ex["kernel"].shape == (3, 8, 32, 64) and ex["kernel_scale_inv"].shape == (3, 8, 2, 8)
    # the leaves hold the file's bytes: the kernel of expert 5 of the last layer is that tensor, transposed
    raw = fp8_case["tensors"]["model.layers.3.mlp.experts.5.down_proj.weight"]
    np.testing.assert_array_equal(np.asarray(ex["kernel"][-1, 5]).view(np.uint8), raw.view(torch.uint8).numpy().T)
    assert target.params["moe_layers"]["router"]["kernel"].dtype == jnp.float32  # routers are not quantized
    nbytes = sum(v.nbytes for _, v in leaves)
    file_bytes = os.path.getsize(os.path.join(fp8_case["fp8"], "model.safetensors"))
    assert nbytes <= file_bytes < 1.05 * nbytes + 65536  # the device copy is the checkpoint's size


def test_parity_with_transformers_fp8_reader(fp8_case):
    target, ref = fp8_case["target"], fp8_case["ref"]
    ids = np.random.RandomState(0).randint(0, VOCAB, (2, 24)).astype(np.int32)
    logits, layers, final = hf_run(ref, ids)
    out = target(jnp.asarray(ids), aux_layer_ids=AUX)
    assert rel_err(out.logits, logits) < REL_TOL
    assert rel_err(out.final_hidden, final) < REL_TOL
    for a, k in zip(out.aux_hidden, AUX):
        assert rel_err(a, layers[k]) < REL_TOL, k
    # the quantization is not a no-op: the unquantized model differs far beyond the tolerance
    with torch.no_grad():
        unquantized = fp8_case["model"](torch.tensor(ids, dtype=torch.long), use_cache=False).logits.numpy()
    assert rel_err(unquantized, logits) > 100 * REL_TOL
    # bf16: the same as a bf16 load of the dequantized weights (each rounded to bf16 once, either way)
    bf16 = load_target(fp8_case["fp8"], dtype="bfloat16")
    assert bf16.params["layers"]["self_attn"]["o_proj"]["kernel"].dtype == jnp.float8_e4m3fn
    want = load_target(fp8_case["dequantized"], dtype="bfloat16")(jnp.asarray(ids), aux_layer_ids=AUX).logits
    got = bf16(jnp.asarray(ids), aux_layer_ids=AUX).logits
    print("bf16 fp8-load vs bf16 dequantized-load rel", rel_err(got, want))
    assert rel_err(got, want) < BF16_SAME_TOL


def test_cached_decoding_equals_forward(fp8_case):
    target = fp8_case["target"]
    ids = np.random.RandomState(1).randint(0, VOCAB, (1, 12)).astype(np.int32)
    want = target(jnp.asarray(ids), aux_layer_ids=AUX).logits
    cache = target.init_cache(1, 32)
    pos = jnp.arange(12, dtype=jnp.int32)[None]
    logits, _, _, cache = target.decode_chunk(target.params, cache, jnp.asarray(ids[:, :8]), pos[:, :8],
                                              jnp.zeros((1,), jnp.int32))
    logits2, _, _, _ = target.decode_chunk(target.params, cache, jnp.asarray(ids[:, 8:]), pos[:, 8:],
                                           jnp.full((1,), 8, jnp.int32))
    got = np.concatenate([np.asarray(logits), np.asarray(logits2)], axis=1)
    assert rel_err(got, want) < REL_TOL


def test_quantized_weight_map():
    cfg = ds.DeepseekV3TargetConfig.from_hf({**transformers.DeepseekV3Config(**CONFIG).to_dict(),
                                             "architectures": ["DeepseekV3ForCausalLM"],
                                             "quantization_config": {**QCONFIG, "weight_block_size": [128, 128],
                                                                     "modules_to_not_convert": ["o_proj", "model.layers.*.mlp.shared_experts.*"]}})
    specs = {s.hf_name: s for s in ds.weight_specs(cfg)}
    assert specs["model.layers.{i}.self_attn.q_a_proj.weight"].dtype == "float8_e4m3fn"
    assert specs["model.layers.{i}.self_attn.q_a_proj.weight_scale_inv"].shape == (4, 1, 1)  # ceil(64/128)
    assert specs["model.layers.{i}.self_attn.o_proj.weight"].dtype is None  # not converted (a component name)
    assert specs["model.layers.{i}.mlp.shared_experts.up_proj.weight"].dtype is None  # not converted (a glob)
    assert "model.layers.{i}.mlp.shared_experts.up_proj.weight_scale_inv" not in specs
    assert specs["model.layers.{i}.mlp.gate.weight"].dtype == "float32"  # routers stay fp32
    assert "model.embed_tokens.weight_scale_inv" not in specs and "lm_head.weight_scale_inv" not in specs
    assert quantize_weight_specs(list(specs.values()), None) == list(specs.values())
    # to_hf carries the format back
    assert ds.DeepseekV3TargetConfig.from_hf(cfg.to_hf()).weight_quant == cfg.weight_quant


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq' is not read"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "no weight_block_size: per-tensor"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "only 'e4m3'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "must be two positive integers"),
])
def test_unsupported_formats_are_refused(qc, match):
    with pytest.raises(ValueError, match=match):
        weight_quant_from_hf({"quantization_config": qc}, "DeepseekV3ForCausalLM")


def test_fp8_file_and_config_must_agree(fp8_case, tmp_path):
    # FP8 tensors, but config.json lost its quantization_config
    no_q = tmp_path / "no_q"
    shutil.copytree(fp8_case["fp8"], no_q)
    cfg = json.loads((no_q / "config.json").read_text())
    del cfg["quantization_config"]
    (no_q / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="stores FP8 block-scaled weights .* has no quantization_config"):
        load_target(str(no_q), dtype="float32")
    # the config says o_proj is FP8 but the file keeps it in fp32 (a module missing from modules_to_not_convert)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    tensors = dict(fp8_case["tensors"])
    for i in range(4):
        name = f"model.layers.{i}.self_attn.o_proj.weight"
        tensors[name] = fp8_block_dequantize(tensors[name], tensors.pop(name + "_scale_inv"))
    safetensors_torch.save_file(tensors, str(mixed / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(fp8_case["fp8"], "config.json"), mixed / "config.json")
    with pytest.raises(ValueError, match="missing tensors: .*o_proj.weight_scale_inv"):
        load_target(str(mixed), dtype="float32")
    cfg = json.loads((mixed / "config.json").read_text())
    cfg["quantization_config"]["modules_to_not_convert"] = ["o_proj"]
    (mixed / "config.json").write_text(json.dumps(cfg))
    ok = load_target(str(mixed), dtype="float32")
    assert ok.params["layers"]["self_attn"]["o_proj"]["kernel"].dtype == jnp.float32
    ids = jnp.asarray(np.random.RandomState(0).randint(0, VOCAB, (1, 16)), jnp.int32)
    assert rel_err(ok(ids).logits, fp8_case["target"](ids).logits) < REL_TOL


def test_qwen3_moe_fp8_release_matches_transformers(tmp_path):
    """The same format on a GQA + qk-norm + softmax-routed MoE family (Qwen3-30B-A3B-FP8's layout):
    the router stays as stored, every other decoder-layer linear is FP8."""
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
                                         max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    randomize_(model, 5)
    _, n_fp8 = write_fp8_release(model, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32).eval()
    target = load_target(str(tmp_path / "fp8"), dtype="float32")
    p = target.params
    assert p["moe_layers"]["experts"]["up_proj"]["kernel"].dtype == jnp.float8_e4m3fn
    assert p["layers"]["self_attn"]["k_proj"]["kernel_scale_inv"].shape == (3, 4, 4)  # [L, 64/16, 32/8]
    assert p["moe_layers"]["router"]["kernel"].dtype == jnp.float32
    assert n_fp8 == 3 * 4 + 3 + 2 * 8 * 3  # attention, layer 0's dense MLP, layers 1-2's experts
    ids = np.random.RandomState(2).randint(0, VOCAB, (2, 16)).astype(np.int32)
    logits, _, final = hf_run(ref, ids)
    out = target(jnp.asarray(ids))
    assert rel_err(out.logits, logits) < REL_TOL and rel_err(out.final_hidden, final) < REL_TOL
    assert target.config.to_hf()["quantization_config"]["weight_block_size"] == list(BLOCK)

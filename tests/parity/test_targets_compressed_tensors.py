"""compressed-tensors checkpoints (llm-compressor's format: GLM-4.x-FP8, FP8-Dynamic re-saves, Kimi
K2.5's int4 experts) load as stored and stay quantized in device memory (specjax/targets/quantized.py).

A tiny random Qwen3-MoE (fp32, transformers) is written three ways, with NumPy doing the quantization
and the bit packing (an independent encoder of the format, not specjax's decoder):
  * "fp8_channel": every decoder-layer linear but the router in FP8 e4m3 with one bf16 scale per output
    channel ([out, 1]);
  * "fp8_block": the same with one scale per 8 x 16 tile (a non-square block: a transposed grid fails);
  * "int4_group": only the routed experts (targets "re:.*mlp.experts.*", as Kimi K2.5), symmetric int4
    packed eight to an int32 (lowest bits first, stored as value + 8), one scale per 16 inputs.
The reference is transformers on a folder holding the NumPy-dequantized weights: logits, final hidden
and the aux states within rel 1e-4 in fp32. The stored leaves keep their dtypes (float8 / int32).
Also: specjax_kernels.quant.int_pack_dequantize against a NumPy decoder for 2, 4 and 8 bits, and the
config refusals.
"""
from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from specjax_kernels.quant import int_pack_dequantize  # noqa: E402

from specjax.targets import load_target  # noqa: E402
from specjax.targets.quantized import CompressedTensorsQuant, weight_quant_from_hf  # noqa: E402

from parity._hf_weights import hf_run, randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
VOCAB = 128
AUX = (0, 1, 2)
BLOCK = (8, 16)
GROUP = 16
IGNORE = ["lm_head", "re:.*mlp\\.gate$"]
SCHEMES = {
    "fp8_channel": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel"}, ["Linear"]),
    "fp8_block": ("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block",
                                      "block_structure": list(BLOCK)}, ["Linear"]),
    "int4_group": ("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP},
                   ["re:.*mlp\\.experts.*"]),
}


def np_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Signed codes [out, in] -> int32 words [out, in * bits / 32], the first code in the lowest bits."""
    per = 32 // bits
    u = (codes.astype(np.int64) + (1 << (bits - 1))).reshape(codes.shape[0], -1, per)
    words = np.zeros(u.shape[:2], np.uint64)
    for j in range(per):
        words |= (u[:, :, j].astype(np.uint64) << np.uint64(bits * j))
    return words.astype(np.uint32).view(np.int32)


def np_unpack(words: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    u = words.view(np.uint32).astype(np.int64)
    codes = np.stack([(u >> (bits * j)) & ((1 << bits) - 1) for j in range(per)], axis=-1)
    return codes.reshape(words.shape[0], -1) - (1 << (bits - 1))


def quantize(name: str, w: np.ndarray, scheme: str):
    """(stored tensors {name: array}, the dequantized fp32 weight) of one [out, in] weight."""
    o, i = w.shape
    if scheme == "int4_group":
        scale = (np.abs(w).reshape(o, i // GROUP, GROUP).max(-1) / 7.0).astype(np.float32)
        codes = np.clip(np.round(w / np.repeat(scale, GROUP, 1)), -8, 7).astype(np.int64)
        return ({name + "_packed": np_pack(codes, 4), name + "_scale": scale,
                 name + "_shape": np.array([o, i], np.int64)}, codes * np.repeat(scale, GROUP, 1))
    if scheme == "fp8_channel":
        scale = (np.abs(w).max(1, keepdims=True) / 448.0).astype(ml_dtypes.bfloat16)
        full = scale.astype(np.float32)
    else:
        bo, bi = BLOCK
        scale = (np.abs(w).reshape(o // bo, bo, i // bi, bi).max((1, 3)) / 448.0).astype(np.float32)
        full = np.repeat(np.repeat(scale, bo, 0), bi, 1)
    q = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return {name: q, name + "_scale": scale}, q.astype(np.float32) * full


def _to_torch(a: np.ndarray):
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
                                      max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    randomize_(model, 7)
    model.save_pretrained(str(root / "fp32"))
    return root


def _write_case(root, scheme):
    fmt, weights, targets = SCHEMES[scheme]
    quant = CompressedTensorsQuant(fmt, weights["num_bits"], weights["strategy"],
                                   tuple(weights.get("block_structure", ())) or None, weights.get("group_size"),
                                   tuple(targets), tuple(IGNORE))
    tensors = {k: v.float().numpy() for k, v in safetensors_torch.load_file(str(root / "fp32" / "model.safetensors")).items()}
    stored, plain, n = {}, {}, 0
    for name, w in tensors.items():
        if name.startswith("model.layers.") and name.endswith(".weight") and w.ndim == 2 and quant.converts(name):
            parts, plain[name] = quantize(name, w, scheme)
            stored.update(parts)
            n += 1
        else:
            stored[name] = plain[name] = w
    cfg = json.loads((root / "fp32" / "config.json").read_text())
    for kind, tensors_out, qc in (("q", stored, {"quant_method": "compressed-tensors", "format": fmt,
                                                  "quantization_status": "compressed", "ignore": IGNORE,
                                                  "config_groups": {"group_0": {"targets": targets,
                                                                                "weights": weights}}}),
                                  ("deq", plain, None)):
        d = root / f"{scheme}_{kind}"
        d.mkdir()
        safetensors_torch.save_file({k: _to_torch(v) for k, v in tensors_out.items()}, str(d / "model.safetensors"),
                                    metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})}))
    return str(root / f"{scheme}_q"), str(root / f"{scheme}_deq"), n


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_tensors_checkpoint_matches_transformers(model_dir, scheme):
    q_dir, deq_dir, n = _write_case(model_dir, scheme)
    ref = transformers.AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32).eval()
    target = load_target(q_dir, dtype="float32")
    p = target.params
    assert isinstance(target.config.weight_quant, CompressedTensorsQuant)
    experts = p["moe_layers"]["experts"]["up_proj"]
    if scheme == "int4_group":
        assert n == 2 * 8 * 3  # the experts of layers 1-2 only
        assert experts["kernel_packed"].dtype == jnp.int32 and experts["kernel_packed"].shape == (2, 8, 32, 8)
        assert experts["kernel_scale"].shape == (2, 8, 32, 64 // GROUP)
        assert p["layers"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.float32  # not targeted
    else:
        assert n == 3 * 4 + 3 + 2 * 8 * 3
        assert experts["kernel"].dtype == jnp.float8_e4m3fn
        scale = p["layers"]["self_attn"]["o_proj"]["kernel_scale"]
        assert scale.shape == ((3, 1, 64) if scheme == "fp8_channel" else (3, 64 // 16, 64 // 8))
    assert p["moe_layers"]["router"]["kernel"].dtype == jnp.float32  # ignored by the pattern (and as stored)
    ids = np.random.RandomState(3).randint(0, VOCAB, (2, 16)).astype(np.int32)
    logits, layers, final = hf_run(ref, ids)
    out = target(jnp.asarray(ids), aux_layer_ids=AUX)
    assert rel_err(out.logits, logits) < REL_TOL and rel_err(out.final_hidden, final) < REL_TOL
    for a, k in zip(out.aux_hidden, AUX):
        assert rel_err(a, layers[k]) < REL_TOL, k
    assert target.config.to_hf()["quantization_config"]["format"] == SCHEMES[scheme][0]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_int_pack_dequantize_matches_numpy(bits):
    rng = np.random.default_rng(bits)
    o, i, g = 6, 64, 16
    codes = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (o, i))
    words = np_pack(codes, bits)
    np.testing.assert_array_equal(np_unpack(words, bits), codes)  # the NumPy encoder and decoder agree
    scale = rng.uniform(0.5, 2.0, (o, i // g)).astype(np.float32)
    got = int_pack_dequantize(jnp.asarray(words), jnp.asarray(scale), bits, i, g, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), codes.astype(np.float32) * np.repeat(scale, g, 1))


@pytest.mark.parametrize("change, match", [
    ({"format": "nvfp4-pack-quantized"}, "format='nvfp4-pack-quantized'"),
    ({"config_groups": {"a": {}, "b": {}}}, "2 schemes"),
    ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                          "symmetric": False}}}}, "zero points are not read"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "token"}}}}, "strategy='token'"),
])
def test_unread_compressed_tensors_formats_are_refused(change, match):
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}, **change}
    if change.get("format") is None and "symmetric" in json.dumps(change):
        qc["format"] = "pack-quantized"
    with pytest.raises(ValueError, match=match):
        weight_quant_from_hf({"quantization_config": qc}, "Qwen3MoeForCausalLM")


def test_kimi_k25_int4_experts_as_released(tmp_path):
    """Kimi K2.5's layout: the DeepSeek-V3 text model under language_model., its routed experts int4
    (pack-quantized, groups of 16 here) and the quantization_config inside text_config; the multimodal
    target reads it and matches transformers' Kimi_K25ForConditionalGeneration on the dequantized
    weights."""
    import test_targets_multimodal as mmt

    torch.manual_seed(0)
    model = transformers.Kimi_K25ForConditionalGeneration(mmt._kimi_k25()).eval()
    randomize_(model, 9)
    plain_dir = mmt.save_as_released(model, "Kimi_K25ForConditionalGeneration", str(tmp_path / "plain"))
    fmt, weights, targets = SCHEMES["int4_group"]
    quant = weight_quant_from_hf({"quantization_config": {"quant_method": "compressed-tensors", "format": fmt,
                                                          "config_groups": {"g": {"targets": targets,
                                                                                  "weights": weights}}}}, "Kimi")
    stored, plain = {}, {}
    for name, t in mmt._tensors(plain_dir).items():
        w = t.astype(np.float32)
        if name.startswith("language_model.model.layers.") and name.endswith(".weight") and quant.converts(name):
            parts, plain[name] = quantize(name, w, "int4_group")
            stored.update(parts)
        else:
            stored[name] = plain[name] = w
    assert any(n.endswith("experts.3.down_proj.weight_packed") for n in stored)
    cfg = json.loads((tmp_path / "plain_released" / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt,
                                                 "config_groups": {"group_0": {"targets": targets, "weights": weights}},
                                                 "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "lm_head"]}
    q_dir = mmt._write_folder(plain_dir, str(tmp_path / "q"), stored)
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    deq_dir = mmt._write_folder(plain_dir, str(tmp_path / "deq"), plain)
    ref = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(deq_dir, dtype=torch.float32).eval()
    target = load_target(q_dir, dtype="float32")
    assert target.params["moe_layers"]["experts"]["down_proj"]["kernel_packed"].dtype == jnp.int32
    assert target.params["moe_layers"]["shared_experts"]["down_proj"]["kernel"].dtype == jnp.float32
    ids = np.random.RandomState(4).randint(0, VOCAB, (2, 12)).astype(np.int32)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids, dtype=torch.long), use_cache=False).logits.numpy()
    assert rel_err(target(jnp.asarray(ids)).logits, want) < REL_TOL


def test_packed_codes_and_group_scales_shard_like_their_kernel():
    """An int4 expert kernel [L, E, in, out] stored as codes [L, E, out, in / 8] and scales
    [L, E, out, in / g] keeps the kernel's logical axes (output then input), so FSDP and expert
    sharding split the stored tensors as they split a bf16 kernel (left whole, a 1 T model's codes sat
    on every FSDP shard); a dimension the mesh does not divide stays whole (mesh._fits)."""
    from specjax import mesh as meshlib
    from specjax.targets.base import WeightSpec

    quant = CompressedTensorsQuant("pack-quantized", 4, "group", group_size=32)
    kernel = WeightSpec("model.layers.{i}.mlp.experts.{e}.up_proj.weight", ("moe_layers", "experts", "up_proj", "kernel"),
                        True, (2, 8, 256, 64), ("layers", "experts", "embed", "expert_mlp"))
    packed, scale = quant.stored_specs(kernel)
    assert packed.path[-1] == "kernel_packed" and packed.shape == (2, 8, 64, 32)
    assert packed.axes == scale.axes == ("layers", "experts", "expert_mlp", "embed")
    assert scale.shape == (2, 8, 64, 8)
    mesh = meshlib.make_mesh({"data": 1, "fsdp": 4, "expert": 2})
    spec = meshlib.named_sharding(mesh, packed.axes, packed.shape).spec
    on_dev = meshlib.named_sharding(mesh, packed.axes, packed.shape).shard_shape(packed.shape)
    assert on_dev[1] == 4 and on_dev[-1] == 8, (spec, on_dev)  # experts over expert=2, codes' input over fsdp=4
    # 8 scale groups over fsdp=4 divide; 6 would not and stay whole
    odd = meshlib.named_sharding(mesh, scale.axes, (2, 8, 64, 6)).shard_shape((2, 8, 64, 6))
    assert odd[-1] == 6

"""MiniMax-M2 (``MiniMaxM2ForCausalLM``: MiniMax-M2 / M2.1 / M2.5) vs transformers (PyTorch) on tiny random
checkpoints (CPU, fp32), plus its cached decoding, config reading and the real-shape config in
configs/targets/minimax_m2.

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state and
three aux states (aux id k = output of layer k, read from forward hooks on transformers' decoder
layers; the final hidden from a hook on its final norm). Two tiny variants, 3 layers:
  * "published": the published layout. GQA (4 query / 2 KV heads of 16), partial RoPE on 8 of 16
    dims given as the legacy ``rotary_dim`` with a top-level ``rope_theta`` 5e6 (the checkpoint's
    config.json is rewritten to that layout), top-3 of 8 experts, the published MiniMax keys
    (attn_type_list, qk_norm_type, scoring_func, ...) and MTP tensors on disk as layer 3;
  * "tied_llama3": full-width RoPE with llama3 scaling, 4 KV heads (no grouping), top-2 of 6,
    tied embeddings.
Weights are redrawn larger than transformers' init (``parity._hf_weights.randomize_``) and the
routers' e_score_correction_bias buffers drawn N(0, 0.3^2), so routing, RoPE width and norm mistakes
move the outputs far beyond the tolerance (test_each_detail_matters and
test_qk_norm_spans_all_heads show the correction bias, the partial RoPE and the full-width q/k norm
each do).

Cached decoding equals the forward to 1e-4 relative for a prefill written over a stale chunk after
a rollback, single tokens and a chunk (left padding with logits_index, lossless speculative
decoding, tree chunks and the device loop: the minimax_m2 entry of parity/test_decoding_families.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.layers.norms import rms_norm  # noqa: E402
from specjax.layers.rope import RopeSpec  # noqa: E402
from specjax.targets import hf_keys, load_target  # noqa: E402
from specjax.targets import minimax_m2 as mm  # noqa: E402  (importing it registers MiniMaxM2ForCausalLM)
from specjax.targets.layers.scan import index_layer  # noqa: E402
from specjax.targets.loading import read_hf_config  # noqa: E402

from parity._hf_weights import assert_matches_hf, randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
VOCAB = 256
LAYERS = 3
AUX = (0, 1, 2)  # the last one is the pre-norm state
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
              head_dim=16, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
VARIANTS = {
    "published": dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=3, rotary_dim=8),
    "tied_llama3": dict(num_key_value_heads=4, num_local_experts=6, num_experts_per_tok=2, tie_word_embeddings=True,
                        rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 64}),
}
# what the published config.json carries beside transformers' keys (its legacy RoPE spelling included)
PUBLISHED_KEYS = {"attn_type_list": [1] * LAYERS, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                  "shared_intermediate_size": 0, "use_mtp": True, "num_mtp_modules": 3, "mtp_transformer_layers": 1,
                  "use_qk_norm": True, "use_routing_bias": True, "rope_theta": 5000000, "rotary_dim": 8}


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t)).astype(np.int32)


@pytest.fixture(scope="module")
def tmp_mod(tmp_path_factory):
    return tmp_path_factory.mktemp("minimax_m2")


def _to_published_layout(path):
    """Rewrite a save_pretrained folder as MiniMax publishes it: the legacy rope spelling, the MiniMax
    keys, and an MTP module's tensors as layer LAYERS (which the target must ignore)."""
    from safetensors.numpy import load_file, save_file

    cfg_path = os.path.join(path, "config.json")
    hf = json.loads(open(cfg_path).read())
    assert hf["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5}
    hf.pop("rope_parameters")
    hf.update(PUBLISHED_KEYS)
    open(cfg_path, "w").write(json.dumps(hf))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors[f"model.layers.{LAYERS}.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    tensors[f"model.layers.{LAYERS}.self_attn.q_proj.weight"] = np.zeros((64, 64), np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def _make(tmp_mod, variant, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.MiniMaxM2Config(**COMMON, **VARIANTS[variant])).eval()
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a buffer, so randomize_ leaves it at zero
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
    path = str(tmp_mod / variant)
    model.save_pretrained(path)
    if variant == "published":
        _to_published_layout(path)
    return model, path, load_target(path, dtype="float32")


@pytest.fixture(scope="module")
def cases(tmp_mod):
    return {v: _make(tmp_mod, v, seed) for v, seed in (("published", 1), ("tied_llama3", 2))}


# =============================================================================================
# Parity with transformers
# =============================================================================================
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity(cases, variant):
    model, path, target = cases[variant]
    cfg = target.config
    assert target.arch == "MiniMaxM2ForCausalLM" and isinstance(cfg, mm.MiniMaxM2TargetConfig)
    assert cfg.rotary_dim == (8 if variant == "published" else 16)
    assert cfg.rope.theta == (5e6 if variant == "published" else 1e4)
    p = target.params["layers"]
    e, f = cfg.num_experts, cfg.intermediate_size
    assert p["experts"]["gate_proj"]["kernel"].shape == (LAYERS, e, 64, f)
    assert p["self_attn"]["q_norm"]["scale"].shape == (LAYERS, 64)  # all 4 heads x 16
    assert p["self_attn"]["k_norm"]["scale"].shape == (LAYERS, cfg.num_key_value_heads * 16)
    assert ("lm_head" in target.params) == (not cfg.tie_word_embeddings)
    # expert 5's w1 / w3 of the last layer are transformers' fused gate / up rows, transposed
    gate_up = model.model.layers[-1].mlp.experts.gate_up_proj[5].detach().numpy()
    np.testing.assert_array_equal(np.asarray(p["experts"]["gate_proj"]["kernel"][-1, 5]), gate_up[:f].T)
    np.testing.assert_array_equal(np.asarray(p["experts"]["up_proj"]["kernel"][-1, 5]), gate_up[f:].T)

    ids = _ids(2, 20, seed=3)
    positions = np.broadcast_to(np.arange(20, dtype=np.int32) + 300, (2, 20)).copy()
    assert_matches_hf(target, model, ids, positions, AUX, REL_TOL, variant)


def test_qk_norm_spans_all_heads(cases):
    """q/k are RMS-normalised over all heads at once (transformers' q_norm / k_norm outputs), which a
    per-head norm with the same weights misses by far more than the tolerance."""
    model, _, target = cases["published"]
    seen = {}
    attn = model.model.layers[1].self_attn
    hooks = [model.model.layers[1].input_layernorm.register_forward_hook(lambda m, a, o: seen.update(h=o)),
             attn.q_norm.register_forward_hook(lambda m, a, o: seen.update(q=o)),
             attn.k_norm.register_forward_hook(lambda m, a, o: seen.update(k=o))]
    ids = _ids(1, 9, seed=4)
    try:
        with torch.no_grad():
            model(torch.tensor(ids, dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    cfg = target.config
    lp = index_layer(target.params["layers"], 1)["self_attn"]
    h = jnp.asarray(seen["h"].numpy())
    q, k, _ = mm.project_qkv(lp, cfg, h)
    for ours, name, heads in ((q, "q", cfg.num_attention_heads), (k, "k", cfg.num_key_value_heads)):
        ref = seen[name].numpy()
        assert rel_err(np.asarray(ours).reshape(ref.shape), ref) <= 1e-5, name
        raw = (h @ lp[f"{name}_proj"]["kernel"]).reshape(1, 9, heads, 16)
        per_head = rms_norm(raw, lp[f"{name}_norm"]["scale"].reshape(heads, 16), cfg.rms_norm_eps)
        assert rel_err(per_head, ref.reshape(per_head.shape)) > 1e-2, name


def test_each_detail_matters(cases):
    """The parity above is not vacuous: the correction bias and the partial RoPE width each move the
    logits by far more than the tolerance."""
    _, _, target = cases["published"]
    ids = _ids(1, 16, seed=5)
    positions = np.arange(16, dtype=np.int32)[None] + 300
    ref = target(ids, aux_layer_ids=AUX, positions=positions).logits
    cfg, cls = target.config, type(target)
    no_bias = jax.tree.map(lambda x: x, target.params)
    no_bias["layers"]["router"]["e_score_correction_bias"] = jnp.zeros_like(
        no_bias["layers"]["router"]["e_score_correction_bias"])
    changed = {
        "full-width RoPE": cls(dataclasses.replace(cfg, rope=RopeSpec("default", cfg.rope.theta)), {}, target.params),
        "no correction bias": cls(cfg, {}, no_bias),
    }
    for name, other in changed.items():
        moved = rel_err(other(ids, aux_layer_ids=AUX, positions=positions).logits, ref)
        assert moved > 1e-2, (name, moved)


def test_bf16_load_keeps_the_router_fp32(cases):
    _, path, _ = cases["published"]
    t16 = load_target(path, dtype="bfloat16")
    router = t16.params["layers"]["router"]
    assert router["kernel"].dtype == jnp.float32 and router["e_score_correction_bias"].dtype == jnp.float32
    assert t16.params["layers"]["experts"]["down_proj"]["kernel"].dtype == jnp.bfloat16
    assert t16.params["layers"]["self_attn"]["q_norm"]["scale"].dtype == jnp.bfloat16


def test_mtp_layers_on_disk_are_ignored(cases, tmp_mod):
    """The published layout's MTP tensors (layer 3 here, num_mtp_modules=3) load as nothing; without
    num_mtp_modules they are unexpected tensors."""
    _, path, target = cases["published"]
    assert target.config.num_mtp_modules == 3
    folder = tmp_mod / "no_mtp"
    shutil.copytree(path, folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "num_mtp_modules": 0}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.3\.eh_proj\.weight, "
                                         r"model\.layers\.3\.self_attn\.q_proj\.weight"):
        load_target(str(folder), dtype="float32")
    assert mm.MiniMaxM2Target.ignored_hf_names(target.config, "model.layers.5.eh_proj.weight")
    assert not mm.MiniMaxM2Target.ignored_hf_names(target.config, "model.layers.6.eh_proj.weight")


# =============================================================================================
# Cached decoding == the forward
# =============================================================================================
def _decoder(target, aux_ids):
    return jax.jit(lambda c, i, p, s, m=None, vf=None, li=None: target.decode_chunk(
        target.params, c, i, p, s, aux_layer_ids=aux_ids, chunk_mask=m, valid_from=vf, logits_index=li))


def _close(got, want, what):
    err = rel_err(got, want)
    assert err <= REL_TOL, f"{what}: rel err {err:.2e} > {REL_TOL}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decoding_equals_forward(cases, variant):
    _, _, target = cases[variant]
    ids = jnp.asarray(_ids(2, 12, seed=6))
    full = target(ids, aux_layer_ids=AUX)
    cache = target.init_cache(2, 40)
    kv = target.config.num_key_value_heads
    assert jax.tree.map(lambda x: x.shape, cache) == {"k": (LAYERS, 2, 256, kv, 16), "v": (LAYERS, 2, 256, kv, 16)}
    decode = _decoder(target, AUX)
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    at = lambda s: jnp.full((2,), s, jnp.int32)  # noqa: E731
    # a wrong 5-token chunk at slot 3 first (stale entries), then roll back to 0: prefill 5, two
    # single tokens, a chunk of 5 (two chunk shapes: two compilations)
    cache = decode(cache, ids[:, ::-1][:, :5], pos[:, 3:8], at(3))[3]
    pieces = []
    for a, b in [(0, 5), (5, 6), (6, 7), (7, 12)]:
        logits, aux, final, cache = decode(cache, ids[:, a:b], pos[:, a:b], at(a))
        pieces.append((logits, aux, final))
    _close(np.concatenate([p[0] for p in pieces], 1), full.logits, "logits")
    _close(np.concatenate([p[2] for p in pieces], 1), full.final_hidden, "final hidden")
    for k in range(len(AUX)):
        _close(np.concatenate([p[1][k] for p in pieces], 1), full.aux_hidden[k], f"aux {AUX[k]}")
    # every layer's cached keys are read: corrupting one layer's valid slots moves token 6
    ref6 = np.asarray(pieces[2][0][:, 0])
    prefix = (jnp.arange(256) < 6)[None, :, None, None]
    for layer in range(LAYERS):
        bad = dict(cache, k=cache["k"].at[layer].set(jnp.where(prefix, 1.0, cache["k"][layer])))
        moved = rel_err(decode(bad, ids[:, 6:7], pos[:, 6:7], at(6))[0][:, 0], ref6)
        assert moved > 1e-4, (layer, moved)


# =============================================================================================
# Config table, RoPE spellings and errors
# =============================================================================================
def _table_test_config():
    """Every table key away from its default (a key dropped on either side changes the result)."""
    return transformers.MiniMaxM2Config(
        vocab_size=96, hidden_size=48, intermediate_size=24, num_hidden_layers=5, num_attention_heads=6,
        num_key_value_heads=2, head_dim=12, num_local_experts=12, num_experts_per_tok=3, rms_norm_eps=3e-6,
        tie_word_embeddings=True, max_position_embeddings=777, num_mtp_modules=2, rotary_dim=6,
        rope_parameters={"rope_type": "default", "rope_theta": 12345.0})


def test_to_hf_round_trips_through_transformers():
    hf = {**_table_test_config().to_dict(), "architectures": ["MiniMaxM2ForCausalLM"]}
    cfg = mm.MiniMaxM2TargetConfig.from_hf(hf)
    assert cfg.rotary_dim == 6 and cfg.rope.theta == 12345.0 and cfg.num_mtp_modules == 2
    written = cfg.to_hf()
    assert mm.MiniMaxM2TargetConfig.from_hf(written) == cfg
    assert not [row.key for row in mm.HF_KEYS if row.key not in written], "a key of the table is not written"
    for row in mm.HF_KEYS:
        if not callable(row.default) and row.default is not hf_keys.REQUIRED:
            assert getattr(cfg, row.field_name) != row.convert(row.default), f"{row.key} is at its default"
    through = transformers.MiniMaxM2Config(
        **{k: v for k, v in written.items() if k not in ("architectures", "model_type")}).to_dict()
    assert mm.MiniMaxM2TargetConfig.from_hf({**through, "architectures": written["architectures"]}) == cfg


# (config.json RoPE keys, the rotary width and theta transformers reads from them); head_dim 128
ROPE_SPELLINGS = {
    "published": ({"rope_theta": 5000000, "rotary_dim": 64}, 64, 5e6),
    "no theta": ({"rotary_dim": 32}, 32, 5e6),
    "full width": ({"rope_theta": 1e4}, 128, 1e4),
    "parameters win": ({"rotary_dim": 64, "rope_parameters": {"rope_type": "default", "rope_theta": 7e5,
                                                              "partial_rotary_factor": 0.25}}, 32, 7e5),
    "top-level factor wins": ({"rotary_dim": 64, "partial_rotary_factor": 0.75, "rope_theta": 3e5}, 96, 3e5),
}


@pytest.mark.parametrize("name", sorted(ROPE_SPELLINGS))
def test_rope_spellings_read_as_transformers_reads_them(name):
    keys, rot, theta = ROPE_SPELLINGS[name]
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=128, num_local_experts=2, num_experts_per_tok=1)
    hf_rope = transformers.MiniMaxM2Config(**base, **keys).rope_parameters
    assert int(128 * hf_rope.get("partial_rotary_factor", 1.0)) == rot and hf_rope["rope_theta"] == theta
    cfg = mm.MiniMaxM2TargetConfig.from_hf({**base, **keys, "architectures": ["MiniMaxM2ForCausalLM"]})
    assert cfg.rotary_dim == rot and cfg.rope.theta == theta and cfg.rope.rope_type == "default"


def test_config_errors():
    hf = {**_table_test_config().to_dict(), "architectures": ["MiniMaxM2ForCausalLM"]}
    fp8 = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "weight_block_size": [128, 128],
           "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    # the FP8 release's format is read (its weights stay FP8 on the device: tests/parity/test_targets_fp8.py)
    q = mm.MiniMaxM2TargetConfig.from_hf({**hf, "quantization_config": fp8})
    assert q.weight_quant.block == (128, 128) and mm.MiniMaxM2TargetConfig.from_hf(q.to_hf()) == q
    specs = {s.hf_name: s for s in mm.weight_specs(q)}
    assert specs["model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight"].dtype == "float8_e4m3fn"
    assert "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight_scale_inv" in specs
    assert specs["model.layers.{i}.block_sparse_moe.gate.weight"].dtype == "float32"  # the router as stored
    assert "model.layers.{i}.block_sparse_moe.gate.weight_scale_inv" not in specs
    int4 = {"quant_method": "awq", "bits": 4}
    bad = {
        "quantization_config": (int4, r"quant_method='awq' is not read.*dequantize the checkpoint"),
        "scoring_func": ("softmax", r"scoring_func='softmax' is not supported"),
        "use_qk_norm": (False, r"use_qk_norm=False is not supported"),
        "qk_norm_type": ("per_head", r"qk_norm_type='per_head' is not supported"),
        "use_routing_bias": (False, r"use_routing_bias=False is not supported"),
        "shared_intermediate_size": (512, r"shared_intermediate_size=512 is not supported"),
        "attn_type_list": ([1, 0, 1, 1, 1], r"attn_type_list must hold only 1"),
        "attention_bias": (True, "attention_bias=true is not supported"),
        "hidden_act": ("gelu", r"hidden_act='gelu' is not supported"),
        "num_experts_per_tok": (13, r"num_experts_per_tok=13 must be in 1..num_local_experts=12"),
        "num_key_value_heads": (4, r"num_attention_heads=6 must be a multiple of num_key_value_heads=4"),
        "rope_parameters": ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, r"unsupported rope type 'yarn'"),
    }
    for key, (value, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            mm.MiniMaxM2TargetConfig.from_hf({**hf, key: value})
    plain = {k: v for k, v in hf.items() if k != "rope_parameters"}
    for rotary_dim, match in ((5, r"rotary width .* = 5 .* must be even"), (13, r"rotary_dim=13 must be an integer "
                                                                                r"in 1..head_dim=12"),
                              ("6", r"rotary_dim='6' must be an integer")):
        with pytest.raises(ValueError, match=match):
            mm.MiniMaxM2TargetConfig.from_hf({**plain, "rotary_dim": rotary_dim})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5 with rope type 'linear' is not supported"):
        mm.MiniMaxM2TargetConfig.from_hf({**plain, "rotary_dim": 6, "rope_scaling": {"rope_type": "linear",
                                                                                     "factor": 2.0}})
    with pytest.raises(ValueError, match="neither num_local_experts nor num_experts"):
        mm.MiniMaxM2TargetConfig.from_hf({k: v for k, v in hf.items() if k != "num_local_experts"})


# =============================================================================================
# The real shape (configs/targets/minimax_m2)
# =============================================================================================
def test_real_config_counts_the_published_parameters(repo_root):
    """Published: "230 billion total parameters with 10 billion active" (transformers' model doc; the
    active count leaves out the embedding and lm_head, 1.23 B). The exact numbers are the sums of the
    tensor shapes, e_score_correction_bias (E per layer) included."""
    from specjax.targets import abstract

    hf = read_hf_config(os.path.join(repo_root, "configs", "targets", "minimax_m2"))
    target = abstract.make_target(hf)
    cfg = target.config
    V, D, L, N, K, hd, E, F, k = 200064, 3072, 62, 48, 8, 128, 256, 1536, 8
    attn = 2 * D * N * hd + 2 * D * K * hd + N * hd + K * hd + 2 * D
    moe = E * 3 * D * F + D * E + E
    total = L * (attn + moe) + 2 * V * D + D
    active = total - L * (E - k) * 3 * D * F
    got = sum(math.prod(s.shape) for s in target.weight_specs(cfg))
    print(f"minimax_m2: {got:,} params ({got / 1e9:.2f} B), {target.active_params_per_token():,} active")
    assert got == total == 228_689_764_864 and target.active_params_per_token() == active
    assert abs(got - 230e9) / 230e9 < 0.03 and abs(active - 2 * V * D - 10e9) / 10e9 < 0.03
    assert cfg.rotary_dim == 64 and cfg.rope.theta == 5e6 and cfg.num_mtp_modules == 3
    leaves = {"/".join(s.path): s.shape for s in target.weight_specs(cfg)}
    assert leaves["layers/experts/gate_proj/kernel"] == (62, 256, 3072, 1536)
    assert leaves["layers/self_attn/q_norm/scale"] == (62, 48 * 128)  # one weight per value of all heads
    assert leaves["layers/self_attn/k_norm/scale"] == (62, 8 * 128)
    assert mm.MiniMaxM2Target.ignored_hf_names(cfg, "model.layers.64.self_attn.q_proj.weight")
    assert not mm.MiniMaxM2Target.ignored_hf_names(cfg, "model.layers.65.self_attn.q_proj.weight")
    # transformers reads the same model from the file
    through = transformers.MiniMaxM2Config.from_dict(hf).to_dict()
    assert mm.MiniMaxM2TargetConfig.from_hf({**through, "architectures": hf["architectures"]}) == cfg
    # the forward and the KV cache at full size, abstractly (nothing allocated)
    params = abstract.abstract_params(type(target), cfg, "bfloat16")
    assert params["layers"]["router"]["kernel"].dtype == jnp.float32
    ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    final, aux = jax.eval_shape(lambda p, i: target.forward(p, i, aux_layer_ids=(1, 30, 58)), params, ids)
    assert final.shape == (1, 16, 3072) and final.dtype == jnp.bfloat16 and len(aux) == 3
    cache = jax.eval_shape(lambda: target.decoder.init_cache(cfg, 1, 300, jnp.bfloat16))
    assert cache["k"].shape == (62, 1, 512, 8, 128)

"""GLM-4.x MoE (``Glm4MoeForCausalLM``: GLM-4.5 / 4.6 / 4.7 / 4.5-Air; ``Glm4MoeLiteForCausalLM``:
GLM-4.7-Flash) vs transformers (PyTorch) on tiny random checkpoints (CPU, fp32), plus cached decoding,
the config tables and refusals, and the real-shape configs in configs/targets/.

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state and
three aux states (aux id k = output of layer k, read from forward hooks on transformers' decoder
layers; the final hidden from a hook on its final norm), at positions 300.. so that RoPE matters.
Three tiny variants, 3 layers, 8 routed experts:
  * "air": GLM-4.5-Air's switches: q/k/v biases, no qk-norm, partial_rotary_factor left at
    transformers' default 0.5, first_k_dense_replace=1, one expert group, weights x 1.0;
  * "qk_norm": GLM-4.5/4.6/4.7's qk-norm with biases, RoPE on a quarter of each head (rope dict),
    first_k_dense_replace=2, top-3 in 1 of 2 groups, two shared experts, raw weights x 2.5, one KV head;
  * "lite": GLM-4.7-Flash (multi-head latent attention over DeepSeek-V3's blocks): query LoRA,
    interleaved RoPE pairs, mlp_layer_types' default (layer 0 dense), top-2 in 1 of 2 groups, x 1.8.
Weights are redrawn larger than transformers' init (``parity._hf_weights.randomize_``) and the
routers' e_score_correction_bias buffers drawn N(0, 0.3^2), so that routing, RoPE width and bias
mistakes move the outputs far beyond the tolerance (test_each_detail_matters shows three do).
Cached decoding equals the forward to 1e-4 relative (a prefill written over a stale chunk after a
rollback, a single token, a chunk).
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

from specjax.layers.rope import RopeSpec  # noqa: E402
from specjax.targets import load_target, registry  # noqa: E402
from specjax.targets import glm4_moe as glm  # noqa: E402  (imported for its @register)
from specjax.targets.loading import read_hf_config  # noqa: E402

from parity._hf_weights import assert_matches_hf, randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
VOCAB = 128
AUX = (0, 1, 2)  # layer 0 (dense), layer 1 (MoE in "air" / "lite", dense in "qk_norm"), the last (pre-norm)
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
              n_routed_experts=8, rms_norm_eps=1e-5, max_position_embeddings=4096)
VARIANTS = {
    "air": (transformers.Glm4MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=False,
        first_k_dense_replace=1, num_experts_per_tok=2, rope_theta=10000.0)),
    "qk_norm": (transformers.Glm4MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_bias=True, use_qk_norm=True,
        first_k_dense_replace=2, n_group=2, topk_group=1, num_experts_per_tok=3, n_shared_experts=2,
        norm_topk_prob=False, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25})),
    "lite": (transformers.Glm4MoeLiteConfig, dict(
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=16, qk_nope_head_dim=12,
        qk_rope_head_dim=8, v_head_dim=10, n_group=2, topk_group=1, num_experts_per_tok=2)),
}
MODEL_TYPES = {"glm4_moe": glm.ARCH, "glm4_moe_lite": glm.LITE_ARCH}  # registry.MODEL_TYPE_TO_ARCH rows


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t)).astype(np.int32)


def _hf_config(variant, **kw):
    cls, extra = VARIANTS[variant]
    return cls(**{**COMMON, **extra, **kw})


@pytest.fixture(scope="module")
def tmp_mod(tmp_path_factory):
    return tmp_path_factory.mktemp("glm4_moe")


def _make(tmp_mod, variant, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(variant)).eval()
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a buffer, so randomize_ leaves it at zero
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
    path = tmp_mod / variant
    model.save_pretrained(str(path))
    return model, str(path), load_target(str(path), dtype="float32")


@pytest.fixture(scope="module")
def cases(tmp_mod):
    return {v: _make(tmp_mod, v, seed) for seed, v in enumerate(VARIANTS, start=1)}


# =============================================================================================
# Parity with transformers
# =============================================================================================
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity(cases, variant):
    model, path, target = cases[variant]
    cfg = target.config
    lite = variant == "lite"
    assert isinstance(cfg, glm.Glm4MoeLiteTargetConfig if lite else glm.Glm4MoeTargetConfig)
    k = {"air": 1, "qk_norm": 2, "lite": 1}[variant]
    assert cfg.mlp_layer_ids == tuple(range(k)) and cfg.moe_layer_ids == tuple(range(k, 3))
    p = target.params
    assert p["moe_layers"]["experts"]["gate_proj"]["kernel"].shape == (3 - k, 8, 48, 24)
    assert p["moe_layers"]["shared_experts"]["up_proj"]["kernel"].shape == (3 - k, 48, 24 * cfg.n_shared_experts)
    assert p["moe_layers"]["router"]["e_score_correction_bias"].shape == (3 - k, 8)
    if lite:
        assert cfg.q_lora_rank == 20 and cfg.rope_interleave and cfg.routed_scaling_factor == 1.8
    else:
        attn = p["layers"]["self_attn"]
        assert attn["q_proj"]["bias"].shape == (3, 64)
        assert attn["k_proj"]["bias"].shape == (3, 16 * cfg.num_key_value_heads)
        assert "bias" not in attn["o_proj"] and ("q_norm" in attn) == cfg.use_qk_norm
        assert cfg.rope.rotary_dim(16) == {"air": 8, "qk_norm": 4}[variant]
    # expert 5 of the last layer is that expert's on-disk tensor, transposed
    w = model.model.layers[2].mlp.experts.gate_up_proj[5, :24].detach().numpy()
    np.testing.assert_array_equal(np.asarray(p["moe_layers"]["experts"]["gate_proj"]["kernel"][-1, 5]), w.T)

    ids = _ids(2, 20, seed=3)
    positions = np.broadcast_to(np.arange(20, dtype=np.int32) + 300, (2, 20)).copy()
    assert_matches_hf(target, model, ids, positions, AUX, REL_TOL, variant)


def test_each_detail_matters(cases):
    """The parity above is not vacuous: the RoPE width, the q/k/v biases and the router's correction
    bias each move the logits by far more than the tolerance."""
    _, _, target = cases["air"]
    ids = _ids(1, 16, seed=4)
    positions = np.arange(16, dtype=np.int32)[None] + 300
    ref = target(ids, aux_layer_ids=AUX, positions=positions).logits
    cfg, cls = target.config, type(target)

    def without(*path):
        params = jax.tree.map(lambda x: x, target.params)
        leaf = params
        for key in path[:-1]:
            leaf = leaf[key]
        leaf[path[-1]] = jnp.zeros_like(leaf[path[-1]])
        return params

    changed = {
        "full-width RoPE": cls(dataclasses.replace(cfg, rope=RopeSpec("default", 10000.0)), {}, target.params),
        "no k bias": cls(cfg, {}, without("layers", "self_attn", "k_proj", "bias")),
        "no correction bias": cls(cfg, {}, without("moe_layers", "router", "e_score_correction_bias")),
    }
    for name, other in changed.items():
        moved = rel_err(other(ids, aux_layer_ids=AUX, positions=positions).logits, ref)
        assert moved > 1e-2, (name, moved)


def test_bf16_load_keeps_the_router_fp32(cases):
    _, path, _ = cases["air"]
    params = load_target(path, dtype="bfloat16").params
    router = params["moe_layers"]["router"]
    assert router["kernel"].dtype == jnp.float32 and router["e_score_correction_bias"].dtype == jnp.float32
    assert params["layers"]["self_attn"]["q_proj"]["bias"].dtype == jnp.bfloat16


def test_mtp_layers_on_disk_are_ignored(cases, tmp_mod):
    """GLM checkpoints carry the MTP module as layer num_hidden_layers (transformers skips it); with
    num_nextn_predict_layers=0 the same tensor is unexpected."""
    from safetensors.numpy import load_file, save_file

    _, path, target = cases["air"]
    folder = tmp_mod / "with_mtp"
    shutil.copytree(path, folder)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = np.zeros((48, 96), np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    assert target.config.num_nextn_predict_layers == 1  # transformers' default, written by save_pretrained
    jax.tree.map(np.testing.assert_array_equal, load_target(str(folder), dtype="float32").params, target.params)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.3\.eh_proj\.weight"):
        load_target(str(folder), dtype="float32")


# =============================================================================================
# Cached decoding == the forward (GQA KV cache for Glm4Moe, the latent cache for the Lite model)
# =============================================================================================
def _close(got, want, what):
    err = rel_err(got, want)
    assert err <= REL_TOL, f"{what}: rel err {err:.2e} > {REL_TOL}"


@pytest.mark.parametrize("variant", ["qk_norm", "lite"])
def test_cached_decoding_equals_forward(cases, variant):
    _, _, target = cases[variant]
    ids = jnp.asarray(_ids(2, 12, seed=6))
    full = target(ids, aux_layer_ids=AUX)
    cache = target.init_cache(2, 40)
    want = ({"kv": (3, 2, 256, 16), "k_rope": (3, 2, 256, 8)} if variant == "lite"
            else {"k": (3, 2, 256, 1, 16), "v": (3, 2, 256, 1, 16)})
    assert jax.tree.map(lambda x: x.shape, cache) == want
    decode = jax.jit(lambda c, i, p, s: target.decode_chunk(target.params, c, i, p, s, aux_layer_ids=AUX))
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    at = lambda s: jnp.full((2,), s, jnp.int32)  # noqa: E731
    # a wrong 6-token chunk at slot 3 first (stale entries), then roll back to 0: prefill 6, one
    # token, a chunk of 5 (three chunk shapes)
    cache = decode(cache, ids[:, ::-1][:, :6], pos[:, 3:9], at(3))[3]
    pieces = []
    for a, b in [(0, 6), (6, 7), (7, 12)]:
        logits, aux, final, cache = decode(cache, ids[:, a:b], pos[:, a:b], at(a))
        pieces.append((logits, aux, final))
    _close(np.concatenate([p[0] for p in pieces], 1), full.logits, "logits")
    _close(np.concatenate([p[2] for p in pieces], 1), full.final_hidden, "final hidden")
    for k in range(len(AUX)):
        _close(np.concatenate([p[1][k] for p in pieces], 1), full.aux_hidden[k], f"aux {AUX[k]}")


# =============================================================================================
# Config tables, defaults and refusals
# =============================================================================================
def _glm_table_config(**kw):
    """Every Glm4Moe table key away from its default (a key dropped on either side changes the result)."""
    return transformers.Glm4MoeConfig(**{**dict(
        vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=6, num_key_value_heads=3, head_dim=10, n_routed_experts=12, num_experts_per_tok=3,
        n_shared_experts=2, n_group=3, topk_group=2, first_k_dense_replace=2, norm_topk_prob=False,
        routed_scaling_factor=1.25, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=2,
        rms_norm_eps=3e-6, tie_word_embeddings=True, max_position_embeddings=777,
        rope_parameters={"rope_type": "default", "rope_theta": 12345.0, "partial_rotary_factor": 0.4}), **kw})


def _lite_table_config(**kw):
    """Every Glm4MoeLite table key away from its default."""
    return transformers.Glm4MoeLiteConfig(**{**dict(
        vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=6, num_key_value_heads=6, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=2, n_group=3,
        topk_group=2, mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"], norm_topk_prob=False,
        routed_scaling_factor=1.25, rope_interleave=False, num_nextn_predict_layers=2, rms_norm_eps=3e-6,
        tie_word_embeddings=True, max_position_embeddings=768,
        rope_parameters={"rope_type": "yarn", "rope_theta": 12345.0, "factor": 3.0, "mscale": 0.9,
                         "mscale_all_dim": 0.7, "original_max_position_embeddings": 256}), **kw})


TABLES = {"glm4_moe": (_glm_table_config, glm.Glm4MoeTargetConfig, glm.HF_KEYS, transformers.Glm4MoeConfig),
          "lite": (_lite_table_config, glm.Glm4MoeLiteTargetConfig, glm.LITE_HF_KEYS, transformers.Glm4MoeLiteConfig)}


@pytest.mark.parametrize("name", list(TABLES))
def test_to_hf_round_trips_through_transformers(name):
    from specjax.targets import hf_keys

    make, cls, table, hf_cls = TABLES[name]
    hf = make().to_dict()
    cfg = cls.from_hf(hf)
    written = cfg.to_hf()
    assert cls.from_hf(written) == cfg
    assert not [row.key for row in table if row.key not in written], "a key of the table is not written"
    for row in table:
        if not callable(row.default) and row.default is not hf_keys.REQUIRED:
            assert getattr(cfg, row.field_name) != row.convert(row.default), f"{row.key} is at its default"
    assert cfg.first_k_dense_replace == 2 and cfg.num_nextn_predict_layers == 2
    through = hf_cls(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")}).to_dict()
    through["architectures"] = written["architectures"]
    assert cls.from_hf(through) == cfg
    # a model_type-only config finds the architecture
    assert registry.get_target_class({"model_type": written["model_type"]}).config_class is cls


def test_defaults_follow_transformers():
    """Absent keys mean what transformers' configs make of them: Glm4Moe RoPE on half of each head
    (a rope-dict value wins over the top-level one), Lite's q_lora_rank 768 and one dense layer."""
    base = {"architectures": [glm.ARCH], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 48,
            "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 8, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "rope_theta": 1e6}
    for extra, want in [({}, 0.5), ({"partial_rotary_factor": 0.25}, 0.25),
                        ({"partial_rotary_factor": 0.25, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                                             "partial_rotary_factor": 1.0}}, 1.0)]:
        hf = {**base, **extra}
        cfg = glm.Glm4MoeTargetConfig.from_hf(hf)
        assert cfg.rope.partial_rotary_factor == want
        assert transformers.Glm4MoeConfig(**{k: v for k, v in hf.items() if k != "architectures"}) \
            .rope_parameters["partial_rotary_factor"] == want
        assert glm.Glm4MoeTargetConfig.from_hf(cfg.to_hf()) == cfg  # full width is written, not left absent
    assert cfg.num_key_value_heads == 8 and cfg.head_dim == 8 and cfg.rms_norm_eps == 1e-5  # Glm4MoeConfig's
    lite = {**base, "architectures": [glm.LITE_ARCH]}
    cfg = glm.Glm4MoeLiteTargetConfig.from_hf(lite)
    assert cfg.q_lora_rank == 768 and cfg.first_k_dense_replace == 1 and cfg.rope.partial_rotary_factor == 1.0
    assert cfg.num_nextn_predict_layers == 0
    assert glm.Glm4MoeLiteTargetConfig.from_hf({**lite, "q_lora_rank": None}).q_lora_rank is None


def test_config_errors():
    hf = {**_glm_table_config().to_dict(), "architectures": [glm.ARCH]}
    fp8 = {"quant_method": "awq", "bits": 4}  # block FP8 and compressed-tensors are read (test_targets_fp8.py)
    bad = {
        "quantization_config": (fp8, r"quant_method='awq' is not read.*dequantize the checkpoint"),
        "hidden_act": ("gelu", r"hidden_act='gelu' is not supported"),
        "scoring_func": ("softmax", r"scoring_func='softmax' is not supported"),
        "topk_method": ("greedy", r"topk_method='greedy' is not supported"),
        "num_key_value_heads": (4, r"num_attention_heads=6 must be a multiple of num_key_value_heads=4"),
        "first_k_dense_replace": (7, r"first_k_dense_replace=7 must be in 0..num_hidden_layers=5"),
        "num_experts_per_tok": (9, r"num_experts_per_tok=9 must be in 1..8"),
        "rope_parameters": ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "partial_rotary_factor": 1.0},
                            r"unsupported rope type 'yarn'"),
    }
    for key, (value, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            glm.Glm4MoeTargetConfig.from_hf({**hf, key: value})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.4 with rope type 'linear' is not supported"):
        glm.Glm4MoeTargetConfig.from_hf({**hf, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e4,
                                                                   "factor": 2.0, "partial_rotary_factor": 0.4}})
    with pytest.raises(ValueError, match=r"rotates 0 dims"):
        glm.Glm4MoeTargetConfig.from_hf({**hf, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                   "partial_rotary_factor": 0.05}})
    with pytest.raises(ValueError, match="neither n_routed_experts nor num_local_experts"):
        glm.Glm4MoeTargetConfig.from_hf({k: v for k, v in hf.items() if k != "n_routed_experts"})

    lite = {**_lite_table_config().to_dict(), "architectures": [glm.LITE_ARCH]}
    bad = {
        "attention_bias": (True, r"attention_bias=true .* is not supported"),
        "num_key_value_heads": (2, r"num_key_value_heads=2 must equal num_attention_heads=6"),
        "head_dim": (8, r"head_dim=8 but qk_rope_head_dim=4"),
        "mlp_layer_types": (["dense", "sparse", "dense", "sparse", "sparse"], "a dense layer after a sparse one"),
        "first_k_dense_replace": (1, r"first_k_dense_replace=1 but mlp_layer_types makes the first 2 layer\(s\) dense"),
        "partial_rotary_factor": (0.5, r"partial_rotary_factor=0.5 is not supported"),
        "quantization_config": (fp8, r"quant_method='awq' is not read"),
    }
    for key, (value, match) in bad.items():
        candidate = {**lite, key: value}
        if key == "partial_rotary_factor":
            candidate["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
        with pytest.raises(ValueError, match=match):
            glm.Glm4MoeLiteTargetConfig.from_hf(candidate)
    with pytest.raises(ValueError, match=r"mlp_layer_types must list 'dense' or 'sparse' for each of the"):
        glm.Glm4MoeLiteTargetConfig.from_hf({**lite, "mlp_layer_types": ["dense", "sparse"]})
    # first_k_dense_replace agreeing with mlp_layer_types is accepted (GLM-4.7-Flash's config.json has both)
    assert glm.Glm4MoeLiteTargetConfig.from_hf({**lite, "first_k_dense_replace": 2}).first_k_dense_replace == 2


# =============================================================================================
# The real shapes (configs/targets/glm4_5_air, configs/targets/glm4_7_flash)
# =============================================================================================
# Published: GLM-4.5-Air "106B total parameters, 12B active"; GLM-4.7-Flash "30B-A3B". The exact
# totals are the sums of the tensor shapes below (e_score_correction_bias included, as transformers
# holds them; the MTP layer on disk is not a parameter of the target). The published active counts
# leave out the embedding and lm_head, which active_params_per_token counts.
def _glm_expected(V=151552, D=4096, L=46, kd=1, N=96, kv=8, hd=128, I=10944, F=1408, E=128, k=8):
    attn = (D * N * hd + N * hd) + 2 * (D * kv * hd + kv * hd) + N * hd * D + 2 * D
    dense, moe = 3 * D * I, E * 3 * D * F + 3 * D * F + E * D + E
    total = L * attn + kd * dense + (L - kd) * moe + 2 * V * D + D
    return total, total - (L - kd) * (E - k) * 3 * D * F, 2 * V * D


def _lite_expected(V=154880, D=2048, L=47, kd=1, N=20, Q=768, R=512, dr=64, dn=192, dv=256, I=10240, F=1536, E=64,
                   k=4):
    attn = D * Q + Q + Q * N * (dn + dr) + D * (R + dr) + R + R * N * (dn + dv) + N * dv * D + 2 * D
    dense, moe = 3 * D * I, E * 3 * D * F + 3 * D * F + E * D + E
    total = L * attn + kd * dense + (L - kd) * moe + 2 * V * D + D
    return total, total - (L - kd) * (E - k) * 3 * D * F, 2 * V * D


REAL = {"glm4_5_air": (glm.Glm4MoeTargetConfig, *_glm_expected(), 106e9, 12e9, transformers.Glm4MoeConfig),
        "glm4_7_flash": (glm.Glm4MoeLiteTargetConfig, *_lite_expected(), 30e9, 3e9, transformers.Glm4MoeLiteConfig)}


@pytest.mark.parametrize("folder", list(REAL))
def test_real_config_counts_the_published_parameters(repo_root, folder):
    from specjax.targets import abstract

    cls, exact, active, embeddings, published, published_active, hf_cls = REAL[folder]
    hf = read_hf_config(os.path.join(repo_root, "configs", "targets", folder))
    target = abstract.make_target(hf)
    cfg = target.config
    assert isinstance(cfg, cls)
    total = sum(math.prod(s.shape) for s in target.weight_specs(cfg))
    print(f"{folder}: {total:,} params ({total / 1e9:.2f} B), {target.active_params_per_token():,} active")
    assert total == exact and target.active_params_per_token() == active
    assert abs(total - published) / published < 0.03
    assert abs(active - embeddings - published_active) / published_active < 0.1
    # transformers reads the same model from the file; the MTP layer after the last one is ignored
    assert cls.from_hf({**hf_cls.from_dict(hf).to_dict(), "architectures": hf["architectures"]}) == cfg
    n = cfg.num_hidden_layers
    assert type(target).ignored_hf_names(cfg, f"model.layers.{n}.eh_proj.weight")
    assert not type(target).ignored_hf_names(cfg, f"model.layers.{n + 1}.eh_proj.weight")
    if folder == "glm4_5_air":
        assert cfg.rope.rotary_dim(cfg.head_dim) == 64 and cfg.attention_bias and not cfg.use_qk_norm
        # the forward and the KV cache at full size, abstractly (nothing allocated)
        params = abstract.abstract_params(type(target), cfg, "bfloat16")
        ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)
        final, aux = jax.eval_shape(lambda p, i: target.forward(p, i, aux_layer_ids=(1, 22, 42)), params, ids)
        assert final.shape == (1, 16, 4096) and final.dtype == jnp.bfloat16 and len(aux) == 3
        cache = jax.eval_shape(lambda: target.decoder.init_cache(cfg, 1, 300, jnp.bfloat16))
        assert cache["k"].shape == (46, 1, 512, 8, 128)
    else:
        assert cfg.q_lora_rank == 768 and cfg.first_k_dense_replace == 1 and cfg.rope.partial_rotary_factor == 1.0


def test_model_types_name_the_architectures():
    for model_type, arch in MODEL_TYPES.items():
        assert registry.MODEL_TYPE_TO_ARCH[model_type] == arch
        assert registry.get_target_class({"model_type": model_type}).__name__.startswith("Glm4Moe")

"""Mistral 4 (``Mistral4ForCausalLM``: Mistral Small 4's text model) vs transformers (PyTorch) on tiny
random checkpoints (CPU, fp32), plus cached decoding, the config table and refusals, the expert
layouts on disk, the quantization formats, and the real-shape config in configs/targets/mistral4_119b.

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state and
three aux states (aux id k = output of layer k, read from forward hooks on transformers' decoder
layers; the final hidden from a hook on its final norm). Two tiny variants, 3 layers, 8 routed experts:
  * "scaled": Llama-4 query scaling on (beta 0.3) with original_max_position_embeddings 16 and
    positions 300..319 (floor(position / 16) goes 18 -> 19 inside the sequence), interleaved RoPE
    pairs, query LoRA, one dense layer, top-2 in 1 of 2 groups, x1.5, one shared expert;
  * "plain": beta 0 (no scaling), RoPE in the half-split convention, a plain q_proj, no dense
    layer, top-3 of one group without renormalisation, two shared experts, YaRN with mscale 0.8 /
    mscale_all_dim 0.6 (softmax scale and cos/sin factor away from 1).
Weights are redrawn larger than transformers' init (``parity._hf_weights.randomize_``), so that the
query scale, the router rule and the RoPE convention each move the outputs far beyond the tolerance
(test_each_detail_matters). transformers 5.25 saves the experts fused (mlp.experts.gate_up_proj);
the same weights written one tensor per expert load to the same params.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.targets import load_target, registry  # noqa: E402
from specjax.targets import mistral4 as m4  # noqa: E402
from specjax.targets.loading import read_hf_config  # noqa: E402

from parity._hf_weights import assert_matches_hf, randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
VOCAB = 128
AUX = (0, 1, 2)
POSITIONS = np.broadcast_to(np.arange(20, dtype=np.int32) + 300, (2, 20)).copy()
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=16, qk_nope_head_dim=12,
              qk_rope_head_dim=8, v_head_dim=10, rms_norm_eps=1e-5)
VARIANTS = {
    "scaled": dict(q_lora_rank=20, first_k_dense_replace=1, n_group=2, topk_group=1, num_experts_per_tok=2,
                   routed_scaling_factor=1.5, rope_interleave=True, max_position_embeddings=64,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3}),
    "plain": dict(q_lora_rank=None, first_k_dense_replace=0, num_experts_per_tok=3, n_shared_experts=2,
                  norm_topk_prob=False, rope_interleave=False, max_position_embeddings=256,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 2.0,
                                   "original_max_position_embeddings": 128, "mscale": 0.8, "mscale_all_dim": 0.6,
                                   "llama_4_scaling_beta": 0.0}),
}


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t)).astype(np.int32)


@pytest.fixture(scope="module")
def tmp_mod(tmp_path_factory):
    return tmp_path_factory.mktemp("mistral4")


def _hf_config(variant):
    return transformers.Mistral4Config(**COMMON, **VARIANTS[variant])


def _make(tmp_mod, variant, seed):
    torch.manual_seed(seed)
    model = transformers.Mistral4ForCausalLM(_hf_config(variant)).eval()
    randomize_(model, seed)
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
    cfg, p = target.config, target.params
    assert isinstance(cfg, m4.Mistral4TargetConfig) and cfg.head_dim == 20 and cfg.rope.rope_type == "yarn"
    k = cfg.first_k_dense_replace
    assert cfg.mlp_layer_ids == tuple(range(k)) and cfg.moe_layer_ids == tuple(range(k, 3))
    assert p["moe_layers"]["experts"]["gate_proj"]["kernel"].shape == (3 - k, 8, 48, 24)
    assert p["moe_layers"]["shared_experts"]["up_proj"]["kernel"].shape == (3 - k, 48, 24 * cfg.n_shared_experts)
    assert set(p["moe_layers"]["router"]) == {"kernel"}  # no correction bias
    assert ("q_proj" in p["layers"]["self_attn"]) == (cfg.q_lora_rank is None)
    # transformers' file holds the experts fused: expert 5 of the last layer, gate and up halves, transposed
    ex = model.model.layers[2].mlp.experts
    w = ex.gate_up_proj[5].detach().numpy()
    np.testing.assert_array_equal(np.asarray(p["moe_layers"]["experts"]["gate_proj"]["kernel"][-1, 5]), w[:24].T)
    np.testing.assert_array_equal(np.asarray(p["moe_layers"]["experts"]["up_proj"]["kernel"][-1, 5]), w[24:].T)
    np.testing.assert_array_equal(np.asarray(p["moe_layers"]["experts"]["down_proj"]["kernel"][-1, 5]),
                                  ex.down_proj[5].detach().numpy().T)
    assert_matches_hf(target, model, _ids(2, 20, seed=3), POSITIONS, AUX, REL_TOL, variant)


def test_each_detail_matters(cases, monkeypatch):
    """The parity above is not vacuous: the query scale, the RoPE pair convention and the softmax
    router (vs DeepSeek-V3's sigmoid one) each move the final hidden state by far more than the
    tolerance (the pure forward, so the router swapped in below is traced afresh)."""
    from specjax.targets.layers.routers import router_logits, sigmoid_topk

    _, _, target = cases["scaled"]
    ids, pos = _ids(1, 20, seed=4), POSITIONS[:1]
    cfg, cls = target.config, type(target)

    def final(config):  # a fresh function: traced again, with the route of the moment
        return jax.jit(lambda p: cls.decoder.forward(p, config, ids, positions=pos)[0])(
            target.params)

    ref = final(cfg)
    moved = {"no query scale": rel_err(final(dataclasses.replace(cfg, llama_4_scaling_beta=0.0)), ref),
             "half-split RoPE": rel_err(final(dataclasses.replace(cfg, rope_interleave=False)), ref)}
    monkeypatch.setattr(m4, "route", lambda mp, c, x: sigmoid_topk(
        router_logits(x, mp["router"]["kernel"]), c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
        renormalize=c.norm_topk_prob, scaling_factor=c.routed_scaling_factor))
    moved["sigmoid router"] = rel_err(final(cfg), ref)
    print({name: f"{err:.2f}" for name, err in moved.items()})
    for name, err in moved.items():
        assert err > 1e-2, (name, err)


def test_query_scale_is_llama4s():
    cfg = dataclasses.replace(m4.Mistral4TargetConfig.from_hf(_table_config()), llama_4_scaling_beta=0.1)
    orig = cfg.rope.original_max_position_embeddings
    pos = np.array([[0, orig - 1, orig, 3 * orig + 5, -4]])
    want = 1 + 0.1 * np.log(1 + np.floor(np.maximum(pos, 0) / orig))
    np.testing.assert_allclose(np.asarray(m4.llama4_query_scale(cfg, pos)), want, rtol=1e-6)
    assert m4.llama4_query_scale(dataclasses.replace(cfg, llama_4_scaling_beta=0.0), pos) is None


def test_per_expert_checkpoint_loads_the_same(cases, tmp_mod):
    """One tensor per expert (DeepSeek's layout) instead of transformers' fused tensors: the same params."""
    from safetensors.numpy import load_file, save_file

    _, path, target = cases["scaled"]
    folder = tmp_mod / "per_expert"
    shutil.copytree(path, folder)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:
        prefix = name[:-len("gate_up_proj")]
        gate_up, down = tensors.pop(name), tensors.pop(prefix + "down_proj")
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}{e}.gate_proj.weight"] = np.ascontiguousarray(gate_up[e, :24])
            tensors[f"{prefix}{e}.up_proj.weight"] = np.ascontiguousarray(gate_up[e, 24:])
            tensors[f"{prefix}{e}.down_proj.weight"] = np.ascontiguousarray(down[e])
    save_file(tensors, str(folder / "model.safetensors"))
    jax.tree.map(np.testing.assert_array_equal, load_target(str(folder), dtype="float32").params, target.params)


# =============================================================================================
# Cached decoding == the forward (DeepSeek-V3's latent cache, queries scaled by position)
# =============================================================================================
def _close(got, want, what):
    err = rel_err(got, want)
    assert err <= REL_TOL, f"{what}: rel err {err:.2e} > {REL_TOL}"


def test_cached_decoding_equals_forward(cases):
    _, _, target = cases["scaled"]
    ids = jnp.asarray(_ids(2, 12, seed=6))
    pos = jnp.asarray(POSITIONS[:, :12])
    full = target(ids, aux_layer_ids=AUX, positions=pos)
    cache = target.init_cache(2, 40)
    assert jax.tree.map(lambda x: x.shape, cache) == {"kv": (3, 2, 256, 16), "k_rope": (3, 2, 256, 8)}
    decode = jax.jit(lambda c, i, p, s: target.decode_chunk(target.params, c, i, p, s, aux_layer_ids=AUX))
    at = lambda s: jnp.full((2,), s, jnp.int32)  # noqa: E731
    # a wrong chunk at slot 3 first (stale entries), then roll back to 0: prefill 6, one token, a chunk of 5
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
# Config table, defaults and refusals
# =============================================================================================
def _table_config(**kw):
    """Every table key away from Mistral4Config's default (a key dropped on either side changes the result)."""
    return transformers.Mistral4Config(**{**dict(
        vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=6, num_key_value_heads=6, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=2, n_group=3,
        topk_group=2, first_k_dense_replace=2, norm_topk_prob=False, routed_scaling_factor=1.25, rope_interleave=False,
        rms_norm_eps=3e-6, tie_word_embeddings=True, max_position_embeddings=768,
        rope_parameters={"rope_type": "yarn", "rope_theta": 12345.0, "factor": 3.0, "mscale": 0.9,
                         "mscale_all_dim": 0.7, "original_max_position_embeddings": 256, "beta_fast": 16.0,
                         "beta_slow": 2.0, "llama_4_scaling_beta": 0.25}), **kw}).to_dict()


def test_to_hf_round_trips_through_transformers():
    from specjax.targets import hf_keys

    hf = _table_config()
    cfg = m4.Mistral4TargetConfig.from_hf(hf)
    written = cfg.to_hf()
    assert m4.Mistral4TargetConfig.from_hf(written) == cfg
    assert not [row.key for row in m4.HF_KEYS if row.key not in written], "a key of the table is not written"
    for row in m4.HF_KEYS:
        default = row.default({}) if callable(row.default) else row.default
        assert default is not hf_keys.REQUIRED and getattr(cfg, row.field_name) != default, f"{row.key} at default"
    assert cfg.llama_4_scaling_beta == 0.25 and cfg.rope.original_max_position_embeddings == 256
    assert cfg.rope.beta_fast == 16.0 and cfg.rope.mscale_all_dim == 0.7 and cfg.head_dim == 10
    through = transformers.Mistral4Config(**{k: v for k, v in written.items()
                                             if k not in ("architectures", "model_type")}).to_dict()
    assert m4.Mistral4TargetConfig.from_hf({**through, "architectures": [m4.ARCH]}) == cfg
    assert registry.get_target_class({"model_type": "mistral4"}) is m4.Mistral4Target
    assert registry.MODEL_TYPE_TO_ARCH["mistral4"] == m4.ARCH


def test_defaults_follow_transformers():
    """Absent keys mean what Mistral4Config makes of them: Mistral Small 4's sizes, router and RoPE
    (YaRN x128 over 8192 positions, llama_4_scaling_beta 0.1); a null q_lora_rank is a plain q_proj;
    a rope dict without original_max_position_embeddings falls back on max_position_embeddings."""
    cfg = m4.Mistral4TargetConfig.from_hf({"architectures": [m4.ARCH]})
    hf = transformers.Mistral4Config().to_dict()
    assert m4.Mistral4TargetConfig.from_hf({**hf, "architectures": [m4.ARCH]}) == cfg
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.n_routed_experts, cfg.num_experts_per_tok) == (1024, 256, 128, 4)
    assert (cfg.n_group, cfg.first_k_dense_replace, cfg.routed_scaling_factor, cfg.head_dim) == (1, 0, 1.0, 128)
    assert cfg.rope == m4.DEFAULT_ROPE and cfg.llama_4_scaling_beta == 0.1
    assert cfg.mla.softmax_scale == pytest.approx(128**-0.5 * (0.1 * math.log(128.0) + 1) ** 2)
    assert m4.Mistral4TargetConfig.from_hf({"architectures": [m4.ARCH], "q_lora_rank": None}).q_lora_rank is None
    assert m4.Mistral4TargetConfig.from_hf({"model_type": "mistral4", "num_local_experts": 16}).n_routed_experts == 16
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "llama_4_scaling_beta": 0.1}
    short = {"architectures": [m4.ARCH], "max_position_embeddings": 512, "rope_parameters": rope}
    assert m4.Mistral4TargetConfig.from_hf(short).rope.original_max_position_embeddings == 512
    assert transformers.Mistral4Config(max_position_embeddings=512, rope_parameters=dict(rope)) \
        .rope_parameters["original_max_position_embeddings"] == 512


def test_config_errors():
    hf = {**_table_config(), "architectures": [m4.ARCH]}
    rope = hf["rope_parameters"]
    bad = {
        "hidden_act": ("gelu", r"hidden_act='gelu' is not supported"),
        "attention_bias": (True, r"attention_bias=true is not supported"),
        "scoring_func": ("sigmoid", r"scoring_func='sigmoid' is not supported.*softmax"),
        "moe_layer_freq": (2, r"moe_layer_freq=2 is not supported"),
        "num_key_value_heads": (2, r"num_key_value_heads=2 must equal num_attention_heads=6"),
        "n_group": (None, r"n_group=null: transformers' Mistral4 cannot run with null"),
        "first_k_dense_replace": (7, r"first_k_dense_replace=7 must be in 0..num_hidden_layers=5"),
        "num_experts_per_tok": (9, r"num_experts_per_tok=9 must be in 1..8"),
        "head_dim": (12, r"head_dim=12 but qk_nope_head_dim \+ qk_rope_head_dim = 10"),
        "original_max_position_embeddings": (512, r"original_max_position_embeddings=512 at the top level but 256"),
        "quantization_config": ({"quant_method": "awq", "bits": 4}, r"quant_method='awq' is not read"),
        "rope_parameters": ({"rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.1},
                            r"rope_type='default' is not supported.*only YaRN"),
    }
    for key, (value, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            m4.Mistral4TargetConfig.from_hf({**hf, key: value})
    rope_bad = {
        "llama_4_scaling_beta": (None, r"llama_4_scaling_beta=None.*needs a number"),
        "partial_rotary_factor": (1.0, r"partial_rotary_factor=1.0 rotates int\(10 \* 1.0\) = 10 dims, but "
                                       r"qk_rope_head_dim=4"),
        "factor": (None, r"rope_parameters.factor: null is not a number"),
    }
    for key, (value, match) in rope_bad.items():
        with pytest.raises(ValueError, match=match):
            m4.Mistral4TargetConfig.from_hf({**hf, "rope_parameters": {**rope, key: value}})
    # transformers cannot run the refused RoPE: its default type rotates head_dim dims against qk_rope-wide queries
    with pytest.raises(RuntimeError, match="must match"):
        c = _hf_config("plain")
        c.rope_parameters = {"rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.1}
        transformers.Mistral4ForCausalLM(c)(torch.zeros(1, 3, dtype=torch.long))


# =============================================================================================
# Quantized checkpoints: the published per-tensor FP8 is refused; block FP8 with one tensor per
# expert loads (targets/quantized.py), fused experts in FP8 are refused
# =============================================================================================
PUBLISHED_QUANT = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None,
                   "modules_to_not_convert": ["model.vision_tower", "model.multi_modal_projector", "lm_head"]}


def test_quantization_formats(cases, tmp_mod):
    hf = {**_table_config(), "architectures": [m4.ARCH]}
    with pytest.raises(ValueError, match=r"no weight_block_size: per-tensor FP8 checkpoints are not read"):
        m4.Mistral4TargetConfig.from_hf({**hf, "quantization_config": PUBLISHED_QUANT})
    block = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 16]}
    cfg = m4.Mistral4TargetConfig.from_hf({**hf, "quantization_config": block})
    specs = {s.hf_name: s for s in m4.weight_specs(cfg)}
    assert specs["model.layers.{i}.mlp.experts.{e}.gate_proj.weight"].dtype == "float8_e4m3fn"
    # kv_b_proj [in 12, out 6 * (6 + 10)]: scales [L, ceil(12 / 16), ceil(96 / 8)]
    assert specs["model.layers.{i}.self_attn.kv_b_proj.weight_scale_inv"].shape == (5, 1, 12)
    assert specs["model.layers.{i}.mlp.gate.weight"].dtype == "float32"  # the router stays as stored
    with pytest.raises(ValueError, match=r"block-scaled FP8 weights with fused experts .* are not read"):
        m4.Mistral4Target.checkpoint_weight_specs(cfg, ["model.layers.2.mlp.experts.gate_up_proj"])


# =============================================================================================
# The real shape (configs/targets/mistral4_119b)
# =============================================================================================
# Published: "119B parameters, with 6.5B activated per token" (Hugging Face lists 119.4 B for the
# multimodal checkpoint: these text weights plus the Pixtral vision tower and projector). The exact
# totals are the sums of the tensor shapes below.
def _expected(V=131072, D=4096, L=36, N=32, Q=1024, R=256, dr=64, dn=64, dv=128, F=2048, E=128, k=4):
    attn = D * Q + Q + Q * N * (dn + dr) + D * (R + dr) + R + R * N * (dn + dv) + N * dv * D + 2 * D
    moe = E * 3 * D * F + 3 * D * F + E * D
    total = L * attn + L * moe + 2 * V * D + D
    return total, total - L * (E - k) * 3 * D * F


def test_real_config_counts_the_published_parameters(repo_root):
    from specjax.targets import abstract

    hf = read_hf_config(os.path.join(repo_root, "configs", "targets", "mistral4_119b"))
    target = abstract.make_target(hf)
    cfg = target.config
    total = sum(math.prod(s.shape) for s in target.weight_specs(cfg))
    active = target.active_params_per_token()
    print(f"mistral4_119b: {total:,} params ({total / 1e9:.2f} B), {active:,} active")
    assert (total, active) == _expected()
    assert abs(total - 119e9) / 119e9 < 0.01 and abs(active - 6.5e9) / 6.5e9 < 0.1
    assert cfg == m4.Mistral4TargetConfig.from_hf({"architectures": [m4.ARCH]})  # Mistral4Config's defaults
    assert m4.Mistral4TargetConfig.from_hf({**transformers.Mistral4Config.from_dict(hf).to_dict(),
                                            "architectures": [m4.ARCH]}) == cfg
    # the forward and the latent cache at full size, abstractly (nothing allocated)
    params = abstract.abstract_params(type(target), cfg, "bfloat16")
    ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    final, aux = jax.eval_shape(lambda p, i: target.forward(p, i, aux_layer_ids=(1, 17, 33)), params, ids)
    assert final.shape == (1, 16, 4096) and final.dtype == jnp.bfloat16 and len(aux) == 3
    cache = jax.eval_shape(lambda: target.decoder.init_cache(cfg, 1, 300, jnp.bfloat16))
    assert cache["kv"].shape == (36, 1, 512, 256) and cache["k_rope"].shape == (36, 1, 512, 64)

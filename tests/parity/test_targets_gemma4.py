"""Gemma 4 (``Gemma4ForCausalLM``, the text model) vs transformers (PyTorch) on tiny random checkpoints
(CPU, fp32), plus its cached decoding, config reading and refusals, and the real-shape configs in
configs/targets/gemma4_*.

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state and
three aux states (``parity._hf_weights.assert_matches_hf``: aux id k = output of layer k from forward
hooks on transformers' decoder layers). Two tiny variants:
  * "shared_ple" (6 layers S S F S S F, saved in the published config.json layout: global_head_dim /
    num_global_key_value_heads, and the shared layers' unused k/v tensors on disk): full layers with
    their own head shape (1 KV head of 32 vs 2 of 16), k = v, transformers' default RoPE pair
    (proportional on a quarter of the full layers' frequencies), shared KV (layers 3-5 reuse layer 1's
    and 2's K/V) with double-wide MLPs, per-layer inputs, final-logit soft-capping, tied embeddings;
  * "plain_moe" (4 layers S F S F, transformers' saved per_layer_config layout): no per-layer inputs,
    no sharing, separate v_proj, full layers of 2 KV heads of 24, a proportional RoPE on half the
    frequencies with a factor, an lm_head, no soft-capping; the 26B-A4B MoE block (top-2 of 6 routed
    experts with per-expert scales beside each layer's MLP).
Both: sliding window 5 (shorter than the sequences), GQA, GeGLU, sqrt(D) embeddings, q/k/v norms.
Weights are redrawn larger than transformers' init (``randomize_``) and the layer scalars (buffers)
drawn 1 + 0.3 N(0, 1), so a missed scalar, soft-cap or RoPE width moves the outputs beyond the
tolerance (test_each_detail_matters).

Cached decoding equals the forward to 1e-5 relative for both cache layouts (sliding and full heads in
one stacked cache: one type stored as it is, or both reshaped and padded) and for the shared layers'
reads of their producer's row; the decoding contract on the family entry is
parity/test_decoding_families.py's.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.layers.rope import RopeSpec  # noqa: E402
from specjax.targets import abstract, hf_keys, load_target  # noqa: E402
from specjax.targets import gemma4 as g4  # noqa: E402  (importing it registers Gemma4ForCausalLM)
from specjax.targets.loading import read_hf_config  # noqa: E402

from parity._hf_weights import assert_matches_hf, randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
DECODE_TOL = 1e-5
VOCAB = 128
S, F = g4.SLIDING, g4.FULL
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_attention_heads=4, head_dim=16,
              num_key_value_heads=2, max_position_embeddings=512, sliding_window=5, pad_token_id=0)
VARIANTS = {
    "shared_ple": dict(num_hidden_layers=6, layer_types=[S, S, F, S, S, F], global_head_dim=32,
                       num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=3,
                       use_double_wide_mlp=True, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
                       final_logit_softcapping=8.0),
    "plain_moe": dict(num_hidden_layers=4, layer_types=[S, F, S, F], global_head_dim=24, hidden_size_per_layer_input=0,
                  tie_word_embeddings=False, rms_norm_eps=3e-6, enable_moe_block=True, num_experts=6, top_k_experts=2,
                  moe_intermediate_size=24,
                  rope_parameters={S: {"rope_type": "default", "rope_theta": 500.0},
                                   F: {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                       "rope_theta": 20000.0, "factor": 2.0}}),
}
AUX = {"shared_ple": (0, 3, 5), "plain_moe": (0, 1, 3)}  # the last one is the pre-norm state


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t)).astype(np.int32)


def _to_published_layout(path):
    """Rewrite a save_pretrained folder as the Hub's config.json spells the full layers' shape
    (global_head_dim / num_global_key_value_heads, no per_layer_config), with the shared layers' K/V
    tensors a checkpoint may still carry (read by nothing)."""
    from safetensors.numpy import load_file, save_file

    cfg_path = os.path.join(path, "config.json")
    hf = json.loads(open(cfg_path).read())
    assert hf.pop("per_layer_config") == {"2": {"head_dim": 32, "num_key_value_heads": 1},
                                          "5": {"head_dim": 32, "num_key_value_heads": 1}}
    hf.update(global_head_dim=32, num_global_key_value_heads=1)
    open(cfg_path, "w").write(json.dumps(hf))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.4.self_attn.k_proj.weight"] = np.zeros((32, 64), np.float32)
    tensors["model.layers.5.self_attn.k_norm.weight"] = np.zeros((32,), np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))


def _make(tmp_path_factory, variant, seed):
    torch.manual_seed(seed)
    model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**COMMON, **VARIANTS[variant])).eval()
    model.config._attn_implementation = "eager"
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # buffers, which randomize_ leaves at one
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.copy_(1.0 + 0.3 * torch.randn(buf.shape, generator=g))
    path = str(tmp_path_factory.mktemp(f"gemma4_{variant}"))
    model.save_pretrained(path)
    if variant == "shared_ple":
        _to_published_layout(path)
    return model, path, load_target(path, dtype="float32")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return {v: _make(tmp_path_factory, v, seed) for v, seed in (("shared_ple", 1), ("plain_moe", 2))}


# =============================================================================================
# Parity with transformers
# =============================================================================================
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity(cases, variant):
    model, _, target = cases[variant]
    cfg = target.config
    assert target.arch == "Gemma4ForCausalLM" and isinstance(cfg, g4.Gemma4TargetConfig)
    layers = target.params["layers"]
    if variant == "shared_ple":
        assert cfg.groups == ("sliding", "full", "sliding_shared", "full_shared")
        assert (cfg.global_head_dim, cfg.num_global_key_value_heads, cfg.first_shared_layer) == (32, 1, 3)
        assert (cfg.producer(S), cfg.producer(F)) == (1, 2)
        assert "v_proj" not in layers["full"]["self_attn"] and "k_proj" not in layers["full_shared"]["self_attn"]
        assert layers["sliding_shared"]["mlp"]["up_proj"]["kernel"].shape == (2, 64, 96)  # double wide
        assert layers["full"]["self_attn"]["q_proj"]["kernel"].shape == (1, 64, 4 * 32)
        assert isinstance(cfg.rope_global, g4.ProportionalRope) and cfg.rope_global.partial_rotary_factor == 0.25
        # layer 4's scalar is transformers' (the second sliding shared layer)
        np.testing.assert_array_equal(np.asarray(layers["sliding_shared"]["layer_scalar"]["scale"][1]),
                                      model.model.layers[4].layer_scalar.numpy())
    else:
        assert "lm_head" in target.params and "embed_tokens_per_layer" not in target.params
        assert (cfg.global_head_dim, cfg.num_global_key_value_heads) == (24, 2)
        assert cfg.rope_global == g4.ProportionalRope(20000.0, 0.5, 2.0) and cfg.rope_local.theta == 500.0
        experts = target.params["moe"]["experts"]
        assert experts["gate_up_proj"]["kernel"].shape == (4, 6, 64, 48)  # [L, E, D, 2F]: gate columns first
        np.testing.assert_array_equal(np.asarray(experts["gate_up_proj"]["kernel"][3, 5]),
                                      model.model.layers[3].experts.gate_up_proj[5].detach().numpy().T)
        assert target.params["moe"]["router"]["kernel"].dtype == jnp.float32
    ids = _ids(2, 13, seed=3)
    positions = np.broadcast_to(np.arange(13, dtype=np.int32) + 40, (2, 13)).copy()
    assert_matches_hf(target, model, ids, positions, AUX[variant], REL_TOL, variant)


def test_each_detail_matters(cases):
    """The parity is not vacuous: the soft-cap, the proportional RoPE (against full-width RoPE with
    the same theta), the layer scalars and the per-layer inputs each move the logits far beyond it."""
    _, _, target = cases["shared_ple"]
    ids = _ids(1, 12, seed=5)
    ref = np.asarray(target(ids).logits)
    cfg, cls = target.config, type(target)
    ones = jax.tree.map(lambda x: x, target.params)
    for group in ones["layers"].values():
        group["layer_scalar"]["scale"] = jnp.ones_like(group["layer_scalar"]["scale"])
    no_ple = jax.tree.map(lambda x: x, target.params)
    no_ple["embed_tokens_per_layer"]["embedding"] = jnp.zeros_like(no_ple["embed_tokens_per_layer"]["embedding"])
    changed = {
        "no soft-cap": cls(dataclasses.replace(cfg, final_logit_softcapping=None), {}, target.params),
        "full-width RoPE": cls(dataclasses.replace(cfg, rope_global=RopeSpec("default", cfg.rope_global.theta)), {},
                               target.params),
        "layer scalars 1": cls(cfg, {}, ones),
        "no per-layer token table": cls(cfg, {}, no_ple),
    }
    for name, other in changed.items():
        moved = rel_err(other(ids).logits, ref)
        assert moved > 1e-2, (name, moved)


# =============================================================================================
# Cached decoding == the forward
# =============================================================================================
@pytest.mark.parametrize("variant,layout", [("shared_ple", (2, 16)), ("plain_moe", (6, 8))])
def test_cached_decoding_equals_forward(cases, variant, layout):
    """shared_ple: sliding K/V (2 x 16) stored as they are, the full layers' (1 x 32) reshaped, the shared
    layers reading rows 1 and 2; plain: both reshaped into rows of 8, the sliding ones padded (32 of 48)."""
    _, _, target = cases[variant]
    aux = AUX[variant]
    ids = jnp.asarray(_ids(2, 12, seed=6))
    full = target(ids, aux_layer_ids=aux)
    cache = target.init_cache(2, 40)
    rows = target.config.num_attention_layers
    assert g4.cache_layout(target.config) == layout
    assert jax.tree.map(lambda x: x.shape, cache) == {"k": (rows, 2, 256) + layout, "v": (rows, 2, 256) + layout,
                                                      "pos": (1, 2, 256)}
    decode = jax.jit(lambda c, i, p, s: target.decode_chunk(target.params, c, i, p, s, aux_layer_ids=aux))
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    at = lambda s: jnp.full((2,), s, jnp.int32)  # noqa: E731
    pieces = []
    for a, b in [(0, 9), (9, 10), (10, 11), (11, 12)]:  # a prefill past the window, then single tokens
        logits, got_aux, final, cache = decode(cache, ids[:, a:b], pos[:, a:b], at(a))
        pieces.append((logits, got_aux, final))
    errs = {"logits": rel_err(np.concatenate([p[0] for p in pieces], 1), full.logits),
            "final": rel_err(np.concatenate([p[2] for p in pieces], 1), full.final_hidden)}
    errs.update({f"aux{aux[k]}": rel_err(np.concatenate([p[1][k] for p in pieces], 1), full.aux_hidden[k])
                 for k in range(len(aux))})
    print(f"\ngemma4 {variant} cached vs forward: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert max(errs.values()) <= DECODE_TOL, errs
    if variant == "shared_ple":  # the shared layers read their producers' rows: a corrupt row 1 moves layer 3
        bad = dict(cache, k=cache["k"].at[1].set(jnp.where((jnp.arange(256) < 9)[None, :, None, None], 1.0,
                                                           cache["k"][1])))
        shared_only = decode(bad, ids[:, 9:10], pos[:, 9:10], at(9))[1][1]  # aux 3: the first shared layer
        assert rel_err(shared_only, pieces[1][1][1]) > 1e-3


# =============================================================================================
# Config reading, the layer schedule and refusals
# =============================================================================================
def test_config_round_trips_through_transformers(cases):
    """to_hf -> from_hf and to_hf -> transformers -> from_hf give the same config, for both layouts;
    the published layout reads as transformers' saved one."""
    for variant in VARIANTS:
        model, _, target = cases[variant]
        cfg = target.config
        assert g4.Gemma4TargetConfig.from_hf(cfg.to_hf()) == cfg
        through = transformers.Gemma4TextConfig(**{k: v for k, v in cfg.to_hf().items()
                                                   if k not in ("architectures", "model_type")}).to_dict()
        assert g4.Gemma4TargetConfig.from_hf({**through, "architectures": ["Gemma4ForCausalLM"]}) == cfg
        saved = {**model.config.to_dict(), "architectures": ["Gemma4ForCausalLM"]}  # per_layer_config
        assert g4.Gemma4TargetConfig.from_hf(saved) == cfg
    # every key of the table is written, and away from its default in one variant at least (a key dropped
    # on either side would change a result above)
    cfgs = [cases[v][2].config for v in VARIANTS]
    assert not [row.key for row in g4.HF_KEYS if row.key not in cfgs[0].to_hf()]
    for row in g4.HF_KEYS:
        if not callable(row.default) and row.default is not hf_keys.REQUIRED:
            assert any(getattr(c, row.field_name) != row.default for c in cfgs), f"{row.key} is at its default"
    # the last layer is full whatever layer_types says (transformers forces it too)
    hf = {**cases["plain_moe"][2].config.to_hf(), "layer_types": [S, F, S, S], "per_layer_config": {}}
    assert g4.Gemma4TargetConfig.from_hf(hf).layer_types == (S, F, S, F)


def test_periodic_runs():
    """The stack runs as scans over its repeating pattern: E2B's own layers (4 sliding + 1 full) x 3,
    a span starting mid-period, a span with no repeat."""
    sig = [(t, i >= 15) for i, t in enumerate(([S] * 4 + [F]) * 7)]
    assert g4.periodic_runs(sig, 0, 15) == [(0, 5, 3)]
    assert g4.periodic_runs(sig, 2, 15) == [(2, 5, 2), (12, 3, 1)]
    assert g4.periodic_runs(sig, 15, 35) == [(15, 5, 4)]
    assert g4.periodic_runs([(S, False), (F, False), (F, False)], 0, 3) == [(0, 3, 1)]


def _hf(**changes):
    base = {"architectures": ["Gemma4ForCausalLM"], **COMMON, **VARIANTS["shared_ple"]}
    return {**base, **changes}


@pytest.mark.parametrize("changes,match", [
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"enable_moe_block": True, "num_experts": 8, "top_k_experts": 9, "moe_intermediate_size": 16},
     "enable_moe_block=True needs .* top_k_experts in 1..num_experts"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config=.*dequantize"),
    ({"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'.*causal"),
    ({"per_layer_config": {"2": {"intermediate_size": 64}}}, r"per_layer_config\['2'\].*not supported"),
    ({"per_layer_config": {"0": {"head_dim": 32}}}, r"per_layer_config\['0'\].*full-attention layers"),
    ({"per_layer_config": {"2": {"head_dim": 32}}}, "per_layer_config.*different head shapes"),
    ({"per_layer_config": {"2": {"head_dim": 8}, "5": {"head_dim": 8}}}, "keep one of the two"),
    ({"rope_parameters": {S: {"rope_type": "yarn", "factor": 4.0}, F: {"rope_type": "default"}}},
     r"rope_parameters\['sliding_attention'\].*unsupported rope type 'yarn'"),
    ({"rope_parameters": {F: {"rope_type": "default"}}}, "rope_parameters must map each layer type"),
    ({"num_kv_shared_layers": 6}, r"num_kv_shared_layers=6 must be in \[0, num_hidden_layers=6\)"),
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers=4: .* every type needs a layer that computes its K/V"),
    ({"vocab_size_per_layer_input": 64}, "vocab_size_per_layer_input=64 < vocab_size=128"),
    ({"global_head_dim": -4}, r"global_head_dim=-4 must be an integer in \[1, 8192\]"),
    ({"num_global_key_value_heads": 3}, "num_attention_heads=4 must be a multiple of the full_attention"),
])
def test_refused_config_keys(changes, match):
    with pytest.raises(ValueError, match=match):
        g4.Gemma4TargetConfig.from_hf(_hf(**changes))


def test_accepted_spellings():
    """Keys transformers reads as "off": a null per-layer size, use_bidirectional_attention="vision" (it
    changes only image tokens of the multimodal model); without rope_parameters transformers' pair."""
    cfg = g4.Gemma4TargetConfig.from_hf(_hf(hidden_size_per_layer_input=None, use_bidirectional_attention="vision",
                                            rope_parameters=None))
    assert cfg.hidden_size_per_layer_input == 0
    assert cfg.rope_local == RopeSpec("default", 10000.0) and cfg.rope_global == g4.ProportionalRope(1e6, 0.25)
    # absent (not null) per-layer size: transformers' default 256
    absent = {k: v for k, v in _hf().items() if k != "hidden_size_per_layer_input"}
    assert g4.Gemma4TargetConfig.from_hf(absent).hidden_size_per_layer_input == 256
    # without attention_k_eq_v the full layers keep num_key_value_heads (transformers ignores the global count)
    assert g4.Gemma4TargetConfig.from_hf(_hf(attention_k_eq_v=False)).num_global_key_value_heads == 2


# =============================================================================================
# The real shapes (configs/targets/gemma4_*)
# =============================================================================================
# name -> (count, count without the per-layer token table): the sums of the tensor shapes
REAL = {"gemma4_e2b": (4_628_569_379, 2_279_759_139), "gemma4_e4b": (7_463_013_418, 4_644_441_130),
        "gemma4_31b": (30_697_345_340, 30_697_345_340), "gemma4_26b_a4b": (25_233_141_790, 25_233_141_790)}


def _count(hf) -> int:
    """The parameter count of a Gemma 4 text config, from transformers' module shapes (written out here,
    independently of the weight table)."""
    D, L, N, V = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["vocab_size"]
    P, shared = hf["hidden_size_per_layer_input"], L - hf["num_kv_shared_layers"]
    total = V * D + D + (hf["vocab_size_per_layer_input"] * L * P + D * L * P + P if P else 0)
    for i, kind in enumerate(hf["layer_types"]):
        full = kind == F
        hd = hf["global_head_dim"] if full else hf["head_dim"]
        kv = (hf["num_global_key_value_heads"] if full and hf["attention_k_eq_v"] else hf["num_key_value_heads"]) * hd
        ff = hf["intermediate_size"] * (2 if hf["use_double_wide_mlp"] and i >= shared else 1)
        total += 4 * D + 1 + 2 * D * N * hd + hd + 3 * D * ff + (2 * D * P + D if P else 0)
        if i < shared:  # k_proj, k_norm and (unless k = v) v_proj
            total += D * kv + hd + (0 if full and hf["attention_k_eq_v"] else D * kv)
        if hf["enable_moe_block"]:  # router (proj, scale, per-expert scale), experts, three norms
            E, Fm = hf["num_experts"], hf["moe_intermediate_size"]
            total += D * E + D + E + E * 3 * D * Fm + 3 * D
    return total


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_config_counts(repo_root, name):
    """The weight table's counts. Published (Gemma 4 model card): 31B "30.7B"; 26B A4B "25.2B" total,
    "3.8B" active (with the embedding); E2B "2.3B effective
    (5.1B with embeddings)", E4B "4.5B effective (8B with embeddings)", where "with embeddings" also holds
    the vision (~150M) and audio (~300M) encoders this text target leaves out. 31B and E2B match to the
    published rounding (E2B's effective count = without the per-layer token table); E4B's 4.64 B without
    that table does not round to the published 4.5B. 31B's and 26B-A4B's "with embeddings" counts would
    hold their ~550M vision encoder too; the text decoder's counts match the published figures."""
    hf = read_hf_config(os.path.join(repo_root, "configs", "targets", name))
    target = abstract.make_target(hf)
    cfg = target.config
    specs = target.weight_specs(cfg)
    total = sum(s.num_params for s in specs)
    without_ple = total - sum(s.num_params for s in specs if s.path[0] == "embed_tokens_per_layer")
    print(f"{name}: {total:,} params ({total / 1e9:.3f} B), {without_ple / 1e9:.3f} B without the per-layer table")
    assert (total, without_ple) == REAL[name] and total == _count(hf)
    if name == "gemma4_31b":
        assert round(total / 1e9, 1) == 30.7 and cfg.attention_k_eq_v and cfg.num_global_key_value_heads == 4
    if name == "gemma4_26b_a4b":
        assert round(total / 1e9, 1) == 25.2 and round(target.active_params_per_token() / 1e9, 1) == 3.8
    else:
        assert target.active_params_per_token() is None
    if name == "gemma4_e2b":
        assert round(without_ple / 1e9, 1) == 2.3 and cfg.num_attention_layers == 15
        assert cfg.producer(S) == 13 and cfg.producer(F) == 14 and cfg.intermediate(20) == 2 * 6144
    # transformers reads the same model from the file
    through = transformers.Gemma4TextConfig.from_dict(hf).to_dict()
    assert g4.Gemma4TargetConfig.from_hf({**through, "architectures": hf["architectures"]}) == cfg


def test_real_shape_forward_and_cache_abstractly(repo_root):
    """E2B at full size, abstractly (nothing allocated): the forward's shapes and the KV cache (15 rows
    of [2, 256]: the sliding layers' 1 x 256 padded to the full layers' 1 x 512)."""
    hf = read_hf_config(os.path.join(repo_root, "configs", "targets", "gemma4_e2b"))
    target = abstract.make_target(hf)
    cfg = target.config
    params = abstract.abstract_params(type(target), cfg, "bfloat16")
    ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    final, aux = jax.eval_shape(lambda p, i: target.forward(p, i, aux_layer_ids=(1, 16, 31)), params, ids)
    assert final.shape == (1, 16, 1536) and final.dtype == jnp.bfloat16 and len(aux) == 3
    cache = jax.eval_shape(lambda: target.decoder.init_cache(cfg, 1, 300, jnp.bfloat16))
    assert cache["k"].shape == (15, 1, 512, 2, 256) and math.prod(cache["pos"].shape) == 512

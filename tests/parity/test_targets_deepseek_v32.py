"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5 (``GlmMoeDsaForCausalLM``): DeepSeek-V3 with
the lightning indexer's top-k sparse attention, vs transformers (PyTorch) on tiny random checkpoints
(CPU, fp32), plus the top-k rule against a NumPy reference, cached decoding, the config tables,
refusals and the real-shape config in configs/targets/deepseek_v3_2.

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state and
three aux states (aux id k = output of layer k, from forward hooks on transformers' decoder layers),
at positions 300.. (past YaRN's original context in "v32"). Sequences are 24 tokens and index_topk
is 8, so every query from position 8 on attends to 8 of its keys only: transformers' eager and SDPA
paths apply the indexer's top-k at every length (topk = min(index_topk, keys)), and
test_indexer_matters shows that without it the logits move by far more than the tolerance.
Two tiny variants, 3 layers (one dense, two MoE), 8 index heads of 16 dims (8 of them roped):
  * "v32": DeepSeek-V3.2's layout (half-split RoPE in the indexer), YaRN, transformers' eager path;
  * "glm": GLM-5's (interleaved indexer RoPE) with layer 1 "shared" (it reuses layer 0's choice and
    has no indexer weights), transformers' SDPA path.
test_topk_rule_against_numpy recomputes every indexer's scores in float64 NumPy from the inputs
transformers' indexers receive, applies the rule (each query keeps its index_topk best visible keys),
and checks transformers' choice and specjax's indexer against it; the draws leave a margin between
the k-th and the next score, so the choice is well defined.
Cached decoding equals the forward to 1e-4 relative (a prefill written over a stale chunk after a
rollback, single tokens, a chunk), and reads the indexer's key cache.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.targets import hf_keys, load_target, registry  # noqa: E402
from specjax.targets import deepseek_v3 as ds  # noqa: E402
from specjax.targets import deepseek_v32 as v32  # noqa: E402  (imported for its @register)
from specjax.targets.layers import indexer  # noqa: E402
from specjax.targets.layers.attention import segment_causal_mask  # noqa: E402
from specjax.targets.loading import read_hf_config  # noqa: E402

from parity._hf_weights import assert_matches_hf, hf_run, randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
VOCAB = 128
T, TOPK = 24, 8
AUX = (0, 1, 2)  # the dense layer 0, the MoE layer 1 ("shared" in "glm"), the last layer (pre-norm)
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=16, qk_nope_head_dim=12,
              qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
              first_k_dense_replace=1, index_topk=TOPK, index_head_dim=16, index_n_heads=8, max_position_embeddings=512)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {  # (config class, extra keys, attention implementation)
    "v32": (transformers.DeepseekV32Config, dict(rope_parameters=YARN), "eager"),
    "glm": (transformers.GlmMoeDsaConfig, dict(indexer_types=["full", "shared", "full"], rms_norm_eps=1e-5), "sdpa"),
}


def _hf_config(variant, **kw):
    cls, extra, _ = VARIANTS[variant]
    return cls(**{**COMMON, **extra, **kw})


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t)).astype(np.int32)


def _positions(b, t, start=300):
    return np.broadcast_to(np.arange(t, dtype=np.int32) + start, (b, t)).copy()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = {}
    for seed, (variant, (_, _, attn)) in enumerate(VARIANTS.items(), start=1):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(_hf_config(variant), attn_implementation=attn).eval()
        randomize_(model, seed)
        g = torch.Generator().manual_seed(seed + 10)
        with torch.no_grad():  # a buffer, so randomize_ leaves it at zero
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
        path = tmp_path_factory.mktemp("deepseek_v32") / variant
        model.save_pretrained(str(path))
        out[variant] = (model, str(path), load_target(str(path), dtype="float32"))
    return out


# =============================================================================================
# Parity with transformers
# =============================================================================================
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity(cases, variant):
    model, _, target = cases[variant]
    cfg = target.config
    assert type(cfg) is v32.DeepseekV32TargetConfig and cfg.index_topk == TOPK
    assert cfg.shared_indexer_layers == ((1,) if variant == "glm" else ())
    assert cfg.indexer.rope_interleave == (variant == "glm")
    ip = target.params["indexer_layers"]
    rows = len(cfg.indexer_layer_ids)
    assert ip["wq_b"]["kernel"].shape == (rows, 20, 8 * 16) and ip["k_norm"]["bias"].shape == (rows, 16)
    # layer 2's indexer key projection is its tensor on disk, transposed (row 1 of 2 in "glm")
    w = model.model.layers[2].self_attn.indexer.wk.weight.detach().numpy()
    np.testing.assert_array_equal(np.asarray(ip["wk"]["kernel"][-1]), w.T)

    ids, positions = _ids(2, T, seed=3), _positions(2, T)
    assert_matches_hf(target, model, ids, positions, AUX, REL_TOL, variant)


def test_indexer_matters(cases):
    """The parity above is not vacuous: with the indexer off (index_topk past the sequence length:
    every query keeps every key) the logits move by far more than the tolerance, and so they do with
    the other RoPE layout in GLM's indexer."""
    ids, positions = _ids(2, T, seed=3), _positions(2, T)
    moved = {}
    for variant in VARIANTS:
        _, _, target = cases[variant]
        ref = target(ids, aux_layer_ids=AUX, positions=positions).logits
        off = type(target)(dataclasses.replace(target.config, index_topk=10**6), {}, target.params)
        moved[f"{variant} indexer off"] = rel_err(off(ids, aux_layer_ids=AUX, positions=positions).logits, ref)
        if variant == "glm":  # DeepSeek-V3.2's half-split indexer RoPE on GLM's weights
            other = type(target)(dataclasses.replace(target.config, architecture=v32.ARCH), {}, target.params)
            moved["glm half-split RoPE"] = rel_err(other(ids, aux_layer_ids=AUX, positions=positions).logits, ref)
    print(moved)
    assert min(moved.values()) > 100 * REL_TOL, moved


# =============================================================================================
# The top-k rule: transformers and specjax against float64 NumPy
# =============================================================================================
def _rope_np(x, cos, sin, rope_dim, interleave):
    """NumPy RoPE on the leading rope_dim dims (half-split; interleaved pairs de-interleaved first)."""
    r, rest = x[..., :rope_dim], x[..., rope_dim:]
    if interleave:
        r = np.concatenate([r[..., 0::2], r[..., 1::2]], axis=-1)
    half = rope_dim // 2
    rotated = np.concatenate([-r[..., half:], r[..., :half]], axis=-1)
    return np.concatenate([r * cos + rotated * sin, rest], axis=-1)


def _numpy_keep(mod, h, q_latent, cos, sin, k, interleave):
    """(kept keys [B, T, T] bool, smallest gap between the k-th and the next visible score) of one
    transformers indexer module, recomputed in float64 from its inputs."""
    weight = lambda lin: lin.weight.detach().double().numpy()  # noqa: E731
    b, t, _ = h.shape
    heads, d, rope_dim = mod.n_heads, mod.head_dim, mod.qk_rope_head_dim
    q = (q_latent @ weight(mod.wq_b).T).reshape(b, t, heads, d)
    key = h @ weight(mod.wk).T
    key = (key - key.mean(-1, keepdims=True)) / np.sqrt(key.var(-1, keepdims=True) + 1e-6)
    key = key * mod.k_norm.weight.detach().double().numpy() + mod.k_norm.bias.detach().double().numpy()
    q = _rope_np(q, cos[:, :, None], sin[:, :, None], rope_dim, interleave)
    key = _rope_np(key, cos, sin, rope_dim, interleave)
    w = (h @ weight(mod.weights_proj).T) * heads**-0.5
    scores = np.einsum("bth,bhts->bts", w, np.maximum(np.einsum("bthd,bsd->bhts", q, key) * d**-0.5, 0.0))
    keep, gap = np.zeros((b, t, t), bool), np.inf
    for i in range(b):
        for j in range(t):
            visible = scores[i, j, : j + 1]  # causal: keys 0..j
            if j + 1 <= k:
                keep[i, j, : j + 1] = True
                continue
            order = np.argsort(-visible, kind="stable")
            keep[i, j, order[:k]] = True
            gap = min(gap, visible[order[k - 1]] - visible[order[k]])
    return keep, gap


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_topk_rule_against_numpy(cases, variant):
    model, _, target = cases[variant]
    seen = []
    hooks = [layer.self_attn.indexer.register_forward_hook(lambda mod, args, out: seen.append((mod, args, out)))
             for layer in model.model.layers if layer.self_attn.indexer is not None]
    ids, positions = _ids(2, T, seed=3), _positions(2, T)
    try:
        hf_run(model, ids, positions)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == len(target.config.indexer_layer_ids)  # no indexer in GLM's shared layer
    spec = target.config.indexer
    visible = np.tril(np.ones((T, T), bool))[None]
    for row, (mod, args, chosen) in enumerate(seen):
        # the indexer's inputs: hidden states, the query LoRA latent, MLA's (cos, sin) tables
        h, q_latent, cos, sin = (a.double().numpy() for a in (args[0], args[1], *args[2]))
        keep, gap = _numpy_keep(mod, h, q_latent, cos, sin, TOPK, spec.rope_interleave)
        assert gap > 1e-5, f"indexer {row}: a near-tie at the k-th score ({gap:.1e}): the choice is ill-defined"
        # keys are dropped: a query at position j >= k keeps k of its j + 1 keys
        assert keep.sum() == 2 * sum(min(j + 1, TOPK) for j in range(T)) < 2 * visible.sum()
        # transformers: its top-k indices, restricted to the keys the query sees (it fills short rows
        # with masked ones)
        theirs = np.zeros_like(keep)
        np.put_along_axis(theirs, chosen.long().numpy(), True, axis=-1)
        np.testing.assert_array_equal(theirs & visible, keep, err_msg=f"transformers' indexer {row}")
        # specjax's indexer on the same inputs (fp32)
        ip = jax.tree.map(lambda a: a[row], target.params["indexer_layers"])
        f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
        ours = indexer.forward_mask(ip, spec, f32(h), f32(q_latent), (f32(cos), f32(sin)),
                                    segment_causal_mask(jnp.ones((2, T), jnp.int32)))
        np.testing.assert_array_equal(np.asarray(ours), keep, err_msg=f"specjax's indexer {row}")


def test_packed_segments_select_within_their_segment(cases):
    """Two packed documents (12 tokens each, more than index_topk) give each document's own forward:
    a query ranks only the keys of its segment."""
    _, _, target = cases["v32"]
    ids = _ids(1, T, seed=5)
    seg = np.array([[1] * 12 + [2] * 12], np.int32)
    pos = np.concatenate([np.arange(12), np.arange(12)])[None].astype(np.int32)
    packed = target(ids, aux_layer_ids=AUX, positions=pos, segment_ids=seg).logits
    for a in (0, 12):
        alone = target(ids[:, a:a + 12], aux_layer_ids=AUX, positions=pos[:, a:a + 12]).logits
        assert rel_err(np.asarray(packed)[:, a:a + 12], alone) <= REL_TOL


def test_bf16_load_keeps_weights_proj_fp32(cases):
    _, path, _ = cases["v32"]
    params = load_target(path, dtype="bfloat16").params
    assert params["indexer_layers"]["weights_proj"]["kernel"].dtype == jnp.float32
    assert params["indexer_layers"]["wq_b"]["kernel"].dtype == jnp.bfloat16


# =============================================================================================
# Cached decoding == the forward (the latent cache plus the indexer's key cache)
# =============================================================================================
def _close(got, want, what):
    err = rel_err(got, want)
    assert err <= REL_TOL, f"{what}: rel err {err:.2e} > {REL_TOL}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decoding_equals_forward(cases, variant):
    _, _, target = cases[variant]
    n = 20
    ids = jnp.asarray(_ids(2, n, seed=6))
    full = target(ids, aux_layer_ids=AUX)
    cache = target.init_cache(2, 40)
    rows = len(target.config.indexer_layer_ids)
    assert jax.tree.map(lambda x: x.shape, cache) == {"kv": (3, 2, 256, 16), "k_rope": (3, 2, 256, 8),
                                                      "index_k": (rows, 2, 256, 16)}
    decode = jax.jit(lambda c, i, p, s: target.decode_chunk(target.params, c, i, p, s, aux_layer_ids=AUX))
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (2, n))
    at = lambda s: jnp.full((2,), s, jnp.int32)  # noqa: E731
    # a wrong 10-token chunk at slot 2 first (stale entries), then roll back to 0: a prefill of 10 (more
    # than index_topk), two single tokens, a chunk of 8
    cache = decode(cache, ids[:, ::-1][:, :10], pos[:, 2:12], at(2))[3]
    pieces = []
    for a, b in [(0, 10), (10, 11), (11, 12), (12, n)]:
        logits, aux, final, cache = decode(cache, ids[:, a:b], pos[:, a:b], at(a))
        pieces.append((logits, aux, final))
    _close(np.concatenate([p[0] for p in pieces], 1), full.logits, "logits")
    _close(np.concatenate([p[2] for p in pieces], 1), full.final_hidden, "final hidden")
    for k in range(len(AUX)):
        _close(np.concatenate([p[1][k] for p in pieces], 1), full.aux_hidden[k], f"aux {AUX[k]}")
    # the key cache is read: the last chunk again, over corrupted index keys of the first 12 slots
    bad = dict(cache, index_k=cache["index_k"].at[:, :, :12].set(1.0))
    moved = rel_err(decode(bad, ids[:, 12:], pos[:, 12:], at(12))[0], pieces[-1][0])
    assert moved > 100 * REL_TOL, moved


# =============================================================================================
# Config tables, defaults and refusals
# =============================================================================================
def _table_config(arch, **kw):
    """Every table key away from both architectures' defaults."""
    cls = transformers.DeepseekV32Config if arch == v32.ARCH else transformers.GlmMoeDsaConfig
    extra = {"indexer_types": ["full", "shared", "full", "full", "shared"]} if arch == v32.GLM_ARCH else {}
    return cls(**{**dict(
        vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=6, num_key_value_heads=6, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=2, n_group=3,
        topk_group=2, first_k_dense_replace=2, norm_topk_prob=False, routed_scaling_factor=1.25,
        num_nextn_predict_layers=2, rms_norm_eps=3e-6, tie_word_embeddings=True, max_position_embeddings=768,
        index_topk=100, index_head_dim=12, index_n_heads=5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 12345.0, "factor": 3.0, "mscale": 0.9,
                         "mscale_all_dim": 0.7, "original_max_position_embeddings": 256}), **extra, **kw})


@pytest.mark.parametrize("arch", list(v32.MODEL_TYPES))
def test_to_hf_round_trips_through_transformers(arch):
    cls = v32.DeepseekV32TargetConfig
    hf = {**_table_config(arch).to_dict(), "architectures": [arch]}
    cfg = cls.from_hf(hf)
    written = cfg.to_hf()
    assert cls.from_hf(written) == cfg
    table = v32.HF_KEYS[arch]
    assert not [row.key for row in table if row.key not in written], "a key of the table is not written"
    for row in table:
        if not callable(row.default) and row.default is not hf_keys.REQUIRED:
            assert getattr(cfg, row.field_name) != row.convert(row.default), f"{row.key} is at its default"
    assert cfg.first_k_dense_replace == 2 and cfg.shared_indexer_layers == ((1, 4) if arch == v32.GLM_ARCH else ())
    hf_cls = type(_table_config(arch))
    through = hf_cls(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")}).to_dict()
    assert cls.from_hf({**through, "architectures": [arch]}) == cfg


def test_defaults_follow_transformers():
    """Absent keys mean what transformers' configs make of them: DeepSeek-V3.2's and GLM-5's index
    and MLA defaults, first_k_dense_replace 3 capped at the layer count, and GLM's shared layers from
    index_topk_pattern or index_topk_freq / index_skip_topk_offset."""
    base = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 48, "moe_intermediate_size": 16,
            "num_hidden_layers": 6, "num_attention_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_group": 1, "topk_group": 1}
    for arch, hf_cls in [(v32.ARCH, transformers.DeepseekV32Config), (v32.GLM_ARCH, transformers.GlmMoeDsaConfig)]:
        cfg = v32.DeepseekV32TargetConfig.from_hf({**base, "architectures": [arch]})
        ref = hf_cls(**base)
        for field in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                      "index_topk", "index_head_dim", "index_n_heads", "rms_norm_eps", "max_position_embeddings",
                      "routed_scaling_factor", "norm_topk_prob"):
            assert getattr(cfg, field) == getattr(ref, field), (arch, field)
        assert cfg.mlp_layer_ids == tuple(i for i, k in enumerate(ref.mlp_layer_types) if k == "dense") == (0, 1, 2)
        assert v32.DeepseekV32TargetConfig.from_hf({**base, "architectures": [arch], "num_hidden_layers": 2}) \
            .first_k_dense_replace == 2
    for extra in ({"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                  {"index_topk_pattern": "FFSFSS"}):
        cfg = v32.DeepseekV32TargetConfig.from_hf({**base, "architectures": [v32.GLM_ARCH], **extra})
        want = transformers.GlmMoeDsaConfig(**base, **extra).indexer_types
        assert cfg.shared_indexer_layers == tuple(i for i, k in enumerate(want) if k == "shared") != ()


def test_config_errors():
    hf = {**_table_config(v32.ARCH).to_dict(), "architectures": [v32.ARCH]}
    glm = {**_table_config(v32.GLM_ARCH).to_dict(), "architectures": [v32.GLM_ARCH]}
    bad = {
        "q_lora_rank": (None, r"q_lora_rank=null .* Fix: set q_lora_rank"),
        "attention_bias": (True, r"attention_bias=true .* Fix: a checkpoint without them"),
        "rope_interleave": (False, r"rope_interleave=False.*Fix: drop rope_interleave"),
        "indexer_rope_interleave": (True, r"Fix: set architectures to \[\"GlmMoeDsaForCausalLM\"\]"),
        "index_topk_freq": (2, r"shared indexer layers.*Fix: set architectures to \[\"GlmMoeDsaForCausalLM\"\]"),
        "index_head_dim": (2, r"index_head_dim=2 is narrower than qk_rope_head_dim=4"),
        "index_n_heads": (0, r"index_n_heads=0 out of range"),
        "num_key_value_heads": (2, r"num_key_value_heads=2 must equal num_attention_heads=6"),
        "scoring_func": ("softmax", r"scoring_func='softmax' is not supported"),
        "mlp_layer_types": (["dense", "sparse", "dense", "sparse", "sparse"], "a dense layer after a sparse one"),
    }
    for key, (value, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            v32.DeepseekV32TargetConfig.from_hf({**hf, key: value})
    glm_bad = {
        "indexer_types": (["shared", "full", "full", "full", "full"], r"layer 0 is 'shared'.*Fix: make layer 0 'full'"),
        "indexer_rope_interleave": (False, r"Fix: set architectures to \[\"DeepseekV32ForCausalLM\"\]"),
    }
    for key, (value, match) in glm_bad.items():
        with pytest.raises(ValueError, match=match):
            v32.DeepseekV32TargetConfig.from_hf({**glm, key: value})
    with pytest.raises(ValueError, match=r"indexer_types must list 'full' or 'shared' for each of the"):
        v32.DeepseekV32TargetConfig.from_hf({**glm, "indexer_types": ["full", "sparse"]})
    # the keys transformers ignores are accepted where they say what it does
    assert v32.DeepseekV32TargetConfig.from_hf({**glm, "indexer_rope_interleave": True, "rope_interleave": True,
                                                "head_dim": 192}).shared_indexer_layers == (1, 4)


def test_model_types_name_the_architectures():
    for arch, model_type in v32.MODEL_TYPES.items():
        assert registry.MODEL_TYPE_TO_ARCH[model_type] == arch
        assert registry.get_target_class({"model_type": model_type}) is registry.ARCHITECTURES[arch]


# =============================================================================================
# The real shape (configs/targets/deepseek_v3_2)
# =============================================================================================
# Published: DeepSeek-V3.2(-Exp) keeps DeepSeek-V3's 671B main model (the 685B on the Hub adds the
# multi-token-prediction module, which targets ignore) and adds an indexer to each of its 61 layers:
# wq_b [1536 -> 64 x 128], wk [7168 -> 128], the key LayerNorm's weight and bias, weights_proj
# [7168 -> 64]. DeepSeek-V3's exact totals come from test_targets_deepseek_v3.py's formula.
V3_TOTAL = 671_026_419_200
V3_ACTIVE = V3_TOTAL - 58 * (256 - 8) * 3 * 7168 * 2048  # 58 MoE layers, 8 of 256 experts of 3 x [7168, 2048]
INDEXER = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64


def test_real_config_counts_the_published_parameters(repo_root):
    from specjax.targets import abstract

    hf = read_hf_config(os.path.join(repo_root, "configs", "targets", "deepseek_v3_2"))
    target = abstract.make_target(hf)
    cfg = target.config
    assert type(target) is v32.DeepseekV32Target and cfg.indexer_layer_ids == tuple(range(61))
    total = sum(math.prod(s.shape) for s in target.weight_specs(cfg))
    active = target.active_params_per_token()
    print(f"deepseek_v3_2: {total:,} params ({total / 1e9:.2f} B), {active:,} active")
    assert total == V3_TOTAL + 61 * INDEXER and active == V3_ACTIVE + 61 * INDEXER
    assert abs(total - 671e9) / 671e9 < 0.01
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (2048, 64, 128)
    assert not cfg.indexer.rope_interleave and cfg.rope.rope_type == "yarn"
    # the same model as DeepSeek-V3 apart from the indexer
    v3 = ds.DeepseekV3TargetConfig.from_hf({**hf, "architectures": [ds.ARCH]})
    assert all(getattr(cfg, f.name) == getattr(v3, f.name) for f in dataclasses.fields(v3) if f.name != "architecture")
    # transformers reads the same model from the file; the MTP layer after the last one is ignored
    assert v32.DeepseekV32TargetConfig.from_hf(
        {**transformers.DeepseekV32Config.from_dict(hf).to_dict(), "architectures": [v32.ARCH]}) == cfg
    assert v32.DeepseekV32Target.ignored_hf_names(cfg, "model.layers.61.self_attn.indexer.wk.weight")
    # the FP8 release (block 128 x 128): wq_b and wk are stored FP8 with their scale grids, like the other
    # linear weights ([64, 12] and [1, 56] on disk, transposed here); weights_proj is not quantized
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    quantized = v32.DeepseekV32TargetConfig.from_hf({**hf, "quantization_config": fp8})
    leaves = {"/".join(s.path): s for s in target.weight_specs(quantized) if s.path[0] == "indexer_layers"}
    assert leaves["indexer_layers/wq_b/kernel_scale_inv"].shape == (61, 12, 64)
    assert leaves["indexer_layers/wk/kernel_scale_inv"].shape == (61, 56, 1)
    assert leaves["indexer_layers/wk/kernel"].dtype == leaves["indexer_layers/wq_b/kernel"].dtype != "float32"
    assert leaves["indexer_layers/weights_proj/kernel"].dtype == "float32"
    assert "indexer_layers/weights_proj/kernel_scale_inv" not in leaves
    # the forward (indexer active past 2048 tokens) and the caches at full size, abstractly
    params = abstract.abstract_params(type(target), cfg, "bfloat16")
    ids = jax.ShapeDtypeStruct((1, 4096), jnp.int32)
    final, aux = jax.eval_shape(lambda p, i: target.forward(p, i, aux_layer_ids=(1, 29, 57)), params, ids)
    assert final.shape == (1, 4096, 7168) and final.dtype == jnp.bfloat16 and len(aux) == 3
    cache = jax.eval_shape(lambda: target.decoder.init_cache(cfg, 1, 3000, jnp.bfloat16))
    assert cache["index_k"].shape == (61, 1, 3072, 128) and cache["kv"].shape == (61, 1, 3072, 512)

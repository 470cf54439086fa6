"""Mistral and Phi-3 / Phi-4 targets vs transformers (PyTorch) on tiny random checkpoints (CPU, fp32).

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state
(HF ``hidden_states[-1]``, after the final norm) and three aux states (aux id k = HF
``hidden_states[k+1]``). The checkpoints are transformers' own ``save_pretrained`` output (Phi-3's
fused ``qkv_proj`` / ``gate_up_proj`` on disk) read by ``load_target``; weights are redrawn larger
than HF's init (parity._hf_weights.randomize_), so a wrong split, rope or norm moves the outputs far
beyond the tolerance.

Cases: Mistral with ``sliding_window: null`` and an explicit head_dim != hidden / heads, and both
families with a 7-position sliding window (shorter than every test sequence); Phi-3 with
LongRoPE + partial rotary (0.5) + GQA (unequal q / k / v parts of qkv_proj) on sequences below and
above ``original_max_position_embeddings`` (short vs long factors, and the attention factor), and
with default RoPE, full rotary and no GQA. Cached decoding equals the forward (1e-5) in both LongRoPE
regimes (and under the window). The real configs in configs/targets count the published parameters.
"""
from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.layers.rope import RopeSpec, rope_spec_from_hf, rope_tables  # noqa: E402
from specjax.targets import load_target  # noqa: E402
from specjax.targets.loading import read_hf_config  # noqa: E402
from specjax.targets.mistral import MistralTargetConfig  # noqa: E402
from specjax.targets.phi3 import Phi3TargetConfig  # noqa: E402
from specjax.targets.registry import get_target_class  # noqa: E402

from parity._hf_weights import randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
DECODE_TOL = 1e-5
VOCAB = 128
AUX = (0, 1, 2)  # of 4 layers: every tap is a pre-final-norm residual state (HF hidden_states[k+1])
ORIG = 16  # Phi-3 LongRoPE: original_max_position_embeddings of the tiny configs


def _mistral_cfg():
    return transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-5,
                                      max_position_embeddings=256, sliding_window=None, rope_theta=5000.0)


def _phi3_longrope_cfg():
    # head_dim 16, rotary 8 -> 4 factors per set; GQA 4 q heads / 2 kv heads
    return transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4 * ORIG, original_max_position_embeddings=ORIG,
        partial_rotary_factor=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.0],
                      "long_factor": [1.0, 3.0, 9.0, 27.0]})


def _phi3_default_cfg():
    return transformers.Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


def _mistral_window_cfg():  # every layer slides over 7 positions (< the 12- and 48-token tests)
    cfg = _mistral_cfg()
    cfg.sliding_window = WINDOW
    return cfg


def _phi3_window_cfg():
    cfg = _phi3_default_cfg()
    cfg.sliding_window = WINDOW
    return cfg


WINDOW = 7
CASES = {"mistral": _mistral_cfg, "phi3_longrope_partial": _phi3_longrope_cfg, "phi3_default": _phi3_default_cfg,
         "mistral_sliding_window": _mistral_window_cfg, "phi3_sliding_window": _phi3_window_cfg}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(name, transformers model, specjax target) sharing one saved checkpoint."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CASES[request.param](), attn_implementation="eager").eval()
    randomize_(model, seed=1)
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    return request.param, model, load_target(path, dtype="float32")


def _ids(t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (2, t)).astype(np.int32)


@pytest.mark.parametrize("length", [12, 3 * ORIG])  # below and above the LongRoPE switch point
def test_forward_matches_transformers(pair, length):
    name, model, target = pair
    ids = _ids(length)
    out = target(ids, aux_layer_ids=AUX)
    with torch.no_grad():
        ref = model(torch.tensor(ids, dtype=torch.long), output_hidden_states=True, use_cache=False)
    errs = {"logits": rel_err(out.logits, ref.logits.numpy()),
            "final": rel_err(out.final_hidden, ref.hidden_states[-1].numpy())}
    errs.update({f"aux{k}": rel_err(a, ref.hidden_states[k + 1].numpy()) for k, a in zip(AUX, out.aux_hidden)})
    print(f"\n{name} T={length}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert v <= REL_TOL, f"{name} T={length} {k}: rel err {v:.3e} > {REL_TOL}"


def test_phi3_checkpoint_is_fused_and_split_at_load(pair):
    name, model, target = pair
    if not name.startswith("phi3"):
        pytest.skip("Phi-3 only")
    sd = model.state_dict()
    qkv = sd["model.layers.2.self_attn.qkv_proj.weight"].numpy()
    cfg = target.config
    q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = target.params["layers"]["self_attn"]
    np.testing.assert_array_equal(np.asarray(attn["q_proj"]["kernel"][2]).T, qkv[:q_dim])
    np.testing.assert_array_equal(np.asarray(attn["k_proj"]["kernel"][2]).T, qkv[q_dim:q_dim + kv_dim])
    np.testing.assert_array_equal(np.asarray(attn["v_proj"]["kernel"][2]).T, qkv[q_dim + kv_dim:])
    gate_up = sd["model.layers.2.mlp.gate_up_proj.weight"].numpy()
    mlp = target.params["layers"]["mlp"]
    np.testing.assert_array_equal(np.asarray(mlp["gate_proj"]["kernel"][2]).T, gate_up[:cfg.intermediate_size])
    np.testing.assert_array_equal(np.asarray(mlp["up_proj"]["kernel"][2]).T, gate_up[cfg.intermediate_size:])


@pytest.mark.parametrize("pieces", [[(0, 5), (5, 6), (6, 7), (7, 10), (10, 12)],  # all below ORIG: short factors
                                    [(0, 20), (20, 21), (21, 22), (22, 24)]])  # every call above ORIG: long
def test_cached_decoding_equals_forward(pair, pieces):
    name, _, target = pair
    t = pieces[-1][1]
    ids = jnp.asarray(_ids(t, seed=3))
    full = target(ids, aux_layer_ids=AUX)
    decode = jax.jit(lambda c, i, p, s: target.decode_chunk(target.params, c, i, p, s, aux_layer_ids=AUX))
    cache = target.init_cache(2, t)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (2, t))
    got = []
    for a, b in pieces:
        logits, aux, final, cache = decode(cache, ids[:, a:b], pos[:, a:b], jnp.full((2,), a, jnp.int32))
        got.append((logits, final, aux))
    for i, (label, ref) in enumerate([("logits", full.logits), ("final", full.final_hidden)]):
        np.testing.assert_allclose(np.concatenate([g[i] for g in got], 1), ref, rtol=DECODE_TOL, atol=DECODE_TOL,
                                   err_msg=f"{name} {label}")
    for k in range(len(AUX)):
        np.testing.assert_allclose(np.concatenate([g[2][k] for g in got], 1), full.aux_hidden[k], rtol=DECODE_TOL,
                                   atol=DECODE_TOL, err_msg=f"{name} aux{AUX[k]}")
    assert np.abs(np.asarray(full.logits)).max() > 1.0  # not trivially equal


def test_longrope_switches_factors_at_the_original_length():
    spec = rope_spec_from_hf(_phi3_longrope_cfg().to_dict(), longrope=True, partial_rotary=True)
    assert spec.rope_type == "longrope" and spec.rotary_dim(16) == 8
    assert math.isclose(spec.attention_factor, math.sqrt(1 + math.log(4) / math.log(ORIG)))
    pos = lambda n: jnp.arange(n, dtype=jnp.int32)[None]  # noqa: E731
    at_orig, past = rope_tables(spec, 16, pos(ORIG), jnp.float32), rope_tables(spec, 16, pos(ORIG + 1), jnp.float32)
    # position 1's angle: short factors while the call ends at ORIG, long ones one token later
    assert not np.allclose(np.asarray(at_orig[0][0, 1]), np.asarray(past[0][0, 1]))
    assert at_orig[0].shape[-1] == 8


def test_sliding_window_is_kept_only_where_it_hides_keys(pair):
    name, _, target = pair
    assert target.config.sliding_window == (WINDOW if name.endswith("sliding_window") else None)
    hf = _mistral_cfg().to_dict()
    hf.update(sliding_window=64, architectures=["MistralForCausalLM"])
    assert MistralTargetConfig.from_hf(hf).sliding_window == 64
    hf.pop("sliding_window")  # transformers' MistralConfig default: 4096, no shorter than 256 -> no window
    assert MistralTargetConfig.from_hf(hf).sliding_window is None
    phi = _phi3_default_cfg().to_dict()
    phi.update(sliding_window=2047, max_position_embeddings=4096, architectures=["Phi3ForCausalLM"])
    assert Phi3TargetConfig.from_hf(phi).sliding_window == 2047
    phi.update(sliding_window=0)
    with pytest.raises(ValueError, match="sliding_window: 0 is outside"):
        Phi3TargetConfig.from_hf(phi)


def test_other_families_still_refuse_longrope_and_partial_rotary():
    with pytest.raises(ValueError, match="longrope"):
        rope_spec_from_hf({"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
                           "original_max_position_embeddings": 4})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_spec_from_hf({"partial_rotary_factor": 0.5})
    assert rope_spec_from_hf({"rope_theta": 7.0}) == RopeSpec("default", 7.0)


@pytest.mark.parametrize("make", [_mistral_cfg, _phi3_longrope_cfg, _phi3_default_cfg])
def test_config_round_trips_through_to_hf_and_transformers(make):
    hf = make().to_dict()
    hf["architectures"] = [hf["architectures"][0] if hf.get("architectures") else
                           {"mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM"}[hf["model_type"]]]
    cls = get_target_class(hf).config_class
    cfg = cls.from_hf(hf)
    written = cfg.to_hf()
    assert cls.from_hf(written) == cfg
    hf_class = type(make())
    through = hf_class(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")}).to_dict()
    through["architectures"] = written["architectures"]
    assert cls.from_hf(through) == cfg


# published parameter counts (Hugging Face model pages, "Model size" from the safetensors metadata):
#   mistralai/Mistral-7B-v0.3 (and -Instruct-v0.3): 7.25B params; microsoft/Phi-4-mini-instruct: 3.84B params.
# The exact totals are the sums of the published tensor shapes (config.json in configs/targets/):
#   Mistral 7B: 2 * 32768 * 4096 + 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096)
#   Phi-4-mini (tied): 200064 * 3072 + 3072 + 32 * (3072 * 5120 + 3072**2 + 3 * 3072 * 8192 + 2 * 3072)
PUBLISHED = {
    "mistral_7b": (7.25e9, 2 * 32768 * 4096 + 4096 + 32 * (2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 8192)),
    "phi4_mini": (3.84e9, 200064 * 3072 + 3072 + 32 * (3072 * 5120 + 3072**2 + 3 * 3072 * 8192 + 6144)),
}


@pytest.mark.parametrize("folder", sorted(PUBLISHED))
def test_real_config_counts_the_published_parameters(folder):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    hf = read_hf_config(os.path.join(repo, "configs", "targets", folder))
    cls = get_target_class(hf)
    cfg = cls.config_from_hf(hf)
    total = sum(math.prod(spec.shape) for spec in cls.weight_specs(cfg))
    rounded, exact = PUBLISHED[folder]
    assert total == exact
    assert round(total / 1e7) * 1e7 == rounded
    if folder == "phi4_mini":  # the fused on-disk tensors the loader expects
        files = {s.hf_name: s.hf_file_shape for s in cls.weight_specs(cfg)}
        assert files["model.layers.{i}.self_attn.qkv_proj.weight"] == (5120, 3072)
        assert files["model.layers.{i}.mlp.gate_up_proj.weight"] == (16384, 3072)
        assert cfg.rope.rope_type == "longrope" and cfg.rope.rotary_dim(cfg.head_dim) == 96
    with open(os.path.join(repo, "configs", "targets", folder, "config.json")) as f:
        assert json.load(f)["architectures"] == [cfg.architecture]


def test_rope_spec_survives_a_json_round_trip():
    """run_meta.json and manifests store the RopeSpec as JSON (lists): rebuilt, it is equal and hashable."""
    import dataclasses
    import json

    from specjax.layers.rope import RopeSpec

    spec = RopeSpec("longrope", 10000.0, original_max_position_embeddings=16, short_factor=(1.0, 1.5),
                    long_factor=(2.0, 3.0), attention_factor=1.2)
    back = RopeSpec(**json.loads(json.dumps(dataclasses.asdict(spec))))
    assert back == spec and hash(back) == hash(spec)
    assert RopeSpec(**json.loads(json.dumps(dataclasses.asdict(RopeSpec())))) == RopeSpec()

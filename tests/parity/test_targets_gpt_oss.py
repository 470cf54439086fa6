"""gpt-oss (``GptOssForCausalLM``) vs transformers (PyTorch) on tiny random checkpoints (CPU, fp32).

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state
(HF ``hidden_states[-1]``) and three aux states (aux id k = HF ``hidden_states[k+1]``). The tiny model
has what makes gpt-oss differ from Llama: YaRN RoPE (and plain RoPE), q/k/v/o biases, per-head attention sinks, alternating
sliding (window 5, shorter than the test sequences) and full layers, every feed-forward a top-k
router with bias (softmax over the k logits) feeding clamped-SwiGLU experts with biases, whose
gate/up columns the checkpoint interleaves. Weights are redrawn far from HF's init
(parity._hf_weights.randomize_); a check confirms the clamps are hit. Cached decoding equals the
forward (rel 1e-5).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.targets import load_target  # noqa: E402
from specjax.targets.gpt_oss import FULL, SLIDING, GptOssTargetConfig  # noqa: E402

from parity._hf_weights import randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
DECODE_TOL = 1e-5
VOCAB = 128
AUX = (0, 1, 2)
# the published YaRN settings (factor 32, truncate false, theta 150k) with a short original context
ROPES = {"default": {"rope_type": "default", "rope_theta": 10000.0},
         "yarn": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 16, "rope_theta": 150000.0}}


def _cfg(rope="default", **kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=2, sliding_window=5,
                max_position_embeddings=256, rope_parameters=dict(ROPES[rope]), swiglu_limit=2.0,
                layer_types=[SLIDING, FULL, SLIDING, FULL])
    base.update(kw)
    return transformers.GptOssConfig(**base)


@pytest.fixture(scope="module", params=list(ROPES))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_cfg(request.param)).eval()
    model.config._attn_implementation = "eager"
    randomize_(model, seed=1)
    with torch.no_grad():  # sinks of both signs and sizes that matter next to the scores
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.numel()))
    path = str(tmp_path_factory.mktemp(f"gpt_oss_{request.param}"))
    model.save_pretrained(path)
    return request.param, model, load_target(path, dtype="float32")


def _ids(t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (2, t)).astype(np.int32)


@pytest.mark.parametrize("length", [4, 17])
def test_forward_matches_transformers(pair, length):
    name, model, target = pair
    ids = _ids(length)
    out = target(ids, aux_layer_ids=AUX)
    with torch.no_grad():
        ref = model(torch.tensor(ids, dtype=torch.long), output_hidden_states=True, use_cache=False)
    errs = {"logits": rel_err(out.logits, ref.logits.numpy()),
            "final": rel_err(out.final_hidden, ref.hidden_states[-1].numpy())}
    errs.update({f"aux{k}": rel_err(a, ref.hidden_states[k + 1].numpy()) for k, a in zip(AUX, out.aux_hidden)})
    print(f"\ngpt-oss {name} T={length}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert v <= REL_TOL, f"{name} T={length} {k}: rel err {v:.3e} > {REL_TOL}"


def test_the_swiglu_clamps_are_hit(pair):
    """The parity above covers the clamps only if the experts' pre-activations cross +-limit."""
    _, model, _ = pair
    seen = []
    hook = model.model.layers[1].mlp.experts.register_forward_hook(
        lambda mod, args, out: seen.append(args[0] @ mod.gate_up_proj[0] + mod.gate_up_proj_bias[0]))
    with torch.no_grad():
        model(torch.tensor(_ids(17), dtype=torch.long))
    hook.remove()
    gu = seen[0].numpy()
    limit = model.config.swiglu_limit
    assert (gu[:, ::2] > limit).any() and (gu[:, 1::2] < -limit).any() and (np.abs(gu) < limit).any()


@pytest.mark.parametrize("pieces", [[(0, 3), (3, 4), (4, 9), (9, 10), (10, 16)], [(0, 12), (12, 13), (13, 16)]])
def test_cached_decoding_equals_forward(pair, pieces):
    _, _, target = pair
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
    errs = {"logits": rel_err(np.concatenate([g[0] for g in got], 1), full.logits),
            "final": rel_err(np.concatenate([g[1] for g in got], 1), full.final_hidden)}
    errs.update({f"aux{AUX[k]}": rel_err(np.concatenate([g[2][k] for g in got], 1), full.aux_hidden[k])
                 for k in range(len(AUX))})
    for k, v in errs.items():
        assert v <= DECODE_TOL, f"{pieces} {k}: rel err {v:.2e} > {DECODE_TOL}"


def test_config_round_trips_through_to_hf_and_transformers():
    cfg = GptOssTargetConfig.from_hf({**_cfg().to_dict(), "architectures": ["GptOssForCausalLM"]})
    assert cfg.sliding_layers == (True, False, True, False) and cfg.swiglu_limit == 2.0
    assert GptOssTargetConfig.from_hf(cfg.to_hf()) == cfg
    through = transformers.GptOssConfig(**{k: v for k, v in cfg.to_hf().items()
                                           if k not in ("architectures", "model_type")}).to_dict()
    assert GptOssTargetConfig.from_hf({**through, "architectures": ["GptOssForCausalLM"]}) == cfg


# ---------------------------------------------------------------------------------------------
# MXFP4 experts (OpenAI's published layout), kept quantized on the device
# ---------------------------------------------------------------------------------------------
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def _np_mxfp4(rows):
    """NumPy MXFP4 of [..., n, in] along `in` (groups of 32): (blocks [..., n, in/32, 16] uint8,
    scales [..., n, in/32] uint8, the dequantized values [..., n, in] float32). Each group's
    exponent makes its largest magnitude <= 6; elements round to the nearest E2M1 magnitude."""
    g = rows.reshape(*rows.shape[:-1], rows.shape[-1] // 32, 32).astype(np.float32)
    amax = np.abs(g).max(-1, keepdims=True)
    exp = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -20, 20).astype(np.int32)
    scaled = g / 2.0 ** exp
    mag = np.abs(np.clip(scaled, -6, 6))
    code = np.abs(mag[..., None] - E2M1).argmin(-1).astype(np.uint8) | np.where(scaled < 0, 8, 0).astype(np.uint8)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    deq = (np.where(code & 8, -1.0, 1.0) * E2M1[code & 7] * 2.0 ** exp).reshape(rows.shape).astype(np.float32)
    # C order: safetensors' numpy writer stores the raw buffer whatever the strides
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exp[..., 0] + 127).astype(np.uint8)), deq


@pytest.fixture(scope="module")
def mxfp4_pair(tmp_path_factory):
    """transformers running the dequantized expert weights, and specjax loading the MXFP4 checkpoint."""
    import json

    from safetensors.numpy import save_file

    torch.manual_seed(0)
    cfg = _cfg(hidden_size=64, intermediate_size=64)
    model = transformers.GptOssForCausalLM(cfg).eval()
    model.config._attn_implementation = "eager"
    randomize_(model, seed=2)
    tensors = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(ex, name).numpy()  # [E, in, out]
                blocks, scales, deq = _np_mxfp4(np.swapaxes(w, 1, 2))  # rows = output features
                getattr(ex, name).copy_(torch.tensor(np.swapaxes(deq, 1, 2)))
                tensors[f"model.layers.{i}.mlp.experts.{name}_blocks"] = blocks
                tensors[f"model.layers.{i}.mlp.experts.{name}_scales"] = scales
    for k, v in model.state_dict().items():
        if not k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[k] = v.numpy()
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    save_file(tensors, str(path / "model.safetensors"))
    conf = {**model.config.to_dict(), "architectures": ["GptOssForCausalLM"],
            "quantization_config": {"quant_method": "mxfp4"}}
    (path / "config.json").write_text(json.dumps(conf))
    return model, load_target(str(path), dtype="float32"), tensors


def test_mxfp4_experts_stay_quantized_and_match_transformers(mxfp4_pair):
    model, target, tensors = mxfp4_pair
    assert target.config.expert_format == "mxfp4"
    ex = target.params["layers"]["experts"]
    assert ex["gate_up_proj"]["blocks"].dtype == jnp.uint8 and ex["down_proj"]["scales"].dtype == jnp.uint8
    assert ex["gate_up_proj"]["blocks"].shape == (4, 6, 128, 2, 16)  # [L, E, 2F, D/32, 16]: 4.25 bits a weight
    # the gate rows come first on the device (the file interleaves gate and up rows)
    np.testing.assert_array_equal(np.asarray(ex["gate_up_proj"]["blocks"][1, :, :64]),
                                  tensors["model.layers.1.mlp.experts.gate_up_proj_blocks"][:, 0::2])
    ids = _ids(17, seed=5)
    out = target(ids, aux_layer_ids=AUX)
    with torch.no_grad():
        ref = model(torch.tensor(ids, dtype=torch.long), output_hidden_states=True, use_cache=False)
    errs = {"logits": rel_err(out.logits, ref.logits.numpy()),
            "final": rel_err(out.final_hidden, ref.hidden_states[-1].numpy())}
    errs.update({f"aux{k}": rel_err(a, ref.hidden_states[k + 1].numpy()) for k, a in zip(AUX, out.aux_hidden)})
    print("\ngpt-oss mxfp4: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert v <= REL_TOL, f"mxfp4 {k}: rel err {v:.3e} > {REL_TOL}"
    assert target.active_params_per_token() < sum(s.num_params for s in type(target).weight_specs(target.config))


def test_other_quantization_methods_are_refused():
    hf = {**_cfg().to_dict(), "architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(ValueError, match="quant_method='fp8' is not supported"):
        GptOssTargetConfig.from_hf(hf)


# published totals (OpenAI's gpt-oss model card): 20.91 B and 116.83 B parameters, 3.61 B / 5.13 B active
# (active counts the unembedding but not the input embedding table, which a token only indexes)
PUBLISHED = {"gpt_oss_20b": (20_914_757_184, 3.61e9), "gpt_oss_120b": (116_829_156_672, 5.13e9)}


@pytest.mark.parametrize("folder", sorted(PUBLISHED))
def test_real_config_counts_the_published_parameters(folder):
    import math
    import os

    from specjax.targets.loading import read_hf_config
    from specjax.targets.registry import get_target_class

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    hf = read_hf_config(os.path.join(repo, "configs", "targets", folder))
    cls = get_target_class(hf)
    cfg = cls.config_from_hf(hf)
    assert cfg.expert_format == "mxfp4" and cfg.rope.rope_type == "yarn" and cfg.rope.truncate is False
    specs = cls.weight_specs(cfg)
    total, active = PUBLISHED[folder]
    assert sum(s.num_params for s in specs) == total  # MXFP4 blocks hold 2 parameters a byte; scales none
    target = cls(cfg, hf, {})
    embed = math.prod(next(s for s in specs if s.path[0] == "embed_tokens").shape)
    assert round((target.active_params_per_token() - embed) / 1e7) * 1e7 == active

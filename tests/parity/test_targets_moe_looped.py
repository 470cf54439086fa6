"""Qwen3-MoE and looped targets vs transformers (PyTorch) on tiny random checkpoints (CPU, fp32).

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits and each of the three aux
hidden states (aux id k = output of (virtual) layer k, read from PyTorch forward hooks on the decoder
layers in call order, so a weight-shared layer contributes once per application).

References:
  * Qwen3MoeForCausalLM saved with save_pretrained (per-expert tensors on disk), mixed MoE / dense
    layers (mlp_only_layers, decoder_sparse_step), both kernels (reference ragged_dot and xla).
  * Looped Llama / Qwen3: an independent unroll built in PyTorch: transformers' LlamaForCausalLM /
    Qwen3ForCausalLM whose layer list is the looped order (the same modules repeated), against our
    LoopedLlamaForCausalLM / LoopedQwen3ForCausalLM loading the same safetensors.
  * HrmTextForCausalLM (transformers' looped architecture), fused gqkv / gate_up tensors on disk.
Weights are redrawn larger than HF's init (std 0.15, norms 1 + 0.2 N(0,1)) so routing, attention and
norm-weight mistakes move the outputs far beyond the tolerance.
"""
from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.targets import SUPPORTED_ARCHITECTURES, default_aux_layer_ids, get_target_class, load_target  # noqa: E402
from specjax.targets.hrm_text import HrmTextTargetConfig  # noqa: E402
from specjax.targets.looped import LoopedLlamaConfig  # noqa: E402
from specjax.targets.qwen3_moe import Qwen3MoeTargetConfig  # noqa: E402

from parity._hf_weights import randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
VOCAB = 256


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t)).astype(np.int32)


def _randomize_(model, seed: int) -> None:
    # HRM-Text's z_L_init (its initial loop state) is drawn like an embedding
    randomize_(model, seed, embed_names=("embed_tokens", "z_L_init"))


def _save(model, path, **config_updates) -> str:
    model.save_pretrained(str(path))
    if config_updates:
        cfg_path = os.path.join(str(path), "config.json")
        with open(cfg_path) as f:
            hf = json.load(f)
        hf.update(config_updates)
        with open(cfg_path, "w") as f:
            json.dump(hf, f)
    return str(path)


def _hf_run(model, ids, layer_modules):
    """(logits, outputs of every decoder-layer call in order)."""
    calls = []
    hooks = [m.register_forward_hook(lambda mod, a, o: calls.append(o[0] if isinstance(o, tuple) else o))
             for m in layer_modules]
    try:
        with torch.no_grad():
            out = model(torch.tensor(ids, dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits.numpy(), [c.numpy() for c in calls]


def _check(name, target, model, layer_modules, ids, aux, n_virtual, **kw):
    t0 = time.perf_counter()
    out = target(ids, aux_layer_ids=aux, **kw)
    jax.block_until_ready(out)
    t1 = time.perf_counter()
    logits, calls = _hf_run(model, ids, layer_modules)
    assert len(calls) == n_virtual, f"HF ran {len(calls)} layer calls, expected {n_virtual}"
    errs = {"logits": rel_err(out.logits, logits)}
    errs.update({f"aux{k}": rel_err(a, calls[k]) for k, a in zip(aux, out.aux_hidden)})
    print(f"{name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
          + f"; compile+run {t1 - t0:.2f}s for {ids.shape}")
    for k, v in errs.items():
        assert v <= REL_TOL, f"{name} {k}: rel err {v:.3e} > {REL_TOL}"
    return out


def _top_level_scans(fn, params, ids, hidden):
    """For each scan directly in fn's jaxpr (the layer scans): the shapes of its outputs that stack a
    [B, T, hidden] state per iteration (must be none: taps come from the carry, not from ys)."""
    jaxpr = jax.make_jaxpr(fn)(params, ids).jaxpr
    per_layer = (*ids.shape, hidden)
    scans = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "scan":
                length = eqn.params["length"]
                scans.append([v.aval.shape for v in eqn.outvars if tuple(v.aval.shape) == (length, *per_layer)])
            elif eqn.primitive.name in ("pjit", "jit", "closed_call"):
                walk(eqn.params["jaxpr"].jaxpr)

    walk(jaxpr)
    return scans


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE
# ---------------------------------------------------------------------------------------------
MOE_VARIANTS = {
    # 5 layers, layer 2 dense (mlp_only_layers), renormalised top-2 of 8 experts
    "mixed": dict(num_hidden_layers=5, mlp_only_layers=[2], decoder_sparse_step=1, norm_topk_prob=True,
                  num_experts_per_tok=2),
    # 4 layers, MoE every 2nd layer (1 and 3), raw softmax weights, top-3
    "sparse_step2": dict(num_hidden_layers=4, mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False,
                         num_experts_per_tok=3),
}


@pytest.fixture(scope="module")
def tmp_mod(tmp_path_factory):
    return tmp_path_factory.mktemp("moe_looped")


def _moe_model(tmp_mod, variant, seed):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, num_experts=8, max_position_embeddings=4096, **MOE_VARIANTS[variant])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize_(model, seed)
    return model, _save(model, tmp_mod / f"qwen3_moe_{variant}")


@pytest.fixture(scope="module")
def moe_mixed(tmp_mod):
    return _moe_model(tmp_mod, "mixed", seed=10)


def test_moe_checkpoint_is_per_expert_on_disk(moe_mixed):
    from safetensors import safe_open

    _, path = moe_mixed
    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)  # transformers 5 fuses in memory only
    assert "model.layers.2.mlp.gate_proj.weight" in names and "model.layers.2.mlp.gate.weight" not in names


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_qwen3_moe_parity(moe_mixed, impl):
    model, path = moe_mixed
    target = load_target(path, dtype="float32", moe_implementation=impl)
    cfg = target.config
    assert target.arch == "Qwen3MoeForCausalLM" and isinstance(cfg, Qwen3MoeTargetConfig)
    assert cfg.moe_layer_ids == (0, 1, 3, 4) and cfg.mlp_layer_ids == (2,) and cfg.num_experts == 8
    p = target.params
    assert p["moe_layers"]["experts"]["gate_proj"]["kernel"].shape == (4, 8, 64, 32)
    assert p["moe_layers"]["experts"]["down_proj"]["kernel"].shape == (4, 8, 32, 64)
    assert p["moe_layers"]["router"]["kernel"].shape == (4, 64, 8)
    assert p["mlp_layers"]["gate_proj"]["kernel"].shape == (1, 64, 96)
    # expert 5 of layer 3 (slot 2 of the MoE stack) is that expert's on-disk tensor, transposed
    w = model.model.layers[3].mlp.experts.gate_up_proj[5, :32].detach().numpy()
    np.testing.assert_array_equal(np.asarray(p["moe_layers"]["experts"]["gate_proj"]["kernel"][2, 5]), w.T)
    # taps: (0) inside an all-MoE span, (2) the dense layer, (4) the last layer (pre final norm)
    _check(f"qwen3_moe[{impl}]", target, model, model.model.layers, _ids(2, 24, seed=1), (0, 2, 4), 5)


def test_qwen3_moe_sparse_step_parity(tmp_mod):
    model, path = _moe_model(tmp_mod, "sparse_step2", seed=11)
    target = load_target(path, dtype="float32")
    assert target.config.moe_layer_ids == (1, 3) and target.config.mlp_layer_ids == (0, 2)
    assert not target.config.norm_topk_prob and target.config.num_experts_per_tok == 3
    _check("qwen3_moe[sparse_step=2]", target, model, model.model.layers, _ids(2, 16, seed=2), (0, 1, 2), 4)


def test_moe_packed_segments_and_scan_split(moe_mixed):
    _, path = moe_mixed
    target = load_target(path, dtype="float32")
    aux = (1, 2, 3)
    n, pad = 10, 4
    docs = _ids(2, n, seed=3)
    packed = np.concatenate([docs[:1], docs[1:], np.zeros((1, pad), np.int32)], axis=1)
    segment_ids = np.array([[1] * n + [2] * n + [0] * pad], np.int32)
    positions = np.array([list(range(n)) * 2 + [0] * pad], np.int32)
    out = target(packed, aux_layer_ids=aux, positions=positions, segment_ids=segment_ids)
    alone = target(docs, aux_layer_ids=aux)
    for j, sl in enumerate((slice(0, n), slice(n, 2 * n))):
        assert rel_err(out.logits[0, sl], alone.logits[j]) <= 1e-5
        for a, b in zip(out.aux_hidden, alone.aux_hidden):
            assert rel_err(a[0, sl], b[j]) <= 1e-5
    assert np.isfinite(np.asarray(out.logits)).all()
    # One scan per span between taps ([0,2) [2,3) [3,4) [4,5)), none emitting per-layer outputs.
    fwd = lambda p, x: target.forward(p, x, aux_layer_ids=aux)  # noqa: E731
    scans = _top_level_scans(fwd, target.params, docs, 64)
    assert len(scans) == 4 and not any(scans), scans


# ---------------------------------------------------------------------------------------------
# Looped Llama / Qwen3 (specjax's generic looped target) vs a PyTorch unroll
# ---------------------------------------------------------------------------------------------
def _looped_case(tmp_mod, name, hf_config, loop, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    _randomize_(model, seed)
    arch = {"LlamaForCausalLM": "LoopedLlamaForCausalLM", "Qwen3ForCausalLM": "LoopedQwen3ForCausalLM"}[
        type(model).__name__]
    path = _save(model, tmp_mod / name, architectures=[arch], **loop)
    target = load_target(path, dtype="float32")
    order = target.config.virtual_layers()
    # The independent reference: the HF model with its layer list replaced by the unroll.
    physical = list(model.model.layers)
    model.model.layers = torch.nn.ModuleList([physical[i] for i in order])
    model.config.num_hidden_layers = len(order)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in order]
    return model, physical, target


def test_looped_llama_whole_stack_parity(tmp_mod):
    # The Nanbeige layout in miniature: every layer runs twice, no loop span given.
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model, physical, target = _looped_case(tmp_mod, "looped_llama", cfg, {"num_loops": 2}, seed=20)
    c = target.config
    assert isinstance(c, LoopedLlamaConfig) and (c.num_loops, c.loop_start, c.loop_end) == (2, 0, 4)
    assert c.virtual_layers() == (0, 1, 2, 3, 0, 1, 2, 3) and target.num_layers == 8
    assert target.default_aux_layer_ids() == (1, 3, 4) == default_aux_layer_ids(8)
    # taps on both passes and the last virtual layer
    _check("looped_llama[4x2]", target, model, physical, _ids(2, 20, seed=4), (1, 5, 7), 8)


def test_looped_qwen3_span_parity(tmp_mod):
    # Only layers [1, 3) loop, three times: virtual order 0 1 2 1 2 1 2 3.
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   max_position_embeddings=4096)
    model, physical, target = _looped_case(
        tmp_mod, "looped_qwen3", cfg, {"num_loops": 3, "loop_start": 1, "loop_end": 3}, seed=21)
    assert target.arch == "LoopedQwen3ForCausalLM" and target.config.qk_norm
    assert target.config.virtual_layers() == (0, 1, 2, 1, 2, 1, 2, 3) and target.num_layers == 8
    ids = _ids(2, 20, seed=5)
    out = _check("looped_qwen3[span 1:3 x3]", target, model, physical, ids, (2, 4, 6), 8)
    # The loop matters: the plain (unlooped) Qwen3 forward of the same weights differs.
    plain = get_target_class("Qwen3ForCausalLM")
    base_cfg = plain.config_from_hf({**target.hf_config, "architectures": ["Qwen3ForCausalLM"]})
    plain_out = plain(base_cfg, target.hf_config, target.params)(ids, aux_layer_ids=(0, 1, 2))
    assert rel_err(plain_out.logits, out.logits) > 1e-2
    # scans: one per span between taps over the unroll, no per-layer outputs kept
    fwd = lambda p, x: target.forward(p, x, aux_layer_ids=(2, 4, 6))  # noqa: E731
    scans = _top_level_scans(fwd, target.params, ids, 64)
    assert len(scans) == 4 and not any(scans), scans


# ---------------------------------------------------------------------------------------------
# HRM-Text (a looped architecture that transformers ships)
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hrm(tmp_mod):
    cfg = transformers.HrmTextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, head_dim=16, H_cycles=2, L_cycles=2,
                                     max_position_embeddings=4096)
    torch.manual_seed(30)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    _randomize_(model, 30)
    return model, _save(model, tmp_mod / "hrm")


def test_hrm_text_parity(hrm):
    from safetensors import safe_open

    model, path = hrm
    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
        assert "model.L_module.layers.0.attn.gqkv_proj.weight" in f.keys()  # fused on disk
    target = load_target(path, dtype="float32")
    c = target.config
    assert isinstance(c, HrmTextTargetConfig) and c.num_layers_per_stack == 2
    assert target.num_layers == c.num_hidden_layers == 12 == target.hf_config["num_hidden_layers"]
    assert c.invocations() == ["L_module", "L_module", "H_module"] * 2
    assert target.default_aux_layer_ids() == (1, 5, 8)
    # gqkv chunk 1 of 4 is q_proj
    q = model.model.H_module.layers[1].self_attn.q_proj.weight.detach().numpy()
    ours = target.params["H_module"]["layers"]["self_attn"]["q_proj"]["kernel"][1]
    np.testing.assert_array_equal(np.asarray(ours), q.T)
    layer_modules = list(model.model.L_module.layers) + list(model.model.H_module.layers)
    # taps: inside the first L run, the end of an H run (before its norm), the last L run of cycle 2
    _check("hrm_text[2 per stack, H2 x L2]", target, model, layer_modules, _ids(2, 20, seed=6), (0, 5, 10), 12)


# ---------------------------------------------------------------------------------------------
# Validators and loader errors
# ---------------------------------------------------------------------------------------------
def test_registry_lists_new_architectures():
    for arch in ("Qwen3MoeForCausalLM", "LoopedLlamaForCausalLM", "LoopedQwen3ForCausalLM", "HrmTextForCausalLM"):
        assert arch in SUPPORTED_ARCHITECTURES
    assert get_target_class({"model_type": "qwen3_moe"}).__name__ == "Qwen3MoeTarget"
    assert get_target_class({"model_type": "hrm_text"}).__name__ == "HrmTextTarget"
    with pytest.raises(ValueError, match=r"'MixtralForCausalLM'; supported: .*Qwen3MoeForCausalLM"):
        get_target_class("MixtralForCausalLM")


def test_aux_ids_address_virtual_depth(hrm):
    _, path = hrm
    target = load_target(path, dtype="float32")
    with pytest.raises(ValueError, match=r"valid ids are 0\.\.11"):
        target(_ids(1, 8), aux_layer_ids=(1, 5, 12))
    with pytest.raises(ValueError, match=r"strictly increasing \(valid range 0\.\.11\)"):
        target.forward(target.params, _ids(1, 8), aux_layer_ids=(3, 2, 1))


def test_config_errors():
    llama_hf = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4).to_dict()
    base = {**llama_hf, "architectures": ["LoopedLlamaForCausalLM"]}
    with pytest.raises(ValueError, match="needs 'num_loops'"):
        LoopedLlamaConfig.from_hf(base)
    with pytest.raises(ValueError, match="num_loops=0 must be >= 1"):
        LoopedLlamaConfig.from_hf({**base, "num_loops": 0})
    with pytest.raises(ValueError, match=r"\[2, 5\) must satisfy 0 <= loop_start < loop_end <= num_hidden_layers=4"):
        LoopedLlamaConfig.from_hf({**base, "num_loops": 2, "loop_start": 2, "loop_end": 5})
    cfg = LoopedLlamaConfig.from_hf({**base, "num_loops": 3, "loop_start": 1, "loop_end": 3})
    assert cfg.num_virtual_layers == 8 and LoopedLlamaConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(ValueError, match=r"LoopedLlamaForCausalLM.*LoopedQwen3ForCausalLM.*'LoopedMistral"):
        LoopedLlamaConfig.from_hf({**base, "architectures": ["LoopedMistralForCausalLM"], "num_loops": 2})

    moe = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2).to_dict()
    moe["architectures"] = ["Qwen3MoeForCausalLM"]
    assert Qwen3MoeTargetConfig.from_hf(moe).num_experts == 4  # num_local_experts spelling
    with pytest.raises(ValueError, match="num_experts_per_tok=5 must be in 1..num_experts=4"):
        Qwen3MoeTargetConfig.from_hf({**moe, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match="use_sliding_window"):
        Qwen3MoeTargetConfig.from_hf({**moe, "use_sliding_window": True})
    with pytest.raises(ValueError, match="Qwen2-MoE"):
        Qwen3MoeTargetConfig.from_hf({**moe, "shared_expert_intermediate_size": 64})
    with pytest.raises(ValueError, match=r"mlp_only_layers \[7\] outside 0..3"):
        Qwen3MoeTargetConfig.from_hf({**moe, "mlp_only_layers": [7]})
    hrm = transformers.HrmTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, head_dim=8).to_dict()
    hrm["architectures"] = ["HrmTextForCausalLM"]
    with pytest.raises(ValueError, match="mlp_bias"):
        HrmTextTargetConfig.from_hf({**hrm, "mlp_bias": True})
    with pytest.raises(ValueError, match=r"num_hidden_layers=7 should be .* = 16"):
        HrmTextTargetConfig.from_hf({**hrm, "num_hidden_layers": 7})


def test_moe_loader_names_missing_expert(tmp_mod, moe_mixed):
    from safetensors.numpy import load_file, save_file

    _, path = moe_mixed
    broken = tmp_mod / "moe_missing_expert"
    broken.mkdir()
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.3.mlp.experts.6.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        (broken / "config.json").write_text(f.read())
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.3\.mlp\.experts\.6\.up_proj\.weight"):
        load_target(str(broken), dtype="float32")

"""Multimodal checkpoints read as their text targets (``specjax.targets.multimodal``) vs transformers'
ConditionalGeneration models (PyTorch, CPU, fp32) on tiny checkpoints with tiny vision towers.

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state (HF
``hidden_states[-1]``) and three aux states (aux id k = the output of the language model's layer k, read
with a forward hook; the last layer's is before the final norm), on a text-only input to the
multimodal model. Each folder is what transformers' save_pretrained writes (Qwen3.5:
``model.language_model.*`` + ``model.visual.*`` + ``lm_head.weight``; Gemma 3: ``language_model.model.*``
+ ``vision_tower.*`` + ``multi_modal_projector.*``, tied). Weights are redrawn far from HF's init
(parity._hf_weights.randomize_; the Qwen (1 + w) norms at scale 1 + 0.2 N, DeltaNet decay rates over
0.05..0.5, as in test_targets_qwen3_next).

Also: Qwen's multi-token-prediction tensors (``mtp.*``) are ignored and an unexpected tensor is refused
(nothing outside the explicit prefix lists is dropped); Qwen's published fused-expert layout (built here
from the per-expert folder; transformers reads it to the same logits) loads to the same params as the per-expert
folder; config.json files as published (google/gemma-3-4b-it's six-key text_config, Qwen3.5-35B-A3B's)
read as transformers' own config classes resolve them, and a draft for the Gemma 3 one exports through
the EAGLE-3 export and its validator.
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

from safetensors.numpy import load_file, save_file  # noqa: E402
from specjax_converters.target_facts import target_text_config  # noqa: E402

from specjax.targets import load_target  # noqa: E402
from specjax.targets import multimodal as mm  # noqa: E402  (registers the multimodal architectures)
from specjax.targets.gemma3 import Gemma3TargetConfig  # noqa: E402
from specjax.targets.qwen3_next import Qwen3NextTargetConfig  # noqa: E402
from specjax.targets.registry import get_target_class  # noqa: E402

from parity._hf_weights import randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
VOCAB = 128
AUX = (0, 1, 3)
LIN, FULL, SLIDE = "linear_attention", "full_attention", "sliding_attention"

_QWEN_TEXT = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
                  linear_num_key_heads=2, linear_num_value_heads=4, layer_types=[LIN, FULL, LIN, FULL],
                  max_position_embeddings=256,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                   "mrope_section": [1, 1, 0], "mrope_interleaved": True})
_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
_MOE = dict(moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=2)


def _qwen3_5():
    return transformers.Qwen3_5Config(text_config=dict(_QWEN_TEXT, intermediate_size=96), vision_config=_QWEN_VISION)


def _qwen3_5_moe():
    return transformers.Qwen3_5MoeConfig(text_config=dict(_QWEN_TEXT, **_MOE), vision_config=_QWEN_VISION)


def _gemma3():
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
                layer_types=[SLIDE, FULL, SLIDE, FULL], max_position_embeddings=256, pad_token_id=0,
                rope_parameters={FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                                 SLIDE: {"rope_type": "default", "rope_theta": 5000.0}})
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=4, vision_use_head=False)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


def _kimi_k25():
    text = dict(model_type="kimi_k2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=12, q_lora_rank=32,
                first_k_dense_replace=1, n_group=1, topk_group=1, num_experts_per_tok=2, max_position_embeddings=256,
                tie_word_embeddings=False)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48, patch_size=4)
    return transformers.Kimi_K25Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


CASES = {  # checkpoint architecture -> (tiny config, the specjax class that reads it, its text architecture)
    mm.QWEN3_5.architecture: (_qwen3_5, mm.Qwen3_5MultimodalTarget, "Qwen3_5ForCausalLM"),
    mm.QWEN3_5_MOE.architecture: (_qwen3_5_moe, mm.Qwen3_5MoeMultimodalTarget, "Qwen3_5MoeForCausalLM"),
    mm.GEMMA3.architecture: (_gemma3, mm.Gemma3MultimodalTarget, "Gemma3ForCausalLM"),
    mm.KIMI_K25.architecture: (_kimi_k25, mm.KimiK25MultimodalTarget, "DeepseekV3ForCausalLM"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (transformers model, its saved folder); each tiny model is built on first use."""
    built = {}

    def get(arch):
        if arch not in built:
            torch.manual_seed(0)
            model = getattr(transformers, arch)(CASES[arch][0]()).eval()
            model.config._attn_implementation = "eager"
            randomize_(model, seed=1)
            if arch == mm.KIMI_K25.architecture:  # DeepSeek's router correction bias: a buffer, drawn here
                g = torch.Generator().manual_seed(2)
                with torch.no_grad():
                    for name, buf in model.named_buffers():
                        if name.endswith("e_score_correction_bias"):
                            buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
            elif arch != mm.GEMMA3.architecture:
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if "language_model" in name and "norm" in name and "linear_attn.norm" not in name:
                            p.sub_(1.0)  # the (1 + w) norms: scale 1 + 0.2 N(0, 1)
                        elif name.endswith("A_log"):  # decay rates exp(A_log) in 0.05..0.5
                            p.copy_(torch.linspace(0.05, 0.5, p.numel()).log())
            built[arch] = (model, save_as_released(model, arch, str(tmp_path_factory.mktemp(arch))))
        return built[arch]

    return get


def _ids(seed=0, t=19):
    return np.random.RandomState(seed).randint(0, VOCAB, (2, t)).astype(np.int32)


def _hf_outputs(model, ids):
    """transformers' logits, final (post-norm) hidden and every language-model layer's output."""
    layers = []

    def keep(mod, args, out):
        layers.append(out[0] if isinstance(out, tuple) else out)

    hooks = [layer.register_forward_hook(keep) for layer in model.model.language_model.layers]
    try:
        with torch.no_grad():
            ref = model(input_ids=torch.tensor(ids, dtype=torch.long), output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return ref.logits.numpy(), ref.hidden_states[-1].numpy(), [x.numpy() for x in layers]


def _tensors(folder):
    return load_file(os.path.join(folder, "model.safetensors"))


def save_as_released(model, arch: str, path: str) -> str:
    """save_pretrained, then the tensor names of the published checkpoints: transformers 5.25 saves Kimi
    K2.5's decoder layers as language_model.model.blocks.* (its vision rename "blocks" -> "layers"
    reversed everywhere), where the release keeps layers.*. Returns the folder."""
    model.save_pretrained(path)
    if arch != mm.KIMI_K25.architecture:
        return path
    tensors = {n.replace("language_model.model.blocks.", "language_model.model.layers."): t
               for n, t in _tensors(path).items()}
    return _write_folder(path, path + "_released", tensors)


def _write_folder(src, dst, tensors):
    """A copy of checkpoint folder ``src`` at ``dst`` holding ``tensors`` (name -> array) as its weights."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", sorted(CASES))
def test_forward_matches_transformers(arch, checkpoints):
    model, path = checkpoints(arch)
    layout = CASES[arch][1].layout
    assert any(n.startswith(layout.ignored_prefixes[0]) for n in _tensors(path))  # the vision tower is there
    target = load_target(path, dtype="float32")
    assert type(target) is CASES[arch][1] and get_target_class(arch) is CASES[arch][1]
    assert (target.arch, target.config.architecture) == (arch, CASES[arch][2])
    ids = _ids()
    ref = _hf_outputs(model, ids)
    out = target(ids, aux_layer_ids=AUX)
    errs = {"logits": rel_err(out.logits, ref[0]), "final": rel_err(out.final_hidden, ref[1])}
    errs.update({f"aux{k}": rel_err(a, ref[2][k]) for k, a in zip(AUX, out.aux_hidden)})
    print(f"\n{arch}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert v <= REL_TOL, f"{arch} {k}: rel err {v:.3e} > {REL_TOL}"
    assert np.abs(ref[0]).max() > 1.0  # O(1) logits: the tolerance is not vacuous
    # what the draft export reads of the target: the text model's sizes
    tc = target_text_config(target.hf_config)
    assert (tc["vocab_size"], tc["hidden_size"], tc["num_hidden_layers"]) == (VOCAB, 64, 4)


def test_mtp_tensors_are_ignored(checkpoints, tmp_path):
    """Qwen's published files also hold the multi-token-prediction head (mtp.*, here with per-expert MoE
    tensors as Qwen3.5-35B-A3B's): the text target reads the same params without it."""
    arch = mm.QWEN3_5_MOE.architecture
    _, path = checkpoints(arch)
    tensors = _tensors(path)
    extra = {"mtp.fc.weight": np.ones((64, 128), np.float32), "mtp.norm.weight": np.ones(64, np.float32),
             "mtp.layers.0.mlp.experts.0.gate_proj.weight": np.ones((24, 64), np.float32),
             "mtp.layers.0.mlp.experts.gate_up_proj": np.ones((6, 48, 64), np.float32)}
    with_mtp = load_target(_write_folder(path, str(tmp_path / "mtp"), {**tensors, **extra}), dtype="float32")
    plain = load_target(path, dtype="float32")
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), with_mtp.params, plain.params)
    assert all(jax.tree.leaves(same))


@pytest.mark.parametrize("arch,extra", [
    (mm.QWEN3_5.architecture, "model.audio_tower.proj.weight"),  # a tower the layout does not list
    (mm.QWEN3_5.architecture, "model.language_model.layers.0.mlp.extra.weight"),  # not in the text model
    (mm.GEMMA3.architecture, "model.language_model.embed_tokens.weight"),  # another layout's text prefix
])
def test_unexpected_tensor_is_refused(arch, extra, checkpoints, tmp_path):
    _, path = checkpoints(arch)
    folder = _write_folder(path, str(tmp_path / "extra"), {**_tensors(path), extra: np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensors: " + extra.replace(".", r"\.")):
        load_target(folder, dtype="float32")


def test_fused_experts_load_as_the_per_expert_ones(checkpoints, tmp_path):
    """Qwen's published Qwen3.5-MoE layout: each layer's experts as one gate_up_proj [E, 2F, D] (gate rows
    first) and one down_proj [E, D, F], built here from the per-expert folder. transformers reads it to the
    same logits (the layout is the one it reads); specjax loads it to the same params as the per-expert
    folder."""
    arch = mm.QWEN3_5_MOE.architecture
    model, path = checkpoints(arch)
    tensors = _tensors(path)
    fused = {name: t for name, t in tensors.items() if ".mlp.experts." not in name}
    E, F, L = _MOE["num_experts"], _MOE["moe_intermediate_size"], _QWEN_TEXT["num_hidden_layers"]
    for i in range(L):
        p = f"model.language_model.layers.{i}.mlp.experts."
        gate, up, down = ([tensors[f"{p}{e}.{w}.weight"] for e in range(E)]
                          for w in ("gate_proj", "up_proj", "down_proj"))
        fused[p + "gate_up_proj"] = np.concatenate([np.stack(gate), np.stack(up)], axis=1)
        fused[p + "down_proj"] = np.stack(down)
    folder = _write_folder(path, str(tmp_path / "fused"), fused)
    assert fused["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 2 * F, 64)

    ids = _ids(seed=1, t=7)
    hf_fused = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
        got = hf_fused(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert rel_err(got, want) <= REL_TOL

    ours, per_expert = load_target(folder, dtype="float32"), load_target(path, dtype="float32")
    flat = dict(jax.tree_util.tree_leaves_with_path(per_expert.params))
    for key, leaf in jax.tree_util.tree_leaves_with_path(ours.params):
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(flat[key]), err_msg=jax.tree_util.keystr(key))
    assert len(flat) == len(jax.tree_util.tree_leaves(ours.params))
    assert rel_err(ours(jnp.asarray(ids, jnp.int32)).logits, want) <= REL_TOL


# google/gemma-3-4b-it's config.json as published (transformers 4.50): text_config names six keys
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3", "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}

# Qwen/Qwen3.5-35B-A3B's text model (its config.json's text_config; vision_config left at the defaults)
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_moe_text", "attention_bias": False, "attn_output_gate": True, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 2048, "full_attention_interval": 4,
        "layer_types": [FULL if (i + 1) % 4 == 0 else LIN for i in range(40)], "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "max_position_embeddings": 262144, "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16,
        "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "vocab_size": 248320,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
}


@pytest.mark.parametrize("published,config_class,text_class", [
    (GEMMA3_4B, "Gemma3Config", Gemma3TargetConfig),
    (QWEN3_5_35B_A3B, "Qwen3_5MoeConfig", Qwen3NextTargetConfig),
])
def test_published_configs_read_as_transformers_resolves_them(published, config_class, text_class):
    """The target config of a published config.json equals the text family's reading of the text config
    transformers builds from the same file (its defaults fill what the file omits); the target's
    hf_config carries the sizes the draft export reads."""
    cls = get_target_class(published)
    ours = cls.config_from_hf(published)
    text = getattr(transformers, config_class)(**published).text_config.to_dict()
    text_arch = mm.GEMMA3.text_architecture if text_class is Gemma3TargetConfig else mm.QWEN3_5_MOE.text_architecture
    assert ours == text_class.from_hf({**text, "architectures": [text_arch]})
    tc = target_text_config(cls(ours, published, None).hf_config)
    assert (tc["vocab_size"], tc["num_hidden_layers"]) == (ours.vocab_size, ours.num_hidden_layers)
    if text_class is Gemma3TargetConfig:  # the published file names neither: transformers' defaults
        assert (ours.num_attention_heads, ours.num_key_value_heads, ours.head_dim, ours.vocab_size) == (8, 4, 256,
                                                                                                          262208)


def _export_head(hf: dict, tmp_path) -> tuple[object, dict]:
    """(target, the head's config.json) of a random EAGLE-3 draft for the config ``hf``, exported through
    specjax.export, whose validator runs on the way out."""
    from specjax.config import load_config
    from specjax.drafts.families import family_of
    from specjax.drafts.vocab import DraftVocab
    from specjax.export import export_from_state
    from specjax.train.setup import abstract_target, make_draft_config, resolve_aux_ids

    (tmp_path / "target").mkdir(parents=True)
    (tmp_path / "target" / "config.json").write_text(json.dumps(hf))
    (tmp_path / "run.yaml").write_text(f"target:\n  path: {tmp_path / 'target'}\n  dtype: bfloat16\n"
                                       "draft:\n  draft_vocab_size: 64\n")
    run = load_config(str(tmp_path / "run.yaml"), [])
    target = abstract_target(run)
    draft_cfg = make_draft_config(run, target, resolve_aux_ids(run, target))
    params = family_of(draft_cfg).init_params(draft_cfg, jax.random.key(0))
    vocab = DraftVocab.from_ids(range(64), target.config.vocab_size)
    out = export_from_state(jax.tree.map(np.asarray, params), draft_cfg, vocab, target.hf_config,
                            str(tmp_path / "head"))
    assert out == str(tmp_path / "head")
    return target, json.loads((tmp_path / "head" / "config.json").read_text())


def test_draft_export_of_a_published_gemma3_layout(tmp_path):
    """A draft for google/gemma-3-4b-it's config.json layout (shrunk to 6 layers of width 256, the
    six-key text_config kept) exports, and the export's own validator passes it: the head's config.json
    has the text model's vocabulary (Gemma3TextConfig's default, absent from the file), hidden size and
    RoPE (the global layers' base 1e6, not the generic 10000, with the file's linear x8)."""
    hf = json.loads(json.dumps(GEMMA3_4B))
    hf["text_config"].update(hidden_size=256, intermediate_size=512, num_hidden_layers=6)
    target, head = _export_head(hf, tmp_path)
    assert type(target) is mm.Gemma3MultimodalTarget and target.arch == mm.GEMMA3.architecture
    assert (head["vocab_size"], head["target_hidden_size"]) == (262208, 256)
    assert head["rope_parameters"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}


def test_draft_export_of_transformers5_gemma3_and_qwen3_5_layouts(tmp_path):
    """Two layouts whose export the validator once refused: Gemma 3 saved by transformers 5 (RoPE per
    layer type: the draft copies the full-attention layers'), and Qwen3.5-35B-A3B's (shrunk; M-RoPE
    sections, which rotate text as plain RoPE, and partial rotary 0.25, written in both RoPE layouts)."""
    gemma = json.loads(_gemma3().to_json_string())
    assert set(gemma["text_config"]["rope_parameters"]) == {"full_attention", "sliding_attention"}
    _, head = _export_head(gemma, tmp_path / "gemma")
    full = gemma["text_config"]["rope_parameters"]["full_attention"]
    assert head["rope_parameters"]["rope_theta"] == full["rope_theta"]
    qwen = json.loads(json.dumps(QWEN3_5_35B_A3B))
    tc = qwen["text_config"]
    tc.update(hidden_size=64, num_hidden_layers=4, layer_types=tc["layer_types"][:4], num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              head_dim=16, vocab_size=4096)
    _, head = _export_head(qwen, tmp_path / "qwen")
    assert head["rope_parameters"] == {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    assert (head["rope_theta"], head["rope_scaling"], head["partial_rotary_factor"]) == (10_000_000.0, None, 0.25)


def test_config_refusals():
    base = {"architectures": [mm.QWEN3_5.architecture], "model_type": "qwen3_5",
            "text_config": _qwen3_5().text_config.to_dict()}
    cls = mm.Qwen3_5MultimodalTarget
    assert cls.config_from_hf(base).tie_word_embeddings is False
    with pytest.raises(ValueError, match="no text_config"):
        cls.config_from_hf({k: v for k, v in base.items() if k != "text_config"})
    with pytest.raises(ValueError, match="tie_word_embeddings=True but text_config.tie_word_embeddings=False"):
        cls.config_from_hf({**base, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="got a config of architecture 'Gemma3ForConditionalGeneration'"):
        cls.config_from_hf({**base, "architectures": [mm.GEMMA3.architecture]})
    # the top-level flag decides the tying when text_config has none
    untied_text = {k: v for k, v in base["text_config"].items() if k != "tie_word_embeddings"}
    assert cls.config_from_hf({**base, "text_config": untied_text, "tie_word_embeddings": True}).tie_word_embeddings

"""`python -m specjax.launch --compile-only` for every registered target architecture.

Each case writes only a tiny config.json (no weights, no tokenizer, no data) built with transformers'
config classes (the looped Llama / Qwen3 ones: a Llama / Qwen3 config plus num_loops), then lowers
and compiles the real train step on a (data 2, fsdp 2, tensor 2) mesh of the 8 fake CPU devices and
checks the printed report. The abstract target params come from the architecture's weight map
(specjax.targets.abstract.abstract_params), so no architecture needs an ``init``. CASES must list the
registry exactly: a new architecture fails test_cases_cover_the_registry until it has a case here.
Also: specjax.shapes builds the draft (fc_norm / norm_output, the hybrid KV-heads check) and
the target's kernel choices with the training loop's own functions.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

pytest.importorskip("torch")  # the parity modules below importorskip torch too
transformers = pytest.importorskip("transformers")

# the tiny configs of the parity tests (tests/parity has no __init__.py; pytest imports its
# modules by basename, so this is the same module object pytest itself uses)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))
import test_targets_deepseek_v3 as deepseek_parity  # noqa: E402
import test_targets_deepseek_v32 as deepseek_v32_parity  # noqa: E402
import test_targets_gemma4 as gemma4_parity  # noqa: E402
import test_targets_glm4_moe as glm4_moe_parity  # noqa: E402
import test_targets_hf as hf_parity  # noqa: E402
import test_targets_kimi_linear as kimi_linear_parity  # noqa: E402
import test_targets_minimax_m2 as minimax_parity  # noqa: E402
import test_targets_mistral4 as mistral4_parity  # noqa: E402
import test_targets_multimodal as multimodal_parity  # noqa: E402
import test_targets_moe_looped as moe_looped_parity  # noqa: E402
import test_targets_nemotron_h as nemotron_parity  # noqa: E402
import test_targets_qwen3_next as qwen3_next_parity  # noqa: E402

from specjax.launch import main  # noqa: E402
from specjax.targets.registry import ARCHITECTURES  # noqa: E402


def _moe():
    return transformers.Qwen3MoeConfig(
        vocab_size=moe_looped_parity.VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, max_position_embeddings=4096,
        **moe_looped_parity.MOE_VARIANTS["mixed"])  # MoE and dense layers


def _hrm():
    return transformers.HrmTextConfig(vocab_size=moe_looped_parity.VOCAB, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, head_dim=16, H_cycles=2,
                                      L_cycles=2, max_position_embeddings=4096)


def _mistral():
    return transformers.MistralConfig(vocab_size=moe_looped_parity.VOCAB, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      max_position_embeddings=4096, sliding_window=None)


def _phi3():  # partial rotary, GQA (fused qkv_proj / gate_up_proj on disk); no LongRoPE: EAGLE-3 drafts lack it
    return transformers.Phi3Config(vocab_size=moe_looped_parity.VOCAB, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, partial_rotary_factor=0.5, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2)


def _gemma3():  # sliding (window 8 < seq_length 32) and global layers, each with its own RoPE
    return transformers.Gemma3TextConfig(vocab_size=moe_looped_parity.VOCAB, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, sliding_window=8, max_position_embeddings=4096,
                                         layer_types=["sliding_attention", "full_attention"] * 2)


def _gpt_oss():  # sinks, biases, sliding (window 8 < seq_length 32) and full layers, biased experts
    return transformers.GptOssConfig(vocab_size=moe_looped_parity.VOCAB, hidden_size=64, intermediate_size=32,
                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                                     max_position_embeddings=4096,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


# architecture -> (transformers config factory, extra config.json keys)
CASES = {
    "LlamaForCausalLM": (hf_parity._llama_cfg, {}),
    "Qwen3ForCausalLM": (hf_parity._qwen3_cfg, {}),
    "Qwen3MoeForCausalLM": (_moe, {}),
    "LoopedLlamaForCausalLM": (hf_parity._llama_cfg, {"num_loops": 2}),
    "LoopedQwen3ForCausalLM": (hf_parity._qwen3_cfg, {"num_loops": 3, "loop_start": 1, "loop_end": 3}),
    "HrmTextForCausalLM": (_hrm, {}),
    "NemotronHForCausalLM": (nemotron_parity._hf_config, {}),  # Mamba-2, attention, MoE and MLP blocks
    "MistralForCausalLM": (_mistral, {}),
    "Phi3ForCausalLM": (_phi3, {}),
    "Gemma3ForCausalLM": (_gemma3, {}),
    "GptOssForCausalLM": (_gpt_oss, {}),
    "DeepseekV3ForCausalLM": (lambda: deepseek_parity._hf_config("lora"), {}),  # MLA + sigmoid-routed MoE
    # MLA + the lightning indexer (top-8 of up to 32 keys: the sparse mask is built); GLM-5's: interleaved indexer
    # RoPE and a layer that reuses the previous layer's choice
    "DeepseekV32ForCausalLM": (lambda: deepseek_v32_parity._hf_config("v32"), {}),
    "GlmMoeDsaForCausalLM": (lambda: deepseek_v32_parity._hf_config("glm"), {}),
    "Glm4MoeForCausalLM": (lambda: glm4_moe_parity._hf_config("qk_norm"), {}),  # GQA + DeepSeek's MoE
    "Glm4MoeLiteForCausalLM": (lambda: glm4_moe_parity._hf_config("lite"), {}),  # MLA + DeepSeek's MoE
    # full-width q/k norm over tensor-sharded heads, partial RoPE, sigmoid-routed experts
    "MiniMaxM2ForCausalLM": (lambda: transformers.MiniMaxM2Config(**minimax_parity.COMMON,
                                                                  **minimax_parity.VARIANTS["published"]), {}),
    # Gated DeltaNet + gated attention; MoE with a gated shared expert and a dense layer / dense / all-MoE
    "Qwen3NextForCausalLM": (lambda: qwen3_next_parity._hf_config("Qwen3NextForCausalLM"), {}),
    "Qwen3_5ForCausalLM": (lambda: qwen3_next_parity._hf_config("Qwen3_5ForCausalLM"), {}),
    "Qwen3_5MoeForCausalLM": (lambda: qwen3_next_parity._hf_config("Qwen3_5MoeForCausalLM"), {}),
    # per-layer inputs, shared KV, k = v full layers with their own head shape, soft-capping
    "Gemma4ForCausalLM": (lambda: transformers.Gemma4TextConfig(**gemma4_parity.COMMON,
                                                                **gemma4_parity.VARIANTS["shared_ple"]), {}),
    # MLA with Llama-4 query scaling (YaRN, interleaved RoPE) + softmax-routed grouped MoE, a dense layer
    "Mistral4ForCausalLM": (lambda: mistral4_parity._hf_config("scaled"), {}),
    # Kimi Delta Attention (per-key-channel gated delta rule) + MLA without RoPE; DeepSeek's MoE after a dense layer
    "KimiLinearForCausalLM": (lambda: kimi_linear_parity._hf_config("release"), {}),
    # multimodal checkpoints read as their text targets
    "Qwen3_5ForConditionalGeneration": (multimodal_parity._qwen3_5, {}),
    "Qwen3_5MoeForConditionalGeneration": (multimodal_parity._qwen3_5_moe, {}),
    "Gemma3ForConditionalGeneration": (multimodal_parity._gemma3, {}),
    "Kimi_K25ForConditionalGeneration": (multimodal_parity._kimi_k25, {}),
}


def _tiny_run(tmp_path, arch, yaml_extra=""):
    """A run config for a folder holding only the case's config.json (no weights, no tokenizer)."""
    make_config, extra = CASES[arch]
    hf = json.loads(make_config().to_json_string())
    hf.update(extra, architectures=[arch])
    tdir = tmp_path / arch
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(hf))
    cfg = tmp_path / f"{arch}.yaml"
    cfg.write_text(f"target:\n  path: {tdir}\n  dtype: bfloat16\ndraft:\n  draft_vocab_size: 64\n{yaml_extra}")
    return str(cfg)


# A multimodal checkpoint compiles its text family's step (compiled above under its own name); its config
# and weights are read in tests/parity/test_targets_multimodal.py. Its compile runs under -m slow.
MULTIMODAL_ALIASES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                      "Gemma3ForConditionalGeneration", "Kimi_K25ForConditionalGeneration")


# transformers 5.25's AutoModelForCausalLM does not list these (their own class is used)
NOT_IN_AUTO_MAPPING = ("Mistral4ForCausalLM",)


# The XLA compile of the sharded step (memory and FLOP analysis) in the default run: one architecture per
# kind of layer stack (dense GQA, Mamba-2 hybrid, MLA + sigmoid MoE, Gated DeltaNet hybrid + softmax MoE
# with a shared expert, sinks + sliding windows, shared-KV / per-layer inputs, a looped stack: HRM's H/L
# cycles). Every architecture lowers the same sharded step in the default run
# (test_training_compile_only_and_shapes_build_the_same_draft calls lower_train_step on each), so a family
# outside this list loses only XLA's compile of it there; the compiles of the rest run under -m slow.
COMPILE_REPRESENTATIVES = ("LlamaForCausalLM", "NemotronHForCausalLM", "DeepseekV3ForCausalLM",
                           "Qwen3_5MoeForCausalLM", "GptOssForCausalLM", "Gemma4ForCausalLM", "HrmTextForCausalLM")


def is_slow_case(test_name: str, params: dict) -> bool:
    """tests/conftest.py marks these cases slow."""
    arch = params.get("arch")
    return arch in MULTIMODAL_ALIASES or (test_name == "test_compile_only" and arch not in COMPILE_REPRESENTATIVES)


def test_cases_cover_the_registry():
    assert set(CASES) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_compile_only(arch, tmp_path, capsys):
    cfg = _tiny_run(tmp_path, arch, "  ttt_steps: 2\ndata:\n  seq_length: 32\n  batch_size: 8\n"
                    "parallelism:\n  data: 2\n  fsdp: 2\n  tensor: 2\n")
    assert main(["--config", cfg, "--compile-only"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["architecture"] == arch and report["devices"] == 8 and report["batch"] == [8, 32]
    assert report["target_params"] > 0 and report["draft_params"] > 0
    assert report["flops_per_step"] > 0
    assert report["temp_size_in_bytes"] > 0 and report["argument_size_in_bytes"] > 0
    assert report["peak_estimate_bytes_per_device"] > 0
    assert "XLA flops per step" in out and "per device" in out


def test_shapes_builds_draft_and_target_like_the_loop(tmp_path, capsys):
    """specjax.shapes (and --compile-only) build the target with the configured kernel
    choices and the draft with the loop's make_draft_config: fc_norm / norm_output count, and the
    hybrid KV-heads check refuses what training would refuse (no compile: cheap)."""
    from specjax.config import load_config
    from specjax import shapes
    from specjax.train.setup import abstract_target
    from specjax.train.setup import make_draft_config, resolve_aux_ids

    moe = _tiny_run(tmp_path, "Qwen3MoeForCausalLM")
    plain = shapes.shape_report(moe, compile_step=False)
    normed = shapes.shape_report(moe, ["draft.fc_norm=true", "draft.norm_output=true"], compile_step=False)
    run = load_config(moe, ["draft.fc_norm=true", "draft.norm_output=true", "kernels.moe=reference"])
    target = abstract_target(run)
    assert target.config.kernels.moe == "reference"
    dcfg = make_draft_config(run, target, resolve_aux_ids(run, target))
    assert dcfg.fc_norm and dcfg.norm_output
    # the fc RMSNorms (one per aux chunk) add 3 * hidden draft params
    assert normed["draft_params"] - plain["draft_params"] == 3 * target.config.hidden_size

    nemotron = _tiny_run(tmp_path, "NemotronHForCausalLM", "  num_key_value_heads: 4\n")
    assert shapes.main(["--config", nemotron, "--no-compile"]) == 2
    assert "draft.num_key_value_heads=2" in capsys.readouterr().err


@pytest.mark.parametrize("arch", sorted(CASES))
def test_training_compile_only_and_shapes_build_the_same_draft(arch, tmp_path):
    """For every architecture, from one run config with fc_norm and norm_output on, on test_compile_only's
    data x fsdp x tensor mesh (so every architecture's sharded train step lowers here): the draft config
    of the training path (build_target reads real HF-saved weights, then build_run_setup, as
    specjax.train.loop does), of --compile-only (specjax.train.aot.lower_train_step on abstract params)
    and of specjax.shapes are the same, EAGLE-3.1 flags included."""
    import dataclasses

    import torch

    from specjax.config import load_config
    from specjax import shapes
    from specjax.train.aot import lower_train_step
    from specjax.train.setup import build_run_setup, build_target, make_mesh

    make_config, extra = CASES[arch]
    torch.manual_seed(0)
    tdir = tmp_path / arch
    if arch in MULTIMODAL_ALIASES:  # the multimodal class itself, saved with the release's tensor names
        tdir = pathlib.Path(multimodal_parity.save_as_released(getattr(transformers, arch)(make_config()), arch,
                                                                str(tdir)))
    elif arch in NOT_IN_AUTO_MAPPING:
        getattr(transformers, arch)(make_config()).save_pretrained(str(tdir))
    else:
        transformers.AutoModelForCausalLM.from_config(make_config()).save_pretrained(str(tdir))
    hf = json.loads((tdir / "config.json").read_text())
    hf.update(extra, architectures=[arch])
    (tdir / "config.json").write_text(json.dumps(hf))
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(f"target:\n  path: {tdir}\n  dtype: float32\ndraft:\n  draft_vocab_size: 64\n"
                        "  ttt_steps: 2\n  fc_norm: true\n  norm_output: true\n"
                        "data:\n  seq_length: 32\n  batch_size: 8\n"
                        "parallelism:\n  data: 2\n  fsdp: 2\n  tensor: 2\n")  # test_compile_only's mesh
    run = load_config(str(cfg_path))
    mesh = make_mesh(run)

    trained = build_run_setup(run, build_target(run, mesh), mesh).draft_config
    compiled = lower_train_step(run, mesh).draft_config
    reported = shapes.shape_report(str(cfg_path), compile_step=False)["draft_config"]
    assert trained.fc_norm and trained.norm_output
    assert trained.draft_vocab_size == 64 and trained.num_aux == 3
    assert compiled == trained
    assert reported == dataclasses.asdict(trained)

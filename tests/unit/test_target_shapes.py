"""configs/qwen3_30b_a3b_eagle3.yaml and configs/looped_eagle3.yaml: full-size shapes and a memory
estimate without allocating, a CLI run, and a reduced-size build that compiles and runs.

Full-size facts checked: Qwen3-30B-A3B has 30.53 B parameters and 3.35 B active per token (Qwen's
model card: 30.5 B total, 3.3 B activated), 48 layers x 128 experts x [2048, 768] expert kernels;
the looped config has 22 physical layers, 44 virtual ones and taps [2, 22, 40] (exported as [3, 23, 41]).
"""
from __future__ import annotations

import json
import resource

import jax
import numpy as np
import pytest

from specjax import shapes
from specjax.targets import abstract
from specjax.targets.loading import read_hf_config

QWEN = "configs/qwen3_30b_a3b_eagle3.yaml"
LOOPED = "configs/looped_eagle3.yaml"


@pytest.fixture(autouse=True)
def _at_repo_root(repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)  # the configs name target folders relative to the repo root


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def test_full_size_shapes_without_allocating():
    rss0 = _rss_gib()
    q = shapes.shape_report(QWEN, compile_step=False)
    lp = shapes.shape_report(LOOPED, compile_step=False)
    # 57 GiB + 5 GiB of bf16 weights were described, not allocated
    assert _rss_gib() - rss0 < 1.0

    assert q["architecture"] == "Qwen3MoeForCausalLM" and q["num_layers"] == 48
    assert q["aux_layer_ids"] == [1, 23, 44]
    leaves = q["leaves"]
    assert leaves["moe_layers/experts/gate_proj/kernel"] == [48, 128, 2048, 768]
    assert leaves["moe_layers/experts/down_proj/kernel"] == [48, 128, 768, 2048]
    assert leaves["moe_layers/router/kernel"] == [48, 2048, 128]
    assert leaves["layers/self_attn/q_proj/kernel"] == [48, 2048, 4096]  # 32 heads x head_dim 128
    assert leaves["layers/self_attn/k_proj/kernel"] == [48, 2048, 512]
    assert "mlp_layers/gate_proj/kernel" not in leaves  # no dense-MLP layers
    assert abs(q["target_params"] / 1e9 - 30.53) < 0.01
    assert abs(q["target_active_params_per_token"] / 1e9 - 3.35) < 0.01
    assert q["target_param_bytes"] == 2 * q["target_params"]  # bf16
    # draft: fc 3H->H, one decoder layer with the target's attention shape and intermediate 6144,
    # lm_head over the 32k draft vocab; fp32 params + grads + 2 AdamW moments
    assert 140e6 < q["draft_params"] < 150e6
    assert q["draft_train_state_bytes"] == 16 * q["draft_params"]
    assert q["estimate_bytes"] == q["target_param_bytes"] + q["draft_train_state_bytes"]

    assert lp["architecture"] == "LoopedLlamaForCausalLM"
    assert (lp["num_hidden_layers"], lp["num_layers"], lp["aux_layer_ids"]) == (22, 44, [2, 22, 40])
    assert lp["leaves"]["layers/self_attn/q_proj/kernel"] == [22, 2560, 2560]  # weights of 22 layers only
    assert lp["leaves"]["embed_tokens/embedding"] == [166144, 2560]

    # the abstract tree really is shapes only
    hf = read_hf_config("configs/targets/qwen3_30b_a3b")
    target = abstract.make_target(hf)
    tree = abstract.abstract_params(type(target), target.config, "bfloat16")
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def test_cli(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert shapes.main(["--config", LOOPED, "--no-compile", "--show-leaves", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "22 layers, 44 virtual" in text and "[2, 22, 40]" in text and "layers/mlp/down_proj/kernel" in text
    assert json.loads(out.read_text())["num_layers"] == 44
    # bad aux ids for the virtual depth: a clear error, exit code 2
    assert shapes.main(["--config", LOOPED, "--no-compile", "target.aux_layer_ids=[3,23,44]"]) == 2
    assert "valid ids are 0..43" in capsys.readouterr().err
    assert shapes.main(["--config", QWEN, "--no-compile", "target.path=/nonexistent"]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize("config_file", [QWEN, LOOPED])
def test_reduced_size_builds_compiles_and_runs(config_file, tmp_path):
    """Same architecture and depth (so the YAML's aux taps stay valid), tiny widths, random weights;
    the train-step memory estimate compiles from abstract inputs on the CPU."""
    from specjax.config import load_config

    run = load_config(config_file)
    hf = abstract.reduced_hf_config(read_hf_config(run.target.path), vocab_size=512)
    folder = tmp_path / "reduced"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf))
    target = abstract.make_target(hf)
    target.params = abstract.random_params(type(target), target.config, seed=0)
    aux = tuple(run.target.aux_layer_ids)
    ids = np.random.RandomState(0).randint(0, 512, (2, 16)).astype(np.int32)
    out = target(ids, aux_layer_ids=aux)
    assert out.logits.shape == (2, 16, 512) and len(out.aux_hidden) == 3
    assert all(np.isfinite(np.asarray(a)).all() for a in (out.logits, *out.aux_hidden))

    if config_file == LOOPED:  # one compiled estimate (the step compile dominates this file's time)
        r = shapes.shape_report(config_file, [f"target.path={folder}", "draft.ttt_steps=1",
                                              "draft.draft_vocab_size=128"], seq=32)
        mem = r["compiled_step"]
        assert mem["temp_bytes"] > 0 and mem["compiled_dtype"] == "float32"
        assert r["estimate_bytes"] == r["target_param_bytes"] + r["draft_train_state_bytes"] + mem["temp_bytes"]
        assert "step temps" in shapes.format_report(r)


def test_gpt_oss_120b_fits_one_h200_as_stored():
    """configs/gpt_oss_120b_eagle3.yaml: 116.83 B parameters (OpenAI's model card) kept as published,
    MXFP4 experts (4.25 bits a weight: 4-bit values plus one uint8 scale per 32) and bf16 for the rest:
    about 61 GiB of weights, not the 218 GiB of a bf16 copy, so the target fits one H200 (141 GB)
    beside the draft's training state. The step's temporaries are measured on the GPU (benchmarks)."""
    r = shapes.shape_report("configs/gpt_oss_120b_eagle3.yaml", compile_step=False)
    assert r["architecture"] == "GptOssForCausalLM" and r["aux_layer_ids"] == [1, 17, 32]
    assert r["target_params"] == 116_829_156_672
    leaves = r["leaves"]
    assert leaves["layers/experts/gate_up_proj/blocks"] == [36, 128, 5760, 90, 16]
    assert leaves["layers/experts/down_proj/scales"] == [36, 128, 2880, 90]
    experts = 36 * 128 * 3 * 2880 * 2880  # routed expert weights
    assert r["target_param_bytes"] < 2 * (r["target_params"] - experts) + experts * 4.25 / 8 + 2**30
    assert 60 * 2**30 < r["target_param_bytes"] < 62 * 2**30

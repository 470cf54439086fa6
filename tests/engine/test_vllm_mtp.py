"""Engine tier, MTP: vLLM 0.32's own MTP model classes load specjax's MTP exports (vllm_mtp_load.py
runs under SPECJAX_VLLM_PYTHON, on the CPU).

For a tiny DeepSeek-V3 (MLA + DeepSeek MoE), GLM-4.5 (GQA with biases and q/k norm + the same MoE) and
Qwen3-Next (gated attention + MoE with a gated shared expert) target config, a random MTP layer is
exported with the family's exporter; vLLM rewrites the config as for `"method": "mtp"` (DeepSeekMTPModel,
Glm4MoeMTPModel, Qwen3NextMTP, n_predict 1), builds that class and runs its own load_weights over the
file: every parameter is loaded except the embedding and the lm_head (shared_head.head for DeepSeek /
GLM), which vLLM's proposer shares with the target for every MTP draft (llm_base_proposer:
"Detected MTP model. Sharing target model ..."), and every tensor vLLM stores unfused holds the file's
values exactly (the fused qkv / gate_up / expert stacks are checked through load_weights' own success).

Qwen3.5 / Qwen3.5-MoE are not loaded here: vLLM's qwen3_5 module imports qwen3_vl, which needs
torchvision, absent from the engine venv. Their mtp.* names are Qwen3-Next's (the same
Qwen3NextMultiTokenPredictor layout: fc, pre_fc_norm_*, layers.0, norm), and their config rewrite
(mtp_num_hidden_layers -> Qwen3_5MTP / Qwen3_5MoeMTP) is checked without building the model.
Running vLLM's MTP forward on the CPU needs its attention metadata; this tier does not do it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from _engine_harness import engine_marks, vllm_env, vllm_python

pytestmark = engine_marks()
transformers = pytest.importorskip("transformers")


def hf_config(kind):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))
    from test_mtp import deepseek_like_hf, qwen_hf

    if kind == "qwen3_next":
        hf = transformers.Qwen3NextConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
        arch = "Qwen3NextForCausalLM"
    elif kind == "qwen3_5_moe":
        hf, arch = qwen_hf(True)
    else:
        hf, arch = deepseek_like_hf(kind)
    conf = hf.to_dict()
    conf["architectures"] = [arch]
    if kind == "deepseek_v3":  # the published configs' router keys (vLLM builds the correction bias for noaux_tc)
        conf.update(topk_method="noaux_tc", scoring_func="sigmoid")
    return conf


def export(kind, tmp_path):
    from specjax.drafts import mtp
    from specjax.drafts.families import family_for_type
    from specjax.targets import get_target_class

    conf = hf_config(kind)
    cfg = mtp.MtpConfig(target=get_target_class(conf).config_class.from_hf(conf))
    params = mtp.init_params(cfg, jax.random.key(1), std=0.1)
    return family_for_type("mtp").export(params, cfg, None, conf, tmp_path / kind, dtype="float32"), cfg


@pytest.mark.parametrize("kind,vllm_arch,shared", [
    ("deepseek_v3", "DeepSeekMTPModel", {"model.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}),
    ("glm4_moe", "Glm4MoeMTPModel", {"model.embed_tokens.weight", "model.layers.2.shared_head.head.weight"}),
    ("qwen3_next", "Qwen3NextMTP", {"model.embed_tokens.weight", "lm_head.weight"}),
])
def test_vllm_loads_the_mtp_export_with_its_own_loader(kind, vllm_arch, shared, tmp_path, tiny_target):
    head, cfg = export(kind, tmp_path)
    out = tmp_path / "facts.json"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_mtp_load.py")
    proc = subprocess.run([vllm_python(), script, head, tiny_target, str(out)], env=vllm_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    facts = json.load(open(out))
    assert facts["architectures"] == [vllm_arch] and facts["n_predict"] == 1, facts
    assert set(facts["not_loaded"]) == shared, facts["not_loaded"]
    equal = facts["unfused_equal"]
    own = [n for n in equal if n.split(".")[-2] in ("enorm", "hnorm", "eh_proj", "norm", "fc", "pre_fc_norm_hidden",
                                                      "pre_fc_norm_embedding")]
    assert len(own) >= 4 and all(equal.values()), equal


def test_vllm_rewrites_a_qwen3_5_export_config_for_mtp(tmp_path):
    head, _ = export("qwen3_5_moe", tmp_path)
    code = ("import json, sys; from transformers import AutoConfig; from vllm.config import SpeculativeConfig; "
            "c = SpeculativeConfig.hf_config_override(AutoConfig.from_pretrained(sys.argv[1])); "
            "print(json.dumps({'architectures': c.architectures, 'n_predict': c.n_predict}))")
    proc = subprocess.run([vllm_python(), "-c", code, head], env=vllm_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"architectures": ["Qwen3_5MoeMTP"], "n_predict": 1}

"""Each target family reads and writes config.json through one HF key table (targets/hf_keys.py).

For every family: ``from_hf(to_hf(cfg)) == cfg``; every key of its table is written; and transformers'
own config class reads ``to_hf()`` into a config that ``from_hf`` maps back to the same target config,
so the dict is the one transformers would write, not just one we can read back. Values are chosen
away from every default so a key dropped on either side changes the result.
"""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from specjax.layers.rope import RopeSpec  # noqa: E402
from specjax.targets import gemma3, gpt_oss, hf_keys, hrm_text, llama, looped, mistral, nemotron_h, phi3, qwen3_moe, qwen3_next  # noqa: E402

ROPE = {"rope_type": "default", "rope_theta": 12345.0}


def _llama():
    return transformers.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                    num_attention_heads=6, num_key_value_heads=2, head_dim=12, rms_norm_eps=3e-6,
                                    tie_word_embeddings=True, max_position_embeddings=777, rope_parameters=ROPE)


def _qwen3_moe():
    return transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=6,
                                       num_attention_heads=6, num_key_value_heads=3, head_dim=10, rms_norm_eps=2e-6,
                                       max_position_embeddings=999, moe_intermediate_size=24, num_experts=6,
                                       num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2,
                                       mlp_only_layers=[1], tie_word_embeddings=True, rope_parameters=ROPE)


def _hrm():
    return transformers.HrmTextConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, head_dim=12, H_cycles=3, L_cycles=2, rms_norm_eps=4e-6,
                                      max_position_embeddings=555, tie_word_embeddings=True,
                                      rope_parameters=ROPE)


def _nemotron():
    return transformers.NemotronHConfig(
        vocab_size=96, hidden_size=64, layers_block_type=[nemotron_h.MAMBA, nemotron_h.MOE, nemotron_h.ATTENTION],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=3, chunk_size=8, use_conv_bias=False,
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
        n_group=2, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.5, layer_norm_epsilon=3e-5,
        max_position_embeddings=666, moe_latent_size=32, mlp_hidden_act="relu", time_step_limit=(0.01, 5.0))


def _mistral():
    return transformers.MistralConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=12, rms_norm_eps=3e-6,
                                      tie_word_embeddings=True, max_position_embeddings=777, sliding_window=None,
                                      rope_parameters=ROPE)


def _phi3():
    return transformers.Phi3Config(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=3e-6,
                                   tie_word_embeddings=True, max_position_embeddings=777, pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2, rope_parameters=ROPE)


def _gemma3():
    return transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=12, rms_norm_eps=3e-6, tie_word_embeddings=False,
        max_position_embeddings=777, query_pre_attn_scalar=20, sliding_window=33,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 3.0, "rope_theta": 54321.0},
                         "sliding_attention": ROPE})


def _gpt_oss():
    return transformers.GptOssConfig(
        vocab_size=96, hidden_size=48, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=12, rms_norm_eps=3e-6, tie_word_embeddings=True, max_position_embeddings=777,
        num_local_experts=5, num_experts_per_tok=3, sliding_window=33, swiglu_alpha=1.5, swiglu_limit=6.0,
        layer_types=["full_attention", "sliding_attention", "full_attention"], rope_parameters=ROPE)


_QN = dict(vocab_size=96, hidden_size=48, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=3,
           head_dim=12, rms_norm_eps=2e-6, tie_word_embeddings=True, max_position_embeddings=777, linear_conv_kernel_dim=3,
           linear_key_head_dim=10, linear_value_head_dim=14, linear_num_key_heads=3, linear_num_value_heads=6,
           layer_types=["linear_attention", "full_attention", "linear_attention"] * 2,
           rope_parameters={**ROPE, "partial_rotary_factor": 0.5})
_QN_MOE = dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=20)


def _qwen3_next():
    return transformers.Qwen3NextConfig(**_QN, **_QN_MOE, intermediate_size=80, norm_topk_prob=False,
                                        decoder_sparse_step=2, mlp_only_layers=[1])


def _qwen3_5():
    return transformers.Qwen3_5TextConfig(**_QN, intermediate_size=80)


def _qwen3_5_moe():
    return transformers.Qwen3_5MoeTextConfig(**_QN, **_QN_MOE, intermediate_size=80)


FAMILIES = {
    "qwen3_next": (qwen3_next.Qwen3NextTargetConfig, qwen3_next.HF_KEYS[qwen3_next.QWEN3_NEXT], _qwen3_next,
                   transformers.Qwen3NextConfig),
    "qwen3_5": (qwen3_next.Qwen3NextTargetConfig, qwen3_next.HF_KEYS[qwen3_next.QWEN3_5], _qwen3_5,
                transformers.Qwen3_5TextConfig),
    "qwen3_5_moe": (qwen3_next.Qwen3NextTargetConfig, qwen3_next.HF_KEYS[qwen3_next.QWEN3_5_MOE], _qwen3_5_moe,
                    transformers.Qwen3_5MoeTextConfig),
    "gpt_oss": (gpt_oss.GptOssTargetConfig, gpt_oss.HF_KEYS, _gpt_oss, transformers.GptOssConfig),
    "gemma3": (gemma3.Gemma3TargetConfig, gemma3.HF_KEYS, _gemma3, transformers.Gemma3TextConfig),
    "mistral": (mistral.MistralTargetConfig, mistral.HF_KEYS, _mistral, transformers.MistralConfig),
    "phi3": (phi3.Phi3TargetConfig, phi3.HF_KEYS, _phi3, transformers.Phi3Config),
    "llama": (llama.LlamaTargetConfig, llama.HF_KEYS, _llama, transformers.LlamaConfig),
    "qwen3_moe": (qwen3_moe.Qwen3MoeTargetConfig, qwen3_moe.HF_KEYS, _qwen3_moe, transformers.Qwen3MoeConfig),
    "hrm_text": (hrm_text.HrmTextTargetConfig, hrm_text.HF_KEYS, _hrm, transformers.HrmTextConfig),
    "nemotron_h": (nemotron_h.NemotronHTargetConfig, nemotron_h.HF_KEYS, _nemotron, transformers.NemotronHConfig),
}
ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe": "Qwen3_5MoeForCausalLM", "gemma3": "Gemma3ForCausalLM", "gpt_oss": "GptOssForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "hrm_text": "HrmTextForCausalLM",
                 "nemotron_h": "NemotronHForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_to_hf_round_trips_through_transformers(name):
    config_class, table, build, hf_class = FAMILIES[name]
    hf = build().to_dict()
    hf["architectures"] = [ARCHITECTURES[name]]
    cfg = config_class.from_hf(hf)
    written = cfg.to_hf()
    assert config_class.from_hf(written) == cfg
    assert not [row.key for row in table if row.key not in written], "a key of the table is not written"
    for row in table:  # the test values are not the defaults, so a dropped key would be noticed
        if not callable(row.default) and row.default is not hf_keys.REQUIRED:
            assert getattr(cfg, row.field_name) != row.convert(row.default), \
                f"{name}: {row.key} is at its default; pick another test value"
    if name != "nemotron_h":
        assert cfg.rope != RopeSpec()
    through_hf = hf_class(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")}).to_dict()
    through_hf["architectures"] = written["architectures"]
    assert config_class.from_hf(through_hf) == cfg


def test_looped_to_hf_round_trips():
    base = _llama().to_dict()
    base.update(architectures=["LoopedLlamaForCausalLM"], num_loops=3, loop_start=1, loop_end=3)
    cfg = looped.LoopedLlamaConfig.from_hf(base)
    assert looped.LoopedLlamaConfig.from_hf(cfg.to_hf()) == cfg

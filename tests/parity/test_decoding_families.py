"""Cached decoding and lossless speculative decoding for the attention-only target families other
than Llama / Qwen3: Qwen3-MoE (mixed MoE / dense layers), looped Llama / Qwen3 (a KV cache row per
virtual layer), HRM-Text (H/L cycles, a cache row per virtual layer), Mistral with and without a
sliding window (slot positions in the cache), Gemma 3 (sliding and global layers in one scan), gpt-oss
(attention sinks and biases, sliding and full layers, biased clamped-SwiGLU experts), DeepSeek-V3 (MLA
with its absorbed latent cache, grouped sigmoid routing) and Phi-3. Tiny random targets built
from their configs; CPU, fp32, no torch.

Bars:
  (a) ``target.decode_chunk`` equals the uncached forward (logits, the three aux states and the final
      hidden; 1e-5 abs + 1e-5 rel, fp32) for a prefill written over a stale chunk after a rollback,
      then one token at a time, then a chunk (two rows); a left-padded row (valid_from) with
      logits_index; a tree-masked chunk against the forward of each root-to-node path. Every
      virtual cache row is read: corrupting any one moves the next logits by > 1e-4.
  (b) speculative decoding (specjax.eval.spec_decode, batch 1, the decoder's only batch size) equals
      the target's own greedy output token for token: a random EAGLE-3 head (chain and tree, K=3),
      and drafts that are right except at one position that moves every step, so a partial
      acceptance (rollback, and in a tree a KV move) happens at every draft position. Batched greedy
      generation (specjax.eval.generate, B=3, ragged prompts) equals an uncached greedy loop over the
      full forward.
"""
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts.eagle3 import config_from_target, init_draft_params
from specjax.drafts.vocab import DraftVocab
from specjax.eval.generate import generate
from specjax.eval.spec_decode import Draft, SpecDecoder
from specjax.targets import registry
from specjax.targets.base import Target, tree_set
from specjax.targets.deepseek_v3 import DeepseekV3Target, DeepseekV3TargetConfig
from specjax.targets.deepseek_v32 import DeepseekV32Target, DeepseekV32TargetConfig, GlmMoeDsaTarget
from specjax.targets.gemma3 import FULL, SLIDING, Gemma3Target, Gemma3TargetConfig
from specjax.targets.gemma4 import Gemma4Target, Gemma4TargetConfig, ProportionalRope
from specjax.targets.glm4_moe import Glm4MoeLiteTarget, Glm4MoeLiteTargetConfig, Glm4MoeTarget, Glm4MoeTargetConfig
from specjax.targets.gpt_oss import FULL as GPT_FULL
from specjax.targets.gpt_oss import SLIDING as GPT_SLIDING
from specjax.targets.gpt_oss import GptOssTarget, GptOssTargetConfig
from specjax.targets.hrm_text import HrmTextTarget, HrmTextTargetConfig
from specjax.targets.kimi_linear import FULL as KL_FULL
from specjax.targets.kimi_linear import LINEAR as KL_LINEAR
from specjax.targets.kimi_linear import KimiLinearTarget, KimiLinearTargetConfig
from specjax.layers.rope import RopeSpec
from specjax.targets.looped import LoopedLlamaConfig, LoopedLlamaTarget
from specjax.targets.minimax_m2 import MiniMaxM2Target, MiniMaxM2TargetConfig
from specjax.targets.mistral import MistralTarget, MistralTargetConfig
from specjax.targets.mistral4 import Mistral4Target, Mistral4TargetConfig
from specjax.targets.phi3 import Phi3Target, Phi3TargetConfig
from specjax.targets.qwen3_moe import Qwen3MoeTarget, Qwen3MoeTargetConfig
from specjax.targets.qwen3_next import FULL as QN_FULL
from specjax.targets.qwen3_next import LINEAR as QN_LINEAR
from specjax.targets.qwen3_next import Qwen3_5Target, Qwen3NextTarget, Qwen3NextTargetConfig

VOCAB = 96
ATOL = RTOL = 1e-5
PROMPT = [5, 17, 3, 9, 11, 2, 40]
MAX_NEW = 12
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=8)


def _moe():
    # 4 layers, layer 1 dense (mlp_only_layers): both feed-forward kinds in one scan span
    return Qwen3MoeTarget, Qwen3MoeTargetConfig(
        architecture="Qwen3MoeForCausalLM", moe_intermediate_size=16, num_hidden_layers=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=(1,), **COMMON)


def _looped_llama():
    # layers 0, [1, 2] x 2 -> virtual [0, 1, 2, 1, 2]
    return LoopedLlamaTarget, LoopedLlamaConfig(
        architecture="LoopedLlamaForCausalLM", num_hidden_layers=3, num_key_value_heads=2, num_loops=2,
        loop_start=1, loop_end=3, **COMMON)


def _looped_qwen3():
    # [0, 1] x 3, then 2 -> virtual [0, 1, 0, 1, 0, 1, 2]; q/k norm
    return LoopedLlamaTarget, LoopedLlamaConfig(
        architecture="LoopedQwen3ForCausalLM", num_hidden_layers=3, num_key_value_heads=2, num_loops=3,
        loop_start=0, loop_end=2, tie_word_embeddings=True, **COMMON)


def _hrm():
    # 2 layers per stack, invocations L, H, L, H -> 8 virtual layers
    return HrmTextTarget, HrmTextTargetConfig(
        architecture="HrmTextForCausalLM", num_layers_per_stack=2, H_cycles=2, L_cycles=1, embedding_scale=1.0,
        **COMMON)


def _mistral():
    return MistralTarget, MistralTargetConfig(architecture="MistralForCausalLM", num_hidden_layers=5,
                                              num_key_value_heads=2, **COMMON)


def _phi3():
    # partial rotary (the first half of each head), through Phi-3's own RoPE hooks. LongRoPE is not
    # here: EAGLE-3 drafts take the target's RoPE and have no LongRoPE (test_targets_mistral_phi3.py
    # checks the LongRoPE target's cached decoding)
    rope = RopeSpec("default", 10000.0, partial_rotary_factor=0.5)
    return Phi3Target, Phi3TargetConfig(architecture="Phi3ForCausalLM", num_hidden_layers=5, num_key_value_heads=2,
                                        rope=rope, **COMMON)


def _mistral_window():
    # every layer slides over 4 positions: shorter than the prompts and generations below
    return MistralTarget, MistralTargetConfig(architecture="MistralForCausalLM", num_hidden_layers=4,
                                              num_key_value_heads=2, sliding_window=4, **COMMON)


def _gemma3():
    # local (window 4, own RoPE base) and global layers in one scan; (1 + w) norms, GeGLU, scaled embeddings
    types = (SLIDING, FULL, SLIDING, SLIDING, FULL)
    return Gemma3Target, Gemma3TargetConfig(architecture="Gemma3ForCausalLM", num_hidden_layers=5,
                                            num_key_value_heads=2, layer_types=types, sliding_window=4,
                                            query_pre_attn_scalar=12, rope_local=RopeSpec("default", 500.0),
                                            **COMMON)


def _gpt_oss():
    # biases, attention sinks, sliding (window 4) and full layers, routed clamped-SwiGLU experts with biases
    return GptOssTarget, GptOssTargetConfig(architecture="GptOssForCausalLM", num_hidden_layers=4,
                                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                            layer_types=(GPT_SLIDING, GPT_FULL) * 2, sliding_window=4, **COMMON)


def _deepseek_v3():
    # MLA (q LoRA, YaRN, absorbed cached decoding), 2 dense layers then sigmoid-routed grouped MoE with a
    # shared expert; 5 layers so that the default taps leave a layer scan longer than 1
    rope = RopeSpec("yarn", 10000.0, factor=40.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=1.0)
    return DeepseekV3Target, DeepseekV3TargetConfig(
        architecture="DeepseekV3ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=5, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=2, rope=rope)


# 4 layers as the Qwen3-MoE entry: [linear, linear, full, linear], so the default taps (1, 2, 3) leave a run of two
# DeltaNet layers (one scan). (a) compares decoding with the forward at 1e-5 per element: the forward runs the
# sequential rule that decoding runs (the chunked one agrees to ~1e-5 relative); (b) holds for either
QN_SHAPE = dict(num_hidden_layers=4, num_key_value_heads=2, layer_types=(QN_LINEAR, QN_LINEAR, QN_FULL, QN_LINEAR),
                linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                rope=RopeSpec("default", 10000.0, partial_rotary_factor=0.5), gated_delta_implementation="reference")


def _qwen3_next():
    # Gated DeltaNet and gated-attention layers (decoding keeps a window of DeltaNet states: rollback and the
    # tree commit re-label them), partial RoPE, (1 + w) norms, routed experts + a gated shared expert, a dense layer
    return Qwen3NextTarget, Qwen3NextTargetConfig(
        architecture="Qwen3NextForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, mlp_only_layers=(2,), **QN_SHAPE, **COMMON)


def _qwen3_5():
    # the same mixers with Qwen3.5's four DeltaNet input projections and dense feed-forwards
    return Qwen3_5Target, Qwen3NextTargetConfig(architecture="Qwen3_5ForCausalLM", **QN_SHAPE, **COMMON)


def _qwen3_5_moe():
    # Qwen3.5's projections, every feed-forward routed experts + a gated shared expert (always renormalised)
    return Qwen3NextTarget, Qwen3NextTargetConfig(
        architecture="Qwen3_5MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, **QN_SHAPE, **COMMON)


def _deepseek_v32():
    # DeepSeek-V3.2: the DeepSeek-V3 entry plus the lightning indexer, which keeps each query's 4 best-scored keys
    # (fewer than the prompts and generations below hold), so its key cache is rolled back, moved along tree paths
    # and refilled with the latent cache
    _, v3 = _deepseek_v3()
    fields = {f.name: getattr(v3, f.name) for f in dataclasses.fields(v3)}
    return DeepseekV32Target, DeepseekV32TargetConfig(**{**fields, "architecture": "DeepseekV32ForCausalLM"},
                                                      index_topk=4, index_head_dim=8, index_n_heads=4)


def _glm_moe_dsa():
    # GLM-5: the same blocks with the indexer's RoPE dims as interleaved pairs, and layers 1 and 3 "shared": they
    # reuse the kept keys of the layer before them (no indexer of their own, no key-cache row)
    _, cfg = _deepseek_v32()
    return GlmMoeDsaTarget, dataclasses.replace(cfg, architecture="GlmMoeDsaForCausalLM",
                                                shared_indexer_layers=(1, 3))


def _glm4_moe():
    # GQA with q/k/v biases and qk-norm, RoPE on half of each head, two dense layers then sigmoid-routed grouped
    # MoE with a shared expert (DeepSeek-V3's feed-forward); 5 layers so the unrolled scans hold more than one
    return Glm4MoeTarget, Glm4MoeTargetConfig(
        architecture="Glm4MoeForCausalLM", moe_intermediate_size=16, num_hidden_layers=5, num_key_value_heads=2,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, attention_bias=True, use_qk_norm=True,
        first_k_dense_replace=2, routed_scaling_factor=2.5, rope=RopeSpec("default", 10000.0, partial_rotary_factor=0.5),
        **COMMON)


def _glm4_moe_lite():
    # GLM-4.7-Flash: DeepSeek-V3's MLA (q LoRA, interleaved RoPE, absorbed cached decoding) and MoE, two dense layers
    return Glm4MoeLiteTarget, Glm4MoeLiteTargetConfig(
        architecture="Glm4MoeLiteForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=5, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=2, routed_scaling_factor=1.8, rope=RopeSpec("default", 10000.0))


def _minimax_m2():
    # q/k RMSNorm over all heads at once, partial RoPE, sigmoid-routed experts with a correction bias
    return MiniMaxM2Target, MiniMaxM2TargetConfig(
        architecture="MiniMaxM2ForCausalLM", num_hidden_layers=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, rope=RopeSpec("default", 10000.0, partial_rotary_factor=0.5), **COMMON)


def _gemma4():
    # sliding (window 4) and full layers with their own head shapes (full: 1 KV head of 16, k = v, proportional
    # RoPE on half the frequencies); layers 4-5 compute no K/V and read layer 1's cache row (shared KV) with
    # double-wide MLPs (one scan: the default taps (1, 2, 3) leave them together); per-layer inputs, layer
    # scalars, final-logit soft-capping
    types = (SLIDING, FULL, SLIDING, SLIDING, FULL, FULL)
    return Gemma4Target, Gemma4TargetConfig(
        architecture="Gemma4ForCausalLM", num_hidden_layers=6, num_key_value_heads=2, layer_types=types,
        global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
        use_double_wide_mlp=True, hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
        final_logit_softcapping=10.0, sliding_window=4, rope_local=RopeSpec("default", 500.0),
        rope_global=ProportionalRope(10000.0, 0.5), **COMMON)


def _mistral4():
    # Mistral 4: DeepSeek-V3's MLA (q LoRA, YaRN, absorbed cached decoding) with every query scaled by Llama 4's
    # position rule (original length 4, so the prompts and generations cross several blocks), two dense layers
    # (5 layers: the default taps leave a layer scan longer than 1), then softmax-routed grouped MoE (top-2 in 2
    # of 4 groups, x1.5) with a shared expert
    rope = RopeSpec("yarn", 10000.0, factor=4.0, original_max_position_embeddings=4, mscale=1.0, mscale_all_dim=1.0)
    return Mistral4Target, Mistral4TargetConfig(
        architecture="Mistral4ForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=5, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=2, routed_scaling_factor=1.5, llama_4_scaling_beta=0.5, rope=rope)


def _kimi_linear():
    # Kimi Delta Attention (the gated delta rule with a decay per key channel; decoding keeps a window of its
    # states, re-labelled on rollback and by the tree commit) and MLA without RoPE (latent cache), one dense layer
    # then sigmoid-routed grouped MoE with a shared expert; [linear, linear, full, linear] so the default taps
    # (1, 2, 3) leave a run of two KDA layers. The forward runs the sequential rule that decoding runs, as the
    # qwen3_next entries do
    return KimiLinearTarget, KimiLinearTargetConfig(
        architecture="KimiLinearForCausalLM", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        layer_types=(KL_LINEAR, KL_LINEAR, KL_FULL, KL_LINEAR), kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, linear_num_heads=2, linear_head_dim=8, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        gated_delta_implementation="reference")


FAMILIES = {"gemma4": _gemma4, "mistral4": _mistral4, "kimi_linear": _kimi_linear, "deepseek_v32": _deepseek_v32, "glm_moe_dsa": _glm_moe_dsa, "glm4_moe": _glm4_moe, "glm4_moe_lite": _glm4_moe_lite, "minimax_m2": _minimax_m2, "qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5_moe, "mistral": _mistral, "deepseek_v3": _deepseek_v3, "mistral_window": _mistral_window, "gemma3": _gemma3, "gpt_oss": _gpt_oss, "phi3": _phi3, "qwen3_moe": _moe, "looped_llama": _looped_llama, "looped_qwen3": _looped_qwen3, "hrm_text": _hrm}


def build(name, seed=0, vocab=None, **overrides):
    """Random params from the weight table: matrices N(0, 0.15^2) (embeddings, z_L_init and the
    lm_head 0.5), norm scales 1 + 0.1 N(0, 1) (Gemma, Qwen3-Next: 0.1 N(0, 1), their norms add the 1); large enough that logits and routing are peaked.
    `vocab`: another vocab size (a real tokenizer's); `overrides`: other config fields."""
    cls, cfg = FAMILIES[name]()
    if vocab is not None:
        overrides["vocab_size"] = vocab
        if cls is Gemma4Target:  # its per-layer input table covers the vocabulary too
            overrides["vocab_size_per_layer_input"] = vocab
    cfg = dataclasses.replace(cfg, **overrides)
    params: dict = {}
    key = jax.random.key(seed)
    for i, spec in enumerate(cls.weight_specs(cfg)):
        noise = jax.random.normal(jax.random.fold_in(key, i), spec.shape, jnp.float32)
        if spec.path[-1] == "scale":  # Gemma's and Qwen3-Next's norms multiply by 1 + scale (not its DeltaNet output norm)
            unit_offset = cls is Gemma3Target or (cls in (Qwen3NextTarget, Qwen3_5Target)
                                                  and spec.path[:2] != ("linear_attn", "norm"))
            value = (0.0 if unit_offset else 1.0) + 0.1 * noise
        elif spec.path[0] in ("embed_tokens", "lm_head", "z_L_init"):  # Gemma scales its embedding by sqrt(D)
            value = (0.1 if cls in (Gemma3Target, Gemma4Target) else 0.5) * noise
        else:
            value = 0.15 * noise
        tree_set(params, spec.path, value)
    return cls(cfg, {}, params)


# The families are split over two files (test_decoding_families_more.py runs the same tests on the rest)
# so that pytest-xdist's --dist loadfile runs the halves on two workers: one file was CI's longest.
MORE_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "mistral_window", "gemma3", "gpt_oss", "glm4_moe_lite",
                 "minimax_m2", "glm_moe_dsa", "kimi_linear", "gemma4")

# Every family runs the decoding contract's core in the default run: cached decoding (prefill, then
# chunks, then a rollback over stale entries) equals the forward. The tests that drive a family's cache
# through the shared machinery run by default on a subset, and on every family under ``pytest -m slow``:
#   LOOP_TESTS (left padding and logits_index, tree chunks, partial acceptance at every position, batched
#     generation with in-device refill, random-draft losslessness): they exercise what differs between
#     cache kinds (rollback, tree commit, row refill along each leaf's batch axis), so they run on one
#     family per cache kind, LOOP_FAMILIES: KV + MoE, MLA latent, mixed sliding/full windows, Gated
#     DeltaNet states, virtual layers, H/L cycles (Llama, Qwen3 and Nemotron-H's Mamba states in their
#     own files).
#   DRIVER_TESTS (the batched device loop, rejection sampling, unrolled layer scans; continuous batching,
#     regeneration and decode_eval in tests/eval): drivers that reach a cache only through the contract
#     the tests above check per kind, so they run on DRIVER_FAMILIES: a KV cache with mixed windows, a
#     Gated DeltaNet state window and Nemotron-H's Mamba states (a batch axis other than 0).
LOOP_FAMILIES = ("qwen3_moe", "deepseek_v3", "gemma3", "qwen3_5", "looped_qwen3", "hrm_text", "nemotron_h")
LOOP_TESTS = ("test_left_padding_and_logits_index", "test_tree_chunk_matches_paths",
              "test_lossless_partial_acceptance_everywhere", "test_batched_generate_equals_uncached_greedy",
              "test_lossless_random_draft")
DRIVER_FAMILIES = ("gemma3", "qwen3_5", "nemotron_h")
DRIVER_TESTS = ("test_device_loop_equals_host_decoder", "test_rejection_sampling_keeps_the_target_distribution",
                "test_unrolled_layer_scans_decode_the_same")


def is_slow_case(test_name: str, params: dict) -> bool:
    """tests/conftest.py marks these cases slow: a loop test for a family outside LOOP_FAMILIES, a driver
    test for one outside DRIVER_FAMILIES."""
    family = params.get("target")
    return ((test_name in LOOP_TESTS and family not in LOOP_FAMILIES)
            or (test_name in DRIVER_TESTS and family not in DRIVER_FAMILIES))


def _params(names, default):
    return [pytest.param(n) if n in default else pytest.param(n, marks=pytest.mark.slow) for n in names]


def loop_family_params(names):
    """``names`` as pytest params, those outside LOOP_FAMILIES marked slow (tests/e2e's per-family training)."""
    return _params(names, LOOP_FAMILIES)


def driver_family_params(names):
    """``names`` as pytest params, those outside DRIVER_FAMILIES marked slow (tests/eval's drivers)."""
    return _params(names, DRIVER_FAMILIES)


def family_fixture(names):
    """The module-scoped ``target`` fixture over these FAMILIES entries."""

    @pytest.fixture(scope="module", params=list(names))
    def target(request):
        yield build(request.param)
        # drop the family's compiled programs before the next family's: conftest's per-file release is not
        # enough for many families in one file, whose XLA:CPU executables reached Linux's 65,530 memory
        # mappings (vm.max_map_count) and crashed the compiler inside the 8th family's device loop
        import gc

        jax.clear_caches()
        gc.collect()

    return target


target = family_fixture([name for name in FAMILIES if name not in MORE_FAMILIES])


def _decoder(target, aux_ids):
    return jax.jit(lambda c, i, p, s, m=None, vf=None, li=None: target.decode_chunk(
        target.params, c, i, p, s, aux_layer_ids=aux_ids, chunk_mask=m, valid_from=vf, logits_index=li))


def _max_diff(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - np.asarray(ref, np.float64)).max())


# =============================================================================================
# (a) cached decoding == uncached forward
# =============================================================================================
DECODING_ARCHS = ("Gemma4ForCausalLM", "Mistral4ForCausalLM", "KimiLinearForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "MiniMaxM2ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "DeepseekV3ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM", "LoopedLlamaForCausalLM", "LoopedQwen3ForCausalLM", "HrmTextForCausalLM")


def test_registered_for_decoding():
    for name in FAMILIES:  # the class decides (no params needed)
        cls, cfg = FAMILIES[name]()
        assert cls(cfg, {}, None).supports_decoding, name
    ok = {a for a, cls in registry.ARCHITECTURES.items() if cls.decoder is not None}
    assert set(DECODING_ARCHS) <= ok
    # the refusal names every architecture that decodes
    other = Target(types.SimpleNamespace(architecture="NemotronHForCausalLM", num_hidden_layers=4), {}, {})
    with pytest.raises(NotImplementedError, match="got NemotronHForCausalLM") as err:
        other.require_decoding()
    assert all(a in str(err.value) for a in DECODING_ARCHS + ("LlamaForCausalLM", "Qwen3ForCausalLM"))


def test_cached_decoding_equals_forward(target):
    aux_ids = target.default_aux_layer_ids()
    ids = jnp.asarray(np.random.RandomState(0).randint(0, VOCAB, (2, 11)), jnp.int32)
    full = target(ids, aux_layer_ids=aux_ids)
    cache = target.init_cache(2, 40)
    # one K/V row per (virtual) attention layer (a hybrid: its attention layers only); a sliding window's
    # slot positions. A hybrid's recurrent-state window has no slot axis (qwen3_next.py "Cached decoding")
    kv_rows = getattr(target.config, "num_attention_layers", target.num_layers)
    by_slot = {name: leaf for name, leaf in cache.items() if leaf.ndim >= 3 and leaf.shape[2] == 256}
    assert {"k", "kv"} & set(by_slot)
    for name, leaf in by_slot.items():
        # a sliding window's slot positions: one row; the indexer's key cache: a row per layer with its own indexer
        rows = {"pos": 1, "index_k": len(getattr(target.config, "indexer_layer_ids", ()))}.get(name, kv_rows)
        assert leaf.shape[:3] == (rows, 2, 256)
    decode = _decoder(target, aux_ids)
    pos = jnp.broadcast_to(jnp.arange(11, dtype=jnp.int32), (2, 11))
    at = lambda s: jnp.full((2,), s, jnp.int32)  # noqa: E731
    # a wrong 8-token chunk first (stale entries), then roll back to 0: prefill 5, 3 single tokens, a chunk of 3
    cache = decode(cache, ids[:, ::-1][:, :8], pos[:, :8], at(0))[3]
    pieces = []
    for a, b in [(0, 5), (5, 6), (6, 7), (7, 8), (8, 11)]:
        logits, aux, final, cache = decode(cache, ids[:, a:b], pos[:, a:b], at(a))
        pieces.append((logits, aux, final))
    logits = np.concatenate([p[0] for p in pieces], 1)
    final = np.concatenate([p[2] for p in pieces], 1)
    diffs = {"logits": _max_diff(logits, full.logits), "final": _max_diff(final, full.final_hidden)}
    np.testing.assert_allclose(logits, full.logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(final, full.final_hidden, rtol=RTOL, atol=ATOL)
    for k in range(len(aux_ids)):
        aux_k = np.concatenate([p[1][k] for p in pieces], 1)
        diffs[f"aux{aux_ids[k]}"] = _max_diff(aux_k, full.aux_hidden[k])
        np.testing.assert_allclose(aux_k, full.aux_hidden[k], rtol=RTOL, atol=ATOL)
    print(f"\n{target.arch}: max |cached - uncached| {diffs}")
    # the logits are not trivially equal (a test that could not fail): rows differ, values are O(1)
    assert np.abs(np.asarray(full.logits)).max() > 1.0

    # every virtual cache row is read: corrupting row v's K at the valid slots moves token 8's logits
    ref8 = np.asarray(pieces[-1][0][:, 0])
    key = "k" if "k" in cache else "kv"  # MLA caches the compressed latent
    prefix = (jnp.arange(cache[key].shape[2]) < 8).reshape((1, -1) + (1,) * (cache[key].ndim - 3))
    for v in range(cache[key].shape[0]):
        bad = dict(cache, **{key: cache[key].at[v].set(jnp.where(prefix, 1.0, cache[key][v]))})
        moved = _max_diff(decode(bad, ids[:, 8:9], pos[:, 8:9], at(8))[0][:, 0], ref8)
        assert moved > 1e-4, (v, moved)


def test_left_padding_and_logits_index(target):
    # Two rows of one 6-token prompt: row 0 at slots 0..5 (3 junk tokens after it, stale later), row 1
    # left-padded (3 pad tokens at slots 0..2, the prompt at 3..8, positions 0..5; its chunk mask
    # hides the pads, later calls pass valid_from=3). Prefill logits at logits_index, then one token
    # per row at different starts (6 and 9): both equal the uncached forward.
    aux_ids = target.default_aux_layer_ids()
    ids = np.random.RandomState(1).randint(0, VOCAB, (1, 7)).astype(np.int32)
    full = target(jnp.asarray(ids), aux_layer_ids=aux_ids)
    p = ids[0, :6]
    chunk = np.stack([np.concatenate([p, [0, 0, 0]]), np.concatenate([[7, 7, 7], p])]).astype(np.int32)
    pos = np.stack([np.arange(9), np.concatenate([[0, 0, 0], np.arange(6)])]).astype(np.int32)
    causal = np.tril(np.ones((9, 9), bool))
    mask = np.stack([causal, causal & ((np.arange(9)[None, :] >= 3) | np.eye(9, dtype=bool))])
    valid_from = jnp.asarray([0, 3], jnp.int32)
    decode = _decoder(target, aux_ids)
    logits, aux, final, cache = decode(target.init_cache(2, 16), jnp.asarray(chunk), jnp.asarray(pos),
                                       jnp.zeros((2,), jnp.int32), jnp.asarray(mask), valid_from,
                                       jnp.asarray([[5], [8]], jnp.int32))
    assert logits.shape == (2, 1, VOCAB)
    for r in range(2):
        np.testing.assert_allclose(logits[r, 0], full.logits[0, 5], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(final[1, 3:], full.final_hidden[0, :6], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(aux[0][1, 3:], full.aux_hidden[0][0, :6], rtol=RTOL, atol=ATOL)
    nxt = jnp.full((2, 1), ids[0, 6], jnp.int32)
    logits, aux, _, _ = decode(cache, nxt, jnp.full((2, 1), 6, jnp.int32), jnp.asarray([6, 9], jnp.int32), None,
                               valid_from)
    for r in range(2):
        np.testing.assert_allclose(logits[r, 0], full.logits[0, 6], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(aux[-1][r, 0], full.aux_hidden[-1][0, 6], rtol=RTOL, atol=ATOL)


def test_tree_chunk_matches_paths(target):
    # cached prefix x0..x4; chunk = a tree: node0 = x5 (root), node1 = x6 (child of 0), node2 = y
    # (child of 0), node3 = z (child of 2); ancestor-or-self mask, positions by depth. Node i's
    # logits and aux states equal the forward of its root-to-node path.
    aux_ids = target.default_aux_layer_ids()
    x = np.random.RandomState(2).randint(0, VOCAB, 7).astype(np.int32)
    y, z = (int(x[6]) + 1) % VOCAB, 13
    path_a = np.concatenate([x[:7], [0]])  # x0..x6 (+ a pad: one forward shape)
    path_b = np.concatenate([x[:6], [y, z]])
    full = target(jnp.asarray(np.stack([path_a, path_b])), aux_layer_ids=aux_ids)
    decode = _decoder(target, aux_ids)
    b = 2
    prefix = jnp.asarray(np.broadcast_to(x[:5], (b, 5)))
    cache = decode(target.init_cache(b, 16), prefix, jnp.broadcast_to(jnp.arange(5), (b, 5)),
                   jnp.zeros((b,), jnp.int32))[3]
    nodes = np.array([x[5], x[6], y, z], np.int32)
    anc = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
    depth_pos = 5 + np.array([0, 1, 1, 2], np.int32)
    logits, aux, _, _ = decode(cache, jnp.asarray(np.broadcast_to(nodes, (b, 4))),
                               jnp.asarray(np.broadcast_to(depth_pos, (b, 4))), jnp.full((b,), 5, jnp.int32),
                               jnp.asarray(np.broadcast_to(anc, (b, 4, 4))))
    # node -> (row of `full`, position in that path)
    for node, (row, t) in enumerate([(0, 5), (0, 6), (1, 6), (1, 7)]):
        np.testing.assert_allclose(logits[0, node], full.logits[row, t], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(logits[1, node], full.logits[row, t], rtol=RTOL, atol=ATOL)
        for k in range(len(aux_ids)):
            np.testing.assert_allclose(aux[k][0, node], full.aux_hidden[k][row, t], rtol=RTOL, atol=ATOL)


# =============================================================================================
# (b) lossless speculative decoding and batched generation
# =============================================================================================
def naive_greedy(target, prompt, n):
    """Greedy continuation by the uncached forward (one padded shape, causal, so the pad is unseen)."""
    seq, total = list(prompt), len(prompt) + n
    for _ in range(n):
        ids = np.zeros((1, total), np.int32)
        ids[0, : len(seq)] = seq
        logits = target(jnp.asarray(ids)).logits
        seq.append(int(np.argmax(np.asarray(logits[0, len(seq) - 1]))))
    return seq[len(prompt):]


def random_draft(target, seed=0):
    V = target.config.vocab_size
    dcfg = config_from_target(target.config, draft_vocab_size=48, aux_layer_ids=target.default_aux_layer_ids())
    return Draft(init_draft_params(dcfg, jax.random.key(seed)), dcfg, DraftVocab.from_ids(np.arange(0, V, 2), V))


@pytest.fixture(scope="module")
def spec_setup(target):
    # the greedy reference, long enough that a near-oracle draft can always look K tokens ahead
    ref = generate(target, [PROMPT], max_new_tokens=MAX_NEW + 4)[0]
    return target, random_draft(target), ref


def test_batched_generate_equals_uncached_greedy(spec_setup):
    target, _, ref = spec_setup
    prompts = [PROMPT, [3, 1, 4], list(range(20, 33))]
    got = generate(target, prompts, max_new_tokens=MAX_NEW, batch_size=3)
    want = [naive_greedy(target, p, MAX_NEW) for p in prompts]
    assert got == want
    # in-device refill: 2 rows for 3 prompts, so one row is refilled (its cache rows replaced) mid-loop
    assert generate(target, prompts, max_new_tokens=MAX_NEW, batch_size=2, refill=True) == want
    assert ref[:MAX_NEW] == want[0]
    assert len(set(want[0])) > 1  # not a degenerate constant continuation


@pytest.mark.parametrize("mode,k", [("chain", 3), ("tree", 3)])
def test_lossless_random_draft(spec_setup, mode, k):
    target, draft, ref = spec_setup
    dec = SpecDecoder(target, draft, num_spec_tokens=k, mode=mode, tree_top_k=2)
    res = dec.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == ref[:MAX_NEW]
    assert sum(res.accept_lengths) == MAX_NEW - 1 and res.num_steps == len(res.accept_lengths)
    eos = ref[6]
    assert dec.generate(PROMPT, max_new_tokens=MAX_NEW, eos_token_ids=[eos]).tokens == ref[: ref.index(eos)]
    assert dec.greedy(PROMPT, max_new_tokens=MAX_NEW).tokens == ref[:MAX_NEW]


class OneWrongChain(SpecDecoder):
    """Proposes the target's greedy continuation with draft position `step % K` wrong: each step
    accepts exactly that many drafts, so the rollback point visits every position."""

    ref: list

    def _override_chain(self, drafts, q, tokens, prompt):
        n, w = len(tokens), self.calls % self.k
        self.calls += 1
        toks = list(self.ref[n: n + self.k])
        toks[w] = (toks[w] + 1) % VOCAB
        return jnp.asarray(toks, jnp.int32), q


class OneWrongTree(SpecDecoder):
    """Puts the greedy continuation on the LAST child of each level down to depth `step % (K+1)`
    (so the accepted K/V must be moved), and keeps every child off the truth below it."""

    ref: list

    def _override_tree(self, nodes, parents, tokens, prompt):
        nodes, parents = np.array(nodes), np.asarray(parents)
        w = self.calls % (self.k + 1)
        self.calls += 1
        truth = self.ref[len(tokens): len(tokens) + self.k]
        offs = np.cumsum((0,) + self.widths)
        chosen = -1
        for d, tok in enumerate(truth):
            kids = np.arange(offs[d], offs[d + 1])
            kids = kids[parents[kids] == chosen]
            nodes[kids[nodes[kids] == tok]] = (tok + 1) % VOCAB  # no sibling matches
            if d >= w or kids.size == 0:
                break
            chosen = int(kids[-1])
            nodes[chosen] = tok
        return jnp.asarray(nodes), jnp.asarray(parents)


def one_wrong_accept_lengths(k, mode, max_new):
    """The accept lengths OneWrongChain / OneWrongTree force: max_new - 1 tokens after the prefill's
    one; step s accepts s % K (chain) or s % (K+1) (tree) drafts + the bonus."""
    period = list(range(1, k + 1)) if mode == "chain" else list(range(1, k + 2))
    want, left = [], max_new - 1
    while left > 0:
        for n in period:
            if left <= 0:
                break
            want.append(min(n, left))
            left -= n
    return want


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_lossless_partial_acceptance_everywhere(spec_setup, mode):
    target, draft, ref = spec_setup
    k = 3
    cls = OneWrongChain if mode == "chain" else OneWrongTree
    dec = cls(target, draft, num_spec_tokens=k, mode=mode, tree_top_k=2, tree_max_width=8)  # widths 2, 4, 8
    dec.ref, dec.calls = ref, 0
    res = dec.generate(PROMPT, max_new_tokens=MAX_NEW)
    assert res.tokens == ref[:MAX_NEW]
    assert res.accept_lengths == one_wrong_accept_lengths(k, mode, MAX_NEW)


def test_device_loop_equals_host_decoder(spec_setup):
    # the whole generation as one device program (spec_loop), batched over ragged prompts: each row
    # equals the host-driven decoder on that prompt (tokens, accept lengths, counts) and is lossless.
    # Chain only here: the loop runs the same _verify_tree as the host decoder, whose tree mode is
    # tested above for every family and with the loop on Llama (tests/eval/test_spec_loop.py)
    from specjax.eval.spec_loop import SpecLoop

    target, draft, ref = spec_setup
    dec = SpecDecoder(target, draft, num_spec_tokens=3)
    prompts = [PROMPT, [3, 1, 4], list(range(20, 33))]
    got = SpecLoop(dec).generate(prompts, max_new_tokens=MAX_NEW)
    for row, prompt in zip(got, prompts):
        want = dec.generate(prompt, max_new_tokens=MAX_NEW)
        assert (row.tokens, row.accept_lengths, row.accepted_per_position, row.num_steps) == \
            (want.tokens, want.accept_lengths, want.accepted_per_position, want.num_steps)
    assert got[0].tokens == ref[:MAX_NEW]


def test_rejection_sampling_keeps_the_target_distribution(target):
    from eval._sampling import assert_second_token_follows_target

    assert_second_token_follows_target(target, lambda seqs: target(jnp.asarray(seqs)).logits)


def _scan_unrolls(jaxpr):
    """(length, unroll) of the outermost scans of a jaxpr (closed or open): the layer scans; scans inside
    a layer (the MoE's blocks) are not looked into."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    found = []
    for eqn in inner.eqns:
        if eqn.primitive.name == "scan":
            found.append((eqn.params["length"], eqn.params["unroll"]))
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):  # a sub-jaxpr: scan/while body, cond branch
                    found += _scan_unrolls(sub)
    return found


def test_unrolled_layer_scans_decode_the_same(target):
    """`scan.unrolled_layer_scans()` (the decoding experiment of decode_speed.md, run 5) traces every
    layer scan of a cached decode fully unrolled; the unrolled decode's logits and final states equal the
    uncached forward's (1e-5, as test_cached_decoding_equals_forward), and all its outputs and cache equal
    the scanned decode's (fp32, 1e-6 relative + 5e-6 absolute: the same ops in the same order, only the
    loop is gone; unrolled, a per-layer flag such as Gemma 3's sliding/global one is a constant that XLA
    folds, and the fusions it then picks round differently by up to ~3.5e-6 on logits of ~6)."""
    from specjax.targets.layers.scan import unrolled_layer_scans

    aux_ids = target.default_aux_layer_ids()
    ids = jnp.asarray(np.random.RandomState(1).randint(0, VOCAB, (2, 6)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    start = jnp.zeros((2,), jnp.int32)
    args = (target.init_cache(2, 16), ids, pos, start)

    def run(unrolled):
        with unrolled_layer_scans(unrolled):
            decode = _decoder(target, aux_ids)  # a new jit: the setting is read when it traces
            scans = _scan_unrolls(jax.make_jaxpr(decode)(*args))
            return decode(*args), scans

    (ref, scans_ref), (got, scans_got) = run(False), run(True)
    full = target(ids, aux_layer_ids=aux_ids)  # the uncached forward, traced outside the context
    np.testing.assert_allclose(np.asarray(got[0]), full.logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(got[2]), full.final_hidden, rtol=RTOL, atol=ATOL)
    assert [n for n, _ in scans_got if n > 1], "the decode has no layer scan to unroll"
    assert all(u == 1 for n, u in scans_ref if n > 1)
    assert all(u == n for n, u in scans_got if n > 1), scans_got
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=5e-6)

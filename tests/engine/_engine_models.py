"""Tiny targets and heads for the engine tier (runs under specjax's venv, not the vLLM one).

Sizes are what vLLM's CPU backend accepts: attention head_dim 32 (CPU_ATTN supports 32, 64, 80, ...;
the 8-wide heads of tests/conftest.py's tiny target are refused), one KV head.

- Llama: the demo target (specjax.demo: byte-level BPE on the shipped chat set + 200 steps of
  causal-LM pretraining, ~25 s), heads trained with the real loop (specjax.train.loop.train) and
  exported by it in fp32.
- Qwen3 / Qwen3-MoE / Nemotron-H: transformers configs, random weights redrawn larger than HF's init
  (a peaked next-token distribution), save_pretrained (safetensors), no tokenizer. Heads: a few
  jitted train steps (specjax.train.step) on the target's own greedy continuations (HF generate),
  or a random head; exported with export_eagle3 in fp32.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

LLAMA_TARGET = dict(hidden=64, layers=4, heads=2, kv_heads=1, intermediate=128, steps=200, seq_len=128,
                    batch_size=8)
LLAMA_VOCAB = 320
HEAD_STEPS = 100  # 30 steps: acceptance mostly at position 0; 100: every position gets some (~18 s)
HF_VOCAB = 256


# ---------------------------------------------------------------------------------------------
# Llama demo target + heads trained by the loop
def build_llama_target(path) -> str:
    from specjax.demo import ensure_demo_target

    return ensure_demo_target(path, vocab_size=LLAMA_VOCAB, log=None, **LLAMA_TARGET)


def train_llama_head(target: str, out_dir, *, eagle31: bool, num_layers: int = 1, p_eagle: bool = False,
                     dflash: bool = False, jetspec: bool = False, dspark: bool = False,
                     train_embedding: bool = False, eagle1: bool = False) -> str:
    from specjax.config import load_config
    from specjax.train.loop import train

    extra = ["draft.fc_norm=true", "draft.norm_output=true"] if eagle31 else []
    extra += [f"draft.num_layers={num_layers}"]
    extra += ["draft.type=p_eagle", "draft.step_decay=1.0"] if p_eagle else []
    # DFlash: one block drafts block_size - 1 = 5 tokens, enough for the tier's K = 3 and 5
    extra += ["draft.type=dflash", "draft.block_size=6", "train.dflash_anchors=32"] if dflash else []
    # JetSpec: the same block, causal inside it (vLLM serves it with dflash_config.causal true)
    extra += ["draft.type=jetspec", "draft.block_size=6", "train.dflash_anchors=32"] if jetspec else []
    # DSpark: slot 0 drafts too (sample_from_anchor), so a 5-slot block drafts 5 tokens (K = 5)
    extra += ["draft.type=dspark", "draft.block_size=5", "draft.markov_rank=32", "train.dflash_anchors=32"] if dspark else []
    # the draft's own embedding, trained and shipped as embed_tokens.weight (vLLM keeps a distinct one)
    extra += ["draft.train_embedding=true"] if train_embedding else []
    # EAGLE-1 (vLLM "eagle"): the whole target vocab, and a faster rate (feature regression learns slowly)
    if eagle1:
        with open(os.path.join(target, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        extra += ["draft.type=eagle", f"draft.draft_vocab_size={vocab}", "optim.lr=2e-2"]
    cfg = load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={out_dir}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=400", "data.seq_length=128",
        "data.batch_size=8", "data.val_fraction=0.05", "draft.ttt_steps=3", "draft.draft_vocab_size=128",
        "optim.lr=3e-3", "optim.warmup_ratio=0.1", f"train.steps={HEAD_STEPS}", "train.log_every=50",
        "train.eval_every=0", "train.eval_batches=1", "train.progress=false", "checkpoint.every_steps=100000",
        "export.dtype=float32", *extra])
    return train(cfg).export_dir


def llama_prompts(target: str, n: int) -> list[list[int]]:
    """The user turns of the last `n` demo conversations, chat-templated as specjax.eval does."""
    from importlib import resources

    from transformers import AutoTokenizer

    from specjax.data.chat import resolve_chat_template
    from specjax.eval.measure import render_prompt

    tok = AutoTokenizer.from_pretrained(target)
    template = resolve_chat_template(tok, None)
    text = resources.files("specjax").joinpath("assets/demo_chat.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()][-n:]
    return [render_prompt(tok, template, [next(m for m in r["messages"] if m["role"] == "user")]) for r in rows]


def target_eos_ids(target: str) -> tuple[int, ...]:
    """specjax.eval's EOS set: the tokenizer's (when the folder has one) + config/generation_config."""
    from specjax.eval.measure import eos_token_ids

    tok = None
    if os.path.isfile(os.path.join(target, "tokenizer.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
    return eos_token_ids(target, tok)


# ---------------------------------------------------------------------------------------------
# HF-built targets
def _hf_config(kind: str):
    import transformers

    common = dict(vocab_size=HF_VOCAB, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                  max_position_embeddings=1024, bos_token_id=None, eos_token_id=1, pad_token_id=0,
                  tie_word_embeddings=False)
    if kind == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=4, intermediate_size=128, **common)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(num_hidden_layers=4, intermediate_size=128, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                           mlp_only_layers=[1], **common)
    if kind in ("nemotron_h", "nemotron_h_dense"):  # dense: no MoE block (as Nemotron-H 8B)
        from specjax.targets import nemotron_h as nh

        third = nh.MLP if kind == "nemotron_h_dense" else nh.MOE
        return transformers.NemotronHConfig(
            layers_block_type=[nh.MAMBA, nh.ATTENTION, third, nh.MAMBA, nh.MLP, nh.ATTENTION],
            intermediate_size=96, mamba_num_heads=4, mamba_head_dim=32, n_groups=1, ssm_state_size=16,
            chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, n_group=1, topk_group=1, **common)
    raise ValueError(kind)


def _sharpen_(model, seed: int) -> None:
    """Larger weights than HF's std-0.02 init, so greedy continuations are far from ties (an fp32
    engine and fp32 JAX then agree on every argmax) and a short training run learns them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                continue  # keep HF's SSM init ranges
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif "lm_head" in name:  # logits std ~8: a peaked teacher, greedy far from ties
                p.copy_(1.0 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def build_hf_target(kind: str, path, *, seed: int = 0):
    """Save a tiny random `kind` model to `path`; return (path, the torch model)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(kind)).eval()
    _sharpen_(model, seed)
    model.save_pretrained(str(path))
    return str(path), model


def hf_prompts(n: int, length: int = 12, seed: int = 1) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [[int(x) for x in rng.randint(2, HF_VOCAB, length)] for _ in range(n)]


def greedy_corpus(model, n: int, prompt_len: int, new_tokens: int, seed: int = 2) -> np.ndarray:
    """[n, prompt_len + new_tokens] ids: random prompts and the model's greedy continuations (its own
    distribution, which the draft must predict at decode time)."""
    import torch

    rng = np.random.RandomState(seed)
    ids = torch.tensor(rng.randint(2, HF_VOCAB, (n, prompt_len)))
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=None)
    return out.numpy().astype(np.int32)


def train_direct_head(target_path: str, out_dir, corpus: np.ndarray | None, *, steps: int, batch_size: int = 8,
                      draft_vocab_size: int = 128, lr: float = 1e-2, seed: int = 0) -> str:
    """Train an EAGLE-3 head for `steps` jitted steps on `corpus` (all rows, every position in the
    loss), or leave it at its random init when corpus is None; export fp32. Returns the folder."""
    import jax
    import jax.numpy as jnp

    from specjax import mesh as meshlib
    from specjax.config import OptimConfig
    from specjax.drafts import eagle3
    from specjax.drafts.ttt import TTTConfig
    from specjax.drafts.vocab import build_draft_vocab
    from specjax.targets import load_target
    from specjax.train.optim import make_optimizer
    from specjax.train.step import build_step_fns, init_state
    from specjax_converters.eagle3_export import export_eagle3

    target = load_target(target_path, dtype="float32")
    aux = target.default_aux_layer_ids()
    counts = np.bincount(corpus.ravel(), minlength=HF_VOCAB) if corpus is not None else np.zeros(HF_VOCAB)
    vocab = build_draft_vocab(counts, draft_vocab_size)
    cfg = eagle3.config_from_target(target.config, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux)
    params = eagle3.init_draft_params(cfg, jax.random.key(seed))
    if corpus is not None and steps > 0:
        mesh = meshlib.make_mesh({"data": -1}, jax.devices()[:1])
        optimizer = make_optimizer(OptimConfig(lr=lr, warmup_ratio=0.0), steps)
        fns = build_step_fns(target, target.params, params, cfg, TTTConfig(ttt_steps=3), optimizer, mesh)
        tparams = jax.device_put(target.params, fns.target_shardings)
        varr = jax.device_put({"draft_ids": jnp.asarray(vocab.draft_ids, jnp.int32), "t2d": jnp.asarray(vocab.t2d),
                               "d2t": jnp.asarray(vocab.d2t, jnp.int32)}, fns.vocab_shardings)
        state = jax.jit(lambda p: init_state(p, optimizer), out_shardings=fns.state_shardings)(params)
        t = corpus.shape[1]
        fixed = {"loss_mask": np.ones((batch_size, t), np.int32), "segment_ids": np.ones((batch_size, t), np.int32),
                 "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (batch_size, t)).copy()}
        for step in range(steps):  # cycle over the corpus in batches of batch_size rows
            rows = np.arange(step * batch_size, (step + 1) * batch_size) % corpus.shape[0]
            batch = jax.device_put({k: jnp.asarray(v) for k, v in {"input_ids": corpus[rows], **fixed}.items()},
                                   fns.batch_sharding)
            state, metrics = fns.train_step(state, tparams, varr, batch)
        print(f"[engine] {target_path}: head trained {steps} steps, loss {float(metrics['loss']):.3f}, "
              f"acc {[round(float(a), 2) for a in metrics['acc_k']]}")
        params = state["params"]
    return export_eagle3(jax.device_get(params), cfg, vocab, target.hf_config, Path(out_dir), dtype="fp32")


# ---------------------------------------------------------------------------------------------
# The other target families (test_vllm_families.py): transformers configs shaped after the parity
# tests' tiny configs (tests/parity/test_targets_<family>.py), resized to what vLLM's CPU kernels take:
# attention head_dim 32 (CPU_ATTN), and for MLA a latent cache row of kv_lora_rank + qk_rope_head_dim
# = 512 + 64 = 576 values (CPU_MLA's decode kernel is compiled for that size only, DeepSeek-V3's).
FAMILY_KINDS = ("gpt_oss", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "minimax_m2", "qwen3_next", "qwen3_5",
                "qwen3_5_moe", "gemma3", "mistral", "mistral_sliding_window", "phi3", "deepseek_v32")
FAMILY_WINDOW = 8  # sliding windows shorter than the 12-token prompts plus 48 new tokens


def family_hf_config(kind: str):
    """The transformers config of the tiny `kind` target (one of FAMILY_KINDS)."""
    import transformers

    base = dict(vocab_size=HF_VOCAB, hidden_size=64, max_position_embeddings=1024, bos_token_id=None, eos_token_id=1,
                pad_token_id=0, tie_word_embeddings=False)
    gqa = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    mla = dict(num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=512, qk_rope_head_dim=64,
               qk_nope_head_dim=32, v_head_dim=32)
    moe = dict(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2)
    ds_yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
               "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
    # the YaRN context as transformers expects it, and the routing keys DeepSeek's config.json carries (transformers
    # drops them; vLLM reads them, and without them routes by softmax with no correction bias)
    ds_base = {**base, "max_position_embeddings": 64 * 40, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    if kind == "gpt_oss":  # sliding and full layers, attention sinks, biased clamped-SwiGLU experts, YaRN
        return transformers.GptOssConfig(
            num_hidden_layers=4, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=FAMILY_WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0},
            **gqa, **{**base, "max_position_embeddings": 16 * 32})
    if kind == "deepseek_v3":  # MLA with q LoRA and YaRN, a dense layer, grouped sigmoid routing + shared expert
        return transformers.DeepseekV3Config(
            num_hidden_layers=3, first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True, rope_parameters=ds_yarn,
            **mla, **moe, **ds_base)
    if kind == "deepseek_v32":  # DeepSeek-V3 plus the lightning indexer keeping 8 keys per query (its heads
        # rotate their first qk_rope_head_dim dims: index_head_dim >= 64)
        return transformers.DeepseekV32Config(
            num_hidden_layers=3, first_k_dense_replace=1, n_group=4, topk_group=2, n_shared_experts=1,
            norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=ds_yarn, index_topk=8, index_head_dim=64,
            index_n_heads=4, **mla, **moe, **ds_base)
    if kind == "glm4_moe":  # q/k/v biases, qk-norm, half-width RoPE, a dense layer, grouped MoE + shared expert
        return transformers.Glm4MoeConfig(
            num_hidden_layers=3, first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, n_group=2,
            topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            **gqa, **moe, **base)
    if kind == "glm4_moe_lite":  # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE
        return transformers.Glm4MoeLiteConfig(
            num_hidden_layers=3, first_k_dense_replace=1, n_group=1, topk_group=1, n_shared_experts=1,
            routed_scaling_factor=1.8, **mla, **moe, **base)
    if kind == "minimax_m2":  # full-width q/k norm, partial RoPE, sigmoid routing with a correction bias
        # with the published config's keys that vLLM reads (rotary_dim, scoring_func, use_routing_bias)
        return transformers.MiniMaxM2Config(
            num_hidden_layers=3, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, rotary_dim=16,
            scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer",
            shared_intermediate_size=0, **gqa, **base)
    if kind in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # Gated DeltaNet and gated attention, partial RoPE
        shape = dict(num_hidden_layers=4, layer_types=["linear_attention", "linear_attention", "full_attention",
                                                       "linear_attention"],
                     linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
                     linear_num_value_heads=4,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                     **gqa, **base)
        experts = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                       num_experts_per_tok=2)
        if kind == "qwen3_next":
            return transformers.Qwen3NextConfig(intermediate_size=96, mlp_only_layers=[3], **experts, **shape)
        if kind == "qwen3_5":
            return transformers.Qwen3_5TextConfig(intermediate_size=96, **shape)
        return transformers.Qwen3_5MoeTextConfig(**experts, **shape)
    if kind == "gemma3":  # sliding (own RoPE base) and global layers, (1 + w) norms, GeGLU, tied embeddings
        return transformers.Gemma3TextConfig(
            num_hidden_layers=4, intermediate_size=96, query_pre_attn_scalar=24, sliding_window=FAMILY_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}},
            **gqa, **{**base, "tie_word_embeddings": True})
    if kind in ("mistral", "mistral_sliding_window"):
        window = FAMILY_WINDOW if kind == "mistral_sliding_window" else None
        return transformers.MistralConfig(num_hidden_layers=4, intermediate_size=96, sliding_window=window,
                                          rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, **gqa, **base)
    if kind == "phi3":  # fused qkv and gate_up projections, RoPE on half of each head
        return transformers.Phi3Config(num_hidden_layers=4, intermediate_size=96, num_attention_heads=2,
                                       num_key_value_heads=1, partial_rotary_factor=0.5, **base)
    raise ValueError(f"unknown family {kind!r}; one of {FAMILY_KINDS}")


def build_family_target(kind: str, path, *, seed: int = 0):
    """Save the tiny random `kind` target (family_hf_config) to `path`, weights sharpened as
    build_hf_target's, expert-choice correction biases (buffers, which HF leaves at zero) drawn so
    that they steer the routing; return (path, the torch model)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_hf_config(kind)).eval()
    _sharpen_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
    model.save_pretrained(str(path))
    return str(path), model

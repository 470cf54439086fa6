"""The MTP draft (specjax.drafts.mtp, draft.type mtp) against independent references, fp32 on CPU.

Qwen3.5 (dense) and Qwen3.5-MoE: speculators 0.9.0's MTPDraftModel (models/mtp/core.py) on the same
weights and batch (the specjax tensors renamed to speculators' names by its own converter,
convert/mtp/converter.py: `_remap_key`, `_fuse_moe_experts`): every step's logits and the weighted
multi-step loss agree to REL_TOL (max |a - b| / max |b|). speculators' forward uses the rows t <
T - K - 1 of every step; the loss mask is zero on the last K - 1 tokens so both count the same rows.

DeepSeek-V3 and GLM-4.5: speculators has no MTP class for them, so the reference is torch built from
transformers' own decoder layer (DeepseekV3DecoderLayer / Glm4MoeDecoderLayer at layer index
num_hidden_layers, an MoE layer) around enorm / hnorm / eh_proj / shared_head.norm written from vLLM
0.32's deepseek_mtp.py (embedding zeroed at position 0; DeepSeek recycles the normed state, GLM the
pre-norm one): K-step logits to REL_TOL.

Also: the weight table's names are the checkpoint's (model.layers.{L}.* / mtp.*), reading them back
gives the same params, and config errors name the fix.
"""
from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.drafts import mtp  # noqa: E402
from specjax.targets import get_target_class  # noqa: E402

REL_TOL = 1e-5
K, T, V = 3, 12, 64


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def target_config(hf_cfg, arch):
    d = hf_cfg.to_dict()
    d["architectures"] = [arch]
    return get_target_class(arch).config_class.from_hf(d)


def qwen_hf(moe: bool):
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, rms_norm_eps=1e-6)
    if moe:
        return transformers.Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                 shared_expert_intermediate_size=24, **common), "Qwen3_5MoeForCausalLM"
    return transformers.Qwen3_5TextConfig(intermediate_size=48, **common), "Qwen3_5ForCausalLM"


def random_params(cfg, seed, scale=0.3):
    """Every leaf redrawn N(0, scale^2) (norm scales too), so a wrong norm, order or block moves the output."""
    p = mtp.init_params(cfg, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [scale * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])


def batch(seed, d):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, V, (1, T)).astype(np.int32)
    hidden = rng.randn(1, T, d).astype(np.float32)
    mask = np.ones((1, T), np.int32)
    mask[:, T - K + 1:] = 0  # speculators' rows: see the module doc
    mask[:, 3] = 0
    return ids, hidden, mask


def import_speculators_mtp():
    if "datasets" not in sys.modules:
        stub = types.ModuleType("datasets")
        stub.load_from_disk = stub.load_dataset = stub.concatenate_datasets = None
        stub.Dataset = type("Dataset", (), {})
        sys.modules["datasets"] = stub
    try:
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.convert.mtp.converter import MTPConverter
        from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig
        from speculators.models.mtp.core import compute_step_weights
        from speculators.proposals.greedy import GreedyTokenProposalConfig
    except ImportError as e:
        pytest.skip(f"speculators 0.9.0 does not import here: {e}")
    return types.SimpleNamespace(**locals())


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_mtp_equals_speculators(moe):
    sp = import_speculators_mtp()
    hf_cfg, arch = qwen_hf(moe)
    cfg = mtp.MtpConfig(target=target_config(hf_cfg, arch), num_steps=K)
    params = random_params(cfg, 0)
    rng = np.random.RandomState(1)
    embed, head = (rng.randn(V, 32).astype(np.float32) for _ in range(2))
    ids, hidden, mask = batch(2, 32)

    spec_cfg = sp.MTPSpeculatorConfig(
        transformer_layer_config=hf_cfg, speculators_config=sp.SpeculatorsConfig(
            algorithm="mtp", proposal_methods=[sp.GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy", verifier=sp.VerifierConfig(name_or_path=None, architectures=[arch])))
    model = sp.MTPDraftModel(spec_cfg).float().eval()
    native = mtp.file_tensors_of_params(params, cfg, np.float32)
    state = sp.MTPConverter._fuse_moe_experts(
        {sp.MTPConverter._remap_key(n): torch.from_numpy(a) for n, a in native.items()})
    state.update({"embed_tokens.weight": torch.from_numpy(embed), "lm_head.weight": torch.from_numpy(head)})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"verifier_lm_head.weight", "t2d", "d2t"}, (missing, unexpected)
    weights = sp.compute_step_weights(beta=0.6, num_steps=K)
    assert np.allclose(weights, mtp.step_weights(0.6, K), rtol=0, atol=1e-12)
    with torch.no_grad():
        ref_logits, ref_loss, _ = model(torch.from_numpy(ids).long(), torch.from_numpy(hidden),
                                        loss_mask=torch.from_numpy(mask), step_weights=weights)

    kw = dict(input_ids=jnp.asarray(ids), positions=jnp.arange(T, dtype=jnp.int32)[None],
              segment_ids=jnp.ones((1, T), jnp.int32), final_hidden=jnp.asarray(hidden), embed_table=jnp.asarray(embed))
    with jax.default_matmul_precision("highest"):
        outs = mtp.mtp_forward(params, cfg, **kw)
        loss, metrics = mtp.mtp_loss(params, cfg, loss_mask=jnp.asarray(mask), lm_head=jnp.asarray(head), **kw)
    valid = T - K - 1
    errs = [rel(mtp.logits_of(o, jnp.asarray(head))[:, :valid], r.numpy()) for o, r in zip(outs, ref_logits)]
    assert len(errs) == K and max(errs) < REL_TOL, errs
    assert rel(loss, ref_loss.numpy()) < REL_TOL, (float(loss), float(ref_loss))
    assert metrics["acc_k"].shape == (K,)


def test_names_and_read_back_are_the_checkpoint_layout():
    hf_cfg, arch = qwen_hf(True)
    cfg = mtp.MtpConfig(target=target_config(hf_cfg, arch))
    params = random_params(cfg, 3)
    native = mtp.file_tensors_of_params(params, cfg, np.float32)
    assert set(native) == set(mtp.file_tensor_names(cfg))
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.experts.3.down_proj.weight",
            "mtp.layers.0.mlp.shared_expert_gate.weight"} <= set(native)
    assert native["mtp.fc.weight"].shape == (32, 64)  # HF [out, in]
    back = mtp.params_from_file_tensors(cfg, native.__getitem__)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), params, back))


def test_unsupported_target_is_refused_naming_the_fix():
    from specjax.targets.llama import LlamaTargetConfig

    llama = LlamaTargetConfig.from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": 32,
                                       "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                       "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="has none specjax can train.*Fix: use another draft.type"):
        mtp.MtpConfig(target=llama).validate()


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 and GLM-4.5: transformers' decoder layer inside vLLM's MTP wrapper
# ---------------------------------------------------------------------------------------------
def deepseek_like_hf(kind):
    common = dict(vocab_size=V, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                  first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=1.5, rms_norm_eps=1e-6,
                  max_position_embeddings=128, num_nextn_predict_layers=1)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(intermediate_size=48, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                                             num_key_value_heads=4, rope_interleave=True,
                                             qk_rope_head_dim=4, v_head_dim=8, **common), "DeepseekV3ForCausalLM"
    return transformers.Glm4MoeConfig(intermediate_size=48, num_key_value_heads=2, head_dim=8, attention_bias=True,
                                      use_qk_norm=True, **common), "Glm4MoeForCausalLM"


def torch_deepseek_like_reference(kind, hf_cfg, native, prefix, embed, head, ids, hidden, steps):
    """vLLM 0.32's DeepSeekMultiTokenPredictorLayer / Glm4MoeMultiTokenPredictorLayer math around
    transformers' decoder layer at index num_hidden_layers: K teacher-forced steps' logits."""
    sp = import_speculators_mtp()
    if kind == "deepseek_v3":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        layer_cls, norm_cls, rope_cls = m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, m.DeepseekV3RotaryEmbedding
    else:
        from transformers.models.glm4_moe import modeling_glm4_moe as m
        layer_cls, norm_cls, rope_cls = m.Glm4MoeDecoderLayer, m.Glm4MoeRMSNorm, m.Glm4MoeRotaryEmbedding
    hf_cfg._attn_implementation = "eager"
    layer = layer_cls(hf_cfg, layer_idx=hf_cfg.num_hidden_layers).float().eval()
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
    block = {n[len(prefix):]: torch.from_numpy(a) for n, a in native.items()
             if not n[len(prefix):].startswith(own)}
    missing, unexpected = layer.load_state_dict(sp.MTPConverter._fuse_moe_experts(block), strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    norms = {}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        norms[name] = norm_cls(hf_cfg.hidden_size, eps=hf_cfg.rms_norm_eps)
        norms[name].weight.data = torch.from_numpy(native[prefix + name + ".weight"])
    eh_proj = torch.from_numpy(native[prefix + "eh_proj.weight"])
    T_ = ids.shape[1]
    pos = torch.arange(T_)[None]
    mask = torch.full((T_, T_), float("-inf")).triu(1)[None, None]
    pe = rope_cls(hf_cfg)(torch.zeros(1, T_, hf_cfg.hidden_size), pos)
    e_all, h = torch.from_numpy(embed), torch.from_numpy(hidden)
    ids_t = torch.from_numpy(ids).long()
    out = []
    with torch.no_grad():
        for k in range(steps):
            nxt = torch.cat([ids_t[:, k + 1:], torch.zeros(1, k + 1, dtype=torch.long)], dim=1)
            e = e_all[nxt]
            if k == 0:
                e = torch.where((pos == 0)[..., None], torch.zeros(()), e)
            u = torch.cat([norms["enorm"](e), norms["hnorm"](h)], dim=-1) @ eh_proj.T
            hp = layer(u, attention_mask=mask, position_ids=pos, position_embeddings=pe)
            hp = hp[0] if isinstance(hp, tuple) else hp
            normed = norms["shared_head.norm"](hp)
            out.append((normed @ torch.from_numpy(head).T).numpy())
            h = normed if kind == "deepseek_v3" else hp
    return out


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_deepseek_and_glm_mtp_equal_transformers_layer_in_vllms_wrapper(kind):
    hf_cfg, arch = deepseek_like_hf(kind)
    cfg = mtp.MtpConfig(target=target_config(hf_cfg, arch), num_steps=K)
    assert cfg.file_prefix == "model.layers.2." and mtp.recycles_normed(cfg) == (kind == "deepseek_v3")
    params = random_params(cfg, 7)
    # the router's correction bias steers the choice only: large, so a wrong routing shows
    params["ffn"]["router"]["e_score_correction_bias"] = 2.0 * params["ffn"]["router"]["e_score_correction_bias"]
    rng = np.random.RandomState(8)
    embed, head = (rng.randn(V, 32).astype(np.float32) for _ in range(2))
    ids, hidden, _ = batch(9, 32)
    native = mtp.file_tensors_of_params(params, cfg, np.float32)
    assert {"model.layers.2.enorm.weight", "model.layers.2.hnorm.weight", "model.layers.2.eh_proj.weight",
            "model.layers.2.shared_head.norm.weight", "model.layers.2.mlp.experts.3.up_proj.weight",
            "model.layers.2.mlp.gate.e_score_correction_bias", "model.layers.2.input_layernorm.weight"} <= set(native)
    ref = torch_deepseek_like_reference(kind, hf_cfg, native, cfg.file_prefix, embed, head, ids, hidden, K)
    with jax.default_matmul_precision("highest"):
        outs = mtp.mtp_forward(params, cfg, input_ids=jnp.asarray(ids), positions=jnp.arange(T, dtype=jnp.int32)[None],
                               segment_ids=jnp.ones((1, T), jnp.int32), final_hidden=jnp.asarray(hidden),
                               embed_table=jnp.asarray(embed))
    valid = T - K - 1
    errs = [rel(mtp.logits_of(o, jnp.asarray(head))[:, :valid], r[:, :valid]) for o, r in zip(outs, ref)]
    assert max(errs) < REL_TOL, errs


# ---------------------------------------------------------------------------------------------
# cached chain drafting == the forward, step by step
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen3_5_moe", "deepseek_v3", "glm4_moe"])
def test_draft_chain_equals_the_forward(kind):
    """draft_chain's K tokens (the one layer over its cache, as vLLM chains it) equal the uncached
    training-forward layer run over the pending rows plus the drafted rows (each reading the previous
    step's recycled state and drafted token at the next position), argmax by argmax; logits to 1e-5."""
    hf_cfg, arch = qwen_hf(True) if kind == "qwen3_5_moe" else deepseek_like_hf(kind)
    cfg = mtp.MtpConfig(target=target_config(hf_cfg, arch))
    params = random_params(cfg, 11)
    rng = np.random.RandomState(12)
    embed, head = (jnp.asarray(rng.randn(V, 32).astype(np.float32)) for _ in range(2))
    ids, hidden, _ = batch(13, 32)
    n, k = T - 2, 3
    dp = dict(params, target_lm_head=head)
    with jax.default_matmul_precision("highest"):
        toks, _, _ = mtp.draft_chain(dp, embed, jnp.zeros((V,), jnp.int32), mtp.init_decode_cache(cfg, 32, jnp.float32),
                                     jnp.asarray(ids[:, 1:n + 1]), (jnp.asarray(hidden[:, :n]),), jnp.int32(n),
                                     jnp.int32(0), jax.random.key(0), 1.0, dcfg=cfg, k=k, sample=False)
        rows_tok, rows_h = list(ids[0, 1:n + 1]), list(hidden[0, :n])
        want = []
        for j in range(k):
            m = len(rows_tok)
            pos = jnp.arange(m, dtype=jnp.int32)[None]
            emb = embed[jnp.asarray(rows_tok)][None]
            emb = jnp.where((pos == 0)[..., None], 0.0, emb) if mtp.masks_first_position(cfg) else emb
            inputs = mtp.forward_inputs(cfg, jnp.zeros((1, m), jnp.int32), pos, jnp.ones((1, m), jnp.int32),
                                        jnp.float32)
            rec, normed, _ = mtp.mtp_step(params, cfg, emb, jnp.asarray(np.stack(rows_h))[None], inputs)
            tok = int(jnp.argmax(mtp.logits_of(normed, head)[0, -1]))
            want.append(tok)
            rows_tok.append(tok)
            rows_h.append(np.asarray(rec[0, -1]))
    assert [int(t) for t in toks] == want


@pytest.mark.parametrize("softcap", [None, 7.0])
def test_token_ce_in_row_chunks_equals_the_dense_form(softcap):
    """mtp.token_ce (rows at a time, recomputed in the backward) gives the dense [B, T, V] form's
    cross-entropy, argmax and gradient with respect to h (fp32, 1e-6 rel), with a last chunk that is
    padding in part (B*T = 2*13 rows, chunks of 8), and builds no [B, T, V]-sized array."""
    rng = np.random.RandomState(3)
    h = jnp.asarray(rng.randn(2, 13, 16).astype(np.float32))
    head = jnp.asarray(rng.randn(50, 16).astype(np.float32))
    labels = jnp.asarray(rng.randint(0, 50, (2, 13)).astype(np.int32))
    w = jnp.asarray(rng.rand(2, 13).astype(np.float32))

    def dense(h):
        logits = mtp.logits_of(h, head, softcap)
        ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
        return ce, jnp.argmax(logits, -1)

    with jax.default_matmul_precision("highest"):
        ce, am = mtp.token_ce(h, head, labels, softcap, rows=8)
        ce_d, am_d = dense(h)
        g = jax.grad(lambda h: jnp.sum(mtp.token_ce(h, head, labels, softcap, rows=8)[0] * w))(h)
        g_d = jax.grad(lambda h: jnp.sum(dense(h)[0] * w))(h)
    assert rel(ce, ce_d) < 1e-6 and rel(g, g_d) < 1e-6
    assert np.array_equal(np.asarray(am), np.asarray(am_d))
    jaxpr = jax.make_jaxpr(jax.grad(lambda h: jnp.sum(mtp.token_ce(h, head, labels, softcap, rows=8)[0])))(h)
    sizes = [int(np.prod(v.aval.shape)) for eq in jaxpr.jaxpr.eqns for v in eq.outvars if hasattr(v.aval, "shape")]
    assert max(sizes) < 2 * 13 * 50, max(sizes)  # the largest block is one chunk's [8, 50] (sub-jaxprs aside)

"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, also Kimi K2's text model) vs transformers (PyTorch) on
tiny random checkpoints (CPU, fp32), plus its cached decoding, routers, YaRN tables, config table
and the real-shape configs in configs/targets/.

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state and
three aux states (aux id k = output of layer k, read from forward hooks on transformers' decoder
layers; the final hidden from a hook on its final norm). Two tiny variants, 4 layers, 8 routed
experts, both with YaRN RoPE read at positions past the original context:
  * "lora": query LoRA, first_k_dense_replace=1, top-4 of 8 in the 2 best of 4 groups, one shared
    expert, renormalised weights x 2.5, interleaved RoPE pairs, DeepSeek-V3's YaRN mscale rule
    (mscale = mscale_all_dim: cos/sin factor 1, softmax scale x mscale^2);
  * "plain_q": q_lora_rank=null (a plain q_proj), first_k_dense_replace=2, top-3 in 1 of 2 groups,
    two shared experts, raw weights x 1.7, half-split RoPE, mscale != mscale_all_dim (cos/sin
    factor != 1), v_head_dim larger than the query/key head.
Weights are redrawn larger than transformers' init (``parity._hf_weights.randomize_``) and the
routers' e_score_correction_bias buffers drawn N(0, 0.3^2), so routing, RoPE layout and norm mistakes
move the outputs far beyond the tolerance (test_each_detail_matters shows three of them do).

Cached decoding (the absorbed latent cache, layers/mla.py) equals the forward to 1e-4 relative for a
prefill written over a stale chunk after a rollback, single tokens and a chunk; a left-padded row
with logits_index; a tree-masked chunk; and lossless speculative decoding with a random EAGLE-3
head (whose RoPE is the target's YaRN) equals greedy decoding.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specjax.layers.rope import (  # noqa: E402
    RopeSpec,
    inverse_frequencies,
    rope_spec_from_hf,
    rope_tables,
    yarn_softmax_scale_factor,
)
from specjax.targets import get_target_class, load_target  # noqa: E402
from specjax.targets import deepseek_v3 as ds  # noqa: E402
from specjax.targets import hf_keys  # noqa: E402
from specjax.targets.layers import routers  # noqa: E402
from specjax.targets.loading import read_hf_config  # noqa: E402

from parity._hf_weights import hf_run, randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
VOCAB = 256
AUX = (0, 1, 3)  # the dense layer 0, layer 1 (MoE in "lora", dense in "plain_q"), the last layer (pre-norm)
DS_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
OTHER_YARN = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0, "mscale": 0.8, "mscale_all_dim": 1.2,
              "original_max_position_embeddings": 32, "beta_fast": 4, "beta_slow": 1}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=16, qk_rope_head_dim=8,
              qk_nope_head_dim=12, max_position_embeddings=4096, rms_norm_eps=1e-5)
VARIANTS = {
    "lora": dict(q_lora_rank=24, v_head_dim=10, first_k_dense_replace=1, n_group=4, topk_group=2,
                 num_experts_per_tok=4, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                 rope_interleave=True, rope_parameters=DS_YARN),
    "plain_q": dict(q_lora_rank=None, v_head_dim=24, first_k_dense_replace=2, n_group=2, topk_group=1,
                    num_experts_per_tok=3, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.7,
                    rope_interleave=False, rope_parameters=OTHER_YARN),
}


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(0, VOCAB, (b, t)).astype(np.int32)


def _hf_config(variant, **kw):
    return transformers.DeepseekV3Config(**{**COMMON, **VARIANTS[variant], **kw})


@pytest.fixture(scope="module")
def tmp_mod(tmp_path_factory):
    return tmp_path_factory.mktemp("deepseek_v3")


def _make(tmp_mod, variant, seed):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(variant)).eval()
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a buffer, so randomize_ leaves it at zero
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))
    path = tmp_mod / variant
    model.save_pretrained(str(path))
    return model, str(path), load_target(str(path), dtype="float32")


@pytest.fixture(scope="module")
def cases(tmp_mod):
    return {v: _make(tmp_mod, v, seed) for v, seed in (("lora", 1), ("plain_q", 2))}


# =============================================================================================
# Parity with transformers
# =============================================================================================
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parity(cases, variant):
    model, path, target = cases[variant]
    cfg = target.config
    assert target.arch == "DeepseekV3ForCausalLM" and isinstance(cfg, ds.DeepseekV3TargetConfig)
    k = VARIANTS[variant]["first_k_dense_replace"]
    assert cfg.mlp_layer_ids == tuple(range(k)) and cfg.moe_layer_ids == tuple(range(k, 4))
    p = target.params
    assert p["moe_layers"]["experts"]["gate_proj"]["kernel"].shape == (4 - k, 8, 64, 32)
    assert p["moe_layers"]["shared_experts"]["up_proj"]["kernel"].shape == (4 - k, 64, 32 * cfg.n_shared_experts)
    assert p["moe_layers"]["router"]["e_score_correction_bias"].shape == (4 - k, 8)
    assert ("q_proj" in p["layers"]["self_attn"]) == (cfg.q_lora_rank is None)
    # expert 5 of the last layer is that expert's on-disk tensor, transposed
    w = model.model.layers[3].mlp.experts.gate_up_proj[5, :32].detach().numpy()
    np.testing.assert_array_equal(np.asarray(p["moe_layers"]["experts"]["gate_proj"]["kernel"][-1, 5]), w.T)

    ids = _ids(2, 24, seed=3)
    positions = np.broadcast_to(np.arange(24, dtype=np.int32) + 300, (2, 24)).copy()  # past the original context
    out = target(ids, aux_layer_ids=AUX, positions=positions)
    logits, calls, final = hf_run(model, ids, positions)
    errs = {"logits": rel_err(out.logits, logits), "final": rel_err(out.final_hidden, final)}
    errs.update({f"aux{a}": rel_err(h, calls[a]) for a, h in zip(AUX, out.aux_hidden)})
    print(f"{variant}: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    assert max(errs.values()) <= REL_TOL, errs


def test_each_detail_matters(cases):
    """The parity above is not vacuous: YaRN, the RoPE pair layout and the correction bias each move
    the logits by far more than the tolerance."""
    _, _, target = cases["lora"]
    ids = _ids(1, 16, seed=4)
    positions = np.arange(16, dtype=np.int32)[None] + 300
    ref = target(ids, aux_layer_ids=AUX, positions=positions).logits
    cfg = target.config
    cls = type(target)
    no_bias = jax.tree.map(lambda x: x, target.params)
    no_bias["moe_layers"]["router"]["e_score_correction_bias"] = jnp.zeros_like(
        no_bias["moe_layers"]["router"]["e_score_correction_bias"])
    changed = {
        "plain RoPE": cls(dataclasses.replace(cfg, rope=RopeSpec("default", 10000.0)), {}, target.params),
        "half-split RoPE": cls(dataclasses.replace(cfg, rope_interleave=False), {}, target.params),
        "no correction bias": cls(cfg, {}, no_bias),
    }
    for name, other in changed.items():
        moved = rel_err(other(ids, aux_layer_ids=AUX, positions=positions).logits, ref)
        assert moved > 1e-2, (name, moved)


def test_bf16_load_keeps_the_router_fp32(cases):
    _, path, t32 = cases["lora"]
    t16 = load_target(path, dtype="bfloat16")
    router = t16.params["moe_layers"]["router"]
    assert router["kernel"].dtype == jnp.float32 and router["e_score_correction_bias"].dtype == jnp.float32
    assert t16.params["layers"]["self_attn"]["kv_b_proj"]["kernel"].dtype == jnp.bfloat16
    ids = _ids(2, 16, seed=5)
    out = t16(ids)
    assert out.logits.dtype == jnp.float32 and out.final_hidden.dtype == jnp.bfloat16
    assert rel_err(out.logits, t32(ids).logits) <= 5e-2


def test_mtp_layers_on_disk_are_ignored(cases, tmp_mod):
    """The published checkpoints carry the MTP module as layer num_hidden_layers (transformers skips
    it); a tensor of a layer past those is still unexpected."""
    from safetensors.numpy import load_file, save_file

    _, path, target = cases["lora"]
    folder = tmp_mod / "with_mtp"
    shutil.copytree(path, folder)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    tensors["model.layers.4.eh_proj.weight"] = np.zeros((64, 128), np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    assert target.hf_config["num_nextn_predict_layers"] == 1  # transformers' default
    jax.tree.map(np.testing.assert_array_equal, load_target(str(folder), dtype="float32").params, target.params)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.4\.eh_proj\.weight"):
        load_target(str(folder), dtype="float32")


# =============================================================================================
# Cached decoding (absorbed MLA over the latent cache) == the forward
# =============================================================================================
def _decoder(target, aux_ids):
    return jax.jit(lambda c, i, p, s, m=None, vf=None, li=None: target.decode_chunk(
        target.params, c, i, p, s, aux_layer_ids=aux_ids, chunk_mask=m, valid_from=vf, logits_index=li))


def _close(got, want, what):
    err = rel_err(got, want)
    assert err <= REL_TOL, f"{what}: rel err {err:.2e} > {REL_TOL}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decoding_equals_forward(cases, variant):
    _, _, target = cases[variant]
    ids = jnp.asarray(_ids(2, 12, seed=6))
    full = target(ids, aux_layer_ids=AUX)
    cache = target.init_cache(2, 40)
    assert jax.tree.map(lambda x: x.shape, cache) == {"kv": (4, 2, 256, 16), "k_rope": (4, 2, 256, 8)}
    decode = _decoder(target, AUX)
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    at = lambda s: jnp.full((2,), s, jnp.int32)  # noqa: E731
    # a wrong 5-token chunk at slot 3 first (stale entries), then roll back to 0: prefill 5, two
    # single tokens, a chunk of 5 (two chunk shapes: two compilations)
    cache = decode(cache, ids[:, ::-1][:, :5], pos[:, 3:8], at(3))[3]
    pieces = []
    for a, b in [(0, 5), (5, 6), (6, 7), (7, 12)]:
        logits, aux, final, cache = decode(cache, ids[:, a:b], pos[:, a:b], at(a))
        pieces.append((logits, aux, final))
    _close(np.concatenate([p[0] for p in pieces], 1), full.logits, "logits")
    _close(np.concatenate([p[2] for p in pieces], 1), full.final_hidden, "final hidden")
    for k in range(len(AUX)):
        _close(np.concatenate([p[1][k] for p in pieces], 1), full.aux_hidden[k], f"aux {AUX[k]}")
    assert np.abs(np.asarray(full.logits)).max() > 1.0  # O(1) logits: the comparison is not trivial
    # every layer's latent and RoPE-key rows are read: corrupting either at the valid slots moves token 6
    ref6 = np.asarray(pieces[2][0][:, 0])
    prefix = (jnp.arange(256) < 6)[None, :, None]
    for leaf in ("kv", "k_rope"):
        for layer in range(4):
            bad = dict(cache, **{leaf: cache[leaf].at[layer].set(jnp.where(prefix, 1.0, cache[leaf][layer]))})
            moved = rel_err(decode(bad, ids[:, 6:7], pos[:, 6:7], at(6))[0][:, 0], ref6)
            assert moved > 1e-4, (leaf, layer, moved)


def test_left_padding_and_logits_index(cases):
    # row 0: a 6-token prompt at slots 0..5 then 3 junk tokens; row 1: 3 pad tokens, then the prompt
    # (positions 0..5; the chunk mask hides the pads, later calls pass valid_from=3). Both rows'
    # logits at logits_index, then one token per row at starts 6 and 9, equal the forward.
    _, _, target = cases["lora"]
    ids = _ids(1, 7, seed=7)
    full = target(jnp.asarray(ids), aux_layer_ids=AUX)
    p = ids[0, :6]
    chunk = np.stack([np.concatenate([p, [0, 0, 0]]), np.concatenate([[7, 7, 7], p])]).astype(np.int32)
    pos = np.stack([np.arange(9), np.concatenate([[0, 0, 0], np.arange(6)])]).astype(np.int32)
    causal = np.tril(np.ones((9, 9), bool))
    mask = np.stack([causal, causal & ((np.arange(9)[None, :] >= 3) | np.eye(9, dtype=bool))])
    valid_from = jnp.asarray([0, 3], jnp.int32)
    decode = _decoder(target, AUX)
    logits, aux, final, cache = decode(target.init_cache(2, 16), jnp.asarray(chunk), jnp.asarray(pos),
                                       jnp.zeros((2,), jnp.int32), jnp.asarray(mask), valid_from,
                                       jnp.asarray([[5], [8]], jnp.int32))
    assert logits.shape == (2, 1, VOCAB)
    for r in range(2):
        _close(logits[r, 0], full.logits[0, 5], f"row {r} prefill logits")
    _close(final[1, 3:], full.final_hidden[0, :6], "padded row final hidden")
    nxt = jnp.full((2, 1), ids[0, 6], jnp.int32)
    logits, aux, _, _ = decode(cache, nxt, jnp.full((2, 1), 6, jnp.int32), jnp.asarray([6, 9], jnp.int32), None,
                               valid_from)
    for r in range(2):
        _close(logits[r, 0], full.logits[0, 6], f"row {r} next logits")
        _close(aux[-1][r, 0], full.aux_hidden[-1][0, 6], f"row {r} next aux")


def test_tree_chunk_matches_paths(cases):
    # cached x0..x4; a tree chunk: node0 = x5 (root), node1 = x6 (child of 0), node2 = y (child of 0),
    # node3 = z (child of 2), ancestor mask, positions by depth: node i equals its path's forward
    _, _, target = cases["plain_q"]
    x = _ids(1, 7, seed=8)[0]
    y, z = (int(x[6]) + 1) % VOCAB, 13
    paths = np.stack([np.concatenate([x[:7], [0]]), np.concatenate([x[:6], [y, z]])])
    full = target(jnp.asarray(paths), aux_layer_ids=AUX)
    decode = _decoder(target, AUX)
    cache = decode(target.init_cache(1, 16), jnp.asarray(x[None, :5]), jnp.arange(5)[None],
                   jnp.zeros((1,), jnp.int32))[3]
    nodes = np.array([[x[5], x[6], y, z]], np.int32)
    anc = np.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], bool)
    logits, aux, _, _ = decode(cache, jnp.asarray(nodes), jnp.asarray(5 + np.array([[0, 1, 1, 2]])),
                               jnp.full((1,), 5, jnp.int32), jnp.asarray(anc))
    for node, (row, t) in enumerate([(0, 5), (0, 6), (1, 6), (1, 7)]):
        _close(logits[0, node], full.logits[row, t], f"node {node} logits")
        _close(aux[1][0, node], full.aux_hidden[1][row, t], f"node {node} aux")


def test_lossless_speculative_decoding(cases):
    """A random EAGLE-3 head (its RoPE the target's YaRN) drafting for the target: chain speculative
    decoding emits exactly the target's greedy tokens (a rollback at every rejection)."""
    from specjax.drafts.eagle3 import config_from_target, init_draft_params
    from specjax.drafts.vocab import DraftVocab
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import Draft, SpecDecoder

    _, _, target = cases["lora"]
    prompt, n = [5, 17, 3, 9, 11, 2, 40], 10
    ref = generate(target, [prompt], max_new_tokens=n)[0]
    dcfg = config_from_target(target.config, draft_vocab_size=128, aux_layer_ids=target.default_aux_layer_ids())
    assert dcfg.rope == target.config.rope and dcfg.rope.rope_type == "yarn"
    draft = Draft(init_draft_params(dcfg, jax.random.key(0)), dcfg, DraftVocab.from_ids(np.arange(0, VOCAB, 2), VOCAB))
    res = SpecDecoder(target, draft, num_spec_tokens=3).generate(prompt, max_new_tokens=n)
    assert res.tokens == ref and len(set(ref)) > 1


# =============================================================================================
# Routers vs transformers
# =============================================================================================
ROUTER_CASES = [  # (E, k, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    (8, 4, 4, 2, True, 2.5),
    (8, 3, 1, 1, False, 1.7),
    (16, 6, 8, 3, True, 2.827),
]


@pytest.mark.parametrize("case", ROUTER_CASES)
def test_sigmoid_router_matches_transformers(case):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    e, k, n_group, topk_group, norm, scale = case
    hf_cfg = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group,
                                           topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    router = DeepseekV3TopkRouter(hf_cfg)
    g = torch.Generator().manual_seed(e + k)
    with torch.no_grad():
        router.weight.copy_(0.5 * torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(e, generator=g))
    x = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        _, hf_w, hf_ids = router(x)
    w_de, bias = router.weight.detach().numpy().T, router.e_score_correction_bias.numpy()
    logits = routers.router_logits(jnp.asarray(x.numpy()), jnp.asarray(w_de))

    def ours(bias=bias, n_group=n_group, topk_group=topk_group):
        return routers.sigmoid_topk(logits, k, correction_bias=None if bias is None else jnp.asarray(bias),
                                    n_group=n_group, topk_group=topk_group, renormalize=norm, scaling_factor=scale)

    ids, w = ours()
    order_hf, order = np.argsort(hf_ids.numpy(), 1), np.argsort(np.asarray(ids), 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1),
                                  np.take_along_axis(hf_ids.numpy(), order_hf, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(hf_w.numpy(), order_hf, 1), rtol=1e-6, atol=1e-7)
    # the correction bias and (where configured) the group limit change some token's choice
    chosen = lambda r: {tuple(sorted(row)) for row in np.asarray(r[0]).tolist()}  # noqa: E731
    assert chosen(ours(bias=None)) != chosen((ids, w))
    if n_group > 1:
        assert chosen(ours(n_group=1, topk_group=1)) != chosen((ids, w))


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_qwen3_moe(norm):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(hidden_size=32, num_experts=8, num_experts_per_tok=3,
                                                            norm_topk_prob=norm))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        x = torch.randn(40, 32, generator=g)
        _, hf_w, hf_ids = router(x)
    ids, w = routers.softmax_topk(routers.router_logits(jnp.asarray(x.numpy()), jnp.asarray(router.weight.detach().numpy().T)),
                                  3, renormalize=norm)
    np.testing.assert_array_equal(np.asarray(ids), hf_ids.numpy())  # both sorted by probability
    np.testing.assert_allclose(np.asarray(w), hf_w.numpy(), rtol=1e-5, atol=1e-7)


def test_topk_softmax_router_matches_gpt_oss():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    router = GptOssTopKRouter(transformers.GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=4))
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.bias.copy_(torch.randn(8, generator=g))
        x = torch.randn(40, 32, generator=g)
        _, hf_w, hf_ids = router(x)
    logits = routers.router_logits(jnp.asarray(x.numpy()), jnp.asarray(router.weight.detach().numpy().T),
                                   jnp.asarray(router.bias.detach().numpy()))
    ids, w = routers.topk_softmax(logits, 4)
    np.testing.assert_array_equal(np.asarray(ids), hf_ids.numpy())
    np.testing.assert_allclose(np.asarray(w), hf_w.numpy(), rtol=1e-5, atol=1e-7)


def test_grouped_topk_config_errors():
    with pytest.raises(ValueError, match="n_routed_experts=10 must split into n_group=4"):
        routers.check_grouped_topk(10, 2, 4, 2, "X")
    with pytest.raises(ValueError, match="topk_group=5 must be in 1..n_group=4"):
        routers.check_grouped_topk(8, 2, 4, 5, "X")
    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in 1..4 \(the experts of the topk_group=2"):
        routers.check_grouped_topk(8, 5, 4, 2, "X")


# =============================================================================================
# YaRN vs transformers' rope init
# =============================================================================================
YARN_CASES = {  # name: (rope_parameters, rope dim, max_position_embeddings)
    "deepseek_v3": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, 64, 163840),
    "kimi_k2": ({"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                 "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}, 64, 131072),
    "mscale_differs": (OTHER_YARN, 8, 4096),
    "no_mscale_untruncated": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "truncate": False,
                               "original_max_position_embeddings": 2048}, 32, 8192),
    "explicit_attention_factor": ({"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "attention_factor": 0.7,
                                   "mscale_all_dim": 0.5, "original_max_position_embeddings": 1024}, 16, 16384),
}


@pytest.mark.parametrize("name", sorted(YARN_CASES))
def test_yarn_matches_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    params, dim, max_pos = YARN_CASES[name]
    hf_cfg = transformers.DeepseekV3Config(qk_rope_head_dim=dim, max_position_embeddings=max_pos,
                                           rope_parameters=dict(params))
    spec = rope_spec_from_hf(hf_cfg.to_dict(), yarn=True)
    assert spec.rope_type == "yarn"
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    # torch's float32 pow is not always correctly rounded (ours is): 1 ulp apart at most
    np.testing.assert_array_max_ulp(inverse_frequencies(spec, dim), hf_inv.numpy(), maxulp=1)
    assert math.isclose(spec.attention_factor, hf_factor, rel_tol=1e-12)
    assert math.isclose(yarn_softmax_scale_factor(spec), yarn_apply_mscale(hf_cfg.rope_parameters, 1.0),
                        rel_tol=1e-12)
    # the tables of a call, cos/sin factor included; a frequency 1 ulp apart moves the float32 angle
    # at position p by p ulp of the frequency plus one ulp of the angle, which bounds the difference
    # beside float32 cos/sin rounding
    positions = np.array([[0, 1, 5, 700, 4095, 9000]], np.int32)
    cos, sin = DeepseekV3RotaryEmbedding(hf_cfg)(torch.zeros(1), torch.tensor(positions, dtype=torch.long))
    ours = rope_tables(spec, dim, jnp.asarray(positions), jnp.float32)
    freq = np.tile(hf_inv.numpy(), 2)
    angle_ulp = np.spacing((positions[..., None] * freq).astype(np.float32))
    bound = 2e-6 + (positions[..., None] * np.spacing(freq) + angle_ulp) * max(1.0, spec.attention_factor)
    for got, want in zip(ours, (cos.numpy(), sin.numpy())):
        assert (np.abs(np.asarray(got) - want) <= bound).all(), np.abs(np.asarray(got) - want).max()
    # the spec survives its own HF dict and a JSON round trip (run_meta.json)
    assert rope_spec_from_hf({"rope_parameters": spec.to_hf(), "max_position_embeddings": max_pos}, yarn=True) == spec
    assert RopeSpec(**json.loads(json.dumps(dataclasses.asdict(spec)))) == spec


def test_yarn_layouts_and_refusals():
    legacy = {"rope_theta": 10000, "max_position_embeddings": 163840,
              "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                               "original_max_position_embeddings": 4096, "type": "yarn"}}
    new = {"max_position_embeddings": 163840, "rope_parameters": dict(YARN_CASES["deepseek_v3"][0])}
    assert rope_spec_from_hf(legacy, yarn=True) == rope_spec_from_hf(new, yarn=True)
    # a family that does not build yarn tables refuses it (Llama, Qwen3, ...)
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        rope_spec_from_hf(new)
    with pytest.raises(ValueError, match="needs a 'factor'"):
        rope_spec_from_hf({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, yarn=True)
    # no yarn: the softmax scale stays the head's own
    assert yarn_softmax_scale_factor(RopeSpec()) == 1.0


# =============================================================================================
# Config table and errors
# =============================================================================================
def _table_test_config():
    """Every table key away from its default (a key dropped on either side changes the result)."""
    return transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=5,
        num_attention_heads=6, num_key_value_heads=6, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=2, n_group=3,
        topk_group=2, first_k_dense_replace=2, norm_topk_prob=False, routed_scaling_factor=1.25, rope_interleave=False,
        num_mtp_layers=2, rms_norm_eps=3e-6, tie_word_embeddings=True, max_position_embeddings=777,
        rope_parameters={"rope_type": "yarn", "rope_theta": 12345.0, "factor": 3.0, "mscale": 0.9,
                         "mscale_all_dim": 0.7, "original_max_position_embeddings": 256, "beta_fast": 16,
                         "beta_slow": 2})


def test_to_hf_round_trips_through_transformers():
    hf = _table_test_config().to_dict()
    cfg = ds.DeepseekV3TargetConfig.from_hf(hf)
    written = cfg.to_hf()
    assert ds.DeepseekV3TargetConfig.from_hf(written) == cfg
    assert not [row.key for row in ds.HF_KEYS if row.key not in written], "a key of the table is not written"
    for row in ds.HF_KEYS:
        if not callable(row.default) and row.default is not hf_keys.REQUIRED:
            assert getattr(cfg, row.field_name) != row.convert(row.default), f"{row.key} is at its default"
    assert cfg.rope.rope_type == "yarn" and cfg.num_nextn_predict_layers == 2
    through = transformers.DeepseekV3Config(
        **{k: v for k, v in written.items() if k not in ("architectures", "model_type")}).to_dict()
    through["architectures"] = written["architectures"]
    assert ds.DeepseekV3TargetConfig.from_hf(through) == cfg
    # q_lora_rank null (a plain q_proj) survives both directions too
    plain = dataclasses.replace(cfg, q_lora_rank=None)
    assert plain.to_hf()["q_lora_rank"] is None and ds.DeepseekV3TargetConfig.from_hf(plain.to_hf()) == plain
    # a model_type-only config finds the architecture
    assert get_target_class({"model_type": "deepseek_v3"}) is ds.DeepseekV3Target


def test_config_errors():
    hf = {**_table_test_config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    awq = {"quant_method": "awq", "bits": 4}  # FP8 and compressed-tensors are read (test_targets_fp8.py, ..._compressed_tensors.py)
    bad = {
        "quantization_config": (awq, r"quant_method='awq' is not read.*dequantize the checkpoint"),
        "scoring_func": ("softmax", r"scoring_func='softmax' is not supported"),
        "topk_method": ("greedy", r"topk_method='greedy' is not supported"),
        "num_key_value_heads": (2, r"num_key_value_heads=2 must equal num_attention_heads=6"),
        "attention_bias": (True, "attention_bias=true is not supported"),
        "first_k_dense_replace": (7, r"first_k_dense_replace=7 must be in 0..num_hidden_layers=5"),
        "num_experts_per_tok": (9, r"num_experts_per_tok=9 must be in 1..8"),
        "rope_parameters": ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, r"rope type 'linear'"),
    }
    for key, (value, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            ds.DeepseekV3TargetConfig.from_hf({**hf, key: value})
    with pytest.raises(ValueError, match="has no q_lora_rank"):
        ds.DeepseekV3TargetConfig.from_hf({k: v for k, v in hf.items() if k != "q_lora_rank"})


# =============================================================================================
# The real shapes (configs/targets/deepseek_v3, configs/targets/kimi_k2)
# =============================================================================================
# Published: DeepSeek-V3 "671B total parameters, 37B activated" (the main model; the 685B on the Hub
# adds the 14B multi-token-prediction module, which targets ignore). Kimi K2: "1T total, 32B
# activated". The exact totals are the sums of the tensor shapes below, e_score_correction_bias
# (E per MoE layer) included, as transformers' DeepseekV3ForCausalLM holds them (parameters +
# that buffer); embeddings and lm_head (untied) count in both totals and active counts.
def _expected(V, D, L, k_dense, E, H, vocab_tied=False, Q=1536, R=512, dr=64, dn=128, dv=128, I=18432, F=2048, k=8):
    attn = D * Q + Q + Q * H * (dn + dr) + D * (R + dr) + R + R * H * (dn + dv) + H * dv * D + 2 * D
    dense, moe = 3 * D * I, E * 3 * D * F + 3 * D * F + E * D + E
    total = k_dense * (attn + dense) + (L - k_dense) * (attn + moe) + (1 if vocab_tied else 2) * V * D + D
    return total, total - (L - k_dense) * (E - k) * 3 * D * F


REAL = {  # folder: (exact total, exact active, published total, published active)
    "deepseek_v3": (*_expected(129280, 7168, 61, 3, 256, 128), 671e9, 37e9),
    "kimi_k2": (*_expected(163840, 7168, 61, 1, 384, 64), 1.0e12, 32e9),
}


@pytest.mark.parametrize("folder", sorted(REAL))
def test_real_config_counts_the_published_parameters(repo_root, folder):
    from specjax.targets import abstract

    hf = read_hf_config(os.path.join(repo_root, "configs", "targets", folder))
    target = abstract.make_target(hf)
    cfg = target.config
    total = sum(math.prod(s.shape) for s in target.weight_specs(cfg))
    exact, active, published, published_active = REAL[folder]
    print(f"{folder}: {total:,} params ({total / 1e9:.2f} B), {target.active_params_per_token():,} active")
    assert total == exact and target.active_params_per_token() == active
    assert abs(total - published) / published < 0.03 and abs(active - published_active) / published_active < 0.03
    if folder == "deepseek_v3":
        assert total == 671_026_419_200  # 671,026,404,352 parameters + 58 x 256 correction biases
        leaves = {"/".join(s.path): s.shape for s in target.weight_specs(cfg)}
        assert leaves["moe_layers/experts/gate_proj/kernel"] == (58, 256, 7168, 2048)
        assert leaves["layers/self_attn/kv_b_proj/kernel"] == (61, 512, 128 * 256)
        assert leaves["mlp_layers/up_proj/kernel"] == (3, 7168, 18432)
        assert cfg.rope.rope_type == "yarn" and cfg.rope.attention_factor == 1.0
        assert math.isclose(cfg.mla.softmax_scale, 192**-0.5 * (0.1 * math.log(40) + 1) ** 2)
        # the training attention's head width: 192 = max(128 + 64, 128); 256 where a GPU flash kernel
        # (powers of two only) may run it
        from specjax.targets.layers.mla import attention_width
        from specjax_kernels.selection import platform_override

        assert attention_width(cfg.mla) == 192
        with platform_override("gpu"):
            assert attention_width(cfg.mla) == 256
            assert attention_width(dataclasses.replace(cfg.mla, implementation="xla")) == 192
        assert ds.DeepseekV3Target.ignored_hf_names(cfg, "model.layers.61.eh_proj.weight")
        assert not ds.DeepseekV3Target.ignored_hf_names(cfg, "model.layers.62.eh_proj.weight")
        # transformers reads the same model from the file
        assert ds.DeepseekV3TargetConfig.from_hf(transformers.DeepseekV3Config.from_dict(hf).to_dict()) == cfg
        # the forward and the latent cache at full size, abstractly (nothing allocated)
        params = abstract.abstract_params(type(target), cfg, "bfloat16")
        ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)
        final, aux = jax.eval_shape(lambda p, i: target.forward(p, i, aux_layer_ids=(1, 29, 57)), params, ids)
        assert final.shape == (1, 16, 7168) and final.dtype == jnp.bfloat16 and len(aux) == 3
        cache = jax.eval_shape(lambda: target.decoder.init_cache(cfg, 1, 300, jnp.bfloat16))
        assert cache["kv"].shape == (61, 1, 512, 512) and cache["k_rope"].shape == (61, 1, 512, 64)

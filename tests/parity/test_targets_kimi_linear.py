"""Kimi Linear (``KimiLinearForCausalLM``, ``specjax.targets.kimi_linear``) vs transformers (PyTorch CPU
fallbacks: chunk_kimi_delta_attention, eager MLA, fp32) on tiny random checkpoints, plus its cached
decoding, config reading and the real-shape config in configs/targets/kimi_linear_48b_a3b.

Parity metric: rel = max|ours - ref| / max|ref| <= 1e-4 for the logits, the final hidden state and three
aux states (aux id k = output of transformers' layer k, forward hooks; parity._hf_weights.assert_matches_hf)
on taps in both mixer types. Two tiny variants, 5 layers each:
  * "release": Moonshot's layout: the layer schedule from linear_attn_config's 1-based kda_layers
    [1, 3, 4] / full_attn_layers [2, 5], a plain q_proj, conv kernel 4, one dense layer then MoE layers
    with 3 of 6 experts in the best 1 of 2 groups; the checkpoint rewritten to the release's tensor names
    (dense layer under ``mlp.``) and config keys;
  * "lora": transformers' default schedule (full attention at layer 4), a query LoRA, conv kernel 3,
    two dense layers, two shared experts, top-2 weights not renormalised; the checkpoint as
    transformers 5.25 saves it.
Both have 2 KDA heads of 8 channels and 4 MLA heads (nope 8 + shared 4, value 6, latent 12). The weights
are redrawn larger than transformers' init (parity._hf_weights.randomize_), the decay rates exp(A_log)
spread over 0.05..0.5 and the routers' e_score_correction_bias drawn N(0, 0.1^2), so the per-channel
decays, the routing and the output gate all move the outputs far beyond the tolerance
(test_each_detail_matters).

Packed rows (segment ids; left and trailing padding) equal transformers on each document alone. Cached
decoding equals the forward to 1e-5: a prefill longer than the state window resumed after its
logits_index rows, a rolled-back chunk, a resume inside the last chunk, and a tree chunk with the
commit of any path (commit_path_fn re-labels the KDA states and moves the MLA latents). Left padding,
single tokens and the decoding loops: the kimi_linear entry of parity/test_decoding_families.py.
Every target forward here runs at one shape ([2, 19]) so it compiles once per variant.
"""
from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from specjax.targets import load_target  # noqa: E402
from specjax.targets import kimi_linear as kl  # noqa: E402  (importing it registers KimiLinearForCausalLM)
from specjax.targets.loading import read_hf_config  # noqa: E402

from parity._hf_weights import assert_matches_hf, hf_run, randomize_, rel_err  # noqa: E402

REL_TOL = 1e-4
DECODE_TOL = 1e-5
VOCAB = 96
AUX = (0, 1, 4)  # 0: KDA, 1: MLA (release) / KDA (lora), 4: the last layer (pre-norm)
WINDOW = 8  # decode_state_window: a chunk of 9+ rows takes the long-chunk path
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=5,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
              v_head_dim=6, num_local_experts=6, pad_token_id=0, bos_token_id=1, eos_token_id=2)
VARIANTS = {
    "release": dict(q_lora_rank=None, num_experts_per_tok=3, n_group=2, topk_group=1, first_k_dense_replace=1,
                    linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4,
                                        "kda_layers": [1, 3, 4], "full_attn_layers": [2, 5]}),
    "lora": dict(q_lora_rank=8, num_experts_per_tok=2, first_k_dense_replace=2, n_shared_experts=2,
                 norm_topk_prob=False, linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 3}),
}
# the release config.json's keys beside transformers' (kept at the values transformers implements)
RELEASE_KEYS = {"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1,
                "use_grouped_topk": True, "num_nextn_predict_layers": 0, "head_dim": 72, "rope_theta": 10000.0,
                "rope_scaling": None}


def _hf_config(variant: str):
    """transformers' config of a tiny variant (also the compile-only case, tests/e2e)."""
    return transformers.KimiLinearConfig(**COMMON, **VARIANTS[variant])


def _ids(b, t, seed=0):
    return np.random.RandomState(seed).randint(3, VOCAB, (b, t)).astype(np.int32)


def _to_release_layout(path):
    """Rewrite a save_pretrained folder with the release's names: dense layers under ``mlp.`` (transformers
    5.25 writes them under ``block_sparse_moe.``), the release's config keys, no layer_types /
    mlp_layer_types (the schedule comes from linear_attn_config and first_k_dense_replace)."""
    file = os.path.join(path, "model.safetensors")
    tensors = safetensors_torch.load_file(file)
    dense = {n: n.replace(".block_sparse_moe.", ".mlp.") for n in tensors
             if ".block_sparse_moe." in n and n.split(".")[-2] in ("gate_proj", "up_proj", "down_proj")
             and ".shared_experts." not in n}
    assert dense, "no dense layer written under block_sparse_moe"
    safetensors_torch.save_file({dense.get(n, n): t for n, t in tensors.items()}, file, metadata={"format": "pt"})
    cfg_file = os.path.join(path, "config.json")
    hf = json.load(open(cfg_file))
    for key in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim"):
        hf.pop(key, None)
    json.dump({**hf, **RELEASE_KEYS}, open(cfg_file, "w"))


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """variant -> (transformers model, checkpoint folder, target loaded in fp32 with decode_state_window WINDOW)."""
    out = {}
    for seed, name in enumerate(sorted(VARIANTS)):
        torch.manual_seed(seed)
        model = transformers.KimiLinearForCausalLM(_hf_config(name)).eval()
        model.config._attn_implementation = "eager"
        randomize_(model, seed=10 + seed)
        g = torch.Generator().manual_seed(20 + seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("A_log"):  # decay rates exp(A_log) in 0.05..0.5 (slow to fast memory)
                    p.copy_(torch.linspace(0.05, 0.5, p.numel()).log().view(p.shape))
            for n, b in model.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.copy_(0.1 * torch.randn(b.shape, generator=g))
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        if name == "release":
            _to_release_layout(path)
        out[name] = (model, path, load_target(path, dtype="float32", decode_state_window=WINDOW))
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward_matches_transformers(cases, variant):
    model, _, target = cases[variant]
    assert type(target) is kl.KimiLinearTarget
    want = [kl.LINEAR, kl.FULL, kl.LINEAR, kl.LINEAR, kl.FULL] if variant == "release" else [kl.LINEAR] * 4 + [kl.FULL]
    assert list(target.config.layer_types) == want == list(model.config.layer_types)
    assert target.config.first_k_dense_replace == model.config.mlp_layer_types.count("dense")
    ids = _ids(2, 19, seed=1)
    assert_matches_hf(target, model, ids, None, AUX, REL_TOL, variant)


def test_both_on_disk_layouts_load_the_same(cases, tmp_path_factory):
    """The release's names (dense layer under mlp.) and transformers' save_pretrained names load the same
    params; the dense layer's tensors under an unknown module are refused by name."""
    model, path, target = cases["release"]
    saved = str(tmp_path_factory.mktemp("saved"))
    model.save_pretrained(saved)
    other = load_target(saved, dtype="float32", decode_state_window=WINDOW)
    assert target.config == other.config
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), target.params, other.params)
    assert all(jax.tree.leaves(same))
    names = safetensors_torch.load_file(os.path.join(path, "model.safetensors"))
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.5.w3.weight" in names


def test_packed_and_padded_documents_equal_transformers_alone(cases):
    """Row 0: 3 left pads (segment 0) then a document; row 1: two documents then 3 trailing pads. Each
    document's rows equal transformers on that document alone (the KDA state and conv window and the
    MLA mask restart at every segment)."""
    model, _, target = cases["release"]
    rng = np.random.RandomState(2)
    docs = [rng.randint(3, VOCAB, n).astype(np.int32) for n in (16, 7, 9)]
    ids = np.zeros((2, 19), np.int32)
    seg = np.zeros((2, 19), np.int32)
    ids[0, 3:], seg[0, 3:] = docs[0], 1
    ids[1, :7], seg[1, :7] = docs[1], 2
    ids[1, 7:16], seg[1, 7:16] = docs[2], 3
    out = target(jnp.asarray(ids), aux_layer_ids=AUX, segment_ids=jnp.asarray(seg))
    for doc, (row, lo) in zip(docs, [(0, 3), (1, 0), (1, 7)]):
        logits, calls, final = hf_run(model, doc[None])
        rows = slice(lo, lo + len(doc))
        errs = {"logits": rel_err(out.logits[row, rows], logits[0]),
                "final": rel_err(out.final_hidden[row, rows], final[0])}
        errs.update({f"aux{a}": rel_err(h[row, rows], calls[a][0]) for a, h in zip(AUX, out.aux_hidden)})
        assert max(errs.values()) <= REL_TOL, (row, lo, errs)
    # not vacuous: without segments the second document of row 1 sees the first
    leaky = target(jnp.asarray(ids), aux_layer_ids=AUX)
    assert rel_err(leaky.logits[1, 7:16], out.logits[1, 7:16]) > 1e-2


def test_each_detail_matters(cases):
    """The parity above is not vacuous: a per-head decay (f_b_proj's columns and dt_bias averaged over
    each head's channels), the routers' correction bias and the KDA output gate each move the logits by
    far more than the tolerance."""
    _, _, target = cases["release"]
    ids = _ids(2, 19, seed=3)  # the shape the parity test compiled
    ref = target(ids, aux_layer_ids=AUX).logits
    cfg, cls = target.config, type(target)

    def changed(**edits):  # "kda/dt_bias" -> fn of the leaf
        params = jax.tree.map(lambda x: x, target.params)
        for path, fn in edits.items():
            *up, leaf = path.split("/")
            node = params
            for key in up:
                node = node[key]
            node[leaf] = fn(node[leaf])
        return rel_err(cls(cfg, {}, params)(ids, aux_layer_ids=AUX).logits, ref)

    def head_mean(x):  # last axis = 2 heads x 8 channels: each head's channels at their mean
        split = x.reshape(x.shape[:-1] + (2, 8))
        return jnp.broadcast_to(split.mean(-1, keepdims=True), split.shape).reshape(x.shape)

    moved = {  # the decay's pre-activation equal over each head's channels: a per-head (Gated DeltaNet) decay
             "per-head decay": changed(**{"kda/dt_bias": head_mean, "kda/f_b_proj/kernel": head_mean}),
             "no correction bias": changed(**{"moe_layers/router/e_score_correction_bias": jnp.zeros_like}),
             "constant output gate": changed(**{"kda/g_b_proj/kernel": jnp.zeros_like})}
    print(", ".join(f"{name} {err:.1e}" for name, err in moved.items()))
    for name, err in moved.items():
        assert err > 1e-2, (name, err)


# =============================================================================================
# Cached decoding == the forward
# =============================================================================================
@pytest.fixture(scope="module")
def dec(cases):
    _, _, target = cases["release"]
    decode = jax.jit(lambda c, i, s, m=None, vf=None, li=None: target.decode_chunk(
        target.params, c, i, jnp.zeros_like(i), s, aux_layer_ids=AUX, chunk_mask=m, valid_from=vf, logits_index=li))
    return target, decode


def _check(out, r, t, ref, ref_row, ref_t, what=""):
    for got, want in [(out[0], ref.logits), (out[2], ref.final_hidden)] + list(zip(out[1], ref.aux_hidden)):
        err = rel_err(np.asarray(got)[r, t], np.asarray(want)[ref_row, ref_t])
        assert err <= DECODE_TOL, f"{what}: rel err {err:.2e}"


def test_cached_decoding_equals_forward(dec):
    """A prefill of 13 rows (longer than the window: the chunked rule for its head) keeping the states
    after its logits_index rows (row 0's prompt is 9 long), resumed there with 3 tokens per row; the same
    3 rolled back and re-run (stale cache entries); then resumed one token later (the window kept the
    state after every row of the 3)."""
    target, decode = dec
    ids = jnp.asarray(_ids(2, 19, seed=4))  # the shape the parity test compiled
    ref = target(ids, aux_layer_ids=AUX)
    cfg = target.config
    cache = target.init_cache(2, 40)
    assert cache["kv"].shape == (2, 2, 256, 12) and cache["k_rope"].shape == (2, 2, 256, 4)
    assert cache["conv"].shape == (3, 2, WINDOW, 3, cfg.conv_dim) and cache["delta"].shape == (3, 2, WINDOW, 2, 8, 8)
    lens = jnp.asarray([9, 13], jnp.int32)
    out = decode(cache, ids[:, :13], jnp.zeros((2,), jnp.int32), None, None, (lens - 1)[:, None])
    for r in (0, 1):
        assert rel_err(out[0][r, 0], ref.logits[r, int(lens[r]) - 1]) <= DECODE_TOL
    cache = out[3]
    take = lambda lo: jnp.stack([ids[r, int(lo[r]):int(lo[r]) + 3] for r in (0, 1)])  # noqa: E731
    for start, what in ((lens, "resume"), (lens, "rolled back"), (lens + 1, "one later")):
        res = decode(cache, take(start), start)
        for r in (0, 1):
            lo = int(start[r])
            _check(res, r, slice(0, 3), ref, r, slice(lo, lo + 3), f"{what}, row {r}")
        cache = res[3]


def test_tree_chunk_and_commit(dec):
    """Prefix x0..x2 cached; a 4-node tree at slot 3 (node 0 = x3, node 3 under node 2); each node equals
    the forward of its root-to-node path, and after committing any path the next 3 tokens continue as
    that path's forward."""
    target, decode = dec
    rng = np.random.RandomState(5)
    x = rng.randint(3, VOCAB, 4).astype(np.int32)
    nodes = rng.randint(3, VOCAB, 4).astype(np.int32)
    nodes[0] = x[3]
    paths = [[0], [0, 1], [0, 2], [0, 2, 3]]
    anc = np.zeros((4, 4), bool)
    for i, path in enumerate(paths):
        anc[i, path] = True
    nxt = rng.randint(3, VOCAB, 3).astype(np.int32)
    seqs = np.zeros((4, 19), np.int32)
    for i, path in enumerate(paths):
        seqs[i, :3 + len(path) + 3] = np.concatenate([x[:3], nodes[path], nxt])
    refs = [target(jnp.asarray(seqs[j:j + 2]), aux_layer_ids=AUX) for j in (0, 2)]  # the parity test's shape
    zero2 = jnp.zeros((2,), jnp.int32)
    cache = decode(target.init_cache(2, 24), jnp.asarray(np.broadcast_to(x[:3], (2, 3))), zero2)[3]
    at3 = jnp.full((2,), 3, jnp.int32)
    out = decode(cache, jnp.asarray(np.broadcast_to(nodes, (2, 4))), at3, jnp.asarray(np.broadcast_to(anc, (2, 4, 4))))
    commit = jax.jit(type(target).commit_path_fn)
    for i, path in enumerate(paths):
        a, (ref, row) = len(path) - 1, (refs[i // 2], i % 2)
        _check(out, 0, slice(i, i + 1), ref, row, slice(3 + a, 4 + a), f"node {i}")
        c = commit(out[3], jnp.int32(3), jnp.asarray(path + [0] * (3 - len(path)), jnp.int32), jnp.int32(a))
        start = jnp.full((2,), 4 + a, jnp.int32)
        res = decode(c, jnp.asarray(np.broadcast_to(nxt, (2, 3))), start)
        _check(res, 0, slice(0, 3), ref, row, slice(4 + a, 7 + a), f"after committing node {i}")


# =============================================================================================
# Config reading
# =============================================================================================
def test_config_reads_as_transformers_reads_it():
    """The layer schedule and feed-forward kinds from each spelling (layer_types, linear_attn_config's
    1-based lists, the default; mlp_layer_types, first_k_dense_replace) equal transformers' config's; to_hf
    round-trips through KimiLinearConfig; the release's key names and transformers' aliases read the same."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=9,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
                v_head_dim=6,
                num_experts=8, num_experts_per_token=2, num_expert_group=2, topk_group=1, pad_token_id=0)
    spellings = [
        {},
        {"first_k_dense_replace": 3,
         "linear_attn_config": {"kda_layers": [1, 2, 4, 5, 6, 8, 9], "full_attn_layers": [3, 7], "head_dim": 16,
                                "num_heads": 3, "short_conv_kernel_size": 2}},
        {"layer_types": [kl.FULL] * 2 + [kl.LINEAR] * 7, "mlp_layer_types": ["dense"] * 4 + ["sparse"] * 5},
    ]
    for extra in spellings:
        hf = {**base, **extra, "architectures": [kl.ARCH]}
        theirs = transformers.KimiLinearConfig(**{k: v for k, v in hf.items() if k != "architectures"})
        cfg = kl.KimiLinearTargetConfig.from_hf(hf)
        assert list(cfg.layer_types) == theirs.layer_types, extra
        assert [("sparse" if cfg.is_moe(i) else "dense") for i in range(9)] == theirs.mlp_layer_types, extra
        assert (cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim) == (
            theirs.linear_head_dim, theirs.linear_num_heads, theirs.linear_conv_kernel_dim)
        assert kl.KimiLinearTargetConfig.from_hf({**theirs.to_dict(), "architectures": [kl.ARCH]}) == cfg
        written = cfg.to_hf()
        assert kl.KimiLinearTargetConfig.from_hf(written) == cfg
        through = transformers.KimiLinearConfig(**{k: v for k, v in written.items()
                                                   if k not in ("architectures", "model_type")}).to_dict()
        assert kl.KimiLinearTargetConfig.from_hf({**through, "architectures": [kl.ARCH]}) == cfg
    aliases = {"num_local_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "n_shared_experts": 2,
               "norm_topk_prob": False, "max_position_embeddings": 777}
    plain = {k: v for k, v in base.items() if k not in ("num_experts", "num_experts_per_token", "num_expert_group")}
    cfg = kl.KimiLinearTargetConfig.from_hf({**plain, **aliases, "architectures": [kl.ARCH]})
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.n_shared_experts, cfg.norm_topk_prob,
            cfg.max_position_embeddings) == (8, 2, 2, 2, False, 777)


def test_config_errors_name_the_key_and_the_fix():
    hf = {"architectures": [kl.ARCH], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "kv_lora_rank": 12,
          "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 6, "num_experts": 8, "num_experts_per_token": 2,
          "linear_attn_config": {"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                                 "full_attn_layers": [3]}}
    kl.KimiLinearTargetConfig.from_hf(hf)
    lac = hf["linear_attn_config"]
    bad = {
        "mla_use_nope": (False, r"mla_use_nope=False is not supported.*Fix"),
        "moe_router_activation_func": ("softmax", r"moe_router_activation_func='softmax' is not supported"),
        "moe_layer_freq": (2, r"moe_layer_freq=2 is not supported"),
        "attn_res_block_size": (12, r"attn_res_block_size=12 is not supported.*no such feature"),
        "num_key_value_heads": (2, r"num_key_value_heads=2 must equal num_attention_heads=4"),
        "attention_bias": (True, r"attention_bias=true is not supported"),
        "hidden_act": ("gelu", r"hidden_act='gelu' is not supported"),
        "quantization_config": ({"quant_method": "fp8"}, r"quantization_config is not supported.*Fix: the bf16"),
        "num_local_experts": (6, r"num_experts=8 and its alias num_local_experts=6 disagree"),
        "linear_attn_config": ({**lac, "gate_lower_bound": -5.0}, r"linear_attn_config keys \['gate_lower_bound'\]"),
        "layer_types": ([kl.LINEAR] * 4, r"layer_types .* disagrees with linear_attn_config"),
        "mlp_layer_types": (["dense", "sparse", "dense", "sparse"], r"dense layer after a sparse one"),
        "first_k_dense_replace": (7, r"first_k_dense_replace=7 must be in 0..num_hidden_layers=4"),
        "num_experts_per_token": (9, r"num_experts_per_tok=9 must be in 1..8"),
        "tie_word_embeddings": (True, r"tie_word_embeddings=true is not supported.*ties nothing"),
    }
    for key, (value, match) in bad.items():
        with pytest.raises(ValueError, match=match):
            kl.KimiLinearTargetConfig.from_hf({**hf, key: value})
    with pytest.raises(ValueError, match=r"use_grouped_topk=false and num_expert_group=2"):
        kl.KimiLinearTargetConfig.from_hf({**hf, "use_grouped_topk": False, "num_expert_group": 2})
    with pytest.raises(ValueError, match=r"must together list each of the 1-based layers 1..4 exactly once"):
        kl.KimiLinearTargetConfig.from_hf({**hf, "linear_attn_config": {**lac, "kda_layers": [1, 2]}})
    with pytest.raises(ValueError, match=r"linear_head_dim=16 but linear_attn_config.head_dim=8"):
        kl.KimiLinearTargetConfig.from_hf({**hf, "linear_head_dim": 16})


# =============================================================================================
# The real shape (configs/targets/kimi_linear_48b_a3b)
# =============================================================================================
def test_real_config_counts_the_published_parameters(repo_root):
    """Published (Moonshot's README): 48 B total, 3 B activated. The weight table gives 49.12 B with the
    embedding and lm_head (48.37 B without), 3.48 B active per token (2.73 B without them): the sums of
    the tensor shapes below, checked exactly, and within 3 % / 10 % of the published round numbers."""
    from specjax.targets import abstract

    hf = read_hf_config(os.path.join(repo_root, "configs", "targets", "kimi_linear_48b_a3b"))
    target = abstract.make_target(hf)
    cfg = target.config
    V, D, L, I = 163840, 2304, 27, 9216
    N, nope, rope, vd, R = 32, 128, 64, 128, 512
    H, Dk, K = 32, 128, 4
    E, F, k, shared = 256, 1024, 8, 1
    C = H * Dk
    mla_layer = D * N * (nope + rope) + D * (R + rope) + R + R * N * (nope + vd) + N * vd * D
    kda_layer = 3 * D * C + 3 * K * C + 2 * (D * Dk + Dk * C) + C + H + D * H + Dk + C * D
    moe_layer = D * E + E + E * 3 * D * F + 3 * D * F * shared
    total = 2 * V * D + D + L * 2 * D + 7 * mla_layer + 20 * kda_layer + 3 * D * I + 26 * moe_layer
    got = sum(math.prod(s.shape) for s in target.weight_specs(cfg))
    active = target.active_params_per_token()
    print(f"kimi_linear_48b_a3b: {got:,} params ({got / 1e9:.2f} B), {active:,} active ({active / 1e9:.2f} B)")
    assert got == total == 49_122_681_728
    assert active == total - 26 * (E - k) * 3 * D * F == 3_484_459_904
    assert abs(got - 48e9) / 48e9 < 0.03 and abs(active - 2 * V * D - 3e9) / 3e9 < 0.1
    assert cfg.layer_types.count(kl.FULL) == 7 and cfg.layers_of(kl.FULL)[:2] == (3, 7) and cfg.mlp_layer_ids == (0,)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.routed_scaling_factor) == (256, 8, 1, 2.446)
    through = transformers.KimiLinearConfig.from_dict(hf).to_dict()
    assert kl.KimiLinearTargetConfig.from_hf({**through, "architectures": hf["architectures"]}) == cfg
    # the forward and the cache at full size, abstractly (nothing allocated)
    params = abstract.abstract_params(type(target), cfg, "bfloat16")
    assert params["moe_layers"]["router"]["kernel"].dtype == jnp.float32
    assert params["kda"]["dt_bias"].dtype == jnp.float32 and params["kda"]["A_log"].dtype == jnp.bfloat16
    ids = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    final, aux = jax.eval_shape(lambda p, i: target.forward(p, i, aux_layer_ids=(1, 13, 23)), params, ids)
    assert final.shape == (1, 16, D) and final.dtype == jnp.bfloat16 and len(aux) == 3
    cache = jax.eval_shape(lambda: kl.init_cache(cfg, 1, 4096, jnp.bfloat16))
    assert cache["kv"].shape == (7, 1, 4096, 512) and cache["delta"].shape == (20, 1, 24, 32, 128, 128)
    assert cache["conv"].shape == (20, 1, 24, 3, 3 * C)
    hash(cfg)  # a jit static argument: hashable

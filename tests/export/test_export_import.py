"""Import of published heads (specjax_converters.eagle3_import) and warm start (`draft.init_from`).

* import -> export reproduces the tensors byte for byte: our own exports (bf16 and fp32: the whole
  model.safetensors and config.json are identical), a SpecForge-saved head (every exported tensor
  equals the source's; embed_tokens dropped), a speculators-saved EAGLE-3.1 head (same, after
  layers.0. -> midlayer.);
* the imported speculators head runs in JAX with speculators' own logits (steps 0..2, <= 1e-4);
* heads specjax cannot run faithfully are refused with the reason;
* warm start: shapes/taps checked against the run, lm_head rows matched by target token id.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from export._heads import AUX, H, HEAD_DIM, INTER, LLAMA3_ROPE, N_HEADS, N_KV, V, VD, import_speculators, inputs, \
    jax_logits, make_draft, rel_err, speculators_head, speculators_logits, target_config, write_target
from specjax.drafts import eagle3
from specjax.drafts.vocab import DraftVocab
from specjax_converters.eagle3_export import export_eagle3
from specjax_converters.eagle3_import import read_head, warm_start_params


def _sha(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _raw(path):
    """tensor name -> (dtype, shape, raw bytes) straight from the safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items()}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_specjax_export_round_trip_is_byte_identical(tmp_path, dtype):
    target_hf, cfg, params, vocab = make_draft(seed=1, fc_norm=(dtype == "fp32"), norm_output=(dtype == "fp32"))
    a = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "a", dtype=dtype)
    head = read_head(a)
    assert head.config == cfg and head.layout == "llama" and head.notes == ()
    assert head.dtype == {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    np.testing.assert_array_equal(head.vocab.d2t, vocab.d2t)
    b = export_eagle3(head.params, head.config, head.vocab, target_hf, tmp_path / "b", dtype=head.dtype)
    for name in ("model.safetensors", "config.json"):
        assert _sha(os.path.join(a, name)) == _sha(os.path.join(b, name)), name


def _specforge_head(folder, seed=0):
    """A head saved from SpecForge's own draft class with a SpecForge-style config (legacy RoPE keys,
    no aux ids, embed_tokens in the file), bf16 like published heads."""
    pytest.importorskip("torch")
    pytest.importorskip("specforge")
    from parity._specforge import draft_class, torch
    from safetensors.torch import save_file as save_torch
    from transformers import LlamaConfig

    conf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": INTER, "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV,
            "head_dim": HEAD_DIM, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "vocab_size": V, "draft_vocab_size": VD, "max_position_embeddings": 4096, "rope_theta": 500000.0,
            "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "pad_token_id": 0}
    torch.manual_seed(seed)
    model = draft_class()(LlamaConfig(**conf), attention_backend="sdpa")
    sd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in model.state_dict().items()}
    ids = torch.arange(VD, dtype=torch.int64) * 2 + 1
    sd["d2t"] = ids - torch.arange(VD)
    sd["t2d"] = torch.zeros(V, dtype=torch.bool)
    sd["t2d"][ids] = True
    os.makedirs(folder, exist_ok=True)
    save_torch(sd, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(conf, f)
    return str(folder)


def test_specforge_head_imports_and_reexports_its_tensors(tmp_path):
    src = _specforge_head(tmp_path / "sf")
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids: absent.*Fix: pass target_config"):
        read_head(src)
    # no aux ids in the head: it was trained on the engines' default taps [1, L//2-1, L-4]
    target_hf = target_config(num_hidden_layers=12)
    head = read_head(src, target_config=target_hf)
    assert head.config.aux_layer_ids == (1, 5, 8) and head.dtype == "bfloat16"
    assert any("embed_tokens.weight ignored" in n for n in head.notes)
    out = export_eagle3(head.params, head.config, head.vocab, target_hf, tmp_path / "out", dtype=head.dtype)
    ours, theirs = _raw(os.path.join(out, "model.safetensors")), _raw(os.path.join(src, "model.safetensors"))
    assert set(theirs) - set(ours) == {"embed_tokens.weight"}
    for k in ours:
        assert ours[k] == theirs[k], k  # dtype, shape and bytes


def test_speculators_head_imports_runs_and_reexports(tmp_path):
    sp = import_speculators()
    target_hf = target_config()
    embed = write_target(tmp_path / "target", target_hf)
    model = speculators_head(sp, tmp_path / "spec", tmp_path / "target", fc_norm=True, norm_output=True, seed=3)
    head = read_head(tmp_path / "spec")
    cfg = head.config
    assert head.layout == "speculators" and cfg.fc_norm and cfg.norm_output and cfg.aux_layer_ids == AUX
    assert head.dtype == "float32"
    # speculators' model (its own forward, target embedding from the verifier folder) vs JAX on the import
    model._load_verifier_weights(overwrite_embed_tokens=True)
    data = inputs(seed=5)
    ref = speculators_logits(model, data, 3)
    ours = jax_logits(head.params, cfg, data, embed, 3)
    errs = [rel_err(a, b) for a, b in zip(ours, ref)]
    print("imported speculators head, JAX vs speculators per step:", ["%.1e" % e for e in errs])
    assert max(errs) <= 1e-4
    out = export_eagle3(head.params, cfg, head.vocab, target_hf, tmp_path / "out", dtype=head.dtype)
    ours_t = _raw(os.path.join(out, "model.safetensors"))
    theirs = {k.replace("layers.0.", "midlayer."): v for k, v in _raw(tmp_path / "spec" / "model.safetensors").items()}
    assert set(theirs) - set(ours_t) == {"embed_tokens.weight"}  # speculators saves its (frozen) embedding copy
    for k in ours_t:
        assert ours_t[k] == theirs[k], k


def test_legacy_names_and_model_prefix_are_read(tmp_path):
    target_hf, cfg, params, vocab = make_draft(seed=2, fc_norm=True)
    a = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "a", dtype="fp32")
    t = load_file(os.path.join(a, "model.safetensors"))
    legacy = {"fc_norm.0.weight": "aux_norm_low.weight", "fc_norm.1.weight": "aux_norm_mid.weight",
              "fc_norm.2.weight": "aux_norm_high.weight"}
    t = {("model." + legacy.get(k, k) if k not in ("d2t", "t2d") else k): v for k, v in t.items()}
    conf = json.loads(open(os.path.join(a, "config.json")).read())
    del conf["fc_norm"]  # pre-flag heads only had the aux_norm_* tensors
    os.makedirs(tmp_path / "b")
    save_file(t, str(tmp_path / "b" / "model.safetensors"))
    (tmp_path / "b" / "config.json").write_text(json.dumps(conf))
    head = read_head(tmp_path / "b")
    assert head.config.fc_norm and any("aux_norm_low.weight->fc_norm.0.weight" in n for n in head.notes)
    for i in range(3):
        np.testing.assert_array_equal(head.params["fc_norm"][str(i)]["scale"], params["fc_norm"][str(i)]["scale"])


@pytest.mark.parametrize("problem", ["norm_before_residual", "zero_layers", "two_layers_one_present", "input_norm",
                                     "no_d2t"])
def test_heads_specjax_cannot_run_are_refused(tmp_path, problem):
    target_hf, cfg, params, vocab = make_draft(seed=2)
    a = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "a", dtype="fp32")
    t = load_file(os.path.join(a, "model.safetensors"))
    conf = json.loads(open(os.path.join(a, "config.json")).read())
    field = problem
    if problem == "norm_before_residual":
        conf["norm_before_residual"] = True
    elif problem == "zero_layers":
        conf["num_hidden_layers"] = 0
        field = "num_hidden_layers"
    elif problem == "two_layers_one_present":  # the config says 2 layers, the file holds one
        conf["num_hidden_layers"] = 2
        field = "layers.1.input_layernorm.weight"
    elif problem == "input_norm":
        t["input_norm.weight"] = np.ones(3 * H, np.float32)
        field = "norm_before_fc"
    else:
        del t["d2t"]
        field = "d2t"
    os.makedirs(tmp_path / "b")
    save_file(t, str(tmp_path / "b" / "model.safetensors"))
    (tmp_path / "b" / "config.json").write_text(json.dumps(conf))
    # zero layers is refused by config.json's sanity checks (specjax.hf_config_checks), the rest by the importer
    with pytest.raises(ValueError, match=rf"(cannot import .*|/config\.json): {field}: .*Fix: "):
        read_head(tmp_path / "b")


def _family_target(kind):
    """A tiny target of a family whose RoPE the draft copies: gpt-oss (YaRN), Phi-3 (LongRoPE on half of
    each head), GLM-4.5 (partial 0.5), MiniMax-M2 (partial through the legacy rotary_dim)."""
    import transformers

    from specjax.targets.abstract import make_target

    common = dict(vocab_size=V, hidden_size=H, num_attention_heads=N_HEADS, num_key_value_heads=N_KV,
                  head_dim=HEAD_DIM, num_hidden_layers=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "yarn":
        conf = transformers.GptOssConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=512, rope_parameters={
                                             "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False, "original_max_position_embeddings": 16,
                                             "rope_theta": 150000.0}, **common)
    elif kind == "longrope_partial":
        half = HEAD_DIM // 4  # factors per rotated pair: half of each head rotates
        conf = transformers.Phi3Config(intermediate_size=INTER, max_position_embeddings=256,
                                       original_max_position_embeddings=64, partial_rotary_factor=0.5,
                                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                        "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                                        "long_factor": [2.0 + 0.2 * i for i in range(half)]},
                                       **common)
    elif kind == "rotary_dim":  # MiniMax-M2's config.json as published: rotary_dim + rope_theta, no rope_parameters
        conf = transformers.MiniMaxM2Config(intermediate_size=INTER, num_local_experts=4, num_experts_per_tok=2,
                                            **common)
        hf = {k: v for k, v in conf.to_dict().items() if k not in ("rope_parameters", "partial_rotary_factor")}
        hf.update(architectures=["MiniMaxM2ForCausalLM"], rope_theta=5e6, rotary_dim=HEAD_DIM // 2)
        return hf, make_target(hf).config
    else:
        conf = transformers.Glm4MoeConfig(intermediate_size=INTER, moe_intermediate_size=16, n_routed_experts=4,
                                          num_experts_per_tok=2, first_k_dense_replace=1, partial_rotary_factor=0.5,
                                          **common)
    hf = conf.to_dict()
    hf["architectures"] = [type(conf).__name__.replace("Config", "ForCausalLM")]
    return hf, make_target(hf).config


@pytest.mark.parametrize("kind", ["yarn", "longrope_partial", "partial", "rotary_dim"])
def test_heads_with_the_targets_rope_import_as_exported(tmp_path, kind):
    """A head trained for a YaRN / LongRoPE / partial-RoPE target carries that RoPE (the draft's
    positions are the target's): specjax.eval's importer reads it back into the same draft config and
    tensors, so such heads can be measured (it used to refuse every RoPE but default/linear/llama3)."""
    target_hf, tcfg = _family_target(kind)
    cfg = eagle3.config_from_target(tcfg, draft_vocab_size=VD, aux_layer_ids=AUX)
    assert cfg.rope.rope_type != "default" or cfg.rope.partial_rotary_factor != 1.0
    params = jax.tree_util.tree_map(np.asarray, eagle3.init_draft_params(cfg, jax.random.key(0)))
    vocab = DraftVocab.from_ids(np.arange(VD), V)
    a = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "a", dtype="fp32")
    head = read_head(a)
    assert head.config == cfg, (head.config.rope, cfg.rope)
    for k, v in jax.tree_util.tree_leaves_with_path(params):
        np.testing.assert_array_equal(v, _get(head.params, k))


def _get(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


# ---- warm start ---------------------------------------------------------------------------------------
def test_warm_start_same_and_different_vocab(tmp_path):
    target_hf, cfg, params, vocab = make_draft(seed=3)
    src = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "head", dtype="fp32")
    init = eagle3.init_draft_params(cfg, jax.random.key(9))
    got = warm_start_params(src, cfg, vocab, init)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(init)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_leaves(params)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(path))

    # the run built another draft vocab: shared tokens keep the head's rows, new ones the fresh init
    run_ids = np.concatenate([vocab.draft_ids[: VD // 2], np.setdiff1d(np.arange(V), vocab.draft_ids)[: VD // 2]])
    run_vocab = DraftVocab.from_ids(run_ids, V)
    got = warm_start_params(src, cfg, run_vocab, init)
    k_new, k_head, k_init = (np.asarray(got["lm_head"]["kernel"]), params["lm_head"]["kernel"],
                             np.asarray(init["lm_head"]["kernel"]))
    head_pos = {int(t): j for j, t in enumerate(vocab.draft_ids)}
    for i, tok in enumerate(run_vocab.draft_ids):
        want = k_head[:, head_pos[int(tok)]] if int(tok) in head_pos else k_init[:, i]
        np.testing.assert_array_equal(k_new[:, i], want)
    np.testing.assert_array_equal(np.asarray(got["fc"]["kernel"]), params["fc"]["kernel"])


@pytest.mark.parametrize("mismatch", ["aux", "intermediate", "fc_norm"])
def test_warm_start_rejects_a_head_that_does_not_fit(tmp_path, mismatch):
    target_hf, cfg, params, vocab = make_draft(seed=3)
    src = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "head", dtype="fp32")
    if mismatch == "aux":
        run_cfg, pattern = dataclasses.replace(cfg, aux_layer_ids=(0, 2, 4)), r"target\.aux_layer_ids=\[1,2,3\]"
    elif mismatch == "intermediate":
        run_cfg, pattern = dataclasses.replace(cfg, intermediate_size=96), r"set draft\.intermediate_size=128"
    else:
        run_cfg, pattern = dataclasses.replace(cfg, fc_norm=True), r"set draft\.fc_norm=False"
    init = eagle3.init_draft_params(run_cfg, jax.random.key(0))
    with pytest.raises(ValueError, match=pattern):
        warm_start_params(src, run_cfg, vocab, init)


def test_config_keys_reach_the_draft_config():
    """draft.fc_norm / draft.norm_output / draft.init_from are config keys and reach Eagle3Config."""
    from types import SimpleNamespace

    from specjax.config import load_config
    from specjax.targets.llama import LlamaTargetConfig
    from specjax.train.setup import make_draft_config

    cfg = load_config(None, ["draft.fc_norm=true", "draft.norm_output=true", "draft.init_from=/heads/x",
                             "draft.draft_vocab_size=100"])
    assert cfg.draft.init_from == "/heads/x"
    target = SimpleNamespace(config=LlamaTargetConfig.from_hf(target_config()))
    dcfg = make_draft_config(cfg, target, AUX)
    assert dcfg.fc_norm and dcfg.norm_output
    assert set(eagle3.init_draft_params(dcfg, jax.random.key(0))["fc_norm"]) == {"0", "1", "2"}

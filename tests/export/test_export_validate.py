"""The head validator (specjax_converters.eagle3_validate, `python -m specjax.export --validate`):
one deliberately broken head per rule, each of which must be rejected with an error that names the
field and a fix; the exporter refusing (and writing nothing) for the rules it can hit; peers' heads
(SpecForge-saved, speculators-saved) validated as folders."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest

from export._heads import H, HEAD_DIM, L, LLAMA3_ROPE, N_HEADS, N_KV, V, VD, make_draft, read_folder, write_folder
from specjax.export import main as export_main
from specjax_converters.eagle3_export import export_eagle3
from specjax.hf_config_checks import ConfigFieldError
from specjax_converters.eagle3_validate import check_head
from specjax_converters.head_formats import errors, validate_folder


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid fp32 export and its target config (also written as a folder, for --target)."""
    root = tmp_path_factory.mktemp("validate")
    target_hf, cfg, params, vocab = make_draft(seed=0)
    out = export_eagle3(params, cfg, vocab, target_hf, root / "good", dtype="fp32")
    tdir = root / "target"
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(target_hf))
    return {"dir": out, "target_hf": target_hf, "target_dir": str(tdir), "root": root,
            "draft": (cfg, params, vocab)}


def test_good_export_has_no_findings(good, capsys):
    findings, info = validate_folder(good["dir"])
    assert findings == [] and info["target_source"] == "specjax_manifest.json" and info["layout"] == "llama"
    assert export_main(["--validate", good["dir"]]) == 0
    assert "OK: 0 error(s), 0 warning(s)" in capsys.readouterr().out


def _drop(d, key):
    d.pop(key)


def _set_ids(cfg, nested, top):
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = nested
    cfg["eagle_aux_hidden_state_layer_ids"] = top


def _shuffle_t2d(cfg, t, m):
    t2d = t["t2d"].copy()
    on = np.flatnonzero(t2d)[5]
    t2d[on] = False
    t2d[np.flatnonzero(~t2d)[0]] = True
    t["t2d"] = t2d


def _dup_ids(cfg, t, m):
    d2t = t["d2t"].copy()
    d2t[7] = d2t[6] - 1  # draft rows 6 and 7 now name the same target token
    t["d2t"] = d2t


def _hybrid(cfg, t, m):
    m["target_config"] = dict(m["target_config"], model_type="nemotron_h", num_key_value_heads=4,
                              hybrid_override_pattern="M-M*M-")


def _looped(cfg, t, m):
    m["target_config"] = dict(m["target_config"], num_loops=2)


# (rule id, field named, mutation of (config, tensors, manifest)); the manifest carries the target
# config and training ids, and gets fresh file hashes, so each head has exactly the intended defect.
CASES = {
    "keys.prefix": ("model.*", lambda c, t, m: t.update({f"model.{k}": t.pop(k) for k in list(t)})),
    "keys.missing": ("midlayer.hidden_norm.weight", lambda c, t, m: _drop(t, "midlayer.hidden_norm.weight")),
    "keys.unknown": ("verifier_lm_head.weight",
                     lambda c, t, m: t.update({"verifier_lm_head.weight": np.zeros((VD, H), np.float32)})),
    "keys.unknown/legacy": ("aux_norm_low.weight",
                            lambda c, t, m: t.update({"aux_norm_low.weight": np.ones(H, np.float32)})),
    "shapes": ("midlayer.mlp.gate_proj.weight", lambda c, t, m: c.update(intermediate_size=96)),
    "dtype.weights": ("model.safetensors", lambda c, t, m: t.update({"norm.weight": np.ones(H, np.int32)})),
    "weights.finite": ("fc.weight", lambda c, t, m: t["fc.weight"].__setitem__((0, 0), np.nan)),
    "vocab.d2t_missing": ("d2t", lambda c, t, m: _drop(t, "d2t")),
    "vocab.d2t_dtype": ("d2t", lambda c, t, m: t.update(d2t=t["d2t"].astype(np.int32))),
    "vocab.t2d_dtype": ("t2d", lambda c, t, m: t.update(t2d=t["t2d"].astype(np.uint8))),
    "vocab.ids": ("d2t", _dup_ids),
    "vocab.ids/range": ("d2t", lambda c, t, m: t["d2t"].__setitem__(-1, t["d2t"][-1] + V)),
    "vocab.invariant": ("t2d", _shuffle_t2d),
    "config.required": ("hidden_size", lambda c, t, m: _drop(c, "hidden_size")),
    "config.architectures": ("architectures", lambda c, t, m: c.update(architectures=["LlamaForCausalLM"])),
    "config.model_type": ("model_type", lambda c, t, m: c.update(model_type="qwen3")),
    "config.num_hidden_layers": ("num_hidden_layers", lambda c, t, m: c.update(num_hidden_layers=0)),
    "config.tie_word_embeddings": ("tie_word_embeddings", lambda c, t, m: c.update(tie_word_embeddings=True)),
    "config.head_dim": ("head_dim", lambda c, t, m: (_drop(c, "head_dim"), c.update(num_attention_heads=3))),
    "config.hidden_act": ("hidden_act", lambda c, t, m: c.update(hidden_act="gelu")),
    "config.bias": ("attention_bias", lambda c, t, m: c.update(attention_bias=True)),
    "config.num_key_value_heads": ("num_key_value_heads", lambda c, t, m: c.update(num_key_value_heads=3)),
    "config.norm_before_residual": ("norm_before_residual", lambda c, t, m: c.update(norm_before_residual=True)),
    "config.norm_before_fc": ("norm_before_fc", lambda c, t, m: c.update(norm_before_fc=True)),
    "config.draft_vocab_size": ("draft_vocab_size", lambda c, t, m: _drop(c, "draft_vocab_size")),
    "config.max_position_embeddings": ("max_position_embeddings",
                                       lambda c, t, m: _drop(c, "max_position_embeddings")),
    "config.rope_layouts": ("rope_parameters", lambda c, t, m: _drop(c, "rope_parameters")),
    "config.rope_layouts/disagree": ("rope_scaling", lambda c, t, m: c.update(rope_theta=10000.0)),
    "config.speculators_mix": ("speculators_config", lambda c, t, m: c.update(speculators_config={})),
    "config.variant": ("norm_output", lambda c, t, m: c.update(norm_output=True)),  # manifest says eagle3
    "aux.use_aux_hidden_state": ("eagle_config.use_aux_hidden_state",
                                 lambda c, t, m: c["eagle_config"].update(use_aux_hidden_state=False)),
    "aux.top_level_missing": ("eagle_aux_hidden_state_layer_ids",
                              lambda c, t, m: _drop(c, "eagle_aux_hidden_state_layer_ids")),
    "aux.nested_missing": ("eagle_config.eagle_aux_hidden_state_layer_ids",
                           lambda c, t, m: _drop(c["eagle_config"], "eagle_aux_hidden_state_layer_ids")),
    "aux.convention": ("eagle_aux_hidden_state_layer_ids", lambda c, t, m: _set_ids(c, [1, 2, 3], [1, 2, 3])),
    "aux.range": ("eagle_aux_hidden_state_layer_ids", lambda c, t, m: _set_ids(c, [1, 3, 3], [2, 4, 4])),
    "aux.range/depth": ("eagle_aux_hidden_state_layer_ids", lambda c, t, m: _set_ids(c, [1, 2, 6], [2, 3, 7])),
    "aux.count": ("num_aux_hidden_states", lambda c, t, m: c.update(num_aux_hidden_states=2)),
    "aux.training": ("eagle_aux_hidden_state_layer_ids", lambda c, t, m: _set_ids(c, [0, 2, 4], [1, 3, 5])),
    "target.hidden_size": ("hidden_size", lambda c, t, m: m.update(target_config=dict(m["target_config"],
                                                                                      hidden_size=2 * H))),
    "target.target_hidden_size": ("target_hidden_size", lambda c, t, m: c.update(target_hidden_size=32)),
    "target.vocab_size": ("vocab_size", lambda c, t, m: m.update(target_config=dict(m["target_config"],
                                                                                    vocab_size=V + 8))),
    "target.kv_heads": ("num_key_value_heads", _hybrid),
    "target.rope": ("rope_parameters", lambda c, t, m: m.update(target_config=dict(
        m["target_config"], rope_parameters=dict(LLAMA3_ROPE, factor=4.0)))),
    "target.max_position_embeddings": ("max_position_embeddings", lambda c, t, m: c.update(
        max_position_embeddings=2048)),
    "target.looped": ("target_layer_count", _looped),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rule_rejects_its_broken_head(good, case):
    rule = case.split("/")[0]
    field, mutate = CASES[case]
    config, tensors, manifest = read_folder(good["dir"])
    tensors = {k: v.copy() for k, v in tensors.items()}
    config, manifest = copy.deepcopy(config), copy.deepcopy(manifest)
    mutate(config, tensors, manifest)
    folder = write_folder(good["root"] / case.replace("/", "_"), config, tensors, manifest)
    try:
        findings, _ = validate_folder(folder)
    except ConfigFieldError as e:
        # config.json's sanity checks (specjax.hf_config_checks) refuse the folder, naming the field, before
        # any rule runs; the rule still guards an export's in-memory config
        assert e.field == field, str(e)
        findings = check_head(config, tensors)
    hits = [f for f in errors(findings) if f.rule == rule]
    assert hits, f"{case}: no {rule} error; got {[str(f) for f in findings]}"
    assert any(f.field == field for f in hits), [str(f) for f in hits]
    for f in hits:  # every message names its field and says what to do
        assert str(f).startswith(f"error: {f.field}: ") and ". Fix: " in str(f) and len(f.fix) > 10


def test_cli_validate_rejects_and_names_the_fix(good, capsys):
    config, tensors, manifest = read_folder(good["dir"])
    del config["eagle_aux_hidden_state_layer_ids"]
    folder = write_folder(good["root"] / "cli_bad", config, tensors)  # a bare folder, no manifest
    assert export_main(["--validate", folder, "--target", good["target_dir"]]) == 1
    out = capsys.readouterr().out
    assert "error: eagle_aux_hidden_state_layer_ids: absent at the top level" in out
    assert "Fix: write the top-level key = nested ids + 1 = [2, 3, 4]" in out and "INVALID: 1 error(s)" in out
    assert f"target config: {good['target_dir']}" in out
    # without --target the target rules are skipped, and it says so
    assert export_main(["--validate", folder]) == 1
    assert "target.unknown" in capsys.readouterr().out
    assert export_main(["--validate", str(good["root"] / "nope")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_manifest_hash_detects_an_edited_file(good):
    folder = good["root"] / "edited"
    config, tensors, manifest = read_folder(good["dir"])
    write_folder(folder, config, tensors, manifest)
    with open(folder / "config.json", "a") as f:
        f.write(" ")
    findings, _ = validate_folder(str(folder))
    assert [(f.rule, f.field) for f in errors(findings)] == [("files.manifest_hash", "config.json")]


def test_portability_warnings_do_not_reject(good):
    """embed_tokens shipped, layers.0.* decoder keys, norm_output absent: loadable, but flagged."""
    config, tensors, manifest = read_folder(good["dir"])
    tensors["embed_tokens.weight"] = np.zeros((V, H), np.float32)
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    del config["norm_output"]
    findings, _ = validate_folder(write_folder(good["root"] / "warn", config, tensors, manifest))
    assert not errors(findings)
    assert {f.rule for f in findings} == {"keys.embed_tokens", "keys.layout", "config.norm_output"}


# ---- the exporter runs the same rules first, and writes nothing when one fails ----------------------
@pytest.mark.parametrize("problem", ["hybrid_kv_heads", "target_hidden", "aux_out_of_range", "variant",
                                     "nan", "looped_aux"])
def test_export_refuses_and_writes_nothing(tmp_path, problem):
    from specjax.drafts import eagle3

    target_hf, cfg, params, vocab = make_draft(seed=4)
    kwargs, rule = {}, None
    if problem == "hybrid_kv_heads":  # Nemotron card: vLLM cannot serve a draft with other KV heads
        target_hf = dict(target_hf, model_type="nemotron_h", hybrid_override_pattern="M-M*M-",
                         num_key_value_heads=4)
        rule = "num_key_value_heads"
    elif problem == "target_hidden":
        target_hf = dict(target_hf, hidden_size=2 * H)
        rule = "hidden_size"
    elif problem == "aux_out_of_range":
        cfg = eagle3.Eagle3Config(**{**eagle3.config_to_dict(cfg), "aux_layer_ids": (1, 2, L),
                                     "rope": cfg.rope})
        rule = "eagle_aux_hidden_state_layer_ids"
    elif problem == "variant":
        kwargs["variant"] = "eagle3.1"
        rule = "variant"
    elif problem == "nan":
        up = params["midlayer"]["mlp"]["up_proj"]
        up["kernel"] = up["kernel"].copy()
        up["kernel"][0, 0] = np.inf
        rule = "midlayer.mlp.up_proj.weight"
    else:  # looped target: ids address the unrolled depth, so 2L-1 is valid there but not for 2L
        target_hf = dict(target_hf, num_loops=2)
        cfg = eagle3.Eagle3Config(**{**eagle3.config_to_dict(cfg), "aux_layer_ids": (1, L + 1, 2 * L),
                                     "rope": cfg.rope})
        rule = "eagle_aux_hidden_state_layer_ids"
    with pytest.raises(ValueError, match=rf"EAGLE-3 export: {rule}: .*Fix: "):
        export_eagle3(params, cfg, vocab, target_hf, tmp_path / "out", **kwargs)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("loop", [{"num_loops": 2}, {"num_loops": 3, "loop_start": 2, "loop_end": 5}])
def test_looped_target_export_writes_the_virtual_depth(tmp_path, loop):
    from specjax.drafts import eagle3

    target_hf, cfg, params, vocab = make_draft(seed=5)
    target_hf = dict(target_hf, **loop)  # 6 layers: all twice (depth 12), or 2..4 three times (6 + 2*3 = 12)
    cfg = eagle3.Eagle3Config(**{**eagle3.config_to_dict(cfg), "aux_layer_ids": (1, 7, 10), "rope": cfg.rope})
    out = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "e", dtype="fp32")
    conf = json.loads(open(os.path.join(out, "config.json")).read())
    assert conf["target_layer_count"] == 12 and conf["target_num_loops"] == loop["num_loops"]
    assert conf["target_num_hidden_layers"] == L
    assert conf.get("target_loop_start") == loop.get("loop_start")
    assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 8, 11]
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 7, 10]
    assert not errors(validate_folder(out)[0])
    # 12 is past the virtual depth
    cfg = eagle3.Eagle3Config(**{**eagle3.config_to_dict(cfg), "aux_layer_ids": (1, 7, 12), "rope": cfg.rope})
    with pytest.raises(ValueError, match="outside the target's depth 0..11"):
        export_eagle3(params, cfg, vocab, target_hf, tmp_path / "f", dtype="fp32")


# ---- other trainers' heads --------------------------------------------------------------------------
def test_validate_specforge_saved_head(good, tmp_path, capsys):
    """A head saved by SpecForge's own model class with a SpecForge-style config (only the legacy RoPE
    keys, no aux ids, embed_tokens included): loadable, but two contract rules fail."""
    pytest.importorskip("torch")
    pytest.importorskip("specforge")
    from parity._specforge import draft_class, torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    conf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
            "intermediate_size": 128, "num_attention_heads": N_HEADS, "num_key_value_heads": N_KV,
            "head_dim": HEAD_DIM, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "vocab_size": V, "draft_vocab_size": VD, "max_position_embeddings": 2048, "rope_theta": 500000.0,
            "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"},
            "tie_word_embeddings": False, "torch_dtype": "float32", "pad_token_id": 0}
    torch.manual_seed(0)
    model = draft_class()(LlamaConfig(**conf), attention_backend="sdpa")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    sd["t2d"] = torch.zeros(V, dtype=torch.bool)
    sd["t2d"][torch.arange(VD) * 2] = True
    sd["d2t"] = torch.arange(VD, dtype=torch.int64)  # ids 2i -> offset i
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(conf))
    assert export_main(["--validate", str(tmp_path), "--target", good["target_dir"]]) == 1
    out = capsys.readouterr().out
    assert "error: rope_parameters: only one RoPE layout is written" in out
    assert "error: max_position_embeddings: draft 2048 < target 4096" in out
    for warn in ("keys.embed_tokens", "aux.absent", "config.norm_output"):
        assert warn in out


def test_validate_speculators_saved_head(good, tmp_path):
    """A head saved by speculators' Eagle3DraftModel.save_pretrained (layers.0.*, speculators_config)."""
    from export._heads import import_speculators, speculators_head

    sp = import_speculators()
    speculators_head(sp, tmp_path, good["target_dir"])
    findings, info = validate_folder(str(tmp_path))
    assert info["layout"] == "speculators" and info["target_source"] == good["target_dir"]  # verifier path
    assert not errors(findings), [str(f) for f in errors(findings)]
    assert "layout.speculators" in {f.rule for f in findings}


def test_validate_cli_in_a_fresh_interpreter(tmp_path):
    """`python -m specjax.export --validate` on a bf16 export, in a process that has not imported jax
    (reading bf16 tensors must not depend on jax having registered numpy's bfloat16)."""
    import subprocess
    import sys

    target_hf, cfg, params, vocab = make_draft(seed=6)
    out = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "bf16", dtype="bf16")
    r = subprocess.run([sys.executable, "-m", "specjax.export", "--validate", out], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: 0 error(s), 0 warning(s)" in r.stdout


def test_pickled_bin_head_is_refused_not_read(good, tmp_path):
    """Older published heads ship pytorch_model.bin: refused (specjax never unpickles), naming the file
    and the fix. The CLI cases are in tests/reliability/test_validate_files.py."""
    torch = pytest.importorskip("torch")
    config, tensors, _ = read_folder(good["dir"])
    torch.save({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"holds only pickled PyTorch weights \(pytorch_model\.bin\), no "
                                         r"model\.safetensors: specjax never unpickles weights"):
        validate_folder(str(tmp_path), target=good["target_dir"])


def test_full_vocab_head_ships_no_d2t(tmp_path):
    # vLLM 0.32 creates draft_id_to_target_id only for a reduced draft vocab and refuses a full-vocab
    # head that carries d2t ("There is no module or parameter named 'draft_id_to_target_id'")
    import jax

    from specjax.drafts import eagle3
    from specjax.drafts.vocab import DraftVocab
    from specjax_converters.eagle3_import import read_head

    target_hf, cfg, _, _ = make_draft(seed=6)
    cfg = eagle3.Eagle3Config(**{**eagle3.config_to_dict(cfg), "draft_vocab_size": V, "rope": cfg.rope})
    params = jax.tree_util.tree_map(np.asarray, eagle3.init_draft_params(cfg, jax.random.key(6), std=0.08))
    out = export_eagle3(params, cfg, DraftVocab.identity(V), target_hf, tmp_path / "full", dtype="fp32")
    config, tensors, manifest = read_folder(out)
    assert "d2t" not in tensors and tensors["t2d"].all() and tensors["lm_head.weight"].shape == (V, H)
    assert validate_folder(out)[0] == []
    head = read_head(out)
    assert head.vocab.draft_vocab_size == V and not np.asarray(head.vocab.d2t).any()
    np.testing.assert_array_equal(head.params["lm_head"]["kernel"], params["lm_head"]["kernel"])
    # a d2t in a full-vocab head is an error that names it
    tensors = dict(tensors, d2t=np.zeros(V, np.int64))
    findings, _ = validate_folder(write_folder(tmp_path / "with_d2t", config, tensors, manifest))
    assert [f.rule for f in errors(findings)] == ["vocab.d2t_unexpected"]


@pytest.mark.parametrize("folder,hybrid", [("kimi_linear_48b_a3b", True), ("qwen3_next_80b_a3b", True),
                                           ("nemotron_h_30b_a3b", True), ("qwen3_30b_a3b", False),
                                           ("deepseek_v3", False), ("gpt_oss_20b", False)])
def test_hybrid_rule_reads_the_published_configs(repo_root, folder, hybrid):
    """The engines' hybrid-target rules (the draft's KV heads) apply to the published config.json of
    each linear-attention / SSM hybrid, whose layer kinds may only be named in a model-specific key
    (Kimi Linear: linear_attn_config), and to no plain or MoE transformer."""
    from specjax_converters.target_facts import is_hybrid_target

    with open(os.path.join(repo_root, "configs", "targets", folder, "config.json")) as f:
        assert is_hybrid_target(json.load(f)) is hybrid

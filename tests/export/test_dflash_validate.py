"""DFlash head folders (specjax_converters.dflash_validate / dflash_export / dflash_import): a good
export validates with no finding (library, `python -m specjax.export --validate`, `specjax.doctor
--draft`) and carries the manifest; one deliberately broken folder per rule, each rejected with an
error naming the field and a fix; a file changed after export fails its manifest hash; warm starts
(`draft.init_from` with draft.type=dflash) load the exported params exactly and refuse a head that
does not fit, naming the key to set.

Tiny shapes and numpy weights (no XLA compile except the one init in the set-up test)."""
from __future__ import annotations

import copy
import json
import os
import shutil
import types

import numpy as np
import pytest

from export._heads import read_folder, write_folder
from specjax.drafts import dflash as D
from specjax.drafts import weights
from specjax.drafts.dflash_weights import DFLASH_WEIGHTS
from specjax.drafts.vocab import DraftVocab
from specjax.export import main as export_main
from specjax.layers.rope import RopeSpec
from specjax_converters.dflash_export import export_dflash
from specjax_converters.dflash_import import read_dflash_head, warm_start_dflash_params
from specjax_converters.head_formats import errors, validate_folder

V, H, NH, NKV, HD, I, VD, L = 50, 32, 4, 2, 8, 64, 24, 4
TAPS, MASK = (0, 2), V - 1


def make_cfg(**overrides) -> D.DFlashConfig:
    base = dict(hidden_size=H, num_layers=2, num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
                intermediate_size=I, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=TAPS, mask_token_id=MASK,
                block_size=4, rope=RopeSpec("default", 10000.0), max_position_embeddings=256, num_target_layers=L)
    return D.DFlashConfig(**{**base, **overrides})


def make_params(cfg, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return weights.nest((e.path, (0.1 * rng.standard_normal(e.shape)).astype(np.float32))
                        for e in weights.entries(DFLASH_WEIGHTS, cfg))


def make_vocab(seed=0, vd=VD) -> DraftVocab:
    return DraftVocab.from_ids(np.random.default_rng(seed).choice(V, vd, replace=False), V)


TARGET = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
          "num_hidden_layers": L, "rope_theta": 10000.0, "max_position_embeddings": 256, "eos_token_id": 1}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_validate")
    cfg, params, vocab = make_cfg(), make_params(make_cfg()), make_vocab()
    out = export_dflash(params, cfg, TARGET, root / "good", vocab=vocab, dtype="fp32", extra_manifest={"step": 7})
    tdir = root / "target"
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(TARGET))
    return {"dir": out, "root": root, "target_dir": str(tdir), "cfg": cfg, "params": params, "vocab": vocab}


def test_good_export_validates_and_carries_the_manifest(good, capsys):
    from specjax.doctor import Report, _check_draft
    from specjax_converters.head_files import file_sha256

    findings, info = validate_folder(good["dir"])
    assert findings == [] and info == {"layout": "dflash", "target_source": "specjax_manifest.json"}
    assert validate_folder(good["dir"], target=good["target_dir"])[0] == []
    assert export_main(["--validate", good["dir"], "--target", good["target_dir"]]) == 0
    out = capsys.readouterr().out
    assert "dflash layout" in out and "OK: 0 error(s), 0 warning(s)" in out
    m = json.load(open(os.path.join(good["dir"], "specjax_manifest.json")))
    assert (m["format"], m["variant"], m["dtype"], m["step"]) == ("specjax-dflash", "dflash", "float32", 7)
    assert m["target_config"] == TARGET and m["draft_config"]["aux_layer_ids"] == list(TAPS)
    for name in ("model.safetensors", "config.json"):
        assert m["files"][name]["sha256"] == file_sha256(os.path.join(good["dir"], name))
    rep = Report()
    _check_draft(rep, good["dir"], good["target_dir"])
    assert rep.failed == 0 and "dflash" in rep.render()
    # the manifest does not stop a re-export into the same folder
    export_dflash(good["params"], good["cfg"], TARGET, good["dir"], vocab=good["vocab"], dtype="fp32")


def _set(section, key, value):
    def mutate(c, t, m):
        (c if section is None else c[section])[key] = value
    return mutate


def _drop(section, key):
    return lambda c, t, m: (c if section is None else c[section]).pop(key)


def _tensor(name, value):
    return lambda c, t, m: t.update({name: value})


def _shuffle_t2d(c, t, m):
    t2d = t["t2d"].copy()
    t2d[np.flatnonzero(t2d)[3]] = False
    t2d[np.flatnonzero(~t2d)[0]] = True
    t["t2d"] = t2d


def _nan(c, t, m):
    w = t["norm.weight"].copy()
    w[0] = np.nan
    t["norm.weight"] = w


def _target(**kw):
    return lambda c, t, m: m.update(target_config=dict(m["target_config"], **kw))


# (rule, field named, mutation of (config, tensors, manifest)); the manifest gets fresh hashes, so each
# folder has the intended defect only
CASES = {
    "dflash.architectures": ("architectures", _set(None, "architectures", ["Qwen3ForCausalLM"])),
    "dflash.model_type": ("model_type", _set(None, "model_type", "llama")),
    "config.required": ("head_dim", _drop(None, "head_dim")),
    "config.required/nkv": ("num_key_value_heads", _drop(None, "num_key_value_heads")),
    "dflash.config": ("dflash_config", _drop(None, "dflash_config")),
    "dflash.mask_token_id": ("dflash_config.mask_token_id", _set("dflash_config", "mask_token_id", V)),
    "dflash.mask_token_id/absent": ("dflash_config.mask_token_id", _drop("dflash_config", "mask_token_id")),
    "dflash.target_layer_ids": ("dflash_config.target_layer_ids", _set("dflash_config", "target_layer_ids", [2, 0])),
    "dflash.target_layer_ids/absent": ("dflash_config.target_layer_ids", _drop("dflash_config", "target_layer_ids")),
    "dflash.target_layer_ids/depth": ("dflash_config.target_layer_ids",
                                      lambda c, t, m: (c["dflash_config"].update(target_layer_ids=[0, 5]),
                                                       c.pop("num_target_layers"), m["draft_config"].update(
                                                           aux_layer_ids=[0, 5]))),
    "dflash.training": ("dflash_config.target_layer_ids", _set("dflash_config", "target_layer_ids", [1, 2])),
    "dflash.aux_override": ("eagle_aux_hidden_state_layer_ids", _set(None, "eagle_aux_hidden_state_layer_ids", [1, 2])),
    "dflash.causal": ("dflash_config.causal", _set("dflash_config", "causal", True)),
    "dflash.layer_types": ("layer_types", _set(None, "layer_types", ["sliding_attention", "full_attention"])),
    "dflash.use_aux_hidden_state": ("dflash_config.use_aux_hidden_state",
                                    _set("dflash_config", "use_aux_hidden_state", False)),
    "dflash.block_size": ("block_size", _set(None, "block_size", 1)),
    "dflash.block_size/absent": ("block_size", _drop(None, "block_size")),
    "dflash.target_hidden_size": ("target_hidden_size", _set(None, "target_hidden_size", 2 * H)),
    "keys.missing": ("layers.1.mlp.up_proj.weight", lambda c, t, m: t.pop("layers.1.mlp.up_proj.weight")),
    "keys.unknown": ("mask_hidden", _tensor("mask_hidden", np.zeros(H, np.float32))),
    "keys.prefix": ("model.*", lambda c, t, m: t.update({f"model.{k}": t.pop(k) for k in list(t)})),
    "shapes": ("layers.0.self_attn.q_proj.weight", _tensor("layers.0.self_attn.q_proj.weight",
                                                           np.zeros((NH * HD, H + 1), np.float32))),
    "dtype.weights": ("model.safetensors", _tensor("norm.weight", np.ones(H, np.int32))),
    "weights.finite": ("norm.weight", _nan),
    "vocab.d2t_missing": ("d2t", lambda c, t, m: t.pop("d2t")),
    "vocab.invariant": ("t2d", _shuffle_t2d),
    "target.hidden_size": ("hidden_size", _target(hidden_size=2 * H)),
    "target.vocab_size": ("vocab_size", _target(vocab_size=V + 8)),
    "target.rope": ("rope_parameters", _target(rope_theta=500000.0)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_rule_fires(good, case, tmp_path):
    field, mutate = CASES[case]
    rule = case.split("/")[0]
    config, tensors, manifest = read_folder(good["dir"])
    config, manifest = copy.deepcopy(config), copy.deepcopy(manifest)
    mutate(config, tensors, manifest)
    findings, info = validate_folder(write_folder(tmp_path / "broken", config, tensors, manifest))
    hits = [f for f in errors(findings) if f.rule == rule and f.field == field]
    assert hits, [str(f) for f in findings]
    assert "Fix: " in str(hits[0]) and hits[0].fix
    assert info["layout"] == "dflash"  # never the EAGLE-3 rules, whatever is broken


def test_file_changed_after_export_fails_its_hash(good, tmp_path, capsys):
    folder = tmp_path / "tampered"
    shutil.copytree(good["dir"], folder)
    conf = json.loads((folder / "config.json").read_text())
    conf["block_size"] = 8  # a valid value: only the hash can tell
    (folder / "config.json").write_text(json.dumps(conf))
    findings, _ = validate_folder(str(folder))
    assert [(f.rule, f.field) for f in errors(findings)] == [("files.manifest_hash", "config.json")]
    assert export_main(["--validate", str(folder)]) == 1
    assert "sha256 differs from specjax_manifest.json" in capsys.readouterr().out


def test_warnings_are_portability_notes(good, tmp_path):
    config, tensors, manifest = read_folder(good["dir"])
    config["dflash_config"]["sample_from_anchor"] = True
    tensors["embed_tokens.weight"] = np.zeros((V, H), np.float32)
    findings, _ = validate_folder(write_folder(tmp_path / "warn", config, tensors, manifest))
    assert not errors(findings), [str(f) for f in errors(findings)]
    assert {f.rule for f in findings} == {"dflash.sample_from_anchor", "keys.embed_tokens"}
    # a full-vocab head may leave lm_head out (vLLM shares the target's); specjax refuses to read it
    cfg = make_cfg(draft_vocab_size=V)
    out = export_dflash(make_params(cfg), cfg, TARGET, tmp_path / "full", dtype="fp32")
    config, tensors, manifest = read_folder(out)
    del tensors["lm_head.weight"]
    findings, _ = validate_folder(write_folder(tmp_path / "shared", config, tensors, manifest))
    assert [f.rule for f in findings] == ["keys.lm_head_shared"] and findings[0].level == "warning"
    with pytest.raises(ValueError, match=r"lacks \['lm_head.weight'\] \(vLLM shares the target's lm_head"):
        read_dflash_head(str(tmp_path / "shared"))


def test_speculators_dflash_folder_is_refused_by_name(tmp_path):
    write_folder(tmp_path, {"speculators_model_type": "dflash", "architectures": ["DFlashDraftModel"]},
                 {"fc.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(ValueError, match=r"speculators-format DFlash head .* Fix:"):
        validate_folder(str(tmp_path))


def test_pickle_only_dflash_folder_is_refused_not_read(good, tmp_path):
    shutil.copy(os.path.join(good["dir"], "config.json"), tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    for read in (validate_folder, read_dflash_head):
        with pytest.raises(ValueError, match=r"holds only pickled PyTorch weights \(pytorch_model\.bin\)"):
            read(str(tmp_path))


def _flat(tree, prefix=()):
    for k, v in tree.items():
        yield from (_flat(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), v)])


def test_warm_start_loads_the_exported_params(good):
    init = make_params(good["cfg"], seed=5)
    got = warm_start_dflash_params(good["dir"], good["cfg"], good["vocab"], init)
    want = dict(_flat(good["params"]))
    assert dict((p, None) for p, _ in _flat(got)).keys() == want.keys()
    for path, value in _flat(got):
        np.testing.assert_array_equal(np.asarray(value), want[path])
    # another draft vocab: the shared tokens' lm_head columns come from the head, the rest from init
    run_vocab = make_vocab(seed=3)
    got = warm_start_dflash_params(good["dir"], good["cfg"], run_vocab, init)
    kernel, head_ids = np.asarray(got["lm_head"]["kernel"]), list(good["vocab"].draft_ids)
    for i, t in enumerate(run_vocab.draft_ids):
        src = good["params"]["lm_head"]["kernel"][:, head_ids.index(t)] if t in head_ids else \
            init["lm_head"]["kernel"][:, i]
        np.testing.assert_array_equal(kernel[:, i], src)


@pytest.mark.parametrize("overrides, match", [
    ({"num_layers": 1}, r"num_layers: head 2 vs run 1 \(set draft.num_layers=2\)"),
    ({"intermediate_size": 48}, r"intermediate_size: head 64 vs run 48 \(set draft.intermediate_size=64\)"),
    ({"mask_token_id": 0}, r"mask_token_id: head 49 vs run 0 \(set draft.mask_token_id=49\)"),
    ({"hidden_size": 2 * H, "num_attention_heads": 8}, r"hidden_size: head 32 vs run 64 \(another target\)"),
    ({"aux_layer_ids": (1, 3)}, r"trained on target layers \[0, 2\], the run taps \[1, 3\]\. Fix: set "
                                   r"target.aux_layer_ids=\[0,2\]"),
])
def test_warm_start_refuses_a_head_that_does_not_fit(good, overrides, match):
    cfg = make_cfg(**overrides)
    with pytest.raises(ValueError, match=r"draft.init_from=.*" + match):
        warm_start_dflash_params(good["dir"], cfg, good["vocab"], make_params(cfg))


def test_warm_start_refuses_other_heads_by_kind(good, tmp_path):
    eagle = tmp_path / "eagle3"  # the kind is read from config.json before any weight
    eagle.mkdir()
    (eagle / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"not a DFlash head .* Fix: point draft.init_from at a DFlash export"):
        warm_start_dflash_params(str(eagle), good["cfg"], good["vocab"], make_params(good["cfg"]))
    with pytest.raises(ValueError, match=r"draft.init_from: .*no model.safetensors"):
        broken = tmp_path / "no_weights"
        broken.mkdir()
        shutil.copy(os.path.join(good["dir"], "config.json"), broken / "config.json")
        warm_start_dflash_params(str(broken), good["cfg"], good["vocab"], make_params(good["cfg"]))


def test_run_setup_warm_starts_a_dflash_run(good):
    """`draft.init_from` through the train set-up: a dflash run gets the head's params, an eagle3 run
    pointed at a DFlash head is refused by name."""
    import jax

    from specjax.config import load_config
    from specjax.train.setup import RunSetup

    target = types.SimpleNamespace(params=None, lm_head_weight=lambda p: jax.ShapeDtypeStruct((V, H), np.float32))
    blank = dict(mesh=None, target=target, objective=None, optimizer=None, schedule=None, compute_dtype=None,
                 draft_params_shape=None, fns=None)
    cfg = load_config(None, ["draft.type=dflash", f"draft.init_from={good['dir']}"])
    params = RunSetup(cfg=cfg, draft_config=good["cfg"], **blank).init_draft_params(good["vocab"])
    np.testing.assert_array_equal(np.asarray(params["fc"]["kernel"]), good["params"]["fc"]["kernel"])
    eagle = load_config(None, [f"draft.init_from={good['dir']}"])
    with pytest.raises(ValueError, match=r"is a DFlash head .* Fix: set draft.type=dflash"):
        RunSetup(cfg=eagle, draft_config=None, **blank).init_draft_params(good["vocab"])

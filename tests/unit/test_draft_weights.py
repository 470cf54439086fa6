"""The EAGLE-3 weight table (specjax.drafts.weights) is the draft's one layout: the init, the logical
axes, the export's keys and dtypes, the validator's expected shapes and the import (both file
layouts) all follow it, for plain EAGLE-3 and EAGLE-3.1 drafts. Every check compares a derivation
with the table as it is at call time, so a row added to the table must reach all of them."""
from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from export._heads import make_draft
from specjax.drafts import eagle3, weights
from specjax_converters.eagle3_export import WEIGHTS_FILE, eagle3_hf_config, eagle3_state_dict, export_eagle3
from specjax_converters.eagle3_import import read_head
from specjax_converters.eagle3_validate import expected_weight_shapes, flatten_head_config
from specjax_converters.head_formats import errors, validate_folder

VARIANTS = {"eagle3": {}, "eagle3.1": {"fc_norm": True, "norm_output": True}, "fc_norm": {"fc_norm": True}}


def _flat(tree: dict, prefix: tuple = ()) -> dict:
    """{path tuple: leaf} of a nested dict (tuples, e.g. logical axes, are leaves)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _speculators_name(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def check_everything_follows_the_table(cfg, vocab, target_hf, tmp_path):
    table = weights.EAGLE3_WEIGHTS
    leaves = weights.entries(table, cfg)
    by_file = {e.file_name: e for e in leaves}
    assert len(by_file) == len(leaves) == len({e.path for e in leaves})

    # init: one leaf per entry, its shape, its init kind
    params = eagle3.init_draft_params(cfg, jax.random.key(0), std=0.02)
    flat = {p: np.asarray(v) for p, v in _flat(params).items()}
    assert {p: v.shape for p, v in flat.items()} == {e.path: e.shape for e in leaves}
    for e in leaves:
        if e.row.init == "ones":
            assert np.all(flat[e.path] == 1), e.path
        else:
            assert 0.01 < flat[e.path].std() < 0.03, e.path

    # logical axes
    assert _flat(eagle3.param_logical_axes(cfg)) == {e.path: e.row.axes for e in leaves}

    # export: the table's file names and file shapes, weights in the export dtype, vocab maps in theirs
    sd = eagle3_state_dict(params, cfg, vocab, "bfloat16")
    assert set(sd) == set(by_file) | set(weights.EAGLE3_VOCAB_TENSORS)
    for name, e in by_file.items():
        want = flat[e.path].T if e.row.transpose else flat[e.path]
        assert sd[name].dtype == ml_dtypes.bfloat16 and sd[name].shape == e.file_shape == want.shape, name
        np.testing.assert_array_equal(sd[name], want.astype(ml_dtypes.bfloat16))
    for name, dtype in weights.EAGLE3_VOCAB_TENSORS.items():
        assert sd[name].dtype == np.dtype(dtype), name

    # validator: expected shapes from the written config.json, in both file layouts
    _, hf = flatten_head_config(eagle3_hf_config(cfg, target_hf))
    assert expected_weight_shapes(hf) == {n: e.file_shape for n, e in by_file.items()}
    assert expected_weight_shapes(hf, "speculators") == {_speculators_name(n): e.file_shape for n, e in by_file.items()}

    # import: the export read back (midlayer.* names), and the same tensors under speculators' layers.0.* names
    folder = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "head", dtype="fp32")
    findings, _ = validate_folder(folder)
    assert not errors(findings), [str(f) for f in errors(findings)]
    renamed = tmp_path / "layers0"
    renamed.mkdir()
    save_file({_speculators_name(k): v for k, v in load_file(f"{folder}/{WEIGHTS_FILE}").items()},
              str(renamed / WEIGHTS_FILE))
    (renamed / "config.json").write_text((tmp_path / "head" / "config.json").read_text())
    for src in (folder, str(renamed)):
        head = read_head(src)
        got = _flat(head.params)
        assert set(got) == set(flat), src
        for p in flat:
            np.testing.assert_array_equal(got[p], flat[p])
        assert head.config.fc_norm == cfg.fc_norm and head.config.norm_output == cfg.norm_output
    return params


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_init_axes_export_validator_and_import_follow_the_table(variant, tmp_path):
    target_hf, cfg, _, vocab = make_draft(seed=0, **VARIANTS[variant])
    check_everything_follows_the_table(cfg, vocab, target_hf, tmp_path)
    names = {e.file_name for e in weights.entries(weights.EAGLE3_WEIGHTS, cfg)}
    assert {n for n in names if n.startswith("fc_norm.")} == ({f"fc_norm.{i}.weight" for i in range(3)}
                                                              if cfg.fc_norm else set())


EXTRA_ROWS = (
    # always there, no random draw
    weights.DraftWeight("midlayer.extra_norm.scale", "midlayer.extra_norm.weight", (weights.H,), ("norm",), "ones",
                        False),
    # only with fc_norm, drawn after the other rows
    weights.DraftWeight("extra_proj.kernel", "extra_proj.weight", (weights.TH, weights.H), (None, "embed"), "normal",
                        True, when="fc_norm"),
)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_a_row_added_to_the_table_reaches_every_derivation(variant, tmp_path, monkeypatch):
    target_hf, cfg, _, vocab = make_draft(seed=0, **VARIANTS[variant])
    original = weights.EAGLE3_WEIGHTS
    before = eagle3.init_draft_params(cfg, jax.random.key(0), std=0.02)
    monkeypatch.setattr(weights, "EAGLE3_WEIGHTS", original + EXTRA_ROWS)
    after = check_everything_follows_the_table(cfg, vocab, target_hf, tmp_path)

    names = {e.file_name for e in weights.entries(weights.EAGLE3_WEIGHTS, cfg)}
    assert "midlayer.extra_norm.weight" in names
    assert ("extra_proj.weight" in names) == cfg.fc_norm
    # the added rows leave every other leaf's value as it was
    old, new = _flat(before), _flat(after)
    assert set(old) < set(new)
    for p in old:
        np.testing.assert_array_equal(np.asarray(new[p]), np.asarray(old[p]))


def test_rows_are_checked():
    with pytest.raises(ValueError, match="init 'zeros'"):
        weights.DraftWeight("x.scale", "x.weight", (weights.H,), ("norm",), "zeros", False)
    with pytest.raises(ValueError, match="logical axes"):
        weights.DraftWeight("x.kernel", "x.weight", (weights.H, weights.H), ("embed",), "normal", True)
    with pytest.raises(ValueError, match="repeat"):
        weights.DraftWeight("x.{i}.scale", "x.{i}.weight", (weights.H,), ("norm",), "ones", False)

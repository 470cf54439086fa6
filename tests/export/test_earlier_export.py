"""head_files.earlier_export: the one rule the DFlash, DFlash 2, DSpark and EAGLE-1 exporters use to
decide whether an existing out_dir may be replaced (empty, or exactly an earlier export of theirs)."""
from __future__ import annotations

import json

from specjax_converters.head_files import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, earlier_export

OURS = {"architectures": ["Ours"]}


def is_ours(conf):
    return conf.get("architectures") == ["Ours"]


def folder(tmp_path, name, files, conf=OURS):
    d = tmp_path / name
    d.mkdir()
    for f in files:
        (d / f).write_text(json.dumps(conf) if f == CONFIG_FILE else "x")
    return str(d)


def test_which_folders_may_be_replaced(tmp_path):
    full = (WEIGHTS_FILE, CONFIG_FILE, MANIFEST_FILE)
    assert not earlier_export(str(tmp_path / "missing"), is_ours)
    assert earlier_export(folder(tmp_path, "empty", ()), is_ours)
    assert earlier_export(folder(tmp_path, "ours", full), is_ours)
    assert not earlier_export(folder(tmp_path, "other", full, {"architectures": ["Other"]}), is_ours)
    assert not earlier_export(folder(tmp_path, "extra", full + ("notes.txt",)), is_ours)
    no_manifest = folder(tmp_path, "old", (WEIGHTS_FILE, CONFIG_FILE))
    assert not earlier_export(no_manifest, is_ours)
    assert earlier_export(no_manifest, is_ours, manifest_optional=True)
    bad = folder(tmp_path, "bad", full)
    (tmp_path / "bad" / CONFIG_FILE).write_text("{not json")
    assert not earlier_export(bad, is_ours)
    listed = folder(tmp_path, "list", full, ["not", "a", "mapping"])
    assert not earlier_export(listed, is_ours)

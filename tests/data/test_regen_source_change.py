"""Regeneration resume compares the source's content, not only its path.

Shards are numbered chunks of the source's conversations. Before, a source edited between a kill and
`--resume` was accepted: with three conversations inserted at the top, the resumed shards held three
conversations a second time and three were never answered. Now the manifest records every source
file's size and sha256 (`input_files`), and a resume whose source differs is refused, naming the file,
both fingerprints and the fix; the row limits (data.max_row_bytes / max_row_depth), which decide which
rows are conversations, are compared settings. A manifest from before the fingerprints resumes with a warning (it
cannot be checked) and gets them, so the next resume is checked.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specjax.data.sources import RowLimits
from specjax.regen.common import ManifestMismatch
from specjax.regenerate import regenerate

SETTINGS = dict(backend="jax", max_new_tokens=4, batch_size=4, shard_size=3, max_prompt_tokens=100, dtype="float32")


def _line(i: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"Please add {i} and {i + 1}."}]})


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _kill_last_shard(out) -> None:
    """What a kill before the last shard was written leaves: the other shards and the manifest."""
    os.remove(os.path.join(out, "shard-000002.parquet"))


def _answered(out) -> list[str]:
    rows = []
    for name in sorted(n for n in os.listdir(out) if n.endswith(".parquet")):
        rows += [r["messages"][0]["content"] for r in pq.read_table(os.path.join(out, name)).to_pylist()]
    return rows


def test_a_source_edited_between_kill_and_resume_is_refused(tmp_path, tiny_target):
    src, out = tmp_path / "chats.jsonl", str(tmp_path / "out")
    original = "".join(_line(i) + "\n" for i in range(8))
    src.write_text(original)
    regenerate(input=str(src), out_dir=out, target=tiny_target, **SETTINGS)
    man = json.load(open(os.path.join(out, "manifest.json")))
    assert man["input_files"] == [{"path": str(src), "bytes": len(original), "sha256": _sha(src)}]
    _kill_last_shard(out)

    edited = "".join(_line(i) + "\n" for i in (0, 1, 2)) + original  # three conversations inserted at the top
    src.write_text(edited)
    with pytest.raises(ManifestMismatch) as e:
        regenerate(input=str(src), out_dir=out, target=tiny_target, resume=True, **SETTINGS)
    assert str(e.value) == (
        f"cannot resume into {out}: the source changed since the run began ({src}: sha256 "
        f"{hashlib.sha256(original.encode()).hexdigest()} ({len(original):,} bytes) when the run began, sha256 "
        f"{_sha(src)} ({len(edited):,} bytes) now). Its finished shards hold the old conversations, numbered in the "
        "old order: resuming would answer some conversations twice and others never. Restore the original file, "
        "or regenerate the edited source into a new output directory (or delete this one first).")
    assert sorted(os.listdir(out)) == ["manifest.json", "shard-000000.parquet", "shard-000001.parquet"]

    src.write_text(original)
    # the row limits decide which rows are conversations, so they are compared settings too
    with pytest.raises(ManifestMismatch, match=r"max_row_bytes: 16777216 in .*manifest.json != 100 now"):
        regenerate(input=str(src), out_dir=out, target=tiny_target, resume=True, row_limits=RowLimits(max_bytes=100),
                   **SETTINGS)
    # the fix: the original source resumes, every conversation answered once
    s = regenerate(input=str(src), out_dir=out, target=tiny_target, resume=True, **SETTINGS)
    assert (s.shards_resumed, s.shards_written) == (2, 1)
    assert sorted(_answered(out)) == sorted(f"Please add {i} and {i + 1}." for i in range(8))


def test_a_manifest_without_fingerprints_resumes_with_a_warning_and_gets_them(tmp_path, tiny_target, caplog):
    src, out = tmp_path / "chats.jsonl", str(tmp_path / "out")
    src.write_text("".join(_line(i) + "\n" for i in range(8)))
    regenerate(input=str(src), out_dir=out, target=tiny_target, **SETTINGS)
    path = os.path.join(out, "manifest.json")
    man = json.load(open(path))
    for key in ("input_files", "max_row_bytes", "max_row_depth"):  # as written before these were recorded
        del man[key]
    json.dump(man, open(path, "w"))
    _kill_last_shard(out)
    with caplog.at_level(logging.WARNING):
        s = regenerate(input=str(src), out_dir=out, target=tiny_target, resume=True, **SETTINGS)
    assert (s.shards_resumed, s.shards_written) == (2, 1)
    assert any("cannot check" in r.message and str(src) in r.message and "Recording the fingerprints now" in r.message
               for r in caplog.records), caplog.text
    assert json.load(open(path))["input_files"][0]["sha256"] == _sha(src)
    _kill_last_shard(out)
    src.write_text(src.read_text().replace("add 7", "add 70"))  # now an edit is caught
    with pytest.raises(ManifestMismatch, match=f"the source changed since the run began \\({src}: sha256 "):
        regenerate(input=str(src), out_dir=out, target=tiny_target, resume=True, **SETTINGS)


def test_a_shard_folder_source_names_the_file_added(tmp_path, tiny_target):
    folder, out = tmp_path / "src", str(tmp_path / "out")
    folder.mkdir()

    def shard(name, rows):
        pq.write_table(pa.Table.from_pylist([json.loads(_line(i)) for i in rows]), folder / name)

    shard("a.parquet", range(4))
    shard("b.parquet", range(4, 8))
    regenerate(input=str(folder), out_dir=out, target=tiny_target, **SETTINGS)
    _kill_last_shard(out)
    shard("0.parquet", range(3))  # sorts first: every later conversation moves
    with pytest.raises(ManifestMismatch, match=f"{folder / '0.parquet'}: not a source file when the run began"):
        regenerate(input=str(folder), out_dir=out, target=tiny_target, resume=True, **SETTINGS)

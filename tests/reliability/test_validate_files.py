"""Head folders whose weight files cannot be trusted or read (issue 20 item 10).

* A head that ships only pickled PyTorch weights (``pytorch_model.bin``) fails: specjax never
  unpickles (no ``torch.load`` / ``pickle`` anywhere in specjax/ or converters/), so `--validate`,
  the importer (`draft.init_from`, `specjax.eval`) and the doctor refuse it, naming the file and the fix.
* A safetensors file cut short (an interrupted download or copy) gets one line naming the file,
  ``<path> is truncated or not a safetensors file: ...``, in `--validate`, in `draft.init_from` and in
  `specjax.eval`'s load_draft, not a traceback from the safetensors reader.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys

import numpy as np
import pytest

from export._heads import make_draft, read_folder
from specjax.export import main as export_main
from specjax_converters.eagle3_export import export_eagle3
from specjax_converters.eagle3_import import read_head

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = "Fix: download or export it again."


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target_hf, cfg, params, vocab = make_draft(seed=0)
    return export_eagle3(params, cfg, vocab, target_hf, str(root / "good"), dtype="fp32")


def _copy(head, dst):
    shutil.copytree(head, dst)
    return str(dst)


def _bin_head(head, tmp_path, name="pytorch_model.bin"):
    """The same head with its weights only as a real torch.save pickle (the layout old heads ship)."""
    torch = pytest.importorskip("torch")
    config, tensors, _ = read_folder(head)
    folder = tmp_path / "bin_head"
    folder.mkdir()
    torch.save({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, folder / name)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _bin_error(folder, files="pytorch_model.bin"):
    return (f"{folder} holds only pickled PyTorch weights ({files}), no model.safetensors: specjax never unpickles "
            "weights (loading a pickle can run arbitrary code). Fix: convert them to model.safetensors in an "
            "environment you trust (safetensors.torch.save_file, or transformers' save_pretrained with "
            "safe_serialization=True), or download the head's safetensors weights.")


def _header_len(path):
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def _cut(folder, keep):
    """Cut model.safetensors to `keep` bytes (a callable of the full size); returns (path, full size)."""
    path = os.path.join(folder, "model.safetensors")
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[: keep(len(raw))])
    return path, len(raw)


@pytest.fixture
def no_unpickling(monkeypatch):
    """Any torch.load / pickle.load(s) in the code under test fails the test."""
    import pickle

    def forbidden(*a, **k):
        raise AssertionError("specjax unpickled a file")

    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)


# ----------------------------------------------------------------------------- pickled weights

def test_validate_refuses_a_bin_only_head(head, tmp_path, capsys, no_unpickling):
    folder = _bin_head(head, tmp_path)
    assert export_main(["--validate", folder]) == 2
    out = capsys.readouterr()
    assert out.err == f"error: {_bin_error(folder)}\n" and "OK" not in out.out, out


def test_other_pickle_names_are_listed(head, tmp_path, capsys, no_unpickling):
    folder = _bin_head(head, tmp_path, name="pytorch_model-00001-of-00001.bin")
    open(os.path.join(folder, "extra.pt"), "wb").write(b"x")
    assert export_main(["--validate", folder]) == 2
    assert capsys.readouterr().err == (
        f"error: {_bin_error(folder, 'extra.pt, pytorch_model-00001-of-00001.bin')}\n")


def test_import_and_doctor_refuse_a_bin_only_head(head, tmp_path, no_unpickling):
    folder = _bin_head(head, tmp_path)
    with pytest.raises(ValueError) as e:
        read_head(folder)
    assert str(e.value) == _bin_error(folder)

    from specjax.doctor import Report, _check_draft

    rep = Report()
    _check_draft(rep, folder, None)
    assert rep.failed == 1 and rep.lines == [("FAIL", "draft export contract", _bin_error(folder))]


def test_nothing_in_specjax_unpickles():
    """The README promise, checked on the source: no torch.load, pickle.load(s), np.load with
    allow_pickle=True, joblib / dill / cloudpickle in specjax/ or converters/."""
    bad = re.compile(r"torch\.load\(|pickle\.loads?\(|import (c?pickle|dill|joblib|cloudpickle)\b|"
                     r"from (c?pickle|dill|joblib|cloudpickle) import|allow_pickle\s*=\s*True|weights_only")
    hits = []
    for top in ("specjax", "converters"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    for no, line in enumerate(open(path, encoding="utf-8"), 1):
                        if bad.search(line):
                            hits.append(f"{os.path.relpath(path, REPO)}:{no}: {line.strip()}")
    assert hits == []


# ----------------------------------------------------------------------------- truncated safetensors

def test_validate_names_a_file_cut_in_the_tensor_data(head, tmp_path, capsys):
    folder = _copy(head, tmp_path / "h")
    path, size = _cut(folder, lambda n: n // 2)
    n = _header_len(path)
    assert export_main(["--validate", folder]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {path} is truncated or not a safetensors file: its header describes {size - 8 - n} "
                   f"bytes of tensor data, but only {size // 2 - 8 - n} follow. {FIX}\n")


@pytest.mark.parametrize("keep, why", [
    (lambda n: 5, "5 bytes, fewer than the 8 of the header length"),
    (lambda n: 40, "the header length says {n} bytes, but only 32 follow"),
    (lambda n: 0, "0 bytes, fewer than the 8 of the header length"),
])
def test_validate_names_a_file_cut_in_the_header(head, tmp_path, capsys, keep, why):
    folder = _copy(head, tmp_path / "h")
    n = _header_len(os.path.join(folder, "model.safetensors"))
    path, _ = _cut(folder, keep)
    assert export_main(["--validate", folder]) == 2
    assert capsys.readouterr().err == f"error: {path} is truncated or not a safetensors file: {why.format(n=n)}. {FIX}\n"


def test_validate_names_a_file_that_is_not_safetensors(head, tmp_path, capsys):
    folder = _copy(head, tmp_path / "h")
    path = os.path.join(folder, "model.safetensors")
    open(path, "wb").write(struct.pack("<Q", 6) + b"{nope}" + b"\0" * 8)
    assert export_main(["--validate", folder]) == 2
    assert capsys.readouterr().err == (
        f"error: {path} is truncated or not a safetensors file: the 6-byte header is not JSON "
        f"(Expecting property name enclosed in double quotes at character 1). {FIX}\n")
    raw = open(os.path.join(head, "model.safetensors"), "rb").read()
    open(path, "wb").write(raw + b"junk")  # safetensors refuses trailing bytes too
    assert export_main(["--validate", folder]) == 2
    assert capsys.readouterr().err == (
        f"error: {path} is truncated or not a safetensors file: 4 bytes follow the last tensor. {FIX}\n")


def test_validate_subprocess_prints_one_line_and_no_traceback(head, tmp_path):
    import subprocess

    folder = _copy(head, tmp_path / "h")
    path, size = _cut(folder, lambda n: n - 100)
    r = subprocess.run([sys.executable, "-m", "specjax.export", "--validate", folder], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: {path} is truncated or not a safetensors file: ")
    assert r.stderr.count("\n") == 1 and r.stderr.endswith(f"but only {size - 100 - 8 - _header_len(path)} follow. "
                                                           f"{FIX}\n")


def test_import_and_load_draft_name_the_truncated_file(head, tmp_path):
    from specjax.eval.spec_decode import load_draft

    folder = _copy(head, tmp_path / "h")
    path, size = _cut(folder, lambda n: n // 2)
    n = _header_len(path)
    want = (f"{path} is truncated or not a safetensors file: its header describes {size - 8 - n} bytes of tensor "
            f"data, but only {size // 2 - 8 - n} follow. {FIX}")
    for load in (read_head, load_draft):
        with pytest.raises(ValueError) as e:
            load(folder)
        assert str(e.value) == want


def test_sharded_head_with_a_missing_shard(head, tmp_path, capsys):
    folder = _copy(head, tmp_path / "h")
    os.rename(os.path.join(folder, "model.safetensors"), os.path.join(folder, "model-00001-of-00002.safetensors"))
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model-00001-of-00002.safetensors"), "numpy") as f:
        keys = list(f.keys())
    index = {"weight_map": {k: "model-00001-of-00002.safetensors" for k in keys}}
    index["weight_map"][keys[0]] = "model-00002-of-00002.safetensors"
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    assert export_main(["--validate", folder]) == 2
    assert capsys.readouterr().err == (
        f"error: {os.path.join(folder, 'model.safetensors.index.json')} names the shard "
        f"model-00002-of-00002.safetensors, which is not in {folder}. Fix: download every shard of the head.\n")


def test_eval_cli_names_the_truncated_file(head, tiny_target, tmp_path, capsys):
    from specjax.eval.cli import main

    folder = _copy(head, tmp_path / "h")
    path, size = _cut(folder, lambda n: n // 2)
    n = _header_len(path)
    rc = main(["--target", tiny_target, "--draft", folder, "--prompts", "mtbench", "--limit", "1"])
    assert rc == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {path} is truncated or not a safetensors file: its header describes {size - 8 - n} bytes of tensor "
        f"data, but only {size // 2 - 8 - n} follow. {FIX}")


def test_draft_init_from_names_the_truncated_file(head, tiny_target, tmp_path, capsys):
    from specjax.launch import main

    folder = _copy(head, tmp_path / "h")
    path, size = _cut(folder, lambda n: n // 2)
    n = _header_len(path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target:\n  path: {tiny_target}\n")
    rc = main(["--config", str(cfg), "target.dtype=float32",
               f"run.output_dir={tmp_path / 'o'}", "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]",
               "data.max_rows=40", "data.seq_length=64", "data.batch_size=8", "data.val_fraction=0.0",
               "train.eval_batches=0", "draft.ttt_steps=2", "draft.draft_vocab_size=96", "train.steps=1",
               "train.progress=false", "export.at_end=false", f"draft.init_from={folder}"])
    assert rc == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: {path} is truncated or not a safetensors file: its header describes {size - 8 - n} bytes of tensor "
        f"data, but only {size // 2 - 8 - n} follow. {FIX}")

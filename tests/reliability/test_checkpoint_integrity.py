"""Checkpoints that are damaged on disk, a disk that fills during a save, a resume with changed
settings, and signals outside the training steps (issue: reliability round two).

Every case uses real files: bytes flipped inside a saved tensor file, a deleted orbax metadata
file, garbage in the data-iterator JSON, a stray empty step folder, a real tmpfs filled to the last
bytes. The reference is an uninterrupted run of the same config: a run that falls back to an older
checkpoint must end exactly where it ends (CPU, fp32: bit-identical params)."""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from specjax import checkpoint as ckpt
from specjax.train.loop import train

from _runs import inprocess_config, write_config


def cfg(target, out, *extra):
    return inprocess_config(target, out, "train.steps=8", "checkpoint.every_steps=2", "checkpoint.keep=2",
                            "export.at_end=true", "export.dtype=float32", *extra)


def exported(out):
    from safetensors.numpy import load_file

    return load_file(os.path.join(out, "export", "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    train(cfg(tiny_target, out))
    return exported(out)


def assert_same_head(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.fixture(scope="module")
def stopped_run(tiny_target, tmp_path_factory):
    """A run checkpointed at 4 and 6 (keep=2) that stopped at 6, to be resumed to 8 (copied per test)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    res = train(cfg(tiny_target, out, "train.stop_at_step=6"))
    assert res.final_step == 6
    assert sorted(ckpt.manager(str(out / "checkpoints"), read_only=True).all_steps()) == [4, 6]
    for step in (4, 6):
        assert ckpt.verify(str(out / "checkpoints"), step) is None
    return out


def _stopped_at_6(stopped_run, out):
    shutil.copytree(stopped_run, out)
    return out / "checkpoints"


def _flip_bytes(path, n=400):
    data = bytearray(open(path, "rb").read())
    start = max(0, len(data) // 2 - n // 2)
    for i in range(start, min(len(data), start + n)):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _largest_state_file(step_dir):
    files = [p for p in glob.glob(os.path.join(step_dir, "state", "**", "*"), recursive=True) if os.path.isfile(p)]
    return max(files, key=os.path.getsize)


def _damage_tensor_bytes(d):
    path = _largest_state_file(str(d / "6"))
    size = os.path.getsize(path)
    _flip_bytes(path)
    assert os.path.getsize(path) == size  # size unchanged: only the checksums can tell
    return "does not match the sha256 written when it was saved"


def _delete_metadata(d):
    os.remove(d / "6" / "state" / "_METADATA")
    return "_METADATA is missing"


def _garbage_data_iter(d):
    files = [p for p in glob.glob(str(d / "6" / "data_iter" / "**" / "*"), recursive=True) if os.path.isfile(p)]
    assert files
    for p in files:
        open(p, "w").write("{garbage")
    return "data_iter"


def _stray_empty_step(d):
    os.makedirs(d / "50")  # e.g. a copy that never finished
    return "is not a complete checkpoint"


@pytest.mark.parametrize("damage", [_damage_tensor_bytes, _delete_metadata, _garbage_data_iter, _stray_empty_step],
                         ids=["flipped_tensor_bytes", "deleted_metadata", "garbage_data_iter", "stray_empty_step"])
def test_damaged_latest_checkpoint_falls_back_and_ends_like_an_uninterrupted_run(
        tiny_target, stopped_run, tmp_path, reference, caplog, damage):
    out = tmp_path / "run"
    d = _stopped_at_6(stopped_run, out)
    reason = damage(d)
    damaged_step = 50 if damage is _stray_empty_step else 6
    with caplog.at_level(logging.WARNING, logger="specjax"):
        res = train(cfg(tiny_target, out))
    assert res.final_step == 8 and res.export_dir
    warned = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(warned) == 1 and f"checkpoints/{damaged_step} is damaged" in warned[0] and reason in warned[0], warned
    assert "Moved aside to" in warned[0] and "trying the next older checkpoint" in warned[0]
    # the damaged folder is kept for inspection, outside orbax's sight and retention
    assert len(glob.glob(str(d / f"{damaged_step}.damaged-*"))) == 1
    steps = sorted(ckpt.manager(str(d), read_only=True).all_steps())
    assert steps == [6, 8] and all(ckpt.verify(str(d), s) is None for s in steps)
    # resumed from 4 (or 6 when only the stray folder was bad): the same trajectory, the same head
    assert_same_head(exported(out), reference)


def test_every_checkpoint_damaged_is_one_error_naming_each(tiny_target, stopped_run, tmp_path):
    out = tmp_path / "run"
    d = _stopped_at_6(stopped_run, out)
    for step in (4, 6):
        _flip_bytes(_largest_state_file(str(d / str(step))))
    with pytest.raises(ckpt.CheckpointDamaged, match=r"no checkpoint in .*checkpoints verifies \(6: .*sha256.*; 4: .*"
                                                     r"checkpoint\.restore_from=none"):
        train(cfg(tiny_target, out))


def test_explicit_restore_from_a_damaged_checkpoint_names_the_damage(tiny_target, stopped_run, tmp_path):
    out = tmp_path / "run"
    d = _stopped_at_6(stopped_run, out)
    os.remove(d / "4" / "state" / "_METADATA")
    with pytest.raises(ckpt.CheckpointDamaged, match=re.escape(
            f"checkpoint.restore_from='{d / '4'}' is damaged: {d / '4' / 'state' / '_METADATA'} is missing.")):
        train(cfg(tiny_target, tmp_path / "other", f"checkpoint.restore_from={d / '4'}"))


def test_non_finite_state_is_never_saved_nor_resumed(stopped_run, tmp_path):
    import jax
    import jax.numpy as jnp

    out = tmp_path / "run"
    d = _stopped_at_6(stopped_run, out)
    import orbax.checkpoint as ocp

    mngr = ckpt.manager(str(d), keep=2)
    state = mngr.restore(6, args=ocp.args.Composite(**{ckpt.STATE: ocp.args.StandardRestore()}))[ckpt.STATE]
    abstract = ckpt.abstract_like(state)
    bad = dict(state, params=jax.tree_util.tree_map(lambda x: x * jnp.nan, state["params"]))
    with pytest.raises(ckpt.NonFiniteState, match=r"refusing to save checkpoint 7 .*NaN/Inf; the previous "
                                                  r"checkpoint \(step 6\) is kept"):
        ckpt.save(mngr, 7, bad)
    assert sorted(mngr.all_steps()) == [4, 6]
    # a NaN checkpoint written behind the guard's back (orbax directly) is moved aside on resume
    mngr.save(7, args=ocp.args.Composite(**{ckpt.STATE: ocp.args.StandardSave(bad),
                                            ckpt.META: ocp.args.JsonSave({})}), force=True)
    mngr.wait_until_finished()
    got, _, step = ckpt.restore_verified(ckpt.manager(str(d), keep=2), abstract)
    assert step == 6 and ckpt.all_finite(got["params"])
    assert len(glob.glob(str(d / "7.damaged-*"))) == 1


# ---- a real full disk --------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_save_keeps_the_previous_checkpoint_and_no_partial_save(tiny_target, small_fs, monkeypatch):
    out = small_fs / "run"
    real_save, calls = ckpt.save, []

    def save_then_fill(mngr, step, *a, **k):
        real_save(mngr, step, *a, **k)
        calls.append(step)
        if len(calls) == 1:  # leave a few KiB: the next save runs out of space for real
            st = os.statvfs(small_fs)
            free = st.f_bavail * st.f_frsize
            with open(small_fs / "filler", "wb") as f:
                f.write(b"\0" * max(free - 16 * 1024, 0))

    monkeypatch.setattr(ckpt, "save", save_then_fill)
    with pytest.raises(ckpt.CheckpointSaveError, match=r"(?s)checkpoint for step 4 .* failed: .*"
                                                       r"previous checkpoint \(step 2\) is intact"):
        train(cfg(tiny_target, out, "train.log_every=100", "export.at_end=false"))
    d = out / "checkpoints"
    assert [n for n in os.listdir(d) if "tmp" in n] == []  # the failed save's leftovers are gone
    assert sorted(ckpt.manager(str(d), read_only=True).all_steps()) == [2]
    assert ckpt.verify(str(d), 2) is None
    os.remove(small_fs / "filler")
    monkeypatch.setattr(ckpt, "save", real_save)
    assert train(cfg(tiny_target, out, "export.at_end=false")).final_step == 8  # resumes from 2


# ---- a resume with other settings -----------------------------------------------------------------
def test_resume_with_a_changed_config_is_refused_then_allowed(tiny_target, tmp_path):
    out = tmp_path / "run"
    train(cfg(tiny_target, out, "train.stop_at_step=4"))
    changed = ("data.seq_length=48", "optim.lr=0.002", "draft.ttt_steps=3")
    with pytest.raises(ValueError) as e:
        train(cfg(tiny_target, out, *changed))
    msg = str(e.value)
    assert f"resuming {out} at step 4 with a different configuration" in msg
    for line in ("data.seq_length: 64 -> 48", "optim.lr: 0.0001 -> 0.002", "draft.ttt_steps: 2 -> 3"):
        assert line in msg, msg
    assert "checkpoint.allow_config_change=true" in msg
    # what may change between invocations is not a difference
    assert train(cfg(tiny_target, out, "train.stop_at_step=6", "train.log_every=3")).final_step == 6
    res = train(cfg(tiny_target, out, *changed, "checkpoint.allow_config_change=true"))
    assert res.final_step == 8
    kept = json.loads((out / "run_meta.before_step6.json").read_text())["config"]
    now = json.loads((out / "run_meta.json").read_text())
    assert kept["data"]["seq_length"] == 64 and now["config"]["data"]["seq_length"] == 48
    assert now["resumed_at_step"] == 6


# ---- signals outside the training steps -------------------------------------------------------------
def test_sigterm_during_the_final_validation_checkpoints_then_a_rerun_exports(tiny_target, tmp_path, reference,
                                                                              monkeypatch):
    from specjax.train import loop

    out = tmp_path / "run"
    real = loop._Trainer._validate

    def validate_and_term(self, step):
        if step == 8:  # the final validation
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, step)

    monkeypatch.setattr(loop._Trainer, "_validate", validate_and_term)
    c = cfg(tiny_target, out, "checkpoint.every_steps=3")  # the last in-loop save is step 6
    res = train(c)
    assert res.preempted and res.final_step == 8 and res.export_dir is None
    assert ckpt.manager(str(out / "checkpoints"), read_only=True).latest_step() == 8  # the tail is kept
    monkeypatch.setattr(loop._Trainer, "_validate", real)
    res = train(c)
    assert res.final_step == 8 and res.export_dir and not res.preempted
    assert_same_head(exported(out), reference)


def test_sigterm_during_setup_exits_cleanly_without_training(tiny_target, tmp_path, monkeypatch):
    from specjax.train import loop

    real = loop.build_run_setup

    def setup_and_term(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(loop, "build_run_setup", setup_and_term)
    res = train(cfg(tiny_target, tmp_path / "run"))
    assert res.preempted and res.final_step == 0 and res.export_dir is None
    assert ckpt.manager(str(tmp_path / "run" / "checkpoints"), read_only=True).all_steps() == []


def test_second_sigint_during_compile_exits_promptly_and_cleanly(tiny_target, tmp_path, repo_root):
    import sys

    from _runs import env

    out = tmp_path / "run"
    path = write_config(tmp_path / "cfg.yaml", tiny_target, out)
    e = dict(env(), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))  # empty: the step really compiles
    p = subprocess.Popen([sys.executable, "-m", "specjax.launch", "--config", path], cwd=repo_root, env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    t0 = time.time()
    for line in p.stdout:  # wait for the data pass; the step compiles right after it
        lines.append(line)
        if " data: " in line or time.time() - t0 > 120:
            break
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    t_second = time.time()
    p.send_signal(signal.SIGINT)
    rest, _ = p.communicate(timeout=60)
    log = "".join(lines) + rest
    assert p.returncode == 130, (p.returncode, log[-3000:])  # not -11 (segfault)
    assert time.time() - t_second < 30
    assert "second interrupt: exiting now; the last saved checkpoint is intact" in log

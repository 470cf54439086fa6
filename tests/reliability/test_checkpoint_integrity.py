"""Checkpoints that are damaged on disk, a disk that fills during a save, a resume with changed
settings, and signals outside the training steps (issue: reliability round two).

Every case uses real files: bytes flipped inside a saved tensor file, a deleted orbax metadata
file, garbage in the data-iterator JSON, a stray empty step folder, a real tmpfs filled to the last
bytes. The reference is an uninterrupted run of the same config: a run that falls back to an older
checkpoint must end exactly where it ends (CPU, fp32: bit-identical params)."""
from __future__ import annotations

import glob
import hashlib
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
from specjax import run_files
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
    bad = dict(state, params=jax.tree_util.tree_map(lambda x: x * jnp.nan, state["params"]),
               step=jnp.asarray(7, state["step"].dtype))
    with pytest.raises(ckpt.NonFiniteState, match=r"refusing to save checkpoint 7 .*NaN/Inf; the previous "
                                                  r"checkpoint \(step 6\) is kept"):
        ckpt.save(mngr, 7, bad)
    assert sorted(mngr.all_steps()) == [4, 6]
    # a NaN checkpoint written behind the guard's back (orbax directly, with its checksums, so that only
    # the finiteness check can tell) is moved aside on resume
    mngr.save(7, args=ocp.args.Composite(**{ckpt.STATE: ocp.args.StandardSave(bad),
                                            ckpt.META: ocp.args.JsonSave({})}), force=True)
    mngr.wait_until_finished()
    ckpt.write_checksums(str(d), 7)
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
    from specjax.train import run

    real = run.build_run_setup

    def setup_and_term(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(run, "build_run_setup", setup_and_term)
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


# ---- the checksum list itself ------------------------------------------------------------------------
# Each case edits checkpoint 6's specjax_checksums.json (4 is intact). A list that is missing,
# malformed or points outside the step folder makes 6 unverified: a warning, 6 moved aside as
# 6.unverified-*, and the run resumes from 4, which verifies. Entries that point at /dev/zero, at a
# FIFO outside the folder or through a link would hang a reader that opened them, and a list that is a
# link to /dev/zero would fill memory: the cases run in a subprocess under a time limit and a 3 GiB
# address-space limit, so a regression fails instead of hanging or eating the machine.
def _edit_list(step_dir, edit):
    path = step_dir / run_files.CHECKPOINT_CHECKSUMS_FILE
    listed = json.loads(path.read_text())
    path.write_text(json.dumps(edit(listed)))


def _list_deleted(step_dir):
    os.remove(step_dir / run_files.CHECKPOINT_CHECKSUMS_FILE)
    return "specjax_checksums.json is missing"


def _files_is_a_list(step_dir):
    _edit_list(step_dir, lambda listed: dict(listed, files=[]))
    return "'files' is list"


def _whole_list_is_x5(step_dir):
    (step_dir / run_files.CHECKPOINT_CHECKSUMS_FILE).write_text('{"x": 5}')
    return "keys ['x']"


def _entry_is_a_number(step_dir):
    _edit_list(step_dir, lambda listed: dict(listed, files=dict(listed["files"], x=5)))
    return "entry 'x' is int"


def _entry_dev_zero(step_dir):  # size 0 is what os.path.getsize says of /dev/zero: only reading it can tell
    _edit_list(step_dir, lambda listed: dict(listed, files={**listed["files"], "/dev/zero": {"size": 0,
                                                                                          "sha256": "0" * 64}}))
    return "entry '/dev/zero' is outside the step folder"


def _entry_dotdot_fifo(step_dir):  # opening a FIFO with no writer blocks forever
    os.mkfifo(step_dir.parent.parent / "outside.fifo")
    _edit_list(step_dir, lambda listed: dict(listed, files={**listed["files"], "../../outside.fifo": {
        "size": 0, "sha256": "0" * 64}}))
    return "entry '../../outside.fifo' is outside the step folder"


def _entry_link_to_dev_zero(step_dir):
    os.symlink("/dev/zero", step_dir / "zero")
    _edit_list(step_dir, lambda listed: dict(listed, files={**listed["files"], "zero": {"size": 0,
                                                                                     "sha256": "0" * 64}}))
    return "lists zero, which is a link or not a regular file"


def _list_is_a_link_to_dev_zero(step_dir):
    os.remove(step_dir / run_files.CHECKPOINT_CHECKSUMS_FILE)
    os.symlink("/dev/zero", step_dir / run_files.CHECKPOINT_CHECKSUMS_FILE)
    return "specjax_checksums.json is not a regular file"


_LIST_EDITS = {f.__name__.lstrip("_"): f for f in (
    _list_deleted, _files_is_a_list, _whole_list_is_x5, _entry_is_a_number, _entry_dev_zero, _entry_dotdot_fifo,
    _entry_link_to_dev_zero, _list_is_a_link_to_dev_zero)}

_RESTORE_EACH = r"""
import json, logging, os, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
sys.path.insert(0, sys.argv[1])
from _runs import small_abstract_state
from specjax import checkpoint as ckpt

warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("specjax").addHandler(Keep(level=logging.WARNING))
for case, directory in json.loads(sys.argv[2]).items():
    warnings.clear()
    t0 = time.monotonic()
    try:
        state, _, step = ckpt.restore_verified(ckpt.manager(directory, keep=3), small_abstract_state())
        got = {"step": step, "w": float(state["params"]["w"][0, 0])}
    except Exception as e:
        got = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(dict(got, case=case, warnings=list(warnings), seconds=time.monotonic() - t0,
                          folders=sorted(os.listdir(directory)))), flush=True)
"""


@pytest.fixture(scope="module")
def restored_after_list_edits(tmp_path_factory):
    """{case: what restore_verified did} for every edit in _LIST_EDITS, from one bounded subprocess."""
    import sys

    from _runs import env, save_small_checkpoints

    root = tmp_path_factory.mktemp("lists")
    dirs, reasons = {}, {}
    for case, edit in _LIST_EDITS.items():
        d = root / case / "checkpoints"
        save_small_checkpoints(d, (4, 6))
        reasons[case] = edit(d / "6")
        dirs[case] = str(d)
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.Popen([sys.executable, "-c", _RESTORE_EACH, here, json.dumps(dirs)], env=env(), cwd=root,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    results = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["case"]] = r
    return results, reasons, out


@pytest.mark.parametrize("case", sorted(_LIST_EDITS))
def test_unusable_checksum_list_warns_and_falls_back_to_the_older_verified_checkpoint(restored_after_list_edits,
                                                                                     case):
    results, reasons, out = restored_after_list_edits
    assert case in results, f"no result (hung, or crashed):\n{out[-3000:]}"
    r = results[case]
    assert r.get("step") == 4 and r.get("w") == 4.0, r
    assert r["seconds"] < 15, r  # nothing listed was read forever
    warned = [w for w in r["warnings"] if "checkpoints/6 could not be verified" in w]
    assert len(warned) == 1 and reasons[case] in warned[0], r["warnings"]
    assert "resuming from the older checkpoint 4, which verifies" in warned[0]
    # moved out of orbax's sight: the resumed run's own save of step 6 cannot collide with it
    assert "4" in r["folders"] and "6" not in r["folders"], r["folders"]
    assert [f for f in r["folders"] if f.startswith("6.unverified-")], r["folders"]


def test_unverified_checkpoint_is_used_with_a_warning_when_none_verifies(tmp_path, caplog):
    from _runs import save_small_checkpoints, small_abstract_state

    d = tmp_path / "checkpoints"
    save_small_checkpoints(d, (6,))
    os.remove(d / "6" / run_files.CHECKPOINT_CHECKSUMS_FILE)
    with caplog.at_level(logging.WARNING, logger="specjax"):
        state, _, step = ckpt.restore_verified(ckpt.manager(str(d)), small_abstract_state())
    assert step == 6 and float(state["params"]["w"][0, 0]) == 6.0
    warned = [r.getMessage() for r in caplog.records if "could not be verified" in r.getMessage()]
    assert len(warned) == 1 and "specjax_checksums.json is missing" in warned[0], warned
    assert "used unverified: a changed byte in it would go unnoticed" in warned[0]
    assert ckpt.verify(str(d), 6) is not None  # verify() never calls it verified


def test_checksum_list_entries_are_never_opened_outside_the_step_folder(tmp_path, monkeypatch):
    """check_files opens only the step folder's own regular files, whatever the list names."""
    import builtins

    from _runs import save_small_checkpoints

    d = tmp_path / "checkpoints"
    save_small_checkpoints(d, (6,))
    secret = tmp_path / "secret.txt"
    secret.write_text("not a checkpoint file")
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    os.symlink(secret, d / "6" / "via_link")
    entries = {str(secret): {"size": secret.stat().st_size, "sha256": digest},
               "../../secret.txt": {"size": secret.stat().st_size, "sha256": digest},
               "via_link": {"size": secret.stat().st_size, "sha256": digest}}
    root = os.path.realpath(d / "6")
    opened = []
    real_open, real_os_open = builtins.open, os.open

    def watch(opener):
        def wrapped(path, *a, **k):
            opened.append(os.path.realpath(path) if isinstance(path, (str, os.PathLike)) else path)
            return opener(path, *a, **k)
        return wrapped

    for name, want in entries.items():
        _edit_list(d / "6", lambda listed: dict(listed, files={**{k: v for k, v in listed["files"].items()
                                                                 if k not in entries}, name: want}))
        opened.clear()
        monkeypatch.setattr(builtins, "open", watch(real_open))
        monkeypatch.setattr(os, "open", watch(real_os_open))
        result = ckpt.check_files(str(d), 6)
        monkeypatch.undo()
        assert result.damage is None and result.unverified, (name, result)
        assert all(isinstance(p, int) or p.startswith(root + os.sep) for p in opened), (name, opened)
        assert str(secret) not in opened

"""One run per output folder (issue 53, item 2): a run holds an exclusive lock on run.output_dir
for its lifetime; a second run on the folder is refused at once with the holder's pid and host and
writes nothing; the lock of a killed run is gone with its process (the kernel drops a flock), so
the next run starts. Real processes throughout: specjax runs through `python -m specjax.launch`,
and small holders that take the lock with specjax.run_lock and sleep."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from specjax import run_files, run_lock
from specjax.train.metrics import read_metrics

from _runs import env, launch, run, wait_for_rows, write_config

_HOLDER = ("import sys, time\nfrom specjax import run_lock\nrun_lock.acquire(sys.argv[1])\n"
           "print('locked', flush=True)\ntime.sleep(600)\n")
_PROBE = ("import sys\nfrom specjax import run_lock\ntry:\n    run_lock.acquire(sys.argv[1])\n"
          "except run_lock.RunFolderInUse as e:\n    print('refused:', e)\nelse:\n    print('locked')\n")


def _holder(folder):
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], env=env(), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def _probe(folder) -> str:
    """What a fresh process gets when it tries to lock `folder`."""
    r = subprocess.run([sys.executable, "-c", _PROBE, str(folder)], env=env(), capture_output=True, text=True,
                       timeout=60)
    return r.stdout.strip() + r.stderr.strip()


def _wait_for_holder(out, proc, timeout=180):
    """Block until `proc` (a specjax run) holds out's lock, i.e. its pid is in the lock file."""
    path = os.path.join(out, run_files.LOCK_FILE)
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        try:
            with open(path) as f:
                if json.loads(f.read() or "{}").get("pid") == proc.pid:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{proc.pid} never locked {out}")


def test_second_run_on_the_same_folder_is_refused_with_the_holders_pid_and_host(tiny_target, tmp_path, repo_root):
    out = tmp_path / "run"
    first = write_config(tmp_path / "first.yaml", tiny_target, out, train={"steps": 8})
    second = write_config(tmp_path / "second.yaml", tiny_target, out, train={"steps": 8}, optim={"lr": 1e-3})
    p1 = launch(first, repo_root)
    try:
        _wait_for_holder(out, p1)
        # stopped once it trains (past the data pass, whose per-row time limit counts wall time): it stays
        # mid-run, holding the lock, however slow the second run is
        assert wait_for_rows(str(out), 1, p1), p1.communicate()[0][-3000:]
        os.kill(p1.pid, signal.SIGSTOP)
        try:
            t0 = time.time()
            rc, log = run(second, repo_root, timeout=120)
            took = time.time() - t0
        finally:
            os.kill(p1.pid, signal.SIGCONT)
        assert rc == 1, log[-3000:]
        assert (f"error: run.output_dir {out} is in use by another specjax run: pid {p1.pid} on host "
                f"{socket.gethostname()}, started ") in log, log[-3000:]
        assert "give this run another run.output_dir" in log
        assert took < 90  # refused at start-up: no data pass, no target build, no training
        log1, _ = p1.communicate(timeout=300)
    finally:
        if p1.poll() is None:
            p1.kill()
            p1.communicate()
    assert p1.returncode == 0, log1[-3000:]
    # only the first run wrote: each step's metrics once, its settings, its export
    assert [r["step"] for r in read_metrics(str(out)) if r.get("split") == "train"] == list(range(1, 9))
    assert json.loads((out / "run_meta.json").read_text())["config"]["optim"]["lr"] == 3e-3
    assert (out / "export" / "model.safetensors").exists()
    assert _probe(out) == "locked"  # released at the end of the run


def test_lock_of_a_killed_run_does_not_stop_the_next_run(tiny_target, tmp_path, repo_root):
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", tiny_target, out, train={"steps": 4})
    p = launch(config, repo_root)
    try:
        _wait_for_holder(out, p)
        assert _probe(out).startswith(f"refused: run.output_dir {out} is in use by another specjax run: pid {p.pid}")
    finally:
        p.kill()  # SIGKILL: no clean-up of any kind
        p.communicate()
    assert json.loads((out / run_files.LOCK_FILE).read_text())["pid"] == p.pid  # the dead holder's record stays
    rc, log = run(config, repo_root)
    assert rc == 0, log[-6000:]
    assert json.loads(log[log.index('{\n "output_dir"'):])["steps"] == 4


def test_stale_lock_of_a_killed_holder_is_taken_over(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(run_lock.RunFolderInUse, match=rf"pid {holder.pid} on host {socket.gethostname()}"):
            run_lock.acquire(str(tmp_path))
    finally:
        holder.kill()
        holder.wait()
    assert run_lock.acquire(str(tmp_path)) is not None
    try:
        record = json.loads((tmp_path / run_files.LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert _probe(tmp_path).startswith(f"refused: run.output_dir {tmp_path} is in use by another specjax run: "
                                           f"pid {os.getpid()}")
    finally:
        run_lock.release(str(tmp_path))
    assert _probe(tmp_path) == "locked"


def test_nested_holding_in_one_process_releases_with_the_outermost(tmp_path):
    """A caller that holds the folder around train() (whose build_run takes it again) keeps it until its own end."""
    with run_lock.holding(str(tmp_path)):
        with run_lock.holding(str(tmp_path)):
            pass
        assert _probe(tmp_path).startswith("refused:")  # still held after the inner block
    assert _probe(tmp_path) == "locked"


def test_lock_file_that_is_a_link_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep me")
    out = tmp_path / "run"
    out.mkdir()
    os.symlink(target, out / run_files.LOCK_FILE)
    with pytest.raises(OSError, match="run.output_dir .* is not writable"):
        run_lock.acquire(str(out))
    assert target.read_text() == "keep me"


def test_every_process_of_a_multi_process_run_is_refused(tiny_target, tmp_path, repo_root):
    """Only process 0 locks; the other processes learn its answer, so the whole run stops at once
    (none of them waits forever in a collective or writes into the held folder)."""
    out = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", tiny_target, out)
    holder = _holder(out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "specjax.launch", "--config", config], cwd=repo_root,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(env(), SPECJAX_COORDINATOR=f"127.0.0.1:{port}", SPECJAX_NUM_PROCESSES="2",
                                           SPECJAX_PROCESS_ID=str(i))) for i in range(2)]
        logs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        holder.kill()
        holder.wait()
    assert [p.returncode for p in procs] == [1, 1], [log[-2000:] for log in logs]
    assert f"is in use by another specjax run: pid {holder.pid} on host {socket.gethostname()}" in logs[0]
    assert f"error: process 0 could not lock run.output_dir {out}" in logs[1], logs[1][-2000:]
    assert sorted(os.listdir(out)) == [run_files.LOCK_FILE]  # nothing written by either process

"""The run-folder lock: at most one specjax run writes into a run.output_dir at a time.

A run holds an exclusive `fcntl.flock` on `<run.output_dir>/specjax.lock` from before anything is
written into the folder (the regeneration stage, the data pass's skipped_rows.jsonl and
draft_vocab.npz) until it ends. The kernel drops the lock when the holder's process dies, however
it dies (SIGKILL included), so a stale lock cannot outlive its run and needs no clean-up. The
holder writes its pid, host and start time into the file; a second run on the same folder is
refused at once with them (`RunFolderInUse`). The file itself stays (removing it would let a third
run lock a new file while a second still waits on the old one).

Several processes of one run (jax.distributed): only process 0 takes the lock, because the other
processes of the same run share the folder (several per host, or all on one host) and an exclusive
lock per process would refuse them; every other process learns from process 0 whether the run may
go on, so all processes of a refused run stop before writing. On a filesystem without flock support
the run goes on unlocked, with a warning.

Taking the lock again in a process that holds it (the launcher, then `train`) nests; the lock is
released when the outermost holder is done.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from typing import Iterator, Optional

from specjax.run_files import LOCK_FILE

_MAX_HOLDER_BYTES = 4096

log = logging.getLogger("specjax")

# lock file (real path) -> [fd, nesting depth], for the locks this process holds
_HELD: dict[str, list] = {}


class RunFolderInUse(ValueError):
    """Another run holds the run folder's lock."""


def lock_path(output_dir: str) -> str:
    return os.path.join(os.path.abspath(output_dir), LOCK_FILE)


def _holder_record() -> bytes:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                       "command": " ".join(sys.argv)[:500]}).encode()


def _describe_holder(fd: int) -> str:
    """The holder's pid, host and start time, read from the lock file (written by the holder)."""
    try:
        raw = os.pread(fd, _MAX_HOLDER_BYTES, 0)
        holder = json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        holder = None
    if not isinstance(holder, dict):
        return "another process (it has not recorded its pid yet: it is starting, or it is not specjax)"
    pid, host = holder.get("pid"), holder.get("host")
    text = f"pid {pid} on host {host}, started {holder.get('started')}"
    if holder.get("command"):
        text += f" ({str(holder['command'])[:200]})"
    if host == socket.gethostname() and isinstance(pid, int) and not _alive(pid):
        text += (f"; no pid {pid} runs on this host (as seen from here), so a process it started may still "
                 "hold the lock: end that process")
    return text


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def acquire(output_dir: str) -> Optional[int]:
    """Lock `output_dir` for this process (creating the folder): the lock file's descriptor, or None
    when the filesystem cannot lock (then the run goes on unlocked, with a warning). RunFolderInUse
    when another process holds it; OSError naming run.output_dir when the folder is not writable."""
    path = lock_path(output_dir)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        key = os.path.realpath(path)
        if key in _HELD:
            _HELD[key][1] += 1
            return _HELD[key][0]
        # O_NOFOLLOW: a link planted at the lock's name is refused, not followed
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise OSError(f"run.output_dir {output_dir!r} is not writable ({e}); choose another run.output_dir.") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe_holder(fd)
        os.close(fd)
        raise RunFolderInUse(
            f"run.output_dir {os.path.dirname(path)} is in use by another specjax run: {holder} (lock file {path}). "
            "Wait for that run to finish or stop it, or give this run another run.output_dir.") from None
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            log.warning("run.output_dir %s cannot be locked on this filesystem (%s): nothing stops a second run from "
                        "writing into it at the same time; start one run per folder.", os.path.dirname(path), e)
            return None
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_record(), 0)
    except OSError as e:  # e.g. a full disk: give the lock back rather than hold it unrecorded
        os.close(fd)
        raise OSError(f"run.output_dir {output_dir!r} is not writable ({e}); choose another run.output_dir.") from e
    _HELD[key] = [fd, 1]
    return fd


def release(output_dir: str) -> None:
    """Undo one `acquire` of `output_dir` by this process; the last one unlocks (clearing the holder)."""
    key = os.path.realpath(lock_path(output_dir))
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[key]
    fd = held[0]
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def holding(output_dir: str) -> Iterator[None]:
    """Hold `output_dir`'s lock for the block, in every process of the run (see the module doc):
    process 0 locks, and all processes raise RunFolderInUse when it could not."""
    import jax

    locked, error = False, None
    if jax.process_index() == 0:
        try:
            acquire(output_dir)
            locked = True
        except (RunFolderInUse, OSError) as e:
            error = e
    if jax.process_count() > 1:  # all processes stop together, before any of them writes
        import numpy as np
        from jax.experimental import multihost_utils

        ok = bool(multihost_utils.broadcast_one_to_all(np.int32(error is None)))
        if not ok and error is None:
            error = RunFolderInUse(f"process 0 could not lock run.output_dir {output_dir} (its log says why: another "
                                   "run holds it, or the folder is not writable).")
    if error is not None:
        raise error
    try:
        yield
    finally:
        if locked:
            release(output_dir)

"""Put a finished folder in place of another with no moment where the path is missing (standard
library only; used by every head exporter through specjax_converters.head_files and by
specjax.convert).

A writer builds its result in a hidden sibling made by `make_temp_folder(out_dir)`, named
`.<name>.tmp-<host>-<pid>-<random>`, and hands it to `publish(tmp, out_dir)`:

* no `out_dir` yet: one rename;
* `out_dir` exists: Linux `renameat2(RENAME_EXCHANGE)` swaps the two names in one step, so the path
  holds the old folder and then the new one, never nothing; the old folder, now under the hidden
  name, is removed after. Where the exchange is not available (another OS, an old C library, a file
  system that answers EINVAL) the old folder is first renamed aside into
  `.<name>.old-<host>-<pid>-<random>` and the new one renamed in: a kill between those two renames
  leaves the path missing until the next publish (the old folder is still in the hidden copy);
* then `remove_stale_copies(out_dir)` removes the hidden copies of the same `out_dir` left by
  publishes that were killed before they cleaned up: only names in the format above, made on this
  host, whose pid is no live process (a zombie counts as dead). Copies of live processes (a
  concurrent export of the same folder), of other hosts sharing the file system, and anything else
  in the folder are left alone.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import sys
import tempfile

__all__ = ["exchange", "make_temp_folder", "publish", "remove_stale_copies"]

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname())[:40] or "host"


def _prefix(out_dir: str, kind: str, pid: int | None = None) -> str:
    return f".{os.path.basename(out_dir)}.{kind}-{_host_tag()}-{os.getpid() if pid is None else pid}-"


def make_temp_folder(out_dir: str) -> str:
    """A new private (0700) hidden sibling of `out_dir` to write into, named with this host and pid
    so that `remove_stale_copies` can tell when its writer is gone. Creates `out_dir`'s parent."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=_prefix(out_dir, "tmp"), dir=parent)


def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # in glibc since 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def exchange(a: str, b: str) -> bool:
    """Swap the names `a` and `b` (both must exist) in one atomic step. False when this system or
    file system cannot (the caller falls back to two renames); OSError for any other failure."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def publish(tmp: str, out_dir: str) -> None:
    """Make the finished folder `tmp` (from make_temp_folder) appear at `out_dir`, replacing what is
    there (see the module docstring for what a kill at any point leaves), then remove stale hidden
    copies of earlier publishes of `out_dir`."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    if not os.path.lexists(out_dir):
        os.rename(tmp, out_dir)
    elif exchange(tmp, out_dir):
        _remove(tmp)  # the old folder, under the hidden name
    else:
        old = tempfile.mkdtemp(prefix=_prefix(out_dir, "old"), dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "x"))
        os.rename(tmp, out_dir)
        _remove(old)
    remove_stale_copies(out_dir)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OverflowError:
        return False
    try:  # a zombie (killed, not yet reaped by its parent) keeps its pid but writes nothing more
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def remove_stale_copies(out_dir: str) -> list[str]:
    """Remove the hidden `.tmp-` / `.old-` copies of `out_dir` made on this host by processes that
    no longer run; returns the paths removed."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    parent = os.path.dirname(out_dir)
    pattern = re.compile(re.escape(f".{os.path.basename(out_dir)}.") + r"(?:tmp|old)-" + re.escape(_host_tag())
                         + r"-([0-9]+)-[A-Za-z0-9_]+")
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid <= 0 or pid == os.getpid() or _pid_alive(pid):
            continue
        _remove(os.path.join(parent, name))
        removed.append(os.path.join(parent, name))
    return removed

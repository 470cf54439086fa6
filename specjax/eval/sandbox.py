"""Run an untrusted Python program (model-generated code) in a throwaway sandbox: an empty filesystem
view, its own PID, network, IPC and UTS namespaces, no capabilities, resource limits, and output that is
drained and capped. Linux only; stdlib only, because this file is also the launcher, which the base
interpreter imports as a top-level module (`python -I -S -c "...import sandbox..." <its folder>
<config>`), without the project or any site-packages.

Used by `specjax.eval.task_accuracy` (HumanEval verdicts). The calling side:

* `run_python(args, program, ...)` starts the launcher (this file, with the base interpreter, in a new
  session) and hands it the program's bytes on stdin. It drains the launcher's stderr (which is also
  the program's) and a status pipe at the same time, keeping only the first and last `KEPT_BYTES` of
  each and counting the rest, so a program that writes gigabytes costs no memory. At the time limit it
  kills the launcher's process group; the sandbox then dies with it (below). It returns an `Outcome`:
  exit status, whether the limit was hit, the kept stderr, and the lines the program wrote on fd 3.
* `probe()` (cached) launches a trivial program through the full sandbox and checks, from inside,
  that it saw the isolation: not root, or root of a user namespace with no capabilities (chroot is
  refused); PID 2 with the sandbox's init as parent; no network interface but loopback; none of the
  host's top-level folders, not this file, a read-only root and a writable /tmp. Its report lists
  what is missing (e.g. "unshare(CLONE_NEWPID) failed: EPERM"); `HOW_TO_FIX` says what to change.

The launcher, in order:

1. Reads the program from stdin. As real root it unshares mount, PID, network, IPC and UTS
   namespaces (no user namespace: the program will run as an unused uid instead). Otherwise, or when
   root may not unshare (a container without CAP_SYS_ADMIN), it also unshares a user namespace that
   maps only uid/gid 0 to the caller's. A failure names each namespace that cannot be created.
2. Forks the sandbox's init (PID 1 of the new PID namespace). Init calls setsid() (a kill(0, ...)
   of the program cannot reach the launcher's process group) and PR_SET_PDEATHSIG(SIGKILL): when the
   launcher dies (killed at the time limit, or its caller died and took it with its own
   PR_SET_PDEATHSIG), init dies, and when a PID namespace's init dies the kernel kills every process
   in it, `setsid` grandchildren included. The launcher also kills init itself past the wall limit.
3. Init builds the filesystem: all mounts private; a size-capped tmpfs as the new root holding only
   empty directories, read-only bind mounts of what the interpreter needs (its prefix and the
   system library folders /lib*, /usr/lib*, /usr/local/lib* as present, symbolic links kept as
   links, and /etc/ld.so.cache), the interpreter's site-packages covered by an empty read-only
   tmpfs (the program has the standard library only), /dev/null, /dev/zero and /dev/urandom, a
   proc of the new PID namespace (read-only; skipped when the kernel refuses it), and a size-capped
   writable tmpfs /tmp holding the program, its working directory and $HOME. The bind sources are
   opened before anything is mounted over them and mounted from their file descriptors. Then
   pivot_root into it, detach the old root (chroot alone is escapable with CAP_SYS_CHROOT) and
   remount the root read-only. Nothing else of the host is visible: no /home, /root (beyond the
   folders leading to the interpreter), /etc, /run, no Unix sockets (abstract Unix sockets belong
   to the empty network namespace).
4. Init forks the program's process, which sets the resource limits (address space, CPU seconds,
   file size, open files, processes, no core files), PR_SET_NO_NEW_PRIVS, drops the whole capability
   bounding set and the ambient set, then as root switches to uid/gid `SANDBOX_UID_BASE` + the
   launcher's PID (unused by anything else, and unique among concurrent sandboxes, so RLIMIT_NPROC
   counts only this sandbox's processes and a fork bomb stops at `Limits.processes`), clears its
   remaining capability sets, writes "sandbox:ready" on fd 3 and execs the interpreter with the
   given arguments (stdin /dev/null, environment PATH, LANG, HOME=/tmp, all other descriptors closed).
   As root of a user namespace the exec leaves it uid 0 there with no capabilities at all (empty
   bounding set, no_new_privs). The program is not PID 1: a signal to its parent (init) from
   inside the namespace is dropped by the kernel, and kill(-1, ...) reaches only the namespace.
5. Init reaps until the program ends, writes "sandbox:exit N" or "sandbox:signal N" on fd 3 and
   exits with the program's status (128 + N for a signal), which tears the namespace down; the
   launcher exits with init's status.

Everything the launcher or init reports before "sandbox:ready" (e.g. "sandbox:error mount(proc)
failed: EPERM") is a setup failure (`SandboxError`, never caused by the program: it has not started).
After it, fd 3 belongs to the program.

`run_python(..., isolated=False)` is the weaker mode for machines without namespaces (the caller's
explicit choice, e.g. `--unsafe-exec`): the program runs in a fresh host temporary folder, with the
same resource limits except the process count, an empty network namespace where `unshare -rn` works
(`weak_prefix()`), and its process group killed at the end; it can read and write whatever its user
can, signal that user's processes, and leave processes behind.

Memory is bounded per process (address space) and by the process count, i.e. at most
`Limits.processes` x `Limits.address_space` plus the two tmpfs sizes for one program; there is no
cgroup.
"""
from __future__ import annotations

# Only light modules at the top: this file is also the launcher, started once per program, and the
# calling side's heavier imports (subprocess, tempfile, ...) are made where they are used.
import errno
import marshal
import os
import select
import signal
import sys
import time

__all__ = ["Limits", "Outcome", "SandboxError", "SandboxUnavailable", "run_python", "probe", "describe",
           "base_interpreter", "weak_prefix", "mount_plan", "KEPT_BYTES", "SANDBOX_UID_BASE", "READY", "STATUS_PREFIX",
           "HOW_TO_FIX"]

KEPT_BYTES = 4096  # of stderr and of the status pipe: the first and the last this many bytes are kept
SANDBOX_UID_BASE = 2_000_000_000  # + the launcher's PID (< 2^22): no account has such a uid
READY = "sandbox:ready"
STATUS_PREFIX = "sandbox:"  # lines the launcher and init write on fd 3 (the program's own lines have no such prefix)
_EXIT_GRACE_S = 2.0  # after the launcher ended, how long stray holders of its pipes are waited for (weak mode)
_KILL_GRACE_S = 5.0  # after the kill at the time limit, how long the pipes are drained before giving up
_WALL_EXTRA_S = 5.0  # the launcher's own backstop beyond the caller's time limit
_LIB_DIRS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32",
             "/usr/local/lib", "/usr/local/lib64")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
_FILES = ("/etc/ld.so.cache",)  # the dynamic loader's index of the library folders
_CACHE: dict = {}  # once-per-process answers: the mount plan, `unshare -rn`, the probe
# The launcher imports this file as a top-level module (not `python sandbox.py`, whose code is compiled
# on every start): its cached bytecode is used, and nothing of the project is imported.
_LAUNCH = "import sys; sys.path.insert(0, sys.argv[1]); import sandbox; sys.exit(sandbox.launcher_main(sys.argv[2:]))"


class SandboxError(RuntimeError):
    """The sandbox could not be set up for one program (before the program started)."""


class SandboxUnavailable(RuntimeError):
    """This machine cannot give the isolation; the message says what is missing and what to do."""


class Limits:
    """Resource limits of one program (bytes, seconds, counts). `processes` counts tasks (threads
    too) of the program's uid and is not applied in the weak mode; `tmp_bytes` sizes the writable
    /tmp (plus the program's own size)."""
    FIELDS = ("cpu_s", "address_space", "file_size", "open_files", "processes", "tmp_bytes")

    def __init__(self, cpu_s: int = 11, address_space: int = 2 << 30, file_size: int = 16 << 20,
                 open_files: int = 64, processes: int = 8, tmp_bytes: int = 64 << 20):
        self.cpu_s, self.address_space, self.file_size = cpu_s, address_space, file_size
        self.open_files, self.processes, self.tmp_bytes = open_files, processes, tmp_bytes

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.FIELDS}

    def __repr__(self) -> str:
        return f"Limits({', '.join(f'{k}={v}' for k, v in self.to_dict().items())})"

    def describe(self, isolated: bool = True, cpu: str | None = None) -> str:
        """The limits in words (`cpu`: how to word the CPU limit, e.g. in terms of a time limit)."""
        text = (f"RLIMIT_AS {self.address_space >> 20} MiB, RLIMIT_CPU {cpu or f'{self.cpu_s} s'}, RLIMIT_FSIZE "
                f"{self.file_size >> 20} MiB, RLIMIT_NOFILE {self.open_files}, RLIMIT_CORE 0")
        if isolated:
            text += f", RLIMIT_NPROC {self.processes}, /tmp tmpfs {self.tmp_bytes >> 20} MiB"
        return text


class _Capped:
    """The first and last KEPT_BYTES of a byte stream, and its total length."""

    def __init__(self, keep: int = KEPT_BYTES):
        self.keep, self.head, self.tail, self.total = keep, bytearray(), bytearray(), 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.keep - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.keep:  # trim in batches: linear in the stream
                del self.tail[:-self.keep]

    def text(self) -> str:
        tail = self.tail[-self.keep:]
        gap = self.total - len(self.head) - len(tail)
        mid = f"\n[... {gap} bytes not kept ...]\n" if gap > 0 else ""
        return (bytes(self.head).decode("utf-8", "replace") + mid + bytes(tail).decode("utf-8", "replace"))

    def last_line(self) -> str:
        for ln in reversed(self.text().splitlines()):
            if ln.strip():
                return ln.strip()
        return ""


class Outcome:
    """What one run gave: `returncode` is the program's exit status (128 + N when signal N ended it;
    negative when the launcher itself was killed, e.g. at the time limit); `ready`: the program was
    started; `setup_error`: why the sandbox could not start it (then `ready` is False); `stderr`: its
    first and last KEPT_BYTES, of `stderr_bytes`; `messages`: the program's own lines on fd 3;
    `signal`: the signal that ended the program, as the sandbox's init saw it."""

    def __init__(self, returncode: int | None, timed_out: bool, ready: bool, setup_error: str | None, stderr: str,
                 stderr_bytes: int, messages: list, signal: int | None, wall_s: float):
        self.returncode, self.timed_out, self.ready, self.setup_error = returncode, timed_out, ready, setup_error
        self.stderr, self.stderr_bytes, self.messages, self.signal = stderr, stderr_bytes, messages, signal
        self.wall_s = wall_s

    def __repr__(self) -> str:
        return f"Outcome({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def last_stderr_line(self) -> str:
        for ln in reversed(self.stderr.splitlines()):
            if ln.strip():
                return ln.strip()
        return ""


# --- the calling side --------------------------------------------------------------------------


def base_interpreter() -> str:
    """The base interpreter (not a virtual environment's): the sandbox mounts only its prefix."""
    v = sys.version_info
    for name in (f"python{v.major}.{v.minor}", f"python{v.major}"):
        cand = os.path.join(sys.base_prefix, "bin", name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.realpath(cand)
    return os.path.realpath(sys.executable)


def mount_plan(python: str | None = None) -> dict:
    """What the sandbox's root holds: read-only bind mounts ("binds": real paths, mounted at the same
    path), symbolic links ("links": path -> target, their targets bound too), device nodes and files
    bound from the host, and the interpreter's site-packages folders, each covered by an empty
    read-only tmpfs ("hide"): the program gets the standard library only, and `python -I` starts
    without importing the host's packages (and their .pth hooks). Computed once per process."""
    key = ("mount_plan", python or base_interpreter())
    if key not in _CACHE:
        _CACHE[key] = _mount_plan(key[1])
    return _CACHE[key]


def _mount_plan(python: str) -> dict:
    wanted = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix),
              os.path.dirname(os.path.realpath(python))}
    links = {}
    for d in _LIB_DIRS:
        if os.path.islink(d):
            links[d] = os.readlink(d)
            if os.path.isdir(d):
                wanted.add(os.path.realpath(d))
        elif os.path.isdir(d):
            wanted.add(os.path.realpath(d))
    if "/" in wanted:
        raise SandboxError("the interpreter's prefix is / : nothing of the host could be hidden")
    binds = []
    for p in sorted(wanted):
        if not any(_under(p, b) for b in binds):  # else already visible through a folder above it
            binds.append(p)
    import site

    hide = sorted({os.path.realpath(d) for d in site.getsitepackages([sys.base_prefix, sys.base_exec_prefix])
                   if os.path.isdir(d)})
    return {"binds": binds, "links": links, "devices": [d for d in _DEVICES if os.path.exists(d)],
            "files": [f for f in _FILES if os.path.isfile(f)],
            "hide": [d for d in hide if any(_under(d, b) for b in binds)]}


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _top_names(plan: dict) -> set:
    names = {"dev", "proc", "tmp"}
    for p in [*plan["binds"], *plan["links"], *plan["files"]]:
        names.add(p.strip("/").split("/")[0])
    return names


def weak_prefix() -> tuple:
    """`unshare -rn` (an empty network namespace as root of a user namespace) where it works, for the
    weak mode; () where it does not. Checked once per process."""
    if "weak_prefix" not in _CACHE:
        _CACHE["weak_prefix"] = _find_weak_prefix()
    return _CACHE["weak_prefix"]


def _find_weak_prefix() -> tuple:
    import shutil
    import subprocess

    exe = shutil.which("unshare")
    if not exe or not sys.platform.startswith("linux"):
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], stdin=subprocess.DEVNULL, capture_output=True,
                            timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (exe, "-rn") if ok else ()


def run_python(args: list[str], program: bytes, *, program_name: str = "program.py", timeout_s: float,
               limits: Limits | None = None, isolated: bool = True, ns_mode: str = "auto") -> Outcome:
    """Run `python <args>` with `program` saved as `program_name` in its working directory, in the
    sandbox (`isolated`) or in the weak mode; see the module docstring. `ns_mode` "auto" (root: no
    user namespace; otherwise one) or "userns" (a user namespace even as root)."""
    if not timeout_s > 0:
        raise ValueError(f"the time limit must be > 0 seconds, got {timeout_s}")
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable(f"the sandbox needs Linux namespaces; this is {sys.platform}")
    if ns_mode not in ("auto", "userns"):
        raise ValueError(f"ns_mode must be 'auto' or 'userns', got {ns_mode!r}")
    import subprocess
    import tempfile

    limits = limits or Limits()
    python = base_interpreter()
    t0 = time.monotonic()
    chan_r, chan_w = os.pipe()
    cfg = {"mode": "sandbox" if isolated else "weak", "ns_mode": ns_mode, "python": python, "args": list(args),
           "program_name": program_name, "limits": limits.to_dict(), "channel_fd": chan_w, "parent_pid": os.getpid(),
           "wall_s": timeout_s + _WALL_EXTRA_S, "weak_prefix": list(weak_prefix()) if not isolated else []}
    tmp = None
    try:
        if isolated:
            cfg["plan"] = mount_plan(python)
        else:
            tmp = tempfile.TemporaryDirectory(prefix="specjax_exec_", ignore_cleanup_errors=True)
            cfg["cwd"] = tmp.name
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(program)
            stdin_file.seek(0)
            try:
                proc = subprocess.Popen([python, "-I", "-S", "-c", _LAUNCH, os.path.dirname(os.path.abspath(__file__)),
                                         marshal.dumps(cfg).hex()],
                                        stdin=stdin_file, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        pass_fds=(chan_w,), start_new_session=True, cwd=tmp.name if tmp else "/",
                                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
            except OSError as e:
                raise SandboxError(f"could not start the sandbox launcher {python}: {e}") from e
            finally:
                os.close(chan_w)  # the launcher has its copy: EOF on chan_r once every holder is gone
                chan_w = -1
            err, chan, timed_out = _drain(proc, chan_r, t0 + timeout_s)
    finally:
        if chan_w >= 0:
            os.close(chan_w)
        os.close(chan_r)
        if tmp is not None:
            tmp.cleanup()
    return _outcome(proc, err, chan, timed_out, time.monotonic() - t0)


def _drain(proc, chan_r: int, deadline: float) -> tuple:
    """Read stderr and the status pipe until both end (or the grace after the launcher's end or
    after the kill at the deadline runs out), keeping only their ends."""
    err, chan = _Capped(), _Capped()
    err_fd = proc.stderr.fileno()
    sinks = {err_fd: err, chan_r: chan}
    poller = select.poll()
    for fd in sinks:
        poller.register(fd, select.POLLIN)
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
            poller.register(pidfd, select.POLLIN)
        except OSError:
            pidfd = None
    ended_at = killed_at = None
    timed_out = False
    try:
        while sinks:
            now = time.monotonic()
            if ended_at is None and _has_ended(proc.pid):
                ended_at = now
                if pidfd is not None:
                    poller.unregister(pidfd)
            if ended_at is None and now >= deadline and killed_at is None:
                timed_out, killed_at = True, now
                _kill_group(proc.pid)
            if ended_at is not None and now - ended_at > _EXIT_GRACE_S:
                break  # a process outside the sandbox (weak mode) still holds the pipes
            if killed_at is not None and now - killed_at > _KILL_GRACE_S:
                break
            if ended_at is not None:
                wait = ended_at + _EXIT_GRACE_S - now
            elif killed_at is not None:
                wait = killed_at + _KILL_GRACE_S - now
            else:
                wait = deadline - now
            if pidfd is None:
                wait = min(wait, 0.05)
            for fd, _ in poller.poll(max(wait, 0.0) * 1000):
                if fd == pidfd:
                    continue
                data = os.read(fd, 65536)
                if data:
                    sinks[fd].feed(data)
                else:
                    poller.unregister(fd)
                    del sinks[fd]
    finally:
        if pidfd is not None:
            os.close(pidfd)
        _kill_group(proc.pid)  # anything left in the launcher's group (the weak mode's program)
        proc.wait()  # killed: it cannot linger
        proc.stderr.close()
    return err, chan, timed_out


def _has_ended(pid: int) -> bool:
    """Whether the launcher has exited, without reaping it (its PID stays its process group's)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _outcome(proc, err: _Capped, chan: _Capped, timed_out: bool, wall_s: float) -> Outcome:
    lines = chan.text().splitlines()
    ready = READY in lines
    before = lines[:lines.index(READY)] if ready else lines
    errors = [ln[len("sandbox:error "):] for ln in before if ln.startswith("sandbox:error ")]
    after = lines[lines.index(READY) + 1:] if ready else []
    messages = [ln for ln in after if not ln.startswith(STATUS_PREFIX)]
    sig = None
    for ln in after:  # init's line comes last (the program's own could forge one: it only mislabels itself)
        word = ln[len("sandbox:signal "):] if ln.startswith("sandbox:signal ") else ""
        if word.isdigit() and len(word) <= 3:
            sig = int(word)
    setup_error = None
    if not ready and not timed_out:
        setup_error = "; ".join(errors) or (f"the sandbox launcher ended with status {proc.returncode} before "
                                            f"starting the program: {err.last_line() or 'no message'}")
    return Outcome(proc.returncode, timed_out, ready, setup_error, err.text(), err.total, messages, sig, wall_s)


_PROBE = r'''
import json, os, socket, sys
r = {"uid": os.getuid()}
try:
    os.chroot("/")
    r["chroot_refused"] = False
except OSError:
    r["chroot_refused"] = True
r["cap_eff"] = None
try:
    for line in open("/proc/self/status"):
        if line.startswith("CapEff:"):
            r["cap_eff"] = int(line.split()[1], 16)
except OSError:
    pass
r["pid"], r["ppid"] = os.getpid(), os.getppid()
try:
    r["procs"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
except OSError:
    r["procs"] = None
r["interfaces"] = sorted(n for _, n in socket.if_nameindex())
r["top"] = sorted(os.listdir("/"))
r["visible"] = [p for p in sys.argv[1:] if os.path.exists(p)]
try:
    open("/probe-write", "w").close()
    r["root_read_only"] = False
except OSError:
    r["root_read_only"] = True
try:
    with open("/tmp/probe-write", "w") as f:
        f.write("x")
    r["tmp_writable"] = True
except OSError:
    r["tmp_writable"] = False
sys.stderr.write(json.dumps(r) + "\n")
'''


def probe(ns_mode: str = "auto") -> dict:
    """Run a trivial program through the full sandbox and check what it saw (see the module
    docstring); once per process and `ns_mode`. {"ok": bool, "missing": [what is missing, ...], "mode":
    "root" or "user namespace", "proc": whether /proc was mounted, "seen": the program's report}."""
    key = ("probe", ns_mode)
    if key not in _CACHE:
        _CACHE[key] = _probe(ns_mode)
    return _CACHE[key]


def _probe(ns_mode: str) -> dict:
    out: dict = {"ok": False, "missing": [], "mode": None, "proc": None, "seen": None}
    if not sys.platform.startswith("linux"):
        out["missing"].append(f"Linux namespaces (this is {sys.platform})")
        return out
    try:
        plan = mount_plan()
    except SandboxError as e:
        out["missing"].append(str(e))
        return out
    host_only = sorted(n for n in os.listdir("/") if n not in _top_names(plan))
    hidden = [os.path.abspath(__file__), *("/" + n for n in host_only)]
    try:
        res = run_python(["-I", "-S", "-c", _PROBE, *hidden], b"", timeout_s=30.0, ns_mode=ns_mode)
    except (SandboxError, SandboxUnavailable, OSError) as e:
        out["missing"].append(str(e))
        return out
    if res.setup_error:
        out["missing"].append(res.setup_error)
        return out
    try:
        import json

        seen = json.loads(res.last_stderr_line())
    except ValueError:
        out["missing"].append(f"the probe program failed in the sandbox (status {res.returncode}"
                              f"{', timed out' if res.timed_out else ''}): {res.last_stderr_line() or 'no message'}")
        return out
    out["seen"], out["proc"] = seen, seen["procs"] is not None
    out["mode"] = "root" if seen["uid"] != 0 else "user namespace"
    miss = out["missing"]
    if seen["uid"] == 0 and (seen["cap_eff"] not in (0, None)):
        miss.append(f"capabilities: the program kept capabilities {seen['cap_eff']:#x}")
    if not seen["chroot_refused"]:
        miss.append("capabilities: the program could call chroot()")
    if seen["pid"] != 2 or seen["ppid"] != 1 or (seen["procs"] is not None and not set(seen["procs"]) <= {1, 2}):
        miss.append(f"PID namespace: the program saw pid {seen['pid']}, parent {seen['ppid']}, processes "
                    f"{(seen['procs'] or [])[:10]}")
    if not set(seen["interfaces"]) <= {"lo"}:
        miss.append(f"network namespace: the program saw interfaces {seen['interfaces']}")
    if seen["visible"]:
        miss.append(f"filesystem: the program saw host paths {seen['visible'][:5]}")
    if not seen["root_read_only"]:
        miss.append("filesystem: the sandbox's root was writable")
    if not seen["tmp_writable"]:
        miss.append("filesystem: /tmp was not writable")
    if res.returncode != 0:
        miss.append(f"the probe program ended with status {res.returncode}")
    out["ok"] = not miss
    return out


HOW_TO_FIX = ("creating mount, PID, network, IPC and UTS namespaces and mounting must be allowed (as root; the "
              "sysctls user.max_<kind>_namespaces above 0), and as another user unprivileged user namespaces too "
              "(kernel.unprivileged_userns_clone=1; on Ubuntu 24.04+ kernel.apparmor_restrict_unprivileged_userns=0); "
              "in a container e.g. docker run --cap-add SYS_ADMIN --security-opt seccomp=unconfined --security-opt "
              "apparmor=unconfined")


def describe(limits: Limits, isolated: bool = True, report: dict | None = None) -> dict:
    """What is in force, for the results (`report`: the probe's, when isolated)."""
    python = base_interpreter()
    if not isolated:
        pre = weak_prefix()
        return {"python": python, "sandbox": None,
                "filesystem": "the host's, as the calling user (a fresh temporary folder as the working directory)",
                "processes": "its own session, killed at the end; other processes of the user can be signalled",
                "network": ("an empty network namespace (unshare -rn)" if pre else
                            "the host's (unshare -rn unavailable)"),
                "limits": limits.describe(isolated=False)}
    plan = mount_plan(python)
    report = report or {}
    mode = report.get("mode")
    user = (f"uid/gid {SANDBOX_UID_BASE} + the launcher's pid, no capabilities, no_new_privs" if mode == "root" else
            "uid 0 of its own user namespace (the caller's uid outside), no capabilities, no_new_privs")
    return {"python": python,
            "sandbox": f"namespaces: mount, pid, network, ipc, uts{'' if mode == 'root' else ', user'}",
            "user": user,
            "filesystem": (f"an empty read-only tmpfs root with read-only binds of {', '.join(plan['binds'])} "
                           f"(site-packages hidden: {', '.join(plan['hide']) or 'none'}); "
                           f"links {', '.join(f'{k} -> {v}' for k, v in plan['links'].items()) or 'none'}; "
                           f"{', '.join(plan['devices'] + plan['files'])}; writable /tmp (tmpfs, the working "
                           f"directory); {'proc of its own PID namespace' if report.get('proc') else 'no /proc'}"),
            "processes": "its own PID namespace: everything it starts is killed when it ends",
            "network": "an empty network namespace (loopback down)",
            "limits": limits.describe(isolated=True)}


# --- the launcher (`launcher_main`, in its own process) ---------------------------------------

_CLONE = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000,
          "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME, _MS_STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 1, 24, 38, 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217}
_RLIMITS = (("RLIMIT_AS", "address_space"), ("RLIMIT_CPU", "cpu_s"), ("RLIMIT_FSIZE", "file_size"),
            ("RLIMIT_NOFILE", "open_files"), ("RLIMIT_NPROC", "processes"))


class _SetupFailed(Exception):
    pass


class _Libc:
    def __init__(self):
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)

    def _check(self, what: str, rc: int) -> None:
        if rc == -1:
            e = self.ctypes.get_errno()
            raise _SetupFailed(f"{what} failed: {errno.errorcode.get(e, e)} ({os.strerror(e)})")

    def unshare(self, flags: int, what: str) -> None:
        self._check(f"unshare({what})", self.lib.unshare(self.ctypes.c_int(flags)))

    def mount(self, source, target, fstype, flags: int, data=None) -> None:
        c = self.ctypes
        enc = (lambda s: None if s is None else os.fsencode(s))
        self._check(f"mount({fstype or ('bind' if flags & _MS_BIND else 'remount')} {target})",
                    self.lib.mount(enc(source), enc(target), enc(fstype), c.c_ulong(flags), enc(data)))

    def umount2(self, target: str, flags: int) -> None:
        self._check(f"umount2({target})", self.lib.umount2(os.fsencode(target), self.ctypes.c_int(flags)))

    def pivot_root(self, new: str, old: str) -> None:
        machine = os.uname().machine
        nr = _SYS_PIVOT_ROOT.get(machine)
        if nr is None:
            raise _SetupFailed(f"pivot_root: unknown system call number on {machine}")
        self._check("pivot_root", self.lib.syscall(self.ctypes.c_long(nr), os.fsencode(new), os.fsencode(old)))

    def prctl(self, option: int, arg: int, what: str) -> None:
        c = self.ctypes
        self._check(what, self.lib.prctl(c.c_int(option), c.c_ulong(arg), c.c_ulong(0), c.c_ulong(0), c.c_ulong(0)))

    def drop_bounding_set(self) -> None:
        """Every capability out of the bounding set (until the kernel says there are no more)."""
        c = self.ctypes
        for cap in range(64):
            rc = self.lib.prctl(c.c_int(_PR_CAPBSET_DROP), c.c_ulong(cap), c.c_ulong(0), c.c_ulong(0), c.c_ulong(0))
            if rc == -1:
                if c.get_errno() == errno.EINVAL and cap > 0:
                    return  # past the last capability this kernel has
                self._check(f"prctl(PR_CAPBSET_DROP, {cap})", rc)

    def clear_capabilities(self) -> None:
        c = self.ctypes

        class Header(c.Structure):
            _fields_ = [("version", c.c_uint32), ("pid", c.c_int)]

        class Data(c.Structure):
            _fields_ = [("effective", c.c_uint32), ("permitted", c.c_uint32), ("inheritable", c.c_uint32)]

        hdr, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
        self._check("capset", self.lib.capset(c.byref(hdr), data))


def _say(fd: int, line: str) -> None:
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode("utf-8", "replace"))
    except OSError:
        pass


def launcher_main(argv: list[str]) -> int:
    """The launcher's entry point (argv: the hex of the marshalled configuration); see the module
    docstring."""
    cfg = marshal.loads(bytes.fromhex(argv[0]))  # written by run_python with this same interpreter
    chan = cfg["channel_fd"]
    try:
        libc = _Libc()
        # die with the caller (its thread that started us); it may already be gone
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != cfg["parent_pid"]:
            raise _SetupFailed("the caller ended before the sandbox started")
        program = sys.stdin.buffer.read()
        if cfg["mode"] == "weak":
            _exec_weak(cfg, program, chan)  # does not return
        root = _unshare(libc, cfg["ns_mode"])
    except _SetupFailed as e:
        _say(chan, f"sandbox:error {e}")
        return 125
    uid = SANDBOX_UID_BASE + os.getpid() if root else None  # unique while this launcher lives
    alive_r, alive_w = os.pipe()  # init sees EOF on alive_r when the launcher is gone
    init = os.fork()
    if init == 0:
        os.close(alive_w)
        try:
            _init(libc, cfg, program, chan, alive_r, uid)
        except _SetupFailed as e:
            _say(chan, f"sandbox:error {e}")
        except BaseException as e:  # noqa: BLE001 - reported on the status pipe, never raised past init
            _say(chan, f"sandbox:error {type(e).__name__}: {e}")
        os._exit(125)
    os.close(alive_r)
    signal.signal(signal.SIGALRM, lambda *_: os.kill(init, signal.SIGKILL))
    signal.setitimer(signal.ITIMER_REAL, cfg["wall_s"])
    _, status = os.waitpid(init, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _unshare(libc: _Libc, ns_mode: str) -> bool:
    """Enter the new namespaces; True when running as real root (no user namespace)."""
    base = ["CLONE_NEWNS", "CLONE_NEWPID", "CLONE_NEWNET", "CLONE_NEWIPC", "CLONE_NEWUTS"]
    flags = sum(_CLONE[n] for n in base)
    uid, gid = os.getuid(), os.getgid()
    if os.geteuid() == 0 and ns_mode == "auto":
        try:
            libc.unshare(flags, "|".join(base))
            return True
        except _SetupFailed as e:
            as_root = "as root: " + (_which_fail(libc, base, 0) or str(e))
    else:
        as_root = ""
    try:
        libc.unshare(flags | _CLONE["CLONE_NEWUSER"], "|".join(["CLONE_NEWUSER", *base]))
    except _SetupFailed as e:
        why = _which_fail(libc, base, _CLONE["CLONE_NEWUSER"]) or str(e)
        raise _SetupFailed("; ".join(x for x in (as_root, f"with a user namespace: {why}") if x)) from None
    try:
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    except OSError as e:
        raise _SetupFailed(f"writing the user namespace's {name} failed: {e}") from None
    return False


def _which_fail(libc: _Libc, names: list[str], extra: int) -> str:
    """Which namespaces cannot be created (each tried alone, with `extra`, in a child process)."""
    failed = []
    for name in ([] if not extra else ["CLONE_NEWUSER"]) + list(names):
        flags = _CLONE[name] | extra
        pid = os.fork()
        if pid == 0:
            rc = libc.lib.unshare(libc.ctypes.c_int(flags))
            os._exit(0 if rc == 0 else min(libc.ctypes.get_errno(), 255))
        _, st = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(st)
        if code:
            failed.append(f"unshare({name}) failed: {errno.errorcode.get(code, code)} ({os.strerror(code)})")
            if name == "CLONE_NEWUSER":
                break
    return "; ".join(failed)


def _init(libc: _Libc, cfg: dict, program: bytes, chan: int, alive_r: int, uid: int | None) -> None:
    """PID 1 of the sandbox: build its filesystem, start the program, reap, exit with its status.
    `uid`: the program's uid when running as real root, None in a user namespace."""
    os.setsid()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
    if select.select([alive_r], [], [], 0)[0]:
        os._exit(125)  # the launcher died before PDEATHSIG was set
    os.close(alive_r)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 gets only signals it handles; SIGINT must not be one
    os.umask(0o022)
    _build_root(libc, cfg, program, uid)
    child = os.fork()
    if child == 0:
        try:
            _exec_program(libc, cfg, chan, uid)
        except _SetupFailed as e:
            _say(chan, f"sandbox:error {e}")
        except BaseException as e:  # noqa: BLE001
            _say(chan, f"sandbox:error {type(e).__name__}: {e}")
        os._exit(125)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(125)
        if pid == child:
            break
    if os.WIFSIGNALED(status):
        _say(chan, f"sandbox:signal {os.WTERMSIG(status)}")
        os._exit(128 + os.WTERMSIG(status))
    code = os.waitstatus_to_exitcode(status)
    _say(chan, f"sandbox:exit {code}")
    os._exit(code & 0xFF)


def _build_root(libc: _Libc, cfg: dict, program: bytes, uid: int | None) -> None:
    """The sandbox's filesystem (module docstring, step 3); afterwards "/" is the new root."""
    plan, lim = cfg["plan"], cfg["limits"]
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates to the host
    # the bind sources, opened before anything is mounted over their paths (one may lie under /tmp)
    sources = []
    for kind in ("binds", "devices", "files"):
        for path in plan[kind]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError as e:
                raise _SetupFailed(f"opening {path} for the sandbox failed: {e}") from None
            sources.append((kind, path, fd))
    new = "/tmp"  # the mount point of the new root, in this (private) mount namespace
    libc.mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for kind, path, fd in sources:
        target = new + path
        os.makedirs(target if kind == "binds" else os.path.dirname(target), mode=0o755, exist_ok=True)
        if kind != "binds":
            open(target, "w").close()
        src = f"/proc/self/fd/{fd}"
        try:
            libc.mount(src, target, None, _MS_BIND)
        except _SetupFailed:
            libc.mount(src, target, None, _MS_BIND | _MS_REC)  # a tree with locked submounts (user namespace)
        os.close(fd)
        if kind != "devices":
            libc.mount(None, target, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _locked_flags(target))
    for path in plan["hide"]:
        libc.mount("tmpfs", new + path, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                   "size=4k,nr_inodes=16,mode=0755")
    for path, dest in plan["links"].items():
        os.makedirs(os.path.dirname(new + path), mode=0o755, exist_ok=True)
        os.symlink(dest, new + path)
    os.mkdir(new + "/tmp")
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    libc.mount("tmpfs", new + "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV,
               f"size={lim['tmp_bytes'] + len(program) + (1 << 20)},nr_inodes=4096,mode=0700{owner}")
    with open(os.path.join(new + "/tmp", cfg["program_name"]), "wb") as f:
        f.write(program)
    os.mkdir(new + "/proc")
    try:  # before the old root goes: in a user namespace the kernel wants a visible proc to allow a new one
        libc.mount("proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC | _MS_RDONLY)
    except _SetupFailed:
        pass  # no /proc in the sandbox (recorded by the probe)
    os.mkdir(new + "/.old")
    libc.pivot_root(new, new + "/.old")
    os.chdir("/")
    libc.umount2("/.old", _MNT_DETACH)
    os.rmdir("/.old")
    libc.mount(None, "/", None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _locked_flags(path: str) -> int:
    """The mount flags a read-only remount of a bind mount must keep (a user namespace may not clear
    the flags its source mount had)."""
    f = os.statvfs(path).f_flag
    out = _MS_NOSUID | _MS_NODEV
    if f & os.ST_NOEXEC:
        out |= _MS_NOEXEC
    if f & os.ST_NODIRATIME:
        out |= _MS_NODIRATIME
    if f & os.ST_NOATIME:
        out |= _MS_NOATIME
    elif f & os.ST_RELATIME:
        out |= _MS_RELATIME
    else:
        out |= _MS_STRICTATIME
    return out


def _set_limits(lim: dict, names: list[tuple]) -> None:
    """Soft = hard = the wanted value, or the inherited hard limit where that is lower (raising it
    would need a privilege an ordinary caller does not have)."""
    import resource

    for rname, key in [*names, ("RLIMIT_CORE", None)]:
        which = getattr(resource, rname)
        value = lim[key] if key else 0
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError) as e:
            raise _SetupFailed(f"setrlimit({rname}, {value}) failed: {e}") from None


def _exec_program(libc: _Libc, cfg: dict, chan: int, uid: int | None) -> None:
    """The program's process (module docstring, step 4)."""
    if chan != 3:
        os.dup2(chan, 3)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.closerange(4, 1 << 16)  # no descriptor of the host (bind sources, pipes) reaches the program
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; the program gets the defaults
        signal.signal(sig, signal.SIG_DFL)
    lim = cfg["limits"]
    if uid is None:  # in a user namespace the launcher and init share the program's uid and count too
        lim = dict(lim, processes=lim["processes"] + 2)
    _set_limits(lim, _RLIMITS)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")
    libc.drop_bounding_set()
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise _SetupFailed(f"setresuid({uid}) did not take")
    libc.clear_capabilities()
    os.chdir("/tmp")
    os.set_inheritable(3, True)
    _say(3, READY)
    python = cfg["python"]
    try:
        os.execve(python, [python, *cfg["args"]], {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp"})
    except OSError as e:
        os.write(2, f"sandbox: exec {python} failed: {e}\n".encode())
        os._exit(127)


def _exec_weak(cfg: dict, program: bytes, chan: int) -> None:
    """The weak mode: write the program into the caller's temporary folder, set the limits (no
    process count) and exec the interpreter, under `unshare -rn` where it works."""
    with open(os.path.join(cfg["cwd"], cfg["program_name"]), "wb") as f:
        f.write(program)
    if chan != 3:
        os.dup2(chan, 3)
        os.close(chan)
    os.set_inheritable(3, True)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.close(null)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    _set_limits(cfg["limits"], [r for r in _RLIMITS if r[0] != "RLIMIT_NPROC"])
    _say(3, READY)
    argv = [*cfg["weak_prefix"], cfg["python"], *cfg["args"]]
    try:
        os.execve(argv[0], argv, {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": cfg["cwd"]})
    except OSError as e:
        os.write(2, f"sandbox: exec {argv[0]} failed: {e}\n".encode())
        os._exit(127)


if __name__ == "__main__":
    sys.exit(launcher_main(sys.argv[1:]))

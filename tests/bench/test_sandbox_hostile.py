"""Hostile model replies through the real HumanEval path (`task_accuracy.check_reply`, which runs the
program in `specjax.eval.sandbox`), each checked from outside the sandbox: a file written to a host path
does not appear; host files cannot be listed or read; a Unix socket server and a TCP listener of the
test receive nothing; a process of the same user survives; no process the program started outlives
it (`setsid` + double fork included) or a benchmark killed with -9; a program that kills its parent
or every process it can (`kill(-1, SIGKILL)`) leaves the benchmark alive with a verdict; 300 MB of
stderr costs the benchmark no memory; a fork bomb stops at the process limit; leaving before the
tests end is not a pass; the same isolation in the user-namespace mode a non-root user gets. The
programs that could harm this machine without the sandbox (kill(-1), killing the parent) run in a
process standing in for the benchmark (tests/bench/_sandbox_checker.py).
Then the refusal: where the sandbox cannot be set up (a real failure: no PID namespace may be
created), the checker says what is missing and names --unsafe-exec, and `run_accuracy` refuses before
any request unless unsafe_exec is set."""
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _fake_server import FakeServer  # noqa: E402

from specjax.bench import accuracy  # noqa: E402
from specjax.bench.client import Endpoint  # noqa: E402
from specjax.eval import sandbox  # noqa: E402
from specjax.eval import task_accuracy as ta  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHECKER = Path(__file__).with_name("_sandbox_checker.py")
PROBLEM = ta.Problem("Hostile/0", 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n', "add",
                     "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
                     "    return a + b\n")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux namespaces")


@pytest.fixture(scope="module")
def sandbox_works():
    rep = sandbox.probe()
    if not rep["ok"]:  # never run hostile code without the sandbox
        pytest.skip(f"no sandbox on this machine: {rep['missing']}")


HOSTILE = pytest.mark.usefixtures("sandbox_works")


def _reply(hostile: str, solution: str = "def add(a, b):\n    return a + b\n") -> str:
    """A fenced reply: the hostile code at module level, then a correct solution."""
    return f"Here is the function.\n```python\n{textwrap.dedent(hostile).strip()}\n\n\n{solution}```\n"


def _check_in_subprocess(reply: str, timeout_s: float = 10.0) -> tuple[subprocess.CompletedProcess, dict]:
    """check_reply in a process standing in for the benchmark (tests/bench/_sandbox_checker.py)."""
    job = {"problem": _problem_fields(), "reply": reply, "timeout_s": timeout_s}
    r = subprocess.run([sys.executable, str(CHECKER)], input=json.dumps(job), capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=str(REPO))
    out = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {}
    return r, out


def _problem_fields() -> dict:
    return {k: getattr(PROBLEM, k) for k in ("task_id", "prompt", "entry_point", "test", "canonical_solution")}


def _processes_with(marker: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(d))
            except OSError:
                pass
    return found


# --- the filesystem ------------------------------------------------------------------------------


@HOSTILE
def test_writes_to_host_paths_do_not_land(tmp_path):
    name = f"specjax-escape-{uuid.uuid4().hex}"
    targets = [tmp_path / name, Path(tempfile.gettempdir()) / name, Path("/root") / name, Path("/") / name]
    hostile = f"""
        import os
        for path in {[str(t) for t in targets]!r}:
            try:
                with open(path, "w") as f:
                    f.write("escaped")
            except OSError:
                pass
        """
    try:
        v = ta.check_reply(PROBLEM, _reply(hostile))
        assert v.passed, v  # the tests still ran (a harmless write attempt and a right answer)
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            if t.exists():
                t.unlink()


@HOSTILE
def test_host_files_cannot_be_listed_or_read(tmp_path):
    secret = uuid.uuid4().hex
    canary = tmp_path / "host" / "canary.txt"
    canary.parent.mkdir()
    canary.write_text(secret)
    root_canary = Path("/root") / f"specjax-canary-{uuid.uuid4().hex}"
    made_root_canary = os.access("/root", os.W_OK)
    if made_root_canary:
        root_canary.write_text(secret)
    hostile = f"""
        import os
        seen = []
        for d in ("/root", {str(canary.parent)!r}, "/home", "/etc", "/work", "/run"):
            try:
                seen.append(d + ":" + ",".join(sorted(os.listdir(d))))
            except OSError as e:
                seen.append(d + ":" + type(e).__name__)
        for p in ({str(canary)!r}, {str(root_canary)!r}):
            try:
                seen.append("read:" + open(p).read())
            except OSError as e:
                seen.append("read:" + type(e).__name__)
        raise RuntimeError("SEEN " + " | ".join(seen))
        """
    try:
        v = ta.check_reply(PROBLEM, _reply(hostile))
    finally:
        if made_root_canary:
            root_canary.unlink()
    assert not v.passed and "SEEN " in v.result, v
    assert secret not in v.result and "canary.txt" not in v.result and root_canary.name not in v.result, v
    # /root shows at most the folders leading to the interpreter (read-only), never its other entries
    listed = v.result.split("SEEN ")[1].split(" | ")[0]
    assert listed.startswith("/root:"), listed
    for entry in filter(None, listed[len("/root:"):].split(",")):
        assert entry in ("FileNotFoundError", "PermissionError") or \
            any(b.startswith(f"/root/{entry}") for b in sandbox.mount_plan()["binds"]), listed


@HOSTILE
def test_unix_socket_in_a_host_folder_gets_nothing():
    folder = tempfile.mkdtemp(prefix="sx")  # short: a socket path has at most 107 bytes
    path = os.path.join(folder, "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(4)
    srv.settimeout(0.2)
    received, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    received.append(conn.recv(100))
                except OSError:
                    received.append(b"<connected>")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    hostile = f"""
        import _socket  # past the driver's patched socket module
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        s.settimeout(3)
        try:
            s.connect({path!r})
            s.send(b"PWNED")
            outcome = "connected"
        except OSError as e:
            outcome = type(e).__name__
        raise RuntimeError("UNIX " + outcome)
        """
    try:
        v = ta.check_reply(PROBLEM, _reply(hostile))
        time.sleep(0.3)  # a connection that got through would be accepted by now
    finally:
        stop.set()
        t.join(5)
        srv.close()
        shutil.rmtree(folder)
    assert received == [], received
    assert v.result.startswith("failed: RuntimeError: UNIX ") and "connected" not in v.result, v


@HOSTILE
def test_tcp_to_a_local_listener_fails():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
                accepted.append(conn)
            except OSError:
                continue

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    hostile = f"""
        import _socket
        s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        s.settimeout(3)
        try:
            s.connect(("127.0.0.1", {port}))
            outcome = "connected"
        except OSError as e:
            outcome = type(e).__name__
        raise RuntimeError("TCP " + outcome)
        """
    try:
        v = ta.check_reply(PROBLEM, _reply(hostile))
        time.sleep(0.3)
    finally:
        stop.set()
        t.join(5)
        srv.close()
        for c in accepted:
            c.close()
    assert accepted == []
    assert v.result.startswith("failed: RuntimeError: TCP ") and "connected" not in v.result, v


# --- processes -----------------------------------------------------------------------------------


@HOSTILE
def test_a_process_of_the_same_user_survives():
    sleeper = subprocess.Popen(["sleep", "60"])
    hostile = f"""
        import os, signal
        for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):
            try:
                os.kill({sleeper.pid}, sig)
            except OSError:
                pass
        """
    try:
        v = ta.check_reply(PROBLEM, _reply(hostile))
        time.sleep(0.2)
        assert sleeper.poll() is None, "the program killed a process outside its sandbox"
        with open(f"/proc/{sleeper.pid}/stat") as f:
            assert f.read().split(") ")[1][0] != "T", "the program stopped a process outside its sandbox"
        assert v.passed, v
    finally:
        sleeper.kill()
        sleeper.wait()


@HOSTILE
def test_no_process_of_the_program_outlives_it():
    marker = f"specjax-grandchild-{uuid.uuid4().hex}"
    # a setsid'd double-forked grandchild with its descriptors closed (a daemon), named by the marker
    hostile = f"""
        import os, sys, time
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.closerange(3, 1024)
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
            os._exit(0)
        os.waitpid(pid, 0)
        running = False
        for _ in range(100):  # the grandchild has exec'd (as the program sees its processes)
            for d in os.listdir("/proc"):
                try:
                    running = running or {marker!r}.encode() in open(f"/proc/{{d}}/cmdline", "rb").read()
                except OSError:
                    pass
            if running:
                break
            time.sleep(0.05)
        raise RuntimeError(f"grandchild running: {{running}}")
        """
    try:
        v = ta.check_reply(PROBLEM, _reply(hostile))
        assert v.result == "failed: RuntimeError: grandchild running: True", v  # it did start
        deadline = time.monotonic() + 3
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_with(marker) == []
    finally:
        for pid in _processes_with(marker):
            os.kill(pid, 9)


@HOSTILE
def test_a_killed_benchmark_takes_the_program_with_it():
    # kill -9 of the benchmark while a program runs: nothing of the program survives it
    marker = f"specjax-orphan-{uuid.uuid4().hex}"
    hostile = f"""
        import os, sys
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {marker!r}])
        """
    job = {"problem": _problem_fields(), "reply": _reply(hostile), "timeout_s": 30.0}
    bench = subprocess.Popen([sys.executable, str(CHECKER)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=str(REPO))
    try:
        bench.stdin.write(json.dumps(job))
        bench.stdin.close()
        deadline = time.monotonic() + 20
        while not _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_with(marker), "the program never started"
        bench.kill()
        bench.wait()
        deadline = time.monotonic() + 5
        while _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_with(marker) == []
    finally:
        bench.kill()
        for pid in _processes_with(marker):
            os.kill(pid, 9)


@HOSTILE
def test_killing_its_parent_leaves_the_benchmark_alive():
    r, out = _check_in_subprocess(_reply("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)"))
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert out["verdict"]["task_id"] == "Hostile/0" and out["verdict"]["result"], out


@HOSTILE
def test_kill_minus_one_leaves_the_benchmark_and_other_processes_alive():
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        r, out = _check_in_subprocess(_reply("import os, signal\nos.kill(-1, signal.SIGKILL)"))
        assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
        assert out["verdict"]["result"], out
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


@HOSTILE
def test_a_fork_bomb_stops_at_the_process_limit():
    hostile = """
        import os, time
        n = 0
        for _ in range(40):
            try:
                pid = os.fork()
            except OSError:
                break
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            n += 1
        raise RuntimeError(f"forked {n}")
        """
    t0 = time.monotonic()
    v = ta.check_reply(PROBLEM, _reply(hostile), timeout_s=5.0)
    took = time.monotonic() - t0
    assert v.result.startswith("failed: RuntimeError: forked "), v
    assert int(v.result.rsplit(" ", 1)[1]) < ta.PROCESS_LIMIT, v
    assert took < 5.0, took  # the sleeping children died with the program, no wait for them


@HOSTILE
def test_the_user_namespace_mode_isolates_too(tmp_path):
    # what a non-root user gets (a user namespace mapping only its uid), probed and attacked as root here
    rep = sandbox.probe("userns")
    assert rep["ok"] and rep["mode"] == "user namespace", rep
    sleeper = subprocess.Popen(["sleep", "60"])
    target = tmp_path / "escaped.txt"
    program = f"""
import os, signal
for path in ({str(target)!r}, "/escaped.txt"):
    try:
        open(path, "w").write("x")
    except OSError:
        pass
for pid in ({sleeper.pid}, -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
print(json.dumps(sorted(os.listdir("/"))), file=__import__("sys").stderr)
""".replace("print(json", "import json\nprint(json").encode()
    try:
        out = sandbox.run_python(["-I", "-S", "program.py"], program, timeout_s=10.0, ns_mode="userns")
        time.sleep(0.2)
        assert out.ready and out.returncode == 0 and not out.timed_out, out
        assert not target.exists() and not Path("/escaped.txt").exists()
        assert sleeper.poll() is None
        assert set(json.loads(out.last_stderr_line())) <= {"dev", "proc", "tmp"} | set(
            p.strip("/").split("/")[0] for p in [*sandbox.mount_plan()["binds"], *sandbox.mount_plan()["links"],
                                                 *sandbox.mount_plan()["files"]]), out
    finally:
        sleeper.kill()
        sleeper.wait()
        for p in (target, Path("/escaped.txt")):
            if p.exists():
                p.unlink()


# --- output, verdicts ----------------------------------------------------------------------------


@HOSTILE
def test_300_mb_of_stderr_costs_the_benchmark_no_memory():
    hostile = """
        import sys
        line = b"x" * ((1 << 20) - 1) + b"\\n"
        for _ in range(300):
            sys.stderr.buffer.write(line)
        sys.stderr.flush()
        raise ValueError("the last line after 300 MB")
        """
    r, out = _check_in_subprocess(_reply(hostile), timeout_s=30.0)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert out["verdict"]["result"] == "failed: ValueError: the last line after 300 MB", out
    grew_mib = (out["maxrss_after_kib"] - out["maxrss_before_kib"]) / 1024
    assert grew_mib < 32, f"the checker's peak memory grew by {grew_mib:.0f} MiB"


@HOSTILE
@pytest.mark.parametrize("hostile,solution", [
    pytest.param("import os\nos._exit(0)", None, id="os._exit-before-the-tests"),
    pytest.param("import sys\nsys.exit(0)", None, id="sys.exit-before-the-tests"),
    pytest.param("", "def add(a, b):\n    raise SystemExit(0)\n", id="SystemExit-inside-the-tests"),
    # forging the sandbox's own status lines on fd 3 changes nothing
    pytest.param("import os\ntry:\n    os.write(3, b'sandbox:ready\\nsandbox:exit 0\\n')\nexcept OSError:\n    pass\n"
                 "os._exit(0)", None, id="forged-status-lines"),
])
def test_leaving_before_the_tests_end_is_not_a_pass(hostile, solution):
    reply = _reply(hostile) if solution is None else _reply(hostile, solution)
    v = ta.check_reply(PROBLEM, reply)
    assert not v.passed and v.result == "failed: exited before the tests finished (exit status 0)", v


@HOSTILE
def test_a_reply_that_cannot_be_encoded_is_a_failed_verdict():
    v = ta.check_reply(PROBLEM, _reply("x = '\ud800'"))  # a lone surrogate (valid JSON escape, no UTF-8)
    assert not v.passed and v.result.startswith("failed: "), v


@HOSTILE
def test_forged_sandbox_errors_do_not_stop_the_benchmark():
    hostile = """
        import os, sys
        os.write(3, b"sandbox:error fake setup failure\\n")
        sys.stderr.write("sandbox:error fake\\n")
        os._exit(125)
        """
    v = ta.check_reply(PROBLEM, _reply(hostile))
    assert not v.passed and v.result == "failed: sandbox:error fake", v


# --- no sandbox: refuse, or run only when asked --------------------------------------------------

_NO_PID_NAMESPACES = r'''
import json
from specjax.eval import task_accuracy as ta
P = ta.Problem(**json.loads(input()))
out = {}
try:
    ta.require_isolation()
except ta.SandboxUnavailable as e:
    out["refused"] = str(e)
try:
    ta.check_reply(P, P.prompt + P.canonical_solution)
except ta.SandboxUnavailable as e:
    out["check_refused"] = True
v = ta.check_reply(P, P.canonical_solution, unsafe_exec=True)
out["unsafe_verdict"] = v.to_dict()
iso = ta.isolation(unsafe_exec=True)
out["exec"] = {"sandbox": iso["sandbox"], "unsafe_exec": iso["unsafe_exec"]}
print(json.dumps(out))
'''


def test_a_machine_without_pid_namespaces_is_refused_and_named():
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-Ur", "true"], capture_output=True).returncode:
        pytest.skip("unshare -Ur (a user namespace to limit) is unavailable")
    # inside a user namespace whose limit on PID namespaces is 0, the sandbox cannot be set up for real
    job = json.dumps(_problem_fields())
    r = subprocess.run(["unshare", "-Ur", "sh", "-c", 'echo 0 > /proc/sys/user/max_pid_namespaces && exec "$@"', "sh",
                        sys.executable, "-c", _NO_PID_NAMESPACES], input=job + "\n", capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=str(REPO))
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "unshare(CLONE_NEWPID) failed: ENOSPC" in out["refused"], out
    assert "--unsafe-exec" in out["refused"], out
    assert out.get("check_refused") is True, out
    assert out["unsafe_verdict"]["passed"] is True, out  # asked for: it runs, weaker
    assert out["exec"] == {"sandbox": None, "unsafe_exec": True}, out


def test_run_accuracy_refuses_before_any_request_unless_unsafe_exec(monkeypatch):
    missing = "as root: unshare(CLONE_NEWPID) failed: EPERM (Operation not permitted)"
    monkeypatch.setattr(sandbox, "probe", lambda ns_mode="auto": {"ok": False, "missing": [missing], "mode": None,
                                                                   "proc": None, "seen": None})
    logs = []
    with FakeServer(ttft_s=0.0, gap_s=0.0, reply=lambda text, body: _reply("")) as srv:
        kwargs = dict(temperatures=[0.0], runs=1, concurrency=1, max_tokens=64, margin=0.1, alpha=0.05,
                      timeout_s=5.0, workers=1, task="humaneval", log=logs.append)
        with pytest.raises(ta.SandboxUnavailable) as exc:
            accuracy.run_accuracy({"spec": Endpoint(srv.url)}, {"spec": srv.model}, [PROBLEM], **kwargs)
        assert missing in str(exc.value) and "--unsafe-exec" in str(exc.value)
        assert srv.bodies == []  # refused before any request
        acc = accuracy.run_accuracy({"spec": Endpoint(srv.url)}, {"spec": srv.model}, [PROBLEM], unsafe_exec=True,
                                    **kwargs)
        assert len(srv.bodies) == 1
    assert acc["exec"]["unsafe_exec"] is True and acc["exec"]["sandbox"] is None
    assert acc["exec"]["sandbox_unavailable"] == missing
    assert any(m.startswith("warning: --unsafe-exec") for m in logs), logs
    row = acc["temperatures"][0]["runs"]["spec"][0]["problems"][0]
    assert row["passed"] is True, row

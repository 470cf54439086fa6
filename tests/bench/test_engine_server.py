"""specjax.bench.server.EngineServer with stand-in engines (small Python scripts that take vLLM's
--host/--port): ready once /health answers, the whole process group stopped, and a server that dies or
never answers reported with its log's error lines and the setting that sets the timeout."""
import os
import sys
import time

import pytest

from specjax.bench.server import EngineServer, EngineStartError

SERVE = r"""
import argparse, http.server, os, subprocess, sys, time
ap = argparse.ArgumentParser(); ap.add_argument("--host"); ap.add_argument("--port", type=int)
ap.add_argument("--mode"); a = ap.parse_args()
if a.mode == "die":
    print("ValueError: the draft's config.json is not an EAGLE-3 head", flush=True); sys.exit(3)
# a child in the same process group, as vLLM's engine core is
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)
if a.mode == "mute":
    time.sleep(600)
time.sleep(0.5)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *args): pass
http.server.HTTPServer((a.host, a.port), H).serve_forever()
"""


def _argv(tmp_path, mode):
    script = tmp_path / "engine.py"
    script.write_text(SERVE)
    return [sys.executable, str(script), "--mode", mode]


def _child_pid(log_path):
    for _ in range(100):
        for line in open(log_path).read().splitlines():
            if line.startswith("child "):
                return int(line.split()[1])
        time.sleep(0.1)
    raise AssertionError("the stand-in engine printed no child pid")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its reaper is gone too
        return f.read().split(")")[-1].split()[0] != "Z"


def test_ready_then_the_whole_group_stops(tmp_path):
    log = tmp_path / "server.log"
    with EngineServer(_argv(tmp_path, "ok"), str(log)) as srv:
        assert srv.wait_ready(30) is srv
        assert srv.url == f"http://127.0.0.1:{srv.port}"
        child = _child_pid(log)
        assert _alive(child)
    assert srv.proc.poll() is not None
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), "stop() left the engine's child process running"


def test_a_server_that_exits_is_reported_with_its_error_lines(tmp_path):
    srv = EngineServer(_argv(tmp_path, "die"), str(tmp_path / "server.log"))
    with pytest.raises(EngineStartError, match=r"exited with code 3(.|\n)*not an EAGLE-3 head"):
        srv.wait_ready(30)


def test_a_server_that_never_answers_times_out_naming_the_setting(tmp_path):
    srv = EngineServer(_argv(tmp_path, "mute"), str(tmp_path / "server.log"))
    child = _child_pid(srv.log_path)
    with pytest.raises(EngineStartError, match=r"not ready after 2 s \(decode_eval.vllm_start_timeout_s\)"):
        srv.wait_ready(2, "decode_eval.vllm_start_timeout_s")
    assert srv.proc.poll() is not None
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child)


def test_the_argvs_own_host_and_port_are_replaced(tmp_path):
    argv = [*_argv(tmp_path, "ok"), "--host", "0.0.0.0", "--port=8000"]
    with EngineServer(argv, str(tmp_path / "server.log")) as srv:
        assert srv.argv.count("--host") == 1 and srv.argv.count("--port") == 1
        assert not any(a.startswith("--port=") for a in srv.argv)
        assert srv.argv[-4:] == ["--host", "127.0.0.1", "--port", str(srv.port)]
        srv.wait_ready(30)


def test_a_port_taken_before_the_bind_is_replaced_by_a_new_one(tmp_path, monkeypatch):
    import socket

    from specjax.bench import server as server_mod

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    busy = taken.getsockname()[1]
    ports = iter([busy])
    real = server_mod.free_port
    monkeypatch.setattr(server_mod, "free_port", lambda: next(ports, None) or real())
    try:
        with EngineServer(_argv(tmp_path, "ok"), str(tmp_path / "server.log")) as srv:
            assert srv.port == busy
            srv.wait_ready(30)
            assert srv.tries == 2 and srv.port != busy
    finally:
        taken.close()


def test_a_port_the_caller_chose_is_not_replaced(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        srv = EngineServer(_argv(tmp_path, "ok"), str(tmp_path / "server.log"), port=taken.getsockname()[1])
        with pytest.raises(EngineStartError, match="Address already in use"):
            srv.wait_ready(30)
        assert srv.tries == 1
    finally:
        taken.close()

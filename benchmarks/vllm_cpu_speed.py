"""vLLM's output tok/s with and without an EAGLE-3 head, on this machine's CPU, through specjax.bench.

Starts two vLLM CPU OpenAI servers one after the other (the target with the head, from
`specjax.serve_cmd.vllm_argv`; the target alone), then runs `python -m specjax.bench` against both
(acceptance from vLLM's counters, tok/s, the speedup per concurrency level) and stops both by their
process groups. A report, not a goal: a 2-core CPU is not where speculation is meant to pay.

    python benchmarks/vllm_cpu_speed.py --vllm-python PY \\
        --target runs/smollm2_assets/SmolLM2-135M-Instruct --draft HEAD --prompts humaneval --limit 20 \\
        [--num-spec-tokens 5] [--max-tokens 256] [--concurrency 1] --out OUT
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--num-spec-tokens", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from specjax.bench.server import EngineServer
    from specjax.serve_cmd import vllm_argv, vllm_launcher

    os.makedirs(a.out, exist_ok=True)
    launcher = vllm_launcher(a.vllm_python)
    common = ["--dtype", "float32", "--max-model-len", str(a.max_model_len), "--max-num-seqs", "4"]
    spec_argv = vllm_argv(os.path.abspath(a.draft), os.path.abspath(a.target), a.num_spec_tokens, launcher) + common
    base_argv = [*launcher.prefix, os.path.abspath(a.target), *common]
    # the CPU settings the engine tier uses (tests/engine/_engine_harness.vllm_env): one OpenMP thread,
    # no pinning, 1 GiB of KV cache, nothing fetched from a hub
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    servers = []
    try:
        for name, args in (("spec", spec_argv), ("base", base_argv)):
            t0 = time.monotonic()
            servers.append(EngineServer(args, os.path.join(a.out, f"vllm_{name}.log"), env=env))
            servers[-1].wait_ready(a.startup_timeout_s, "--startup-timeout-s")
            print(f"[vllm_cpu_speed] {name} server ready in {time.monotonic() - t0:.0f} s: {servers[-1].url}",
                  flush=True)
        cmd = [sys.executable, "-m", "specjax.bench", "--url", servers[0].url, "--baseline-url", servers[1].url,
               "--prompts", a.prompts, "--limit", str(a.limit), "--concurrency", a.concurrency,
               "--max-tokens", str(a.max_tokens), "--temperature", "0", "--no-progress", "--no-plots",
               "--out", os.path.join(a.out, "bench")]
        print("[vllm_cpu_speed] " + " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu")).returncode
    finally:
        for srv in servers:
            srv.stop()


if __name__ == "__main__":
    sys.exit(main())

"""A publishable evaluation of one head the way the Nemotron 3.5 card measures its own: two local
vLLM servers (the target with the head, the target alone) started side by side, then
`python -m specjax.bench` with repeated windows (`--repeats`) and task accuracy with the equivalence
test: HumanEval pass@1 by execution (`--accuracy-task humaneval`, the default) or the seeded
arithmetic task (`--accuracy-task arithmetic`, for a small target that scores 0 on HumanEval). The
report (results.md, results.json, PNGs) lands in --out, with the exact server commands in it.

    python benchmarks/evidence.py --target DIR --head DIR --vllm-python PY --out DIR \
        [--repeats 5] [--concurrency 1,2] [--limit 4] [--accuracy-task humaneval|arithmetic] \
        [--accuracy-limit N] [--accuracy-temperatures 0,1] [--accuracy-runs 3]

The speculative server gets the speculative config `specjax.serve_cmd` gives the head. Both servers
run fp32 (vLLM's CPU backend here; on a GPU pass --dtype bfloat16). Bench settings not exposed here
can be passed after `--`, they go to specjax.bench unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _vllm_env() -> dict:
    # the engine's own threads: one unbound OpenMP thread per server on a small CPU machine (the
    # engine tier's setting, tests/engine/_engine_harness.py); nothing of specjax's JAX settings
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "PYTHONPATH"))}
    env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_CPU_KVCACHE_SPACE="2",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-spec-tokens", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--concurrency", default="1,2")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--accuracy-task", choices=("humaneval", "arithmetic"), default="humaneval",
                    help="specjax.bench --accuracy (default humaneval)")
    ap.add_argument("--accuracy-limit", type=int, default=None,
                    help="the first N problems (default: humaneval 20, arithmetic all 2820)")
    ap.add_argument("--accuracy-temperatures", default="0,1")
    ap.add_argument("--accuracy-runs", type=int, default=3)
    ap.add_argument("--accuracy-max-tokens", type=int, default=None,
                    help="default: humaneval 256, arithmetic specjax.bench's task default (32)")
    ap.add_argument("--labels", default="EAGLE-3 head,no speculation")
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    ap.add_argument("bench_args", nargs="*", help="more specjax.bench arguments (after --)")
    a = ap.parse_args(argv)

    from specjax.bench.server import EngineServer
    from specjax.serve_cmd import vllm_speculative_config

    os.makedirs(a.out, exist_ok=True)
    limit, max_tok = a.accuracy_limit, a.accuracy_max_tokens
    if a.accuracy_task == "humaneval":  # this script's earlier defaults
        limit, max_tok = limit if limit is not None else 20, max_tok if max_tok is not None else 256
    limit_opt = ["--accuracy-limit", str(limit)] if limit is not None else []
    max_tok_opt = ["--accuracy-max-tokens", str(max_tok)] if max_tok is not None else []
    spec = vllm_speculative_config(os.path.abspath(a.head), a.num_spec_tokens)
    base_argv = [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", os.path.abspath(a.target),
                 "--dtype", a.dtype, "--max-model-len", str(a.max_model_len), "--max-num-seqs", str(a.max_num_seqs)]
    servers = []
    try:
        t0 = time.monotonic()
        for name, argv_ in (("spec", base_argv + ["--speculative-config", json.dumps(spec)]), ("base", base_argv)):
            servers.append(EngineServer(argv_, os.path.join(a.out, f"vllm_{name}.log"), env=_vllm_env()))
        for srv in servers:
            srv.wait_ready(max(a.startup_timeout_s - (time.monotonic() - t0), 1), "--startup-timeout-s")
        print(f"[evidence] both servers ready after {time.monotonic() - t0:.0f} s", flush=True)
        cmd = [sys.executable, "-m", "specjax.bench", "--url", servers[0].url, "--baseline-url", servers[1].url,
               "--prompts", a.prompts, "--limit", str(a.limit), "--concurrency", a.concurrency,
               "--max-tokens", str(a.max_tokens), "--repeats", str(a.repeats), "--labels", a.labels,
               "--server-flags", shlex.join(servers[0].argv), "--baseline-server-flags", shlex.join(servers[1].argv),
               "--accuracy", a.accuracy_task, *limit_opt,
               "--accuracy-temperatures", a.accuracy_temperatures, "--accuracy-runs", str(a.accuracy_runs),
               *max_tok_opt, "--no-progress", "--out", a.out, *a.bench_args]
        print("[evidence] " + shlex.join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu")).returncode
    finally:
        for srv in servers:
            srv.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())

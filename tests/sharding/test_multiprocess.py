"""Two processes on 127.0.0.1 (4 fake CPU devices each) train in lockstep and reach the same losses
as one process with 8 devices (same global batches: every process runs the same data iterator)."""
import os
import socket
import subprocess
import sys

import numpy as np

from specjax.train.metrics import read_metrics

CFG = """\
run: {{output_dir: {out}, seed: 0}}
target: {{path: {target}, dtype: float32}}
draft: {{ttt_steps: 2, draft_vocab_size: 96}}
data: {{train_files: [pkg://specjax/assets/demo_chat.jsonl], max_rows: 160, seq_length: 64, batch_size: 8, val_fraction: 0.0}}
optim: {{lr: 3.0e-3, warmup_ratio: 0.1}}
train: {{steps: 6, log_every: 1, eval_batches: 0, progress: false}}
checkpoint: {{every_steps: 3}}
export: {{at_end: true, dtype: float32}}
parallelism: {{data: 2, fsdp: 4}}
"""


def _env(devices, extra=None):
    e = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))  # and conftest's XLA_FLAGS
    e.update(extra or {})
    return e


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one(tiny_target, tmp_path, repo_root):
    cmd = [sys.executable, "-m", "specjax.launch", "--config"]
    one = tmp_path / "one.yaml"
    one.write_text(CFG.format(out=tmp_path / "one", target=tiny_target))
    r = subprocess.run(cmd + [str(one)], cwd=repo_root, env=_env(8), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr

    two = tmp_path / "two.yaml"
    two.write_text(CFG.format(out=tmp_path / "two", target=tiny_target))
    port = _free_port()
    procs = [subprocess.Popen(cmd + [str(two)], cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(4, {"SPECJAX_COORDINATOR": f"127.0.0.1:{port}", "SPECJAX_NUM_PROCESSES": "2",
                                           "SPECJAX_PROCESS_ID": str(i)})) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    a, b = read_metrics(str(tmp_path / "one")), read_metrics(str(tmp_path / "two"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        np.testing.assert_allclose(y["loss"], x["loss"], rtol=1e-5)
        np.testing.assert_allclose(y["grad_norm"], x["grad_norm"], rtol=1e-5)
    # both processes reached the final, collectively written checkpoint
    assert max(int(d) for d in os.listdir(tmp_path / "two" / "checkpoints") if d.isdigit()) == 6
    assert (tmp_path / "two" / "export" / "model.safetensors").exists()

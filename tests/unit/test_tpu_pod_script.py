"""launch/tpu_pod.sh --dry-run prints the exact commands it would run (one shell-quoted line each, `local:`)
and the command every worker runs, and runs none of them. Checked against the script run for real with a
fake `gcloud` first on PATH that records its arguments: the printed commands are the ones it runs."""
import os
import shlex
import subprocess

import pytest

WORKER_PREFIX = "each worker (--worker=all): "
TRAIN = ["train", "my-pod", "us-east5-a", "configs/llama3_8b_eagle3.yaml", "parallelism.fsdp=8",
         "run.name=two words", "data.batch_size=64"]


@pytest.fixture
def fake_gcloud(tmp_path):
    bindir, log = tmp_path / "bin", tmp_path / "gcloud.log"
    bindir.mkdir()
    (bindir / "gcloud").write_text('#!/usr/bin/env bash\nfor a in "$@"; do printf \'%s\\n\' "$a"; done >> "$GCLOUD_LOG"\n'
                                   'echo "@@end" >> "$GCLOUD_LOG"\n')
    (bindir / "gcloud").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", GCLOUD_LOG=str(log))

    def run(*args):
        r = subprocess.run(["bash", "launch/tpu_pod.sh", *args], capture_output=True, text=True, env=env,
                           cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        calls = log.read_text().split("@@end\n")[:-1] if log.exists() else []
        if log.exists():
            log.unlink()
        return r, [c.splitlines() for c in calls]
    return run


@pytest.mark.parametrize("args", [TRAIN, ["create", "my-pod", "us-east5-a", "v5p-64"], ["delete", "my-pod", "z"]],
                         ids=["train", "create", "delete"])
def test_dry_run_prints_what_the_real_run_runs(fake_gcloud, args):
    dry, calls = fake_gcloud("--dry-run", *args)
    assert dry.returncode == 0, dry.stderr
    assert calls == []  # nothing ran
    printed = [shlex.split(line[len("local: "):]) for line in dry.stdout.splitlines() if line.startswith("local: ")]
    real, calls = fake_gcloud(*args)
    assert real.returncode == 0, real.stderr
    assert [["gcloud", *c] for c in calls] == printed


def test_dry_run_shows_each_workers_command(fake_gcloud):
    dry, _ = fake_gcloud("--dry-run", *TRAIN)
    lines = dry.stdout.splitlines()
    assert len(lines) == 2 and lines[1].startswith(WORKER_PREFIX)
    worker = lines[1][len(WORKER_PREFIX):]
    gcloud = shlex.split(lines[0][len("local: "):])
    assert gcloud[:7] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod", "--zone"]
    assert "--worker=all" in gcloud and gcloud[gcloud.index("--command") + 1] == worker
    # what each worker's shell runs: the overrides arrive as separate, intact arguments
    assert shlex.split(worker) == ["cd", "~/specjax", "&&", "SPECJAX_DISTRIBUTED=auto", ".venv/bin/python", "-m",
                                   "specjax.launch", "--config", "configs/llama3_8b_eagle3.yaml",
                                   "parallelism.fsdp=8", "run.name=two words", "data.batch_size=64"]


def test_dry_run_setup_copies_nothing(fake_gcloud, tmp_path):
    dry, calls = fake_gcloud("--dry-run", "setup", "my-pod", "us-east5-a")
    assert dry.returncode == 0 and calls == []
    lines = dry.stdout.splitlines()
    tar, scp, rm, ssh, worker = lines
    tarball = shlex.split(tar)[-2]
    assert shlex.split(tar)[1:3] == ["tar", "-C"] and not os.path.exists(tarball)  # not even created
    assert shlex.split(scp)[1:6] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and tarball in scp
    assert shlex.split(rm)[1:] == ["rm", "-f", tarball]
    assert "--worker=all" in ssh and worker.startswith(WORKER_PREFIX + "mkdir -p ~/specjax")

import os
import shutil
import subprocess

import pytest

SCRIPTS = ["launch/tpu_pod.sh", "launch/slurm_h200.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bash_syntax(repo_root, script):
    r = subprocess.run(["bash", "-n", os.path.join(repo_root, script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck_clean(repo_root, script):
    r = subprocess.run(["shellcheck", os.path.join(repo_root, script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_tpu_script_usage_without_args(repo_root):
    r = subprocess.run(["bash", os.path.join(repo_root, "launch/tpu_pod.sh")], capture_output=True, text=True)
    assert r.returncode == 2 and "create" in r.stdout

"""benchmarks/target_outputs.py: the same code gives bit-identical arrays, and a changed array is found."""
import os
import subprocess
import sys

import numpy as np


def test_same_code_is_identical_and_a_change_is_found(repo_root, tmp_path):
    script = os.path.join(repo_root, "benchmarks", "target_outputs.py")
    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    for out in (a, b):
        r = subprocess.run([sys.executable, script, "--out", str(out), "--only", "llama"], capture_output=True,
                           text=True, cwd=repo_root)
        assert r.returncode == 0, r.stderr
    same = subprocess.run([sys.executable, script, "--compare", str(a), str(b)], capture_output=True, text=True)
    assert same.returncode == 0 and "llama" in same.stdout and "DIFF" not in same.stdout, same.stdout
    arrays = dict(np.load(a))
    key = sorted(arrays)[0]
    arrays[key] = np.nextafter(arrays[key], np.inf)  # one ulp
    np.savez(b, **arrays)
    diff = subprocess.run([sys.executable, script, "--compare", str(a), str(b)], capture_output=True, text=True)
    assert diff.returncode == 1 and key in diff.stdout, diff.stdout

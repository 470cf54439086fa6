"""`kernels/` and `converters/` must never shadow PyPI packages of the same names.

They are plain folders (no __init__.py) holding `specjax_kernels` / `specjax_converters`. Even with
the repo root first on sys.path (as `python -m specjax.launch` run from the repo does), a real
package named `kernels` or `converters` installed anywhere later on the path must win."""
import os
import subprocess
import sys


def test_repo_folders_are_not_packages(repo_root):
    for name in ("kernels", "converters"):
        assert not os.path.exists(os.path.join(repo_root, name, "__init__.py"))


def test_real_packages_win_over_repo_folders(repo_root, tmp_path):
    site = tmp_path / "site"
    for name in ("kernels", "converters"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"ORIGIN = 'pypi-{name}'\n")
    code = (
        "import sys; sys.path.insert(0, %r); sys.path.append(%r)\n"
        "import kernels, converters, specjax_kernels, specjax_converters\n"
        "print(kernels.ORIGIN, converters.ORIGIN)\n" % (repo_root, str(site))
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pypi-kernels", "pypi-converters"]


def test_repo_code_never_imports_bare_names(repo_root):
    import re

    pat = re.compile(r"^\s*(from|import)\s+(kernels|converters)\b", re.M)
    for base in ("specjax", "kernels", "converters", "tests"):
        for dirpath, _, files in os.walk(os.path.join(repo_root, base)):
            for f in files:
                if f.endswith(".py"):
                    text = open(os.path.join(dirpath, f), encoding="utf-8").read()
                    assert not pat.search(text), f"{dirpath}/{f} imports a bare kernels/converters name"

"""`kernels/` and `converters/` must never shadow PyPI packages of the same names.

They are plain folders (no __init__.py) holding `specjax_kernels` / `specjax_converters`. Even with
the repo root first on sys.path (as `python -m specjax.launch` run from the repo does), a real
package named `kernels` or `converters` installed anywhere later on the path must win.

The same holds for the modules of the script and test folders, which do go first on sys.path (a
script's own folder is sys.path[0]; pytest inserts each test folder): `benchmarks/kernels.py` once
shadowed PyPI's `kernels`, which transformers 5.25 depends on and imports, so `import transformers`
failed in every benchmark script and in the tests that import one."""
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
        # the package goes right after the repo root: later than the folders, earlier than the
        # site-packages that may hold the real `kernels` (transformers >= 5.25 depends on it)
        "import sys; sys.path.insert(0, %r); sys.path.insert(1, %r)\n"
        "import kernels, converters, specjax_kernels, specjax_converters\n"
        "print(kernels.ORIGIN, converters.ORIGIN)\n" % (repo_root, str(site))
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["pypi-kernels", "pypi-converters"]


def test_script_and_test_modules_shadow_no_installed_module(repo_root, tmp_path):
    names = {}
    for base in ("benchmarks", "tests"):
        for dirpath, dirs, files in os.walk(os.path.join(repo_root, base)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    names.setdefault(f[:-3], os.path.relpath(os.path.join(dirpath, f), repo_root))
            for d in dirs:
                if os.path.exists(os.path.join(dirpath, d, "__init__.py")):
                    names.setdefault(d, os.path.relpath(os.path.join(dirpath, d), repo_root))
    assert "methods" in names and "conftest" in names  # the walk saw the folders
    # a fresh interpreter outside the repo: what would these names import if the folders were absent?
    code = ("import importlib.util, sys\n"
            "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is not None))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code, *sorted(names)], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    clashes = {n: names[n] for n in out.stdout.split()}
    assert not clashes, f"these repo modules shadow installed ones of the same name; rename them: {clashes}"


def test_repo_code_never_imports_bare_names(repo_root):
    import re

    pat = re.compile(r"^\s*(from|import)\s+(kernels|converters)\b", re.M)
    for base in ("specjax", "kernels", "converters", "tests"):
        for dirpath, _, files in os.walk(os.path.join(repo_root, base)):
            for f in files:
                if f.endswith(".py"):
                    text = open(os.path.join(dirpath, f), encoding="utf-8").read()
                    assert not pat.search(text), f"{dirpath}/{f} imports a bare kernels/converters name"

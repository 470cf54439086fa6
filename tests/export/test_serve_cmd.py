"""`python -m specjax.serve_cmd`: the exact vLLM / SGLang commands for an exported draft, the caveats
the validator knows, and no command for a head that fails validation."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from export._heads import L, make_draft, target_config
from specjax.serve_cmd import main
from specjax_converters.eagle3_export import export_eagle3


def _export(tmp_path, name="draft", target_hf=None, **kw):
    target_hf, cfg, params, vocab = make_draft(seed=1, target_hf=target_hf, **kw)
    out = export_eagle3(params, cfg, vocab, target_hf, tmp_path / name, dtype="fp32")
    tdir = tmp_path / f"{name}-target"
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(target_hf))
    return out, str(tdir)


def test_prints_exact_commands(tmp_path, capsys):
    draft, target = _export(tmp_path)
    assert main(["--draft", draft, "--target", target, "--num-spec-tokens", "4"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln and not ln.startswith("#")]
    assert lines == [
        f"vllm serve {target} --host 127.0.0.1 --port 8000 --speculative-config "
        f"'{{\"method\": \"eagle3\", \"model\": \"{draft}\", \"num_speculative_tokens\": 4}}'",
        f"python -m sglang.launch_server --model-path {target} --host 127.0.0.1 --port 8000 "
        "--speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {draft} --speculative-num-steps 4 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 5",
    ]
    assert "(validated; target config from" in out
    # exported outside a training run: no run config in the manifest, so no measured dtype to name
    assert "# dtype: not recorded for this head" in out and "--dtype" not in "\n".join(lines)
    # the vLLM JSON is valid and names method eagle3 explicitly
    spec = json.loads(lines[0].split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "eagle3", "model": draft, "num_speculative_tokens": 4}

    assert main(["--draft", draft, "--target", "org/some-hub-model", "--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "vllm serve org/some-hub-model" in out and "sglang" not in out
    assert "target config from the draft's specjax_manifest.json" in out


def test_caveats_hybrid_looped_and_eagle31(tmp_path, capsys):
    hybrid = target_config(model_type="nemotron_h", hybrid_override_pattern="M-M*M-")
    draft, target = _export(tmp_path, "hybrid", target_hf=hybrid)
    assert main(["--draft", draft, "--target", target]) == 0
    out = capsys.readouterr().out
    assert "# sglang: UNSUPPORTED: upstream SGLang has no EAGLE-3 aux-state capture for nemotron_h" in out
    assert "# python -m sglang.launch_server" in out and "--disable-radix-cache" in out  # commented out
    assert "\nvllm serve " in out and "SupportsEagle3" in out

    looped = target_config(num_loops=2)
    draft, target = _export(tmp_path, "looped", target_hf=looped, aux=(1, L + 1, 2 * L - 2))
    assert main(["--draft", draft, "--target", target, "--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert f"looped target ({L} layers, 2 loops = virtual depth {2 * L})" in out and "target_layer_count" in out

    draft, target = _export(tmp_path, "e31", fc_norm=True, norm_output=True)
    assert main(["--draft", draft, "--target", target]) == 0
    out = capsys.readouterr().out
    assert "EAGLE-3.1 head" in out and "acceptance ~1.5 on SGLang" in out


def test_gemma3_target_is_marked_unsupported_on_vllm(tmp_path, capsys):
    """vLLM 0.32's Gemma3ForCausalLM has no SupportsEagle3: the vLLM command is commented out with the reason."""
    gemma = target_config(model_type="gemma3_text")
    draft, target = _export(tmp_path, "gemma3", target_hf=gemma)
    assert main(["--draft", draft, "--target", target, "--engine", "vllm"]) == 0
    out = capsys.readouterr().out
    assert "UNSUPPORTED: vLLM 0.32's Gemma3ForCausalLM" in out and "SupportsEagle3" in out
    assert "\nvllm serve " not in out and "# vllm serve " in out


def test_invalid_draft_gets_no_command(tmp_path, capsys):
    draft, target = _export(tmp_path)
    conf = json.loads(open(os.path.join(draft, "config.json")).read())
    conf["tie_word_embeddings"] = True
    os.remove(os.path.join(draft, "specjax_manifest.json"))
    with open(os.path.join(draft, "config.json"), "w") as f:
        json.dump(conf, f)
    assert main(["--draft", draft, "--target", target]) == 2
    err = capsys.readouterr().err
    assert "fails validation" in err and "tie_word_embeddings" in err and "vllm serve" not in err
    assert main(["--draft", str(tmp_path / "missing"), "--target", target]) == 2


def test_module_entry_point(tmp_path):
    draft, target = _export(tmp_path)
    r = subprocess.run([sys.executable, "-m", "specjax.serve_cmd", "--draft", draft, "--target", target,
                        "--engine", "sglang"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr
    assert "--speculative-algorithm EAGLE3" in r.stdout and "vllm serve" not in r.stdout


@pytest.mark.parametrize("n", ["0", "-1"])
def test_bad_num_spec_tokens(tmp_path, capsys, n):
    draft, target = _export(tmp_path)
    assert main(["--draft", draft, "--target", target, "--num-spec-tokens", n]) == 2

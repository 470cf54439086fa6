"""specjax.serve_cmd serves a head the way it was measured: `--dtype` from the head's manifest (the
training run's target.dtype) or a specjax.eval results file, warnings when that is not the target
config's dtype or not the measured one, `--host`/`--port` on every command, and for `--device cpu`
vLLM's CPU environment in front of the command (KV cache sized from the target and head configs,
OpenMP threads, no binding) and `--max-model-len`. The vLLM install is faked as a regular one
(`vllm serve`); the engine tier runs the printed CPU command (tests/engine/test_serve_cmd_cpu.py)."""
from __future__ import annotations

import json
import math
import shlex

import pytest

from export._heads import HEAD_DIM, L, N_KV, make_draft, target_config
from specjax import serve_cmd
from specjax_converters.eagle3_export import export_eagle3


@pytest.fixture(autouse=True)
def plain_vllm(monkeypatch):
    monkeypatch.setattr(serve_cmd, "_probe", lambda python: {"vllm": None, "providers": [], "importable": False,
                                                              "bindir": "/nowhere"})


def _head(tmp_path, *, trained_dtype="float32", target_dtype="bfloat16", name="head"):
    """An EAGLE-3 head exported with a run config naming `trained_dtype` (None: no run config) and
    its target folder whose config.json says `target_dtype`."""
    target_hf, cfg, params, vocab = make_draft(seed=1, target_hf=target_config(dtype=target_dtype))
    extra = {"config": {"target": {"dtype": trained_dtype, "path": "/t"}}} if trained_dtype else None
    draft = export_eagle3(params, cfg, vocab, target_hf, tmp_path / name, dtype="fp32", extra_manifest=extra)
    tdir = tmp_path / f"{name}-target"
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(target_hf))
    return draft, str(tdir)


def _command(text: str, engine: str = "vllm") -> str:
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    (line,) = [ln for ln in lines if ("sglang" in ln) == (engine == "sglang")]
    return line


def _opt(argv: list, flag: str):
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_gpu_command_serves_the_measured_dtype_and_warns_about_the_targets(tmp_path):
    draft, target = _head(tmp_path)
    code, text = serve_cmd.build(draft, target)
    assert code == 0, text
    argv = shlex.split(_command(text))
    assert argv[:3] == ["vllm", "serve", target]
    assert (_opt(argv, "--dtype"), _opt(argv, "--host"), _opt(argv, "--port")) == ("float32", "127.0.0.1", "8000")
    assert "--max-model-len" not in argv and "VLLM_CPU" not in text
    assert "# dtype: float32, the dtype the head was measured in (target.dtype of the training run" in text
    warn = [ln for ln in text.splitlines() if ln.startswith("# WARNING: dtype")]
    assert len(warn) == 1 and "says bfloat16, this command serves float32" in warn[0]
    assert "without --dtype vLLM would serve bfloat16" in warn[0]
    sg = shlex.split(_command(text, "sglang"))
    assert (_opt(sg, "--dtype"), _opt(sg, "--host"), _opt(sg, "--port")) == ("float32", "127.0.0.1", "8000")
    # the printed argv is vllm_argv's default (what decode_eval and the engine tier build)
    assert argv == serve_cmd.vllm_argv(draft, target, 3)


def test_dtype_sources_and_their_warnings(tmp_path):
    # float32 target config, float32 run: no mismatch, but auto would downcast: a note
    draft, target = _head(tmp_path, target_dtype="float32", name="f32")
    code, text = serve_cmd.build(draft, target, engine="vllm")
    assert code == 0 and "WARNING" not in text
    assert "# note: dtype: vLLM's default (--dtype auto) serves a float32 checkpoint in bfloat16" in text

    # trained against a bf16 target: bf16 is served, with the specjax.eval hint (it decodes in fp32)
    draft, target = _head(tmp_path, trained_dtype="bfloat16", name="bf16")
    code, text = serve_cmd.build(draft, target, engine="vllm")
    assert _opt(shlex.split(_command(text)), "--dtype") == "bfloat16" and "WARNING" not in text
    assert "specjax.eval decodes in float32 unless given --dtype" in text and "--eval-results" in text

    # a specjax.eval results file decides; the hint goes
    res = tmp_path / "eval.json"
    res.write_text(json.dumps({"format": "specjax-eval", "config": {"dtype": "float32", "draft": draft}}))
    code, text = serve_cmd.build(draft, target, engine="vllm", eval_results=str(res))
    assert _opt(shlex.split(_command(text)), "--dtype") == "float32"
    assert f"(specjax.eval --dtype of {res})" in text and "decodes in float32 unless" not in text
    assert "says bfloat16, this command serves float32" in text  # this target's config says bfloat16
    res.write_text(json.dumps({"format": "specjax-eval", "config": {"dtype": "float32", "draft": "/other/head"}}))
    code, text = serve_cmd.build(draft, target, engine="vllm", eval_results=str(res))
    assert "which measured the head at /other/head, not this folder" in text

    # an explicit --dtype that is not the measured one is served, with a warning
    code, text = serve_cmd.build(draft, target, engine="vllm", dtype="fp16")
    assert _opt(shlex.split(_command(text)), "--dtype") == "float16"
    assert "# WARNING: dtype: the head was measured in bfloat16" in text and "serves float16" in text
    # auto: no --dtype, and the measured one named
    code, text = serve_cmd.build(draft, target, engine="vllm", dtype="auto")
    assert "--dtype" not in _command(text) and "the head was measured in bfloat16" in text

    # a head exported outside a run: nothing recorded, no --dtype, a line saying so
    draft, target = _head(tmp_path, trained_dtype=None, name="bare")
    code, text = serve_cmd.build(draft, target, engine="vllm")
    assert "--dtype" not in _command(text) and "# dtype: not recorded for this head" in text

    # bad inputs are errors naming the setting
    assert serve_cmd.build(draft, target, dtype="int8")[0] == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else"}))
    code, text = serve_cmd.build(draft, target, eval_results=str(bad))
    assert code == 2 and "not a specjax.eval results file" in text
    code, text = serve_cmd.build(draft, target, eval_results=str(tmp_path / "missing.json"))
    assert code == 2 and "no such file" in text


def test_cpu_command_environment_kv_cache_and_threads(tmp_path):
    draft, target = _head(tmp_path)
    code, text = serve_cmd.build(draft, target, device="cpu", host="0.0.0.0", port=8123)
    assert code == 0, text
    env, argv = serve_cmd.split_env(shlex.split(_command(text)))
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(serve_cmd.default_cpu_threads()),
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    # target_config(): max_position_embeddings 4096 = the CPU cap
    assert (_opt(argv, "--dtype"), _opt(argv, "--max-model-len")) == ("float32", "4096")
    assert (_opt(argv, "--host"), _opt(argv, "--port")) == ("0.0.0.0", "8123")
    settings, _, _ = serve_cmd.serve_settings(draft, target, device="cpu", host="0.0.0.0", port=8123)
    assert argv == serve_cmd.vllm_argv(draft, target, 3, settings=settings)
    assert "Without it vLLM's CPU worker takes most of the free memory" in text
    assert "# sglang: no CPU command" in text and "sglang.launch_server" not in text

    # the KV cache holds CPU_KV_SEQUENCES sequences of --max-model-len tokens: per token K and V of
    # every target layer and the head's one layer (same KV heads and head_dim), 4 bytes in float32
    per_token = 2 * (L + 1) * N_KV * HEAD_DIM * 4
    n = 1_000_000
    want = math.ceil(per_token * n * serve_cmd.CPU_KV_SEQUENCES / 2**30)
    assert want > 1
    code, text = serve_cmd.build(draft, target, engine="vllm", device="cpu", max_model_len=n)
    env, argv = serve_cmd.split_env(shlex.split(_command(text)))
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(want) and _opt(argv, "--max-model-len") == str(n)
    assert f"{per_token / 1024:.1f} KiB a token" in text
    # in bfloat16 half of that
    code, text = serve_cmd.build(draft, target, engine="vllm", device="cpu", max_model_len=n, dtype="bf16")
    assert serve_cmd.split_env(shlex.split(_command(text)))[0]["VLLM_CPU_KVCACHE_SPACE"] == str(
        math.ceil(per_token // 2 * n * serve_cmd.CPU_KV_SEQUENCES / 2**30))

    # explicit sizes
    code, text = serve_cmd.build(draft, target, engine="vllm", device="cpu", kv_cache_gib=3, cpu_threads=5)
    env, _ = serve_cmd.split_env(shlex.split(_command(text)))
    assert (env["VLLM_CPU_KVCACHE_SPACE"], env["OMP_NUM_THREADS"]) == ("3", "5")
    # CPU settings without --device cpu, and impossible values, are refused
    for kw in ({"kv_cache_gib": 2}, {"cpu_threads": 2}):
        code, text = serve_cmd.build(draft, target, **kw)
        assert code == 2 and "add --device cpu" in text
    for kw in ({"device": "cpu", "kv_cache_gib": 0}, {"device": "cpu", "cpu_threads": 0}, {"port": 0},
               {"max_model_len": 0}):
        assert serve_cmd.build(draft, target, **kw)[0] == 2


def test_hub_target_reads_the_manifest_and_cli(tmp_path, capsys):
    draft, _ = _head(tmp_path)
    assert serve_cmd.main(["--draft", draft, "--target", "org/model", "--engine", "vllm", "--device", "cpu",
                           "--port", "9000"]) == 0
    out = capsys.readouterr().out
    env, argv = serve_cmd.split_env(shlex.split(_command(out)))
    # the target config (bfloat16, 4096 positions) came from the head's manifest
    assert argv[:3] == ["vllm", "serve", "org/model"] and _opt(argv, "--port") == "9000"
    assert _opt(argv, "--max-model-len") == "4096" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "the target's config (the draft's specjax_manifest.json) says bfloat16" in out
    assert serve_cmd.main(["--draft", draft, "--target", "org/model", "--kv-cache-gib", "2"]) == 2
    assert "add --device cpu" in capsys.readouterr().err


def test_split_env_and_canonical_dtype():
    assert serve_cmd.split_env(["A=1", "B_2=x=y", "python", "C=3"]) == ({"A": "1", "B_2": "x=y"}, ["python", "C=3"])
    assert serve_cmd.split_env(["vllm", "serve"]) == ({}, ["vllm", "serve"])
    assert [serve_cmd.canonical_dtype(x) for x in ("fp32", "torch.bfloat16", "half", "auto", None, 3)] == [
        "float32", "bfloat16", "float16", None, None, None]
    assert serve_cmd.config_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert serve_cmd.config_dtype({"text_config": {"dtype": "float16"}}) == "float16"
    assert serve_cmd.config_dtype({}) is None

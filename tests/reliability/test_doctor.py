import json
import os
import shutil

import numpy as np

from specjax.doctor import main


def _yaml(tmp_path, target, **extra):
    lines = [f"target:\n  path: {target}\n  dtype: float32",
             "data:\n  train_files: [pkg://specjax/assets/demo_chat.jsonl]\n  seq_length: 256\n  batch_size: 8",
             "draft:\n  draft_vocab_size: 96"]
    p = tmp_path / "c.yaml"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_doctor_passes_on_a_good_setup(tiny_target, tmp_path, capsys):
    assert main(["--config", _yaml(tmp_path, tiny_target), "--rows", "50"]) == 0
    out = capsys.readouterr().out
    for what in ("devices", "mesh fit", "target architecture", "target weights", "aux layer ids",
                 "tokenizer", "chat template", "data sample"):
        assert f"[OK  ] {what}" in out or f"[WARN] {what}" in out, what
    assert "loss-mask density" in out and "LlamaForCausalLM" in out


def test_doctor_reports_each_problem(tiny_target, tmp_path, capsys):
    t = tmp_path / "broken"
    shutil.copytree(tiny_target, t)
    os.rename(t / "model.safetensors", t / "pytorch_model.bin")
    cfg = _yaml(tmp_path, str(t))
    rc = main(["--config", cfg, "target.aux_layer_ids=[0,9,10]", "data.batch_size=3", "--rows", "20"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "[FAIL] target weights: no safetensors weights (found pickle files ['pytorch_model.bin']" in out
    assert "[FAIL] target config / aux ids" in out
    assert "[FAIL] mesh fit: data.batch_size=3" in out


def test_doctor_checks_a_draft_folder(tiny_target, tmp_path, capsys):
    """A valid export passes; the same export with d2t removed fails naming the field."""
    import jax
    from safetensors.numpy import load_file, save_file

    from specjax.drafts import eagle3
    from specjax.drafts.vocab import build_draft_vocab
    from specjax.export import export_from_state
    from specjax.targets import load_target

    target = load_target(tiny_target, dtype="float32")
    dcfg = eagle3.config_from_target(target.config, draft_vocab_size=64, aux_layer_ids=target.default_aux_layer_ids())
    vocab = build_draft_vocab(np.arange(target.config.vocab_size)[::-1].copy(), 64)
    out = tmp_path / "head"
    export_from_state(jax.device_get(eagle3.init_draft_params(dcfg, jax.random.key(0))), dcfg, vocab,
                      target.hf_config, str(out), dtype="bfloat16", extra_manifest={})
    cfg = _yaml(tmp_path, tiny_target)
    assert main(["--config", cfg, "--rows", "10", "--draft", str(out)]) == 0
    assert "[OK  ] draft export contract" in capsys.readouterr().out
    w = load_file(str(out / "model.safetensors"))
    del w["d2t"]
    save_file(w, str(out / "model.safetensors"))
    assert main(["--config", cfg, "--rows", "10", "--draft", str(out)]) == 1
    assert "[FAIL] draft" in capsys.readouterr().out

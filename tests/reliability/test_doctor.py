import os
import re
import shutil

import numpy as np
import pytest

from specjax.doctor import main

# every check the doctor runs for a config (without --draft), in the order it prints them
CHECKS = ("config", "devices", "mesh fit", "target architecture", "target weights", "aux layer ids",
          "draft", "tokenizer", "chat template", "data sample")


def _yaml(tmp_path, target, **extra):
    lines = [f"target:\n  path: {target}\n  dtype: float32",
             "data:\n  train_files: [pkg://specjax/assets/demo_chat.jsonl]\n  seq_length: 256\n  batch_size: 8",
             "draft:\n  draft_vocab_size: 96"]
    p = tmp_path / "c.yaml"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def _statuses(out: str) -> dict:
    """{check: status} from the doctor's `[STATUS] check: detail` lines (the python line is keyed `python`)."""
    found = {}
    for status, what in re.findall(r"^\[(OK  |WARN|FAIL)\] ([^:\n]+)", out, re.M):
        found["python" if what.startswith("python ") else what] = status.strip()
    return found


def test_doctor_passes_on_a_good_setup(tiny_target, tmp_path, capsys):
    """The tiny target with the shipped demo data: every check is OK (no warning, no failure)."""
    assert main(["--config", _yaml(tmp_path, tiny_target), "--rows", "50"]) == 0
    out = capsys.readouterr().out
    assert _statuses(out) == {c: "OK" for c in CHECKS + ("python",)}, out
    assert "[OK  ] mesh fit: {'data': 8, 'fsdp': 1, 'tensor': 1, 'context': 1, 'expert': 1}" in out
    assert "[OK  ] target architecture: LlamaForCausalLM (supported: " in out
    assert "[OK  ] target weights: model.safetensors" in out
    assert "[OK  ] aux layer ids: [1, 2, 3] of 4 layers (output-of-layer-k convention)" in out
    assert "[OK  ] draft: draft.type=eagle3, 1 layer(s), draft vocab 96 of 320" in out
    assert f"[OK  ] tokenizer: 320 tokens from {tiny_target}" in out
    assert f"[OK  ] chat template: the tokenizer's chat template ({tiny_target})" in out
    assert re.search(r"^\[OK  \] data sample: 50/50 rows usable, \d+ tokens, loss-mask density 0\.\d\d, ", out, re.M)
    assert out.rstrip().endswith("doctor: 11 ok, 0 failing")


def test_doctor_reports_each_problem(tiny_target, tmp_path, capsys):
    t = tmp_path / "broken"
    shutil.copytree(tiny_target, t)
    os.rename(t / "model.safetensors", t / "pytorch_model.bin")
    cfg = _yaml(tmp_path, str(t))
    rc = main(["--config", cfg, "target.aux_layer_ids=[0,9,10]", "data.batch_size=3", "--rows", "20"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "[FAIL] target weights: no safetensors weights (found pickle files ['pytorch_model.bin']" in out
    assert ("[FAIL] target config / aux ids: aux_layer_ids (0, 9, 10) out of range: valid ids are 0..3 "
            "(output of decoder layer k, 4 layers)") in out
    assert "[FAIL] mesh fit: data.batch_size=3 is not divisible by data*fsdp*expert=8" in out
    # the three problems fail; the checks they do not touch still pass, and a failed aux check
    # stops the target checks there (no `aux layer ids` line)
    assert _statuses(out) == {"config": "OK", "python": "OK", "devices": "OK", "mesh fit": "FAIL",
                              "target architecture": "OK", "target weights": "FAIL",
                              "target config / aux ids": "FAIL", "tokenizer": "OK", "chat template": "OK",
                              "data sample": "OK"}, out
    assert out.rstrip().endswith("doctor: 7 ok, 3 failing")


def test_doctor_data_problems(tiny_target, tmp_path, capsys):
    """A missing data file and an empty file list fail the data check; a file with a broken row only
    warns (naming the row); a draft vocab larger than the target's fails its own check."""
    cfg = _yaml(tmp_path, tiny_target)
    missing = tmp_path / "nope.jsonl"
    assert main(["--config", cfg, f"data.train_files=[{missing}]", "--rows", "20"]) == 1
    out = capsys.readouterr().out
    assert f"[FAIL] data sample: data file not found: {missing}\n" in out
    assert [c for c, s in _statuses(out).items() if s != "OK"] == ["data sample"], out

    assert main(["--config", cfg, "data.train_files=[]", "--rows", "20"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] data: data.train_files is empty\n" in out
    assert [c for c, s in _statuses(out).items() if s != "OK"] == ["data"], out

    src = os.path.join(os.path.dirname(__import__("specjax").__file__), "assets", "demo_chat.jsonl")
    good = open(src, encoding="utf-8").read().splitlines()[:10]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(good[:5] + ["{broken"] + good[5:]) + "\n")
    rc = main(["--config", cfg, f"data.train_files=[{mixed}]", "draft.draft_vocab_size=400", "--rows", "20"])
    out = capsys.readouterr().out
    assert rc == 1
    assert ("[FAIL] draft: draft.draft_vocab_size=400 is larger than the target's vocab (320 tokens in "
            f"{tiny_target}/config.json); set draft.draft_vocab_size <= 320.\n") in out
    assert re.search(r"^\[WARN\] data sample: 10/11 rows usable, .*; skipped \{'malformed JSON': 1\}; "
                     rf"first: \['{re.escape(str(mixed))}:6: malformed JSON", out, re.M), out
    assert [(c, s) for c, s in _statuses(out).items() if s != "OK"] == [("draft", "FAIL"),
                                                                         ("data sample", "WARN")], out


def test_doctor_target_folder_not_built_yet(tmp_path, capsys):
    """No target folder: a warning when the run builds it (target.build_demo), a failure otherwise."""
    cfg = _yaml(tmp_path, str(tmp_path / "not_yet"))
    assert main(["--config", cfg, "target.build_demo=true"]) == 0
    out = capsys.readouterr().out
    assert (f"[WARN] target folder: no config.json in '{tmp_path / 'not_yet'}' "
            "(it is built on the first run: target.build_demo=true)\n") in out
    assert (f"[WARN] tokenizer: no tokenizer files in '{tmp_path / 'not_yet'}' yet (the first run builds "
            "them)\n") in out
    assert _statuses(out) == {"config": "OK", "python": "OK", "devices": "OK", "mesh fit": "OK",
                              "target folder": "WARN", "tokenizer": "WARN"}, out

    assert main(["--config", cfg]) == 1
    out = capsys.readouterr().out
    assert f"[FAIL] target folder: no config.json in '{tmp_path / 'not_yet'}'\n" in out
    assert _statuses(out)["target folder"] == "FAIL" and out.rstrip().endswith("doctor: 4 ok, 1 failing")


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
    text = capsys.readouterr().out
    assert f"[OK  ] draft export contract: {out} (" in text
    assert _statuses(text) == {c: "OK" for c in CHECKS + ("python", "draft export contract")}, text
    w = load_file(str(out / "model.safetensors"))
    del w["d2t"]
    save_file(w, str(out / "model.safetensors"))
    assert main(["--config", cfg, "--rows", "10", "--draft", str(out)]) == 1
    text = capsys.readouterr().out
    assert ("[FAIL] draft d2t: absent: vLLM then maps draft id i to target id i (silently wrong tokens when "
            "draft_vocab_size < vocab_size); old SGLang crashes. Fix: ship d2t (int64 offsets, [draft_vocab_size])"
            ) in text
    assert "draft export contract" not in text
    # editing the exported file also breaks its recorded checksum: both are reported
    assert ("[FAIL] draft model.safetensors: sha256 differs from specjax_manifest.json (the file changed after "
            "export)") in text
    assert [(c, s) for c, s in _statuses(text).items() if s != "OK"] == [("draft model.safetensors", "FAIL"),
                                                                         ("draft d2t", "FAIL")], text
    assert text.rstrip().endswith("doctor: 11 ok, 2 failing")


def test_doctor_fails_a_template_that_does_not_compile(tiny_target, tmp_path, capsys):
    """A Jinja syntax error is found once, up front, with the template's file named (not row by row)."""
    bad = tmp_path / "broken.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    assert main(["--config", _yaml(tmp_path, tiny_target), f"data.chat_template={bad}", "--rows", "5"]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("[FAIL] chat template"))
    assert f"the chat template file {bad}" in line and "does not compile (line 1" in line, line
    assert "data sample" not in _statuses(out)  # the data pass is not attempted


def test_the_row_and_template_limits_of_the_config_reach_the_checks(tiny_target, tmp_path, capsys):
    """data.max_template_chars and data.max_row_depth are the bounds the doctor's template check and data
    sample use, and the run's preflight (train.setup.preflight) too: set low, each is named where it bites.
    Fails when a caller renders or reads under the built-in defaults instead of the config's."""
    from specjax.config import load_config
    from specjax.data.chat import ChatTemplateLimitExceeded
    from specjax.train.setup import preflight

    cfg = _yaml(tmp_path, tiny_target)
    assert main(["--config", cfg, "data.max_template_chars=20", "--rows", "20"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\[FAIL\] chat template: .*over data\.max_template_chars = 20\b", out, re.M), out
    # every demo row is a list of message objects: 3 levels deep
    assert main(["--config", cfg, "data.max_row_depth=2", "--rows", "20"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\[FAIL\] data sample: .*row nested too deep", out, re.M), out
    with pytest.raises(ChatTemplateLimitExceeded, match=r"data\.max_template_chars = 20\b"):
        preflight(load_config(cfg, ["data.max_template_chars=20"]))


def test_doctor_fails_a_target_without_a_tokenizer_as_launch_does(tiny_target, tmp_path, capsys):
    """A converted target folder without tokenizer files: the doctor fails it with the message the
    run's preflight raises (before anything expensive), not a warning that lets launch refuse later."""
    from specjax.config import load_config
    from specjax.train.setup import preflight

    t = tmp_path / "no_tok"
    shutil.copytree(tiny_target, t)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (t / name).exists():
            (t / name).unlink()
    cfg = _yaml(tmp_path, str(t))
    assert main(["--config", cfg, "--rows", "5"]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"^\[FAIL\] tokenizer: no tokenizer in '{re.escape(str(t))}': none of tokenizer\.json, "
                     r"tokenizer_config\.json, tokenizer\.model is there\. Fix: set data\.tokenizer", out, re.M), out
    with pytest.raises(ValueError, match=r"no tokenizer in .*no_tok"):
        preflight(load_config(cfg))


def test_doctor_checks_a_target_folder_without_a_config(tiny_target, tmp_path, capsys):
    """--target DIR: the target, its tokenizer and template under the default config; data only with
    --data; draft keys from overrides. A draft vocab the default config cannot take is named."""
    fit = "data.batch_size=8"  # the tests' 8 CPU devices take 8 rows a step
    assert main(["--target", tiny_target, "draft.draft_vocab_size=96", fit]) == 0
    out = capsys.readouterr().out
    st = _statuses(out)
    assert st["target architecture"] == "OK" and st["tokenizer"] == "OK" and st["chat template"] == "OK", out
    assert st["data"] == "WARN" and "give data files with --data" in out, out
    assert f"[OK  ] config: the default config with target.path={tiny_target}" in out

    src = os.path.join(os.path.dirname(__import__("specjax").__file__), "assets", "demo_chat.jsonl")
    assert main(["--target", tiny_target, "--data", src, "draft.draft_vocab_size=96", fit, "--rows", "10"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\[OK  \] data sample: 10/10 rows usable", out, re.M), out

    assert main(["--target", tiny_target, fit]) == 1  # the default draft vocab (32000) is larger than 320
    out = capsys.readouterr().out
    assert "[FAIL] draft: draft.draft_vocab_size=32000 is larger than the target's vocab" in out
    with pytest.raises(SystemExit):
        main(["--target", tiny_target, "--config", _yaml(tmp_path, tiny_target)])

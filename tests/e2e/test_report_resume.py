"""Knowing from the run whether the head is any good, across Ctrl-C and resume, on the tiny target.

- Ctrl-C (a real SIGINT to this process) while a validation step trains: the run stops there with the
  validation not done, the checkpoint names it, and the resumed run validates that step first, on the
  same state (equal to an uninterrupted run's validation, rtol 1e-6). The run report written at the
  end covers both invocations: its numbers are metrics.jsonl's, its PNGs decode, are 800 x 450 and
  not blank, the validation curve spans the steps before and after the resume; the export manifest
  carries the last validation; the launcher's summary starts at step 1, not at the resume.
- Ctrl-C while a validation runs, with decode_eval due after it at that step: the validation
  finishes, decode_eval is left to the resumed run, which measures it at that step first; the report
  then places the head by the measured tau.
- A report that fails is logged and does not fail the run.
- `python -m specjax.launch` with the progress bar: each validation is one console line of its own,
  above the bar, not glued to it; the summary after a resume is over the whole run.
"""
import json
import logging
import os
import re
import signal
import sys

import numpy as np
import pytest

from specjax.config import load_config
from specjax.run_files import (REPORT_ACC_PLOT, REPORT_LOSS_PLOT, REPORT_TAU_PLOT, checkpoint_meta_path,
                               report_path)
from specjax.train.metrics import last_per_step, read_metrics

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import run as run_launch  # noqa: E402

C1 = (255, 127, 14)  # the validation curve's colour (matplotlib's second cycle colour)


def _cfg(target, out, *extra):
    return load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={out}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=200",
        "data.seq_length=128", "data.batch_size=8", "data.val_fraction=0.05",
        "draft.ttt_steps=3", "draft.draft_vocab_size=128", "optim.lr=3e-3", "optim.warmup_ratio=0.1",
        "train.steps=12", "train.log_every=1", "train.eval_every=4", "train.eval_batches=1", "train.progress=false",
        "checkpoint.every_steps=4", "export.at_end=true", "export.dtype=float32", *extra,
    ])


def _table(text):
    """{first|best|last: {column: cell}} of report.md's validation table."""
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("|  | step"))
    cols = [c.strip() for c in lines[head].strip().strip("|").split("|")]
    out = {}
    for line in lines[head + 2:head + 5]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        out[cells[0].split(" ")[0]] = dict(zip(cols, cells))
    return out


def _check_png(path):
    from PIL import Image

    im = Image.open(path)
    im.load()
    assert im.format == "PNG" and im.size == (800, 450), path
    a = np.asarray(im.convert("RGB")).astype(int)
    assert a.std() > 20 and len(np.unique(a.reshape(-1, 3), axis=0)) > 50, f"{path} looks blank"
    return a


def test_ctrl_c_at_a_validation_step_validates_it_on_resume_and_the_report_covers_the_run(
        tiny_target, tmp_path, monkeypatch, caplog):
    from specjax import report as rp
    from specjax.launch import summary_of
    from specjax.train import loop

    ref_dir, out = tmp_path / "ref", tmp_path / "run"
    loop.train(_cfg(tiny_target, ref_dir))
    real_step = loop._Trainer._step

    def step_then_ctrl_c(self):
        real_step(self)
        if self.loop.step == 8:  # step 8 is a validation step (eval_every 4)
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as m:
        m.setattr(loop._Trainer, "_step", step_then_ctrl_c)
        first = loop.train(_cfg(tiny_target, out))
    assert first.preempted and first.final_step == 8
    assert [r["step"] for r in read_metrics(str(out), "val")] == [0, 4]  # the stop came before it
    with open(checkpoint_meta_path(str(out), 8)) as f:
        assert json.load(f)[loop.DUE_NOT_RUN] == ["validate"]
    assert first.report_path == report_path(str(out)) and os.path.isfile(first.report_path)  # a stop reports too

    caplog.clear()  # only the resumed run's lines (the earlier runs' are captured when the level allows)
    with caplog.at_level(logging.INFO, logger="specjax"):
        second = loop.train(_cfg(tiny_target, out))
    assert second.start_step == 8 and second.final_step == 12 and not second.preempted
    val, ref_val = last_per_step(read_metrics(str(out), "val")), last_per_step(read_metrics(str(ref_dir), "val"))
    assert sorted(val) == sorted(ref_val) == [0, 4, 8, 12]
    for s in val:  # step 8's validation is the uninterrupted run's: the same state
        for key in ("loss", "acc_0", "tau_sim"):
            np.testing.assert_allclose(val[s][key], ref_val[s][key], rtol=1e-6, err_msg=f"{key} at {s}")
    lines = [msg for msg in caplog.messages if "validation: loss" in msg]
    assert [int(re.match(r"step (\d+) validation", msg).group(1)) for msg in lines] == [8, 12]
    assert f"loss {val[8]['loss']:.4f}, acc_0 {val[8]['acc_0']:.4f}" in lines[0]
    assert f"predicted tau {1 + val[8]['tau_sim']:.3f} at K=3" in lines[0]

    # the report: numbers from metrics.jsonl, the whole run, the resume marked
    assert second.report_path == report_path(str(out))
    text = open(second.report_path).read()
    table = _table(text)
    for name, step in (("first", 0), ("last", 12)):
        assert int(table[name]["step"]) == step
        for key in ("loss", "acc_0", "tau_sim"):
            assert abs(float(table[name][key]) - val[step][key]) <= 5e-5, (name, key)  # printed to 4 decimals
        assert abs(float(table[name]["predicted tau"]) - (1 + val[step]["tau_sim"])) <= 5e-5
    assert "| steps | 12 of 12 (resumed at step 8) |" in text and "(2 invocations, set-up included)" in text
    stands = text.split("## Where this head stands\n\n", 1)[1].split("\n\n")[0]
    assert f"Validation at step 12 predicts tau {1 + val[12]['tau_sim']:.2f} at K=3" in stands

    report = rp.build_report(str(out))
    assert report.markers == [8]
    loss = report.plots[REPORT_LOSS_PLOT]
    assert loss["train (each logged batch)"][0] == list(range(1, 13))  # before and after the resume
    assert loss["validation"][0] == [0, 4, 8, 12]
    for name in (REPORT_LOSS_PLOT, REPORT_ACC_PLOT, REPORT_TAU_PLOT):
        _check_png(os.path.join(out, name))
    a = _check_png(os.path.join(out, REPORT_LOSS_PLOT))
    # the axes take ~82% of the 800 columns; the validation curve over steps 0..12 fills most of them,
    # one over the steps after the resume only would fill under 40%
    cols = np.unique(np.nonzero(np.abs(a - np.array(C1)).sum(-1) < 40)[1])
    assert len(cols) > 0.65 * 800, len(cols)

    # the manifest: the last validation beside the last train batch
    manifest = json.load(open(os.path.join(second.export_dir, "specjax_manifest.json")))
    assert manifest["val_step"] == 12 and manifest["metrics"]["step"] == 12
    assert manifest["val_metrics"] == {k: v for k, v in val[12].items() if k not in ("step", "split", "time")}
    assert set(manifest["metrics_sources"]) == {"metrics", "val_metrics"}

    # the launcher's summary: the whole run
    s = summary_of(second)
    assert s["first"]["step"] == 1 and s["last"]["step"] == 12 and s["val_first"]["step"] == 0
    assert s["val"]["loss"] == round(val[12]["loss"], 4) and s["resumed_at"] == [8]


def test_ctrl_c_during_a_validation_leaves_decode_eval_to_the_resumed_run(tiny_target, tmp_path, monkeypatch,
                                                                       caplog):
    from specjax.train import loop

    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": c}]}) + "\n"
                               for c in ("Name three colours.", "What is two plus two?")))
    out = tmp_path / "run"
    extra = ("train.steps=8", "decode_eval.every_steps=4", "decode_eval.at_end=true", f"decode_eval.prompts=[{prompts}]",
             "decode_eval.limit=2", "decode_eval.num_spec_tokens=3", "decode_eval.max_new_tokens=8")
    real_validate = loop._Trainer._validate

    def ctrl_c_during_validation(self, step):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)
        return real_validate(self, step)

    with monkeypatch.context() as m:
        m.setattr(loop._Trainer, "_validate", ctrl_c_during_validation)
        first = loop.train(_cfg(tiny_target, out, *extra))
    assert first.preempted and first.final_step == 4
    assert [r["step"] for r in read_metrics(str(out), "val")] == [0, 4]  # the validation ran to its end
    assert read_metrics(str(out), "decode") == []
    with open(checkpoint_meta_path(str(out), 4)) as f:
        assert json.load(f)[loop.DUE_NOT_RUN] == ["decode_eval"]

    with caplog.at_level(logging.INFO, logger="specjax"):
        second = loop.train(_cfg(tiny_target, out, *extra))
    assert second.final_step == 8 and sorted(second.decode_eval) == [4, 8]
    dec = last_per_step(read_metrics(str(out), "decode"))
    assert sorted(dec) == [4, 8]
    tau4 = dec[4]["decode_tau/heldout"]
    # the validation at 8 names the latest measurement, step 4's (step 8's comes after it)
    line8 = next(msg for msg in caplog.messages if msg.startswith("step 8 validation: loss"))
    assert f"decode tau heldout {tau4:.3f}" in line8 and "(step 4)" in line8

    text = open(second.report_path).read()
    assert f"| 4 | heldout | {tau4:.4f} |" in text and f"| 8 | heldout | {dec[8]['decode_tau/heldout']:.4f} |" in text
    stands = text.split("## Where this head stands\n\n", 1)[1].split("\n\n")[0]
    assert f"measured tau {dec[8]['decode_tau/heldout']:.2f}" in stands and "K=3" in stands
    assert "a head at the measured tau of" in stands
    manifest = json.load(open(os.path.join(second.export_dir, "specjax_manifest.json")))
    assert manifest["decode_eval_step"] == 8
    assert manifest["decode_eval"]["decode_tau/heldout"] == dec[8]["decode_tau/heldout"]


def test_a_failing_report_does_not_fail_the_run(tiny_target, tmp_path, monkeypatch, caplog):
    from specjax.train import loop

    def broken(run_dir):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(loop, "write_report", broken)
    with caplog.at_level(logging.INFO, logger="specjax"):
        res = loop.train(_cfg(tiny_target, tmp_path / "run", "train.steps=2", "train.eval_every=0",
                              "export.at_end=false"))
    assert res.final_step == 2 and res.report_path is None
    assert "the run report could not be written (RuntimeError: disk on fire)" in caplog.text
    assert "python -m specjax.report" in caplog.text


def test_launch_console_shows_each_validation_on_its_own_line(tiny_target, tmp_path, repo_root):
    import yaml

    out = tmp_path / "run"
    cfg = {"run": {"output_dir": str(out)}, "target": {"path": tiny_target, "dtype": "float32"},
           "draft": {"ttt_steps": 3, "draft_vocab_size": 128},
           "data": {"train_files": ["pkg://specjax/assets/demo_chat.jsonl"], "max_rows": 200, "seq_length": 128,
                    "batch_size": 8, "val_fraction": 0.05},
           "train": {"steps": 12, "log_every": 1, "eval_every": 2, "eval_batches": 1, "progress": True},
           "checkpoint": {"every_steps": 4}, "export": {"at_end": False}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(dict(cfg, train=dict(cfg["train"], stop_at_step=8))))
    rc, log1 = run_launch(str(path), repo_root, timeout=600)
    assert rc == 0, log1
    path.write_text(yaml.safe_dump(cfg))
    rc, log2 = run_launch(str(path), repo_root, timeout=600)
    assert rc == 0, log2
    # the bar redraws with \r; a log line written past it would share its segment ("train: 50%|...2026-...")
    segments = [seg for seg in re.split(r"[\r\n]", log2) if "validation: loss" in seg]
    assert [int(re.search(r"step (\d+) validation", seg).group(1)) for seg in segments] == [10, 12]
    assert all(re.match(r"\d{4}-\d\d-\d\d [\d:,]+ specjax INFO step \d+ validation: loss", seg) for seg in segments), \
        segments
    bars = [seg for seg in re.split(r"[\r\n]", log2) if seg.startswith("train:") and "val_loss=" in seg]
    assert bars, "the bar shows no validation"
    summary, _ = json.JSONDecoder().raw_decode(log2, log2.index("\n{") + 1)
    assert summary["first"]["step"] == 1 and summary["val_first"]["step"] == 0 and summary["resumed_at"] == [8]
    assert summary["report"] == report_path(str(out))

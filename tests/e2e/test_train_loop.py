"""End-to-end: the training loop on a tiny locally built target (8 fake CPU devices, data-parallel).

Covers: loss falls, metrics/TensorBoard/checkpoints/export are written, and a run stopped after N
steps and resumed matches an uninterrupted run at every later step (1e-6)."""
import json
import os

import numpy as np
import pytest

from specjax.config import load_config
from specjax.train.metrics import read_metrics

def _cfg(target, out, *extra):
    return load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={out}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=400",
        "data.seq_length=128", "data.batch_size=8", "data.val_fraction=0.05",
        "draft.ttt_steps=3", "draft.draft_vocab_size=128",
        "optim.lr=3e-3", "optim.warmup_ratio=0.1",
        "train.log_every=1", "train.eval_batches=1", "train.progress=false",
        "checkpoint.every_steps=4", *extra,
    ])


def test_train_writes_everything_and_learns(tiny_target, tmp_path):
    from specjax.train.loop import train

    out = tmp_path / "run"
    res = train(_cfg(tiny_target, out, "train.steps=30", "train.eval_every=15"))
    rows = read_metrics(str(out), "train")
    assert [r["step"] for r in rows] == list(range(1, 31))
    losses = np.array([r["loss"] for r in rows])
    assert np.all(np.isfinite(losses))
    # a fixed held-out set before and after: the soft CE has the teacher's entropy as its floor,
    # so compare absolute drops rather than ratios
    val = read_metrics(str(out), "val")
    assert [r["step"] for r in val] == [0, 15, 30]
    assert val[-1]["loss"] < val[0]["loss"] - 0.1, val
    assert val[-1]["acc_0"] > val[0]["acc_0"] + 0.3, val
    assert res.initial_val_metrics["loss"] == val[0]["loss"]
    assert {"acc_0", "acc_2", "loss_0", "tau_sim", "grad_norm", "lr", "tokens_per_s"} <= set(rows[-1])
    assert os.listdir(out / "tensorboard")
    assert sorted(int(s) for s in os.listdir(out / "checkpoints") if s.isdigit())[-1] == 30
    assert sorted(os.listdir(res.export_dir)) == ["config.json", "model.safetensors", "specjax_manifest.json"]
    exported = json.loads((out / "export" / "config.json").read_text())
    assert exported["draft_vocab_size"] == 128


def test_resume_matches_uninterrupted_run(tiny_target, tmp_path):
    from specjax.train.loop import train

    full, split = tmp_path / "full", tmp_path / "split"
    train(_cfg(tiny_target, full, "train.steps=8", "export.at_end=false"))
    first = train(_cfg(tiny_target, split, "train.steps=8", "train.stop_at_step=4", "export.at_end=false"))
    assert first.stopped_early and first.final_step == 4
    second = train(_cfg(tiny_target, split, "train.steps=8", "export.at_end=false"))
    assert second.final_step == 8
    a = {r["step"]: r for r in read_metrics(str(full), "train")}
    b = {r["step"]: r for r in read_metrics(str(split), "train")}
    assert sorted(b) == list(range(1, 9))  # the resumed run continued at step 5
    for step in range(1, 9):
        for key in ("loss", "acc_0", "grad_norm"):
            np.testing.assert_allclose(b[step][key], a[step][key], rtol=1e-6, atol=1e-7,
                                       err_msg=f"{key} at step {step}")


def test_epochs_set_the_step_count_from_the_data(tiny_target, tmp_path):
    """train.epochs replaces train.steps once the data is read: ceil(epochs x packed batches of one
    pass), and the loop, the LR schedule and run_meta.json all use it."""
    import math

    from specjax.data.pipeline import batches_per_epoch
    from specjax.train.loop import train

    out = tmp_path / "run"
    res = train(_cfg(tiny_target, out, "data.max_rows=20", "train.steps=1000", "train.epochs=1.5",
                     "export.at_end=false", "optim.min_lr_ratio=0.1"))
    meta = json.loads((out / "run_meta.json").read_text())
    steps = meta["config"]["train"]["steps"]
    rows = read_metrics(str(out), "train")
    assert res.final_step == steps == len(rows) and steps < 1000
    # the same data read again (val split included) gives the count the run used
    from specjax.data import prepare_examples
    from transformers import AutoTokenizer

    from specjax.train.setup import resolve_path

    prep = prepare_examples((resolve_path("pkg://specjax/assets/demo_chat.jsonl"),), AutoTokenizer.from_pretrained(tiny_target), 128,
                            0.05, 0, max_rows=20)
    per_epoch = batches_per_epoch(prep.train, 128, 8)
    assert steps == math.ceil(1.5 * per_epoch)
    # the LR schedule spans these steps (a 1000-step one would still be warming up)
    from specjax.train.optim import lr_schedule

    cfg = _cfg(tiny_target, out, "optim.min_lr_ratio=0.1")
    lrs = [r["lr"] for r in rows]
    assert lrs == pytest.approx([float(lr_schedule(cfg.optim, steps)(i)) for i in range(steps)], rel=1e-5)
    assert lrs != pytest.approx([float(lr_schedule(cfg.optim, 1000)(i)) for i in range(steps)], rel=1e-2)


def test_batches_per_epoch_counts_first_fit_packed_batches():
    from specjax.data.chat import Example
    from specjax.data.pipeline import batches_per_epoch

    ex = lambda n: Example(input_ids=np.arange(n, dtype=np.int32), loss_mask=np.ones(n, np.int32))  # noqa: E731
    # rows of 10: [6, 4], [6, 3], [9], [2] -> 4 rows -> 2 batches of 2, or 1 batch of 4
    examples = [ex(6), ex(6), ex(4), ex(9), ex(3), ex(2)]
    assert batches_per_epoch(examples, 10, 2) == 2 and batches_per_epoch(examples, 10, 4) == 1
    assert batches_per_epoch(examples, 10, 3) == 2  # 4 rows: a padded second batch counts


def test_launch_cli_help_and_config_errors(capsys, tmp_path):
    from specjax.launch import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "draft:" in out and "ttt_steps" in out and "parallelism:" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("draft:\n  ttt_step: 3\n")
    assert main(["--config", str(bad)]) == 2
    assert "Did you mean `ttt_steps`" in capsys.readouterr().err

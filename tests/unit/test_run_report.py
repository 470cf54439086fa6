"""The run report (specjax.report) and the history it reads (specjax.train.metrics.read_history), on
metrics.jsonl files written here: a resumed run (re-logged steps, the later row wins), a block
drafter's keys, a run without validation, without matplotlib; the report's numbers against the
file's, its PNGs decoded and looked at, the sentence that places the head at each side of the rule
of thumb, the CLI, the launcher's whole-run summary and the export manifest's evaluation keys."""
import json
import math
import os
import re
import sys

import numpy as np
import pytest

from specjax import report as rp
from specjax.run_files import REPORT_ACC_PLOT, REPORT_FILE, REPORT_LOSS_PLOT, REPORT_TAU_PLOT
from specjax.train.metrics import Smoothed, predicted_tau, read_history, summarize, validation_line

C0, C1 = (31, 119, 180), (255, 127, 14)  # matplotlib's first two cycle colours: train and validation


def _write(run, rows, meta=None):
    os.makedirs(run, exist_ok=True)
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r) + "\n")
    if meta is not None:
        with open(os.path.join(run, "run_meta.json"), "w") as f:
            json.dump(meta, f)


def _ttt(step, split, loss, acc, t):
    """A TTT row: acc per position, tau_sim = sum of the running products."""
    tau_sim = float(np.sum(np.cumprod(acc)))
    return {"step": step, "split": split, "time": t, "loss": loss, "tau_sim": tau_sim,
            **{f"acc_{i}": a for i, a in enumerate(acc)}, "tokens_per_s": 1000.0 + step}


def _meta(draft_type="eagle3", decode=None):
    cfg = {"train": {"steps": 12, "eval_every": 4, "eval_batches": 2}, "draft": {"type": draft_type}}
    if decode:
        cfg["decode_eval"] = decode
    return {"config": cfg, "target_path": "/models/tiny", "target_config": {"model_type": "llama"}}


def _resumed_run(run):
    """12 steps; the first invocation logs 1..10 and validates at 0, 4, 8, then is killed (no end
    marker); the second resumes from the checkpoint at 8, re-logs 9..10 with other values, validates
    at 12 and measures decode tau at 12."""
    rng = np.random.default_rng(0)
    rows = [{"step": 0, "split": "run", "time": 100.0, "event": "start", "start_step": 0, "setup_s": 5.0}]
    rows.append(_ttt(0, "val", 6.0, [0.0, 0.0, 0.0], 101.0))
    for s in range(1, 11):
        rows.append(_ttt(s, "train", 6.0 - 0.2 * s + rng.normal(), [0.05 * s, 0.03 * s, 0.01 * s], 101.0 + s))
        if s in (4, 8):
            rows.append(_ttt(s, "val", 6.0 - 0.25 * s, [0.05 * s, 0.04 * s, 0.03 * s], 101.5 + s))
    rows.append('{"step": 11, "split": "train", "loss": 9\n')  # torn by the kill (MetricsWriter then starts a new line)
    rows.append({"step": 8, "split": "run", "time": 200.0, "event": "start", "start_step": 8, "setup_s": 4.0})
    for s in range(9, 13):
        rows.append(_ttt(s, "train", 3.0 - 0.1 * s, [0.5 + 0.01 * s, 0.4, 0.3], 200.0 + s))
    rows.append(_ttt(12, "val", 2.5, [0.7, 0.6, 0.5], 213.0))
    rows.append({"step": 12, "split": "decode", "time": 214.0, "decode_tau/mtbench": 1.9, "decode_tau_lo/mtbench": 1.7,
                 "decode_tau_hi/mtbench": 2.1, **{f"decode_accept_{i}/mtbench": 0.3 for i in range(5)}})
    rows.append({"step": 12, "split": "run", "time": 215.0, "event": "end", "wall_time_s": 19.0, "stopped": False})
    _write(run, rows, _meta(decode={"backend": "jax", "num_spec_tokens": 5, "prompts": ["mtbench"], "limit": 8,
                                    "temperature": 0.0}))
    return rows


def _expected(rows, split):
    """The file's rows of `split`, the later one winning per step (read independently of the code)."""
    out = {}
    for r in rows:
        if isinstance(r, dict) and r.get("split") == split:
            out[r["step"]] = r
    return out


# ---------------------------------------------------------------------------------------------
def test_history_keeps_the_later_row_of_a_relogged_step_and_each_invocation(tmp_path):
    run = str(tmp_path / "run")
    rows = _resumed_run(run)
    h = read_history(run)
    want = _expected(rows, "train")
    assert h.steps("train") == list(range(1, 13)) == sorted(want)
    for s in (9, 10):  # re-logged by the resume: the second invocation's values
        assert h.rows["train"][s]["loss"] == want[s]["loss"] == pytest.approx(3.0 - 0.1 * s)
    assert h.steps("val") == [0, 4, 8, 12] and h.first("val")["step"] == 0 and h.last("val")["step"] == 12
    # the first invocation was killed: counted from its start (minus its set-up) to its last row
    assert [(s.start_step, s.last_step, s.ended) for s in h.segments] == [(0, 10, False), (8, 12, True)]
    assert h.segments[0].wall_time_s == pytest.approx(111.0 - 100.0 + 5.0) and h.wall_time_s == pytest.approx(35.0)
    assert h.at_or_before("val", 11)["step"] == 8


def test_a_fresh_start_in_the_same_folder_begins_a_new_history(tmp_path):
    run = str(tmp_path / "run")
    _write(run, [{"step": 0, "split": "run", "time": 1.0, "event": "start", "start_step": 0},
                 _ttt(1, "train", 9.0, [0.1], 2.0), _ttt(2, "train", 9.0, [0.1], 3.0),
                 {"step": 0, "split": "run", "time": 10.0, "event": "start", "start_step": 0},
                 _ttt(1, "train", 5.0, [0.2], 11.0)])
    h = read_history(run)
    assert h.steps("train") == [1] and h.rows["train"][1]["loss"] == 5.0 and len(h.segments) == 1


def test_report_numbers_are_the_files_and_the_plots_cover_the_resume(tmp_path):
    from PIL import Image

    run = str(tmp_path / "run")
    rows = _resumed_run(run)
    path = rp.write_report(run)
    assert path == os.path.join(os.path.abspath(run), REPORT_FILE)
    text = open(path).read()
    val = _expected(rows, "val")

    # the validation table: first / best / last, every number the file's (4 decimals: |diff| <= 5e-5)
    table = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("first", "last") or cells[0].startswith("best ("):
            table[cells[0].split(" ")[0]] = cells
    header = next(line for line in text.splitlines() if line.startswith("|  | step"))
    cols = [c.strip() for c in header.strip().strip("|").split("|")]
    assert cols == ["", "step", "loss", "acc_0", "tau_sim", "predicted tau", "K"]
    for name, step in (("first", 0), ("best", 12), ("last", 12)):
        cells = table[name]
        assert int(cells[1]) == step
        for col, cell in zip(cols[2:5], cells[2:5]):
            assert abs(float(cell) - val[step][col]) <= 5e-5, (name, col)
        assert abs(float(cells[5]) - (1 + val[step]["tau_sim"])) <= 5e-5 and cells[6] == "3"

    # the run: steps with the resume, the wall time of both invocations, the median tokens/s
    assert "| steps | 12 of 12 (resumed at step 8) |" in text
    assert "| wall time | 35.0 s (2 invocations, set-up included; 1 killed" in text
    train = _expected(rows, "train")
    rates = [train[s]["tokens_per_s"] for s in train if s not in (1, 9)]  # each invocation's first window left out
    assert f"| training tokens/s | {np.median(rates):.0f} (median" in text
    assert "| 12 | mtbench | 1.9000 | [1.7000, 2.1000] |" in text
    assert "| target | /models/tiny (llama) |" in text and "| draft | eagle3 |" in text

    # the sentence: validation's prediction, the engine's measurement (which places the head), the rule
    stands = text.split("## Where this head stands\n\n", 1)[1].split("\n\n")[0]
    assert f"predicts tau {1 + val[12]['tau_sim']:.2f} at K=3 (1 + tau_sim)" in stands
    assert "measured tau 1.90 [1.70, 2.10] on mtbench at step 12" in stands and "K=5" in stands
    assert "may help a little or not at all" in stands and "at K=5 the bar is higher" in stands
    assert "below ~1.5 tends to be slower than no speculation" in text and "above ~2.5 it usually pays" in text

    # the plots: the curves hold every step of both invocations, the resume is marked
    report = rp.build_report(run)
    assert report.markers == [8]
    loss = report.plots[REPORT_LOSS_PLOT]
    assert loss["train (each logged batch)"][0] == list(range(1, 13))
    assert loss["validation"] == ([0, 4, 8, 12], [val[s]["loss"] for s in (0, 4, 8, 12)])
    acc = report.plots[REPORT_ACC_PLOT]
    assert sorted(acc) == ["acc_0", "acc_1", "acc_2"] and acc["acc_2"] == ([0, 4, 8, 12],
                                                                            [val[s]["acc_2"] for s in (0, 4, 8, 12)])
    tau = report.plots[REPORT_TAU_PLOT]
    assert tau["predicted, validation"][1] == pytest.approx([1 + val[s]["tau_sim"] for s in (0, 4, 8, 12)])
    assert tau["decode_eval mtbench"] == ([12], [1.9])
    assert all(f"![{t}]({p})" in text for t, p in (("loss", REPORT_LOSS_PLOT), ("tau over steps", REPORT_TAU_PLOT),
                                                    ("accuracy by draft position", REPORT_ACC_PLOT)))

    for name in (REPORT_LOSS_PLOT, REPORT_ACC_PLOT, REPORT_TAU_PLOT):
        im = Image.open(os.path.join(run, name))
        im.load()  # decodes the whole image
        assert im.format == "PNG" and im.size == (800, 450), name
        a = np.asarray(im.convert("RGB")).astype(int)
        assert a.std() > 20 and len(np.unique(a.reshape(-1, 3), axis=0)) > 50, f"{name} looks blank"
    # the validation line (C1) runs across the axes, steps 0 to 12, on both sides of the resume: the axes
    # take ~82% of the 800 columns; a curve over the steps after the resume only would fill under 40%
    a = np.asarray(Image.open(os.path.join(run, REPORT_LOSS_PLOT)).convert("RGB")).astype(int)
    cols = np.unique(np.nonzero(np.abs(a - np.array(C1)).sum(-1) < 40)[1])
    assert len(cols) > 0.65 * 800, len(cols)


@pytest.mark.parametrize("tau_sim, says", [(0.2, "slower than no speculation"), (1.0, "may help a little"),
                                          (1.8, "usually pays")])
def test_the_sentence_follows_the_rule_of_thumb(tmp_path, tau_sim, says):
    run = str(tmp_path / "run")
    _write(run, [{"step": 5, "split": "val", "time": 1.0, "loss": 1.0, "tau_sim": tau_sim, "acc_0": 0.5,
                  "acc_1": 0.4, "acc_2": 0.3}], _meta())
    stands = rp.build_report(run).placement
    assert f"predicts tau {1 + tau_sim:.2f} at K=3" in stands and says in stands and "predicted tau" in stands
    assert "the bar is" not in stands  # K=3: the rule's own K


def test_a_block_drafter_is_placed_by_accept_len(tmp_path):
    """DFlash-style rows (acc_<slot>, acc, accept_len, no tau_sim): accept_len is the prediction (it
    counts its bonus token), the acc plot has one line per slot and the overall acc."""
    run = str(tmp_path / "run")
    rows = []
    for s in (0, 5, 10):
        rows.append({"step": s, "split": "val", "time": float(s), "loss": 1.0 / (s + 1), "acc_0": 0.1 * s / 5,
                     "acc_1": 0.05 * s / 5, "acc_2": 0.02 * s / 5, "acc": 0.06 * s / 5, "accept_len": 1 + 0.4 * s / 5})
        if s:
            rows.append({"step": s, "split": "train", "time": float(s), "loss": 2.0, "acc_0": 0.1, "accept_len": 1.2})
    _write(run, rows, _meta("dflash"))
    text = open(rp.write_report(run)).read()
    assert predicted_tau(rows[-2]) == (1.8, 3)
    assert "predicts tau 1.80 at K=3 (accept_len)" in text and "may help a little" in text
    assert re.search(r"\| last \| 10 \| 0\.0909 \| 0\.2000 \| 0\.1200 \| 1\.8000 \| 1\.8000 \| 3 \|", text), text
    acc = rp.build_report(run).plots[REPORT_ACC_PLOT]
    assert sorted(acc) == ["acc (all positions)", "acc_0", "acc_1", "acc_2"]


def test_without_validation_the_training_batches_are_used_and_said_so(tmp_path):
    run = str(tmp_path / "run")
    _write(run, [_ttt(s, "train", 3.0, [0.6, 0.5, 0.4], float(s)) for s in range(1, 6)], _meta())
    text = open(rp.write_report(run)).read()
    assert "No validation rows" in text and "No validation ran (data.val_fraction" in text and "(which the head has seen)" in text
    assert f"predict tau {1 + 0.6 + 0.3 + 0.12:.2f} at K=3" in text
    acc = rp.build_report(run).plots[REPORT_ACC_PLOT]  # from the training rows, smoothed
    assert acc["acc_0"] == ([1, 2, 3, 4, 5], pytest.approx([0.6] * 5))
    assert all(os.path.exists(os.path.join(run, n)) for n in (REPORT_LOSS_PLOT, REPORT_ACC_PLOT, REPORT_TAU_PLOT))


def test_without_matplotlib_the_markdown_is_written_and_one_line_says_why(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    _resumed_run(run)
    rp.write_report(run)
    assert os.path.exists(os.path.join(run, REPORT_TAU_PLOT))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    lines = []
    text = open(rp.write_report(run, info=lines.append)).read()
    assert len(lines) == 1 and "matplotlib could not be imported" in lines[0]
    assert "No plots: matplotlib could not be imported" in text and "![" not in text
    assert "## Validation" in text and "predicts tau" in text
    # the earlier plots are gone: they would show an older state of the run than the markdown
    assert not any(os.path.exists(os.path.join(run, n)) for n in (REPORT_LOSS_PLOT, REPORT_ACC_PLOT, REPORT_TAU_PLOT))


def test_cli(tmp_path, capsys):
    run = str(tmp_path / "run")
    _resumed_run(run)
    assert rp.main([run]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == os.path.join(os.path.abspath(run), REPORT_FILE) and "measured tau 1.90" in out[-2]
    assert rp.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "has no metrics.jsonl" in err and "run.output_dir" in err


def test_launch_summary_is_over_the_whole_run(tmp_path):
    """After a resume, first is the run's first logged step, not the resumed invocation's; val_first
    and val are the first and last validation; wall_time_s_all_runs adds the invocations."""
    from specjax.launch import summary_of
    from specjax.train.loop import RunResult

    run = str(tmp_path / "run")
    rows = _resumed_run(run)
    res = RunResult(output_dir=run, final_step=12, first_metrics={"step": 9, "loss": 1.0},
                    last_metrics={"step": 12, "loss": 0.5}, val_metrics={"loss": 2.5}, wall_time_s=19.0,
                    report_path="/x/report.md")
    s = summary_of(res)
    train, val = _expected(rows, "train"), _expected(rows, "val")
    assert s["first"] == {"step": 1, **{k: round(train[1][k], 4) for k in ("loss", "acc_0", "tau_sim")}}
    assert s["last"]["step"] == 12 and s["last"]["loss"] == round(train[12]["loss"], 4)
    assert s["val_first"]["step"] == 0 and s["val"]["step"] == 12 and s["val"]["tau_sim"] == round(val[12]["tau_sim"], 4)
    assert s["resumed_at"] == [8] and s["wall_time_s_all_runs"] == 35.0 and s["report"] == "/x/report.md"


def test_manifest_evaluation_keys(tmp_path):
    from specjax.export import eval_manifest

    run = str(tmp_path / "run")
    rows = _resumed_run(run)
    val = _expected(rows, "val")
    m = eval_manifest(run, 12)
    assert m["val_step"] == 12 and m["val_metrics"] == {k: v for k, v in val[12].items()
                                                         if k not in ("step", "split", "time")}
    assert m["decode_eval_step"] == 12 and m["decode_eval"]["decode_tau/mtbench"] == 1.9
    assert set(m["metrics_sources"]) == {"metrics", "val_metrics", "decode_eval"}
    m = eval_manifest(run, 10)  # a head exported at step 10: the validation at 8, no decode_eval yet
    assert m["val_step"] == 8 and "decode_eval" not in m and set(m["metrics_sources"]) == {"metrics", "val_metrics"}
    assert eval_manifest(str(tmp_path / "none"), 3) == {}


def test_console_line_and_smoothed_bar():
    m = {"loss": 2.5, "acc_0": 0.6, "acc_1": 0.5, "tau_sim": 0.9, "tokens_per_s": 10.0}
    line = validation_line(40, m, (30, {"decode_tau/mtbench": 1.7, "decode_tau_lo/mtbench": 1.5,
                                        "decode_tau_hi/mtbench": 1.9}))
    assert line == ("step 40 validation: loss 2.5000, acc_0 0.6000, tau_sim 0.9000, predicted tau 1.900 at K=2, "
                    "decode tau mtbench 1.700 [1.500, 1.900] (step 30)")
    # the bar: a noisy loss smoothed (the first value is itself; a constant stays; the jumps shrink)
    sm = Smoothed(0.9)
    assert sm.update({"loss": 6.0})["loss"] == 6.0
    rng = np.random.default_rng(1)
    raw = 16 + 10 * rng.choice([-1.0, 1.0], size=200)  # a batch-of-2 loss jumping between 6 and 26
    out = [sm.update({"loss": x})["loss"] for x in raw]
    assert np.std(out[50:]) < 0.4 * np.std(raw[50:])
    bar = summarize({"loss": out[-1], "tokens_per_s": 99.4}, {"loss": 2.0, "tau_sim": 0.5, "acc_0": 0.5})
    assert bar == {"loss": f"{out[-1]:.3f}", "tok/s": "99", "val_loss": "2.000", "val_tau": "1.50"}
    assert not math.isnan(Smoothed().update({"x": float("nan")}).get("x", 0.0))

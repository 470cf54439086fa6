"""A checkpoint of another run must not resume silently (issue 53, item 1).

Run A and run B train the tiny target on different data (so different draft vocabularies) with a
different lr. B's checkpoint copied over A's newest, or A's own checkpoint copied in under another
step number, is refused at set-up with every difference listed and the fix; nothing is trained or
exported. checkpoint.allow_config_change lets settings and data through (a warm start from another
run's checkpoint, once the new folder holds that run's draft vocabulary) but never another draft
vocabulary or another step."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from specjax import checkpoint as ckpt
from specjax.train.loop import train

from _runs import count_train_rows, inprocess_config, save_small_checkpoints, small_abstract_state


def cfg(target, out, *extra):
    return inprocess_config(target, out, "train.steps=8", "checkpoint.every_steps=2", "checkpoint.keep=3", *extra)


@pytest.fixture(scope="module")
def run_a(tiny_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("a") / "run"
    assert train(cfg(tiny_target, out, "train.stop_at_step=4")).final_step == 4
    return out


@pytest.fixture(scope="module")
def run_b(tiny_target, tmp_path_factory):
    """Other rows of the demo data, another lr: same shapes as A, another identity."""
    root = tmp_path_factory.mktemp("b")
    with open(os.path.join(os.path.dirname(ckpt.__file__), "assets", "demo_chat.jsonl")) as f:
        rows = f.readlines()[1500:1620]
    data = root / "other_chat.jsonl"
    data.write_text("".join(rows))
    out = root / "run"
    assert train(cfg(tiny_target, out, f"data.train_files=[{data}]", "optim.lr=0.003",
                     "train.stop_at_step=4")).final_step == 4
    return out, str(data)


def _vocab_ids(run):
    return np.load(run / "draft_vocab.npz")["draft_ids"]


def _copy(run, out):
    shutil.copytree(run, out)
    return out / "checkpoints"


def _assert_nothing_trained(out, latest=4):
    """Still as run A left it: 4 steps trained, no export; `latest`: the newest checkpoint folder."""
    assert ckpt.manager(str(out / "checkpoints"), read_only=True).latest_step() == latest
    assert count_train_rows(str(out)) == 4 and not (out / "export").exists()


def test_another_runs_checkpoint_over_the_newest_is_refused_with_the_differences(tiny_target, run_a, run_b,
                                                                                 tmp_path):
    b_run, b_data = run_b
    assert not np.array_equal(_vocab_ids(run_a), _vocab_ids(b_run))  # the case needs another vocabulary
    out = tmp_path / "run"
    d = _copy(run_a, out)
    shutil.rmtree(d / "4")
    shutil.copytree(b_run / "checkpoints" / "4", d / "4")  # same shapes, same step, verifies
    for extra in ((), ("checkpoint.allow_config_change=true",)):
        with pytest.raises(ckpt.CheckpointFromAnotherRun) as e:
            train(cfg(tiny_target, out, *extra))
        msg = str(e.value)
        assert msg.startswith(f"checkpoint {d / '4'} does not belong to this run ({out}) as step 4:\n"), msg
        for line in ("  config optim.lr: 0.003 -> 0.0001\n",
                     f"  config data.train_files: ['{b_data}'] -> ['pkg://specjax/assets/demo_chat.jsonl']\n",
                     "  data sha256 ", "(the training examples' token ids: ",
                     "  draft vocabulary sha256 ", "(draft_vocab.npz)\n",
                     "lm_head rows are in the order of another draft vocabulary",
                     f"Move {d / '4'} out of {d}", "checkpoint.restore_from=none", "draft.init_from"):
            assert line in msg, (line, msg)
        assert "step: folder" not in msg
        _assert_nothing_trained(out)


def test_checkpoint_copied_in_under_another_step_is_refused(tiny_target, run_a, tmp_path):
    out = tmp_path / "run"
    d = _copy(run_a, out)
    shutil.copytree(d / "4", d / "30")  # A's own checkpoint of step 4, as checkpoints/30
    with pytest.raises(ckpt.CheckpointFromAnotherRun) as e:
        train(cfg(tiny_target, out))
    msg = str(e.value)
    assert f"checkpoint {d / '30'} does not belong to this run ({out}) as step 30:\n  step: folder 30 holds step 4\n" \
        in msg, msg
    assert "copied in or renamed" in msg and f"Move {d / '30'} out of {d}" in msg
    assert "config " not in msg and "sha256" not in msg  # the identity is A's own: only the step differs
    # asked for by name it is refused too
    with pytest.raises(ckpt.CheckpointFromAnotherRun, match="step: folder 30 holds step 4"):
        train(cfg(tiny_target, tmp_path / "other", f"checkpoint.restore_from={d / '30'}"))
    _assert_nothing_trained(out, latest=30)


def test_a_renamed_step_folder_is_refused_by_the_state_it_holds(tmp_path):
    """Without a step in its meta (older checkpoints), the restored state's step tells."""
    d = tmp_path / "checkpoints"
    save_small_checkpoints(d, (4,))
    os.rename(d / "4", d / "30")
    with pytest.raises(ckpt.CheckpointFromAnotherRun, match=r"(?s)checkpoints/30 does not belong here:\n"
                                                           r"  step: folder 30 holds step 4\n.*copied in or renamed"):
        ckpt.restore_verified(ckpt.manager(str(d)), small_abstract_state())
    assert sorted(os.listdir(d)) == ["30"]  # refused, not moved aside: the user decides


def test_warm_start_from_another_runs_checkpoint_needs_its_vocabulary_and_the_override(tiny_target, run_a, run_b,
                                                                                       tmp_path):
    """checkpoint.restore_from=<B's step 4> with A's settings and data: refused, naming B's
    draft_vocab.npz; with it copied into the new folder, refused naming allow_config_change; with
    both, the run starts from B's step 4 and trains to the end."""
    b_run, _ = run_b
    src = b_run / "checkpoints" / "4"
    out = tmp_path / "run"
    with pytest.raises(ckpt.CheckpointFromAnotherRun) as e:
        train(cfg(tiny_target, out, f"checkpoint.restore_from={src}"))
    msg = str(e.value)
    assert "  draft vocabulary sha256 " in msg and "  data sha256 " in msg and "config optim.lr: 0.003 -> 0.0001" in msg
    assert f"start in a new run.output_dir holding a copy of {b_run / 'draft_vocab.npz'}" in msg, msg
    shutil.rmtree(out)
    out.mkdir()
    shutil.copy(b_run / "draft_vocab.npz", out / "draft_vocab.npz")
    with pytest.raises(ValueError) as e:
        train(cfg(tiny_target, out, f"checkpoint.restore_from={src}"))
    msg = str(e.value)
    assert msg.startswith(f"starting {out} from checkpoint {src} (checkpoint.restore_from), which was trained with "
                          "a different configuration or data:\n"), msg
    assert "draft vocabulary" not in msg and "checkpoint.allow_config_change=true to start from it" in msg
    res = train(cfg(tiny_target, out, f"checkpoint.restore_from={src}", "checkpoint.allow_config_change=true"))
    assert res.final_step == 8 and count_train_rows(str(out)) == 4  # steps 5..8, from B's step 4
    np.testing.assert_array_equal(_vocab_ids(out), _vocab_ids(b_run))

"""build_run runs each set-up stage once, in the documented order (lock -> preflight -> target
folder -> regeneration -> target -> tokenizer -> data -> vocab -> set-up -> restore), loads the
tokenizer once, converts a GGUF once, resolves train.epochs into the one final config, and holds the
run-folder lock until the Run is closed; `python -m specjax.launch` only parses and dispatches."""
from __future__ import annotations

import fcntl
import json
import os

import pytest

from specjax import run_lock
from specjax.config import config_to_dict, load_config


def _cfg(tiny_target, out, *extra):
    return load_config(None, [
        f"target.path={tiny_target}", "target.dtype=float32", f"run.output_dir={out}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=60",
        "data.seq_length=64", "data.batch_size=8", "data.val_fraction=0.0", "train.eval_batches=0",
        "draft.ttt_steps=2", "draft.draft_vocab_size=96", "train.steps=2", "train.progress=false",
        "export.at_end=false", *extra,
    ])


def _locked_elsewhere(out) -> bool:
    """Whether a new open file description of the lock file can take the lock (flock is per
    description, so this sees a lock held by this same process)."""
    fd = os.open(run_lock.lock_path(str(out)), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.fixture
def stages(monkeypatch):
    """Record the stages build_run calls, in order; the demo build and the GGUF conversion are
    counted (the tiny target is already a finished folder, which neither may touch)."""
    import specjax.convert
    import specjax.demo
    from specjax.train import run, setup

    calls = []

    def recording(module, name, stage=None, fake=None):
        real = getattr(module, name)

        def wrapper(*a, **k):
            calls.append(stage or name)
            return fake(*a, **k) if fake else real(*a, **k)
        monkeypatch.setattr(module, name, wrapper)

    real_holding = run_lock.holding

    def holding(out):
        calls.append("lock")
        return real_holding(out)
    monkeypatch.setattr(run.run_lock, "holding", holding)
    recording(run, "preflight")
    recording(specjax.demo, "ensure_demo_target", fake=lambda path, **k: str(path))
    recording(specjax.convert, "ensure_target_folder", fake=lambda path, gguf: path)
    recording(run, "run_regenerate_stage")
    recording(run, "load_prepared_target")
    recording(setup, "build_tokenizer", "tokenizer load")  # preflight's
    recording(run, "build_tokenizer", "tokenizer load")  # the one after a target build that wrote it
    recording(run, "prepare_examples")
    recording(run, "build_vocab")
    recording(run, "build_run_setup")
    recording(run._Resume, "restore", "restore")
    return calls


def test_each_stage_runs_once_in_order(tiny_target, tmp_path, stages):
    from specjax.train.run import build_run

    out = tmp_path / "run"
    cfg = _cfg(tiny_target, out, "target.build_demo=true", "target.gguf=unused.gguf", "train.epochs=2")
    with build_run(cfg) as run:
        # the tokenizer is on disk: preflight loads it, and the tokenizer stage reuses it
        assert stages == ["lock", "preflight", "tokenizer load", "ensure_demo_target", "ensure_target_folder",
                          "run_regenerate_stage", "load_prepared_target", "prepare_examples", "build_vocab",
                          "build_run_setup", "restore"]
        # train.epochs became train.steps once, before the set-up: one final config everywhere
        assert run.cfg.train.epochs == 2 and run.cfg.train.steps != cfg.train.steps
        assert run.setup.cfg is run.cfg
        assert run.identity["config"] == config_to_dict(run.cfg)
        with open(out / "run_meta.json") as f:
            assert json.load(f)["config"]["train"]["steps"] == run.cfg.train.steps
        assert run.start_step == 0 and run.decode_eval is None and len(run.tokenizer) <= run.target.config.vocab_size
        assert _locked_elsewhere(out)  # held until the Run is closed
    assert not _locked_elsewhere(out)


def test_tokenizer_written_by_the_target_build_is_loaded_once(tiny_target, tmp_path, stages, monkeypatch):
    """Preflight finds no tokenizer on disk (a demo or GGUF target writes it): it is loaded once,
    after the target folder is ready."""
    from specjax.train import run, setup

    real, calls = setup.tokenizer_files, []

    def absent_at_preflight(folder):  # the first look (preflight) finds none, as before a demo build
        calls.append(folder)
        return [] if len(calls) == 1 else real(folder)

    monkeypatch.setattr(setup, "tokenizer_files", absent_at_preflight)
    with run.build_run(_cfg(tiny_target, tmp_path / "run", "target.build_demo=true")):
        pass
    assert stages.count("tokenizer load") == 1 and stages.count("preflight") == 1
    assert stages.index("tokenizer load") > stages.index("load_prepared_target")


def test_a_failing_stage_releases_the_lock(tiny_target, tmp_path):
    from specjax.train.run import build_run

    out = tmp_path / "run"
    with pytest.raises(ValueError, match="data.train_files is empty"):
        build_run(_cfg(tiny_target, out, "data.train_files=[]"))
    assert not _locked_elsewhere(out)


# ---- the launcher ------------------------------------------------------------------------------
@pytest.fixture
def no_setup(monkeypatch):
    """Every set-up entry point refuses: the launcher must leave them to train()."""
    import specjax.convert
    from specjax.train import loop, run, setup  # noqa: F401 - loop binds build_run at import: import it unpatched

    def refuse(*a, **k):
        raise AssertionError("the launcher did set-up work itself")

    for module, name in ((run, "build_run"), (run, "preflight"), (setup, "preflight"), (setup, "build_tokenizer"),
                         (specjax.convert, "ensure_target_folder"), (run, "run_regenerate_stage"),
                         (run_lock, "holding")):
        monkeypatch.setattr(module, name, refuse)


def test_launch_hands_the_config_to_train_and_prints_the_summary(tmp_path, repo_root, monkeypatch, no_setup,
                                                                 capsys):
    from specjax import launch
    from specjax.train import loop

    seen = []

    def fake_train(cfg):
        seen.append(cfg)
        return loop.RunResult(output_dir=str(tmp_path), final_step=3, first_metrics={"loss": 2.0, "acc_0": 0.1},
                              last_metrics={"loss": 1.0, "acc_0": 0.5}, val_metrics={"loss": 1.5, "lr": 1.0},
                              export_dir=str(tmp_path / "export"), wall_time_s=1.23)
    monkeypatch.setattr(loop, "train", fake_train)
    rc = launch.main(["--config", os.path.join(repo_root, "configs", "demo_cpu.yaml"),
                      f"run.output_dir={tmp_path}", "train.steps=3"])
    assert rc == 0 and len(seen) == 1 and seen[0].train.steps == 3 and seen[0].run.output_dir == str(tmp_path)
    summary = json.loads(capsys.readouterr().out)
    assert summary == {"output_dir": str(tmp_path), "steps": 3, "wall_time_s": 1.2,
                       "first": {"loss": 2.0, "acc_0": 0.1}, "last": {"loss": 1.0, "acc_0": 0.5},
                       "val": {"loss": 1.5}, "export_dir": str(tmp_path / "export")}


def test_launch_reports_a_known_problem_in_one_line(tmp_path, repo_root, monkeypatch, no_setup, capsys):
    from specjax import launch
    from specjax.train import loop

    def fake_train(cfg):
        raise ValueError("data.train_files is empty: give one or more JSONL/JSON/parquet chat files.")
    monkeypatch.setattr(loop, "train", fake_train)
    rc = launch.main(["--config", os.path.join(repo_root, "configs", "demo_cpu.yaml"), f"run.output_dir={tmp_path}"])
    assert rc == 1
    assert capsys.readouterr().err == "error: data.train_files is empty: give one or more JSONL/JSON/parquet chat files.\n"


def test_launch_compile_only_and_print_config_do_not_train(tmp_path, repo_root, monkeypatch, no_setup, capsys):
    from specjax import launch
    from specjax.train import aot, loop

    def refuse(cfg):
        raise AssertionError("trained")
    monkeypatch.setattr(loop, "train", refuse)
    monkeypatch.setattr(aot, "compile_step", lambda cfg, **k: {"cfg": cfg, **k})
    monkeypatch.setattr(aot, "format_report", lambda report: f"report {sorted(report)}")
    config = os.path.join(repo_root, "configs", "demo_cpu.yaml")
    assert launch.main(["--config", config, "--compile-only"]) == 0
    assert capsys.readouterr().out == "report ['cfg', 'n_devices', 'platform', 'tpu_chip']\n"
    assert launch.main(["--config", config, "--print-config", "train.steps=7"]) == 0
    assert json.loads(capsys.readouterr().out)["train"]["steps"] == 7


def test_stop_signal_paused_gives_the_previous_handling_back_for_the_block():
    """The regeneration stage runs with the handling from before the run (a signal there ends the
    process; a rerun resumes it); the run's handler is back after it."""
    import signal

    from specjax.train.signals import StopSignal

    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignal()
    with stop.paused():  # not installed: nothing to give back
        assert signal.getsignal(signal.SIGTERM) == before
    with stop.installed():
        assert signal.getsignal(signal.SIGTERM) != before
        with stop.paused():
            assert signal.getsignal(signal.SIGTERM) == before
        assert signal.getsignal(signal.SIGTERM) != before
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested
    assert signal.getsignal(signal.SIGTERM) == before

"""A run must survive SIGTERM (clean stop + checkpoint) and SIGKILL at any moment (including during a
checkpoint save) and end exactly where an uninterrupted run ends."""
import random
import signal
import time

import numpy as np
import pytest

from specjax.train.metrics import last_per_step, read_metrics

from _runs import assert_same_tensors, exported_tensors, launch, run, wait_for_rows, write_config


@pytest.fixture(scope="module")
def reference_run(tiny_target, tmp_path_factory, repo_root):
    out = tmp_path_factory.mktemp("ref") / "run"
    cfg = write_config(out.parent / "cfg.yaml", tiny_target, out)
    rc, log = run(cfg, repo_root)
    assert rc == 0, log
    return str(out)


def test_sigterm_saves_and_resumes_to_the_same_trajectory(reference_run, tiny_target, tmp_path, repo_root):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "cfg.yaml", tiny_target, out)
    p = launch(cfg, repo_root)
    assert wait_for_rows(str(out), 7, p), "the run ended before it could be interrupted"
    p.send_signal(signal.SIGTERM)
    log, _ = p.communicate(timeout=120)
    assert p.returncode == 0, log
    assert "stopped at step" in log and "run the same command again to resume" in log
    stopped = max(r["step"] for r in read_metrics(str(out)))
    assert 7 <= stopped < 24
    rc, log2 = run(cfg, repo_root)
    assert rc == 0, log2
    got, want = last_per_step(read_metrics(str(out))), last_per_step(read_metrics(reference_run))
    assert sorted(got) == sorted(want) == list(range(1, 25))
    for step in want:
        np.testing.assert_allclose(got[step]["loss"], want[step]["loss"], rtol=1e-6, err_msg=f"step {step}")
    assert_same_tensors(exported_tensors(str(out)), exported_tensors(reference_run), atol=1e-6)


# ten kills under -m slow; four in the default run exercise the same kill points (start-up, restore,
# mid-step, mid-save) at a third of the time
@pytest.mark.parametrize("n_kills", [4, pytest.param(10, marks=pytest.mark.slow)])
def test_sigkill_repeatedly_then_finish_equals_uninterrupted(reference_run, tiny_target, tmp_path, repo_root,
                                                             n_kills):
    out = tmp_path / "run"
    # checkpoint every 2 steps so that many kills land inside a save
    cfg = write_config(tmp_path / "cfg.yaml", tiny_target, out, checkpoint={"every_steps": 2, "keep": 2})
    rng = random.Random(1234)
    kills, attempts = 0, 0
    while kills < n_kills and attempts < 25:
        attempts += 1
        p = launch(cfg, repo_root)
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0.5, 6.0))  # somewhere in start-up, restore or the first steps
        else:
            done = len(read_metrics(str(out)))
            if not wait_for_rows(str(out), done + 1, p):
                continue  # it finished first; the final run below covers the rest
            time.sleep(rng.uniform(0.0, 0.4))  # mid-step or mid-save (saves every 2 steps)
        if p.poll() is None:
            p.kill()
            kills += 1
        p.communicate(timeout=60)
    assert kills == n_kills
    rc, log = run(cfg, repo_root)
    assert rc == 0, log
    assert_same_tensors(exported_tensors(str(out)), exported_tensors(reference_run), atol=1e-6)
    got, want = last_per_step(read_metrics(str(out))), last_per_step(read_metrics(reference_run))
    for step in want:
        np.testing.assert_allclose(got[step]["loss"], want[step]["loss"], rtol=1e-6, err_msg=f"step {step}")

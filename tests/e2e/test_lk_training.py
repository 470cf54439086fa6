"""train.loss end to end: an LK loss trains the tiny target's draft through the real loop (8 fake
devices, fp32), logs its per-step objective, soft CE and expected acceptance, and lowers the loss;
a loss name the config does not know is refused by load_config, naming the choices.

One loss runs here (lk_lambda: the full-vocab logsumexp, the CE blend and the explicit-logits step
path); every loss's value and gradients are checked against its reference in
tests/unit/test_lk_losses.py, through the same TTT code (CI time: each loop run costs ~1 min)."""
import math
import sys
import os

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402

from specjax.train.metrics import read_metrics  # noqa: E402


@pytest.mark.parametrize("loss", ["lk_lambda"])
def test_each_lk_loss_trains(tiny_target, tmp_path, loss):
    from specjax.train.loop import train

    out = tmp_path / loss
    train(inprocess_config(tiny_target, out, f"train.loss={loss}", "train.steps=12", "optim.lr=3e-3",
                           "optim.warmup_ratio=0.0"))
    rows = read_metrics(str(out))
    assert len(rows) == 12
    for r in rows:
        for key in ("loss", "loss_0", "soft_ce_0", "lk_acceptance_0", "lk_acceptance_1"):
            assert math.isfinite(r[key]), (key, r)
        assert 0.0 <= r["lk_acceptance_0"] <= 1.0
    first, last = sum(r["loss"] for r in rows[:3]) / 3, sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first, (loss, first, last)


def test_unknown_loss_is_refused_by_the_config(tiny_target, tmp_path):
    with pytest.raises(ValueError, match=r"train\.loss.*lk_alpha"):
        inprocess_config(tiny_target, tmp_path, "train.loss=lk")

"""benchmarks/tau_by_turn.py on a made-up specjax.eval results file whose τ per group is known."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import tau_by_turn  # noqa: E402


def _turn(accept_lengths):
    return {"spec": {"new_tokens": sum(accept_lengths), "num_steps": len(accept_lengths),
                     "accept_lengths": accept_lengths}}


def test_groups(tmp_path):
    res = {"prompts": [
        {"category": "math", "turns": [_turn([1, 1, 3, 3]), _turn([4, 4])]},
        {"category": "code", "turns": [_turn([2, 2, 2])]},
    ]}
    path = tmp_path / "r.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(res, f)
    g = tau_by_turn.tau_by_turn(tau_by_turn._load(str(path)), first=4)
    assert g["all"] == {"tokens": 22, "steps": 9, "tau": 22 / 9}
    assert g["turn 1"]["tau"] == 14 / 7 and g["turn 2"]["tau"] == 4.0
    assert g["category math"]["tau"] == 16 / 6 and g["category code"]["tau"] == 2.0
    # first 4 tokens: [1, 1, 3] (the step crossing 4 counts whole) and [2, 2]; turn 2: [4]
    assert g["turn 1, first 4 tokens"] == {"tokens": 9, "steps": 5, "tau": 9 / 5}
    assert g["turn 2, first 4 tokens"] == {"tokens": 4, "steps": 1, "tau": 4.0}


def test_not_a_results_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{}")
    with pytest.raises(SystemExit, match="not a specjax.eval results file"):
        tau_by_turn._load(str(path))

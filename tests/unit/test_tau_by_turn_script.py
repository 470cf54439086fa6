"""benchmarks/tau_by_turn.py on a made-up specjax.eval results file whose τ per group is known by hand
(τ = 1 + accepted drafts / steps, as specjax.eval reports it)."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import tau_by_turn  # noqa: E402

from specjax.eval.report import RESULTS_FORMAT, RESULTS_VERSION  # noqa: E402

K = 3


def _turn(accept_lengths, cut_last=0):
    """A turn whose steps emitted `accept_lengths` tokens (accepted drafts + 1); with cut_last, the
    last step accepted that many drafts more than it emitted (an EOS inside the accepted drafts)."""
    accepted = [a - 1 for a in accept_lengths]
    accepted[-1] += cut_last
    per_position = [sum(1 for x in accepted if x > i) for i in range(K)]
    return {"spec": {"new_tokens": sum(accept_lengths), "num_steps": len(accept_lengths),
                     "accept_lengths": accept_lengths, "accepted_per_position": per_position,
                     "wall_s": 1.0, "draft_time_s": 0.0, "target_time_s": 0.0}, "greedy": None, "match": None}


def _write(tmp_path, prompts, version=RESULTS_VERSION):
    path = tmp_path / "r.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"format": RESULTS_FORMAT, "format_version": version, "prompts": prompts}, f)
    return str(path)


def test_groups(tmp_path):
    prompts = [{"category": "math", "turns": [_turn([1, 1, 3, 3]), _turn([4, 4])]},
               {"category": "code", "turns": [_turn([2, 2, 1], cut_last=2)]}]
    g = tau_by_turn.tau_by_turn(tau_by_turn._load(_write(tmp_path, prompts)), first=4)
    # accepted drafts: 0+0+2+2, 3+3, 1+1+2 (the cut step accepted 2, emitted 1)
    assert g["all"]["steps"] == 9 and g["all"]["tau"] == pytest.approx(1 + 14 / 9)
    assert g["all"]["tokens_per_step"] == pytest.approx(21 / 9)
    assert g["turn 1"]["tau"] == pytest.approx(1 + 8 / 7) and g["turn 2"]["tau"] == pytest.approx(4.0)
    assert g["category math"]["tau"] == pytest.approx(1 + 10 / 6) and g["category code"]["tau"] == pytest.approx(1 + 4 / 3)
    # first 4 tokens: [1, 1, 3] (the step crossing 4 counts whole) and [2, 2]; turn 2: [4]
    assert g["turn 1, first 4 tokens"] == {"steps": 5, "tokens_per_step": 9 / 5}
    assert g["turn 2, first 4 tokens"] == {"steps": 1, "tokens_per_step": 4.0}


def test_not_a_results_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"prompts": []}))
    with pytest.raises(SystemExit, match="not a specjax.eval results file"):
        tau_by_turn._load(str(path))
    with pytest.raises(SystemExit, match="results format version 1"):
        tau_by_turn._load(_write(tmp_path, [], version=1))

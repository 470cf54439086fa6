"""Templating + tokenizing in worker processes (`data.prepare_workers`): the same Prepared as in-process.

The reference is the in-process path (`workers=0`), which the rest of the data tests check against
the chat template's own rendering. Workers must give the same examples (ids, masks, file:N), the same
skips in the same order, the same train/val split, and must stop the run on an environment problem
raised in a worker, as the in-process path does.
"""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from _tok import CHATML, build_tokenizer
from specjax.config import DataConfig
from specjax.data import prepare_examples
from specjax.data import pipeline
from specjax.data.chat import ChatTemplateLimitExceeded, TemplateLimits


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def conv(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def _rows(n: int, seed: int = 0) -> list:
    """Good multi-turn rows of random lengths with bad rows of every kind the readers and the
    tokenizer path skip, spread over more than two worker chunks."""
    rng = random.Random(seed)
    words = "the a cat dog sat ran on under table chair quickly slowly and but".split()
    out = []
    for i in range(n):
        k = i % 50
        if k == 7:
            out.append("{not json")  # reader error
        elif k == 13:
            out.append(conv(("user", "only a question")))  # no assistant turn
        elif k == 21:
            out.append(conv(("user", "q"), ("assistant", "   ")))  # empty assistant content
        elif k == 33:
            out.append(conv(("user", " ".join(rng.choices(words, k=400))), ("assistant", "short")))  # truncated away
        else:
            turns = []
            for _ in range(rng.randint(1, 3)):
                turns += [("user", " ".join(rng.choices(words, k=rng.randint(3, 30)))),
                          ("assistant", " ".join(rng.choices(words, k=rng.randint(3, 40))))]
            out.append(conv(*turns))
    return out


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _same(a, b):
    assert (a.n_rows, a.skipped, a.skips) == (b.n_rows, b.skipped, b.skips)
    for xs, ys in ((a.train, b.train), (a.val, b.val)):
        assert len(xs) == len(ys)
        for x, y in zip(xs, ys):
            assert (x.source, x.row) == (y.source, y.row)
            np.testing.assert_array_equal(x.input_ids, y.input_ids)
            np.testing.assert_array_equal(x.loss_mask, y.loss_mask)


def test_workers_give_the_same_examples_skips_and_split(tmp_path, tok):
    n = 2 * pipeline._CHUNK_ROWS + 77  # three chunks, the last one partial
    a = _write(tmp_path / "a.jsonl", _rows(n, seed=1))
    b = _write(tmp_path / "b.jsonl", _rows(40, seed=2))
    here = prepare_examples([a, b], tok, 96, 0.1, 3)
    there = prepare_examples([a, b], tok, 96, 0.1, 3, workers=2, inline_s=0)
    assert here.skipped.keys() >= {"no assistant turn", "empty assistant content", "no assistant token after truncation"}
    assert len(here.val) > 0 and len(here.train) > n // 2
    _same(here, there)
    # max_rows stops reading at the same row on both paths
    _same(prepare_examples([a, b], tok, 96, 0.1, 3, max_rows=300),
          prepare_examples([a, b], tok, 96, 0.1, 3, max_rows=300, workers=2, inline_s=0))


def test_data_done_within_the_inline_window_starts_no_workers(tmp_path, tok, monkeypatch):
    p = _write(tmp_path / "s.jsonl", _rows(30))

    def no_pool(*a, **k):
        raise AssertionError("a process pool was started for 30 rows")

    import concurrent.futures
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", no_pool)
    prep = prepare_examples([p], tok, 96, 0.0, 0, workers=4)  # done before the 5 s in-process window ends
    assert prep.n_rows == 30 and len(prep.train) > 20


def test_worker_start_arguments_fit_a_pipe(tmp_path, tok, monkeypatch):
    """A spawned worker's start writes its arguments into the worker's pipe and blocks until the worker
    has read them, which it does while importing specjax and transformers. So the arguments must fit
    a pipe's buffer (64 KiB on Linux): a transformers tokenizer travels as a saved folder, not as an
    argument. Else the workers start one after another (2.6 s each here; 111 s of data preparation with
    16 on the H200). Other tokenizer objects still travel as an argument (the next test's `_Wrapped`)."""
    import concurrent.futures
    import pickle

    seen = []
    real = concurrent.futures.ProcessPoolExecutor

    def spy(*a, **k):
        seen.append(k["initargs"])
        return real(*a, **k)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", spy)
    p = _write(tmp_path / "s.jsonl", _rows(pipeline._CHUNK_ROWS + 10))
    _same(prepare_examples([p], tok, 96, 0.1, 0), prepare_examples([p], tok, 96, 0.1, 0, workers=2, inline_s=0))
    assert len(seen) == 1
    assert isinstance(seen[0][0], str) and not any(x is tok for x in seen[0])  # SmolLM2's pickles to 1.6 MB
    assert len(pickle.dumps(seen[0])) < 16 * 1024


class _Wrapped:
    """A tokenizer that is not a transformers object, so it travels to the workers as a start argument
    (not as a saved folder). Picklable (module level)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "inner":  # unpickling looks it up before it is set
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __len__(self):
        return len(self.inner)

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


# renders ChatML, but its rendering of a row that mentions POISON builds a string past the
# data.max_template_chars limit set below (small, so a regression cannot take much memory), which
# stops the run: a template problem, not a row's
_POISONED_TEMPLATE = CHATML + "{% for m in messages %}{% if 'POISON' in m['content'] %}{{ 'x' * 5000 }}{% endif %}{% endfor %}"
_SMALL = TemplateLimits(max_chars=4000)


def test_an_environment_problem_in_a_worker_stops_the_run(tmp_path, tok):
    """A chat template past a rendering limit first shows in a worker's chunk: the run stops with the
    same error as in-process, naming the limit and the row (not a counted skip, not a hang)."""
    rows = _rows(2 * pipeline._CHUNK_ROWS)
    rows[pipeline._CHUNK_ROWS + 5] = conv(("user", "POISON here"), ("assistant", "fine"))
    p = _write(tmp_path / "e.jsonl", rows)
    where = f"{p}:{pipeline._CHUNK_ROWS + 6}"
    with pytest.raises(ChatTemplateLimitExceeded, match=rf"data\.max_template_chars.*first met rendering {where}"):
        prepare_examples([p], tok, 96, 0.0, 0, chat_template=_POISONED_TEMPLATE, template_limits=_SMALL)  # in-process
    with pytest.raises(ChatTemplateLimitExceeded, match=rf"data\.max_template_chars.*first met rendering {where}"):
        prepare_examples([p], _Wrapped(tok), 96, 0.0, 0, chat_template=_POISONED_TEMPLATE, template_limits=_SMALL,
                         workers=2, inline_s=0)


def test_config_prepare_workers():
    assert DataConfig(prepare_workers=3).prepare_processes() == 3
    assert DataConfig(prepare_workers=0).prepare_processes() == 0
    assert 1 <= DataConfig().prepare_processes() <= 16
    with pytest.raises(ValueError, match="prepare_workers"):
        DataConfig(prepare_workers=-1)


def test_prepare_speed_script_runs_both_arms_on_the_same_rows(tmp_path, tok):
    """benchmarks/prepare_speed.py: each arm is a real prepare_examples call; the workers arm (made to
    use its workers from the first row) must report the same examples as the in-process one."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    import prepare_speed

    tok.save_pretrained(tmp_path / "tok")
    data = _write(tmp_path / "d.jsonl", _rows(300))
    out = tmp_path / "r.json"
    assert prepare_speed.main(["--tokenizer", str(tmp_path / "tok"), "--data", str(data), "--workers", "0,2",
                               "--seq-length", "96", "--inline-s", "0", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert [a["workers"] for a in r["arms"]] == [0, 2]
    assert r["arms"][0]["rows"] == r["arms"][1]["rows"] == 300
    assert r["arms"][1]["same_as_first_arm"] is True
    assert r["arms"][0]["examples"] == r["arms"][1]["examples"] > 200

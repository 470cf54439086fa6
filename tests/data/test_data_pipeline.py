"""specjax.data: sources, chat templating + loss masks, split, packing, resume."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from _tok import CHATML_WITH_TRAILER, build_tokenizer
from specjax.data import (
    Example,
    SkipRow,
    make_eval_batches,
    make_train_iterator,
    prepare_examples,
    read_conversations,
    tokenize_conversation,
)
from specjax.data.pipeline import _packed_rows

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def conv(*turns):
    """conv(("user", "hi"), ("assistant", "hello")) -> messages list."""
    return [{"role": r, "content": c} for r, c in turns]


def masked_runs(tokenizer, ex):
    """Decoded text of each contiguous run of loss-masked tokens."""
    runs, cur = [], []
    for t, m in zip(ex.input_ids.tolist(), ex.loss_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tokenizer.decode(r) for r in runs]


# ----------------------------------------------------------------------------- chat / loss mask

def test_single_turn_mask_is_content_plus_end_of_turn(tok):
    msgs = conv(("user", "Hello there!"), ("assistant", "I am fine, thank you."))
    ex = tokenize_conversation(tok, msgs, 128)
    assert ex.input_ids.dtype == np.int32 and ex.loss_mask.dtype == np.int32
    assert ex.input_ids.shape == ex.loss_mask.shape
    # The whole text is the template rendering, tokenized without extra special tokens.
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert masked_runs(tok, ex) == ["I am fine, thank you." + END]


def test_multi_turn_with_system_and_unicode(tok):
    msgs = conv(
        ("system", "You are a helpful assistant."),
        ("user", "Hello there!"),
        ("assistant", "I am fine, thank you."),
        ("user", "Tell me a story"),
        ("assistant", "Once upon a time, a cat 🐱 and a dog."),
    )
    ex = tokenize_conversation(tok, msgs, 256)
    assert masked_runs(tok, ex) == ["I am fine, thank you." + END, "Once upon a time, a cat 🐱 and a dog." + END]
    # Nothing of the system / user turns or role headers is masked.
    assert "system" not in "".join(masked_runs(tok, ex))


def test_fallback_when_prefix_property_breaks():
    # The trailer after the last message makes prefix renderings differ from the full text.
    t = build_tokenizer(CHATML_WITH_TRAILER)
    msgs = conv(("user", "Hello"), ("assistant", "I am fine."), ("user", "And?"), ("assistant", "Thank you."))
    ex = tokenize_conversation(t, msgs, 256)
    assert t.decode(ex.input_ids).endswith("<|endoftext|>")
    assert masked_runs(t, ex) == ["I am fine." + END, "Thank you." + END]


def test_template_that_trims_content_and_uses_another_marker():
    tmpl = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n\n' + (m['content'] | trim) + '<|endoftext|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n\n' }}{% endif %}"
    )
    t = build_tokenizer(None)
    msgs = conv(("user", "Hello"), ("assistant", "  I am fine.  "))
    ex = tokenize_conversation(t, msgs, 128, chat_template=tmpl)  # explicit template argument
    assert masked_runs(t, ex) == ["I am fine.<|endoftext|>"]


def test_no_chat_template_is_a_config_error_not_a_skip(tmp_path):
    t = build_tokenizer(None)
    msgs = conv(("user", "Hello"), ("assistant", "Hi"))
    with pytest.raises(ValueError, match="data.chat_template"):
        tokenize_conversation(t, msgs, 64)
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"messages": msgs}) + "\n")
    with pytest.raises(ValueError, match="data.chat_template"):
        prepare_examples([p], t, 64, 0.0, 0)


@pytest.mark.parametrize(
    "msgs, reason",
    [
        (conv(("user", "Hello")), "no assistant turn"),
        (conv(("system", "x"), ("user", "Hello")), "no assistant turn"),
        (conv(("user", "Hello"), ("assistant", "   ")), "empty assistant content"),
    ],
)
def test_skip_reasons(tok, msgs, reason):
    with pytest.raises(SkipRow) as e:
        tokenize_conversation(tok, msgs, 64)
    assert e.value.reason == reason


def test_truncation_vs_drop(tok):
    long_answer = " ".join(["The quick brown fox jumps over the lazy dog."] * 10)
    msgs = conv(("user", "Tell me a story"), ("assistant", long_answer))
    full = tokenize_conversation(tok, msgs, 4096)
    n = len(full)
    assert n > 40
    ex = tokenize_conversation(tok, msgs, 40, truncate=True)
    assert len(ex) == 40
    np.testing.assert_array_equal(ex.input_ids, full.input_ids[:40])
    np.testing.assert_array_equal(ex.loss_mask, full.loss_mask[:40])
    with pytest.raises(SkipRow) as e:
        tokenize_conversation(tok, msgs, 40, truncate=False)
    assert e.value.reason == "longer than seq_length"
    # Exactly fitting is not "longer".
    assert len(tokenize_conversation(tok, msgs, n, truncate=False)) == n
    # The assistant turn starts after the cut: nothing left to train on.
    long_user = conv(("user", long_answer), ("assistant", "Hi"))
    with pytest.raises(SkipRow) as e:
        tokenize_conversation(tok, long_user, 20, truncate=True)
    assert e.value.reason == "no assistant token after truncation"


def test_rows_longer_than_the_tokenizers_max_length_are_quiet(tok, caplog):
    """specjax truncates to data.seq_length itself, so transformers' "Token indices sequence length is
    longer than the specified maximum" warning (once per tokenizer copy, i.e. once per data worker)
    says nothing useful; the ids are the same without it."""
    import copy
    import logging

    msgs = conv(("user", "Tell me a story"), ("assistant", " ".join(["The quick brown fox."] * 40)))
    small = copy.deepcopy(tok)
    small.model_max_length = 16
    with caplog.at_level(logging.WARNING):
        ex = tokenize_conversation(small, msgs, 4096)
    assert len(ex) > 16
    assert not [r for r in caplog.records if "sequence length is longer" in r.getMessage()], caplog.text
    np.testing.assert_array_equal(ex.input_ids, tokenize_conversation(tok, msgs, 4096).input_ids)
    # the warning does fire for a plain call, so the check above can fail
    with caplog.at_level(logging.WARNING):
        copy.deepcopy(small)("x " * 40)
    assert [r for r in caplog.records if "sequence length is longer" in r.getMessage()], caplog.text

# ----------------------------------------------------------------------------- sources

def _write_lines(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")


GOOD = {"messages": conv(("user", "Hello there!"), ("assistant", "I am fine, thank you."))}
SHAREGPT = {
    "id": "x",
    "conversations": [
        {"from": "system", "value": "You are a helpful assistant."},
        {"from": "human", "value": "Tell me a story"},
        {"from": "gpt", "value": "Once upon a time."},
    ],
}


def _bad_file(tmp_path):
    p = tmp_path / "mixed.jsonl"
    lines = [
        json.dumps(GOOD).encode(),                                                     # 1 ok
        json.dumps(SHAREGPT).encode(),                                                 # 2 ok (ShareGPT)
        b'{"messages": [',                                                             # 3 malformed JSON
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',                     # 4 invalid UTF-8
        json.dumps({"text": "no chat here"}).encode(),                                 # 5 no messages
        json.dumps({"messages": conv(("user", "a"), ("robot", "b"))}).encode(),        # 6 unknown role
        json.dumps({"messages": [{"role": "user", "content": ["a", "b"]}]}).encode(),  # 7 non-string content
        b"",                                                                           # 8 blank: not a row
        json.dumps({"messages": conv(("user", "only a question"))}).encode(),          # 9 no assistant turn
        json.dumps({"messages": conv(("user", "q"), ("assistant", ""))}).encode(),     # 10 empty answer
    ]
    _write_lines(p, lines)
    return p


def test_read_conversations_rows_and_errors(tmp_path):
    p = _bad_file(tmp_path)
    rows = list(read_conversations([p]))
    assert [r.index for r in rows] == [0, 1, 2, 3, 4, 5, 6, 8, 9]
    assert rows[0].messages == GOOD["messages"] and rows[0].error is None
    assert rows[1].messages == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": "Once upon a time."},
    ]
    expected = {3: "malformed JSON", 4: "invalid UTF-8", 5: "no messages", 6: "unknown role", 7: "non-string content"}
    for r in rows:
        line = r.index + 1
        if line in expected:
            assert r.messages is None
            assert isinstance(r.error, str)
            assert f"{p}:{line}" in r.error, r.error
            assert expected[line] in r.error
            assert r.error.kind == expected[line]
        else:
            assert r.error is None and r.source == str(p)


def test_json_list_file_and_missing_file(tmp_path):
    p = tmp_path / "rows.json"
    p.write_text(json.dumps([GOOD, {"conversations": [{"from": "alien", "value": "x"}]}, SHAREGPT]))
    rows = list(read_conversations(str(p)))
    assert [r.error is None for r in rows] == [True, False, True]
    assert f"{p}:2: unknown role" in rows[1].error  # file:N, N from 1 (the second element)
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_conversations([p, missing])  # raised at call time, before any row
    csv = tmp_path / "rows.csv"
    csv.write_text("x")
    with pytest.raises(ValueError, match="unsupported"):
        read_conversations([csv])


def test_parquet(tmp_path):
    p = tmp_path / "rows.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        p.write_bytes(b"PAR1")
        with pytest.raises(ImportError, match="pip install pyarrow"):
            list(read_conversations([p]))
        return
    pq.write_table(pa.Table.from_pylist([GOOD, GOOD]), p)
    rows = list(read_conversations([p]))
    assert [r.messages for r in rows] == [GOOD["messages"]] * 2


# ----------------------------------------------------------------------------- prepare_examples

def test_prepare_examples_counts_skips(tmp_path, tok):
    p = _bad_file(tmp_path)
    prep = prepare_examples([p], tok, 128, val_fraction=0.0, seed=0)
    assert prep.n_rows == 9
    assert len(prep.train) == 2 and prep.val == []
    assert prep.skipped == {
        "malformed JSON": 1,
        "invalid UTF-8": 1,
        "no messages": 1,
        "unknown role": 1,
        "non-string content": 1,
        "no assistant turn": 1,
        "empty assistant content": 1,
    }
    assert any(f"{p}:3" in m for m in prep.skip_messages)
    # The ShareGPT row made a proper example.
    assert masked_runs(tok, prep.train[1]) == ["Once upon a time." + END]
    # max_rows counts rows read, bad ones included.
    prep2 = prepare_examples([p], tok, 128, val_fraction=0.0, seed=0, max_rows=3)
    assert prep2.n_rows == 3 and len(prep2.train) == 2 and prep2.skipped == {"malformed JSON": 1}


def test_prepare_examples_split_deterministic(tmp_path, tok):
    p = tmp_path / "many.jsonl"
    rows = [
        {"messages": conv(("user", f"Question {i}"), ("assistant", f"Answer {i} is fine."))} for i in range(200)
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def key(prep):
        return [tuple(e.input_ids.tolist()) for e in prep.train], [tuple(e.input_ids.tolist()) for e in prep.val]

    a = prepare_examples([p], tok, 64, val_fraction=0.25, seed=1)
    b = prepare_examples([str(p)], tok, 64, val_fraction=0.25, seed=1)
    c = prepare_examples([p], tok, 64, val_fraction=0.25, seed=2)
    assert key(a) == key(b)
    assert key(a) != key(c)
    assert len(a.train) + len(a.val) == 200 and a.skipped == {}
    assert 25 <= len(a.val) <= 75


def test_split_keeps_a_regenerated_conversation_together(tmp_path, tok):
    """Regenerated rows carry `source_index`; a conversation's windows and last row share it (and
    share turns), so they go to the same side of the split. Without the column rows split one by one,
    and the windows of these 60 conversations would land on both sides."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"messages": conv(("user", f"Question {i}"), ("assistant", f"Answer {i}, part {w}.")), "source_index": i}
            for i in range(60) for w in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "shard-000000.parquet")
    prep = prepare_examples([tmp_path], tok, 64, val_fraction=0.3, seed=0)
    side = {}
    for is_val, examples in ((False, prep.train), (True, prep.val)):
        for e in examples:
            side.setdefault(rows[e.row - 1]["source_index"], set()).add(is_val)
    assert len(side) == 60 and all(len(v) == 1 for v in side.values())
    assert 5 <= sum(v == {True} for v in side.values()) <= 35
    # the same rows without the column split by row: some conversation sits on both sides
    for r in rows:
        del r["source_index"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "shard-000000.parquet")
    prep = prepare_examples([tmp_path], tok, 64, val_fraction=0.3, seed=0)
    both = {}
    for is_val, examples in ((False, prep.train), (True, prep.val)):
        for e in examples:
            both.setdefault((e.row - 1) // 3, set()).add(is_val)
    assert any(len(v) == 2 for v in both.values())


def test_prepare_examples_truncate_vs_drop(tmp_path, tok):
    long_answer = " ".join(["The quick brown fox jumps over the lazy dog."] * 10)
    p = tmp_path / "mixed_len.jsonl"
    rows = [GOOD, {"messages": conv(("user", "Tell me a story"), ("assistant", long_answer))}] * 3
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cut = prepare_examples([p], tok, 40, val_fraction=0.0, seed=0, truncate=True)
    assert len(cut.train) == 6 and cut.skipped == {} and max(len(e) for e in cut.train) == 40
    drop = prepare_examples([p], tok, 40, val_fraction=0.0, seed=0, truncate=False)
    assert len(drop.train) == 3 and drop.skipped == {"longer than seq_length": 3}


# ----------------------------------------------------------------------------- packing

def make_examples(n, max_len, seed=0):
    """Example i holds tokens i*1000+1, i*1000+2, ... so a segment identifies its example."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(1, max_len + 1))
        ids = (np.arange(1, L + 1) + 1000 * i).astype(np.int32)
        mask = (rng.random(L) < 0.7).astype(np.int32)
        out.append(Example(ids, mask))
    return out


def segments_of(batch):
    """Check the packed-row layout; return [(input_ids tuple, loss_mask tuple)] in row order."""
    for k in ("input_ids", "loss_mask", "segment_ids", "positions"):
        assert batch[k].dtype == np.int32
    segs = []
    B, T = batch["input_ids"].shape
    for r in range(B):
        seg, pos = batch["segment_ids"][r], batch["positions"][r]
        n_tok = int(np.count_nonzero(seg))
        # documents first (ids 1..n in order, contiguous), then padding (0) to the end
        assert np.all(seg[:n_tok] > 0) and np.all(seg[n_tok:] == 0)
        assert np.all(np.diff(seg[:n_tok]) >= 0)
        pad = seg == 0
        assert np.all(batch["loss_mask"][r][pad] == 0)
        assert np.all(batch["input_ids"][r][pad] == 0)
        assert np.all(pos[pad] == 0)
        if n_tok:
            assert seg[0] == 1 and set(np.unique(seg[:n_tok])) == set(range(1, int(seg[n_tok - 1]) + 1))
        for s in np.unique(seg[seg > 0]):
            idx = np.flatnonzero(seg == s)
            np.testing.assert_array_equal(pos[idx], np.arange(idx.size))  # positions reset per segment
            ids = batch["input_ids"][r][idx]
            assert len(set((ids - 1) // 1000)) == 1  # one example per segment: nothing crosses
            segs.append((tuple(ids.tolist()), tuple(batch["loss_mask"][r][idx].tolist())))
    return segs


def as_multiset(examples):
    return collections.Counter((tuple(e.input_ids.tolist()), tuple(e.loss_mask.tolist())) for e in examples)


def test_train_iterator_layout_and_shapes():
    exs = make_examples(30, 16)
    it = make_train_iterator(exs, seq_length=16, batch_size=4, seed=0)
    all_segs = set(as_multiset(exs))
    for _ in range(10):
        b = next(it)
        assert set(b) == {"input_ids", "loss_mask", "segment_ids", "positions", "example_ids"}
        assert all(v.shape == (4, 16) for v in b.values())
        for s in segments_of(b):
            assert s in all_segs
        # example_ids trace every segment back to its example (0 only on padding)
        for r in range(4):
            for seg in set(b["segment_ids"][r].tolist()) - {0}:
                cells = b["segment_ids"][r] == seg
                (eid,) = set(b["example_ids"][r][cells].tolist())
                np.testing.assert_array_equal(b["input_ids"][r][cells], exs[eid - 1].input_ids)
            assert not b["example_ids"][r][b["segment_ids"][r] == 0].any()


def test_each_example_once_per_epoch():
    exs = make_examples(50, 24, seed=1)
    rows = list(_packed_rows(exs, 32, seed=3, num_epochs=1, num_packing_bins=4))
    segs = []
    for r in rows:
        segs += segments_of({k: v[None] for k, v in r.items()})
    assert collections.Counter(segs) == as_multiset(exs)
    # Two epochs: everything exactly twice.
    rows = list(_packed_rows(exs, 32, seed=3, num_epochs=2, num_packing_bins=4))
    segs = []
    for r in rows:
        segs += segments_of({k: v[None] for k, v in r.items()})
    assert collections.Counter(segs) == collections.Counter({k: 2 * v for k, v in as_multiset(exs).items()})


def test_epochs_reshuffle_deterministically():
    # One bin of exactly one example's length: emission order == shuffled input order.
    exs = [Example(np.full(8, i + 1, np.int32), np.ones(8, np.int32)) for i in range(12)]

    def order(seed, n):
        it = make_train_iterator(exs, 8, 1, seed)
        return [int(next(it)["input_ids"][0, 0]) for _ in range(n)]

    o = order(0, 36)
    epochs = [o[0:12], o[12:24], o[24:36]]
    for e in epochs:
        assert sorted(e) == list(range(1, 13))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    assert order(0, 36) == o
    assert order(1, 36) != o


def test_host_shards_disjoint_and_covering():
    exs = make_examples(40, 12, seed=2)
    parts = []
    for h in range(3):
        segs = []
        for r in _packed_rows(exs, 16, seed=0, shard_index=h, shard_count=3, num_epochs=1):
            segs += segments_of({k: v[None] for k, v in r.items()})
        parts.append(collections.Counter(segs))
    for a in range(3):
        for b in range(a + 1, 3):
            assert not (set(parts[a]) & set(parts[b]))
    assert parts[0] + parts[1] + parts[2] == as_multiset(exs)
    # The public iterator runs on a shard too.
    b = next(make_train_iterator(exs, 16, 2, 0, shard_index=2, shard_count=3))
    assert b["input_ids"].shape == (2, 16)
    with pytest.raises(ValueError):
        make_train_iterator(exs, 16, 2, 0, shard_index=3, shard_count=3)
    with pytest.raises(ValueError, match="no example"):
        make_train_iterator(exs[:2], 16, 2, 0, shard_index=2, shard_count=3)


def test_deterministic_given_seed():
    exs = make_examples(30, 16, seed=4)
    a = make_train_iterator(exs, 16, 4, seed=7)
    b = make_train_iterator(exs, 16, 4, seed=7)
    c = make_train_iterator(exs, 16, 4, seed=8)
    ba, bb, bc = [next(a) for _ in range(8)], [next(b) for _ in range(8)], [next(c) for _ in range(8)]
    for x, y in zip(ba, bb):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert any(not np.array_equal(x["input_ids"], z["input_ids"]) for x, z in zip(ba, bc))


def test_iterator_state_resume():
    exs = make_examples(23, 20, seed=5)
    it = make_train_iterator(exs, 24, 3, seed=11)
    for _ in range(5):
        next(it)
    state = it.get_state()
    state = json.loads(json.dumps(state))  # must survive a JSON checkpoint
    expect = [next(it) for _ in range(3)]
    it2 = make_train_iterator(exs, 24, 3, seed=11)
    it2.set_state(state)
    got = [next(it2) for _ in range(3)]
    for x, y in zip(expect, got):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_too_long_example_is_an_error():
    exs = make_examples(5, 10) + [Example(np.ones(20, np.int32), np.ones(20, np.int32))]
    with pytest.raises(ValueError, match="seq_length"):
        make_train_iterator(exs, 16, 2, 0)
    with pytest.raises(ValueError, match="seq_length"):
        make_eval_batches(exs, 16, 2)


def test_eval_batches_cover_everything_once():
    exs = make_examples(37, 20, seed=6)
    batches = make_eval_batches(exs, 32, 4)
    segs = []
    for b in batches:
        assert all(v.shape == (4, 32) and v.dtype == np.int32 for v in b.values())
        segs += segments_of(b)
    assert collections.Counter(segs) == as_multiset(exs)
    assert make_eval_batches([], 32, 4) == []  # no validation split -> no eval batches
    again = make_eval_batches(exs, 32, 4)
    assert len(again) == len(batches)
    for x, y in zip(batches, again):
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])


def test_end_to_end_from_file(tmp_path, tok):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(SHAREGPT) + "\n")
    prep = prepare_examples([p], tok, 64, 0.0, 0)
    b = next(make_train_iterator(prep.train, 64, 2, 0))
    masked = b["input_ids"][b["loss_mask"] == 1]
    text = tok.decode(masked)
    assert "I am fine, thank you." + END in text and "Once upon a time." + END in text

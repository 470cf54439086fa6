"""Bad rows, round 2 (issue 20 items 6 and 7).

* Text no tokenizer can encode -- a lone surrogate (``"\\ud800"`` is valid JSON) in a JSONL or JSON
  row, a string of a parquet file that is not UTF-8 (e.g. the WTF-8 bytes of a surrogate) -- is a bad
  row: counted and located, never a crash of the whole run. NUL and other control characters are
  accepted by every tokenizer family (checked below) and stay ordinary rows.
* One location convention everywhere: ``file:N`` with N counted from 1 -- the line of a JSONL file,
  the element of a JSON list, the row of a parquet file -- in row errors, tokenization skips, the log,
  the doctor and the skip report, which lists every skipped row (``skipped_rows.jsonl``).
"""
from __future__ import annotations

import json
import logging
import os

import pytest

from _tok import build_tokenizer
from specjax import run_files
from specjax.data import SkipRow, prepare_examples, read_conversations, tokenize_conversation
from specjax.data import pipeline

SKIP_REPORT_FILE = "skipped_rows.jsonl"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def conv(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


GOOD = conv(("user", "Hello there!"), ("assistant", "I am fine, thank you."))
SURROGATE = conv(("user", "Hello there!"), ("assistant", "I am \ud800 fine."))  # json.dumps writes \ud800
SURROGATE_MSG = ("invalid Unicode (turn 1 content has an unpaired surrogate U+D800 at character offset 5, "
                 "which no tokenizer can encode)")


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- item 6: text a tokenizer refuses

def test_lone_surrogate_is_valid_json_but_a_bad_row_in_jsonl(tmp_path, tok):
    p = _jsonl(tmp_path / "s.jsonl", [GOOD, SURROGATE, GOOD])
    assert "\\ud800" in p.read_text()  # the escape, as a real dump has it: valid JSON
    prep = prepare_examples([p], tok, 128, 0.0, 0)
    assert (len(prep.train), prep.n_rows, prep.skipped) == (2, 3, {"invalid Unicode": 1})
    assert prep.skip_messages == [f"{p}:2: {SURROGATE_MSG}"]


def test_lone_surrogate_in_a_json_list(tmp_path, tok):
    p = tmp_path / "s.json"
    p.write_text(json.dumps([GOOD, GOOD, SURROGATE]))
    prep = prepare_examples([p], tok, 128, 0.0, 0)
    assert (len(prep.train), prep.skipped) == (2, {"invalid Unicode": 1})
    assert prep.skip_messages == [f"{p}:3: {SURROGATE_MSG}"]


@pytest.mark.parametrize("raw, byte, reason", [
    (b"I am \xed\xa0\x80 fine.", "0xED", "invalid continuation byte"),  # U+D800 in WTF-8 (Java's "modified UTF-8")
    (b"I am \xff fine.", "0xFF", "invalid start byte"),
])
def test_parquet_string_that_is_not_utf8_is_a_bad_row(tmp_path, tok, raw, byte, reason):
    """Arrow cannot hold a Python surrogate, but a parquet writer can store bytes that are not UTF-8 in a
    string column; decoding them used to raise out of the reader and stop the run."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    contents = [b"Hello there!", b"I am fine, thank you."] * 3
    contents[3] = raw  # row 2's answer
    content = pa.array(contents, pa.binary()).view(pa.string())
    role = pa.array(["user", "assistant"] * 3)
    turns = pa.StructArray.from_arrays([role, content], names=["role", "content"])
    messages = pa.ListArray.from_arrays(pa.array([0, 2, 4, 6], pa.int32()), turns)
    p = tmp_path / "s.parquet"
    pq.write_table(pa.table({"messages": messages}), p)
    prep = prepare_examples([p], tok, 128, 0.0, 0)
    assert (len(prep.train), prep.n_rows, prep.skipped) == (2, 3, {"invalid UTF-8": 1})
    assert prep.skip_messages == [
        f"{p}:2: invalid UTF-8 (a string holds byte {byte} at byte offset 5, which is not UTF-8: {reason})"]
    rows = list(read_conversations([p]))
    assert [r.error is None for r in rows] == [True, False, True] and rows[2].messages == GOOD["messages"]


def test_tokenize_conversation_turns_a_surrogate_into_a_skip(tok):
    """Callers that pass messages straight in (not through the readers) get a SkipRow, not the
    tokenizer's TypeError."""
    with pytest.raises(SkipRow) as e:
        tokenize_conversation(tok, SURROGATE["messages"], 128)
    assert e.value.reason == "invalid Unicode"
    assert str(e.value) == ("invalid Unicode: turn 1 content has an unpaired surrogate U+D800 at character "
                            "offset 5, which no tokenizer can encode")


def _tokenizer_families():
    """Three offline tokenizers of the other families: Unigram+Metaspace+NFKC (SentencePiece style),
    WordPiece+BertNormalizer, byte-fallback BPE (Llama style). The byte-level BPE is `tok`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["hello world the cat", "a dog ran fast", "I am fine, thank you."] * 10
    out = []
    t = Tokenizer(models.Unigram())
    t.normalizer, t.pre_tokenizer = normalizers.NFKC(), pre_tokenizers.Metaspace()
    t.train_from_iterator(corpus, trainers.UnigramTrainer(vocab_size=60, special_tokens=["<unk>"],
                                                          unk_token="<unk>", show_progress=False))
    out.append(t)
    t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.normalizer, t.pre_tokenizer = normalizers.BertNormalizer(), pre_tokenizers.BertPreTokenizer()
    t.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=60, special_tokens=["[UNK]"],
                                                            show_progress=False))
    out.append(t)
    t = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    t.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>"] + [f"<0x{i:02X}>" for i in range(256)], show_progress=False))
    out.append(t)
    return [PreTrainedTokenizerFast(tokenizer_object=t) for t in out]


ACCEPTED = ["a\x00b", "\x00", "\x01\x1b[31m\x7f", "\x85\x9f", "\ufffe\uffff", "\ufeff", "\U0010ffff",
            "\u2028\u2029", "\ue000", "\u0301"]


def test_only_unpaired_surrogates_are_refused_by_tokenizers(tok):
    """What a tokenizer refuses: of the strings Python can hold, only those with unpaired surrogates
    (they have no UTF-8 encoding). NUL, C0/C1 controls, noncharacters, BOM, U+10FFFF, line separators,
    private use and lone combining marks all tokenize in every family, so they are ordinary rows."""
    for t in [tok] + _tokenizer_families():
        for s in ACCEPTED:
            t(s, add_special_tokens=False, return_offsets_mapping=True)
        for s in ("\ud800", "\udfff", "\udc00\ud800"):
            with pytest.raises(TypeError):
                t(s, add_special_tokens=False, return_offsets_mapping=True)


def test_nul_and_control_characters_stay_ordinary_rows(tmp_path, tok):
    rows = [conv(("user", f"q {s}"), ("assistant", f"a {s} fine.")) for s in ACCEPTED]
    p = _jsonl(tmp_path / "ctl.jsonl", rows)
    prep = prepare_examples([p], tok, 128, 0.0, 0)
    assert (len(prep.train), prep.skipped) == (len(ACCEPTED), {})


# ----------------------------------------------------------------------------- item 7: one location convention

def test_one_location_convention_for_row_errors_and_tokenization_skips(tmp_path, tok):
    """JSONL: the line (blank lines count); JSON list and parquet: the row, from 1. A tokenization
    skip ("no assistant turn") used to say file[i] with i from 0."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    no_answer = conv(("user", "only a question"))
    jl = _jsonl(tmp_path / "a.jsonl", [GOOD, "", no_answer, "{broken"])  # line 2 is blank
    js = tmp_path / "b.json"
    js.write_text(json.dumps([GOOD, no_answer, conv(("robot", "x"))]))
    pqf = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, GOOD, no_answer]), pqf)
    prep = prepare_examples([jl, js, pqf], tok, 128, 0.0, 0)
    assert prep.skip_messages == [
        f"{jl}:3: no assistant turn",
        f"{jl}:4: malformed JSON (Expecting property name enclosed in double quotes at column 2)",
        f"{js}:2: no assistant turn",
        f"{js}:3: unknown role (turn 0 has role 'robot')",
        f"{pqf}:3: no assistant turn",
    ]
    # the examples kept carry the same N (the training loop names a bad batch's rows as source:row)
    assert sorted((e.source, e.row) for e in prep.train) == [(str(jl), 1), (str(js), 1), (str(pqf), 1), (str(pqf), 2)]
    assert [(s.file, s.row) for s in prep.skips] == [(str(jl), 3), (str(jl), 4), (str(js), 2), (str(js), 3),
                                                     (str(pqf), 3)]


def test_json_file_level_problems_have_no_row_number(tmp_path, tok):
    empty = tmp_path / "empty.json"
    empty.write_text("  \n")
    notlist = tmp_path / "obj.json"
    notlist.write_text('{"a": 1}')
    broken = tmp_path / "broken.json"
    broken.write_text('{"messages": \n [}')
    good = _jsonl(tmp_path / "g.jsonl", [GOOD])
    prep = prepare_examples([empty, notlist, broken, good], tok, 128, 0.0, 0)
    assert prep.skip_messages == [
        f"{empty}: no messages (the file is empty)",
        f"{notlist}: no messages (a .json file must hold a list of rows)",
        f"{broken}: malformed JSON (Expecting value at line 2 column 3; the whole file is unreadable)",
    ]
    assert [s.row for s in prep.skips] == [None, None, None]


def test_truncated_and_malformed_json_lists_name_the_row(tmp_path, tok):
    cut = tmp_path / "cut.json"
    cut.write_text("[" + json.dumps(GOOD) + ", " + json.dumps(GOOD)[:20])
    bad = tmp_path / "bad.json"
    bad.write_text("[" + json.dumps(GOOD) + ", {\"conversations\": [}, " + json.dumps(GOOD) + "]")
    prep = prepare_examples([cut, bad], tok, 128, 0.0, 0)
    assert [m.split(" (")[0] for m in prep.skip_messages] == [f"{cut}:2: truncated file", f"{bad}:2: malformed JSON"]
    assert "the 1 complete rows before it are used" in prep.skip_messages[0]


def test_every_skip_goes_to_the_report_and_the_log_names_it(tmp_path, tok, caplog):
    """All skipped rows, not the first 5 (or 100): the report holds one JSON object per skipped row."""
    rows = [GOOD if i % 3 == 0 else ("{broken" if i % 3 == 1 else conv(("user", f"q{i}"))) for i in range(30)]
    p = _jsonl(tmp_path / "many.jsonl", rows)
    run = tmp_path / "run"
    run.mkdir()
    caplog.set_level(logging.WARNING, logger="specjax.data.pipeline")
    prep = prepare_examples([p], tok, 128, 0.0, 0, skip_report_dir=str(run))
    assert (len(prep.train), len(prep.skips), prep.skipped) == (10, 20, {"malformed JSON": 10, "no assistant turn": 10})
    assert run_files.SKIP_REPORT_FILE == SKIP_REPORT_FILE
    report = run / SKIP_REPORT_FILE
    recs = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(recs) == 20
    assert recs[0] == {"where": f"{p}:2", "file": str(p), "row": 2, "reason": "malformed JSON",
                       "detail": "Expecting property name enclosed in double quotes at column 2"}
    assert recs[1] == {"where": f"{p}:3", "file": str(p), "row": 3, "reason": "no assistant turn", "detail": ""}
    assert [r["row"] for r in recs] == [i + 1 for i in range(30) if i % 3]
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "specjax.data.pipeline"]
    assert msg.startswith(
        f"skipped 20 of 30 rows {{'malformed JSON': 10, 'no assistant turn': 10}}; all 20 are listed in {report} "
        "(locations are file:N, N counted from 1: the line of a .jsonl file, the row of a .json list or a .parquet "
        f"file); first 5: ['{p}:2: malformed JSON (Expecting")
    assert msg.count(f"{p}:") == 5


def test_write_skip_report_after_the_fact_and_an_empty_report(tmp_path, tok, caplog):
    p = _jsonl(tmp_path / "x.jsonl", [GOOD, "{broken", GOOD])
    prep = prepare_examples([p], tok, 128, 0.0, 0)
    caplog.set_level(logging.WARNING, logger="specjax.data.pipeline")
    path = pipeline.write_skip_report(prep, tmp_path / "run")  # creates the folder
    assert path == os.path.join(str(tmp_path / "run"), "skipped_rows.jsonl")
    assert [json.loads(x)["where"] for x in open(path)] == [f"{p}:2"]
    assert [r.getMessage() for r in caplog.records if r.name == "specjax.data.pipeline"][-1] == (
        f"all 1 skipped rows are listed in {path} (locations are file:N, N counted from 1: the line of a .jsonl "
        "file, the row of a .json list or a .parquet file)")
    # a later run without bad rows leaves an empty report, not the stale list
    clean = prepare_examples([_jsonl(tmp_path / "ok.jsonl", [GOOD])], tok, 128, 0.0, 0)
    assert pipeline.write_skip_report(clean, tmp_path / "run") == path and open(path).read() == ""
    assert os.listdir(tmp_path / "run") == ["skipped_rows.jsonl"]  # no temporary file left behind


def test_no_usable_row_still_writes_the_report_and_names_it(tmp_path, tok):
    p = _jsonl(tmp_path / "bad.jsonl", ["{broken"] * 7 + [SURROGATE])
    with pytest.raises(ValueError) as e:
        prepare_examples([p], tok, 128, 0.0, 0, skip_report_dir=str(tmp_path))
    report = tmp_path / SKIP_REPORT_FILE
    assert str(e.value).endswith(f"; all 8 skipped rows are listed in {report}")
    assert str(e.value).startswith("no usable training example: 8 rows read, 0 went to validation, skipped "
                                   "{'malformed JSON': 7, 'invalid Unicode': 1}; first problems: [")
    assert len(report.read_text().splitlines()) == 8


def test_doctor_uses_the_same_convention(tiny_target, tmp_path, capsys):
    from specjax.doctor import main

    src = os.path.join(os.path.dirname(__import__("specjax").__file__), "assets", "demo_chat.jsonl")
    good = [json.loads(x) for x in open(src, encoding="utf-8").read().splitlines()[:6]]
    data = tmp_path / "rows.json"
    data.write_text(json.dumps(good[:2] + [conv(("user", "only a question")), SURROGATE] + good[2:]))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"target:\n  path: {tiny_target}\n  dtype: float32\n"
                   f"data:\n  train_files: [{data}]\n  seq_length: 256\n  batch_size: 8\n"
                   "draft:\n  draft_vocab_size: 96\n")
    assert main(["--config", str(cfg), "--rows", "20"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("[WARN] data sample: "))
    assert line.endswith(f"skipped {{'no assistant turn': 1, 'invalid Unicode': 1}}; first: ['{data}:3: no assistant "
                         f"turn', '{data}:4: {SURROGATE_MSG}']"), line

"""Per-row limits of the readers (data.max_row_bytes, data.max_row_depth): a row nested 100,000
levels deep, or hundreds of MB long, is a counted skip naming file:N, the limit and its config key,
found in bounded memory, and the other rows of the file are still prepared.

Before: the deep row ended the run with a RecursionError (no file:N); a 200 MB row took 8 GB in 13 s
(a 20 MB one 5.8 GB): the line was read whole, decoded, templated and tokenized. The memory cases run
`prepare_examples` in a subprocess under RLIMIT_AS (a regression fails there instead of taking the
machine) and report its peak RSS before and after, which must grow by far less than the row (VmHWM:
the subprocess's own peak; ru_maxrss would include the forking test process's).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from _tok import build_tokenizer
from specjax.data import prepare_examples, read_conversations
from specjax.data.sources import RowLimits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 2**20
DEEP = 100_000


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def conv(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Question {i}: how are you?"},
                         {"role": "assistant", "content": f"Answer {i}: fine, thank you."}]}


GOOD = [json.dumps(conv(i)) for i in range(4)]


def _write_huge_jsonl(path, content_bytes: int) -> int:
    """GOOD[0], a row whose content is ``content_bytes`` of 'x' (written 8 MB at a time), GOOD[1:];
    returns the long line's length in bytes."""
    chunk = "x" * (8 * MB)
    head, tail = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "', '"}]}'
    with open(path, "w") as f:
        f.write(GOOD[0] + "\n" + head)
        for _ in range(content_bytes // len(chunk)):
            f.write(chunk)
        f.write(tail + "\n" + "\n".join(GOOD[1:]) + "\n")
    return len(head) + content_bytes // len(chunk) * len(chunk) + len(tail)


def _prepare_in_subprocess(path: str, address_space_gb: float = 3.0, **kwargs) -> dict:
    """prepare_examples([path], tiny tokenizer, seq_length 64) in a fresh process under RLIMIT_AS;
    returns its counts, skip messages and peak RSS (KiB) before and after the call."""
    code = f"""
import json, resource, sys
limit = int({address_space_gb} * 2**30)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.path[:0] = [{REPO!r}, {os.path.join(REPO, 'tests', 'data')!r}]
from _tok import build_tokenizer
from specjax.data import prepare_examples
tok = build_tokenizer()
before = int([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1])
prep = prepare_examples([{path!r}], tok, 64, 0.0, 0, **{kwargs!r})
after = int([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1])
print(json.dumps({{"before_kib": before, "after_kib": after, "train": len(prep.train), "skipped": prep.skipped,
                   "skips": prep.skip_messages}}))
"""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_row_nested_100000_deep_is_a_counted_skip(tmp_path, tok):
    deep = "[" * DEEP + "]" * DEEP
    jl = tmp_path / "deep.jsonl"
    jl.write_text("\n".join([GOOD[0], '{"messages": ' + deep + "}", GOOD[1]]) + "\n")
    lst = tmp_path / "deep.json"
    lst.write_text("[" + ", ".join([GOOD[0], deep, GOOD[1], '{"conversations": ' + deep + "}", GOOD[2]]) + "]")
    one = tmp_path / "one.json"  # a file that is one conversation object
    one.write_text('{"messages": ' + deep + "}")
    prep = prepare_examples([jl, lst, one], tok, 64, 0.0, 0)
    assert len(prep.train) == 5 and prep.skipped == {"row nested too deep": 4}
    limit = "over the limit data.max_row_depth = 256; raise data.max_row_depth to read it"
    assert prep.skip_messages == [
        f"{jl}:2: row nested too deep (nested {DEEP + 1:,} levels deep, {limit})",
        f"{lst}:2: row nested too deep (nested {DEEP:,} levels deep, {limit})",
        f"{lst}:4: row nested too deep (nested {DEEP + 1:,} levels deep, {limit})",
        f"{one}: row nested too deep (the file's one value is nested {DEEP + 1:,} levels deep, {limit})",
    ]
    # the limit is the config's: raised, a 300-deep row is read (and then skipped for what it holds)
    mid = tmp_path / "mid.jsonl"
    mid.write_text('{"messages": ' + "[" * 299 + "]" * 299 + "}\n" + GOOD[0] + "\n")
    assert [r.error.kind for r in read_conversations(mid) if r.error] == ["row nested too deep"]
    assert [r.error.kind for r in read_conversations(mid, limits=RowLimits(max_depth=400)) if r.error] == ["no messages"]


def test_a_200_mb_jsonl_line_is_skipped_in_bounded_memory(tmp_path):
    path = tmp_path / "huge.jsonl"
    size = _write_huge_jsonl(path, 200 * MB)
    r = _prepare_in_subprocess(str(path))
    assert r["train"] == 4 and r["skipped"] == {"row too large": 1}
    assert r["skips"] == [f"{path}:2: row too large (a line of {size:,} bytes, over the limit "
                          "data.max_row_bytes = 16,777,216; raise data.max_row_bytes to read it)"]
    grew = (r["after_kib"] - r["before_kib"]) / 1024
    assert grew < 64, f"peak RSS grew by {grew:.0f} MB reading past a 200 MB line"


def test_a_64_mb_json_list_element_is_skipped_in_bounded_memory(tmp_path):
    path = tmp_path / "huge.json"
    chunk = "y" * (8 * MB)
    head, tail = '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "', '"}]}'
    with open(path, "w") as f:
        f.write("[" + GOOD[0] + ", " + head)
        for _ in range(8):
            f.write(chunk)
        f.write(tail + ",\n" + ", ".join(GOOD[1:]) + "]")
    r = _prepare_in_subprocess(str(path))
    assert r["train"] == 4 and r["skipped"] == {"row too large": 1}
    assert r["skips"] == [f"{path}:2: row too large (an element of {len(head) + 64 * MB + len(tail):,} characters, "
                          "over the limit "
                          "data.max_row_bytes = 16,777,216; raise data.max_row_bytes to read it)"]
    grew = (r["after_kib"] - r["before_kib"]) / 1024
    assert grew < 80, f"peak RSS grew by {grew:.0f} MB reading past a 64 MB element"


def test_a_huge_parquet_cell_is_skipped_before_it_becomes_python_objects(tmp_path):
    """Parquet stores a cell in one page, so Arrow holds it (about its size) while the row group is
    read; the limit keeps it from becoming a Python string, a rendered template and tokens."""
    path = tmp_path / "huge.parquet"
    turn = pa.struct([("role", pa.string()), ("content", pa.string())])
    rows = [conv(0)["messages"], [{"role": "user", "content": "z" * (64 * MB)}, {"role": "assistant", "content": "ok"}],
            *[conv(i)["messages"] for i in range(1, 4)]]
    pq.write_table(pa.table({"messages": rows}, schema=pa.schema([("messages", pa.list_(turn))])), path)
    del rows
    r = _prepare_in_subprocess(str(path), max_rows=None)
    assert r["train"] == 4 and r["skipped"] == {"row too large": 1}
    assert r["skips"][0].startswith(f"{path}:2: row too large (a row of 67,108,") and "data.max_row_bytes" in r["skips"][0]
    grew = (r["after_kib"] - r["before_kib"]) / 1024
    # Arrow alone decodes this row group with ~210 MB (pq.ParquetFile.iter_batches over the file, measured
    # 2026-12-06), the floor of any parquet reader; the whole preparation measured ~310 MB. Before the
    # limit, the cell became a Python string, a rendered template and tokens: several GB (the subprocess
    # failed under its address-space limit).
    assert grew < 6 * 64, f"peak RSS grew by {grew:.0f} MB for a 64 MB cell"


def test_limits_apply_at_their_config_values(tmp_path, tok):
    """row_limits is what data.max_row_bytes / data.max_row_depth set: a line just over a small limit
    is skipped, one at it is read; the same for a JSON list element and a parquet row."""
    line = json.dumps(conv(9))
    n = len(line.encode())
    jl = tmp_path / "a.jsonl"
    jl.write_text(line + "\n" + line + " \n")  # the second line is one byte longer
    prep = prepare_examples([jl], tok, 64, 0.0, 0, row_limits=RowLimits(max_bytes=n))
    assert len(prep.train) == 1 and prep.skip_messages == [
        f"{jl}:2: row too large (a line of {n + 1:,} bytes, over the limit data.max_row_bytes = {n:,}; "
        "raise data.max_row_bytes to read it)"]
    lst = tmp_path / "a.json"
    lst.write_text("[" + line + ", " + line.replace("Answer", "Answers") + "]")
    prep = prepare_examples([lst], tok, 64, 0.0, 0, row_limits=RowLimits(max_bytes=n))
    assert len(prep.train) == 1 and prep.skipped == {"row too large": 1} and prep.skips[0].row == 2
    pq_path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist([conv(1), {"messages": [{"role": "user", "content": "q" * 5000},
                                                                {"role": "assistant", "content": "a"}]}]), pq_path)
    prep = prepare_examples([pq_path], tok, 64, 0.0, 0, row_limits=RowLimits(max_bytes=4000))
    assert len(prep.train) == 1 and prep.skipped == {"row too large": 1} and prep.skips[0].row == 2


def test_a_number_of_5000_digits_is_a_counted_skip(tmp_path, tok):
    """Python refuses to read integers of more than 4300 digits with a ValueError that is not a
    JSONDecodeError: it ended the run; now it is a malformed row like any other."""
    number = "1" * 5000
    jl = tmp_path / "n.jsonl"
    jl.write_text(GOOD[0] + '\n{"messages": [], "n": ' + number + "}\n" + GOOD[1] + "\n")
    lst = tmp_path / "n.json"
    lst.write_text("[" + GOOD[0] + ", " + number + "]")
    prep = prepare_examples([jl, lst], tok, 64, 0.0, 0)
    assert len(prep.train) == 3 and prep.skipped == {"malformed JSON": 2}
    assert [s.where for s in prep.skips] == [f"{jl}:2", f"{lst}:2"]
    assert all("4300 digits" in m for m in prep.skip_messages), prep.skip_messages

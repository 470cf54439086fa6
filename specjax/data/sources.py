"""Read chat conversations from JSONL / JSON / parquet files.

Every row comes back as a `Row`. A row that cannot be used carries an error string saying what is
wrong and where (``file:line`` for JSONL, ``file[row]`` for JSON lists and parquet) instead of
raising, so one bad line never stops a long preprocessing run. Files that cannot be opened at all
are an exception: that is a configuration mistake, not a data problem.
"""
from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

__all__ = ["Row", "RowError", "read_conversations", "normalize_messages", "ROLES"]

ROLES = ("system", "user", "assistant", "tool")

# ShareGPT speaker names -> chat roles. A few dumps use chat role names directly, so accept those too.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class RowError(str):
    """An error message (a plain ``str``) that also remembers a short category in ``.kind``.

    The pipeline counts skipped rows per category; the full message keeps the location."""

    kind: str

    def __new__(cls, kind: str, where: str, detail: str = "") -> "RowError":
        text = f"{where}: {kind}" + (f" ({detail})" if detail else "")
        obj = super().__new__(cls, text)
        obj.kind = kind
        return obj

    def __reduce__(self):  # keep .kind when pickled (e.g. sent to a worker process)
        return (_rebuild_row_error, (str(self), self.kind))


def _rebuild_row_error(text: str, kind: str) -> RowError:
    obj = str.__new__(RowError, text)
    obj.kind = kind
    return obj


class Row(NamedTuple):
    source: str
    index: int
    messages: list[dict] | None
    error: str | None


def normalize_messages(row: Any) -> tuple[list[dict] | None, tuple[str, str] | None]:
    """Turn one decoded row into ``[{"role", "content"}, ...]``.

    Returns (messages, None) or (None, (kind, detail))."""
    if not isinstance(row, dict):
        return None, ("no messages", f"row is a {type(row).__name__}, expected an object")
    if "messages" in row and row["messages"] is not None:
        raw, role_key, content_key, role_map = row["messages"], "role", "content", None
    elif "conversations" in row and row["conversations"] is not None:
        raw, role_key, content_key, role_map = row["conversations"], "from", "value", _SHAREGPT_ROLES
    else:
        return None, ("no messages", "expected a 'messages' or 'conversations' list")
    if not isinstance(raw, (list, tuple)) or len(raw) == 0:
        return None, ("no messages", "'messages' must be a non-empty list")
    out = []
    for turn_no, turn in enumerate(raw):
        if not isinstance(turn, dict):
            return None, ("no messages", f"turn {turn_no} is a {type(turn).__name__}, expected an object")
        # Accept either schema per turn: some ShareGPT exports mix 'role'/'content' in.
        role = turn.get(role_key, turn.get("role"))
        content = turn.get(content_key, turn.get("content"))
        if role_map is not None:
            mapped = role_map.get(role) if isinstance(role, str) else None
        else:
            mapped = role if role in ROLES else None
        if mapped is None:
            return None, ("unknown role", f"turn {turn_no} has role {role!r}")
        if not isinstance(content, str):
            return None, ("non-string content", f"turn {turn_no} content is {type(content).__name__}")
        out.append({"role": mapped, "content": content})
    return out, None


def _row_from_obj(source: str, index: int, where: str, obj: Any) -> Row:
    messages, err = normalize_messages(obj)
    if err is not None:
        return Row(source, index, None, RowError(err[0], where, err[1]))
    return Row(source, index, messages, None)


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _read_jsonl(path: str) -> Iterator[Row]:
    with _open_binary(path) as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            index = line_no - 1  # the line, not a running count: blank lines don't shift later rows
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Row(path, index, None, RowError("invalid UTF-8", where, f"byte offset {e.start}"))
                continue
            if not line.strip():
                continue  # blank lines are not rows
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield Row(path, index, None, RowError("malformed JSON", where, e.msg + f" at column {e.colno}"))
                continue
            yield _row_from_obj(path, index, where, obj)


def _read_json(path: str) -> Iterator[Row]:
    with _open_binary(path) as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        yield Row(path, 0, None, RowError("invalid UTF-8", f"{path}:byte {e.start}", "whole file unreadable"))
        return
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        yield Row(path, 0, None, RowError("malformed JSON", f"{path}:{e.lineno}", e.msg + " (whole file unreadable)"))
        return
    if isinstance(obj, dict) and ("messages" in obj or "conversations" in obj):
        obj = [obj]  # a single conversation stored as one object
    if not isinstance(obj, list):
        yield Row(path, 0, None, RowError("no messages", path, "a .json file must hold a list of rows"))
        return
    for i, item in enumerate(obj):
        yield _row_from_obj(path, i, f"{path}[{i}]", item)


def _read_parquet(path: str) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
            "(or convert the data to JSONL)"
        ) from e
    pf = pq.ParquetFile(path)
    index = 0
    for batch in pf.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            yield _row_from_obj(path, index, f"{path}[{index}]", obj)
            index += 1


def _reader_for(path: str):
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith(".jsonl") or name.endswith(".ndjson"):
        return _read_jsonl
    if name.endswith(".json"):
        return _read_json
    if name.endswith(".parquet"):
        return _read_parquet
    raise ValueError(f"unsupported data file {path!r}: expected .jsonl, .json or .parquet (optionally .gz for json)")


def read_conversations(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> Iterator[Row]:
    """Yield a `Row` for every conversation in ``paths`` (files read in the given order).

    Raises FileNotFoundError (naming the path) for a missing file, ValueError for an unknown
    extension -- at call time, before any row is read, so a typo in the last path fails before
    minutes of tokenizing. Bad rows are yielded with ``error`` set."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ValueError("no data files given")
    readers = []
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"data file not found: {p}")
        readers.append((_reader_for(p), p))
    return (row for reader, p in readers for row in reader(p))

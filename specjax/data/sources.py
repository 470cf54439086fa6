"""Read chat conversations from JSONL / JSON / parquet files, folders of parquet shards and
dataset presets (``preset://sharegpt``; see `specjax.data.presets`).

Every row comes back as a `Row`. A row that cannot be used carries an error string saying what is
wrong and where instead of raising, so one bad line never stops a long preprocessing run. Files that
cannot be opened at all are an exception: that is a configuration mistake, not a data problem.

Locations are ``file:N`` with N counted from 1 everywhere: the line of a JSONL file (blank lines
count, so it is the line an editor shows), the element of a JSON list, the row of a parquet file.
A problem of a whole file (empty, not a list, unreadable) is located by the file name alone.
`Row.index` is N - 1 (it keys the train/val split, so it must not change).

Text that no tokenizer can encode is a bad row too: a lone surrogate (``"\\ud800"`` is valid JSON)
in JSON / JSONL rows (``invalid Unicode``), a string of a parquet file that is not UTF-8
(``invalid UTF-8``). NUL and other control characters are ordinary text: tokenizers accept them.

JSON lists are decoded one element at a time, so a huge list costs one element of memory and a
list cut short (a truncated download, e.g. the ShareGPT dump) yields its complete rows followed by
one error row of kind ``truncated file`` instead of failing as a whole.
"""
from __future__ import annotations

import glob
import gzip
import io
import json
import os
import re
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

__all__ = ["Row", "RowError", "read_conversations", "read_records", "iter_json_list", "normalize_messages",
           "resolve_data_paths", "format_skip", "unencodable", "ROLES", "PRESET_SCHEME"]

PRESET_SCHEME = "preset://"

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


def format_skip(kind: str, where: str, detail: str = "") -> str:
    """The one-line form of a skipped row: ``where: kind (detail)``."""
    return f"{where}: {kind}" + (f" ({detail})" if detail else "")


class RowError(str):
    """An error message (a plain ``str``) that also remembers its parts: ``.kind`` (a short
    category), ``.where`` (``file:N`` or the file alone) and ``.detail``.

    The pipeline counts skipped rows per category; the full message keeps the location."""

    kind: str
    where: str
    detail: str

    def __new__(cls, kind: str, where: str, detail: str = "") -> "RowError":
        obj = super().__new__(cls, format_skip(kind, where, detail))
        obj.kind, obj.where, obj.detail = kind, where, detail
        return obj

    def __reduce__(self):  # keep the parts when sent to a worker process
        return (RowError, (self.kind, self.where, self.detail))


class Row(NamedTuple):
    source: str
    index: int
    messages: list[dict] | None
    error: str | None
    # rows that must land on the same side of the train/val split: the `source_index` a regenerated
    # row carries (specjax.regenerate), shared by a conversation's windows and its last row
    group: str | None = None


_SURROGATE = re.compile("[\ud800-\udfff]")


def unencodable(text: str) -> str | None:
    """Why ``text`` cannot be tokenized, or None. Of the strings Python can hold, tokenizers refuse
    only those with an unpaired surrogate (they have no UTF-8 encoding; a JSON ``\\ud800`` escape
    without its pair decodes to one). NUL, control characters, noncharacters are accepted."""
    m = _SURROGATE.search(text)
    if m is None:
        return None
    return (f"an unpaired surrogate U+{ord(m.group()):04X} at character offset {m.start()}, "
            "which no tokenizer can encode")


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
        bad = unencodable(content)
        if bad is not None:
            return None, ("invalid Unicode", f"turn {turn_no} content has {bad}")
        out.append({"role": mapped, "content": content})
    return out, None


def _row_from_obj(source: str, index: int, where: str, obj: Any) -> Row:
    messages, err = normalize_messages(obj)
    if err is not None:
        return Row(source, index, None, RowError(err[0], where, err[1]))
    src = obj.get("source_index") if isinstance(obj, dict) else None
    group = f"source_index {src}" if isinstance(src, int) and not isinstance(src, bool) else None
    return Row(source, index, messages, None, group)


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


# A record is (index, where, obj) where obj is the decoded JSON value, or a RowError when the
# record itself could not be decoded. Conversation rows and evaluation prompts are both built on it.
Record = tuple[int, str, Any]


def _records_jsonl(path: str) -> Iterator[Record]:
    with _open_binary(path) as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            index = line_no - 1  # the line, not a running count: blank lines don't shift later rows
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield index, where, RowError("invalid UTF-8", where, f"byte offset {e.start}")
                continue
            if not line.strip():
                continue  # blank lines are not rows
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield index, where, RowError("malformed JSON", where, e.msg + f" at column {e.colno}")
                continue
            yield index, where, obj


_SEPARATORS = re.compile(r"[\s,]*")
_WHITESPACE = re.compile(r"\s*")
_CHUNK_CHARS = 1 << 20  # characters read per step of the incremental decoder


def iter_json_list(path: str, *, label: str | None = None) -> Iterator[Record]:
    """Records of a JSON file holding a list, decoded element by element from a stream (the file is
    never held whole). A file that ends inside the list -- a truncated download -- yields its
    complete elements and then one ``truncated file`` error; a malformed element yields a
    ``malformed JSON`` error and ends the file (there is no reliable place to resume).
    A top-level object (one conversation) is yielded as record 0. ``label`` names the rows in
    error messages (default: the path)."""
    label = path if label is None else label
    decoder = json.JSONDecoder()
    state = {"buf": "", "pos": 0, "dropped": 0, "eof": False}

    with io.TextIOWrapper(_open_binary(path), encoding="utf-8") as f:

        def more() -> bool:  # append a chunk; False at end of file
            if state["eof"]:
                return False
            try:
                chunk = f.read(_CHUNK_CHARS)
            except UnicodeDecodeError as e:
                raise _BadUtf8(e) from None
            if not chunk:
                state["eof"] = True
                return False
            if state["pos"] > _CHUNK_CHARS:  # forget what was consumed (keeps memory at ~a chunk)
                state["dropped"] += state["pos"]
                state["buf"], state["pos"] = state["buf"][state["pos"]:], 0
            state["buf"] += chunk
            return True

        index = 0
        try:
            while True:  # skip leading whitespace
                state["pos"] = _WHITESPACE.match(state["buf"], state["pos"]).end()
                if state["pos"] < len(state["buf"]) or not more():
                    break
            buf, pos = state["buf"], state["pos"]
            if pos >= len(buf):
                yield 0, f"{label}", RowError("no messages", label, "the file is empty")
                return
            if buf[pos] != "[":
                while more():
                    pass
                try:  # the whole text (json allows the leading whitespace), so line numbers are the file's
                    obj = json.loads(state["buf"] if not state["dropped"] else state["buf"][state["pos"]:])
                except json.JSONDecodeError as e:
                    yield 0, label, RowError("malformed JSON", label, f"{e.msg} at line {e.lineno} column "
                                             f"{e.colno}; the whole file is unreadable")
                    return
                if isinstance(obj, dict) and ("messages" in obj or "conversations" in obj):
                    yield 0, f"{label}:1", obj  # a single conversation stored as one object
                else:
                    yield 0, label, RowError("no messages", label, "a .json file must hold a list of rows")
                return
            state["pos"] += 1
            while True:
                buf = state["buf"]
                state["pos"] = pos = _SEPARATORS.match(buf, state["pos"]).end()
                if pos >= len(buf):
                    if more():
                        continue
                    yield index, f"{label}:{index + 1}", RowError(
                        "truncated file", f"{label}:{index + 1}",
                        f"the file ends before the list's closing ']'; the {index} complete rows before are used")
                    return
                if buf[pos] == "]":
                    return
                try:
                    obj, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as e:
                    # Out of input (the error sits at the end of what was read, or a string runs
                    # off the end): read more and retry. Anything else is a real syntax error.
                    near_end = e.pos >= len(buf) - 8 or e.msg.startswith("Unterminated string")
                    if near_end and more():
                        continue
                    where = f"{label}:{index + 1}"
                    offset = state["dropped"] + pos
                    if near_end:
                        yield index, where, RowError(
                            "truncated file", where,
                            f"the file ends inside this row ({len(buf) - pos} characters from character offset "
                            f"{offset} do not parse: {e.msg}); the {index} complete rows before it are used")
                    else:
                        yield index, where, RowError(
                            "malformed JSON", where,
                            f"{e.msg} at character offset {state['dropped'] + e.pos}; the rest of the file is skipped")
                    return
                if end >= len(buf) and more():
                    continue  # a bare number may go on in the next chunk: decode it again
                yield index, f"{label}:{index + 1}", obj
                index += 1
                state["pos"] = end
        except _BadUtf8 as e:
            where = f"{label}:{index + 1}"
            yield index, where, RowError("invalid UTF-8", where, f"{e.error.reason}; the rest of the file is skipped")


class _BadUtf8(Exception):
    def __init__(self, error: UnicodeDecodeError):
        super().__init__(str(error))
        self.error = error


def _records_parquet(path: str) -> Iterator[Record]:
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
        try:
            objs = batch.to_pylist()
        except UnicodeDecodeError:  # a string column holds bytes that are not UTF-8: find the rows
            objs = [_parquet_row(batch, i, f"{path}:{index + i + 1}") for i in range(batch.num_rows)]
        for obj in objs:
            yield index, f"{path}:{index + 1}", obj
            index += 1


def _parquet_row(batch, i: int, where: str):
    try:
        return batch.slice(i, 1).to_pylist()[0]
    except UnicodeDecodeError as e:
        return RowError("invalid UTF-8", where, f"a string holds byte 0x{e.object[e.start]:02X} at byte offset "
                        f"{e.start}, which is not UTF-8: {e.reason}")


def _reader_for(path: str):
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith(".jsonl") or name.endswith(".ndjson"):
        return _records_jsonl
    if name.endswith(".json"):
        return iter_json_list
    if name.endswith(".parquet"):
        return _records_parquet
    raise ValueError(f"unsupported data file {path!r}: expected .jsonl, .json or .parquet (optionally .gz for json)")


def _parquet_shards(folder: str) -> list[str]:
    """The ``*.parquet`` files of a folder (e.g. `specjax.regenerate` output), in sorted order;
    temporary files of an interrupted writer (``*.parquet.*.tmp``) do not match."""
    shards = sorted(glob.glob(os.path.join(glob.escape(folder), "*.parquet")))
    if not shards:
        raise ValueError(
            f"data folder {folder} holds no *.parquet shards; point at a finished `python -m specjax.regenerate` "
            "output folder, or list the data files themselves"
        )
    return shards


def resolve_data_paths(paths: str | os.PathLike | Iterable[str | os.PathLike], *,
                       allow_eval_presets: bool = False) -> list[str]:
    """Expand ``paths`` into the list of files / ``preset://NAME`` entries to read, checking each
    one now (missing file, unknown extension, empty shard folder, unknown preset, missing asset
    package, evaluation preset while training) so a typo fails before any row is read."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise ValueError("no data files given")
    out: list[str] = []
    for p in paths:
        if p.startswith(PRESET_SCHEME):
            from specjax.data import presets

            name = presets.check_preset(p, allow_eval=allow_eval_presets)
            presets.preset_file(name)  # asset package installed? (the error names the pip command)
            out.append(PRESET_SCHEME + name)
        elif os.path.isdir(p):
            out.extend(_parquet_shards(p))
        elif os.path.isfile(p):
            _reader_for(p)  # unknown extension -> ValueError now
            out.append(p)
        else:
            hint = ""
            from specjax.data.presets import PRESETS

            if p in PRESETS:
                hint = f" (for the dataset preset write {PRESET_SCHEME}{p})"
            raise FileNotFoundError(f"data file not found: {p}{hint}")
    return out


def read_records(path: str) -> Iterator[Record]:
    """(index, where, decoded object | RowError) for every record of one data file."""
    return _reader_for(path)(path)


def _rows_of(entry: str) -> Iterator[Row]:
    if entry.startswith(PRESET_SCHEME):
        from specjax.data.presets import preset_rows

        yield from preset_rows(entry)
        return
    for index, where, obj in read_records(entry):
        if isinstance(obj, RowError):
            yield Row(entry, index, None, obj)
        else:
            yield _row_from_obj(entry, index, where, obj)


def read_conversations(paths: str | os.PathLike | Iterable[str | os.PathLike], *,
                       allow_eval_presets: bool = False) -> Iterator[Row]:
    """Yield a `Row` for every conversation in ``paths``, read in the given order.

    An entry is a data file (.jsonl / .json / .parquet, json optionally .gz), a folder of
    ``*.parquet`` shards (read in sorted order) or a dataset preset ``preset://NAME``.
    Evaluation presets (MT-bench, HumanEval) are refused unless ``allow_eval_presets``: this is the
    training-data reader, and a draft trained on its benchmark prompts reports inflated acceptance.

    Raises FileNotFoundError (naming the path) for a missing file, ValueError for an unknown
    extension, an empty shard folder or a refused preset -- at call time, before any row is read,
    so a typo in the last path fails before minutes of tokenizing. Bad rows are yielded with
    ``error`` set."""
    entries = resolve_data_paths(paths, allow_eval_presets=allow_eval_presets)
    return (row for entry in entries for row in _rows_of(entry))

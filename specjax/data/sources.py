"""Read chat conversations from JSONL / JSON / parquet files. Lists of data files, shard folders and
dataset presets (``preset://sharegpt``) are read by `specjax.data.datasets`.

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

A row over the per-row limits (`RowLimits`: config `data.max_row_bytes`, default 16 MiB, and
`data.max_row_depth`, default 256 levels) is a bad row of kind ``row too large`` / ``row nested too
deep`` that names the limit and its config key, found before the row is decoded and in bounded
memory: a JSONL line is read up to the limit and the rest of it passed over a piece at a time; a
JSON list element is scanned for its end and depth (quotes and brackets only) before it is decoded;
a parquet row is measured in Arrow before it becomes Python objects. The reader goes on with the
next row.
"""
from __future__ import annotations

import gzip
import io
import json
import re
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["Row", "RowError", "RowLimits", "read_records", "reader_for", "iter_json_list", "normalize_messages",
           "row_from_obj", "format_skip", "unencodable", "ROLES", "PRESET_SCHEME", "DEFAULT_MAX_ROW_BYTES",
           "DEFAULT_MAX_ROW_DEPTH"]

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


def row_from_obj(source: str, index: int, where: str, obj: Any) -> Row:
    """The `Row` of one decoded conversation object (an error row when its messages do not parse)."""
    messages, err = normalize_messages(obj)
    if err is not None:
        return Row(source, index, None, RowError(err[0], where, err[1]))
    src = obj.get("source_index") if isinstance(obj, dict) else None
    group = f"source_index {src}" if isinstance(src, int) and not isinstance(src, bool) else None
    return Row(source, index, messages, None, group)


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


# ---------------------------------------------------------------------------------------------
# Per-row limits. A row is read into memory, decoded by the json module (which recurses once per
# nesting level) and then templated and tokenized (~200 bytes of memory per byte of text with a
# Hugging Face fast tokenizer), so one absurd row could take the whole run down: a 100,000-deep row
# ended it with a RecursionError, a 200 MB one took 8 GB. The defaults stay far from real chat data:
# a 128k-token conversation is under a few MB of JSON and nests fewer than 10 levels.
DEFAULT_MAX_ROW_BYTES = 16 * 2**20
DEFAULT_MAX_ROW_DEPTH = 256


class RowLimits(NamedTuple):
    """Per-row bounds of the readers (config `data.max_row_bytes`, `data.max_row_depth`). A row over
    one of them is a counted skip (kinds ``row too large``, ``row nested too deep``) read in bounded
    memory: the size of a JSONL line is its bytes (without the newline), of a JSON list element its
    characters, of a parquet row the Arrow bytes of its values; the depth counts nested lists and
    objects, the row itself being 1."""

    max_bytes: int = DEFAULT_MAX_ROW_BYTES
    max_depth: int = DEFAULT_MAX_ROW_DEPTH

    @classmethod
    def of(cls, data) -> "RowLimits":
        """The bounds a config's `data` section sets (`data.max_row_bytes`, `data.max_row_depth`)."""
        return cls(data.max_row_bytes, data.max_row_depth)


def _too_large(where: str, size: str, limits: RowLimits) -> RowError:
    return RowError("row too large", where, f"{size}, over the limit data.max_row_bytes = {limits.max_bytes:,}; "
                                            "raise data.max_row_bytes to read it")


def _too_deep(where: str, depth: str, limits: RowLimits) -> RowError:
    return RowError("row nested too deep", where, f"{depth}, over the limit data.max_row_depth = "
                                                  f"{limits.max_depth}; raise data.max_row_depth to read it")


# a JSON string: quotes around anything but a quote or backslash, or an escape (unrolled and
# possessive: the regex engine never backtracks)
_JSON_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)


def _nesting_depth(text: str) -> int:
    """How deep lists and objects nest in JSON ``text``, counting brackets outside strings (no
    recursion; for malformed text an upper bound)."""
    import numpy as np

    outside = np.frombuffer(_JSON_STRING.sub("", text).encode("utf-8", "replace"), np.uint8)
    step = ((outside == ord("[")) | (outside == ord("{"))).astype(np.int32)
    step -= (outside == ord("]")) | (outside == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def _decode_row(text: str, where: str, limits: RowLimits) -> Any:
    """``json.loads(text)`` when its nesting is within the limit (checked first, so the decoder
    never recurses past it), else a RowError."""
    if text.count("[") + text.count("{") > limits.max_depth:  # cheap bound; most rows stop here
        depth = _nesting_depth(text)
        if depth > limits.max_depth:
            return _too_deep(where, f"nested {depth:,} levels deep", limits)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return RowError("malformed JSON", where, e.msg + f" at column {e.colno}")
    except RecursionError:  # only when data.max_row_depth is set above Python's recursion limit
        return _too_deep(where, "nested deeper than Python's JSON decoder can go", limits)
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        return RowError("malformed JSON", where, str(e))


# A record is (index, where, obj) where obj is the decoded JSON value, or a RowError when the
# record itself could not be decoded. Conversation rows and evaluation prompts are both built on it.
Record = tuple[int, str, Any]

_DISCARD_BYTES = 1 << 20  # read size while passing over the rest of a line that is too long


def _records_jsonl(path: str, limits: RowLimits = RowLimits()) -> Iterator[Record]:
    with _open_binary(path) as f:
        line_no = 0
        while True:
            raw = f.readline(limits.max_bytes + 1)  # never more than the limit (+1 to see it is over)
            if not raw:
                return
            line_no += 1
            where = f"{path}:{line_no}"
            index = line_no - 1  # the line, not a running count: blank lines don't shift later rows
            if len(raw) > limits.max_bytes and not raw.endswith(b"\n"):
                size = len(raw)
                del raw
                while piece := f.readline(_DISCARD_BYTES):  # pass over the rest, a piece at a time
                    size += len(piece)
                    if piece.endswith(b"\n"):
                        size -= 1
                        break
                yield index, where, _too_large(where, f"a line of {size:,} bytes", limits)
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield index, where, RowError("invalid UTF-8", where, f"byte offset {e.start}")
                continue
            if not line.strip():
                continue  # blank lines are not rows
            yield index, where, _decode_row(line, where, limits)


_SEPARATORS = re.compile(r"[\s,]*")
_WHITESPACE = re.compile(r"\s*")
_CHUNK_CHARS = 1 << 20  # characters read per step of the incremental decoder
# text and whole strings up to the next bracket outside a string (or a string the buffer cuts off)
_TO_BRACKET = re.compile(r'(?:[^"\[\]{}]++|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+', re.DOTALL)
_INSIDE_STRING = re.compile(r'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)  # up to the closing quote (or a last backslash)
_SCALAR = re.compile(r"[^\s,\]]*")  # a number / true / false / null (or garbage) up to a separator


class _Text:
    """A text file read a chunk at a time. Positions are absolute character offsets; ``buf`` holds
    the text from ``base`` on (`more` forgets what the caller no longer needs)."""

    def __init__(self, f):
        self.f, self.buf, self.base, self.eof = f, "", 0, False

    def end(self) -> int:
        return self.base + len(self.buf)

    def at(self, pos: int) -> str:
        return self.buf[pos - self.base]

    def more(self, keep_from: int) -> bool:
        """Append a chunk, forgetting the text before ``keep_from``; False at the end of the file."""
        if self.eof:
            return False
        try:
            chunk = self.f.read(_CHUNK_CHARS)
        except UnicodeDecodeError as e:
            raise _BadUtf8(e) from None
        if not chunk:
            self.eof = True
            return False
        drop = keep_from - self.base
        if drop > _CHUNK_CHARS:  # keeps memory at about a chunk plus the value being read
            self.buf, self.base = self.buf[drop:], keep_from
        self.buf += chunk
        return True


class _ValueExtent:
    """Where a JSON list element that starts at ``start`` ends and how deep it nests, found from its
    quotes and brackets alone (no decoding, no recursion), a chunk at a time."""

    def __init__(self, start: int, first: str):
        self.depth = self.deepest = 0
        self.in_string = first == '"'  # a string element: its opening quote is passed
        self.pos = start + self.in_string
        self.done = False

    def advance(self, text: _Text) -> None:
        """Scan the buffered text from ``pos``; stops at the element's end (``done``) or the buffer's."""
        buf, i, n = text.buf, self.pos - text.base, len(text.buf)
        while i < n:
            if self.in_string:
                i = _INSIDE_STRING.match(buf, i).end()
                if i >= n or buf[i] == "\\":  # a backslash left here is the buffer's last character
                    break  # the string (or the escape) goes on in the next chunk
                self.in_string = False
                i += 1
                if self.depth == 0:  # the element is a string
                    self.done = True
                    break
                continue
            i = _TO_BRACKET.match(buf, i).end()  # the regex engine passes over whole strings
            if i >= n:
                break
            c = buf[i]
            i += 1
            if c == '"':  # a string that goes on in the next chunk
                self.in_string = True
            elif c in "[{":
                self.depth += 1
                self.deepest = max(self.deepest, self.depth)
            else:
                self.depth -= 1
                if self.depth <= 0:
                    self.done = True
                    break
        self.pos = text.base + i


def iter_json_list(path: str, *, label: str | None = None, limits: RowLimits = RowLimits()) -> Iterator[Record]:
    """Records of a JSON file holding a list, decoded element by element from a stream (the file is
    never held whole). A file that ends inside the list -- a truncated download -- yields its
    complete elements and then one ``truncated file`` error; a malformed element yields a
    ``malformed JSON`` error and ends the file (there is no reliable place to resume). An element
    over ``limits`` is a ``row too large`` / ``row nested too deep`` error found before it is
    decoded; the reader passes over it (holding at most the limit) and goes on with the next.
    A top-level object (one conversation) is yielded as record 0. ``label`` names the rows in
    error messages (default: the path)."""
    label = path if label is None else label
    decoder = json.JSONDecoder()
    with io.TextIOWrapper(_open_binary(path), encoding="utf-8") as f:
        text = _Text(f)
        index = 0
        try:
            pos = 0
            while True:  # skip leading whitespace
                pos = text.base + _WHITESPACE.match(text.buf, pos - text.base).end()
                if pos < text.end() or not text.more(pos):
                    break
            if pos >= text.end():
                yield 0, f"{label}", RowError("no messages", label, "the file is empty")
                return
            if text.at(pos) != "[":
                yield _single_value(text, pos, label, limits)
                return
            pos += 1
            while True:
                pos = text.base + _SEPARATORS.match(text.buf, pos - text.base).end()
                where = f"{label}:{index + 1}"
                if pos >= text.end():
                    if text.more(pos):
                        continue
                    yield index, where, RowError(
                        "truncated file", where,
                        f"the file ends before the list's closing ']'; the {index} complete rows before are used")
                    return
                first = text.at(pos)
                if first == "]":
                    return
                extent = _ValueExtent(pos, first)
                if first in '[{"':
                    while True:
                        extent.advance(text)
                        if extent.done:
                            break
                        # past a limit: forget the element's text as it is scanned
                        over = extent.pos - pos > limits.max_bytes or extent.deepest > limits.max_depth
                        if not text.more(extent.pos if over else pos):
                            break
                    end = extent.pos
                else:  # a scalar (valid or not): to the next separator or the end of the file
                    while True:
                        extent.pos = text.base + _SCALAR.match(text.buf, extent.pos - text.base).end()
                        over = extent.pos - pos > limits.max_bytes
                        if extent.pos < text.end() or not text.more(extent.pos if over else pos):
                            extent.done = True
                            break
                    end = extent.pos
                size = end - pos
                if extent.done and size > limits.max_bytes:
                    yield index, where, _too_large(where, f"an element of {size:,} characters", limits)
                elif extent.done and extent.deepest > limits.max_depth:
                    yield index, where, _too_deep(where, f"nested {extent.deepest:,} levels deep", limits)
                elif not extent.done:  # the file ends inside this element
                    shown = f" ({size} characters from character offset {pos} do not parse)" \
                        if size <= limits.max_bytes else ""
                    yield index, where, RowError(
                        "truncated file", where,
                        f"the file ends inside this row{shown}; the {index} complete rows before it are used")
                    return
                else:
                    try:
                        obj, stop = decoder.raw_decode(text.buf, pos - text.base)
                    except json.JSONDecodeError as e:
                        yield index, where, RowError(
                            "malformed JSON", where,
                            f"{e.msg} at character offset {text.base + e.pos}; the rest of the file is skipped")
                        return
                    except (RecursionError, ValueError) as e:  # a depth over Python's limit, a 4301-digit number
                        yield index, where, RowError(
                            "malformed JSON", where, f"{type(e).__name__}: {e}; the rest of the file is skipped")
                        return
                    yield index, where, obj
                    end = text.base + stop
                index += 1
                pos = end
        except _BadUtf8 as e:
            where = f"{label}:{index + 1}"
            yield index, where, RowError("invalid UTF-8", where, f"{e.error.reason}; the rest of the file is skipped")


def _single_value(text: _Text, pos: int, label: str, limits: RowLimits) -> Record:
    """The record of a .json file that is not a list: one conversation object, or an error."""
    while text.end() - pos <= limits.max_bytes and text.more(pos):
        pass
    if text.end() - pos > limits.max_bytes:
        return 0, label, _too_large(label, f"the file's one value has more than {limits.max_bytes:,} characters",
                                    limits)
    body = text.buf[pos - text.base:]
    if body.count("[") + body.count("{") > limits.max_depth:
        depth = _nesting_depth(body)
        if depth > limits.max_depth:
            return 0, label, _too_deep(label, f"the file's one value is nested {depth:,} levels deep", limits)
    try:  # the whole text from the file's start when nothing was dropped, so line numbers are the file's
        obj = json.loads(text.buf if text.base == 0 else body)
    except json.JSONDecodeError as e:
        return 0, label, RowError("malformed JSON", label, f"{e.msg} at line {e.lineno} column "
                                  f"{e.colno}; the whole file is unreadable")
    except (RecursionError, ValueError) as e:
        return 0, label, RowError("malformed JSON", label, f"{type(e).__name__}: {e}; the whole file is unreadable")
    if isinstance(obj, dict) and ("messages" in obj or "conversations" in obj):
        return 0, f"{label}:1", obj  # a single conversation stored as one object
    return 0, label, RowError("no messages", label, "a .json file must hold a list of rows")


class _BadUtf8(Exception):
    def __init__(self, error: UnicodeDecodeError):
        super().__init__(str(error))
        self.error = error


_PARQUET_BATCH_ROWS = 1024


def _records_parquet(path: str, limits: RowLimits = RowLimits()) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
            "(or convert the data to JSONL)"
        ) from e
    pf = pq.ParquetFile(path)
    index = 0
    for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        # A batch within the limit holds no row over it; else each row is measured (Arrow's bytes of
        # its slice) and only the rows within it become Python objects.
        sizes = None if batch.nbytes <= limits.max_bytes else [batch.slice(i, 1).nbytes
                                                               for i in range(batch.num_rows)]
        objs = None
        if sizes is None:
            try:
                objs = batch.to_pylist()
            except UnicodeDecodeError:  # a string column holds bytes that are not UTF-8: find the rows
                pass
        for i in range(batch.num_rows):
            where = f"{path}:{index + 1}"
            if sizes is not None and sizes[i] > limits.max_bytes:
                obj = _too_large(where, f"a row of {sizes[i]:,} bytes", limits)
            else:
                obj = objs[i] if objs is not None else _parquet_row(batch, i, where)
            yield index, where, obj
            index += 1
        del batch, objs


def _parquet_row(batch, i: int, where: str):
    try:
        return batch.slice(i, 1).to_pylist()[0]
    except UnicodeDecodeError as e:
        return RowError("invalid UTF-8", where, f"a string holds byte 0x{e.object[e.start]:02X} at byte offset "
                        f"{e.start}, which is not UTF-8: {e.reason}")


def reader_for(path: str):
    """The record reader of a data file, by its extension; ValueError for an unsupported one."""
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith(".jsonl") or name.endswith(".ndjson"):
        return _records_jsonl
    if name.endswith(".json"):
        return iter_json_list
    if name.endswith(".parquet"):
        return _records_parquet
    raise ValueError(f"unsupported data file {path!r}: expected .jsonl, .json or .parquet (optionally .gz for json)")


def read_records(path: str, limits: RowLimits = RowLimits()) -> Iterator[Record]:
    """(index, where, decoded object | RowError) for every record of one data file; a record over
    ``limits`` is a RowError (see `RowLimits`)."""
    reader = reader_for(path)
    return reader(path, limits=limits)

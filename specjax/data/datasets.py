"""What a data-file list names, read: training conversations (`read_conversations`) and evaluation
prompts (`load_eval_prompts`). An entry is a data file (.jsonl / .json / .parquet, json optionally
.gz), a folder of ``*.parquet`` shards or a dataset preset ``preset://NAME``; `resolve_data_paths`
checks every entry before any row is read. The file readers are `specjax.data.sources`, the presets
`specjax.data.presets`.
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from specjax.data.presets import PRESETS, bare_preset_name, check_preset, humaneval_user_turn, preset_file, preset_rows
from specjax.data.sources import (PRESET_SCHEME, Row, RowError, RowLimits, normalize_messages, read_records, reader_for,
                                  row_from_obj)

__all__ = ["EvalPrompt", "load_eval_prompts", "read_conversations", "resolve_data_paths"]

log = logging.getLogger("specjax")


@dataclasses.dataclass(frozen=True)
class EvalPrompt:
    """One evaluation prompt: ``turns`` are the user messages, answered one after another."""

    id: str
    dataset: str
    category: str
    turns: tuple[str, ...]


# ---------------------------------------------------------------------------------------------
# data-file lists
# ---------------------------------------------------------------------------------------------
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
            name = check_preset(p, allow_eval=allow_eval_presets)
            preset_file(name)  # asset package installed? (the error names the pip command)
            out.append(PRESET_SCHEME + name)
        elif os.path.isdir(p):
            out.extend(_parquet_shards(p))
        elif os.path.isfile(p):
            reader_for(p)  # unknown extension -> ValueError now
            out.append(p)
        else:
            hint = ""
            if p in PRESETS:
                hint = f" (for the dataset preset write {PRESET_SCHEME}{p})"
            raise FileNotFoundError(f"data file not found: {p}{hint}")
    return out


def _rows_of(entry: str, limits: RowLimits) -> Iterator[Row]:
    if entry.startswith(PRESET_SCHEME):
        yield from preset_rows(entry)  # packaged data, read under the default limits
        return
    for index, where, obj in read_records(entry, limits):
        if isinstance(obj, RowError):
            yield Row(entry, index, None, obj)
        else:
            yield row_from_obj(entry, index, where, obj)


def read_conversations(paths: str | os.PathLike | Iterable[str | os.PathLike], *,
                       allow_eval_presets: bool = False, limits: RowLimits | None = None) -> Iterator[Row]:
    """Yield a `Row` for every conversation in ``paths``, read in the given order.

    An entry is a data file (.jsonl / .json / .parquet, json optionally .gz), a folder of
    ``*.parquet`` shards (read in sorted order) or a dataset preset ``preset://NAME``.
    Evaluation presets (MT-bench, HumanEval) are refused unless ``allow_eval_presets``: this is the
    training-data reader, and a draft trained on its benchmark prompts reports inflated acceptance.

    Raises FileNotFoundError (naming the path) for a missing file, ValueError for an unknown
    extension, an empty shard folder or a refused preset -- at call time, before any row is read,
    so a typo in the last path fails before minutes of tokenizing. Bad rows are yielded with
    ``error`` set, among them the rows over ``limits`` (default `RowLimits()`)."""
    entries = resolve_data_paths(paths, allow_eval_presets=allow_eval_presets)
    limits = RowLimits() if limits is None else limits
    return (row for entry in entries for row in _rows_of(entry, limits))


# ---------------------------------------------------------------------------------------------
# evaluation prompts
# ---------------------------------------------------------------------------------------------
def _first_of(obj: dict, keys: tuple[str, ...], default):
    for k in keys:
        if obj.get(k) is not None:
            return obj[k]
    return default


def _prompt_from_record(obj, where: str) -> tuple[tuple[str, ...], str, str | None]:
    """(user turns, category, id or None) of one record of an evaluation file."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: an evaluation prompt must be a JSON object, got {type(obj).__name__}")
    category = str(obj.get("category") or "")
    rid = _first_of(obj, ("question_id", "task_id", "id"), None)
    rid = None if rid is None else str(rid)
    if obj.get("turns") is not None:  # MT-bench's question.jsonl layout
        turns = obj["turns"]
        if not isinstance(turns, (list, tuple)) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of strings")
        return tuple(turns), category, rid
    if obj.get("messages") is not None or obj.get("conversations") is not None:
        messages, err = normalize_messages(obj)
        if err is not None:
            raise ValueError(f"{where}: {err[0]} ({err[1]})")
        turns = tuple(m["content"] for m in messages if m["role"] == "user" and m["content"])
        if not turns:
            raise ValueError(f"{where}: the conversation has no user turn to prompt with")
        return turns, category, rid
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return (obj["prompt"],), category, rid
    raise ValueError(f"{where}: no prompt found; expected 'turns' (list of user messages), "
                     "'messages' / 'conversations' (chat) or 'prompt' (string)")


def _dataset_name(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    for ext in (".gz", ".jsonl", ".ndjson", ".json", ".parquet"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    return base or path


def _spread(prompts: list[EvalPrompt], limit: int | None) -> list[EvalPrompt]:
    """The first ``limit`` prompts taken round-robin over categories (in order of first appearance),
    so a small limit on MT-bench (sorted by category) still covers every category."""
    if limit is None or limit >= len(prompts):
        return prompts
    groups: OrderedDict[str, list[EvalPrompt]] = OrderedDict()
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    out: list[EvalPrompt] = []
    depth = 0
    while len(out) < limit:
        for items in groups.values():
            if depth < len(items) and len(out) < limit:
                out.append(items[depth])
        depth += 1
    return out


def load_eval_prompts(name_or_path: str, limit: int | None = None) -> list[EvalPrompt]:
    """Evaluation prompts of a preset (``mtbench``, ``humaneval``, also ``sharegpt``; bare or
    ``preset://``) or of a JSONL / JSON / parquet file or shard folder whose rows have ``turns``,
    ``messages`` / ``conversations`` (their user turns are used) or ``prompt``.

    ``limit``: at most that many prompts, picked round-robin over categories (so ``limit=8`` on
    MT-bench gives one prompt from each of its 8 categories); without categories, the first ones.
    A malformed row in an evaluation file is an error (evaluation sets are small and curated);
    ShareGPT's bad rows are skipped."""
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive or None, got {limit}")
    bare = bare_preset_name(name_or_path)
    if bare in PRESETS and (name_or_path.startswith(PRESET_SCHEME) or not os.path.exists(name_or_path)):
        path = preset_file(bare)
        if bare == "mtbench":
            prompts = []
            for _, where, obj in read_records(path):
                if isinstance(obj, RowError):
                    raise ValueError(f"MT-bench file: {obj}")
                turns, category, rid = _prompt_from_record(obj, where)
                prompts.append(EvalPrompt(rid or where, "mtbench", category, turns))
            return _spread(prompts, limit)
        if bare == "humaneval":
            prompts = []
            for _, where, obj in read_records(path):
                if isinstance(obj, RowError):
                    raise ValueError(f"HumanEval file: {obj}")
                if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                    raise ValueError(f"{where}: a HumanEval problem needs a 'prompt' string")
                prompts.append(EvalPrompt(str(obj.get("task_id", where)), "humaneval", "code",
                                          (humaneval_user_turn(obj["prompt"]),)))
                if limit is not None and len(prompts) >= limit:
                    break
            return prompts
        # sharegpt: the user turns of conversations that parse (a dirty dump: bad rows are skipped)
        prompts, skipped = [], 0
        for row in preset_rows(bare):
            turns = tuple(m["content"] for m in row.messages or () if m["role"] == "user" and m["content"])
            if not turns:
                skipped += 1
                continue
            prompts.append(EvalPrompt(f"sharegpt/{row.index}", "sharegpt", "", turns))
            if limit is not None and len(prompts) >= limit:
                break
        if skipped:
            log.info("sharegpt prompts: skipped %d rows without usable user turns", skipped)
        return prompts

    files = resolve_data_paths(name_or_path, allow_eval_presets=True)
    dataset = _dataset_name(name_or_path)
    prompts, any_category = [], False
    for path in files:
        for _, where, obj in read_records(path):
            if isinstance(obj, RowError):
                raise ValueError(f"evaluation prompts: {obj}")
            turns, category, rid = _prompt_from_record(obj, where)
            any_category |= bool(category)
            prompts.append(EvalPrompt(rid or where, dataset, category, turns))
            if limit is not None and len(prompts) >= limit and not any_category:
                return prompts  # no categories to spread over: the first ones, without reading on
    if not prompts:
        raise ValueError(f"{name_or_path}: no evaluation prompts found")
    return _spread(prompts, limit)

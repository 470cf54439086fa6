"""Where the conversations to regenerate come from: a dataset preset (`preset://sharegpt`, or the
bare name) or a JSONL / JSON / parquet path (or a directory of them, where the reader supports
it)."""
from __future__ import annotations

import os
from collections.abc import Iterator

from specjax.regen.common import RegenerateError

__all__ = ["PRESET_SCHEME", "canonical_input", "input_files", "iter_rows"]

PRESET_SCHEME = "preset://"


def _presets():
    try:
        from specjax.data import presets
    except ImportError as e:  # the presets module lands separately
        raise RegenerateError(f"dataset presets are not available in this installation ({e}); give a file path") from e
    return presets


def _preset_name(source: str) -> str | None:
    if source.startswith(PRESET_SCHEME):
        return source[len(PRESET_SCHEME):]
    if os.sep not in source and "." not in source and not os.path.exists(source):
        return source  # a bare name such as the config default "sharegpt"
    return None


def canonical_input(source: str) -> str:
    """The manifest's spelling of the input: `preset://NAME` or an absolute path."""
    if not source:
        raise RegenerateError("no input given: --input preset://sharegpt or a JSONL/JSON/parquet path "
                              "(config: regenerate.source)")
    name = _preset_name(source)
    if name is not None:
        presets = _presets()
        if name not in presets.PRESETS:
            raise RegenerateError(f"unknown dataset preset {name!r}; the presets are {list(presets.PRESETS)}, "
                                  "or give a JSONL/JSON/parquet path")
        if name in getattr(presets, "EVAL_PRESETS", ()):
            raise RegenerateError(
                f"{name!r} is an evaluation set; regenerating it would put it into the draft's training data. "
                f"Use a training source such as preset://sharegpt, or your own file"
            )
        return PRESET_SCHEME + name
    path = os.path.abspath(source)
    if not os.path.exists(path):
        raise RegenerateError(f"input not found: {source} (give an existing file, or preset://NAME)")
    return path


def input_files(source: str) -> list[str]:
    """The files the (canonical) input's conversations are read from: a preset's packaged file, the
    file itself, or a directory's parquet shards."""
    if source.startswith(PRESET_SCHEME):
        try:
            return [_presets().preset_file(source[len(PRESET_SCHEME):])]
        except FileNotFoundError as e:
            raise RegenerateError(str(e)) from e
    from specjax.data.datasets import resolve_data_paths

    try:
        return resolve_data_paths(source)
    except (FileNotFoundError, ValueError) as e:
        raise RegenerateError(str(e)) from e


def iter_rows(source: str, limits=None) -> Iterator:
    """specjax.data.sources.Row objects of the (canonical) input, in order; a file's rows over
    ``limits`` (a `specjax.data.sources.RowLimits`, default its defaults) are bad rows."""
    if source.startswith(PRESET_SCHEME):
        return iter(_presets().preset_rows(source[len(PRESET_SCHEME):]))
    from specjax.data.datasets import read_conversations

    try:
        return read_conversations(source, limits=limits)
    except (FileNotFoundError, ValueError) as e:
        raise RegenerateError(str(e)) from e

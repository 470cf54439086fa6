"""From data files to fixed-shape packed batches.

`prepare_examples` reads + tokenizes + splits (train/val) in one pass. `make_train_iterator`
builds an endless, checkpointable grain pipeline: per-host slice -> per-epoch deterministic
shuffle -> first-fit packing to a static length (segment ids + per-segment positions) -> batches.
`make_eval_batches` packs a list once, deterministically, for evaluation.

Packed batch (all int32 [B, T]): input_ids, loss_mask, segment_ids (0 = padding, 1..n per
document inside a row), positions (restart at 0 for every document).

Skipped rows: `Prepared.skips` lists every one (``file:N``, N counted from 1: the line of a JSONL
file, the row of a JSON list or parquet file; see `specjax.data.sources`), and `write_skip_report`
(or ``prepare_examples(..., skip_report_dir=run_dir)``) writes them all to
``<run_dir>/skipped_rows.jsonl``, one JSON object per row: ``{"where", "file", "row", "reason",
"detail"}`` (``row`` is N, or null for a problem of the whole file).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import grain
import numpy as np

from specjax.data.chat import (ChatTemplateUnusable, Example, SkipRow, TemplateLimits, resolve_chat_template,
                               tokenize_conversation)
from specjax.data.datasets import read_conversations
from specjax.data.sources import RowLimits, format_skip
from specjax.run_files import SKIP_REPORT_FILE

__all__ = ["Prepared", "Skip", "prepare_examples", "write_skip_report", "make_train_iterator",
           "make_eval_batches", "first_fit_rows", "split_is_val", "batches_per_epoch"]

log = logging.getLogger(__name__)

BATCH_KEYS = ("input_ids", "loss_mask", "segment_ids", "positions")
LOCATIONS = ("locations are file:N, N counted from 1: the line of a .jsonl file, the row of a .json list or a "
             ".parquet file")
_LOGGED_SKIPS = 5  # messages quoted in the log line and the no-usable-example error


class Skip(NamedTuple):
    """One skipped row. ``row`` is N of ``file:N`` (from 1), None for a problem of the whole file."""

    where: str
    file: str
    row: int | None
    reason: str
    detail: str

    @property
    def message(self) -> str:
        return format_skip(self.reason, self.where, self.detail)


@dataclasses.dataclass
class Prepared:
    train: list[Example]
    val: list[Example]
    skipped: dict[str, int]  # reason -> number of rows
    n_rows: int  # rows read (good and bad)
    skips: list[Skip] = dataclasses.field(default_factory=list)  # every skipped row, in reading order

    @property
    def skip_messages(self) -> list[str]:
        """Every skip as one line, ``file:N: reason (detail)``."""
        return [s.message for s in self.skips]


def split_is_val(source: str, index: int, seed: int, val_fraction: float, group: str | None = None) -> bool:
    """Deterministic train/val assignment of one row. Uses the file's base name, so the split does
    not change when the data directory moves or is given as a relative path. Rows with a ``group``
    (``Row.group``: a regenerated conversation's windows and last row share their ``source_index``)
    are assigned by the group, so turns two rows share never sit on both sides."""
    if val_fraction <= 0:
        return False
    key = (f"{group}\x00{seed}" if group is not None else f"{os.path.basename(source)}\x00{index}\x00{seed}").encode()
    u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") / 2.0**64
    return u < val_fraction


def prepare_examples(
    paths: str | os.PathLike | Iterable[str | os.PathLike],
    tokenizer,
    seq_length: int,
    val_fraction: float,
    seed: int,
    max_rows: int | None = None,
    truncate: bool = True,
    chat_template: str | None = None,
    *,
    mask_reasoning_content: bool = False,
    mask_generation_prompt: bool = False,
    skip_report_dir: str | os.PathLike | None = None,
    workers: int = 0,
    inline_s: float | None = None,
    row_limits: RowLimits | None = None,
    template_limits: TemplateLimits | None = None,
    template_variables: dict | None = None,
) -> Prepared:
    """Read, template, tokenize and split. Bad rows are counted in ``skipped`` and listed in
    ``skips``, never raised; a missing file, a tokenizer without a chat template, or no usable
    example at all raise. The two mask flags are `data.mask_reasoning_content` /
    `data.mask_generation_prompt` (see `specjax.data.chat`). With ``skip_report_dir`` (the run
    folder) every skipped row is written to ``<skip_report_dir>/skipped_rows.jsonl`` (see
    `write_skip_report`), also when no usable example is left, and the log line names the file.

    ``workers`` > 1 templates and tokenizes in that many processes (`data.prepare_workers`), in chunks
    of rows: the first ``inline_s`` seconds of rows (default `PARALLEL_AFTER_S`) are done here, so
    small data never waits for workers to start, and the rows left after that go to the workers. The
    result is the same in every respect: examples, skips and their order.

    ``row_limits`` (`data.max_row_bytes`, `data.max_row_depth`) make an oversized or too deeply nested
    row a counted skip (see `specjax.data.sources`); ``template_limits`` (`data.template_time_limit_s`,
    `data.max_template_chars`) bound every rendering of the chat template: a rendering past one raises
    ChatTemplateLimitExceeded, naming the template, the limit and the first row it happened on (see
    `specjax.data.chat`). Both default to the config defaults. ``template_variables``
    (`data.chat_template_kwargs`) are given to every rendering."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_rows is not None and max_rows <= 0:
        raise ValueError(f"max_rows must be positive or None, got {max_rows}")
    # fail before reading anything
    template = resolve_chat_template(tokenizer, chat_template, template_limits, template_variables)

    train: list[Example] = []
    val: list[Example] = []
    skipped: dict[str, int] = {}
    skips: list[Skip] = []
    n_rows = 0

    def skip(row, reason: str, where: str, detail: str):
        skipped[reason] = skipped.get(reason, 0) + 1
        source = str(row.source)
        skips.append(Skip(where, source, None if where == source else int(row.index) + 1, reason, detail))

    def rows():
        nonlocal n_rows
        for row in read_conversations(paths, limits=row_limits):
            if max_rows is not None and n_rows >= max_rows:
                return
            n_rows += 1
            yield row

    options = _TokenizeOptions(seq_length, truncate, template, mask_reasoning_content, mask_generation_prompt)
    outcomes = _tokenized(rows(), tokenizer, options, workers, inline_s)
    try:
        for row, outcome in outcomes:
            if row.error is not None:
                err = row.error
                where = getattr(err, "where", None)
                if where is None:  # a plain string error from another reader
                    skip(row, getattr(err, "kind", "bad row"), f"{row.source}:{row.index + 1}", str(err))
                else:
                    skip(row, err.kind, where, err.detail)
                continue
            if isinstance(outcome, SkipRow):
                skip(row, outcome.reason, f"{row.source}:{row.index + 1}", outcome.detail)
                continue
            if isinstance(outcome, ChatTemplateUnusable):  # the config's or the machine's problem: stop here
                raise type(outcome)(f"{outcome} (first met rendering {row.source}:{row.index + 1})") from outcome
            ex = dataclasses.replace(outcome, source=str(row.source), row=int(row.index) + 1)  # as in file:N
            (val if split_is_val(row.source, row.index, seed, val_fraction, row.group) else train).append(ex)
    finally:
        outcomes.close()  # stops the workers now when the loop ends early, not when the traceback goes

    prepared = Prepared(train=train, val=val, skipped=skipped, n_rows=n_rows, skips=skips)
    first = [s.message for s in skips[:_LOGGED_SKIPS]]
    listed = ""
    if skip_report_dir is not None:
        path = _write_report(skips, skip_report_dir)
        listed = f"all {len(skips)} are listed in {path} ({LOCATIONS}); "
    if skipped:
        log.warning("skipped %d of %d rows %s; %sfirst %d: %s", len(skips), n_rows, skipped, listed, len(first), first)
    if not train:
        raise ValueError(
            f"no usable training example: {n_rows} rows read, {len(val)} went to validation, "
            f"skipped {skipped}; first problems: {first}"
            + (f"; all {len(skips)} skipped rows are listed in {path}" if skip_report_dir is not None else "")
        )
    return prepared


# ---------------------------------------------------------------------------------------------
# Templating + tokenizing, here or in worker processes. Rendering a chat template is Python (jinja2)
# and tokenizing one text is one thread, ~4 ms a ShareGPT row on an H200 host: 128 s for the 32,713
# rows of the full SmolLM2 recipe (benchmarks/results/smollm2_eagle3.md). Rows are independent, so
# chunks of them go to processes; reading, splitting and skip bookkeeping stay here, in order.

# in-process for this long first: data that is done by then never pays for starting workers (each
# imports transformers, seconds); the rows still left then go to the workers
PARALLEL_AFTER_S = 5.0
_CHUNK_ROWS = 256  # rows per task: pickling a chunk is small next to ~1 s of work in it


class _TokenizeOptions(NamedTuple):
    seq_length: int
    truncate: bool
    template: str
    mask_reasoning_content: bool
    mask_generation_prompt: bool


def _tokenize_one(tokenizer, messages: list[dict], o: _TokenizeOptions) -> Example | SkipRow | ChatTemplateUnusable:
    """The row's example, or why not: a SkipRow (counted), or a ChatTemplateUnusable that stops the run
    (returned, so the caller can say which row met it, also from a worker)."""
    try:
        return tokenize_conversation(
            tokenizer, messages, o.seq_length, truncate=o.truncate, chat_template=o.template,
            mask_reasoning_content=o.mask_reasoning_content, mask_generation_prompt=o.mask_generation_prompt,
        )
    except SkipRow as e:
        return SkipRow(e.reason, e.detail)
    except ChatTemplateUnusable as e:
        return e


_worker: tuple | None = None  # (tokenizer, options) of a worker process


def _init_worker(tokenizer, options: _TokenizeOptions) -> None:
    """`tokenizer`: the tokenizer object, or the folder a transformers tokenizer was saved to (see
    `_tokenized`)."""
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one text at a time per process: no thread pool
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    _worker = (tokenizer, options)


def _saved_for_workers(tokenizer, folder: str) -> str | None:
    """Save a transformers tokenizer to `folder` for the workers to load; None for any other object
    (it then travels as a start argument)."""
    if type(tokenizer).__module__.split(".")[0] != "transformers" or not hasattr(tokenizer, "save_pretrained"):
        return None
    tokenizer.save_pretrained(folder)
    return folder


def _tokenize_chunk(chunk: list[list[dict] | None]) -> list[Example | SkipRow | ChatTemplateUnusable | None]:
    tokenizer, options = _worker
    out = []
    for m in chunk:
        out.append(None if m is None else _tokenize_one(tokenizer, m, options))
        if isinstance(out[-1], ChatTemplateUnusable):
            break  # the run stops at this row: the rest of the chunk is not worth a time limit each
    return out


def _tokenized(rows, tokenizer, options: _TokenizeOptions, workers: int, inline_s: float | None):
    """(row, Example | SkipRow | ChatTemplateUnusable | None) for every row, in reading order; None for
    a row the reader already failed. A ChatTemplateUnusable (the machine's or the config's problem)
    ends the rows: the caller raises it."""
    rows = iter(rows)
    deadline = time.perf_counter() + (PARALLEL_AFTER_S if inline_s is None else inline_s)
    for row in rows:
        yield row, (None if row.error is not None else _tokenize_one(tokenizer, row.messages, options))
        if workers > 1 and time.perf_counter() >= deadline:
            break
    else:
        return
    head = list(itertools.islice(rows, 1))
    if not head:  # the data ended with the deadline
        return

    import multiprocessing

    def chunks():
        stream = itertools.chain(head, rows)
        while chunk := list(itertools.islice(stream, _CHUNK_ROWS)):
            yield chunk

    import tempfile

    # spawn, not fork: the parent holds JAX's threads (and maybe tokenizers' pool), which fork copies
    # in an undefined state. A transformers tokenizer goes to the workers as a saved folder, not as a
    # start argument: the pool starts its workers one by one, and a start writes the arguments into
    # the new process's pipe, which blocks until that process has read them, i.e. has imported
    # specjax and transformers (SmolLM2's tokenizer pickles to 1.6 MB, far over a pipe's 64 KiB):
    # 2.6 s per worker on the 2-core CPU machine, so the workers started one after another. The full
    # SmolLM2 recipe spent 111 s here with 16 workers on the H200 host (2026-12-03).
    ctx = multiprocessing.get_context("spawn")
    log.info("data: templating and tokenizing in %d worker processes (data.prepare_workers)", workers)
    with tempfile.TemporaryDirectory(prefix="specjax_prepare_") as tmp:
        sent = _saved_for_workers(tokenizer, tmp) or tokenizer
        yield from _tokenized_in_workers(chunks(), ctx, workers, sent, options)


def _tokenized_in_workers(chunks, ctx, workers: int, tokenizer, options: _TokenizeOptions):
    import concurrent.futures

    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                   initargs=(tokenizer, options))
    try:
        pending = []  # (rows, future), oldest first; at most 2 chunks per worker in flight
        for chunk in chunks:
            pending.append((chunk, pool.submit(_tokenize_chunk, [r.messages if r.error is None else None
                                                                 for r in chunk])))
            if len(pending) >= 2 * workers:
                done_rows, fut = pending.pop(0)
                yield from zip(done_rows, fut.result())
        for done_rows, fut in pending:
            yield from zip(done_rows, fut.result())
    finally:
        # when the caller stops early (a ChatTemplateUnusable), queued chunks are dropped and the
        # running ones end at their first row that meets it, instead of all of them running to the end
        pool.shutdown(wait=True, cancel_futures=True)


def _write_report(skips: Sequence[Skip], out_dir: str | os.PathLike) -> str:
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, SKIP_REPORT_FILE)
    # Every process of a multi-host run writes the same list: a private temporary name, then an atomic
    # rename, so readers never see a half-written file and writers do not interleave.
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for s in skips:
            f.write(json.dumps({"where": s.where, "file": s.file, "row": s.row, "reason": s.reason,
                                "detail": s.detail}) + "\n")
    os.replace(tmp, path)
    return path


def write_skip_report(prepared: Prepared, out_dir: str | os.PathLike) -> str:
    """Write every skipped row of ``prepared`` to ``<out_dir>/skipped_rows.jsonl`` (one JSON object
    a line: where, file, row, reason, detail; an empty file when nothing was skipped, so a stale list
    from an earlier run does not survive) and log where it is. Returns the path."""
    path = _write_report(prepared.skips, out_dir)
    if prepared.skips:
        log.warning("all %d skipped rows are listed in %s (%s)", len(prepared.skips), path, LOCATIONS)
    return path


def _check_lengths(examples: Sequence[Example], seq_length: int) -> None:
    for i, ex in enumerate(examples):
        n = len(ex.input_ids)
        if n == 0 or n > seq_length:
            raise ValueError(
                f"example {i} has {n} tokens; packing needs 1..seq_length={seq_length} "
                "(prepare the examples with the same seq_length)"
            )


def _features(item: tuple[int, Example]) -> dict[str, np.ndarray]:
    # example_ids (index into the host's example list, +1; 0 = padding) lets a bad batch be traced
    # back to its source rows; it stays on the host
    i, ex = item
    return {"input_ids": ex.input_ids, "loss_mask": ex.loss_mask,
            "example_ids": np.full(ex.input_ids.shape, i + 1, np.int32)}


def _rename_packed(x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    # grain names its metadata "<feature>_segment_ids" / "<feature>_positions"; both features are
    # packed identically, so one copy is kept. grain already uses 0 for padding cells.
    if "input_ids_segment_ids" not in x or "input_ids_positions" not in x:
        raise KeyError(
            f"grain's packer returned keys {sorted(x)}; expected 'input_ids_segment_ids' and "
            "'input_ids_positions' (a grain version with different packing output names?)"
        )
    return {
        "input_ids": x["input_ids"].astype(np.int32, copy=False),
        "loss_mask": x["loss_mask"].astype(np.int32, copy=False),
        "segment_ids": x["input_ids_segment_ids"].astype(np.int32, copy=False),
        "positions": x["input_ids_positions"].astype(np.int32, copy=False),
        "example_ids": x["example_ids"].astype(np.int32, copy=False),
    }


def _packed_rows(
    examples: Sequence[Example],
    seq_length: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: int | None = None,
    num_packing_bins: int = 8,
    groups: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
    pool=None,
) -> grain.IterDataset:
    """Unbatched packed rows of this host's shard ([T] per feature). With `weights`, example i belongs
    to group `groups[i]` (its data.train_files entry): each group is shuffled and repeated on its own
    and the groups are mixed in proportion to `weights` (grain's MapDataset.mix), endlessly. With
    `pool` (a `specjax.train.regen_rounds.RegenPool`), the k-th drawn (index, example) goes through
    `pool.current(k, item)`, which may give the index's regenerated example instead."""
    if shard_count <= 0 or not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    if pool is not None and shard_count != 1:
        raise ValueError("a regeneration pool replaces examples by their index in the whole training list; "
                         f"it needs one global iterator (shard_count=1), got shard_count={shard_count}")
    local = list(examples[shard_index::shard_count])
    if not local:
        raise ValueError(
            f"host shard {shard_index}/{shard_count} has no example ({len(examples)} examples in total)"
        )
    _check_lengths(local, seq_length)
    if weights is None:
        ds = grain.MapDataset.source(list(enumerate(local)))
        # shuffle before repeat: grain folds the epoch number into the seed, so every epoch gets a
        # different but reproducible order.
        ds = ds.shuffle(seed=int(seed) % 2**32).repeat(num_epochs)
    else:
        local_groups = list(groups[shard_index::shard_count])
        parts = []
        for g in range(len(weights)):
            members = [(i, ex) for i, (ex, eg) in enumerate(zip(local, local_groups)) if eg == g]
            if not members:
                raise ValueError(f"data.train_files entry {g} has no training example on host shard "
                                 f"{shard_index}/{shard_count}, so it cannot get weight {weights[g]}")
            parts.append(grain.MapDataset.source(members).shuffle(seed=(int(seed) + g) % 2**32).repeat(None))
        ds = grain.MapDataset.mix(parts, [float(w) for w in weights])
    if pool is not None:
        ds = ds.map_with_index(pool.current)
    ds = ds.map(_features)
    # Everything is already in memory; reader threads would only add GIL contention.
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={"input_ids": seq_length, "loss_mask": seq_length, "example_ids": seq_length},
        num_packing_bins=num_packing_bins,
        shuffle_bins=False,  # the input order is already shuffled
    )
    return ds.map(_rename_packed)


def make_train_iterator(
    examples: Sequence[Example],
    seq_length: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    *,
    num_packing_bins: int | None = None,
    groups: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
    pool=None,
):
    """Endless iterator of packed [batch_size, seq_length] numpy batches for this host (`groups` /
    `weights`: data.train_file_weights, `pool`: regenerate.every_steps, see `_packed_rows`).

    This host reads ``examples[shard_index::shard_count]`` (disjoint across hosts, together all).
    The returned grain iterator has get_state()/set_state() (a small dict of ints) for exact
    resume. ``num_packing_bins`` (default: batch_size) trades packing density for memory."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    bins = batch_size if num_packing_bins is None else int(num_packing_bins)
    ds = _packed_rows(examples, seq_length, seed, shard_index, shard_count, None, bins, groups, weights, pool)
    return iter(ds.batch(batch_size, drop_remainder=True))


def batches_per_epoch(examples: Sequence[Example], seq_length: int, batch_size: int) -> int:
    """Packed batches in one pass over `examples`, first-fit packed in order as `make_eval_batches`
    packs them. The training stream packs a shuffled order with `batch_size` open bins, so its rows
    can be a little less full: `train.epochs` therefore means at least that many passes' worth of
    batches as counted here, about that many passes in practice."""
    return len(make_eval_batches(examples, seq_length, batch_size))


def _empty_batch(batch_size: int, seq_length: int) -> dict[str, np.ndarray]:
    return {k: np.zeros((batch_size, seq_length), np.int32) for k in BATCH_KEYS}


def first_fit_rows(examples: Sequence[Example], seq_length: int) -> list[list[int]]:
    """The example indices of each packed row, first-fit in the given order (make_eval_batches'
    rows; a row's segments 1, 2, ... are its indices in this order)."""
    _check_lengths(examples, seq_length)
    free = np.zeros(0, dtype=np.int64)  # free cells per row
    rows: list[list[int]] = []
    for i, ex in enumerate(examples):
        n = len(ex.input_ids)
        fits = np.flatnonzero(free >= n)
        if fits.size:
            r = int(fits[0])
        else:
            r = len(rows)
            rows.append([])
            free = np.append(free, seq_length)
        rows[r].append(i)
        free[r] -= n
    return rows


def make_eval_batches(
    examples: Sequence[Example], seq_length: int, batch_size: int
) -> list[dict[str, np.ndarray]]:
    """Every example exactly once, first-fit packed in the given order, padded to whole batches
    (padding rows are all segment 0). Same input -> same batches."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    rows = first_fit_rows(examples, seq_length)
    batches = []
    for b0 in range(0, len(rows), batch_size):
        batch = _empty_batch(batch_size, seq_length)
        for r, row in enumerate(rows[b0 : b0 + batch_size]):
            at = 0
            for seg, i in enumerate(row, start=1):
                ex = examples[i]
                n = len(ex.input_ids)
                batch["input_ids"][r, at : at + n] = ex.input_ids
                batch["loss_mask"][r, at : at + n] = ex.loss_mask
                batch["segment_ids"][r, at : at + n] = seg
                batch["positions"][r, at : at + n] = np.arange(n, dtype=np.int32)
                at += n
        batches.append(batch)
    return batches

"""From data files to fixed-shape packed batches.

`prepare_examples` reads + tokenizes + splits (train/val) in one pass. `make_train_iterator`
builds an endless, checkpointable grain pipeline: per-host slice -> per-epoch deterministic
shuffle -> first-fit packing to a static length (segment ids + per-segment positions) -> batches.
`make_eval_batches` packs a list once, deterministically, for evaluation.

Packed batch (all int32 [B, T]): input_ids, loss_mask, segment_ids (0 = padding, 1..n per
document inside a row), positions (restart at 0 for every document).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Iterable, Sequence

import grain
import numpy as np

from specjax.data.chat import Example, SkipRow, resolve_chat_template, tokenize_conversation
from specjax.data.sources import read_conversations

__all__ = ["Prepared", "prepare_examples", "make_train_iterator", "make_eval_batches", "split_is_val"]

log = logging.getLogger(__name__)

BATCH_KEYS = ("input_ids", "loss_mask", "segment_ids", "positions")
_MAX_KEPT_MESSAGES = 100


@dataclasses.dataclass
class Prepared:
    train: list[Example]
    val: list[Example]
    skipped: dict[str, int]  # reason -> number of rows
    n_rows: int  # rows read (good and bad)
    # The first few full skip messages (with file:line) so a log can show where the problems are.
    skip_messages: list[str] = dataclasses.field(default_factory=list)


def split_is_val(source: str, index: int, seed: int, val_fraction: float) -> bool:
    """Deterministic train/val assignment of one row. Uses the file's base name, so the split does
    not change when the data directory moves or is given as a relative path."""
    if val_fraction <= 0:
        return False
    key = f"{os.path.basename(source)}\x00{index}\x00{seed}".encode()
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
) -> Prepared:
    """Read, template, tokenize and split. Bad rows are counted in ``skipped``, never raised;
    a missing file, a tokenizer without a chat template, or no usable example at all raise.
    The two mask flags are `data.mask_reasoning_content` / `data.mask_generation_prompt`
    (see `specjax.data.chat`)."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_rows is not None and max_rows <= 0:
        raise ValueError(f"max_rows must be positive or None, got {max_rows}")
    template = resolve_chat_template(tokenizer, chat_template)  # fail before reading anything

    train: list[Example] = []
    val: list[Example] = []
    skipped: dict[str, int] = {}
    messages: list[str] = []
    n_rows = 0

    def skip(reason: str, message: str):
        skipped[reason] = skipped.get(reason, 0) + 1
        if len(messages) < _MAX_KEPT_MESSAGES:
            messages.append(message)

    for row in read_conversations(paths):
        if max_rows is not None and n_rows >= max_rows:
            break
        n_rows += 1
        if row.error is not None:
            skip(getattr(row.error, "kind", "bad row"), str(row.error))
            continue
        try:
            ex = tokenize_conversation(
                tokenizer, row.messages, seq_length, truncate=truncate, chat_template=template,
                mask_reasoning_content=mask_reasoning_content, mask_generation_prompt=mask_generation_prompt,
            )
        except SkipRow as e:
            skip(e.reason, f"{row.source}[{row.index}]: {e}")
            continue
        ex = dataclasses.replace(ex, source=str(row.source), row=int(row.index))
        (val if split_is_val(row.source, row.index, seed, val_fraction) else train).append(ex)

    if skipped:
        log.warning(
            "skipped %d of %d rows: %s; first: %s",
            sum(skipped.values()), n_rows, skipped, messages[: min(5, len(messages))],
        )
    if not train:
        raise ValueError(
            f"no usable training example: {n_rows} rows read, {len(val)} went to validation, "
            f"skipped {skipped}; first problems: {messages[:5]}"
        )
    return Prepared(train=train, val=val, skipped=skipped, n_rows=n_rows, skip_messages=messages)


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
) -> grain.IterDataset:
    """Unbatched packed rows of this host's shard ([T] per feature)."""
    if shard_count <= 0 or not 0 <= shard_index < shard_count:
        raise ValueError(f"need 0 <= shard_index < shard_count, got {shard_index}, {shard_count}")
    local = list(examples[shard_index::shard_count])
    if not local:
        raise ValueError(
            f"host shard {shard_index}/{shard_count} has no example ({len(examples)} examples in total)"
        )
    _check_lengths(local, seq_length)
    ds = grain.MapDataset.source(list(enumerate(local)))
    # shuffle before repeat: grain folds the epoch number into the seed, so every epoch gets a
    # different but reproducible order.
    ds = ds.shuffle(seed=int(seed) % 2**32).repeat(num_epochs).map(_features)
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
):
    """Endless iterator of packed [batch_size, seq_length] numpy batches for this host.

    This host reads ``examples[shard_index::shard_count]`` (disjoint across hosts, together all).
    The returned grain iterator has get_state()/set_state() (a small dict of ints) for exact
    resume. ``num_packing_bins`` (default: batch_size) trades packing density for memory."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    bins = batch_size if num_packing_bins is None else int(num_packing_bins)
    ds = _packed_rows(examples, seq_length, seed, shard_index, shard_count, None, bins)
    return iter(ds.batch(batch_size, drop_remainder=True))


def _empty_batch(batch_size: int, seq_length: int) -> dict[str, np.ndarray]:
    return {k: np.zeros((batch_size, seq_length), np.int32) for k in BATCH_KEYS}


def make_eval_batches(
    examples: Sequence[Example], seq_length: int, batch_size: int
) -> list[dict[str, np.ndarray]]:
    """Every example exactly once, first-fit packed in the given order, padded to whole batches
    (padding rows are all segment 0). Same input -> same batches."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
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

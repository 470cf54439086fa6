"""Training from an offline state cache (target.source: cache): what a cache must have been written
from (`cache_fields`), the packed rows it holds (`packed_rows`), the training iterator over its rows
(`make_cache_iterator`: grain, shuffled per epoch, resumable with get_state / set_state as the online
iterator) and the validation batches (`cache_val_batches`). An FP8 cache's training rows reach the
device as stored and are dequantized there (`place_host_rows`): on the host, the float8 -> float32
conversion was the slowest part of a cache-fed step (one H100, Llama-3.1-8B shape, 4 x 4096:
1.92 s a step from an FP8 cache against 0.61 s from a bf16 one and 0.59 s for the step alone).

The rows are the prepared examples first-fit packed in order (as the validation batches are
packed online); training shuffles whole rows per epoch. A cache records the fields below; a run
whose fields differ is refused with each difference named (`open_checked_cache`).

A cache imported from a foreign dump (`python -m specjax.import_states`: a speculators /
hs-connectors folder) was not made from this run's data config: its manifest has an `origin` field
(the dump and the sha256 of its token ids and loss masks). Training from it checks only what it
can, FOREIGN_CHECKED (the target, the tokenizer, data.seq_length and the taps), logs that the data
fields are not checked, and takes its examples (the draft vocabulary's token counts) from the
cache's rows instead of data.train_files (`examples_from_cache`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np

from specjax import checkpoint as ckpt
from specjax.data.chat import resolve_chat_template
from specjax.data.pipeline import make_eval_batches
from specjax.data.state_cache import StateCache, manifest_differences
from specjax.run_files import VOCAB_FILE
from specjax.train.setup import tokenizer_files

log = logging.getLogger("specjax")

__all__ = ["FOREIGN_CHECKED", "HostRows", "cache_fields", "cache_origin", "cache_val_batches", "check_cache_settings",
           "check_cache_vocab", "describe", "examples_from_cache", "foreign_cache_fields", "make_cache_iterator",
           "open_checked_cache", "packed_rows", "place_host_rows", "target_fingerprint", "tokenizer_fingerprint"]

# the fields a foreign (imported) cache is checked on: what this run's data config did not decide
FOREIGN_CHECKED = ("target", "tokenizer", "data.seq_length", "aux_layer_ids", "precompute.teacher_top_k")


def _sha_files(paths: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(os.path.basename(p).encode())
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def target_fingerprint(path: str) -> str:
    """sha256 of the target's config.json and of its weight files' names and sizes (not their bytes:
    a 1 TB target is not read twice to name it)."""
    h = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(f.read())
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            h.update(f"{name}:{os.path.getsize(os.path.join(path, name))}".encode())
    return h.hexdigest()


def cache_fields(cfg, prepared, tokenizer, aux_layer_ids: Sequence[int]) -> dict:
    """What a state cache depends on: the target, the tokenizer and chat template, the prepared
    examples (their token ids and loss masks: the data files, templating, masking, truncation and
    split), the row length, the taps and the target's dtype."""
    template = resolve_chat_template(tokenizer, cfg.data.chat_template)  # its kwargs: a field of their own
    return {
        "target": target_fingerprint(cfg.target.path),
        "target.dtype": cfg.target.dtype,
        "tokenizer": tokenizer_fingerprint(cfg),
        "chat_template": hashlib.sha256(str(template).encode()).hexdigest(),
        "train_examples": ckpt.examples_sha256(prepared.train),
        "val_examples": ckpt.examples_sha256(prepared.val),
        "data.seq_length": int(cfg.data.seq_length),
        "data.mask_reasoning_content": cfg.data.mask_reasoning_content,
        "data.mask_generation_prompt": cfg.data.mask_generation_prompt,
        "data.chat_template_kwargs": dict(sorted(cfg.data.chat_template_kwargs.items())),
        "aux_layer_ids": [int(i) for i in aux_layer_ids],
        "precompute.teacher_top_k": int(cfg.precompute.teacher_top_k),
    }


def check_cache_vocab(cfg, vocab) -> None:
    """A top-k teacher is indexed by the draft vocabulary it was written with: this run's must be it."""
    cache = StateCache.open(cfg.target.cache_dir)
    want = cache.manifest.get("draft_vocab_sha256")
    if cache.teacher_top_k and want != ckpt.vocab_sha256(vocab):
        raise ValueError(
            f"the state cache at {cfg.target.cache_dir} holds a top-{cache.teacher_top_k} teacher over another draft "
            f"vocabulary than this run's. Fix: draft.vocab_file={os.path.join(cfg.target.cache_dir, VOCAB_FILE)} "
            "(the one precompute wrote), with a new run.output_dir if this one has its own draft_vocab.npz")


def tokenizer_fingerprint(cfg) -> str:
    """sha256 of the tokenizer files (data.tokenizer, else the target folder's)."""
    tok_dir = cfg.data.tokenizer or cfg.target.path
    tok = [os.path.join(tok_dir, f) for f in tokenizer_files(tok_dir)] if os.path.isdir(tok_dir) else []
    return _sha_files(tok) if tok else str(tok_dir)


def foreign_cache_fields(cfg, aux_layer_ids: Sequence[int], origin: str) -> dict:
    """The fields of a cache imported from a dump this run's data config did not make: FOREIGN_CHECKED
    and the `origin`."""
    return {"origin": origin, "target": target_fingerprint(cfg.target.path), "tokenizer": tokenizer_fingerprint(cfg),
            "data.seq_length": int(cfg.data.seq_length), "aux_layer_ids": [int(i) for i in aux_layer_ids],
            # an imported dump holds the final hidden; a run asking for a top-k teacher is refused by name
            "precompute.teacher_top_k": int(cfg.precompute.teacher_top_k)}


def cache_origin(cfg) -> str | None:
    """The `origin` of target.cache_dir's cache (an imported dump), None for one precompute wrote."""
    path = os.path.join(cfg.target.cache_dir or "", "manifest.json")
    if not cfg.target.cache_dir or not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("fields", {}).get("origin")


def examples_from_cache(cache: StateCache):
    """The examples of an imported cache, one per (row, segment), train and val (a Prepared)."""
    from specjax.data.chat import Example
    from specjax.data.pipeline import Prepared

    out = {}
    for split in ("train", "val"):
        out[split] = []
        if not cache.rows(split):
            continue
        arrays = cache.split(split).arrays
        ids, mask, seg = (arrays[k].read().result() for k in ("input_ids", "loss_mask", "segment_ids"))
        for r in range(ids.shape[0]):
            for s in range(1, int(seg[r].max()) + 1):
                at = seg[r] == s
                out[split].append(Example(ids[r][at].astype(np.int32), mask[r][at].astype(np.int32),
                                          source=cache.path, row=len(out[split]) + 1))
    return Prepared(train=out["train"], val=out["val"], skipped={}, n_rows=len(out["train"]) + len(out["val"]))


def packed_rows(examples, seq_length: int) -> list[dict]:
    """The examples first-fit packed in order into [seq_length] rows (token arrays)."""
    return [{k: v[0] for k, v in b.items()} for b in make_eval_batches(examples, seq_length, 1)]


def check_cache_settings(cfg) -> None:
    """With target.source=cache, the settings that need the whole target in this process are refused
    before anything is loaded: decode_eval's jax backend and the regeneration stage."""
    if cfg.target.source != "cache":
        return
    if not cfg.target.cache_dir:
        raise ValueError("target.source=cache needs target.cache_dir: the folder `python -m specjax.precompute "
                         "--config <this config>` writes")
    if (cfg.decode_eval.every_steps or cfg.decode_eval.at_end) and cfg.decode_eval.backend == "jax":
        raise ValueError("decode_eval.backend=jax decodes with the target, which a run with target.source=cache does "
                         "not load. Fix: decode_eval.backend=vllm (a separate server), or decode_eval.every_steps=0 "
                         "and decode_eval.at_end=false")
    if cfg.data.train_file_weights:
        raise ValueError("data.train_file_weights mixes the training files in the online stream; a state cache's "
                         "rows are packed from all of them once. Fix: leave data.train_file_weights empty with "
                         "target.source=cache")
    if cfg.regenerate.enabled:
        raise ValueError("regenerate.enabled runs the target, which a run with target.source=cache does not load. "
                         "Fix: regenerate first (python -m specjax.regenerate), precompute the cache on its output, "
                         "then train with regenerate.enabled=false")


def open_checked_cache(cfg, fields: dict) -> StateCache:
    """target.cache_dir's cache, complete and written for `fields`, else a ValueError naming each
    differing field (or the rows still to write) and the fix."""
    if not cfg.target.cache_dir:
        raise ValueError("target.source=cache needs target.cache_dir: the folder `python -m specjax.precompute "
                         "--config <this config>` wrote")
    cache = StateCache.open(cfg.target.cache_dir)
    origin = cache.fields.get("origin")
    if origin is not None:  # imported: only what this run can know about the dump is compared
        diffs = manifest_differences({k: cache.fields.get(k) for k in FOREIGN_CHECKED},
                                     {k: fields.get(k) for k in FOREIGN_CHECKED})
        if not diffs:
            log.info("state cache %s was imported (%s): checked %s; its examples, chat template, loss masks and "
                     "split are the dump's, not data.*'s", cfg.target.cache_dir, origin, list(FOREIGN_CHECKED))
    else:
        diffs = manifest_differences(cache.fields, fields)
    if diffs:
        raise ValueError(
            f"the state cache at {cfg.target.cache_dir} was written for other settings or data:\n  "
            + "\n  ".join(diffs)
            + "\nFix: put those settings back, or write a cache for this config with `python -m specjax.precompute "
              "--config <this config> target.cache_dir=<new folder>`")
    for split in ("train", "val"):
        if cache.rows(split) and not cache.split(split).done().all():
            left = int((~cache.split(split).done()).sum())
            raise ValueError(f"the state cache at {cfg.target.cache_dir} is unfinished: {left} of {cache.rows(split)} "
                             f"{split} rows are not written. Fix: rerun `python -m specjax.precompute` with the same "
                             "config (it continues where it stopped)")
    return cache


class HostRows(dict):
    """A batch holding only this process's rows of the global batch (a cache-fed run's host reads no
    other host's states); the loop places it as this process's part of the global array
    (`place_host_rows`). From an FP8 cache its states are as stored, float8 values beside their
    per-token scales (`*_scale`), which `place_host_rows` turns into `state_dtype` on the device."""

    state_dtype: object = None


class _ReadHostRows(grain.transforms.Map):
    def __init__(self, split, state_dtype, process_index: int, process_count: int):
        self.split, self.state_dtype = split, state_dtype
        self.index, self.count = int(process_index), int(process_count)

    def map(self, rows):
        n = len(rows) // self.count
        out = HostRows(self.split.read_rows(rows[self.index * n:(self.index + 1) * n], self.state_dtype,
                                            dequantize=False))
        out.state_dtype = self.state_dtype
        return out


@functools.partial(jax.jit, static_argnames="dtype")
def _dequantize(values, scale, dtype):
    # the host decoder's arithmetic (state_cache.dequantize_per_token, then the cast): the same numbers
    return (values.astype(jnp.float32) * scale[..., None]).astype(dtype)


def place_host_rows(rows: HostRows, sharding, keys: Sequence[str]) -> dict:
    """`keys` of this process's rows as global arrays on `sharding` (the batch sharding: rows split over
    the processes); an FP8 cache's states dequantized on the device to the rows' `state_dtype`."""
    def put(k):
        return jax.make_array_from_process_local_data(sharding, np.asarray(rows[k]))

    out = {k: put(k) for k in keys}
    for k in keys:
        scale = k.replace("hidden", "scale")
        if k.endswith("_hidden") and scale in rows:
            out[k] = _dequantize(out[k], put(scale), dtype=np.dtype(rows.state_dtype))
    return out


def make_cache_iterator(cache: StateCache, batch_size: int, seed: int, state_dtype, process_index: int = 0,
                        process_count: int = 1):
    """Endless iterator of the cache's training rows, reshuffled every epoch, in global batches of
    `batch_size` rows (the same order on every process) of which this process reads and yields its
    own contiguous 1/process_count (a HostRows: token arrays [b, T], final_hidden [b, T, D] or the
    top-k teacher, aux_hidden [b, T, A, D] in `state_dtype`). get_state() / set_state() resume it exactly."""
    split = cache.split("train")
    if split.rows < batch_size:
        raise ValueError(f"the state cache holds {split.rows} training rows, fewer than data.batch_size={batch_size}; "
                         "lower data.batch_size or add data")
    if batch_size % process_count:
        raise ValueError(f"data.batch_size={batch_size} does not split over {process_count} processes")
    ds = (grain.MapDataset.source(np.arange(split.rows)).shuffle(seed=int(seed) % 2**32).repeat(None)
          .batch(batch_size, drop_remainder=True).map(_ReadHostRows(split, state_dtype, process_index, process_count)))
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=2)))


def cache_val_batches(cache: StateCache, batch_size: int, limit: int, state_dtype) -> list[dict]:
    """Up to `limit` validation batches of the cache's val rows in order, the last padded with empty
    rows (segment 0: no loss), as make_eval_batches pads them."""
    n = cache.rows("val")
    if n == 0 or limit <= 0:
        return []
    split = cache.split("val")
    batches = []
    for b0 in range(0, min(n, limit * batch_size), batch_size):
        rows = [split.read(i, state_dtype) for i in range(b0, min(b0 + batch_size, n))]
        while len(rows) < batch_size:
            rows.append({k: np.zeros_like(v) for k, v in rows[0].items()})
        batches.append({k: np.stack([r[k] for r in rows]) for k in rows[0]})
    return batches


def describe(cache: StateCache) -> str:
    m = cache.manifest
    return (f"state cache {cache.path}: {cache.rows('train')} train / {cache.rows('val')} val rows of "
            f"{m['seq_length']} tokens, {m['num_aux']} taps ({m['hidden_size']} wide, {m['dtype']}) + "
            f"{f'a top-{cache.teacher_top_k} teacher' if cache.teacher_top_k else 'the final hidden'}; "
            f"fields {json.dumps({k: m['fields'][k] for k in ('aux_layer_ids', 'data.seq_length')})}")

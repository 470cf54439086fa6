"""python -m specjax.import_states --config X.yaml --dump DIR [key=value ...]: a speculators /
hs-connectors hidden-states dump as a specjax state cache (target.cache_dir), to train on with
target.source=cache.

The dump is what speculators' data generation writes: a preprocessed dataset folder (Hugging Face
`save_to_disk`: data-*.arrow files listed in state.json, columns input_ids and loss_mask) and, by
default in its hidden_states/ subfolder (--hidden-states elsewhere), hs_<i>.safetensors for dataset
row i (vLLM's ExampleHiddenStatesConnector files, or hs-connectors' FP8 ones, dequantized here).
Each file's layers are the vLLM layer ids the server ran with (--vllm-layer-ids; default: the run's
taps k as k + 1, then num_layers, which speculators appends); the last one is the pre-norm output of
the last layer, to which the target's final norm is applied here (specjax.data.vllm_states).

Rows are every dataset row in order, the last int(n * data.val_fraction) of them the validation
split, first-fit packed into data.seq_length rows. A file whose token ids are not its row's input ids
is refused, naming the row. The manifest's `origin` names the dump and the sha256 of its token ids
and loss masks; training checks such a cache on the target, tokenizer, data.seq_length and taps only
(specjax.train.cache_source.FOREIGN_CHECKED). Resumable as precompute is.
"""
from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys

import numpy as np

from specjax.config import Config, ConfigError, load_config

__all__ = ["import_dump", "main", "read_dump_examples"]

log = logging.getLogger("specjax")


def read_dump_examples(dump: str) -> list:
    """The dataset rows of a speculators dump folder as Examples (input_ids, loss_mask), in order."""
    import pyarrow as pa
    import pyarrow.ipc

    from specjax.data.chat import Example

    state = os.path.join(dump, "state.json")
    if os.path.isfile(state):
        with open(state) as f:
            files = [os.path.join(dump, d["filename"]) for d in json.load(f).get("_data_files", [])]
    else:
        files = sorted(glob.glob(os.path.join(dump, "data-*.arrow")))
    if not files:
        raise FileNotFoundError(f"{dump} holds no dataset (no state.json, no data-*.arrow). Fix: --dump is the "
                                "folder speculators' prepare-data wrote (the one holding hidden_states/)")
    tables = []
    for path in files:
        with pa.memory_map(path) as src:
            tables.append(pa.ipc.open_stream(src).read_all())
    table = pa.concat_tables(tables)
    missing = {"input_ids", "loss_mask"} - set(table.column_names)
    if missing:
        raise ValueError(f"the dataset in {dump} has no {sorted(missing)} column(s) (it has {table.column_names})")
    ids, mask = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    return [Example(np.asarray(a, np.int32), np.asarray(m, np.int32), source=dump, row=i + 1)
            for i, (a, m) in enumerate(zip(ids, mask))]


def import_dump(cfg: Config, dump: str, hidden_states: str | None = None, vllm_layer_ids=None, *,
                progress: bool = True) -> str:
    """Write (or finish writing) target.cache_dir from the dump; returns its path."""
    from specjax.data.vllm_states import ROWS_PER_WRITE, FinalNorm, examples_sha, fill_cache, hs_path, open_or_create
    from specjax.data.vllm_states import vllm_layer_ids as default_layer_ids
    from specjax.data.pipeline import first_fit_rows
    from specjax.train.cache_source import foreign_cache_fields
    from specjax.train.setup import resolve_aux_ids

    out = cfg.target.cache_dir
    if not out:
        raise ValueError("target.cache_dir is empty: name the folder to write the state cache to")
    if cfg.precompute.teacher_top_k:
        raise ValueError("a dump's states are stored with the final hidden state, not a top-k teacher; Fix: "
                         "precompute.teacher_top_k=0 (for the import and the training run)")
    hs_dir = hidden_states or os.path.join(dump, "hidden_states")
    examples = read_dump_examples(dump)
    T = cfg.data.seq_length
    long = [i for i, ex in enumerate(examples) if len(ex.input_ids) > T]
    if long:
        raise ValueError(f"{len(long)} dataset rows are longer than data.seq_length={T} (row {long[0]}: "
                         f"{len(examples[long[0]].input_ids)} tokens). Fix: data.seq_length >= the dump's sequence "
                         "length")
    norm = FinalNorm(cfg.target.path, cfg.target.dtype)
    aux_ids = resolve_aux_ids(cfg, norm.target)
    want = default_layer_ids(aux_ids, norm.num_layers)
    layer_ids = sorted(int(k) for k in vllm_layer_ids) if vllm_layer_ids else want
    lacking = sorted(set(want) - set(layer_ids))
    if lacking:
        raise ValueError(f"the dump's vLLM layer ids {layer_ids} lack {lacking}: this run's taps {list(aux_ids)} are "
                         f"vLLM ids {[k + 1 for k in aux_ids]}, and the final hidden state needs {norm.num_layers} "
                         "(the last layer). Fix: set target.aux_layer_ids to the dump's ids minus 1 (its last id "
                         "left out)")
    n_val = int(len(examples) * cfg.data.val_fraction)
    splits = {"train": examples[:len(examples) - n_val], "val": examples[len(examples) - n_val:]}
    fields = foreign_cache_fields(cfg, aux_ids, f"hs-connectors:{examples_sha(examples)}")
    fields["dump.vllm_layer_ids"] = layer_ids
    cache = open_or_create(out, fields, {k: len(first_fit_rows(v, T)) for k, v in splits.items()}, T, len(aux_ids),
                           norm.hidden_size, cfg.precompute.dtype, cfg.precompute.rows_per_shard or ROWS_PER_WRITE)
    log.info("import_states: %d dataset rows (%d val) from %s -> %s (taps %s, vLLM layer ids %s)", len(examples),
             n_val, hs_dir, out, list(aux_ids), layer_ids)
    offset = {"train": 0, "val": len(splits["train"])}
    for split, exs in splits.items():
        if exs:
            fill_cache(cache, split, exs, T, lambda i, o=offset[split]: hs_path(hs_dir, o + i), aux_ids, layer_ids,
                       norm.num_layers, norm, progress=progress, what="dataset row", first_index=offset[split])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specjax.import_states", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the training config (target, data.seq_length, taps, precompute.*)")
    p.add_argument("--dump", required=True, help="speculators' preprocessed dataset folder")
    p.add_argument("--hidden-states", default=None, help="the hs_<i>.safetensors folder (default: DUMP/hidden_states)")
    p.add_argument("--vllm-layer-ids", default=None,
                   help="comma-separated vLLM layer ids the dump was taken with (default: the run's taps + 1, then "
                        "num_layers)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. target.cache_dir=runs/cache")
    args = p.parse_intermixed_args(argv)  # options may come between the overrides
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", force=True)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    ids = [int(x) for x in args.vllm_layer_ids.split(",")] if args.vllm_layer_ids else None
    try:
        out = import_dump(cfg, args.dump, args.hidden_states, ids, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"state cache written: {out}\ntrain from it with: target.source=cache target.cache_dir={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

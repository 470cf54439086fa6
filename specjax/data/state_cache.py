"""The offline store of a frozen target's states (`python -m specjax.precompute` writes it, training
with `target.source: cache` reads it): per packed row the token ids, loss mask, segment ids and
positions, the target's tapped states (aux) and its final hidden state.

Layout (one folder, tensorstore zarr3 arrays, each a group of rows per shard file):

    manifest.json             what the states were computed from (`manifest_differences` compares it)
    <split>/input_ids         int32   [N, T]       (split: "train", "val")
    <split>/loss_mask         uint8   [N, T]
    <split>/segment_ids       int32   [N, T]
    <split>/positions         int32   [N, T]
    <split>/aux_hidden        dtype   [N, T, A, D]  the taps, in aux_layer_ids order
    <split>/final_hidden      dtype   [N, T, D]
    <split>/aux_scale         float32 [N, T, A]    FP8 only: one scale per token and tap
    <split>/final_scale       float32 [N, T]       FP8 only
    <split>/done              uint8   [N]          1 once every array of the row is written

dtype: bfloat16 (a bf16 target's states exactly), float32 (an fp32 target's exactly), or
float8_e4m3fn with per-token scales: scale = max|x| / 448 over the token's D values (1 where the
token is all zero), stored value = x / scale rounded to e4m3, read back as value * scale. A row's
`done` flag is written only after its arrays are, so a killed writer leaves no row marked done
that is not complete, and a rerun writes exactly the rows not marked done.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

__all__ = ["CACHE_DTYPES", "CacheSplit", "FP8_MAX", "StateCache", "dequantize_per_token", "manifest_differences",
           "quantize_per_token", "state_bytes_per_token"]

FORMAT = "specjax-state-cache"
VERSION = 1
MANIFEST = "manifest.json"
CACHE_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
TOKEN_ARRAYS = {"input_ids": np.int32, "loss_mask": np.uint8, "segment_ids": np.int32, "positions": np.int32}


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(
        ml_dtypes.float8_e4m3fn) if name == "float8_e4m3fn" else np.dtype(name)


def quantize_per_token(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] (float) -> (e4m3 values [..., D], float32 scales [...]) with x ~ values * scale."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=-1)
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    return (x / scale[..., None]).astype(ml_dtypes.float8_e4m3fn), scale


def dequantize_per_token(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return values.astype(np.float32) * np.asarray(scale, np.float32)[..., None]


def state_bytes_per_token(num_aux: int, hidden: int, dtype: str) -> int:
    """Bytes one token takes in the store: its states (+ FP8 scales) and its four int arrays."""
    per_state = hidden * _np_dtype(dtype).itemsize + (4 if dtype == "float8_e4m3fn" else 0)
    return (num_aux + 1) * per_state + sum(np.dtype(t).itemsize for t in TOKEN_ARRAYS.values())


def manifest_differences(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """The `fields` a cache was written with that differ from the ones a run needs, one line each."""
    out = []
    for key in sorted(set(recorded) | set(wanted)):
        a, b = recorded.get(key, "<absent>"), wanted.get(key, "<absent>")
        if json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str):
            out.append(f"{key}: the cache has {_short(a)}, this run has {_short(b)}")
    return out


def _short(v) -> str:
    s = json.dumps(v, default=str)
    return s if len(s) <= 80 else s[:77] + "..."


def _spec(path: str, shape: Sequence[int], dtype: str, rows_per_shard: int) -> dict:
    shape = [int(s) for s in shape]
    outer = [min(rows_per_shard, shape[0])] + shape[1:]
    inner = [1] + shape[1:]
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
            "metadata": {"shape": shape, "data_type": dtype,
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": outer}},
                         "codecs": [{"name": "sharding_indexed",
                                     "configuration": {"chunk_shape": inner,
                                                       "codecs": [
                                                           {"name": "bytes", "configuration": {"endian": "little"}},
                                                           {"name": "zstd", "configuration": {"level": 1}}]}}]}}


@dataclasses.dataclass
class CacheSplit:
    """One split's arrays (`StateCache.split`)."""
    folder: str
    rows: int
    seq_length: int
    num_aux: int
    hidden: int
    dtype: str
    arrays: dict

    @property
    def fp8(self) -> bool:
        return self.dtype == "float8_e4m3fn"

    def done(self) -> np.ndarray:
        """bool [rows]: the rows completely written."""
        return self.arrays["done"].read().result().astype(bool)

    def write(self, rows: np.ndarray, tokens: Mapping[str, np.ndarray], final_hidden: np.ndarray,
              aux_hidden: np.ndarray) -> None:
        """Write rows `rows` (int [n]): token arrays [n, T], final_hidden [n, T, D], aux_hidden
        [n, T, A, D] (any float dtype); then mark them done."""
        rows = np.asarray(rows, np.int64)
        futures = [self.arrays[k][rows].write(np.asarray(tokens[k]).astype(t)) for k, t in TOKEN_ARRAYS.items()]
        if self.fp8:
            fv, fs = quantize_per_token(final_hidden)
            av, as_ = quantize_per_token(aux_hidden)
            futures += [self.arrays["final_hidden"][rows].write(fv), self.arrays["final_scale"][rows].write(fs),
                        self.arrays["aux_hidden"][rows].write(av), self.arrays["aux_scale"][rows].write(as_)]
        else:
            dt = _np_dtype(self.dtype)
            futures += [self.arrays["final_hidden"][rows].write(np.asarray(final_hidden).astype(dt)),
                        self.arrays["aux_hidden"][rows].write(np.asarray(aux_hidden).astype(dt))]
        for f in futures:
            f.result()
        self.arrays["done"][rows].write(np.ones(rows.shape, np.uint8)).result()  # after the data, never before

    def read(self, row: int, state_dtype=np.float32) -> dict[str, np.ndarray]:
        """One row: the token arrays (int32 [T]), final_hidden [T, D] and aux_hidden [T, A, D] in
        `state_dtype` (FP8 dequantized with its scales)."""
        out = {k: self.arrays[k][row].read() for k in list(TOKEN_ARRAYS) + ["final_hidden", "aux_hidden"]}
        if self.fp8:
            out["final_scale"] = self.arrays["final_scale"][row].read()
            out["aux_scale"] = self.arrays["aux_scale"][row].read()
        got = {k: f.result() for k, f in out.items()}
        row_out = {k: got[k].astype(np.int32) for k in TOKEN_ARRAYS}
        if self.fp8:
            row_out["final_hidden"] = dequantize_per_token(got["final_hidden"], got["final_scale"]).astype(state_dtype)
            row_out["aux_hidden"] = dequantize_per_token(got["aux_hidden"], got["aux_scale"]).astype(state_dtype)
        else:
            row_out["final_hidden"] = got["final_hidden"].astype(state_dtype)
            row_out["aux_hidden"] = got["aux_hidden"].astype(state_dtype)
        return row_out


class StateCache:
    """A state store folder: `create` a new one, `open` an existing one."""

    def __init__(self, path: str, manifest: dict):
        self.path = path
        self.manifest = manifest
        self._splits: dict[str, CacheSplit] = {}

    @property
    def fields(self) -> dict:
        return self.manifest["fields"]

    @classmethod
    def create(cls, path: str, fields: Mapping[str, Any], splits: Mapping[str, int], *, seq_length: int,
               num_aux: int, hidden: int, dtype: str, rows_per_shard: int = 64) -> "StateCache":
        """A new store at `path` (refused when one is there): `splits` maps split name -> rows."""
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"state cache dtype {dtype!r} is not one of {CACHE_DTYPES}")
        if os.path.exists(os.path.join(path, MANIFEST)):
            raise FileExistsError(f"{path} already holds a state cache; open it (or remove it to start over)")
        os.makedirs(path, exist_ok=True)
        manifest = {"format": FORMAT, "version": VERSION, "fields": dict(fields), "seq_length": int(seq_length),
                    "num_aux": int(num_aux), "hidden_size": int(hidden), "dtype": dtype,
                    "rows_per_shard": int(rows_per_shard), "splits": {k: int(v) for k, v in splits.items()}}
        T, A, D = int(seq_length), int(num_aux), int(hidden)
        store_dtype = "float8_e4m3fn" if dtype == "float8_e4m3fn" else dtype
        for name, n in splits.items():
            if n <= 0:
                continue
            base = os.path.join(path, name)
            shapes = {**{k: ([n, T], np.dtype(t).name) for k, t in TOKEN_ARRAYS.items()},
                      "aux_hidden": ([n, T, A, D], store_dtype), "final_hidden": ([n, T, D], store_dtype),
                      "done": ([n], "uint8")}
            if dtype == "float8_e4m3fn":
                shapes.update(aux_scale=([n, T, A], "float32"), final_scale=([n, T], "float32"))
            for key, (shape, dt) in shapes.items():
                ts.open(_spec(os.path.join(base, key), shape, dt, rows_per_shard), create=True).result()
        tmp = os.path.join(path, MANIFEST + ".tmp")
        with open(tmp, "w") as f:  # the manifest last: a folder without one is an unfinished create
            json.dump(manifest, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, os.path.join(path, MANIFEST))
        return cls(path, manifest)

    @classmethod
    def open(cls, path: str) -> "StateCache":
        mpath = os.path.join(path, MANIFEST)
        if not os.path.isfile(mpath):
            raise FileNotFoundError(
                f"no state cache at {path} ({MANIFEST} is missing). Fix: write one with "
                "`python -m specjax.precompute --config <your config>` (target.cache_dir names the folder)")
        with open(mpath) as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise ValueError(f"{mpath} is not a {FORMAT} v{VERSION} manifest (format {manifest.get('format')!r}, "
                             f"version {manifest.get('version')!r})")
        return cls(path, manifest)

    def rows(self, split: str) -> int:
        return int(self.manifest["splits"].get(split, 0))

    def split(self, name: str) -> CacheSplit:
        if name not in self._splits:
            n = self.rows(name)
            if n <= 0:
                raise KeyError(f"the state cache at {self.path} has no {name!r} rows")
            base = os.path.join(self.path, name)
            keys = list(TOKEN_ARRAYS) + ["aux_hidden", "final_hidden", "done"]
            if self.manifest["dtype"] == "float8_e4m3fn":
                keys += ["aux_scale", "final_scale"]
            arrays = {k: ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(base, k)}}
                                 ).result() for k in keys}
            m = self.manifest
            self._splits[name] = CacheSplit(base, n, m["seq_length"], m["num_aux"], m["hidden_size"], m["dtype"],
                                            arrays)
        return self._splits[name]

    def complete(self) -> bool:
        return all(self.split(s).done().all() for s, n in self.manifest["splits"].items() if n > 0)

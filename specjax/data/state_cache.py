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
    <split>/final_hidden      dtype   [N, T, D]    (absent with a top-k teacher)
    <split>/teacher_ids       int32   [N, T, k]    top-k teacher only (manifest teacher_top_k = k > 0): the
    <split>/teacher_logits    float32 [N, T, k]      k largest draft-vocab logits, largest first (draft ids)
    <split>/target_argmax     int32   [N, T]         the full-vocab argmax
    <split>/target_lse        float32 [N, T]         the full-vocab logsumexp
    <split>/aux_scale         float32 [N, T, A]    FP8 only: one scale per token and tap
    <split>/final_scale       float32 [N, T]       FP8 only, with final_hidden
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
from typing import Any, Optional

import ml_dtypes
import numpy as np
import tensorstore as ts

__all__ = ["CACHE_DTYPES", "CacheSplit", "FP8_MAX", "StateCache", "TEACHER_ARRAYS", "dequantize_per_token",
           "manifest_differences", "quantize_per_token", "state_bytes_per_token"]

FORMAT = "specjax-state-cache"
VERSION = 1
MANIFEST = "manifest.json"
CACHE_DTYPES = ("bfloat16", "float32", "float8_e4m3fn")
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
TOKEN_ARRAYS = {"input_ids": np.int32, "loss_mask": np.uint8, "segment_ids": np.int32, "positions": np.int32}
# a top-k teacher's arrays (specjax.drafts.teacher.TOPK_STATE_KEYS), stored exactly
TEACHER_ARRAYS = {"teacher_ids": "int32", "teacher_logits": "float32", "target_argmax": "int32",
                  "target_lse": "float32"}


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


def state_bytes_per_token(num_aux: int, hidden: int, dtype: str, teacher_top_k: int = 0) -> int:
    """Bytes one token takes in the store: its states (+ FP8 scales), the final hidden or the top-k
    teacher, and its four int arrays."""
    per_state = hidden * _np_dtype(dtype).itemsize + (4 if dtype == "float8_e4m3fn" else 0)
    teacher = 8 * teacher_top_k + 8 if teacher_top_k else per_state
    return num_aux * per_state + teacher + sum(np.dtype(t).itemsize for t in TOKEN_ARRAYS.values())


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
    teacher_top_k: int = 0

    @property
    def fp8(self) -> bool:
        return self.dtype == "float8_e4m3fn"

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The state arrays a row reads back as (besides the token arrays)."""
        return ((*TEACHER_ARRAYS, "aux_hidden") if self.teacher_top_k else ("final_hidden", "aux_hidden"))

    def done(self) -> np.ndarray:
        """bool [rows]: the rows completely written."""
        return self.arrays["done"].read().result().astype(bool)

    def write(self, rows: np.ndarray, tokens: Mapping[str, np.ndarray], final_hidden: Optional[np.ndarray],
              aux_hidden: np.ndarray, teacher: Optional[Mapping[str, np.ndarray]] = None) -> None:
        """Write rows `rows` (int [n]): token arrays [n, T], final_hidden [n, T, D] (None in a top-k cache,
        which takes `teacher`: TEACHER_ARRAYS' arrays), aux_hidden [n, T, A, D] (any float dtype); then
        mark them done."""
        rows = np.asarray(rows, np.int64)
        if (teacher is None) != (self.teacher_top_k == 0) or (final_hidden is None) != bool(self.teacher_top_k):
            raise ValueError(f"this cache holds {'a top-k teacher' if self.teacher_top_k else 'the final hidden'}; "
                             "write exactly that")
        futures = [self.arrays[k][rows].write(np.asarray(tokens[k]).astype(t)) for k, t in TOKEN_ARRAYS.items()]
        states = {"aux_hidden": aux_hidden} if teacher is not None else {"aux_hidden": aux_hidden,
                                                                         "final_hidden": final_hidden}
        for name, x in states.items():
            if self.fp8:
                v, sc = quantize_per_token(x)
                scale_name = "aux_scale" if name == "aux_hidden" else "final_scale"
                futures += [self.arrays[name][rows].write(v), self.arrays[scale_name][rows].write(sc)]
            else:
                futures.append(self.arrays[name][rows].write(np.asarray(x).astype(_np_dtype(self.dtype))))
        for name, dt in (TEACHER_ARRAYS.items() if teacher is not None else ()):
            futures.append(self.arrays[name][rows].write(np.asarray(teacher[name]).astype(dt)))
        for f in futures:
            f.result()
        self.arrays["done"][rows].write(np.ones(rows.shape, np.uint8)).result()  # after the data, never before

    @property
    def scale_keys(self) -> tuple[str, ...]:
        """An FP8 cache's per-token scale arrays, one per stored state array (none otherwise)."""
        hidden = ("aux_hidden",) if self.teacher_top_k else ("final_hidden", "aux_hidden")
        return tuple(n.replace("hidden", "scale") for n in hidden) if self.fp8 else ()

    def read_rows(self, rows, state_dtype=np.float32, dequantize: bool = True) -> dict[str, np.ndarray]:
        """Rows `rows` (int [n]) stacked as `read` gives one: every array's rows requested at once.
        ``dequantize=False`` leaves an FP8 cache's states as stored, float8_e4m3fn values beside their
        float32 scales (``scale_keys``), for the device to dequantize (specjax.train.cache_source)."""
        rows = np.asarray(rows, np.int64)
        got = {k: f.result() for k, f in {k: self.arrays[k][rows].read() for k in self._names()}.items()}
        return self._decoded(got, state_dtype, dequantize)

    def _names(self) -> list[str]:
        hidden = ["aux_hidden"] if self.teacher_top_k else ["final_hidden", "aux_hidden"]
        names = list(TOKEN_ARRAYS) + hidden + (list(TEACHER_ARRAYS) if self.teacher_top_k else [])
        return names + list(self.scale_keys)

    def _decoded(self, got: Mapping[str, np.ndarray], state_dtype, dequantize: bool = True) -> dict[str, np.ndarray]:
        out = {k: got[k].astype(np.int32) for k in TOKEN_ARRAYS}
        for name in ("aux_hidden",) if self.teacher_top_k else ("final_hidden", "aux_hidden"):
            scale = name.replace("hidden", "scale")
            if self.fp8 and not dequantize:
                out[name], out[scale] = got[name], np.asarray(got[scale], np.float32)
                continue
            x = dequantize_per_token(got[name], got[scale]) if self.fp8 else got[name]
            out[name] = x.astype(state_dtype)
        for name in (TEACHER_ARRAYS if self.teacher_top_k else ()):
            out[name] = got[name]
        return out

    def read(self, row: int, state_dtype=np.float32) -> dict[str, np.ndarray]:
        """One row: the token arrays (int32 [T]), final_hidden [T, D] (a top-k cache: the teacher's
        arrays, as stored) and aux_hidden [T, A, D] in `state_dtype` (FP8 dequantized with its scales)."""
        got = {k: f.result() for k, f in {k: self.arrays[k][int(row)].read() for k in self._names()}.items()}
        return self._decoded(got, state_dtype)


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
               num_aux: int, hidden: int, dtype: str, rows_per_shard: int = 64, teacher_top_k: int = 0,
               extra: Optional[Mapping[str, Any]] = None) -> "StateCache":
        """A new store at `path` (refused when one is there): `splits` maps split name -> rows;
        teacher_top_k > 0 stores a top-k teacher in place of the final hidden; `extra`: more manifest
        entries (not compared as fields)."""
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"state cache dtype {dtype!r} is not one of {CACHE_DTYPES}")
        if int(rows_per_shard) < 1:
            raise ValueError(f"rows_per_shard={rows_per_shard}: a shard holds at least one row")
        if os.path.exists(os.path.join(path, MANIFEST)):
            raise FileExistsError(f"{path} already holds a state cache; open it (or remove it to start over)")
        os.makedirs(path, exist_ok=True)
        manifest = {"format": FORMAT, "version": VERSION, "fields": dict(fields), "seq_length": int(seq_length),
                    "num_aux": int(num_aux), "hidden_size": int(hidden), "dtype": dtype,
                    "rows_per_shard": int(rows_per_shard), "splits": {k: int(v) for k, v in splits.items()},
                    "teacher_top_k": int(teacher_top_k), **dict(extra or {})}
        T, A, D = int(seq_length), int(num_aux), int(hidden)
        store_dtype = "float8_e4m3fn" if dtype == "float8_e4m3fn" else dtype
        for name, n in splits.items():
            if n <= 0:
                continue
            base = os.path.join(path, name)
            k = int(teacher_top_k)
            shapes = {**{name: ([n, T], np.dtype(t).name) for name, t in TOKEN_ARRAYS.items()},
                      "aux_hidden": ([n, T, A, D], store_dtype), "done": ([n], "uint8")}
            if dtype == "float8_e4m3fn":
                shapes["aux_scale"] = ([n, T, A], "float32")
            if k:
                shapes.update({name: ([n, T, k] if name.startswith("teacher") else [n, T], dt)
                               for name, dt in TEACHER_ARRAYS.items()})
            else:
                shapes["final_hidden"] = ([n, T, D], store_dtype)
                if dtype == "float8_e4m3fn":
                    shapes["final_scale"] = ([n, T], "float32")
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

    @property
    def teacher_top_k(self) -> int:
        """k > 0: the rows hold a top-k teacher in place of the final hidden."""
        return int(self.manifest.get("teacher_top_k", 0))

    def rows(self, split: str) -> int:
        return int(self.manifest["splits"].get(split, 0))

    def split(self, name: str) -> CacheSplit:
        if name not in self._splits:
            n = self.rows(name)
            if n <= 0:
                raise KeyError(f"the state cache at {self.path} has no {name!r} rows")
            base = os.path.join(self.path, name)
            top_k = self.teacher_top_k
            hidden = ["aux_hidden"] + ([] if top_k else ["final_hidden"])
            keys = list(TOKEN_ARRAYS) + hidden + ["done"] + (list(TEACHER_ARRAYS) if top_k else [])
            if self.manifest["dtype"] == "float8_e4m3fn":
                keys += [h.replace("hidden", "scale") for h in hidden]
            arrays = {k: ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(base, k)}}
                                 ).result() for k in keys}
            m = self.manifest
            self._splits[name] = CacheSplit(base, n, m["seq_length"], m["num_aux"], m["hidden_size"], m["dtype"],
                                            arrays, top_k)
        return self._splits[name]

    def complete(self) -> bool:
        return all(self.split(s).done().all() for s, n in self.manifest["splits"].items() if n > 0)

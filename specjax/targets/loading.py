"""Torch-free HF checkpoint loading (and a streaming safetensors writer for export).

``load_target(hf_dir)`` reads ``config.json``, picks the architecture from the registry, and fills
the params leaf by leaf: for each weight-map row it reads that tensor (every layer, for stacked
rows) from ``model.safetensors`` or the shards named in ``model.safetensors.index.json``,
transposes to kernel layout, casts into one preallocated host buffer, then puts the buffer on
device (optionally with a caller-supplied sharding) before the next leaf. Host memory therefore
peaks at one stacked leaf, not the whole model. config.json's fields are checked first
(specjax.hf_config_checks: types and sanity bounds, one line naming the file and the field), and
every tensor's shape is compared from its shard's checked header (specjax.safetensors_io) before
the tensor is read, so nothing is sized from a hostile config or header.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Any, Iterable, Mapping, Sequence

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors' numpy path can read it)
import numpy as np
from safetensors import safe_open

from specjax.hf_config_checks import check_config_fields, check_name_inside, read_config_json
from specjax.safetensors_io import read_safetensors_header
from specjax.targets.base import Target, tree_get, tree_set
from specjax.targets.fp8_compute import checkpoint_config, fp8_compute_params, is_fp8
from specjax.targets.registry import get_target_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype tags <-> numpy dtypes (bf16 via ml_dtypes).
_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
FP8_TAGS = ("F8_E4M3", "F8_E5M2")
_NP_TO_ST = {v: k for k, v in _ST_DTYPES.items()}


# ---------------------------------------------------------------------------------------------
# config / file discovery
# ---------------------------------------------------------------------------------------------
def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """config.json of a target folder, its fields checked (specjax.hf_config_checks: types and
    sanity bounds) before anything is sized from them; a bad field is one ValueError naming the file
    and the field."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    config = read_config_json(path, "model config")
    check_config_fields(config, path)
    return config


def checkpoint_files(hf_dir: str | os.PathLike) -> dict[str, str]:
    """Map tensor name -> safetensors file path (single file or sharded index)."""
    index_path = os.path.join(hf_dir, INDEX_FILE)
    single_path = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(index_path):
        weight_map = read_config_json(index_path, "safetensors index").get("weight_map")
        if not isinstance(weight_map, Mapping) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index_path}: weight_map: not an object of tensor -> shard file name. "
                             "Fix: download the checkpoint's index again")
        for fn in sorted(set(weight_map.values())):
            check_name_inside(os.fspath(hf_dir), fn, index_path, "weight_map")
        missing = sorted({fn for fn in weight_map.values() if not os.path.isfile(os.path.join(hf_dir, fn))})
        if missing:
            raise FileNotFoundError(
                f"{INDEX_FILE} in {hf_dir} names shard file(s) that do not exist: {', '.join(missing)}"
            )
        return {name: os.path.join(hf_dir, fn) for name, fn in weight_map.items()}
    if os.path.isfile(single_path):
        return {name: single_path for name in read_safetensors_header(single_path)[0]}
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir} (only safetensors checkpoints load)")


# ---------------------------------------------------------------------------------------------
# raw safetensors access (fallback for dtypes the installed safetensors numpy path rejects)
# ---------------------------------------------------------------------------------------------
def _read_raw_tensor(path: str, name: str) -> np.ndarray:
    header, data_start = read_safetensors_header(path)
    info = header[name]
    begin, end = info["data_offsets"]
    dtype = _ST_DTYPES[info["dtype"]]
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=data_start + begin, shape=(end - begin,))
    return mm.view(dtype).reshape(info["shape"])


class _Reader:
    """Keeps each shard open while a checkpoint loads; returns numpy arrays one tensor at a time.
    Names and shapes come from each shard's checked header (specjax.safetensors_io), read before the
    shard is opened for its data, so a tensor of the wrong shape is refused before any of it is read."""

    def __init__(self, files: Mapping[str, str], stack: contextlib.ExitStack):
        self._files = files
        self._stack = stack
        self._headers: dict[str, dict[str, Any]] = {}
        self._handles: dict[str, Any] = {}

    def _header(self, name: str) -> tuple[str, dict[str, Any]]:
        path = self._files[name]
        if path not in self._headers:
            self._headers[path] = read_safetensors_header(path)[0]
        if name not in self._headers[path]:
            raise ValueError(f"tensor {name} is listed in {INDEX_FILE} but missing from {os.path.basename(path)}")
        return path, self._headers[path]

    def _handle(self, name: str):
        path, _ = self._header(name)
        if path not in self._handles:
            self._handles[path] = self._stack.enter_context(safe_open(path, framework="numpy"))
        return path, self._handles[path]

    def get(self, name: str) -> np.ndarray:
        path, handle = self._handle(name)
        if self.dtype_tag(name) in FP8_TAGS:  # safetensors' numpy path has no float8 dtypes
            return np.array(_read_raw_tensor(path, name))
        try:
            return handle.get_tensor(name)
        except TypeError:  # dtype numpy does not know (older safetensors without ml_dtypes)
            return _read_raw_tensor(path, name)

    def dtype_tag(self, name: str) -> str:
        """The tensor's safetensors dtype tag ("BF16", "F8_E4M3", ...), from the checked header."""
        _, header = self._header(name)
        return header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        _, header = self._header(name)
        return tuple(header[name]["shape"])

    def get_rows(self, name: str, start: int, stop: int, axis: int = 0) -> np.ndarray:
        """Entries [start, stop) along ``axis``, without reading the rest of the tensor."""
        path, handle = self._handle(name)
        index = (slice(None),) * axis + (slice(start, stop),)
        try:
            return handle.get_slice(name)[index]
        except TypeError:
            return np.array(_read_raw_tensor(path, name)[index])


def write_safetensors(
    path: str | os.PathLike,
    entries: Sequence[tuple[str, Sequence[int], np.dtype]],
    arrays: Iterable[np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Stream tensors into a .safetensors file; ``entries`` (name, shape, dtype) fix the header and
    ``arrays`` yields the matching arrays in the same order, one at a time."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _NP_TO_ST[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        count = 0
        for (name, shape, dtype), arr in zip(entries, arrays):
            arr = np.ascontiguousarray(arr)
            if tuple(arr.shape) != tuple(shape) or arr.dtype != np.dtype(dtype):
                raise ValueError(f"{name}: got {arr.shape} {arr.dtype}, header says {tuple(shape)} {np.dtype(dtype)}")
            f.write(arr.tobytes())
            count += 1
    if count != len(entries):
        raise ValueError(f"write_safetensors: {len(entries)} entries but {count} arrays")


# ---------------------------------------------------------------------------------------------
# params
# ---------------------------------------------------------------------------------------------
def _short_list(names: Sequence[str], limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _check_fp8_storage(tag: str, leaf_dtype: np.dtype, name: str, config: Any) -> None:
    """FP8 on disk only where the weight map keeps a float8 leaf with its scales, and the reverse: a
    silent cast either way would drop the block scales or quantize a weight the checkpoint keeps."""
    on_disk, in_leaf = tag in FP8_TAGS, "float8" in leaf_dtype.name
    if on_disk and not in_leaf:
        raise ValueError(
            f"tensor {name} is stored as {tag}, but {config.architecture}'s config reads it unquantized. Fix: "
            "config.json needs the checkpoint's quantization_config (quant_method 'fp8' with weight_block_size), "
            "or use the bf16 release")
    if in_leaf and tag != "F8_E4M3":
        raise ValueError(
            f"tensor {name} is stored as {tag}, but quantization_config says the checkpoint holds it in FP8 e4m3. "
            "Fix: name its module in quantization_config.modules_to_not_convert")


def load_params(
    hf_dir: str | os.PathLike,
    target_cls: type[Target],
    config: Any,
    dtype: Any = "bfloat16",
    shardings: Any = None,
    only: Any = None,
) -> dict:
    """Read a safetensors checkpoint into the stacked specjax param tree of ``target_cls``. `only`: a
    set of param paths to read (the whole checkpoint is still checked against the architecture), e.g.
    `embedding_and_head_paths` for a run fed from a state cache."""
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    files = checkpoint_files(hf_dir)
    specs = target_cls.checkpoint_weight_specs(config, files)
    L = config.num_hidden_layers

    expected = {}
    for spec in specs:
        for _, name in spec.hf_tensors(L):
            expected[name] = spec
    unknown = [n for n in files if n not in expected and not target_cls.ignored_hf_names(config, n)]
    missing = [n for n in expected if n not in files]
    scales = [n for n in unknown if n.endswith(".weight_scale_inv")]
    if scales and getattr(config, "weight_quant", None) is None:
        family = ("" if hasattr(config, "weight_quant") else
                  f"; {config.architecture} does not read FP8 checkpoints yet: use the model's bf16 release")
        raise ValueError(
            f"checkpoint {hf_dir} stores FP8 block-scaled weights ({_short_list(scales, 3)}), but its config.json "
            f"has no quantization_config. Fix: restore the release's quantization_config (quant_method 'fp8', "
            f"weight_block_size){family}")
    if unknown or missing:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_short_list(missing)}")
        if unknown:
            parts.append(f"unexpected tensors: {_short_list(unknown)}")
        raise ValueError(f"checkpoint {hf_dir} does not match {config.architecture}: " + "; ".join(parts))

    params: dict = {}
    with contextlib.ExitStack() as stack:
        reader = _Reader(files, stack)
        for spec in specs:
            if only is not None and tuple(spec.path) not in only:
                continue
            buf = np.empty(spec.shape, np.dtype(jax.numpy.dtype(spec.dtype)) if spec.dtype else np_dtype)
            for index, name in spec.hf_tensors(L):
                _check_fp8_storage(reader.dtype_tag(name), buf.dtype, name, config)
                if spec.hf_chunk is None:  # the shape from the header first: nothing of a wrong size is read
                    file_shape = reader.shape(name)
                    if file_shape != spec.hf_shape:
                        raise ValueError(f"tensor {name} has shape {file_shape}, expected {spec.hf_shape}")
                    t = reader.get(name)
                else:  # one chunk of a fused tensor: check the whole shape, read only the rows needed
                    file_shape = reader.shape(name)
                    if file_shape != spec.hf_file_shape:
                        raise ValueError(f"tensor {name} has shape {file_shape}, expected {spec.hf_file_shape}")
                    rows = spec.hf_shape[spec.hf_chunk_axis]
                    t = reader.get_rows(name, spec.hf_chunk[0] * rows, (spec.hf_chunk[0] + 1) * rows,
                                        spec.hf_chunk_axis)
                if spec.hf_axes is not None:
                    t = np.transpose(t, spec.hf_axes)
                elif spec.transpose:
                    t = t.T
                if spec.deinterleave_axis is not None:
                    ax = spec.deinterleave_axis
                    t = np.concatenate([np.take(t, np.arange(0, t.shape[ax], 2), axis=ax),
                                        np.take(t, np.arange(1, t.shape[ax], 2), axis=ax)], axis=ax)
                buf[index] = t  # numpy casts to the target dtype (round-to-nearest-even for bf16)
            sharding = _sharding_at(shardings, spec.path)
            if sharding is None:
                leaf = jax.device_put(buf)
            else:  # each process only materialises its addressable shards (multi-host safe)
                leaf = jax.make_array_from_callback(buf.shape, sharding, lambda idx, b=buf: b[idx])
            tree_set(params, spec.path, leaf)
            del buf
    return params


def _sharding_at(shardings: Any, path) -> Any:
    """The leaf's sharding, or None where the tree has none (no shardings; a stored scale that FP8
    compute replaces, placed whole and then quantized away: fp8_compute_params)."""
    try:
        return None if shardings is None else tree_get(shardings, path)
    except KeyError:
        return None


def embedding_and_head_paths(target_cls: type[Target], config: Any) -> set[tuple[str, ...]]:
    """The param paths of the token embedding and the lm_head (none when tied): all a draft's train
    step reads of the target when the target's states come from a cache."""
    paths = {tuple(target_cls.decoder.embedding)}
    if not getattr(config, "tie_word_embeddings", False):
        paths.add(("lm_head", "kernel"))
    return paths


def load_target(
    hf_dir: str | os.PathLike,
    dtype: Any = "bfloat16",
    shardings: Any = None,
    embedding_and_head_only: bool = False,
    **config_overrides,
) -> Target:
    """Load an HF safetensors checkpoint as a frozen specjax target.

    dtype: params/compute dtype ("bfloat16" or "float32"; the on-disk dtype is cast).
    shardings: optional pytree like the params (leaves jax.sharding.Sharding or None).
    embedding_and_head_only: read only the embedding and lm_head (a run fed from a state cache).
    config_overrides: runtime config fields, e.g. ``kernels=KernelChoices(...)``, ``compute_dtype="fp8"``
    (FP8 projection GEMMs: targets/fp8_compute.py), or the kernel keywords
    ``moe_implementation=``, ``ssd_implementation=``, ``attention_implementation=``,
    ``attention_q_block=``, ``decode_attention_implementation=`` (Target.config_from_hf folds them
    into the config's KernelChoices).
    """
    hf_config = read_hf_config(hf_dir)
    cls = get_target_class(hf_config)
    config = cls.config_from_hf(hf_config, **config_overrides)
    only = embedding_and_head_paths(cls, config) if embedding_and_head_only else None
    params = load_params(hf_dir, cls, checkpoint_config(config), dtype=dtype, shardings=shardings, only=only)
    if is_fp8(config):  # the checkpoint as stored, then its projections quantized on the device
        params = fp8_compute_params(params, cls.weight_specs(config), getattr(config, "weight_quant", None),
                                    shardings)
    return cls(config, hf_config, params)

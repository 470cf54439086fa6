"""The one checked safetensors header reader (standard library only).

Used by target loading (specjax.targets.loading, its raw-tensor fallback) and by the draft-head
converters (specjax_converters.head_files); it lives outside specjax.targets so that reading a head
folder does not import jax (specjax.targets imports every architecture).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any

__all__ = ["UnreadableWeightsError", "read_safetensors_header"]


class UnreadableWeightsError(ValueError):
    """A weight file that is cut short or not safetensors at all; the message names the file."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path} is truncated or not a safetensors file: {why}. Fix: download or export it again.")
        self.path = path


def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """(tensor table without `__metadata__`, byte offset where tensor data starts) of a safetensors
    file, after checking that the file is complete: the 8-byte header length, a JSON header, and
    tensor data that ends exactly at the end of the file (what the safetensors reader demands; a file
    cut short by an interrupted download fails here, by name, instead of in the reader's traceback
    when a tensor is first loaded). Raises UnreadableWeightsError."""
    size = os.path.getsize(path)
    if size < 8:
        raise UnreadableWeightsError(path, f"{size} bytes, fewer than the 8 of the header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise UnreadableWeightsError(path, f"the header length says {n} bytes, but only {size - 8} follow")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except UnicodeDecodeError:
        raise UnreadableWeightsError(path, f"the {n}-byte header is not UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise UnreadableWeightsError(path, f"the {n}-byte header is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(header, dict):
        raise UnreadableWeightsError(path, f"the header is a JSON {type(header).__name__}, not a table of tensors")
    header.pop("__metadata__", None)
    end = 0
    for key, info in header.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise UnreadableWeightsError(path, f"tensor {key!r} has no dtype, shape or data_offsets")
        try:
            _, stop = (int(x) for x in info["data_offsets"])
        except (TypeError, ValueError):
            raise UnreadableWeightsError(path, f"tensor {key!r} has data_offsets {info['data_offsets']!r}") from None
        end = max(end, stop)
    have = size - 8 - n
    if have < end:
        raise UnreadableWeightsError(path, f"its header describes {end} bytes of tensor data, but only {have} follow")
    if have > end:
        raise UnreadableWeightsError(path, f"{have - end} bytes follow the last tensor")
    return header, 8 + n

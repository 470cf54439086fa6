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

__all__ = ["DTYPE_BITS", "MAX_HEADER_BYTES", "UnreadableWeightsError", "read_safetensors_header"]


class UnreadableWeightsError(ValueError):
    """A weight file that is cut short or not safetensors at all; the message names the file."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path} is truncated or not a safetensors file: {why}. Fix: download or export it again.")
        self.path = path


# bits per element of every safetensors dtype (the format's own list; F4/F6 are packed sub-byte types)
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
              "F8_E8M0": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
              "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}
# the safetensors library's own limit on the JSON header; checked before the header is read
MAX_HEADER_BYTES = 100_000_000


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _tensor_bytes(path: str, key: str, info: Any) -> tuple[int, int]:
    """(begin, end) of one header entry after checking its dtype, shape and offsets against each
    other: the bytes its shape and dtype need are exactly the bytes its offsets span."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise UnreadableWeightsError(path, f"tensor {key!r} has no dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise UnreadableWeightsError(path, f"tensor {key!r} has dtype {dtype!r}, not a safetensors dtype")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise UnreadableWeightsError(path, f"tensor {key!r} has shape {shape!r}, not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(x) for x in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise UnreadableWeightsError(path, f"tensor {key!r} has data_offsets {offsets!r}")
    count = 1
    for d in shape:
        count *= d
    need = (count * DTYPE_BITS[dtype] + 7) // 8
    if need != offsets[1] - offsets[0]:
        raise UnreadableWeightsError(path, f"tensor {key!r} ({dtype} {shape}) needs {need} bytes, but its "
                                     f"data_offsets span {offsets[1] - offsets[0]}")
    return offsets[0], offsets[1]


def read_safetensors_header(path: str) -> tuple[dict[str, Any], int]:
    """(tensor table without `__metadata__`, byte offset where tensor data starts) of a safetensors
    file, after checking that the file is complete and consistent, before anything is read beyond a
    header of bounded size: the 8-byte header length (at most MAX_HEADER_BYTES), a JSON header, every
    tensor's dtype, shape and offsets agreeing (shape x dtype = the bytes its offsets span, tensors
    back to back from offset 0), and tensor data that ends exactly at the end of the file (what the
    safetensors reader demands; a file cut short by an interrupted download fails here, by name,
    instead of in the reader's traceback when a tensor is first loaded). The sizes of the tensors a
    caller may read are therefore bounded by the file's size. Raises UnreadableWeightsError."""
    size = os.path.getsize(path)
    if size < 8:
        raise UnreadableWeightsError(path, f"{size} bytes, fewer than the 8 of the header length")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise UnreadableWeightsError(path, f"the header length says {n} bytes, but only {size - 8} follow")
        if n > MAX_HEADER_BYTES:
            raise UnreadableWeightsError(path, f"the header length says {n} bytes, more than the {MAX_HEADER_BYTES} "
                                         "safetensors allows")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except UnicodeDecodeError:
        raise UnreadableWeightsError(path, f"the {n}-byte header is not UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise UnreadableWeightsError(path, f"the {n}-byte header is not JSON ({e.msg} at character {e.pos})") from None
    except (ValueError, RecursionError) as e:  # an integer over Python's digit limit, or nesting too deep
        raise UnreadableWeightsError(path, f"the {n}-byte header cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise UnreadableWeightsError(path, f"the header is a JSON {type(header).__name__}, not a table of tensors")
    header.pop("__metadata__", None)
    spans = sorted((_tensor_bytes(path, key, info), key) for key, info in header.items())
    end = 0
    for (begin, stop), key in spans:
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves {begin - end} unused bytes before it"
            raise UnreadableWeightsError(path, f"tensor {key!r} starts at data offset {begin}: it {what}")
        end = stop
    have = size - 8 - n
    if have < end:
        raise UnreadableWeightsError(path, f"its header describes {end} bytes of tensor data, but only {have} follow")
    if have > end:
        raise UnreadableWeightsError(path, f"{have - end} bytes follow the last tensor")
    return header, 8 + n

"""Read an EAGLE-3 draft head folder without trusting it (docs/eagle3-format.md, "Checkpoint layout").

`read_head_files` returns a head's config.json, its tensors (names, dtypes and shapes from the
checked safetensors headers, arrays loaded only when asked), its specjax manifest and the
file-level findings (manifest hashes). Pickled weights are refused, never unpickled; a safetensors
file cut short fails by name (specjax.safetensors_io.UnreadableWeightsError).

`Finding` (one problem with a head: rule id, field, problem, fix) lives here because the file checks
produce findings too; the rules themselves are in specjax_converters.eagle3_validate (EAGLE-3,
EAGLE-3.1, P-EAGLE) and specjax_converters.dflash_validate (DFlash).

Every exporter ends here too: `write_manifest` writes specjax_manifest.json (the sha256 the checks
above compare against, the draft and target configs, the caller's extra keys) and `publish_folder`
moves the finished folder into place.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from specjax.safetensors_io import UnreadableWeightsError, read_safetensors_header

__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "WEIGHTS_FILE",
    "Finding",
    "HeadTensors",
    "file_sha256",
    "manifest_extra",
    "publish_folder",
    "read_head_files",
    "target_config_sha256",
    "write_manifest",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
MANIFEST_FILE = "specjax_manifest.json"
# safetensors dtype names <-> numpy dtype names (HeadTensors reports the safetensors names)
ST_TO_NP = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
            "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
NP_TO_ST = {v: k for k, v in ST_TO_NP.items()}


@dataclasses.dataclass(frozen=True)
class Finding:
    rule: str  # stable id, e.g. "aux.convention"
    field: str  # config key or tensor name the problem is in
    problem: str
    fix: str
    level: str = "error"  # "error" | "warning"

    def __str__(self) -> str:
        return f"{self.level}: {self.field}: {self.problem}. Fix: {self.fix} [{self.rule}]"


# ---------------------------------------------------------------------------------------------
# tensors: one interface for in-memory arrays and safetensors folders (pickles are never read)
# ---------------------------------------------------------------------------------------------
class HeadTensors:
    """Names, dtypes (safetensors names: BF16, F32, I64, BOOL, ...) and shapes of a head's tensors,
    with the arrays loaded only when a rule needs them."""

    def __init__(self, meta: Mapping[str, tuple[str, tuple[int, ...]]], load: Callable[[str], np.ndarray]):
        self.meta = dict(meta)
        self._load = load

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, Any]) -> "HeadTensors":
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        meta = {k: (NP_TO_ST.get(a.dtype.name, a.dtype.name.upper()), tuple(a.shape)) for k, a in arrays.items()}
        return cls(meta, arrays.__getitem__)

    @property
    def names(self) -> list[str]:
        return sorted(self.meta)

    def __contains__(self, name: str) -> bool:
        return name in self.meta

    def dtype(self, name: str) -> str:
        return self.meta[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][1]

    def array(self, name: str) -> np.ndarray:
        return np.asarray(self._load(name))


def _safetensors_tensors(folder: str) -> HeadTensors:
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index_path} is not a safetensors index (a JSON object with a 'weight_map' of "
                             f"tensor -> file): {type(e).__name__}: {e}. Fix: download it again.") from None
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                raise ValueError(f"{index_path} names the shard {name}, which is not in {folder}. "
                                 "Fix: download every shard of the head.")
    else:
        files = [WEIGHTS_FILE]
    meta, where = {}, {}
    for name in files:
        path = os.path.join(folder, name)
        for key, info in read_safetensors_header(path)[0].items():
            meta[key] = (info["dtype"], tuple(info["shape"]))
            where[key] = path

    def load(key: str) -> np.ndarray:
        # Imported here, not at the top: names, dtypes and shapes come from the checked header, so only
        # a rule that reads an array needs safetensors; ml_dtypes registers numpy's "bfloat16" dtype,
        # which safetensors asks for.
        importlib.import_module("ml_dtypes")
        from safetensors import safe_open

        try:
            with safe_open(where[key], framework="numpy") as f:
                return f.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - SafetensorError is a bare Exception; the file changed since
            raise UnreadableWeightsError(where[key], f"{type(e).__name__}: {e}") from None

    return HeadTensors(meta, load)


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _pickle_error(folder: str, pickles: Sequence[str]) -> ValueError:
    return ValueError(
        f"{folder} holds only pickled PyTorch weights ({', '.join(pickles)}), no {WEIGHTS_FILE}: specjax never "
        "unpickles weights (loading a pickle can run arbitrary code). Fix: convert them to model.safetensors in "
        "an environment you trust (safetensors.torch.save_file, or transformers' save_pretrained with "
        "safe_serialization=True), or download the head's safetensors weights.")


def read_head_files(folder: str) -> tuple[dict, HeadTensors, Optional[dict], list[Finding]]:
    """(config dict, tensors, specjax manifest or None, file-level findings) of a head folder.
    Raises ValueError when the folder has no config or no weights at all."""
    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    if not os.path.isdir(folder):
        raise ValueError(f"{folder} is not a folder; pass the draft head's folder (config.json + model.safetensors).")
    cpath = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(cpath):
        raise ValueError(f"{folder} has no {CONFIG_FILE}; an EAGLE-3 head folder needs config.json and weights.")
    with open(cpath) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cpath} is not valid JSON ({e}); re-export the head.") from e
    findings: list[Finding] = []
    if os.path.isfile(os.path.join(folder, WEIGHTS_FILE)) or os.path.isfile(os.path.join(folder, INDEX_FILE)):
        tensors = _safetensors_tensors(folder)
    else:
        pickles = sorted(n for n in os.listdir(folder) if n.endswith(_PICKLE_SUFFIXES))
        if pickles:  # pytorch_model.bin and friends: refused, never unpickled
            raise _pickle_error(folder, pickles)
        raise ValueError(f"{folder} has no {WEIGHTS_FILE} or {INDEX_FILE}; nothing to validate.")
    manifest = None
    mpath = os.path.join(folder, MANIFEST_FILE)
    if os.path.isfile(mpath):
        with open(mpath) as f:
            manifest = json.load(f)
        for name, info in (manifest.get("files") or {}).items():
            path = os.path.join(folder, name)
            want = info.get("sha256") if isinstance(info, Mapping) else None
            if want is None:
                continue
            if not os.path.isfile(path):
                findings.append(Finding("files.manifest_hash", name, f"listed in {MANIFEST_FILE} but missing",
                                        "copy the whole export folder, or re-export"))
            elif file_sha256(path) != want:
                findings.append(Finding("files.manifest_hash", name,
                                        f"sha256 differs from {MANIFEST_FILE} (the file changed after export)",
                                        "re-export instead of editing exported files"))
    return config, tensors, manifest, findings


def file_sha256(path: str) -> str:
    """sha256 of a file's bytes (streamed by the standard library)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---------------------------------------------------------------------------------------------
# the manifest (one writer for every draft family: EAGLE-3 and DFlash exports carry the same keys)
# ---------------------------------------------------------------------------------------------
MANIFEST_FORMAT_VERSION = 1
# written by write_manifest itself; a caller's extra keys may not replace them
RESERVED_MANIFEST_KEYS = ("format", "format_version", "dtype", "files", "variant", "target_config",
                          "target_config_sha256", "draft_config", "warnings")


def manifest_extra(extra: Optional[Mapping], what: str) -> dict:
    """The caller's extra manifest keys (step, metrics, training config, target path, ...), refused
    when one would replace a key the writer owns. `what` names the export in the error."""
    extra = dict(extra or {})
    clash = [k for k in extra if k in RESERVED_MANIFEST_KEYS]
    if clash:
        raise ValueError(f"{what}: extra_manifest: keys {clash} are reserved. Fix: rename them "
                         f"(reserved: {RESERVED_MANIFEST_KEYS})")
    return extra


def json_default(x):
    """json.dump's fallback for numpy scalars/arrays and anything else (its str)."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def target_config_sha256(target_hf_config: Mapping) -> str:
    """Hash of the target's config.json content (key order does not matter)."""
    blob = json.dumps(target_hf_config, sort_keys=True, separators=(",", ":"), default=json_default)
    return hashlib.sha256(blob.encode()).hexdigest()


def _config_dict(cfg) -> dict:
    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)
    return dict(cfg) if isinstance(cfg, Mapping) else dict(vars(cfg))


def write_manifest(folder: str, *, format: str, variant: str, dtype: str, draft_config, target_config: Mapping,
                   warnings: Sequence = (), extra: Optional[Mapping] = None,
                   files: Sequence[str] = (WEIGHTS_FILE, CONFIG_FILE)) -> dict:
    """Write `folder`/specjax_manifest.json for the head files already in `folder` and return it:
    format / format_version, dtype, variant, sha256 and size of each of `files`, the draft config
    (a dataclass or dict), the target config and its hash, the export's warnings, then `extra`
    (check it with manifest_extra first). read_head_files compares the hashes on every read."""
    manifest = {
        "format": format, "format_version": MANIFEST_FORMAT_VERSION, "dtype": dtype, "variant": variant,
        "files": {name: {"sha256": file_sha256(os.path.join(folder, name)),
                         "bytes": os.path.getsize(os.path.join(folder, name))} for name in files},
        "draft_config": _config_dict(draft_config),
        "target_config_sha256": target_config_sha256(target_config),
        "target_config": dict(target_config),
        "warnings": [str(w) for w in warnings],
        **dict(extra or {}),
    }
    with open(os.path.join(folder, MANIFEST_FILE), "w") as f:
        json.dump(manifest, f, indent=2, default=json_default)
        f.write("\n")
    return manifest


# ---------------------------------------------------------------------------------------------
# publishing an export folder (every exporter writes into a temporary sibling, then this)
# ---------------------------------------------------------------------------------------------
def publish_folder(tmp: str, out_dir: str) -> None:
    """Give the finished temporary folder `tmp` (a sibling of `out_dir` made by tempfile.mkdtemp, so
    private 0700) the modes a plain mkdir/open would, so a server running as another user can read
    it, then rename it to `out_dir`. An existing `out_dir` is moved aside first and removed after, so
    `out_dir` is never half-written."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "x"))
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)

"""Read an EAGLE-3 draft head folder without trusting it (docs/eagle3-format.md, "Checkpoint layout").

`read_head_files` returns a head's config.json, its tensors (names, dtypes and shapes from the
checked safetensors headers, arrays loaded only when asked), its specjax manifest and the
file-level findings (manifest hashes). Pickled weights are refused, never unpickled; a safetensors
file cut short fails by name (specjax.safetensors_io.UnreadableWeightsError). Before any weight is
looked at, config.json's fields pass specjax.hf_config_checks (types and sanity bounds: one line
naming the file and field); the manifest and the shard index must be JSON objects whose file names
stay inside the head folder (a name such as "../../etc/passwd" or "/dev/zero" is refused, never
opened), and a weight's finiteness is checked a block at a time (`HeadTensors.all_finite`), so
memory stays bounded whatever the files declare.

`Finding` (one problem with a head: rule id, field, problem, fix) lives here because the file checks
produce findings too; the rules themselves are in specjax_converters.eagle3_validate (EAGLE-3,
EAGLE-3.1, P-EAGLE) and specjax_converters.dflash_validate (DFlash).

Every exporter ends here too: `write_manifest` writes specjax_manifest.json (the sha256 the checks
above compare against, the draft and target configs, the caller's extra keys), `make_publish_folder`
makes the hidden sibling it writes into and `publish_folder` swaps the finished folder into place
(specjax.folder_publish: the path always holds a complete export, and stale copies of dead
publishes are removed).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import os
import shutil
import stat
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from specjax import folder_publish
from specjax.drafts import weights
from specjax.hf_config_checks import check_config_fields, check_name_inside, read_config_json
from specjax.safetensors_io import UnreadableWeightsError, read_safetensors_header

__all__ = [
    "CONFIG_FILE",
    "EXPORT_DTYPES",
    "INDEX_FILE",
    "MANIFEST_FILE",
    "WEIGHTS_FILE",
    "Finding",
    "HeadTensors",
    "TOKEN_FIELDS",
    "earlier_export",
    "export_dtype",
    "file_sha256",
    "file_arrays",
    "flat_paths",
    "make_publish_folder",
    "manifest_extra",
    "numpy_dtype",
    "publish_folder",
    "read_head_files",
    "target_config_sha256",
    "write_head_folder",
    "write_manifest",
]

log = logging.getLogger("specjax")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
MANIFEST_FILE = "specjax_manifest.json"
# safetensors dtype names <-> numpy dtype names (HeadTensors reports the safetensors names)
ST_TO_NP = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
            "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
NP_TO_ST = {v: k for k, v in ST_TO_NP.items()}
# the weight dtypes a head is exported in (name -> canonical name), and the target's token ids its config copies
EXPORT_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
                 "float16": "float16", "fp16": "float16"}
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def export_dtype(name: str, what: str) -> str:
    """The canonical export dtype for `name`, else a ValueError naming `what` (e.g. "DFlash export")."""
    key = str(name).lower()
    if key not in EXPORT_DTYPES:
        raise ValueError(f"{what}: dtype: {name!r} is not supported. Fix: use one of "
                         f"{sorted(set(EXPORT_DTYPES.values()))}.")
    return EXPORT_DTYPES[key]


def numpy_dtype(name: str):
    """numpy's dtype for a canonical export dtype name (ml_dtypes' for bfloat16)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    import numpy as np

    return np.dtype(name)


def file_arrays(entries, params: Mapping, np_dtype, what: str, config_name: str) -> dict[str, np.ndarray]:
    """{file name: array} for weight-table `entries` (specjax.drafts.weights.entries) read from the
    nested `params`: float32 first (bf16 converts cleanly), transposed where the entry's row says, cast
    to `np_dtype`. A leaf missing or of another shape than the entry's raises ValueError naming the
    exporter (`what`) and the config the params must have been built with (`config_name`)."""
    out: dict[str, np.ndarray] = {}
    for e in entries:
        name = ".".join(e.path)
        try:
            arr = np.asarray(weights.leaf(params, e.path), dtype=np.float32)
        except KeyError:
            raise ValueError(f"{what}: {name}: missing from the params. Fix: export the tree the family's "
                             "init_draft_params builds.") from None
        if arr.shape != e.shape:
            raise ValueError(f"{what}: {name}: shape {arr.shape}, expected {e.shape}. Fix: check the "
                             f"{config_name} the params were built with.")
        out[e.file_name] = np.ascontiguousarray((arr.T if e.row.transpose else arr).astype(np_dtype))
    return out


def flat_paths(tree: Mapping, prefix: tuple = ()) -> set:
    """The leaf paths (tuples of keys) of a nested mapping."""
    out = set()
    for k, v in tree.items():
        out |= flat_paths(v, prefix + (str(k),)) if isinstance(v, Mapping) else {prefix + (str(k),)}
    return out


def earlier_export(path: str, is_ours: Callable[[dict], bool], *, manifest_optional: bool = False) -> bool:
    """Whether an existing export folder `path` may be replaced: it is empty, or it holds exactly the
    weights, config.json and specjax_manifest.json (the manifest may be missing with
    `manifest_optional`: exports from before it) and `is_ours(config)` accepts its config.json."""
    if not os.path.isdir(path):
        return False
    names = set(os.listdir(path))
    if not names:
        return True
    allowed = [{WEIGHTS_FILE, CONFIG_FILE, MANIFEST_FILE}]
    if manifest_optional:
        allowed.append({WEIGHTS_FILE, CONFIG_FILE})
    if names not in allowed:
        return False
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            return bool(is_ours(json.load(f)))
    except (OSError, ValueError, AttributeError):
        return False


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
    with the arrays loaded only when a rule needs them. `all_finite` reads a stored tensor a block at a
    time (`finite`, when given), so checking a large weight never holds it whole."""

    def __init__(self, meta: Mapping[str, tuple[str, tuple[int, ...]]], load: Callable[[str], np.ndarray],
                 finite: Optional[Callable[[str], bool]] = None):
        self.meta = dict(meta)
        self._load = load
        self._finite = finite

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

    def all_finite(self, name: str) -> bool:
        """True when float tensor `name` holds no NaN or Inf."""
        if self._finite is not None:
            return self._finite(name)
        return bool(np.all(np.isfinite(self.array(name).astype(np.float32))))


# bytes of a stored tensor read at a time by the finiteness check
FINITE_BLOCK_BYTES = 16 << 20


def _numpy_dtype(st_dtype: str, path: str, key: str) -> np.dtype:
    if st_dtype not in ST_TO_NP:
        raise UnreadableWeightsError(path, f"tensor {key!r} is {st_dtype}, which specjax does not read "
                                     f"(it reads {', '.join(ST_TO_NP)})")
    importlib.import_module("ml_dtypes")  # registers numpy's "bfloat16"
    return np.dtype(ST_TO_NP[st_dtype])


def _index_files(folder: str, index_path: str) -> list[str]:
    """The shard file names a safetensors index lists, each checked to be a file inside `folder`."""
    index = read_config_json(index_path, "safetensors index", fix="download the head's index again")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, Mapping) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path}: weight_map: {type(weight_map).__name__}, not an object of tensor -> shard "
                         "file name. Fix: download the head's index again.")
    files = sorted(set(weight_map.values()))
    for name in files:
        check_name_inside(folder, name, index_path, "weight_map")
        if not _is_regular_file(os.path.join(folder, name)):
            raise ValueError(f"{index_path} names the shard {name}, which is not in {folder}. "
                             "Fix: download every shard of the head.")
    return files


def _safetensors_tensors(folder: str) -> HeadTensors:
    index_path = os.path.join(folder, INDEX_FILE)
    files = _index_files(folder, index_path) if os.path.isfile(index_path) else [WEIGHTS_FILE]
    meta, where = {}, {}
    for name in files:
        path = os.path.join(folder, name)
        header, data_start = read_safetensors_header(path)
        for key, info in header.items():
            meta[key] = (info["dtype"], tuple(info["shape"]))
            where[key] = (path, data_start + info["data_offsets"][0], data_start + info["data_offsets"][1])

    def load(key: str) -> np.ndarray:
        # Read at the checked offsets into one array of the declared size (bounded by the file's size):
        # no mapping of the whole file, which a large shard would need as address space.
        path, begin, end = where[key]
        dtype = _numpy_dtype(meta[key][0], path, key)
        arr = np.empty(meta[key][1], dtype)
        with open(path, "rb") as f:
            f.seek(begin)
            got = f.readinto(memoryview(arr.reshape(-1).view(np.uint8)))
        if got != end - begin:
            raise UnreadableWeightsError(path, f"tensor {key!r}: the file got shorter while it was read")
        return arr

    def finite(key: str) -> bool:
        path, begin, end = where[key]
        dtype = _numpy_dtype(meta[key][0], path, key)
        step = max(FINITE_BLOCK_BYTES // dtype.itemsize, 1) * dtype.itemsize
        with open(path, "rb") as f:
            f.seek(begin)
            for at in range(begin, end, step):
                raw = f.read(min(step, end - at))
                if len(raw) != min(step, end - at):
                    raise UnreadableWeightsError(path, "the file got shorter while it was read")
                if not np.all(np.isfinite(np.frombuffer(raw, dtype).astype(np.float32))):
                    return False
        return True

    return HeadTensors(meta, load, finite)


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
    config = read_config_json(cpath, "model config", fix="re-export the head")
    check_config_fields(config, cpath)
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
        manifest = read_config_json(mpath, "specjax manifest", fix=f"re-export the head (or delete {MANIFEST_FILE})")
        files = manifest.get("files")
        files = {} if files is None else files
        if not isinstance(files, Mapping):
            raise ValueError(f"{mpath}: files: a JSON {type(files).__name__}, not an object of file name -> "
                             f"{{sha256, bytes}}. Fix: re-export the head (or delete {MANIFEST_FILE})")
        for name in files:  # every name first: nothing is opened before all are known to be inside
            check_name_inside(folder, name, mpath, "files")
        for name, info in files.items():
            path = os.path.join(folder, name)
            want = info.get("sha256") if isinstance(info, Mapping) else None
            if want is None:
                continue
            if not _is_regular_file(path):
                findings.append(Finding("files.manifest_hash", name, f"listed in {MANIFEST_FILE} but missing "
                                        "(or not a regular file)", "copy the whole export folder, or re-export"))
            elif file_sha256(path) != want:
                findings.append(Finding("files.manifest_hash", name,
                                        f"sha256 differs from {MANIFEST_FILE} (the file changed after export)",
                                        "re-export instead of editing exported files"))
    return config, tensors, manifest, findings


def _is_regular_file(path: str) -> bool:
    """A regular file (after symlinks): never a FIFO, device or socket, which could block or never end."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


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
def make_publish_folder(out_dir: str) -> str:
    """The hidden sibling of `out_dir` an exporter writes into before publish_folder (named with this
    host and pid, so a later publish can tell a copy left by a killed export from a live one)."""
    return folder_publish.make_temp_folder(out_dir)


def publish_folder(tmp: str, out_dir: str) -> None:
    """Give the finished folder `tmp` (from make_publish_folder, so private 0700) the modes a plain
    mkdir/open would, so a server running as another user can read it, then put it at `out_dir`
    (specjax.folder_publish.publish: an existing `out_dir` is swapped out in one step, so the path
    always holds a complete export, and copies left by killed exports of `out_dir` are removed)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    folder_publish.publish(tmp, out_dir)


def write_head_folder(out_dir: str | os.PathLike, tensors: Mapping[str, np.ndarray], config: Mapping, *,
                      replaceable: Callable[[str], bool], refuse_existing: Callable[[str], None],
                      check_written: Callable[[str], None], **manifest) -> str:
    """Publish a validated head at `out_dir` and return its absolute path: the export's warnings
    (manifest["warnings"]) logged; an existing `out_dir` that is not `replaceable` handed to
    `refuse_existing` (which raises); then model.safetensors from `tensors`, config.json from
    `config` and specjax_manifest.json from write_manifest(**manifest) written into a publish folder
    beside it, `check_written(folder)` run on what was written (it raises to stop the export), and the
    folder published. On any failure the temporary folder is removed and `out_dir` is left as it was."""
    from safetensors.numpy import save_file

    for w in manifest.get("warnings", ()):
        log.warning("export: %s", w)
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not replaceable(out_dir):
        refuse_existing(out_dir)
    tmp = make_publish_folder(out_dir)
    try:
        save_file(dict(tensors), os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        write_manifest(tmp, **manifest)
        check_written(tmp)
        publish_folder(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir

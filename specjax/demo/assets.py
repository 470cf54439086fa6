"""The demo asset cache: tokenizer + trained target built once per build key (parameters, recipe
version, dataset bytes), in a temporary sibling folder published with one rename."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from specjax.demo.pretrain import DEMO_OPTIM, DEMO_TARGET_DEFAULTS, build_demo_target
from specjax.demo.tasks import DEMO_DATA_PATH, read_demo_conversations
from specjax.demo.tokenizer import build_demo_tokenizer, demo_tokenizer_texts

# Bump when the build recipe changes in a way the parameters don't capture (invalidates caches).
# 2: pretraining uses specjax.train.optim.make_optimizer (no weight decay on 1-D norm scales).
DEMO_BUILD_VERSION = 2
BUILD_MARKER = "BUILD_COMPLETE.json"  # written last by a finished build: its build key and parameters


def _build_params(data_path, vocab_size: int, target_kwargs: dict) -> dict:
    kw = dict(DEMO_TARGET_DEFAULTS)
    kw.update(target_kwargs)
    return {
        "version": DEMO_BUILD_VERSION,
        "vocab_size": vocab_size,
        "target": kw,
        "optim": dict(DEMO_OPTIM),
        "data_sha256": hashlib.sha256(Path(data_path).read_bytes()).hexdigest(),
    }


def _build_key(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def read_marker(d: Path) -> dict | None:
    try:
        return json.loads((d / BUILD_MARKER).read_text())
    except (OSError, ValueError):
        return None


def _build_tree(tmp: Path, build: dict, data_path, log) -> dict:
    """tokenizer/ and target/ (which also gets the tokenizer files) under `tmp`."""
    rows = read_demo_conversations(data_path)
    build_demo_tokenizer(demo_tokenizer_texts(rows), tmp / "tokenizer", vocab_size=build["vocab_size"])
    info = build_demo_target(tmp / "target", data_path=data_path, tokenizer_dir=tmp / "tokenizer",
                             log=log, **build["target"])
    return {k: v for k, v in info.items() if k != "history"}


def _publish(src: Path, dst: Path, key: str) -> None:
    """Move a finished build to `dst` with one rename. If another process published the same
    build meanwhile, keep theirs; a stale build of ours is replaced."""
    marker = read_marker(dst)
    if marker is not None and marker.get("key") == key:
        return
    if dst.exists():
        shutil.rmtree(dst, ignore_errors=True)
    try:
        os.rename(src, dst)
    except OSError:
        marker = read_marker(dst)
        if marker is None or marker.get("key") != key:
            raise


def _write_marker(d: Path, key: str, build: dict, info: dict) -> None:
    # Written last: its presence is what marks a folder as a complete build.
    (d / BUILD_MARKER).write_text(json.dumps({"key": key, "params": build, "info": info}, indent=2) + "\n")


def ensure_demo_assets(cache_dir: str | os.PathLike, *, data_path: str | os.PathLike = DEMO_DATA_PATH,
                       vocab_size: int = 512, log=print, **target_kwargs) -> tuple[str, str]:
    """Build the demo tokenizer and target once under `cache_dir` and reuse them afterwards.

    The build lives in `cache_dir/demo-<key>/` where key hashes the build parameters, the build
    recipe version and the dataset bytes, so changing any of them builds afresh next to (not over)
    older builds. Returns (target_dir, tokenizer_dir); the target folder also holds the tokenizer.
    """
    build = _build_params(data_path, vocab_size, target_kwargs)
    key = _build_key(build)
    root = Path(cache_dir).expanduser() / f"demo-{key}"
    marker = read_marker(root)
    if marker is not None and marker.get("key") == key:
        if log:
            log(f"[demo] reusing cached demo target {root}")
    else:
        if log:
            log(f"[demo] building tokenizer + target in {root} (one-off)")
        root.parent.mkdir(parents=True, exist_ok=True)
        # Built in a temporary sibling and renamed into place, so an interrupted build never
        # leaves a folder that looks complete.
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
        try:
            info = _build_tree(tmp, build, data_path, log)
            _write_marker(tmp, key, build, info)
            _publish(tmp, root, key)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(root / "target"), str(root / "tokenizer")


def ensure_demo_target(path: str | os.PathLike, *, data_path: str | os.PathLike = DEMO_DATA_PATH,
                       vocab_size: int = 512, log=print, **target_kwargs) -> str:
    """Make `path` a demo target folder (HF model + tokenizer files), building it if it is missing
    or was built from other parameters/data. A folder at `path` that this module did not build is
    never overwritten. Returns `path`."""
    path = Path(path).expanduser()
    build = _build_params(data_path, vocab_size, target_kwargs)
    key = _build_key(build)
    marker = read_marker(path)
    if marker is not None and marker.get("key") == key:
        if log:
            log(f"[demo] reusing demo target {path}")
        return str(path)
    if marker is None and path.exists() and any(path.iterdir()):
        raise FileExistsError(
            f"{path} exists and is not a specjax demo build; refusing to overwrite it "
            "(point target.path at an empty or new folder, or turn off target.build_demo)")
    if log:
        log(f"[demo] building demo tokenizer + target into {path} (one-off)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        info = _build_tree(tmp, build, data_path, log)
        _write_marker(tmp / "target", key, build, info)
        _publish(tmp / "target", path, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)

"""Output directory of a regeneration: `manifest.json` + `shard-NNNNNN.parquet` files.

Each shard is written to a temporary name in the same directory and renamed into place, so a
shard file that exists is complete; a process killed mid-write leaves only a `.tmp` file, which
is ignored (and overwritten) by the next run. The manifest is written before any shard and holds
the settings that decide the output; `--resume` with other settings is refused, naming them.

It also holds the content of the source: ``input_files``, the path, size and sha256 of every file
the conversations are read from (`fingerprint_files`). Shards are numbered chunks of the source's
conversations, so a source edited between a kill and ``--resume`` would pair the finished shards
with other conversations (some answered twice, some never): such a resume is refused, naming each
changed file and both fingerprints. A manifest written before fingerprints were recorded cannot be
checked: the resume goes on with a warning saying so (refusing would leave an interrupted run no way
to finish but starting over, and the source is unchanged in nearly every resume), and the current
fingerprints are added to the manifest, so later resumes are checked."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from typing import Any

from specjax.regen.common import LOGGER_NAME, ManifestMismatch, RegenerateError

__all__ = [
    "MANIFEST", "COMPARED_KEYS", "shard_name", "prepare_output_dir", "finished_shards",
    "write_shard", "read_shard_stats", "fingerprint_files",
]

log = logging.getLogger(LOGGER_NAME)

MANIFEST = "manifest.json"
_SHARD_RE = re.compile(r"^shard-(\d{6})\.parquet$")
# Settings that change what is written. Others (concurrency, batch size, timeouts, the endpoint
# URL, the specjax version) are recorded for information only.
COMPARED_KEYS = (
    "input", "limit", "backend", "model", "temperature", "top_p", "seed", "max_new_tokens",
    "max_prompt_tokens", "long_prompts", "shard_size", "keep_reasoning", "extra_body", "turns",
    "max_row_bytes", "max_row_depth",  # which rows are skipped, so which conversations each shard holds
    "chat_template_kwargs",  # the prompts the jax back end renders
)
# Compared keys that runs before them did not have (they read every row whatever its size): not compared
# when the old manifest lacks them.
_UNRECORDED_BEFORE = ("max_row_bytes", "max_row_depth")
# Compared keys added after the first manifests were written: (value those runs behaved as, the back end
# it applies to, None = any).
_LATER_KEYS = {"long_prompts": ("skip", "jax"), "turns": ("last", None), "chat_template_kwargs": ({}, "jax")}


def _old_value(old: dict, k: str):
    if k in old or k not in _LATER_KEYS:
        return old.get(k)
    value, backend = _LATER_KEYS[k]
    return value if backend is None or old.get("backend") == backend else None
_STATS_KEY = b"specjax.regen"


def shard_name(k: int) -> str:
    return f"shard-{k:06d}.parquet"


def _write_atomic(path: str, data: bytes) -> None:
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _fmt(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def fingerprint_files(paths: list[str]) -> list[dict]:
    """``{"path", "bytes", "sha256"}`` of each file (streamed by the standard library)."""
    out = []
    for path in paths:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        out.append({"path": path, "bytes": os.path.getsize(path), "sha256": digest})
    return out


def _source_changes(old: list, new: list) -> list[str]:
    """One line per source file whose fingerprint differs between two manifests (or that is only in one)."""
    before = {f.get("path"): f for f in old if isinstance(f, dict)}
    now = {f["path"]: f for f in new}
    lines = []
    for path in sorted(set(before) | set(now), key=str):
        a, b = before.get(path), now.get(path)
        if a is None:
            lines.append(f"{path}: not a source file when the run began, now sha256 {b['sha256']} "
                         f"({b['bytes']:,} bytes)")
        elif b is None:
            lines.append(f"{path}: sha256 {a.get('sha256')} ({a.get('bytes', 0):,} bytes) when the run began, now gone")
        elif (a.get("sha256"), a.get("bytes")) != (b["sha256"], b["bytes"]):
            lines.append(f"{path}: sha256 {a.get('sha256')} ({a.get('bytes', 0):,} bytes) when the run began, "
                         f"sha256 {b['sha256']} ({b['bytes']:,} bytes) now")
    return lines


def prepare_output_dir(out_dir: str, manifest: dict, resume: bool) -> bool:
    """Create ``out_dir`` and write the manifest, or check it on resume. Returns True when an
    earlier run's manifest was found (and matches).

    Refuses: an existing manifest without ``resume``; a manifest whose compared settings differ
    (the message lists each key with both values); a non-empty directory that is not a
    regeneration output."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise RegenerateError(f"cannot create the output directory {out_dir!r}: {e}; choose another --out") from e
    if not os.access(out_dir, os.W_OK):
        raise RegenerateError(f"the output directory {out_dir!r} is not writable; choose another --out")
    path = os.path.join(out_dir, MANIFEST)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise RegenerateError(f"{path} is unreadable ({e}); remove the directory or choose another --out") from e
        if not resume:
            raise RegenerateError(
                f"{out_dir} already holds a regeneration ({MANIFEST}); pass --resume "
                "(config: the stage always resumes) to continue it, or choose another output directory"
            )
        diffs = [
            f"{k}: {_fmt(_old_value(old, k))} in {path} != {_fmt(manifest.get(k))} now"
            for k in COMPARED_KEYS
            if _fmt(_old_value(old, k)) != _fmt(manifest.get(k)) and (k in old or k not in _UNRECORDED_BEFORE)
        ]
        if diffs:
            raise ManifestMismatch(
                f"cannot resume into {out_dir}: it was written with other settings ("
                + "; ".join(diffs)
                + "). Use the original settings, or a new output directory for the new ones."
            )
        if "input_files" in manifest:
            if isinstance(old.get("input_files"), list):
                changes = _source_changes(old["input_files"], manifest["input_files"])
                if changes:
                    raise ManifestMismatch(
                        f"cannot resume into {out_dir}: the source changed since the run began ("
                        + "; ".join(changes)
                        + "). Its finished shards hold the old conversations, numbered in the old order: resuming "
                        "would answer some conversations twice and others never. Restore the original file, or "
                        "regenerate the edited source into a new output directory (or delete this one first)."
                    )
            else:
                log.warning(
                    "%s was written before regeneration recorded its source files' sha256, so this resume cannot check "
                    "that %s is unchanged since the run began; if it was edited, delete %s and regenerate. Recording "
                    "the fingerprints now: later resumes are checked.", path, manifest.get("input"), out_dir)
                _write_atomic(path, (json.dumps({**old, "input_files": manifest["input_files"]}, indent=1,
                                                sort_keys=True) + "\n").encode())
        return True
    leftovers = [n for n in os.listdir(out_dir) if not n.endswith(".tmp")]
    if leftovers:
        raise RegenerateError(
            f"{out_dir} is not empty and holds no {MANIFEST} (found {sorted(leftovers)[:5]}); "
            "choose an empty or new output directory"
        )
    _write_atomic(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return False


def finished_shards(out_dir: str) -> set[int]:
    """Indices of complete shards (temporary files of an interrupted write do not count)."""
    if not os.path.isdir(out_dir):
        return set()
    return {int(m.group(1)) for n in os.listdir(out_dir) if (m := _SHARD_RE.match(n))}


def _schema():
    import pyarrow as pa

    turn = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema([("messages", pa.list_(turn)), ("source_index", pa.int64())])


def write_shard(out_dir: str, k: int, rows: list[tuple[list[dict], int]], stats: dict) -> str:
    """Write shard ``k`` atomically: rows are (messages, source_index); ``stats`` (the shard's
    skip counts and token totals) goes into the parquet metadata so a resumed run can report
    the whole output."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema().with_metadata({_STATS_KEY: json.dumps(stats).encode()})
    table = pa.Table.from_pydict(
        {"messages": [r[0] for r in rows], "source_index": [int(r[1]) for r in rows]}, schema=schema
    )
    path = os.path.join(out_dir, shard_name(k))
    buf = pa.BufferOutputStream()  # shards are small (shard_size rows): serialise, then one atomic write
    pq.write_table(table, buf)
    _write_atomic(path, buf.getvalue().to_pybytes())
    for name in os.listdir(out_dir):  # leftovers of an earlier, killed write of this shard
        if name.startswith(shard_name(k) + ".") and name.endswith(".tmp"):
            try:
                os.unlink(os.path.join(out_dir, name))
            except OSError:
                pass
    return path


def read_shard_stats(path: str) -> dict:
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    try:
        return json.loads(meta.get(_STATS_KEY, b"{}"))
    except json.JSONDecodeError:
        return {}

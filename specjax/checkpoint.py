"""Checkpoints: orbax CheckpointManager holding the train state (draft params, optimizer state, step),
the grain iterator position and a small JSON of run metadata. Saves are atomic (orbax writes
to a temporary folder and renames), so a killed save never becomes the latest checkpoint.

Integrity: a state with non-finite params or optimizer moments is never saved; after each save the
sha256 of every file of the step folder goes into `specjax_checksums.json` beside them. Resuming
(`restore_verified`) checks those, restores, and checks the restored state is finite; a checkpoint
that fails any of this is moved aside (`<step>.damaged-<time>`, kept for inspection, invisible to
orbax and its retention) and the next older one is tried, so one damaged checkpoint can neither be
trained from nor make retention delete the good ones.

The checksum list is itself untrusted: one that is missing, unreadable, malformed or that names a
path outside its step folder (absolute, `..`, through a link, not a regular file) makes that
checkpoint *unverified*, never a crash or a hang. Nothing outside the step folder is opened. An
unverified checkpoint is passed over (moved aside as `<step>.unverified-<time>`) when an older one
verifies, and used with a warning only when none does.

Identity: the meta of each checkpoint records its step and the identity of its run (config, a
hash of the training examples' token ids, a hash of the draft vocabulary; `examples_sha256`,
`vocab_sha256`), so a resumed run can refuse a checkpoint of another run (specjax.train.loop
compares them); a folder whose name is not the step of the state it holds is refused
(`check_restored_step`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import time
from typing import Any, Callable, NamedTuple, Optional

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

from specjax.run_files import (CHECKPOINT_CHECKSUMS_FILE, CHECKPOINT_DATA_ITEM, CHECKPOINT_META_ITEM,
                               CHECKPOINT_MOVED_ASIDE_DIR, CHECKPOINT_STATE_ITEM)

STATE, DATA, META = CHECKPOINT_STATE_ITEM, CHECKPOINT_DATA_ITEM, CHECKPOINT_META_ITEM
# state entries that older specjax versions saved and nothing reads any more: restored (orbax
# restores whole trees) and dropped, so their checkpoints still resume. "rng": a PRNG key the
# train step never used (removed 2026-12).
LEGACY_STATE_KEYS = ("rng",)

log = logging.getLogger("specjax")


class CheckpointMismatch(ValueError):
    pass


class CheckpointSaveError(OSError):
    pass


class CheckpointDamaged(ValueError):
    """No checkpoint (or not the one asked for) passes verification."""


class NonFiniteState(ValueError):
    """A state with NaN/Inf params or optimizer moments, which must not be checkpointed."""


def manager(directory: str, *, keep: int = 3, read_only: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        create=not read_only,
        read_only=read_only,
        enable_async_checkpointing=False,  # the loop saves rarely; sync keeps kill/resume simple
        preservation_policy=ocm.preservation_policy.LatestN(keep) if keep else None,
        cleanup_tmp_directories=True,
    )

    # explicit handlers let item_metadata() describe a saved state before restoring it
    handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler(),
                DATA: grain.checkpoint.CheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(directory), item_handlers=handlers, options=options)


def all_finite(tree) -> bool:
    """Every float leaf of `tree` is finite (one fused reduction on the device, one bool to the host)."""
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        return True
    return bool(jax.jit(lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])))(leaves))


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_iter=None, meta: Optional[dict] = None) -> None:
    """Save `state` (+ data position + meta) as checkpoint `step`, then its checksums. Refuses a state
    whose params or optimizer state are non-finite (NonFiniteState): such a checkpoint could only
    ever resume into NaN."""

    if not all_finite({"params": state["params"], "opt_state": state["opt_state"]}):
        raise NonFiniteState(
            f"refusing to save checkpoint {step} in {mngr.directory}: the draft params or optimizer state "
            f"hold NaN/Inf; the previous checkpoint (step {mngr.latest_step()}) is kept.")
    items = {STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta or {})}
    if data_iter is not None:
        items[DATA] = grain.checkpoint.CheckpointSave(data_iter)
    try:
        mngr.save(int(step), args=ocp.args.Composite(**items), force=True)
        mngr.wait_until_finished()
    except BaseException:
        # when mngr.save itself raises (a full disk), the save's other writer threads may still be
        # running and would recreate <step>.orbax-checkpoint-tmp after the caller removed it (seen in CI
        # runs under load); let them finish or fail first
        with contextlib.suppress(Exception):
            mngr.wait_until_finished()
        raise
    if jax.process_index() == 0:
        write_checksums(str(mngr.directory), int(step))


# ---------------------------------------------------------------------------------------------
# integrity
# ---------------------------------------------------------------------------------------------
# A checksum list longer than this is not one specjax wrote (a large draft's checkpoint lists a few
# hundred files, ~150 bytes each); reading is bounded so a hostile list cannot exhaust memory.
MAX_CHECKSUMS_BYTES = 16 << 20
_SHA256_HEX = frozenset("0123456789abcdef")


class FileCheck(NamedTuple):
    """What `check_files` found. `damage`: the checkpoint must never be resumed (a file missing,
    changed or added, or no checkpoint at all). `unverified`: its files could not be checked, because
    its checksum list is missing, unreadable, malformed, or names a path outside the step folder;
    such a checkpoint is used only when no older one verifies. Both None: every file matches."""

    damage: Optional[str] = None
    unverified: Optional[str] = None


def _sha256_of_regular_file(path: str) -> str:
    # O_NOFOLLOW + the fstat check: a file swapped for a symlink, FIFO or device after the listing
    # was walked is refused instead of followed or read forever
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel != CHECKPOINT_CHECKSUMS_FILE and not rel.startswith(CHECKPOINT_CHECKSUMS_FILE):
                out.append(rel)
    return sorted(out)


def _folder_entries(root: str) -> tuple[dict[str, int], set[str]]:
    """The step folder as it is, without following any link: {relative path: size} of its regular
    files, and the relative paths of everything else (symlinks, FIFOs, devices, sockets)."""
    regular, other = {}, set()
    for d, dirs, names in os.walk(root):  # os.walk lists a symlink to a folder but does not enter it
        for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel == CHECKPOINT_CHECKSUMS_FILE or rel.startswith(CHECKPOINT_CHECKSUMS_FILE):
                continue
            st = os.lstat(os.path.join(d, n))
            if stat.S_ISREG(st.st_mode):
                regular[rel] = st.st_size
            else:
                other.add(rel)
    return regular, other


def write_checksums(directory: str, step: int) -> None:
    """sha256 + size of every file of checkpoint `step`, written atomically beside them."""
    root = os.path.join(directory, str(step))
    sums = {rel: {"size": os.path.getsize(os.path.join(root, rel)),
                  "sha256": _sha256_of_regular_file(os.path.join(root, rel))} for rel in _files(root)}
    tmp = os.path.join(root, CHECKPOINT_CHECKSUMS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "files": sums}, f, indent=0)
    os.replace(tmp, os.path.join(root, CHECKPOINT_CHECKSUMS_FILE))


def _entry_problem(rel, want) -> Optional[str]:
    """Why one entry of a checksum list is not one specjax wrote, or None. A listed path must stay
    inside the step folder by its spelling alone: relative, no `..`, `.` or empty parts."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        return f"entry {rel!r} is not a file name"
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return f"entry {rel!r} is outside the step folder (absolute, or with '..', '.' or an empty part)"
    if rel == CHECKPOINT_CHECKSUMS_FILE or rel.startswith(CHECKPOINT_CHECKSUMS_FILE):
        return f"entry {rel!r} lists the checksum list itself"
    if not isinstance(want, dict):
        return f"entry {rel!r} is {type(want).__name__}, not an object with size and sha256"
    size, digest = want.get("size"), want.get("sha256")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return f"entry {rel!r} has size {size!r}, not a byte count"
    if not isinstance(digest, str) or len(digest) != 64 or not set(digest) <= _SHA256_HEX:
        return f"entry {rel!r} has sha256 {str(digest)[:80]!r}, not 64 hex digits"
    return None


def _read_checksum_list(path: str) -> tuple[Optional[dict], Optional[str]]:
    """(the `files` object of a checksum list, None), or (None, why it cannot be used). The list is
    read only if it is a regular file of bounded size; every entry is validated before any listed
    path is looked at."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path} is not a regular file (a link, FIFO or device)"
        if st.st_size > MAX_CHECKSUMS_BYTES:
            return None, f"{path} is {st.st_size} bytes, more than a checksum list can be ({MAX_CHECKSUMS_BYTES})"
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            listed = json.loads(f.read(MAX_CHECKSUMS_BYTES + 1))
    except (OSError, ValueError, RecursionError) as e:
        return None, f"{path} cannot be read ({type(e).__name__}: {str(e)[:200]})"
    if not isinstance(listed, dict) or listed.get("format") != 1 or not isinstance(listed.get("files"), dict):
        shape = (f"'files' is {type(listed.get('files')).__name__}" if isinstance(listed, dict) and "files" in listed
                 else f"keys {sorted(listed)[:5]}" if isinstance(listed, dict) else f"a JSON {type(listed).__name__}")
        return None, f"{path} is not a checksum list of format 1 with a 'files' object ({shape})"
    files = listed["files"]
    for rel, want in files.items():
        problem = _entry_problem(rel, want)
        if problem is not None:
            return None, f"{path}: {problem}"
    return files, None


def check_files(directory: str, step: int) -> FileCheck:
    """Check checkpoint `step`'s files against its `specjax_checksums.json` without opening anything
    outside the step folder: a listed path is opened only when it is a regular file reached from the
    folder through no link. See FileCheck for what the outcomes mean."""
    root = os.path.join(directory, str(step))
    if not os.path.isdir(root):
        return FileCheck(damage=f"{root} does not exist")
    path = os.path.join(root, CHECKPOINT_CHECKSUMS_FILE)
    if not os.path.lexists(path):
        if os.path.exists(os.path.join(root, "_CHECKPOINT_METADATA")):
            return FileCheck(unverified=f"{path} is missing (deleted, or the checkpoint predates checksums)")
        return FileCheck(damage=f"{root} is not a complete checkpoint (no {CHECKPOINT_CHECKSUMS_FILE}, "
                                f"no _CHECKPOINT_METADATA)")
    listed, problem = _read_checksum_list(path)
    if problem is not None:
        return FileCheck(unverified=problem)
    regular, other = _folder_entries(root)
    for rel, want in sorted(listed.items()):
        p = os.path.join(root, rel)
        parts = rel.split("/")
        if rel in other or any("/".join(parts[:i]) in other for i in range(1, len(parts))):
            return FileCheck(unverified=f"{path} lists {rel}, which is a link or not a regular file")
        if rel not in regular:
            return FileCheck(damage=f"{p} is missing")
        if regular[rel] != want["size"]:
            return FileCheck(damage=f"{p} has {regular[rel]} bytes, {want['size']} were written")
        try:
            digest = _sha256_of_regular_file(p)
        except OSError as e:
            return FileCheck(damage=f"{p} cannot be read ({e})")
        if digest != want["sha256"]:
            return FileCheck(damage=f"{p} does not match the sha256 written when it was saved")
    extra = sorted((set(regular) | other) - set(listed))
    if extra:
        return FileCheck(damage=f"{root} has files that were not part of the save: {extra[:5]}")
    return FileCheck()


def verify(directory: str, step: int) -> Optional[str]:
    """None when every file of checkpoint `step` matches its checksum list, else what is wrong: its
    damage, or why it could not be verified (see `check_files`)."""
    result = check_files(directory, step)
    return result.damage or result.unverified


def quarantine(directory: str, step: int, label: str = "damaged") -> str:
    """Move a checkpoint out of orbax's sight (and out of its retention): <step>.<label>-<time>."""
    src = os.path.join(directory, str(step))
    dst = os.path.join(directory, CHECKPOINT_MOVED_ASIDE_DIR.format(step=step, label=label,
                                                                   time=time.strftime('%Y%m%d-%H%M%S')))
    if jax.process_index() == 0:
        os.replace(src, dst)
    return dst


def remove_partial_saves(directory: str, step: int) -> list[str]:
    """Delete what a failed save of `step` left behind (orbax's `<step>.orbax-checkpoint-tmp-*`
    folders, or a step folder without its checksums); returns the removed paths."""
    removed = []
    if jax.process_index() != 0 or not os.path.isdir(directory):
        return removed
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        partial = name.startswith(f"{step}.orbax-checkpoint-tmp") or (
            name == str(step) and not os.path.exists(os.path.join(path, CHECKPOINT_CHECKSUMS_FILE)))
        if partial:
            _remove_tree(path)
            removed.append(path)
    return removed


def _remove_tree(path: str, timeout_s: float = 10.0, quiet_s: float = 1.5) -> None:
    """rmtree that outlasts the failed save's own writer threads: tensorstore may still be writing
    (or failing to write) chunks into the folder when the error reaches us, recreating it after it
    is removed (seen in CI under load: gone at one check, back a moment later). So the folder must
    stay gone for `quiet_s` in a row before this returns, or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    gone_since = None
    while True:
        now = time.monotonic()
        if os.path.exists(path):
            shutil.rmtree(path, ignore_errors=True)
            gone_since = None
        elif gone_since is None:
            gone_since = now
        if (gone_since is not None and now - gone_since >= quiet_s) or now > deadline:
            break
        time.sleep(0.1)
    if os.path.exists(path):
        log.warning("could not remove the partial checkpoint %s; delete it by hand", path)


class CheckpointFromAnotherRun(CheckpointMismatch):
    """A checkpoint this run must not resume: written by another run (another draft vocabulary, or
    data and settings the override does not cover), or kept under a folder name that is not its step."""


def read_meta(mngr: ocp.CheckpointManager, step: int) -> dict:
    """The small JSON saved beside checkpoint `step`'s state (step, metrics, run identity), read
    without touching the state."""
    meta = mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    return meta if isinstance(meta, dict) else {}


def check_restored_step(directory: str, step: int, state: Any) -> None:
    """CheckpointFromAnotherRun unless the state in folder `step` is the state of that step: a
    checkpoint copied in or renamed under another number would resume at the wrong step, and the
    run's own save of that number would then collide with it on every rerun."""
    if not isinstance(state, dict) or "step" not in state:
        return
    held = int(np.asarray(jax.device_get(state["step"])))
    if held != step:
        where = os.path.join(directory, str(step))
        raise CheckpointFromAnotherRun(
            f"checkpoint {where} does not belong here:\n  step: folder {step} holds step {held}\n"
            f"A checkpoint folder is named after the step it saved; this one was copied in or renamed. Move "
            f"{where} out of {directory} (the run then resumes from its own checkpoints), or set "
            f"checkpoint.restore_from=none to start fresh.")


def restore_verified(mngr: ocp.CheckpointManager, abstract_state: Any, data_iter=None,
                     check_meta: Optional[Callable[[int, dict], None]] = None):
    """Restore the newest checkpoint that verifies (checksums, readable, finite), moving each damaged
    newer one aside with a warning. Returns (state, meta, step), or (None, None, None) when there is
    no checkpoint at all.

    A checkpoint whose checksum list is missing, malformed or points outside its folder
    (`check_files`: unverified) is passed over while an older one verifies: the older one is resumed
    and the unverified newer ones are moved aside as `<step>.unverified-<time>` (left in place they
    would collide with this run's next saves). When none verifies, the newest unverified one that
    restores is used, with a warning that nothing was verified.

    `check_meta(step, meta)` sees each candidate's saved meta before its state is restored and raises
    CheckpointMismatch to refuse it (a checkpoint of another run). CheckpointMismatch (another
    configuration, another run) is raised, not skipped; CheckpointDamaged when checkpoints exist but
    none can be used."""
    directory = str(mngr.directory)
    damaged, unverified = [], []

    def attempt(step: int):
        """(state, meta) of `step`, or the problem that makes it unusable."""
        try:
            meta = read_meta(mngr, step)
        except Exception as e:  # noqa: BLE001 - any failure to read is damage here
            return f"its meta cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})"
        if check_meta is not None:
            check_meta(step, meta)
        try:
            state, meta = restore(mngr, abstract_state, data_iter, step=step)
        except CheckpointMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - any failure to read is damage here
            return f"it cannot be restored ({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})"
        check_restored_step(directory, step, state)
        if not all_finite({"params": state["params"], "opt_state": state["opt_state"]}):
            return "its params or optimizer state hold NaN/Inf"
        return state, meta

    def set_aside(step: int, problem: str, label: str, then: str) -> None:
        moved = quarantine(directory, step, label)
        log.warning("checkpoint %s/%d %s: %s. Moved aside to %s; %s.", directory, step,
                    "is damaged" if label == "damaged" else "could not be verified", problem, moved, then)
        mngr.reload()

    for step in sorted(mngr.all_steps(), reverse=True):
        files = check_files(directory, step)
        if files.unverified is not None:
            unverified.append((step, files.unverified))
            continue
        got = files.damage or attempt(step)
        if isinstance(got, tuple):
            for newer, why in unverified:
                set_aside(newer, why, "unverified", f"resuming from the older checkpoint {step}, which verifies")
            return (*got, step)
        damaged.append(f"{step}: {got}")
        set_aside(step, got, "damaged", "trying the next older checkpoint")
    for step, why in unverified:  # none verifies: the newest unverified one that restores
        log.warning("checkpoint %s/%d could not be verified: %s. No older checkpoint verifies, so it is used "
                    "unverified: a changed byte in it would go unnoticed.", directory, step, why)
        got = attempt(step)
        if isinstance(got, tuple):
            return (*got, step)
        damaged.append(f"{step}: {got}")
        set_aside(step, got, "damaged", "trying the next older checkpoint")
    if damaged:
        raise CheckpointDamaged(
            f"no checkpoint in {directory} verifies ({'; '.join(damaged)}); they were moved aside as "
            f"<step>.damaged-*. Set checkpoint.restore_from=none to start fresh, or point it at a good copy.")
    return None, None, None


def _plain_path(path) -> tuple:
    # saved metadata uses dict/list keys where the live tree has namedtuple attributes: compare names
    out = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
        else:
            out.append(str(k))
    return tuple(out)


def _shape_diff(expected, found) -> list[str]:
    out = []
    e_flat = {_plain_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(expected)[0]}
    f_flat = {_plain_path(p): v for p, v in jax.tree_util.tree_flatten_with_path(found)[0]}
    for path in sorted(set(e_flat) | set(f_flat), key=str):
        name = ".".join(str(p) for p in path)
        e, f = e_flat.get(path), f_flat.get(path)
        if e is None:
            out.append(f"  {name}: only in checkpoint {tuple(f.shape)}")
        elif f is None:
            out.append(f"  {name}: missing from checkpoint (expected {tuple(e.shape)})")
        elif tuple(e.shape) != tuple(f.shape):
            out.append(f"  {name}: checkpoint {tuple(f.shape)} != this config {tuple(e.shape)}")
    return out


def _saved_state(mngr: ocp.CheckpointManager, step: int):
    saved = mngr.item_metadata(step)
    return saved[STATE] if saved is not None and STATE in saved else None


def _legacy_entries(saved_state, abstract_state) -> dict:
    """Abstract values for the LEGACY_STATE_KEYS that checkpoint holds and this version's state lacks
    (replicated like the step counter)."""
    # orbax describes a saved tree with a Mapping-like TreeMetadata, not a dict
    if not hasattr(saved_state, "keys") or not isinstance(abstract_state, dict):
        return {}
    sharding = getattr(abstract_state.get("step"), "sharding", None)
    return {k: jax.ShapeDtypeStruct(tuple(saved_state[k].shape), saved_state[k].dtype, sharding=sharding)
            for k in LEGACY_STATE_KEYS if k in saved_state and k not in abstract_state}


def check_compatible(mngr: ocp.CheckpointManager, step: int, abstract_state: Any) -> None:
    """CheckpointMismatch (with the shape diff) when checkpoint `step` holds a state of other shapes
    than `abstract_state`, i.e. was written by a different draft configuration."""
    saved_state = _saved_state(mngr, step)
    if saved_state is not None:
        legacy = _legacy_entries(saved_state, abstract_state)
        expected = {**abstract_state, **legacy} if legacy else abstract_state
        diff = _shape_diff(expected, saved_state)
        if diff:
            raise CheckpointMismatch(
                f"checkpoint {mngr.directory}/{step} was written by a different configuration:\n"
                + "\n".join(diff)
                + "\nUse a new run.output_dir, or set checkpoint.restore_from=none to start fresh."
            )


def restore(mngr: ocp.CheckpointManager, abstract_state: Any, data_iter=None, step: Optional[int] = None):
    """Restore (state, meta) at `step` (default latest) into the shardings of `abstract_state`;
    the grain iterator, if given, is moved to its saved position in place."""

    step = mngr.latest_step() if step is None else step
    if step is None:
        return None, None
    check_compatible(mngr, step, abstract_state)
    legacy = _legacy_entries(_saved_state(mngr, step), abstract_state)
    items = {STATE: ocp.args.StandardRestore({**abstract_state, **legacy} if legacy else abstract_state),
             META: ocp.args.JsonRestore()}
    if data_iter is not None:
        items[DATA] = grain.checkpoint.CheckpointRestore(data_iter)
    restored = mngr.restore(step, args=ocp.args.Composite(**items))
    state = restored[STATE]
    if legacy:
        state = {k: v for k, v in state.items() if k not in legacy}
    return state, restored[META]


def abstract_like(tree) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)), tree
    )


# ---------------------------------------------------------------------------------------------
# run identity: what a checkpoint was trained on, recorded in its meta (see specjax.train.loop)
# ---------------------------------------------------------------------------------------------
IDENTITY = "identity"  # the meta key


def examples_sha256(examples) -> str:
    """sha256 over the prepared training examples in order (each one's length, token ids and loss
    mask): what the saved data position indexes into. Any change of the data files or of how they
    are templated, tokenized, truncated or split changes it; moving the files does not."""
    h = hashlib.sha256()
    for ex in examples:
        ids = np.ascontiguousarray(ex.input_ids, dtype="<i4")
        h.update(int(ids.shape[0]).to_bytes(8, "little"))
        h.update(ids.tobytes())
        h.update(np.ascontiguousarray(ex.loss_mask, dtype="<i4").tobytes())
    return h.hexdigest()


def vocab_sha256(vocab) -> str:
    """sha256 of a draft vocabulary (its target vocab size and draft ids, which fix d2t and t2d): the
    rows of the draft's lm_head are in this vocabulary's order."""
    h = hashlib.sha256(f"V={int(vocab.t2d.shape[0])};".encode())
    h.update(np.ascontiguousarray(vocab.draft_ids, dtype="<i8").tobytes())
    return h.hexdigest()


def config_sha256(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()

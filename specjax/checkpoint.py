"""Checkpoints: orbax CheckpointManager holding the train state (draft params, optimizer state, step),
the grain iterator position and a small JSON of run metadata. Saves are atomic (orbax writes
to a temporary folder and renames), so a killed save never becomes the latest checkpoint.

Integrity: a state with non-finite params or optimizer moments is never saved; after each save the
sha256 of every file of the step folder goes into `specjax_checksums.json` beside them. Resuming
(`restore_verified`) checks those, restores, and checks the restored state is finite; a checkpoint
that fails any of this is moved aside (`<step>.damaged-<time>`, kept for inspection, invisible to
orbax and its retention) and the next older one is tried, so one damaged checkpoint can neither be
trained from nor make retention delete the good ones.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any, Optional

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

STATE, DATA, META = "state", "data_iter", "meta"
# state entries that older specjax versions saved and nothing reads any more: restored (orbax
# restores whole trees) and dropped, so their checkpoints still resume. "rng": a PRNG key the
# train step never used (removed 2026-12).
LEGACY_STATE_KEYS = ("rng",)
CHECKSUMS_FILE = "specjax_checksums.json"

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
def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(root: str) -> list[str]:
    out = []
    for d, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), root)
            if rel != CHECKSUMS_FILE and not rel.startswith(CHECKSUMS_FILE):
                out.append(rel)
    return sorted(out)


def write_checksums(directory: str, step: int) -> None:
    """sha256 + size of every file of checkpoint `step`, written atomically beside them."""
    root = os.path.join(directory, str(step))
    sums = {rel: {"size": os.path.getsize(os.path.join(root, rel)), "sha256": _sha256(os.path.join(root, rel))}
            for rel in _files(root)}
    tmp = os.path.join(root, CHECKSUMS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "files": sums}, f, indent=0)
    os.replace(tmp, os.path.join(root, CHECKSUMS_FILE))


def verify(directory: str, step: int) -> Optional[str]:
    """None when checkpoint `step` matches its checksums, else what is wrong (for the log). A step
    folder without checksums (written before they existed) passes here; the restored state is
    still checked for finiteness."""
    root = os.path.join(directory, str(step))
    if not os.path.isdir(root):
        return f"{root} does not exist"
    path = os.path.join(root, CHECKSUMS_FILE)
    if not os.path.exists(path):
        return None if os.path.exists(os.path.join(root, "_CHECKPOINT_METADATA")) else \
            f"{root} is not a complete checkpoint (no {CHECKSUMS_FILE}, no _CHECKPOINT_METADATA)"
    try:
        with open(path) as f:
            listed = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{path} cannot be read ({e})"
    for rel, want in sorted(listed.items()):
        p = os.path.join(root, rel)
        if not os.path.exists(p):
            return f"{p} is missing"
        if os.path.getsize(p) != want["size"]:
            return f"{p} has {os.path.getsize(p)} bytes, {want['size']} were written"
        if _sha256(p) != want["sha256"]:
            return f"{p} does not match the sha256 written when it was saved"
    extra = sorted(set(_files(root)) - set(listed))
    if extra:
        return f"{root} has files that were not part of the save: {extra[:5]}"
    return None


def quarantine(directory: str, step: int) -> str:
    """Move a damaged checkpoint out of orbax's sight (and out of its retention): <step>.damaged-<time>."""
    src = os.path.join(directory, str(step))
    dst = f"{src}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
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
            name == str(step) and not os.path.exists(os.path.join(path, CHECKSUMS_FILE)))
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


def restore_verified(mngr: ocp.CheckpointManager, abstract_state: Any, data_iter=None):
    """Restore the newest checkpoint that verifies (checksums, readable, finite), moving each damaged
    newer one aside with a warning. Returns (state, meta, step), or (None, None, None) when there is
    no checkpoint at all. CheckpointMismatch (another configuration) is raised, not skipped;
    CheckpointDamaged when checkpoints exist but none verifies."""
    directory = str(mngr.directory)
    tried = []
    for step in sorted(mngr.all_steps(), reverse=True):
        problem = verify(directory, step)
        if problem is None:
            try:
                state, meta = restore(mngr, abstract_state, data_iter, step=step)
            except CheckpointMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - any failure to read is damage here
                problem = f"it cannot be restored ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
            else:
                if all_finite({"params": state["params"], "opt_state": state["opt_state"]}):
                    return state, meta, step
                problem = "its params or optimizer state hold NaN/Inf"
        moved = quarantine(directory, step)
        tried.append(f"{step}: {problem}")
        log.warning("checkpoint %s/%d is damaged: %s. Moved aside to %s; trying the next older checkpoint.",
                    directory, step, problem, moved)
        mngr.reload()
    if tried:
        raise CheckpointDamaged(
            f"no checkpoint in {directory} verifies ({'; '.join(tried)}); they were moved aside as "
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

"""Checkpoints: orbax CheckpointManager holding the train state (draft params, optimizer state, step,
RNG), the grain iterator position and a small JSON of run metadata. Saves are atomic (orbax writes
to a temporary folder and renames), so a killed save never becomes the latest checkpoint.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

STATE, DATA, META = "state", "data_iter", "meta"


class CheckpointMismatch(ValueError):
    pass


class CheckpointSaveError(OSError):
    pass


def manager(directory: str, *, keep: int = 3, read_only: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        create=not read_only,
        read_only=read_only,
        enable_async_checkpointing=False,  # the loop saves rarely; sync keeps kill/resume simple
        preservation_policy=ocm.preservation_policy.LatestN(keep) if keep else None,
        cleanup_tmp_directories=True,
    )
    import grain

    # explicit handlers let item_metadata() describe a saved state before restoring it
    handlers = {STATE: ocp.StandardCheckpointHandler(), META: ocp.JsonCheckpointHandler(),
                DATA: grain.checkpoint.CheckpointHandler()}
    return ocp.CheckpointManager(os.path.abspath(directory), item_handlers=handlers, options=options)


def save(mngr: ocp.CheckpointManager, step: int, state: Any, data_iter=None, meta: Optional[dict] = None) -> None:
    import grain

    items = {STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta or {})}
    if data_iter is not None:
        items[DATA] = grain.checkpoint.CheckpointSave(data_iter)
    mngr.save(int(step), args=ocp.args.Composite(**items), force=True)
    mngr.wait_until_finished()


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


def restore(mngr: ocp.CheckpointManager, abstract_state: Any, data_iter=None, step: Optional[int] = None):
    """Restore (state, meta) at `step` (default latest) into the shardings of `abstract_state`;
    the grain iterator, if given, is moved to its saved position in place."""
    import grain

    step = mngr.latest_step() if step is None else step
    if step is None:
        return None, None
    saved = mngr.item_metadata(step)
    saved_state = saved[STATE] if saved is not None and STATE in saved else None
    if saved_state is not None:
        diff = _shape_diff(abstract_state, saved_state)
        if diff:
            raise CheckpointMismatch(
                f"checkpoint {mngr.directory}/{step} was written by a different configuration:\n"
                + "\n".join(diff)
                + "\nUse a new run.output_dir, or set checkpoint.restore_from=none to start fresh."
            )
    items = {STATE: ocp.args.StandardRestore(abstract_state), META: ocp.args.JsonRestore()}
    if data_iter is not None:
        items[DATA] = grain.checkpoint.CheckpointRestore(data_iter)
    restored = mngr.restore(step, args=ocp.args.Composite(**items))
    return restored[STATE], restored[META]


def abstract_like(tree) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)), tree
    )

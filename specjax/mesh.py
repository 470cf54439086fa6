"""Device mesh and the one logical-axis rules table.

Every array that crosses the train step's boundary (target params, draft params, optimizer state,
batch) is annotated with logical axis names; `RULES` maps them to mesh axes. Scaling out is a
config change (`parallelism.*`), not a code change.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor", "context", "expert")

# logical name -> mesh axes (a tuple shards one array dim over several mesh axes; None = replicate)
RULES: dict[str, Any] = {
    "batch": ("data", "fsdp", "expert"),
    "seq": "context",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "vocab": "tensor",
    "draft_vocab": "tensor",
    "experts": "expert",
    "expert_mlp": "tensor",
    "ssm_heads": "tensor",
    "layers": None,
    "head_dim": None,
    "norm": None,
    "ssm_state": None,
    "ttt": None,
}


def mesh_shape(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """Resolve -1 (fill) and check the product equals the device count."""
    sizes = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ValueError(f"parallelism: only one axis may be -1 (fill), got {fill}.")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if any(s == 0 or s < -1 for s in sizes.values()):
        raise ValueError(f"parallelism: sizes must be positive or -1, got {sizes}.")
    if fill:
        if num_devices % fixed:
            raise ValueError(
                f"parallelism: {num_devices} devices are not divisible by the fixed axes {sizes} "
                f"(product {fixed}); change the sizes so their product divides {num_devices}."
            )
        sizes[fill[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total > num_devices:
        raise ValueError(
            f"parallelism {sizes} needs {total} devices but only {num_devices} are visible."
        )
    return sizes


def make_mesh(sizes: dict[str, int], devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(sizes, len(devices))
    n = math.prod(shape.values())
    arr = np.asarray(devices[:n]).reshape(tuple(shape[a] for a in MESH_AXES))
    # Auto axes: the compiler propagates shardings inside the step; we pin only the boundaries.
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_pspec(logical: Optional[Sequence[Optional[str]]], mesh: Mesh, exclude: Sequence[str] = ()) -> P:
    """The PartitionSpec of a logical-axis tuple under RULES; mesh axes in `exclude` are not used
    (e.g. the frozen target kept whole across `fsdp`: parallelism.target_sharding)."""
    if logical is None:
        return P()
    out, used = [], set()
    for name in logical:
        phys = RULES.get(name) if name is not None else None
        if name is not None and name not in RULES:
            raise KeyError(f"logical axis `{name}` has no rule in specjax.mesh.RULES")
        axes = (phys,) if isinstance(phys, str) else tuple(phys or ())
        # drop mesh axes of size 1 and axes already used by an earlier dim
        axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in used and a not in exclude)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def _fits(shape: Sequence[int], spec: P, mesh: Mesh) -> P:
    """Replicate a dim whose size is not divisible by its mesh axes (tiny models, odd vocabs)."""
    fixed = []
    for dim, ax in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if ax is None:
            fixed.append(None)
            continue
        n = math.prod(mesh.shape[a] for a in ((ax,) if isinstance(ax, str) else ax))
        fixed.append(ax if dim % n == 0 else None)
    return P(*fixed)


def named_sharding(mesh: Mesh, logical, shape=None, exclude: Sequence[str] = ()) -> NamedSharding:
    spec = logical_to_pspec(logical, mesh, exclude)
    if shape is not None:
        spec = _fits(shape, spec, mesh)
    return NamedSharding(mesh, spec)


def tree_shardings(mesh: Mesh, logical_tree, shape_tree, exclude: Sequence[str] = ()) -> Any:
    """Shardings for a pytree given a matching tree of logical-axis tuples and of arrays/shapes
    (mesh axes in `exclude` left out, see `logical_to_pspec`)."""
    is_leaf = lambda x: x is None or (isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x))
    flat_logical, _ = jax.tree_util.tree_flatten(logical_tree, is_leaf=is_leaf)
    flat_shapes, treedef = jax.tree_util.tree_flatten(shape_tree)
    if len(flat_logical) != len(flat_shapes):
        raise ValueError("logical-axis tree does not match the parameter tree")
    out = [named_sharding(mesh, lg, np.shape(s) if not hasattr(s, "shape") else s.shape, exclude)
           for lg, s in zip(flat_logical, flat_shapes)]
    return jax.tree_util.tree_unflatten(treedef, out)


def shard(x: jax.Array, logical: Sequence[Optional[str]], mesh: Optional[Mesh] = None) -> jax.Array:
    """Constrain an activation inside jit to its logical sharding (no-op without a mesh)."""
    if mesh is None or mesh.size == 1:
        return x
    spec = _fits(x.shape, logical_to_pspec(logical, mesh), mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


BATCH_LOGICAL = ("batch", "seq")


# --------------------------------------------------------------------------------------------
# Context parallelism: the explicit shard_map paths (target attention, TTT attention, Mamba-2)
# need the concrete mesh while the step is traced. Tracers carry no mesh on Auto axes, so the
# step activates it with `with use_mesh(mesh):` around the traced body; layers then ask
# `context_mesh()`, which is None unless the active mesh has context > 1 (no behaviour change).
# --------------------------------------------------------------------------------------------
import contextlib as _contextlib
import contextvars as _contextvars

_ACTIVE: _contextvars.ContextVar = _contextvars.ContextVar("specjax_active_mesh", default=None)
CONTEXT_AXIS = "context"


@_contextlib.contextmanager
def use_mesh(mesh: Optional[Mesh]):
    """Make `mesh` the one the layers' explicit collectives use while tracing inside this block, and
    the one the Mosaic TPU kernels are split over (batch over the batch axes, heads over `tensor`:
    XLA cannot partition a Mosaic call, specjax_kernels.tpu_lowering.kernel_mesh)."""
    from specjax_kernels.tpu_lowering import kernel_mesh

    token = _ACTIVE.set(mesh)
    try:
        with kernel_mesh(mesh, batch_axes=RULES["batch"], head_axes=(RULES["heads"],)):
            yield mesh
    finally:
        _ACTIVE.reset(token)


def context_mesh() -> Optional[Mesh]:
    """The active mesh when it shards the sequence (context > 1), else None."""
    mesh = _ACTIVE.get()
    if mesh is None or CONTEXT_AXIS not in mesh.shape or mesh.shape[CONTEXT_AXIS] == 1:
        return None
    return mesh


def spec_for(shape: Sequence[int], logical: Sequence[Optional[str]], mesh: Mesh) -> P:
    """The PartitionSpec `logical` maps to on `mesh`, with dims that do not divide replicated."""
    return _fits(shape, logical_to_pspec(logical, mesh), mesh)


def check_context_divides(seq_len: int, mesh: Mesh, what: str) -> int:
    c = mesh.shape[CONTEXT_AXIS]
    if seq_len % c:
        raise ValueError(
            f"{what}: sequence length {seq_len} is not divisible by parallelism.context={c}; pad the "
            f"sequence (data.seq_len) to a multiple of {c} or lower parallelism.context.")
    return c

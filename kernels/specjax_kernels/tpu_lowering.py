"""Lowering for a TPU from any host: what a machine without a TPU (CI's CPU) can check of the TPU paths.

`jax.export.export(jax.jit(f), platforms=["tpu"])(*shapes)`, or `jit(f).trace(*shapes).lower(
lowering_platforms=("tpu",))`, runs Pallas's TPU lowering for every `pallas_call` in `f`: the kernel
body becomes Mosaic MLIR (a primitive without a Mosaic lowering rule is an error), the block shapes are
checked (the last two dims of a block divisible by 8 and 128, or equal to the array's), the MLIR is
verified, and the kernel becomes a `stablehlo.custom_call @tpu_custom_call` carrying the serialized
Mosaic module and its `kernel_name`. A backend that silently fell back to XLA leaves no such call, so
`mosaic_kernels` (counted per kernel name) is what the lowering tests assert on.

Not run without a TPU: Mosaic's own compiler passes (vector layout inference and application, VMEM
allocation against the chip's capacity) and XLA:TPU's compile of the module (fusion, buffer
assignment, memory analysis); both happen in libtpu on a TPU.

The chip: a few Mosaic lowering rules read the chip's generation (`jax._src.pallas.mosaic.tpu_info.
get_tpu_info()`, e.g. for `lax.sign` and rank-1 blocks) from the current abstract mesh's
`jax.sharding.AbstractDevice`, else from the default device, which on a CPU host is "cpu" and is refused
("Unsupported TPU device kind: cpu"). `lowering_for("tpu", chip=...)` names the chip that way, through
`jax.sharding.use_abstract_mesh` with an `AbstractDevice` (JAX's documented way to trace and lower for a
TPU it does not have); the abstract mesh is part of JAX's trace-cache key, so a function traced for the
CPU is traced again for the TPU. It also makes `auto` choose kernels for the TPU
(`selection.target_platform`). The specjax kernels avoid the chip-dependent rules (they lower with no
chip named); the chip is still named and reported so that a lowering states what it assumed.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import re

import jax

from specjax_kernels.selection import platform_override

# --tpu-chip name -> (the device_kind a JAX TPU device of that chip reports, TensorCores per JAX device);
# the device kinds are the ones jax._src.pallas.mosaic.tpu_info.chip_version_from_device_kind maps.
TPU_CHIPS = {
    "v4": ("TPU v4", 2),         # megacore: one JAX device = both TensorCores
    "v5e": ("TPU v5 lite", 1),
    "v5p": ("TPU v5", 2),        # megacore
    "v6e": ("TPU v6 lite", 1),
    "7x": ("TPU7x", 1),          # two TensorCores per chip, each its own JAX device
}
DEFAULT_TPU_CHIP = "v6e"
PLATFORMS = ("cpu", "gpu", "tpu")

_CALL = "stablehlo.custom_call @tpu_custom_call"
_KERNEL_NAME = re.compile(r'kernel_name = "([^"]*)"')


def check_chip(chip: str) -> str:
    if chip not in TPU_CHIPS:
        raise ValueError(f"unknown TPU chip {chip!r}; choose one of {', '.join(TPU_CHIPS)} "
                         f"(the chip Mosaic's lowering is told it targets).")
    return chip


@contextlib.contextmanager
def lowering_for(platform: str, *, chip: str | None = None, mesh=None):
    """Trace and lower for `platform` from any host inside this block: kernel choice (`auto`, and which
    backends are available) follows `platform`, and for "tpu" Mosaic's lowering is told the chip
    (`chip`, default DEFAULT_TPU_CHIP). `mesh`: the concrete Mesh the lowered function is sharded over
    (its axis names, sizes and types are kept in the abstract mesh); None = one device. Lower inside the
    block too (`jit(f).trace(...).lower(lowering_platforms=(platform,))`, or jax.export)."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; choose one of {', '.join(PLATFORMS)}.")
    if platform != "tpu":
        if chip is not None:
            raise ValueError(f"a TPU chip ({chip!r}) was given for platform {platform!r}; drop it or use tpu.")
        with platform_override(platform):
            yield
        return
    kind, cores = TPU_CHIPS[check_chip(chip or DEFAULT_TPU_CHIP)]
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform="tpu")
    if mesh is None:
        abstract = jax.sharding.AbstractMesh((1,), ("_tpu_lowering",), abstract_device=device)
    else:
        abstract = jax.sharding.AbstractMesh(tuple(mesh.axis_sizes), tuple(mesh.axis_names),
                                             axis_types=tuple(mesh.axis_types), abstract_device=device)
    with platform_override("tpu"), jax.sharding.use_abstract_mesh(abstract):
        yield


def mosaic_kernels(module_text: str) -> collections.Counter:
    """{kernel_name: number of Mosaic TPU custom calls} in a lowered module's text (StableHLO, as
    `Lowered.as_text()` or `Exported.mlir_module()` print it); unnamed kernels count under ''."""
    counts: collections.Counter = collections.Counter()
    for line in module_text.splitlines():
        n = line.count(_CALL)
        if n:
            names = _KERNEL_NAME.findall(line)
            counts[names[0] if len(names) == 1 and n == 1 else ""] += n
    return counts


def mosaic_call_count(module_text: str) -> int:
    """The number of Mosaic TPU custom calls in a lowered module's text."""
    return module_text.count(_CALL)


def export_for_tpu(fn, *args, chip: str | None = None) -> str:
    """StableHLO text of `fn(*args)` (args: arrays or ShapeDtypeStructs) lowered for a TPU by
    jax.export from this host, with `chip` named to Mosaic's lowering (see `lowering_for`)."""
    with lowering_for("tpu", chip=chip):
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


def mosaic_or_interpret(call, *args, interpret: bool | None):
    """`call(pallas_interpret, *args)` for a Pallas TPU kernel, where `pallas_interpret` is what the
    kernel's pallas_call gets as `interpret=`. interpret False: the Mosaic kernel. True: Pallas's TPU
    interpreter (pltpu.InterpretParams: TPU memory semantics, NaN-filled scratch, out-of-bounds reads
    raise). None: decided by the platform being lowered for (jax.lax.platform_dependent): the Mosaic
    kernel when lowering for a TPU, Pallas's generic interpreter (`interpret=True`, also NaN-filled
    scratch) for any other platform. Both branches are traced and lowering keeps only its platform's,
    so a CPU host can lower the TPU kernel and still run the interpreter. The generic interpreter, not
    the TPU one, because the TPU interpreter's ordered host callbacks are an effect that a
    platform_dependent branch cannot carry (lowering for a TPU then fails: "Lowering rule for `cond`
    returns incorrect set of output tokens", jax 0.10.2)."""
    if interpret is None:
        return jax.lax.platform_dependent(*args, tpu=lambda *a: call(False, *a), default=lambda *a: call(True, *a))
    if interpret:
        from jax.experimental.pallas import tpu as pltpu

        return call(pltpu.InterpretParams(), *args)
    return call(False, *args)


def resolve_interpret(interpret: bool | None, tpu_legal: bool, what: str) -> bool | None:
    """The `interpret` a kernel runs with, given whether its blocks are legal on a TPU: an illegal
    block is an error when the kernel must compile for a TPU (interpret=False, or None while choosing
    for a TPU) and means interpret mode otherwise."""
    from specjax_kernels.selection import target_platform

    if tpu_legal:
        return interpret
    if interpret is False or (interpret is None and target_platform() == "tpu"):
        raise ValueError(what)
    return True


# ---------------------------------------------------------------------------------------------
# Mosaic calls on a mesh of several devices. XLA cannot partition a Mosaic custom call: lowering one
# whose operands are sharded fails with "Mosaic kernels cannot be automatically partitioned. Please
# wrap the call in a shard_map." (found by lowering the 8-device train step for a TPU). So the caller
# names the mesh and which of its axes split the batch (rows) and the attention heads, and each
# pallas_tpu backend runs its kernels under jax.shard_map over those axes (each device computes its
# rows / heads; XLA moves operands to that layout). Axes that do not divide a dim are left out of it
# (those devices then compute the same values).
# ---------------------------------------------------------------------------------------------
_KERNEL_MESH: contextvars.ContextVar = contextvars.ContextVar("specjax_kernels_kernel_mesh", default=None)


@contextlib.contextmanager
def kernel_mesh(mesh, *, batch_axes: tuple = (), head_axes: tuple = ()):
    """Split the Mosaic TPU kernels traced inside this block over `mesh`: batch / row dims over
    `batch_axes`, attention-head dims over `head_axes` (mesh axis names). None or a one-device mesh:
    no split. Enter it inside the traced function (specjax.mesh.use_mesh does, in the train step's
    body): jit's trace cache does not see it."""
    token = _KERNEL_MESH.set(None if mesh is None or mesh.size == 1
                             else (mesh, tuple(batch_axes), tuple(head_axes)))
    try:
        yield
    finally:
        _KERNEL_MESH.reset(token)


def active_kernel_mesh():
    """(mesh, batch_axes, head_axes) to split a Mosaic call over, or None: no multi-device mesh named,
    or already inside a shard_map (the caller split the operands itself)."""
    km = _KERNEL_MESH.get()
    if km is None or jax.sharding.get_abstract_mesh().manual_axes:
        return None
    return km


def axes_dividing(mesh, axes, *sizes: int) -> tuple:
    """The axes of `axes` (in order, size > 1) whose running product divides every one of `sizes`."""
    out, prod = [], 1
    for a in axes:
        s = mesh.shape[a]
        if s > 1 and all(n % (prod * s) == 0 for n in sizes):
            out.append(a)
            prod *= s
    return tuple(out)


def dim_spec(axes: tuple):
    """A PartitionSpec entry for one dim split over `axes`."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def shard_kernel(fn, mesh, in_specs, out_specs, *args):
    """`fn(*args)` under jax.shard_map over `mesh` (Pallas calls carry no replication rule, hence
    check_vma=False; a reduction across shards is `fn`'s own psum). Inside `lowering_for` the abstract
    mesh it set (same axes, the TPU as its device) stands for `mesh`: shard_map wants the context's."""
    context = jax.sharding.get_abstract_mesh()
    if (not context.empty and tuple(context.axis_names) == tuple(mesh.axis_names)
            and tuple(context.axis_sizes) == tuple(mesh.axis_sizes)):
        mesh = context
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs, check_vma=False)(*args)

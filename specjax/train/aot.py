"""Ahead-of-time compile of the train step for the configured mesh, without weights or data.

`python -m specjax.launch --config X --compile-only` lowers and compiles the exact jitted step the
loop would run (same shardings, same shapes) from abstract arrays, then reports XLA's per-device
memory analysis and FLOP count. Only the target's config.json is read, so a 70B setup can be checked
on a laptop-sized fake mesh before any weights are downloaded. The abstract target params come from
the architecture's weight map (``specjax.train.setup.abstract_target``), so every registered
architecture works; the draft config, TTT config, optimizer and step functions come from the same
``specjax.train.setup.build_run_setup`` the training loop uses.
``specjax.shapes`` compiles its memory estimate through ``lower_train_step`` too.

`--platform tpu` on a host without a TPU lowers the same step for a TPU instead (`platform="tpu"`):
kernels are chosen for the TPU (`auto` included), every Pallas TPU kernel goes through Mosaic's
lowering (`specjax_kernels.tpu_lowering`: block-shape checks, a lowering rule for every op), and the
chip named with `tpu_chip` is the one Mosaic's lowering is told about. The CPU devices stand in for
the TPU devices of the mesh (same axes and shardings). Nothing is compiled: XLA's memory and cost
analyses need XLA:TPU, so the report gives what the shardings determine (parameter, optimizer-state,
target and batch bytes per device), the kernels chosen and the Mosaic calls in the module, and says
what is not known (temporaries, peak memory, FLOPs, Mosaic's own compile passes).
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from specjax import mesh as meshlib
from specjax.config import Config
from specjax.targets.base import tree_get, tree_set
from specjax.targets.loading import embedding_and_head_paths
from specjax.train.setup import abstract_target, build_run_setup, check_batch_fits, make_mesh
from specjax.train.step import BATCH_KEYS, init_state
from specjax_kernels.selection import recording_choices
from specjax_kernels.tpu_lowering import DEFAULT_TPU_CHIP, TPU_CHIPS, check_chip, lowering_for, mosaic_kernels

# what a lowering for another platform (no compile) cannot tell, printed with its report
NOT_KNOWN_WITHOUT_COMPILE = (
    "temporaries, peak memory and FLOPs per device: XLA's memory and cost analyses need an XLA:TPU "
    "compile (a TPU host); Mosaic's own compile of each kernel (vector layouts, VMEM use against the "
    "chip's capacity) runs in libtpu on a TPU, so a kernel that lowers here can still fail there; "
    "TPU speed of the pallas_tpu kernels is not measured")


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@dataclass
class LoweredStep:
    target: Any  # holds the abstract target params
    draft_config: Any
    draft_params: Any  # abstract
    mesh: Any
    batch: tuple[int, int]
    lowered: Any  # jax.stages.Lowered of the jitted train step
    platform: str = ""  # the platform lowered for
    tpu_chip: str | None = None  # the chip named to Mosaic's lowering (platform "tpu" off a TPU host)
    kernels: dict = field(default_factory=dict)  # {op: [implementations chosen while tracing]}
    abstract_args: tuple = ()  # (state, target params, vocab, batch) as sharded ShapeDtypeStructs


def lower_train_step(cfg: Config, mesh, hf: Mapping[str, Any] | None = None, dtype: str | None = None,
                     batch_size: int | None = None, seq_length: int | None = None, platform: str | None = None,
                     tpu_chip: str | None = None) -> LoweredStep:
    """Lower the train step the loop would run on ``mesh`` (same shardings, draft config, TTT config
    and optimizer) from abstract inputs, for ``abstract_target(cfg, hf, dtype)``. As in training,
    the step computes in float32 for a float32 target and in bfloat16 otherwise. Batch and sequence
    default to data.batch_size and data.seq_length.

    ``platform``: lower for this platform instead of the local one (only "tpu" differs in practice:
    kernels are chosen for it and Mosaic lowers the Pallas TPU kernels; see the module doc), with
    ``tpu_chip`` (a name in specjax_kernels.tpu_lowering.TPU_CHIPS, default DEFAULT_TPU_CHIP) named to
    Mosaic's lowering. The result cannot be compiled here."""

    local = jax.default_backend()
    if platform in (None, local):
        if tpu_chip is not None and local != "tpu":
            raise ValueError(f"a TPU chip ({tpu_chip!r}) only applies to lowering for a TPU; add --platform tpu.")
        context, platform, tpu_chip = contextlib.nullcontext(), local, None
    else:
        tpu_chip = check_chip(tpu_chip or DEFAULT_TPU_CHIP) if platform == "tpu" else tpu_chip
        context = lowering_for(platform, chip=tpu_chip, mesh=mesh)
    with context, recording_choices() as choices:
        step = _lower(cfg, mesh, hf, dtype, batch_size, seq_length, None if platform == local else platform)
    step.platform, step.tpu_chip = platform, tpu_chip
    step.kernels = {op: sorted(names) for op, names in sorted(choices.items())}
    return step


def _lower(cfg, mesh, hf, dtype, batch_size, seq_length, lowering_platform) -> LoweredStep:
    dtype = dtype or cfg.target.dtype
    target = abstract_target(cfg, hf, dtype)
    if cfg.target.source == "cache":  # the step reads only the embedding and lm_head; the states come in the batch
        keep = embedding_and_head_paths(type(target), target.config)
        tparams = {}
        for path in keep:
            tree_set(tparams, path, tree_get(target.params, path))
        target = type(target)(target.config, target.hf_config, tparams)
    tparams = target.params
    setup = build_run_setup(cfg, target, mesh, dtype=dtype)
    dcfg, dparams, optimizer, fns = setup.draft_config, setup.draft_params_shape, setup.optimizer, setup.fns
    state = jax.eval_shape(lambda p: init_state(p, optimizer), dparams)
    B, T = int(batch_size or cfg.data.batch_size), int(seq_length or cfg.data.seq_length)
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=fns.batch_sharding) for k in BATCH_KEYS}
    if cfg.target.source == "cache":
        D, A = int(target.config.hidden_size), len(dcfg.aux_layer_ids)
        sdt = jnp.float32 if dtype == "float32" else jnp.bfloat16
        k = cfg.precompute.teacher_top_k
        shapes = ({"teacher_ids": ((B, T, k), jnp.int32), "teacher_logits": ((B, T, k), jnp.float32),
                   "target_argmax": ((B, T), jnp.int32), "target_lse": ((B, T), jnp.float32)} if k
                  else {"final_hidden": ((B, T, D), sdt)})
        shapes["aux_hidden"] = ((B, T, A, D), sdt)
        batch.update({name: jax.ShapeDtypeStruct(shape, dt, sharding=fns.batch_sharding)
                      for name, (shape, dt) in shapes.items()})
    Vd, V = dcfg.draft_vocab_size, dcfg.vocab_size
    vocab = {"draft_ids": jax.ShapeDtypeStruct((Vd,), jnp.int32), "t2d": jax.ShapeDtypeStruct((V,), jnp.bool_),
             "d2t": jax.ShapeDtypeStruct((Vd,), jnp.int32)}
    args = (_abstract(state, fns.state_shardings), _abstract(tparams, fns.target_shardings),
            _abstract(vocab, fns.vocab_shardings), batch)
    if lowering_platform is None:
        lowered = fns.train_step.lower(*args)
    else:
        lowered = fns.train_step.trace(*args).lower(lowering_platforms=(lowering_platform,))
    return LoweredStep(target, dcfg, dparams, mesh, (B, T), lowered, abstract_args=args)


def bytes_per_device(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
    return int(sum(math.prod(x.sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(tree)))


def lowering_mesh(cfg: Config, platform: str, n_devices: int | None = None):
    """The mesh of the configured parallelism over this host's CPU devices, standing in for the
    `n_devices` devices of `platform` (lowering for a TPU from a host without one; default: as many as
    the fixed parallelism.* sizes need, and a -1 size fills what `n_devices` leaves)."""
    devices = jax.devices("cpu")
    sizes = {a: getattr(cfg.parallelism, a) for a in meshlib.MESH_AXES}
    needed = n_devices or math.prod(max(s, 1) for s in sizes.values())
    if needed > len(devices):
        raise ValueError(
            f"lowering for {platform}: {needed} devices (parallelism {sizes}) and this host has "
            f"{len(devices)} CPU devices to stand in for them; start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} (python -m specjax.launch sets it "
            "itself when JAX has not started yet).")
    return meshlib.make_mesh(sizes, devices=devices[:needed])


def compile_for_analysis(step: LoweredStep):
    """Compile a lowered step for its memory / cost analysis only (the executable never runs). On
    the CPU, LLVM's optimisation of the generated code is skipped (xla_backend_optimization_level=0):
    it changes the machine code, not the HLO passes, buffer assignment or cost analysis read here
    (measured on tiny Llama, Qwen3, Qwen3-MoE, looped, HRM-Text and Nemotron-H steps: identical
    FLOPs and memory figures, 40-50% less compile time)."""
    cpu = all(d.platform == "cpu" for d in step.mesh.devices.flat)
    return step.lowered.compile(compiler_options={"xla_backend_optimization_level": 0} if cpu else None)


def _sharding_report(step: LoweredStep) -> dict:
    state, tparams, _, batch = step.abstract_args
    return {"platform": step.platform, "kernels": step.kernels,
            "draft_param_bytes_per_device": bytes_per_device(state["params"]),
            "optimizer_state_bytes_per_device": bytes_per_device(state["opt_state"]),
            "target_param_bytes_per_device": bytes_per_device(tparams),
            "batch_bytes_per_device": bytes_per_device(batch)}


def _base_report(step: LoweredStep) -> dict:
    n = lambda tree: int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
    return {"mesh": dict(step.mesh.shape), "devices": step.mesh.size, "batch": list(step.batch),
            "architecture": step.target.arch, "target_params": n(step.target.params),
            "target_param_bytes": int(sum(math.prod(x.shape) * x.dtype.itemsize
                                          for x in jax.tree_util.tree_leaves(step.target.params))),
            "target_compute_dtype": getattr(step.target.config, "compute_dtype", "bfloat16"),
            "draft_params": n(step.draft_params)}


def lower_step_for(cfg: Config, platform: str, tpu_chip: str | None = None, n_devices: int | None = None) -> dict:
    """Lower (not compile) the train step for `platform` from this host; the report of the module doc."""
    mesh = lowering_mesh(cfg, platform, n_devices)
    check_batch_fits(cfg, mesh)
    step = lower_train_step(cfg, mesh, platform=platform, tpu_chip=tpu_chip)
    mosaic = mosaic_kernels(step.lowered.as_text())
    report = {**_base_report(step), **_sharding_report(step), "compiled": False}
    if platform == "tpu":
        report["tpu_chip"] = step.tpu_chip
        report["tpu_device_kind"] = TPU_CHIPS[step.tpu_chip][0]
    report["mosaic_kernels"] = dict(sorted(mosaic.items()))
    report["mosaic_calls"] = int(sum(mosaic.values()))
    report["not_known"] = NOT_KNOWN_WITHOUT_COMPILE
    return report


def compile_step(cfg: Config, platform: str | None = None, tpu_chip: str | None = None,
                 n_devices: int | None = None) -> dict:
    """Compile the train step for the configured mesh; XLA's per-device memory and FLOP figures.
    `platform` other than the local backend: lower it for that platform instead (`lower_step_for`;
    `n_devices` = the platform's device count)."""

    local = jax.default_backend()
    if platform not in (None, local):
        if platform != "tpu":
            raise ValueError(
                f"--platform {platform} on a {local} host: only a TPU step can be lowered from another kind of "
                f"host (the GPU kernels need a GPU to lower); run --compile-only on a {platform} machine.")
        return lower_step_for(cfg, platform, tpu_chip, n_devices)
    if n_devices is not None:
        raise ValueError("--devices counts the devices of another platform; add --platform tpu.")
    if tpu_chip is not None and local != "tpu":
        raise ValueError(f"--tpu-chip {tpu_chip} only applies with --platform tpu (this host is {local}).")
    mesh = make_mesh(cfg)
    check_batch_fits(cfg, mesh)
    step = lower_train_step(cfg, mesh)
    compiled = compile_for_analysis(step)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    report = {**_base_report(step), "flops_per_step": float(cost.get("flops", 0.0)) if cost else None,
              **_sharding_report(step)}
    if mem is not None:
        for key in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                    "generated_code_size_in_bytes", "alias_size_in_bytes"):
            report[key] = int(getattr(mem, key, 0))
        report["peak_estimate_bytes_per_device"] = (report["argument_size_in_bytes"] + report["output_size_in_bytes"]
                                                    + report["temp_size_in_bytes"] - report["alias_size_in_bytes"])
    return report


def format_report(report: dict) -> str:
    gib = lambda b: f"{b / 2**30:.3f} GiB"
    lines = [f"mesh {report['mesh']} ({report['devices']} devices), batch {report['batch']}",
             f"target {report['architecture']}: {report['target_params']:,} params "
             f"({gib(report['target_param_bytes'])} of weights, GEMMs in {report['target_compute_dtype']}), "
             f"draft params {report['draft_params']:,}"]
    if report.get("kernels"):
        lines.append("kernels: " + ", ".join(f"{op}={'/'.join(names)}" for op, names in report["kernels"].items()))
    if report.get("compiled") is False:
        chip = f" (chip {report['tpu_chip']}, {report['tpu_device_kind']!r})" if report.get("tpu_chip") else ""
        lines.append(f"lowered for {report['platform']}{chip}, not compiled; Mosaic calls {report['mosaic_calls']}: "
                     + (", ".join(f"{k} x{v}" for k, v in report["mosaic_kernels"].items()) or "none"))
    if "draft_param_bytes_per_device" in report:
        lines.append("per device (from the shardings): draft params {}, optimizer state {}, target params {}, "
                     "batch {}".format(gib(report["draft_param_bytes_per_device"]),
                                       gib(report["optimizer_state_bytes_per_device"]),
                                       gib(report["target_param_bytes_per_device"]),
                                       gib(report["batch_bytes_per_device"])))
    if report.get("not_known"):
        lines.append(f"not known without compiling for {report['platform']}: {report['not_known']}")
    if report.get("flops_per_step"):
        lines.append(f"XLA flops per step (per device program): {report['flops_per_step']:.3e}")
    if "temp_size_in_bytes" in report:
        lines.append("per device: arguments {}, outputs {}, temporaries {}, aliased (donated) {}, peak estimate {}".format(
            gib(report["argument_size_in_bytes"]), gib(report["output_size_in_bytes"]),
            gib(report["temp_size_in_bytes"]), gib(report["alias_size_in_bytes"]),
            gib(report["peak_estimate_bytes_per_device"])))
    return "\n".join(lines) + "\n" + json.dumps(report)

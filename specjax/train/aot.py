"""Ahead-of-time compile of the train step for the configured mesh, without weights or data.

`python -m specjax.launch --config X --compile-only` lowers and compiles the exact jitted step the
loop would run (same shardings, same shapes) from abstract arrays, then reports XLA's per-device
memory analysis and FLOP count. Only the target's config.json is read, so a 70B setup can be checked
on a laptop-sized fake mesh before any weights are downloaded. The abstract target params come from
the architecture's weight map (``specjax.train.setup.abstract_target``), so every registered
architecture works; the draft config, TTT config, optimizer and step functions come from the same
``specjax.train.setup.build_run_setup`` the training loop uses.
``specjax.targets.shapes`` compiles its memory estimate through ``lower_train_step`` too.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from specjax.config import Config
from specjax.train.setup import abstract_target, build_run_setup, check_batch_fits, make_mesh
from specjax.train.step import BATCH_KEYS, init_state


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


def lower_train_step(cfg: Config, mesh, hf: Mapping[str, Any] | None = None, dtype: str | None = None,
                     batch_size: int | None = None, seq_length: int | None = None) -> LoweredStep:
    """Lower the train step the loop would run on ``mesh`` (same shardings, draft config, TTT config
    and optimizer) from abstract inputs, for ``abstract_target(cfg, hf, dtype)``. As in training,
    the step computes in float32 for a float32 target and in bfloat16 otherwise. Batch and sequence
    default to data.batch_size and data.seq_length."""

    dtype = dtype or cfg.target.dtype
    target = abstract_target(cfg, hf, dtype)
    tparams = target.params
    setup = build_run_setup(cfg, target, mesh, dtype=dtype)
    dcfg, dparams, optimizer, fns = setup.draft_config, setup.draft_params_shape, setup.optimizer, setup.fns
    state = jax.eval_shape(lambda p: init_state(p, optimizer), dparams)
    B, T = int(batch_size or cfg.data.batch_size), int(seq_length or cfg.data.seq_length)
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=fns.batch_sharding) for k in BATCH_KEYS}
    Vd, V = dcfg.draft_vocab_size, dcfg.vocab_size
    vocab = {"draft_ids": jax.ShapeDtypeStruct((Vd,), jnp.int32), "t2d": jax.ShapeDtypeStruct((V,), jnp.bool_),
             "d2t": jax.ShapeDtypeStruct((Vd,), jnp.int32)}
    lowered = fns.train_step.lower(_abstract(state, fns.state_shardings), _abstract(tparams, fns.target_shardings),
                                   _abstract(vocab, fns.vocab_shardings), batch)
    return LoweredStep(target, dcfg, dparams, mesh, (B, T), lowered)


def compile_for_analysis(step: LoweredStep):
    """Compile a lowered step for its memory / cost analysis only (the executable never runs). On
    the CPU, LLVM's optimisation of the generated code is skipped (xla_backend_optimization_level=0):
    it changes the machine code, not the HLO passes, buffer assignment or cost analysis read here
    (measured on tiny Llama, Qwen3, Qwen3-MoE, looped, HRM-Text and Nemotron-H steps: identical
    FLOPs and memory figures, 40-50% less compile time)."""
    cpu = all(d.platform == "cpu" for d in step.mesh.devices.flat)
    return step.lowered.compile(compiler_options={"xla_backend_optimization_level": 0} if cpu else None)


def compile_step(cfg: Config) -> dict:
    """Compile the train step for the configured mesh; XLA's per-device memory and FLOP figures."""

    mesh = make_mesh(cfg)
    check_batch_fits(cfg, mesh)
    step = lower_train_step(cfg, mesh)
    compiled = compile_for_analysis(step)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    n = lambda tree: int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
    report = {
        "mesh": dict(mesh.shape),
        "devices": mesh.size,
        "batch": list(step.batch),
        "architecture": step.target.arch,
        "target_params": n(step.target.params),
        "draft_params": n(step.draft_params),
        "flops_per_step": float(cost.get("flops", 0.0)) if cost else None,
    }
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
             f"target {report['architecture']}: {report['target_params']:,} params, "
             f"draft params {report['draft_params']:,}"]
    if report.get("flops_per_step"):
        lines.append(f"XLA flops per step (per device program): {report['flops_per_step']:.3e}")
    if "temp_size_in_bytes" in report:
        lines.append("per device: arguments {}, outputs {}, temporaries {}, aliased (donated) {}, peak estimate {}".format(
            gib(report["argument_size_in_bytes"]), gib(report["output_size_in_bytes"]),
            gib(report["temp_size_in_bytes"]), gib(report["alias_size_in_bytes"]),
            gib(report["peak_estimate_bytes_per_device"])))
    return "\n".join(lines) + "\n" + json.dumps(report)

"""Full-size parameter shapes and a memory estimate for a run config, without allocating weights.

    python -m specjax.shapes --config configs/qwen3_30b_a3b_eagle3.yaml [--batch 1]
        [--seq N] [--no-compile] [--json out.json] [--show-leaves] [section.key=value ...]

Reads the run config, then ``config.json`` from ``target.path`` (weights are not needed: the
folders under configs/targets/ hold only a config.json). It prints the target's architecture,
(virtual) depth, aux taps, parameter count and every parameter leaf's full-size shape, built as
``jax.ShapeDtypeStruct`` from the architecture's weight map, so nothing is allocated.

The memory estimate adds, per device holding a full replica (no sharding):
  target params (target.dtype) + draft params, gradients and AdamW moments (fp32)
  + the temporaries of one train step for ``--batch`` sequences of ``--seq`` tokens, taken from
    XLA's buffer assignment of the real jitted step compiled from abstract inputs (``--no-compile``
    skips this part). On the CPU the step is compiled with an fp32 target: XLA:CPU has no bf16
    matmul and hoists an fp32 copy of every bf16 weight stack out of the layer loop, which would
    count the weights twice; fp32 activations make the CPU figure an upper bound for bf16. On a GPU
    or TPU the step compiles in target.dtype. XLA backends fuse differently: it is an estimate.

The abstract and random params come from ``specjax.targets.abstract``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import mesh as meshlib
from specjax.config import load_config
from specjax.drafts.families import family_of
from specjax.targets.loading import read_hf_config
from specjax.train.aot import compile_for_analysis, lower_train_step
from specjax.train.setup import abstract_target, make_draft_config, resolve_aux_ids

GIB = 1024**3


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _nbytes(tree) -> int:
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _count(tree) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def resolve_target_dir(path: str, config_file: str | None = None) -> str:
    """``target.path`` as given (relative to the working directory), else relative to the YAML file."""
    candidates = [path]
    if config_file and not os.path.isabs(path):
        candidates.append(os.path.join(os.path.dirname(os.path.abspath(config_file)), path))
    for c in candidates:
        if os.path.isfile(os.path.join(c, "config.json")):
            return c
    raise FileNotFoundError(
        f"target.path {path!r}: no config.json in {' or '.join(repr(c) for c in candidates)}. Point target.path "
        f"at an HF folder (only config.json is needed here), e.g. configs/targets/qwen3_30b_a3b."
    )


def compiled_step_memory(run_cfg, hf: Mapping[str, Any], dtype: str, batch: int, seq: int) -> dict:
    """XLA buffer assignment of the real train step on a 1-device mesh, from abstract inputs: the
    step --compile-only lowers (specjax.train.aot), with the target's params in ``dtype``."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(meshlib.MESH_AXES)), meshlib.MESH_AXES)
    step = lower_train_step(run_cfg, mesh, hf=hf, dtype=dtype, batch_size=batch, seq_length=seq)
    stats = compile_for_analysis(step).memory_analysis()
    return {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "alias_bytes": int(getattr(stats, "alias_size_in_bytes", 0)),
    }


def shape_report(config_path: str, overrides: Sequence[str] = (), batch: int = 1, seq: int | None = None,
                 compile_step: bool = True) -> dict:
    """Everything the CLI prints, as a dict (see module docstring). The target (with the configured
    kernel choices), aux ids, draft config (check_draft_compat, fc_norm / norm_output) and TTT
    config are built by the training run's own functions (specjax.train.setup)."""
    run_cfg = load_config(config_path, list(overrides))
    folder = resolve_target_dir(run_cfg.target.path, config_path)
    hf = read_hf_config(folder)
    target = abstract_target(run_cfg, hf)
    cls, cfg, params = type(target), target.config, target.params
    aux = resolve_aux_ids(run_cfg, target)
    draft_cfg = make_draft_config(run_cfg, target, aux)
    draft_params = jax.eval_shape(lambda: family_of(draft_cfg).init_params(draft_cfg, jax.random.key(0)))
    seq = int(seq or run_cfg.data.seq_length)

    n_draft = _count(draft_params)
    report: dict[str, Any] = {
        "config": os.path.abspath(config_path),
        "target_dir": os.path.abspath(folder),
        "architecture": target.arch,
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "num_layers": int(target.num_layers),  # virtual depth for looped targets
        "aux_layer_ids": list(aux),
        "target_dtype": run_cfg.target.dtype,
        # model parameters (MXFP4 blocks hold two a byte; quantization scales are none), not stored elements
        "target_params": sum(s.num_params for s in cls.weight_specs(cfg)),
        "target_param_bytes": _nbytes(params),
        "leaves": {"/".join(s.path): list(s.shape) for s in cls.weight_specs(cfg)},
        "draft_params": n_draft,
        "draft_config": dataclasses.asdict(draft_cfg),  # what training would build (specjax.train.setup)
        # fp32 params + grads + AdamW mu and nu
        "draft_train_state_bytes": 4 * n_draft * 4,
        "batch": int(batch),
        "seq": seq,
    }
    if target.active_params_per_token() is not None:
        report["target_active_params_per_token"] = target.active_params_per_token()
    if compile_step:
        # see the module docstring: XLA:CPU would count bf16 weights twice, so compile fp32 there
        step_dtype = "float32" if jax.default_backend() == "cpu" else run_cfg.target.dtype
        mem = compiled_step_memory(run_cfg, hf, step_dtype, batch, seq)
        mem["compiled_dtype"] = step_dtype
        mem["backend"] = jax.default_backend()
        report["compiled_step"] = mem
        report["estimate_bytes"] = report["target_param_bytes"] + report["draft_train_state_bytes"] + mem["temp_bytes"]
    else:
        report["estimate_bytes"] = report["target_param_bytes"] + report["draft_train_state_bytes"]
    return report


def format_report(r: Mapping[str, Any], show_leaves: bool = False) -> str:
    lines = [
        f"config        {r['config']}",
        f"target        {r['architecture']} from {r['target_dir']}",
        f"depth         {r['num_hidden_layers']} layers" + (
            f", {r['num_layers']} virtual" if r["num_layers"] != r["num_hidden_layers"] else ""),
        f"aux taps      {r['aux_layer_ids']} (output of layer k)",
        f"target params {r['target_params'] / 1e9:.3f} B ({r['target_dtype']}, as stored: "
        f"{r['target_param_bytes'] / GIB:.2f} GiB)"
        + (f", {r['target_active_params_per_token'] / 1e9:.3f} B active per token"
           if "target_active_params_per_token" in r else ""),
        f"draft params  {r['draft_params'] / 1e6:.1f} M (params + grads + AdamW, fp32: "
        f"{r['draft_train_state_bytes'] / GIB:.2f} GiB)",
    ]
    if "compiled_step" in r:
        c = r["compiled_step"]
        lines.append(f"step temps    {c['temp_bytes'] / GIB:.2f} GiB for {r['batch']} x {r['seq']} tokens (XLA:"
                     f"{c['backend'].upper()} buffer assignment of the jitted train step, {c['compiled_dtype']} target)")
    lines.append(f"estimate      {r['estimate_bytes'] / GIB:.2f} GiB on one device holding everything unsharded")
    if show_leaves:
        lines.append("leaves:")
        lines += [f"  {name:60s} {tuple(shape)}" for name, shape in r["leaves"].items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specjax.shapes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="run config YAML (its target.path must hold a config.json)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per device for the step estimate (default 1)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default data.seq_length)")
    ap.add_argument("--no-compile", action="store_true", help="skip compiling the train step (params only)")
    ap.add_argument("--show-leaves", action="store_true", help="print every parameter leaf's shape")
    ap.add_argument("--json", default=None, help="also write the report as JSON here")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.seq_length=4096")
    args = ap.parse_args(argv)
    try:
        r = shape_report(args.config, args.overrides, batch=args.batch, seq=args.seq, compile_step=not args.no_compile)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(r, show_leaves=args.show_leaves))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

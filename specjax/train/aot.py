"""Ahead-of-time compile of the train step for the configured mesh, without weights or data.

`python -m specjax.launch --config X --compile-only` lowers and compiles the exact jitted step the
loop would run (same shardings, same shapes) from abstract arrays, then reports XLA's per-device
memory analysis and FLOP count. Only the target's config.json is read, so a 70B setup can be checked
on a laptop-sized fake mesh before any weights are downloaded.
"""
from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp

from specjax import mesh as meshlib
from specjax.config import Config
from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig
from specjax.train.optim import make_optimizer
from specjax.train.step import BATCH_KEYS, build_step_fns, init_state


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compile_step(cfg: Config) -> dict:
    from specjax.targets.loading import read_hf_config
    from specjax.targets.registry import get_target_class
    from specjax.train.loop import kernel_overrides, make_draft_config, resolve_aux_ids

    hf = read_hf_config(cfg.target.path)
    cls = get_target_class(hf)
    tconfig = cls.config_from_hf(hf, **kernel_overrides(cfg, cls))
    dtype = jnp.float32 if cfg.target.dtype == "float32" else jnp.bfloat16
    # abstract target: shapes and dtypes only, nothing allocated
    tparams = jax.eval_shape(lambda: cls.init(tconfig, jax.random.key(0), dtype).params)
    target = cls(tconfig, hf, tparams)
    aux_ids = resolve_aux_ids(cfg, target)
    dcfg = make_draft_config(cfg, target, aux_ids)
    dparams = jax.eval_shape(lambda: eagle3.init_draft_params(dcfg, jax.random.key(0)))
    mesh = meshlib.make_mesh({a: getattr(cfg.parallelism, a) for a in meshlib.MESH_AXES})
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    ttt = TTTConfig(ttt_steps=cfg.draft.ttt_steps, step_decay=cfg.draft.step_decay,
                    attention_impl=cfg.kernels.ttt_attention, soft_ce_impl=cfg.kernels.soft_ce)
    fns = build_step_fns(target, tparams, dparams, dcfg, ttt, optimizer, mesh, dtype)
    state = jax.eval_shape(lambda p: init_state(p, optimizer, 0), dparams)
    B, T = cfg.data.batch_size, cfg.data.seq_length
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=fns.batch_sharding) for k in BATCH_KEYS}
    Vd, V = dcfg.draft_vocab_size, dcfg.vocab_size
    vocab = {"draft_ids": jax.ShapeDtypeStruct((Vd,), jnp.int32), "t2d": jax.ShapeDtypeStruct((V,), jnp.bool_),
             "d2t": jax.ShapeDtypeStruct((Vd,), jnp.int32)}
    lowered = fns.train_step.lower(_abstract(state, fns.state_shardings), _abstract(tparams, fns.target_shardings),
                                   _abstract(vocab, fns.vocab_shardings), batch)
    compiled = lowered.compile()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    n = lambda tree: int(sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
    report = {
        "mesh": dict(mesh.shape),
        "devices": mesh.size,
        "batch": [B, T],
        "target_params": n(tparams),
        "draft_params": n(dparams),
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
             f"target params {report['target_params']:,}, draft params {report['draft_params']:,}"]
    if report.get("flops_per_step"):
        lines.append(f"XLA flops per step (per device program): {report['flops_per_step']:.3e}")
    if "temp_size_in_bytes" in report:
        lines.append("per device: arguments {}, outputs {}, temporaries {}, aliased (donated) {}, peak estimate {}".format(
            gib(report["argument_size_in_bytes"]), gib(report["output_size_in_bytes"]),
            gib(report["temp_size_in_bytes"]), gib(report["alias_size_in_bytes"]),
            gib(report["peak_estimate_bytes_per_device"])))
    return "\n".join(lines) + "\n" + json.dumps(report)

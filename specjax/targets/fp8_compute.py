"""``target.compute_dtype: fp8``: the frozen target's dense projections as FP8 GEMMs.

What changes (everything else of the target is as with ``bfloat16``):
  * weights: each per-layer dense projection kernel (attention q/k/v/o and the gated MLP's
    gate/up/down; not the embedding, the lm_head, norms or routers) is kept in device memory as
    float8_e4m3fn [L, in, out] with a float32 scale per output channel ``kernel_fp8_scale`` [L, out]
    (the channel's amax / 448): about half the bytes of the bf16 kernels;
  * compute: ``layers/linear.dense`` quantizes each token's activations with its own dynamic scale and
    runs the GEMM on the two float8 operands with float32 accumulation (the pattern XLA rewrites into a
    cuBLASLt FP8 GEMM on Hopper; see that module). Attention scores, softmax and norms stay in the
    params dtype.

Where the weights come from: the family's weight map (``weight_specs``) under an fp8 config names
the FP8 kernel and its scale leaf (:func:`device_weight_specs`), so shardings, abstract params and
``--compile-only`` see the FP8 tree. The loader reads the checkpoint as stored (the config with
``compute_dtype`` reset, :func:`checkpoint_config`), then :func:`fp8_compute_params` quantizes each
projection on the device, one layer at a time (``lax.map``). An FP8 checkpoint (block scales,
``targets/quantized.py``) keeps FP8 bytes: its [in / 128, out / 128] block scales do not factor
into one scale per output channel, so each layer is dequantized with its own scales (float32) and
requantized per output channel once at load (one more e4m3 rounding of each weight; nothing is
dequantized per step).

Families: those whose Target class sets ``fp8_compute = True`` route every projection of their
blocks through ``dense`` (Llama, Qwen3, Mistral); any other family with ``fp8`` is refused at config
time naming them (``base.Target.config_from_hf``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from specjax.targets.base import WeightSpec, tree_get, tree_set
from specjax.targets.layers.linear import FP8_SCALE, quantize_columns
from specjax.targets.quantized import FP8_DTYPE, QUANTIZED_LEAVES, quantize_weight_specs


def is_fp8(config: Any) -> bool:
    return getattr(config, "compute_dtype", "bfloat16") == "fp8"


def projection(spec: WeightSpec) -> bool:
    """A per-layer dense projection kernel [L, in, out] read from an [out, in] ``nn.Linear`` weight
    (routers excluded: they stay in the params dtype)."""
    return (spec.stacked and spec.transpose and spec.path[-1] == "kernel" and len(spec.shape) == 3
            and spec.dtype is None and spec.hf_chunk is None and "router" not in spec.path)


def scale_spec(spec: WeightSpec) -> WeightSpec:
    """The [L, out] float32 ``kernel_fp8_scale`` leaf of an FP8-compute kernel (not in the checkpoint)."""
    return WeightSpec(spec.hf_name + "_fp8_scale", spec.path[:-1] + (FP8_SCALE,), False,
                      spec.shape[:-2] + spec.shape[-1:], spec.axes[:-2] + spec.axes[-1:], layer_ids=spec.layer_ids,
                      dtype="float32", values_per_element=0)


def device_weight_specs(specs: Sequence[WeightSpec], config: Any) -> list[WeightSpec]:
    """A family's weight map (unquantized rows) as the leaves kept on the device: with fp8 compute, each
    projection's FP8 kernel and its scale; else the checkpoint's stored format
    (``quantized.quantize_weight_specs`` of the config's ``weight_quant``)."""
    if not is_fp8(config):
        return quantize_weight_specs(specs, getattr(config, "weight_quant", None))
    out = []
    for spec in specs:
        out.extend([dataclasses.replace(spec, dtype=FP8_DTYPE), scale_spec(spec)] if projection(spec) else [spec])
    return out


def checkpoint_config(config: Any) -> Any:
    """The config whose weight map is the checkpoint's own layout (what the loader reads)."""
    return dataclasses.replace(config, compute_dtype="bfloat16") if is_fp8(config) else config


def fp8_compute_params(params: dict, device_specs: Sequence[WeightSpec], quant: Any = None,
                       shardings: Any = None) -> dict:
    """The checkpoint-layout params with each projection node replaced by its FP8 kernel and
    per-output-channel scale (module docstring): ``device_specs`` the family's weight map under the fp8
    config (its ``kernel_fp8_scale`` rows name the nodes), ``quant`` the checkpoint's ``weight_quant``
    (its stored kernels are dequantized with their own scales first). Nodes the tree lacks (a run that
    read only the embedding and lm_head) are skipped. ``shardings``: the FP8 tree's, or None."""
    out = jax.tree.map(lambda a: a, params)  # new containers, same leaves
    for spec in device_specs:
        if spec.path[-1] != FP8_SCALE:
            continue
        where = spec.path[:-1]
        try:
            node = tree_get(out, where)
        except KeyError:
            continue

        def one_layer(n):
            w = quant.dequantize(n, jnp.float32) if any(k in n for k in QUANTIZED_LEAVES) else n["kernel"]
            return quantize_columns(w)

        out_sh = None
        if shardings is not None:
            out_sh = (tree_get(shardings, where + ("kernel",)), tree_get(shardings, spec.path))
        kernel, scale = jax.jit(lambda n: jax.lax.map(one_layer, n), out_shardings=out_sh)(dict(node))
        new = {k: v for k, v in node.items() if k not in QUANTIZED_LEAVES and k != "kernel"}
        new.update(kernel=kernel, **{FP8_SCALE: scale})
        tree_set(out, where, new)
    return out


def param_bytes(params: Any) -> int:
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))

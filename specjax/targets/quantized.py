"""Targets whose checkpoints are published quantized: the weights stay in their stored format in
device memory and each layer's are dequantized inside the layer scan, where the layer runs.

FP8 with block scales (``quantization_config = {"quant_method": "fp8", "weight_block_size": [bo, bi]}``:
the FP8 releases of DeepSeek-V3, Kimi K2, GLM-4.5+, MiniMax-M2, Qwen3): every quantized linear layer
``X`` stores ``X.weight`` float8_e4m3fn [out, in] and ``X.weight_scale_inv`` float32
[ceil(out / bo), ceil(in / bi)]; the weight is ``float(weight) * weight_scale_inv[row // bo, col // bi]``
(specjax_kernels.quant.fp8_block_dequantize). Modules named in ``modules_to_not_convert`` (or
``ignored_layers``) are stored unquantized, as are embeddings, norms, routers and the lm_head.

How a family takes part:
  * its config carries ``weight_quant`` (:func:`weight_quant_from_hf` reads it from config.json);
  * its ``weight_specs`` ends with :func:`quantize_weight_specs`, which turns each per-layer linear
    kernel the checkpoint quantizes into a float8 leaf (same path, kernel layout [in, out]) plus a
    float32 scale leaf beside it, ``kernel_scale_inv`` [ceil(in / bi), ceil(out / bo)];
  * nothing else: :func:`specjax.targets.layers.scan.index_layer` hands every layer's weights to
    :func:`dequantize_layer_weights`, which replaces each (kernel, kernel_scale_inv) pair by the
    kernel in the compute dtype that :class:`specjax.targets.decoder.Decoder` sets for the call
    (:func:`layer_weights_dequantized`). One layer's weights exist dequantized at a time, so device
    memory holds the FP8 model plus one layer, never a bf16 copy of the target.

Only the decoder layers' linear weights stay quantized ("{i}" rows of the weight map); a quantized
tensor outside them (none in the published checkpoints) is dequantized while loading.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import math
from typing import Any, Iterator, Mapping, Sequence

import jax.numpy as jnp
from specjax_kernels.quant import fp8_block_dequantize

from specjax.targets.base import WeightSpec

FP8_DTYPE = "float8_e4m3fn"
SCALE_SUFFIX = "_scale_inv"  # kernel leaf "kernel" -> scale leaf "kernel_scale_inv"; "X.weight" -> "X.weight_scale_inv"


@dataclasses.dataclass(frozen=True)
class Fp8BlockQuant:
    """FP8 e4m3 weights with one float32 scale per (block[0] x block[1]) tile of the [out, in] weight."""

    block: tuple[int, int] = (128, 128)
    # module-name patterns stored unquantized (config.json's modules_to_not_convert / ignored_layers)
    not_converted: tuple[str, ...] = ()

    def converts(self, hf_weight_name: str) -> bool:
        """Whether the checkpoint stores this ``X.weight`` quantized: not when a not-converted pattern
        is a glob matching module X, or a run of whole dotted components of X's name ("lm_head",
        "mlp.gate", "model.layers.0.self_attn" and its children)."""
        module = hf_weight_name.rsplit(".", 1)[0]
        dotted = "." + module + "."
        return not any(fnmatch.fnmatchcase(module, pat) or ("." + pat + ".") in dotted for pat in self.not_converted)

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": list(self.block)}
        if self.not_converted:
            out["modules_to_not_convert"] = list(self.not_converted)
        return out


def weight_quant_from_hf(hf: Mapping[str, Any], arch: str) -> Fp8BlockQuant | None:
    """The checkpoint's weight format from config.json's ``quantization_config`` (None: unquantized);
    a ValueError naming the field and the fix for a format specjax does not read."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"{arch}: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{arch}: quantization_config.quant_method={method!r} is not read by specjax for this family. It loads "
            "unquantized checkpoints and FP8 with block scales (quant_method 'fp8', weight_block_size [128, 128]: "
            "the DeepSeek/Kimi/GLM/MiniMax/Qwen FP8 releases). Fix: use the bf16 release of the model, or "
            "dequantize the checkpoint first")
    fmt = q.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):  # MiniMax's configs spell it with the dtype name
        raise ValueError(f"{arch}: quantization_config.fmt={fmt!r}: only 'e4m3' FP8 weights are read")
    block = q.get("weight_block_size")
    if block is None:
        raise ValueError(f"{arch}: quantization_config has quant_method 'fp8' but no weight_block_size: per-tensor "
                         "FP8 checkpoints are not read. Fix: use a block-scaled FP8 release (weight_block_size "
                         "[128, 128]) or the bf16 one")
    if (not isinstance(block, Sequence) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 65536 for b in block)):
        raise ValueError(f"{arch}: quantization_config.weight_block_size={block!r} must be two positive integers")
    skip = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise ValueError(f"{arch}: quantization_config.modules_to_not_convert must be a list of module names")
    return Fp8BlockQuant(block=(int(block[0]), int(block[1])), not_converted=tuple(skip))


def _quantizable(spec: WeightSpec) -> bool:
    """A per-layer linear weight stored [out, in] and read whole (chunked or de-interleaved rows are
    not block-aligned in general); MoE routers stay as stored (no release quantizes them)."""
    return (spec.stacked and spec.transpose and spec.hf_name.endswith(".weight") and len(spec.hf_shape) == 2
            and spec.path[-1] == "kernel" and spec.hf_chunk is None and spec.deinterleave_axis is None
            and spec.dtype is None and "router" not in spec.path)


def scale_spec(spec: WeightSpec, quant: Fp8BlockQuant) -> WeightSpec:
    """The float32 scale leaf beside a quantized kernel: [lead..., ceil(in / bi), ceil(out / bo)]."""
    lead = spec.shape[:-2]
    d_in, d_out = spec.shape[-2:]
    bo, bi = quant.block
    return WeightSpec(spec.hf_name + SCALE_SUFFIX, spec.path[:-1] + (spec.path[-1] + SCALE_SUFFIX,), True,
                      lead + (math.ceil(d_in / bi), math.ceil(d_out / bo)), spec.axes[:-2] + (None, None),
                      layer_ids=spec.layer_ids, dtype="float32", values_per_element=0)


def quantize_weight_specs(specs: Sequence[WeightSpec], quant: Fp8BlockQuant | None) -> list[WeightSpec]:
    """A family's weight map for a checkpoint in ``quant`` (unchanged for None): each per-layer linear
    kernel the checkpoint quantizes becomes a float8 leaf, followed by its scale leaf."""
    if quant is None:
        return list(specs)
    out = []
    for spec in specs:
        if _quantizable(spec) and quant.converts(spec.hf_name):
            out.append(dataclasses.replace(spec, dtype=FP8_DTYPE))
            out.append(scale_spec(spec, quant))
        else:
            out.append(spec)
    return out


# ---------------------------------------------------------------------------------------------
# per-layer dequantization inside the layer scan
# ---------------------------------------------------------------------------------------------
_DEQUANT = contextvars.ContextVar("specjax_layer_dequantization", default=None)


@contextlib.contextmanager
def layer_weights_dequantized(dtype: Any, quant: Fp8BlockQuant | None) -> Iterator[None]:
    """Within this context (the decoder's layer stack, while it is traced), quantized layer weights
    read through ``index_layer`` come out as ``dtype`` kernels."""
    token = _DEQUANT.set(None if quant is None else (jnp.dtype(dtype), quant))
    try:
        yield
    finally:
        _DEQUANT.reset(token)


def dequantize_layer_weights(tree: Any) -> Any:
    """One layer's weights with each (``kernel`` float8, ``kernel_scale_inv``) pair replaced by the
    dequantized kernel (compute dtype of :func:`layer_weights_dequantized`); other trees unchanged."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, value in tree.items():
        if key.endswith(SCALE_SUFFIX) and key[:-len(SCALE_SUFFIX)] in tree:
            continue
        scale = tree.get(key + SCALE_SUFFIX)
        if scale is not None and not isinstance(value, dict):
            setting = _DEQUANT.get()
            if setting is None:
                raise RuntimeError(
                    f"quantized weight {key!r} read outside a decoder's layer stack (or its config has no "
                    "weight_quant): run the target through its Decoder, which sets the compute dtype")
            dtype, quant = setting
            # kernel [.., in, out] with scales [.., in / bi, out / bo]: the [out, in] rule transposed
            value = fp8_block_dequantize(value, scale, (quant.block[1], quant.block[0]), dtype)
        else:
            value = dequantize_layer_weights(value)
        out[key] = value
    return out

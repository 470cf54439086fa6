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
import re
from typing import Any, Iterator, Mapping, Sequence

import jax.numpy as jnp
from specjax_kernels.quant import fp8_block_dequantize, int_pack_dequantize

from specjax.targets.base import WeightSpec

FP8_DTYPE = "float8_e4m3fn"


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
        return not any(fnmatch.fnmatchcase(module, pat) or ("." + pat + ".") in dotted or _name_matches(module, pat)
                       for pat in self.not_converted)

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": list(self.block)}
        if self.not_converted:
            out["modules_to_not_convert"] = list(self.not_converted)
        return out

    def stored_specs(self, spec: WeightSpec) -> list[WeightSpec]:
        """The float8 kernel (same path and layout) and its float32 ``kernel_scale_inv``
        [lead..., ceil(in / bi), ceil(out / bo)] (the file's [out / bo, in / bi] grid, transposed)."""
        d_in, d_out = spec.shape[-2:]
        bo, bi = self.block
        return [dataclasses.replace(spec, dtype=FP8_DTYPE),
                _beside(spec, "_scale_inv", True, (math.ceil(d_in / bi), math.ceil(d_out / bo)))]

    def dequantize(self, node: Mapping[str, Any], dtype) -> Any:
        # kernel [.., in, out] with scales [.., in / bi, out / bo]: the [out, in] rule transposed
        return fp8_block_dequantize(node["kernel"], node["kernel_scale_inv"], (self.block[1], self.block[0]), dtype)


def _beside(spec: WeightSpec, suffix: str, transpose: bool, trailing: tuple[int, ...], dtype: str = "float32",
            values_per_element: int = 0, rows_first: bool = False) -> WeightSpec:
    """A stored tensor next to a quantized kernel: ``X.weight<suffix>`` on disk, leaf ``kernel<suffix>``
    beside the kernel, the kernel's stacking axes and then ``trailing`` (a scale: not a parameter).
    ``rows_first``: ``trailing`` is the file's [out, in-derived] grid, sharded as the kernel's output
    and input axes are (packed codes and per-group scales are as large as the weight's shards need to
    be: left whole, a 1 T model's int4 experts would sit on every FSDP shard); else unsharded."""
    lead = spec.shape[:-2]
    axes = (spec.axes[-1], spec.axes[-2]) if rows_first else (None,) * len(trailing)
    return WeightSpec(spec.hf_name + suffix, spec.path[:-1] + (spec.path[-1] + suffix,), transpose, lead + trailing,
                      spec.axes[:-2] + axes, layer_ids=spec.layer_ids, dtype=dtype,
                      values_per_element=values_per_element)


def _name_matches(module: str, pattern: str) -> bool:
    """compressed-tensors' module patterns: "re:<regex>" (matched from the start of the module name),
    else a module name or a run of its trailing dotted components. ``module`` is a weight-map row's
    name, whose "{i}" / "{e}" stand for every layer / expert: a pattern naming one layer's module
    matches the row (a stacked leaf has one storage for all its layers; a checkpoint that quantizes
    some layers of a row and not others is refused by the loader, tensor by tensor)."""
    instance = module.replace("{i}", "0").replace("{e}", "0")
    if pattern.startswith("re:"):
        return re.match(pattern[3:], instance) is not None
    template = re.escape(module).replace(re.escape("{i}"), r"\d+").replace(re.escape("{e}"), r"\d+")
    return re.fullmatch(f"(.*\\.)?{template}", pattern) is not None or instance.endswith("." + pattern) \
        or instance == pattern


@dataclasses.dataclass(frozen=True)
class CompressedTensorsQuant:
    """compressed-tensors checkpoints (llm-compressor's output; ``quant_method: compressed-tensors``):
    one quantization scheme (config group) applied to the linear layers its ``targets`` name, minus
    ``ignore``.

    * ``float-quantized``: FP8 e4m3 ``X.weight`` [out, in] with ``X.weight_scale`` per tensor [1], per
      output channel [out, 1], per block [ceil(out / bo), ceil(in / bi)] or per group [out, in / g];
    * ``pack-quantized``: symmetric int ``X.weight_packed`` int32 (specjax_kernels.quant.int_pack_dequantize)
      with ``X.weight_scale`` per group [out, in / g] or channel [out, 1] (Kimi K2.5's int4 experts).
    Static activation scales and ``X.weight_shape`` are not read (the weight map has the shape)."""

    format: str  # "float-quantized" | "pack-quantized"
    num_bits: int
    strategy: str  # "tensor" | "channel" | "block" | "group"
    block: tuple[int, int] | None = None  # (out, in) for strategy "block"
    group_size: int | None = None  # for strategy "group"
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()

    def converts(self, hf_weight_name: str) -> bool:
        module = hf_weight_name.rsplit(".", 1)[0]
        targeted = any(t == "Linear" or _name_matches(module, t) for t in self.targets)
        return targeted and not any(_name_matches(module, p) for p in self.ignore)

    def to_hf(self) -> dict[str, Any]:
        weights: dict[str, Any] = {"num_bits": self.num_bits, "type": "float" if self.format == "float-quantized"
                                   else "int", "strategy": self.strategy, "symmetric": True, "dynamic": False}
        if self.block is not None:
            weights["block_structure"] = list(self.block)
        if self.group_size is not None:
            weights["group_size"] = self.group_size
        return {"quant_method": "compressed-tensors", "format": self.format, "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": list(self.targets), "weights": weights}},
                "ignore": list(self.ignore)}

    def _scale_grid(self, d_in: int, d_out: int) -> tuple[int, int]:
        """The file's weight_scale shape for an [out, in] weight."""
        if self.strategy == "tensor":
            return (1,)
        if self.strategy == "channel":
            return (d_out, 1)
        if self.strategy == "block":
            return (math.ceil(d_out / self.block[0]), math.ceil(d_in / self.block[1]))
        return (d_out, math.ceil(d_in / self.group_size))

    def stored_specs(self, spec: WeightSpec) -> list[WeightSpec]:
        """float: the float8 kernel and ``kernel_scale`` (the file's grid transposed to [in.., out..]; a
        per-tensor scale [1] as stored). packed: ``kernel_packed`` and ``kernel_scale`` as stored
        ([out, ...] rows, dequantized then transposed)."""
        d_in, d_out = spec.shape[-2:]
        grid = self._scale_grid(d_in, d_out)
        if self.format == "float-quantized":
            scale = _beside(spec, "_scale", len(grid) == 2, tuple(reversed(grid)))
            return [dataclasses.replace(spec, dtype=FP8_DTYPE), scale]
        per_word = 32 // self.num_bits
        if d_in % per_word or (self.strategy == "group" and d_in % self.group_size):
            raise ValueError(f"{spec.hf_name}: {d_in} inputs do not fill whole int32 words of {per_word} codes"
                             + (f" and groups of {self.group_size}" if self.strategy == "group" else "")
                             + ": this packed layout is not read. Fix: use the bf16 release")
        packed = _beside(spec, "_packed", False, (d_out, d_in // per_word), "int32", per_word, rows_first=True)
        return [packed, _beside(spec, "_scale", False, grid, rows_first=True)]

    def dequantize(self, node: Mapping[str, Any], dtype) -> Any:
        scale = node["kernel_scale"]
        if self.format == "pack-quantized":
            d_in = node["kernel_packed"].shape[-1] * (32 // self.num_bits)  # whole words (stored_specs)
            group = self.group_size if self.strategy == "group" else d_in
            w = int_pack_dequantize(node["kernel_packed"], scale, self.num_bits, d_in, group, jnp.float32)
            return jnp.swapaxes(w, -1, -2).astype(dtype)
        w = node["kernel"].astype(jnp.float32)
        if self.strategy == "tensor":
            return (w * scale[..., None].astype(jnp.float32)).astype(dtype)
        if self.strategy == "block":
            return fp8_block_dequantize(node["kernel"], scale, (self.block[1], self.block[0]), dtype)
        rows = w.shape[-2] if self.strategy == "channel" else self.group_size  # scale rows: 1 or in / g
        s = jnp.repeat(scale.astype(jnp.float32), rows, axis=-2)[..., :w.shape[-2], :]
        return (w * s).astype(dtype)


def weight_quant_from_hf(hf: Mapping[str, Any], arch: str) -> "Fp8BlockQuant | CompressedTensorsQuant | None":
    """The checkpoint's weight format from config.json's ``quantization_config`` (None: unquantized);
    a ValueError naming the field and the fix for a format specjax does not read."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"{arch}: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return compressed_tensors_from_hf(q, arch)
    if method != "fp8":
        raise ValueError(
            f"{arch}: quantization_config.quant_method={method!r} is not read by specjax for this family. It loads "
            "unquantized checkpoints, FP8 with block scales (quant_method 'fp8', weight_block_size [128, 128]: "
            "the DeepSeek/Kimi/MiniMax/Qwen FP8 releases) and compressed-tensors FP8 or packed int weights. Fix: "
            "use the bf16 release of the model, or dequantize the checkpoint first")
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


def compressed_tensors_from_hf(q: Mapping[str, Any], arch: str) -> CompressedTensorsQuant:
    """A compressed-tensors quantization_config: one config group, FP8 (float-quantized) or symmetric
    packed ints (pack-quantized) weights; anything else refused naming the field."""
    where = f"{arch}: quantization_config"
    fmt = q.get("format")
    if fmt not in ("float-quantized", "pack-quantized"):
        raise ValueError(f"{where}.format={fmt!r}: specjax reads compressed-tensors 'float-quantized' (FP8) and "
                         "'pack-quantized' (int4/int8) weights. Fix: use the bf16 release, or dequantize first")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise ValueError(f"{where}.config_groups: {len(groups) if isinstance(groups, Mapping) else groups!r} "
                         "schemes; specjax reads checkpoints with exactly one. Fix: dequantize the checkpoint first")
    (name, group), = groups.items()
    w = group.get("weights") or {}
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if fmt == "float-quantized" and (kind != "float" or bits != 8):
        raise ValueError(f"{where}.config_groups.{name}.weights: type={kind!r} num_bits={bits!r} under format "
                         "'float-quantized'; only FP8 (type 'float', num_bits 8) is read")
    if fmt == "pack-quantized" and (kind != "int" or bits not in (2, 4, 8)):
        raise ValueError(f"{where}.config_groups.{name}.weights: type={kind!r} num_bits={bits!r} under format "
                         "'pack-quantized'; only int weights of 2, 4 or 8 bits are read")
    if not w.get("symmetric", True) or w.get("zero_point") is not None:
        raise ValueError(f"{where}.config_groups.{name}.weights.symmetric=false: zero points are not read. Fix: "
                         "dequantize the checkpoint first")
    if w.get("dynamic"):
        raise ValueError(f"{where}.config_groups.{name}.weights.dynamic=true: the weights have no stored scales")
    allowed = ("tensor", "channel", "block", "group") if fmt == "float-quantized" else ("channel", "group")
    if strategy not in allowed:
        raise ValueError(f"{where}.config_groups.{name}.weights.strategy={strategy!r}: {fmt} weights are read "
                         f"with strategy {', '.join(allowed)}")
    block = tuple(int(b) for b in w.get("block_structure") or ()) or None
    if strategy == "block" and (block is None or len(block) != 2 or min(block) < 1):
        raise ValueError(f"{where}.config_groups.{name}.weights.block_structure={w.get('block_structure')!r} must "
                         "be [rows, cols] for strategy 'block'")
    group_size = w.get("group_size")
    if strategy == "group" and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"{where}.config_groups.{name}.weights.group_size={group_size!r} must be a positive "
                         "integer for strategy 'group'")
    targets, ignore = group.get("targets") or ["Linear"], q.get("ignore") or []
    if not all(isinstance(t, str) for t in [*targets, *ignore]):
        raise ValueError(f"{where}: targets and ignore must be lists of module names or 're:' patterns")
    return CompressedTensorsQuant(fmt, int(bits), strategy, block if strategy == "block" else None,
                                  group_size if strategy == "group" else None, tuple(targets), tuple(ignore))


def _quantizable(spec: WeightSpec) -> bool:
    """A per-layer linear weight stored [out, in] and read whole (chunked or de-interleaved rows are
    not block-aligned in general); MoE routers stay as stored (no release quantizes them)."""
    return (spec.stacked and spec.transpose and spec.hf_name.endswith(".weight") and len(spec.hf_shape) == 2
            and spec.path[-1] == "kernel" and spec.hf_chunk is None and spec.deinterleave_axis is None
            and spec.dtype is None and "router" not in spec.path)


def quantize_weight_specs(specs: Sequence[WeightSpec], quant) -> list[WeightSpec]:
    """A family's weight map for a checkpoint in ``quant`` (unchanged for None): each per-layer linear
    kernel the checkpoint quantizes becomes the leaves it is stored as (``quant.stored_specs``)."""
    if quant is None:
        return list(specs)
    out = []
    for spec in specs:
        out.extend(quant.stored_specs(spec) if _quantizable(spec) and quant.converts(spec.hf_name) else [spec])
    return out


# ---------------------------------------------------------------------------------------------
# per-layer dequantization inside the layer scan
# ---------------------------------------------------------------------------------------------
_DEQUANT = contextvars.ContextVar("specjax_layer_dequantization", default=None)


@contextlib.contextmanager
def layer_weights_dequantized(dtype: Any, quant) -> Iterator[None]:
    """Within this context (the decoder's layer stack, while it is traced), quantized layer weights
    read through ``index_layer`` come out as ``dtype`` kernels."""
    token = _DEQUANT.set(None if quant is None else (jnp.dtype(dtype), quant))
    try:
        yield
    finally:
        _DEQUANT.reset(token)


QUANTIZED_LEAVES = ("kernel_scale_inv", "kernel_scale", "kernel_packed")  # beside (or for) a stored kernel


def dequantize_layer_weights(tree: Any) -> Any:
    """One layer's weights with each quantized kernel's stored leaves (``kernel`` + ``kernel_scale_inv``,
    ``kernel`` + ``kernel_scale``, ``kernel_packed`` + ``kernel_scale``) replaced by the kernel in the
    compute dtype of :func:`layer_weights_dequantized`; other trees unchanged."""
    if not isinstance(tree, dict):
        return tree
    out = {k: dequantize_layer_weights(v) for k, v in tree.items() if k not in QUANTIZED_LEAVES}
    if any(k in tree for k in QUANTIZED_LEAVES):
        setting = _DEQUANT.get()
        if setting is None:
            raise RuntimeError(
                "quantized layer weights read outside a decoder's layer stack (or its config has no weight_quant): "
                "run the target through its Decoder, which sets the compute dtype")
        dtype, quant = setting
        out["kernel"] = quant.dequantize(tree, dtype)
    return out

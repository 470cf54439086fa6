"""Shared pieces of every frozen target: output type, aux-id rules, HF config reading, weight-map
rows, Target wrapper.

A concrete architecture (see ``llama.py``) subclasses :class:`Target`, registers it
(``registry.register``) and supplies ``config_class`` (whose ``from_hf`` starts with
:func:`resolve_hf_config`), ``weight_specs`` and its ``decoder`` (``decoder.Decoder``), from which
the pure ``forward`` / ``decode_chunk`` / ``init_cache`` / ``embed_table`` / ``lm_head_weight`` come
(``TargetClass.decoder.decode_chunk(params, config, ...)``; the instance methods bind them).
The wrapper holds ``config``/``hf_config``/``params`` and a jitted ``__call__`` (one trace per
config, static ``aux_layer_ids`` and input shapes, shared by all instances).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax.aux_ids import default_aux_layer_ids, validate_aux_layer_ids  # re-exported (jax-free home)
from specjax.hf_config_checks import check_config_fields
from specjax.targets import registry
from specjax.targets.kernel_choices import KernelChoices


class TargetOutput(NamedTuple):
    logits: jax.Array  # [B, T, V] fp32
    final_hidden: jax.Array  # [B, T, H] after the final norm, params dtype
    aux_hidden: tuple  # tuple of [B, T, H] residual-stream states (output of layer k)


def resolve_hf_config(
    hf: Mapping[str, Any] | Any,
    handles: Sequence[str],
    owner: str,
    *,
    unsupported_flags: Sequence[str] = (),
    silu_keys: Sequence[str] = (),
) -> tuple[dict, str]:
    """The start of every target config's ``from_hf``: (the HF config as a new plain dict, its
    architecture). ``hf`` is a config.json dict or a ``PretrainedConfig`` (``to_dict()``); the
    architecture is ``architectures[0]``, else the registry's model_type map. ValueError unless
    ``owner`` (the config class name) handles it, a flag in ``unsupported_flags`` is set, or an
    activation in ``silu_keys`` is other than SiLU (the default when absent). Every field is first
    checked by specjax.hf_config_checks (types and sanity bounds, before anything is sized from them:
    a config dict that did not come through ``loading.read_hf_config``, which names its file, is
    named "target config")."""
    if not isinstance(hf, Mapping) and hasattr(hf, "to_dict"):
        hf = hf.to_dict()
    hf = dict(hf)
    check_config_fields(hf, f"target config ({owner})")
    arch = registry.architecture_of(hf, strict=False)
    if arch not in handles:
        raise ValueError(f"{owner} handles {sorted(handles)}, got architecture {arch!r}")
    for flag in unsupported_flags:
        if hf.get(flag):
            raise ValueError(f"{arch} with {flag}=true is not supported by specjax targets")
    for key in silu_keys:
        act = hf.get(key, "silu")
        if act != "silu":
            raise ValueError(f"{key}={act!r} is not supported (only 'silu')")
    return hf, arch


# a quantized checkpoint's static activation scales (for FP8 GEMM kernels; the target computes in the
# load dtype, so they are not read) and compressed-tensors' packed-weight shapes (the weight map has them)
# target.compute_dtype: the dense projections in the params dtype, or FP8 GEMMs (targets/fp8_compute.py)
COMPUTE_DTYPES = ("bfloat16", "fp8")
ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".activation_scale", ".weight_shape")  # (and a packed weight's shape)


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    """One row of an architecture's HF weight map.

    ``hf_name`` contains ``{i}`` for per-layer tensors, which are stacked along a leading layer axis
    at ``path``. ``transpose`` converts HF's [out, in] Linear weight to the x@W kernel [in, out].
    ``shape`` is the specjax leaf shape (with the layer axis when stacked); ``axes`` its logical names.
    """

    hf_name: str
    path: tuple[str, ...]
    transpose: bool
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    # Optional extras for non-dense layouts (defaults keep the plain per-layer stacking above):
    # layer_ids: the layers a stacked row holds, in order (None = all num_hidden_layers). Used when
    #   only some layers carry the tensor, e.g. the MoE layers of an interleaved MoE/MLP stack.
    # "{e}" in hf_name: one tensor per expert on disk, stacked on a second axis [L, E, ...].
    # hf_chunk=(k, n): the leaf is chunk k of n equal chunks along axis 0 of the on-disk tensor
    #   (a fused projection such as [gate; q; k; v]); only that chunk is read.
    layer_ids: tuple[int, ...] | None = None
    hf_chunk: tuple[int, int] | None = None
    # dtype: keep this leaf in a fixed dtype whatever the load dtype (e.g. fp32 MoE routers, whose
    #   bf16 rounding changes which experts are picked)
    dtype: str | None = None
    # deinterleave_axis: this axis of the (transposed) file tensor alternates two projections
    #   (gpt-oss's gate_up_proj: gate at even indices, up at odd); the leaf holds the even entries
    #   first, then the odd ones (the [gate | up] layout specjax_kernels.moe fuses)
    deinterleave_axis: int | None = None
    # values_per_element: model parameters one stored element holds (2 for MXFP4's packed nibbles,
    #   0 for a quantization scale, which is not a parameter); parameter counts use it
    values_per_element: int = 1
    # hf_axes: the file tensor's axes in the leaf's order (np.transpose), in place of `transpose`'s reversal
    #   of every axis: a stack of [out, in] matrices [E, out, in] read as [E, in, out] is (0, 2, 1)
    hf_axes: tuple[int, ...] | None = None
    # hf_chunk_axis: the file axis hf_chunk splits
    hf_chunk_axis: int = 0

    @property
    def num_params(self) -> int:
        return math.prod(self.shape) * self.values_per_element

    @property
    def stacked(self) -> bool:
        return "{i}" in self.hf_name

    @property
    def expert_stacked(self) -> bool:
        return "{e}" in self.hf_name

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """Shape of one tensor on disk (one layer's / expert's slice when stacked; one chunk when chunked)."""
        lead = int(self.stacked) + int(self.expert_stacked)
        shape = self.shape[lead:]
        if self.hf_axes is not None:
            file_shape = [0] * len(shape)
            for leaf_axis, file_axis in enumerate(self.hf_axes):
                file_shape[file_axis] = shape[leaf_axis]
            return tuple(file_shape)
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    @property
    def hf_file_shape(self) -> tuple[int, ...]:
        """Shape of the whole tensor in the file (the fused tensor when chunked)."""
        shape = list(self.hf_shape)
        if self.hf_chunk is not None:
            shape[self.hf_chunk_axis] *= self.hf_chunk[1]
        return tuple(shape)

    def hf_tensors(self, num_layers: int) -> list[tuple[tuple[int, ...], str]]:
        """(index into the stacked leaf, on-disk tensor name) for every tensor this row reads."""
        if not self.stacked:
            return [((), self.hf_name)]
        layers = range(num_layers) if self.layer_ids is None else self.layer_ids
        if not self.expert_stacked:
            return [((j,), self.hf_name.format(i=i)) for j, i in enumerate(layers)]
        n_experts = self.shape[1]
        return [((j, e), self.hf_name.format(i=i, e=e)) for j, i in enumerate(layers) for e in range(n_experts)]


def layer_depth(config: Any) -> int:
    """Depth that aux ids and cache rows address: the decoder layers, or for looped (weight-shared)
    targets the unrolled virtual depth (their config's ``num_virtual_layers``)."""
    return getattr(config, "num_virtual_layers", config.num_hidden_layers)


def tree_get(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def tree_set(tree: dict, path: Sequence[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _target_call(params, input_ids, positions, segment_ids, *, target_cls, config, aux_layer_ids):
    final, aux = target_cls.decoder.forward(
        params, config, input_ids, aux_layer_ids=aux_layer_ids, positions=positions, segment_ids=segment_ids
    )
    w_vd = target_cls.decoder.lm_head_weight(params, config)
    logits = jnp.einsum("btd,vd->btv", final, w_vd, preferred_element_type=jnp.float32)
    return TargetOutput(logits, final, aux)


def commit_tree_path(cache, start, path, accepted):
    """Tree verification's KV move (batch row 0, the speculative decoder's only row): chunk row
    ``path[i]`` (written at slot start+path[i]; ``path[0]`` = 0 is the root) goes to the linear slot
    start+i for i = 1..accepted; other slots are stale. Every cache leaf has the slot on axis 2.
    ``path`` [depth+1] int, ``accepted`` scalar int. Returns the new cache."""
    num_slots = jax.tree.leaves(cache)[0].shape[2]
    depth = path.shape[0] - 1
    i = jnp.arange(1, depth + 1)
    dst = jnp.where(i <= accepted, start + i, num_slots)  # past-the-end = dropped
    src = start + path[1:]
    return jax.tree.map(lambda c: c.at[:, 0, dst].set(c[:, 0, src], mode="drop"), cache)


# Module-level so every Target with an equal (hashable) config shares one compilation per
# static aux_layer_ids / input shapes, instead of re-tracing per instance.
_jitted_target_call = jax.jit(_target_call, static_argnames=("target_cls", "config", "aux_layer_ids"))


class Target:
    """A frozen target model: config, raw HF config, params and a pure forward.

    An architecture subclass provides ``config_class``, ``weight_specs`` and ``decoder`` (a
    ``decoder.Decoder``), whose pure functions are the target's computation:
    ``forward(params, config, input_ids, *, aux_layer_ids, positions, segment_ids)``,
    ``embed_table(params, config)``, ``lm_head_weight(params, config)``, and cached decoding's
    ``init_cache(config, batch_size, max_len, dtype)`` and ``decode_chunk(params, config, cache,
    input_ids, positions, start, *, aux_layer_ids, chunk_mask_btt, valid_from_b, logits_index) ->
    (logits, aux, final_hidden, cache)``. The methods below of the same names bind ``params``/``config``.
    Its config must be a hashable (frozen) dataclass with ``num_hidden_layers``, ``architecture``
    and ``kernels`` (a KernelChoices).
    """

    decoder: Any = None  # a decoder.Decoder; None only for a class that is not yet a family
    # commit_path_fn(cache, start, path, accepted) -> cache: after a tree chunk written at slots
    # start.., make the accepted root-to-node path (chunk rows path[0..accepted]) the linear sequence
    # at slots start..start+accepted (see commit_tree_path; a target with recurrent state overrides it)
    commit_path_fn: Callable[..., Any] = staticmethod(commit_tree_path)
    # init_params(config, key, dtype) -> random params, for architectures with toy targets (``init``)
    init_params: Callable[..., Any] | None = None
    # an MoE family's routed-expert weights (the weight-path prefix); its config has
    # num_experts_per_tok and num_routed_experts
    routed_experts_path: tuple[str, ...] = ()
    # the family's blocks run every dense projection through layers/linear.dense and its weight map
    # goes through fp8_compute.device_weight_specs: target.compute_dtype fp8 is accepted
    fp8_compute: bool = False

    def __init__(self, config: Any, hf_config: Mapping[str, Any], params: Any, arch: str | None = None):
        self.config = config
        self.hf_config = dict(hf_config)
        self.params = params
        self.arch = arch or config.architecture

    # ---- architecture hooks -------------------------------------------------------------------
    config_class: Any  # a frozen dataclass with from_hf(hf_config, **overrides)

    @classmethod
    def config_from_hf(cls, hf_config: Mapping[str, Any], **overrides) -> Any:
        """The config for an HF config dict; ``overrides`` are config fields, or the kernel keywords
        of ``kernel_choices.KEYWORDS`` (``moe_implementation=``, ``attention_q_block=``, ...), or
        ``compute_dtype=`` (target.compute_dtype: "bfloat16", or "fp8" for a family with ``fp8_compute``)."""
        overrides = KernelChoices.take_keywords(overrides)
        compute_dtype = overrides.pop("compute_dtype", "bfloat16")
        if compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"target.compute_dtype={compute_dtype!r}: expected one of {COMPUTE_DTYPES}")
        if compute_dtype != "bfloat16":  # fp8: targets/fp8_compute.py
            if not cls.fp8_compute:
                supported = sorted(a for a, c in registry.ARCHITECTURES.items() if getattr(c, "fp8_compute", False))
                raise ValueError(
                    f"target.compute_dtype=fp8 is not implemented for {cls.__name__}: the FP8 target GEMMs run for "
                    f"{', '.join(supported)}. Fix: set target.compute_dtype: bfloat16 for this target")
            overrides["compute_dtype"] = compute_dtype
        return cls.config_class.from_hf(hf_config, **overrides)

    @classmethod
    def init(cls, config: Any, key: jax.Array, dtype=jnp.float32) -> "Target":
        """A random toy target (hf_config = ``config.to_hf()``), for architectures with ``init_params``."""
        if cls.init_params is None:
            raise NotImplementedError(f"{cls.__name__} has no init_params; build random params from its weight_specs")
        return cls(config, config.to_hf(np.dtype(dtype).name), cls.init_params(config, key, dtype))

    @classmethod
    def weight_specs(cls, config: Any) -> list[WeightSpec]:  # pragma: no cover
        raise NotImplementedError

    @classmethod
    def checkpoint_weight_specs(cls, config: Any, names) -> list[WeightSpec]:
        """The weight map of a checkpoint holding the tensors ``names``: weight_specs, unless the family
        stores the same params in more than one on-disk layout and picks by name."""
        return cls.weight_specs(config)

    @classmethod
    def ignored_hf_names(cls, config: Any, name: str) -> bool:
        """True for tensors that may be on disk but are not parameters: old checkpoints' rotary
        buffers, and the lm_head copy some tied checkpoints still carry."""
        return name.endswith("rotary_emb.inv_freq") or (
            bool(getattr(config, "tie_word_embeddings", False)) and name == "lm_head.weight") or (
            getattr(config, "weight_quant", None) is not None and name.endswith(ACTIVATION_SCALE_SUFFIXES))

    # ---- generic API --------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Depth that aux ids address: the decoder layers, or for looped (weight-shared) targets the
        unrolled virtual depth (their config's ``num_virtual_layers``)."""
        return layer_depth(self.config)

    def default_aux_layer_ids(self) -> tuple[int, int, int]:
        return default_aux_layer_ids(self.num_layers)

    def active_params_per_token(self) -> int | None:
        """Parameters one token uses: all but the routed experts it is not sent to (the published
        "activated" count, embeddings included); None for a target without routed experts."""
        prefix = type(self).routed_experts_path
        if not prefix:
            return None
        k, e = self.config.num_experts_per_tok, self.config.num_routed_experts
        total = 0
        for spec in self.weight_specs(self.config):
            n = spec.num_params
            total += n * k // e if spec.path[:len(prefix)] == prefix else n
        return int(total)

    def param_logical_axes(self) -> dict:
        tree: dict = {}
        for spec in self.weight_specs(self.config):
            tree_set(tree, spec.path, spec.axes)
        return tree

    def forward(self, params, input_ids, *, aux_layer_ids, positions=None, segment_ids=None):
        """PURE: (final_hidden [B,T,H], aux tuple). Safe inside a jitted train step."""
        return type(self).decoder.forward(
            params, self.config, input_ids,
            aux_layer_ids=aux_layer_ids, positions=positions, segment_ids=segment_ids,
        )

    def embed_table(self, params) -> jax.Array:
        """[V, H] token embedding table."""
        return type(self).decoder.embed_table(params, self.config)

    def lm_head_weight(self, params) -> jax.Array:
        """[V, H] output projection in HF layout (rows = vocab; tied -> the embedding table)."""
        return type(self).decoder.lm_head_weight(params, self.config)

    @property
    def logit_softcap(self) -> float | None:
        """c when the target's logits are c * tanh((h @ lm_head.T) / c) (Gemma 4's
        final_logit_softcapping; specjax.layers.logits.soft_cap), which training teachers apply too."""
        return None

    # ---- cached decoding ------------------------------------------------------------------------
    @property
    def supports_decoding(self) -> bool:
        return type(self).decoder is not None

    def require_decoding(self) -> None:
        """Raise NotImplementedError naming the architectures with cached decoding."""
        if self.supports_decoding:
            return
        ok = sorted(a for a, cls in registry.ARCHITECTURES.items() if cls.decoder is not None)
        raise NotImplementedError(
            f"speculative decoding/regeneration supports {', '.join(ok)}; got {self.arch}. Use one of "
            f"those targets, or regenerate through an OpenAI-compatible endpoint (regenerate.backend=openai)."
        )

    def init_cache(self, batch_size: int, max_len: int, dtype=None):
        """A zeroed KV cache for `max_len` slots per row (static size, rounded up); dtype defaults
        to the params dtype."""
        self.require_decoding()
        if dtype is None:
            dtype = self.embed_table(self.params).dtype
        return type(self).decoder.init_cache(self.config, batch_size, max_len, dtype)

    def decode_chunk(self, params, cache, input_ids, positions, start, *, aux_layer_ids=(), chunk_mask=None,
               valid_from=None, logits_index=None):
        """PURE cached forward of a chunk [B,T] written at slots start[b].. (usable inside jit):
        (fp32 logits, aux tuple, final hidden, new cache). The contract is decoder.Decoder.decode_chunk's."""
        self.require_decoding()
        return type(self).decoder.decode_chunk(
            params, self.config, cache, input_ids, positions, start, aux_layer_ids=aux_layer_ids,
            chunk_mask_btt=chunk_mask, valid_from_b=valid_from, logits_index=logits_index,
        )

    def __call__(self, input_ids, aux_layer_ids=None, positions=None, segment_ids=None) -> TargetOutput:
        """Jitted forward + logits on ``self.params``; aux_layer_ids=None uses the default triple."""
        ids = self.default_aux_layer_ids() if aux_layer_ids is None else aux_layer_ids
        ids = validate_aux_layer_ids(ids, self.num_layers)
        return _jitted_target_call(
            self.params, input_ids, positions, segment_ids,
            target_cls=type(self), config=self.config, aux_layer_ids=ids,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(arch={self.arch!r}, config={self.config!r})"

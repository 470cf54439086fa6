"""Rotary position embeddings (RoPE) for HF-style targets.

Reads both config layouts transformers has used:
  * transformers >= 5: ``rope_parameters = {"rope_type": ..., "rope_theta": ..., <scaling keys>}``
  * legacy:            ``rope_theta`` at top level and ``rope_scaling = {"type"|"rope_type": ..., ...}``

Supported rope types: ``default``, ``linear`` and ``llama3`` for every family; ``longrope``
(Phi-3 / Phi-4) and ``partial_rotary_factor`` < 1 only where a family builds its tables with
:func:`rope_tables` and asks :func:`rope_spec_from_hf` for them (``longrope=True``,
``partial_rotary=True``); the others refuse such configs. The inverse frequencies are computed once
in numpy float32, mirroring transformers' float32 arithmetic, and become trace-time constants.

LongRoPE has two sets of frequencies, ``short_factor`` and ``long_factor``. transformers
(``modeling_rope_utils.longrope_frequency_update``) picks one per call: the long set when the
call's largest position + 1 exceeds ``original_max_position_embeddings``, else the short set, for
every position of that call; cos and sin are then scaled by the attention factor (from the config,
else sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), factor defaulting to
max_position_embeddings / original_max_position_embeddings). :func:`rope_tables` does the same per
call (a select on the traced positions), so a training forward or a decoding chunk gets the tables
transformers computes for the same position ids. In cached decoding, as in transformers with a
cache, keys written by earlier calls keep the set they were written with.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LONGROPE_TYPES = ("longrope", "su")  # "su": the name older Phi-3 configs use for longrope


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Hashable RoPE description (safe to close over in jitted code)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3 and longrope
    partial_rotary_factor: float = 1.0  # RoPE on the first int(head_dim * factor) dims of each head only
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors, sequences <= original length
    long_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors, longer sequences
    attention_factor: float = 1.0  # longrope: cos and sin are multiplied by it

    def __post_init__(self):  # a JSON round trip (run_meta.json, manifests) gives lists: keep it hashable
        for name in ("short_factor", "long_factor"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dims of each head are rotated (transformers: int(head_dim * factor))."""
        return int(head_dim * self.partial_rotary_factor)

    def to_hf(self) -> dict[str, Any]:
        """The transformers-5 ``rope_parameters`` dict for this spec."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type in ("linear", "llama3"):
            out["factor"] = self.factor
        if self.rope_type == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "longrope":
            out.update(short_factor=list(self.short_factor), long_factor=list(self.long_factor),
                       original_max_position_embeddings=self.original_max_position_embeddings,
                       attention_factor=self.attention_factor)
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        return out


def rope_spec_from_hf(hf: Mapping[str, Any], *, longrope: bool = False, partial_rotary: bool = False) -> RopeSpec:
    """Build a RopeSpec from an HF config dict (either config layout). ``longrope`` /
    ``partial_rotary``: the caller's family builds its tables with :func:`rope_tables`, which
    handles LongRoPE / partial rotary; without them such configs are refused."""
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
    else:
        params = dict(params)
    if params and all(isinstance(v, Mapping) for v in params.values()):
        # transformers nests rope_parameters per layer type for hybrid models (e.g. sliding layers).
        raise ValueError(
            f"per-layer-type rope_parameters ({sorted(params)}) are not supported by this target"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    partial = 1.0 if partial is None else float(partial)
    if partial != 1.0 and not (partial_rotary and 0.0 < partial < 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full-width RoPE)")
    if rope_type in LONGROPE_TYPES and longrope:
        return dataclasses.replace(_longrope_spec(hf, params, float(theta)), partial_rotary_factor=partial)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeSpec("default", float(theta), partial_rotary_factor=partial)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} with rope type {rope_type!r} is not supported")
    if "factor" not in params:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor' in the rope config: {params}")
    if rope_type == "linear":
        return RopeSpec("linear", float(theta), factor=float(params["factor"]))
    # llama3; transformers falls back to max_position_embeddings for the original context length.
    orig = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
    missing = [k for k in ("low_freq_factor", "high_freq_factor") if k not in params]
    if missing or orig is None:
        raise ValueError(f"llama3 rope config is missing {missing or ['original_max_position_embeddings']}")
    return RopeSpec(
        "llama3",
        float(theta),
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(orig),
    )


def _longrope_spec(hf: Mapping[str, Any], params: Mapping[str, Any], theta: float) -> RopeSpec:
    """The longrope RopeSpec of an HF config (transformers' ``_compute_longrope_parameters``)."""
    missing = [k for k in ("short_factor", "long_factor") if not params.get(k)]
    # Phi-3 configs keep the pretraining length at the top level, and transformers prefers it there
    orig = hf.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    if missing or orig is None:
        raise ValueError(f"longrope rope config is missing {missing or ['original_max_position_embeddings']}")
    short, long = tuple(float(x) for x in params["short_factor"]), tuple(float(x) for x in params["long_factor"])
    if len(short) != len(long):
        raise ValueError(f"longrope short_factor has {len(short)} entries, long_factor {len(long)}; they must match")
    factor = params.get("factor")
    if factor is None:
        factor = float(hf.get("max_position_embeddings", orig)) / float(orig)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(int(orig)))
    return RopeSpec("longrope", theta, original_max_position_embeddings=int(orig), short_factor=short,
                    long_factor=long, attention_factor=float(attention_factor))


def _base_frequencies(spec: RopeSpec, head_dim: int) -> np.ndarray:
    dim = spec.rotary_dim(head_dim)
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    return (np.float32(1.0) / (np.float32(spec.theta) ** exponent)).astype(np.float32)


def longrope_frequencies(spec: RopeSpec, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 (short, long) inverse frequencies [rotary_dim // 2] of a longrope spec."""
    dim = spec.rotary_dim(head_dim)
    if len(spec.short_factor) != dim // 2:
        raise ValueError(f"longrope factors have {len(spec.short_factor)} entries; rotary dim {dim} needs {dim // 2}")
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    base = (np.float32(spec.theta) ** exponent).astype(np.float32)
    return tuple((np.float32(1.0) / (np.asarray(f, np.float32) * base)).astype(np.float32)
                 for f in (spec.short_factor, spec.long_factor))


def inverse_frequencies(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """float32 [rotary_dim // 2] inverse frequencies, scaled per ``spec.rope_type`` (longrope has two
    sets, picked per call: :func:`rope_tables`)."""
    if spec.rope_type == "longrope":
        raise ValueError("longrope picks its frequencies per call from the positions: build the tables with "
                         "rope_tables(spec, head_dim, positions, dtype)")
    inv_freq = _base_frequencies(spec, head_dim)
    if spec.rope_type == "default":
        return inv_freq
    factor = np.float32(spec.factor)
    if spec.rope_type == "linear":
        return (inv_freq / factor).astype(np.float32)
    # llama3: keep short wavelengths, divide long ones by `factor`, blend the band in between.
    old_ctx = np.float32(spec.original_max_position_embeddings)
    low, high = np.float32(spec.low_freq_factor), np.float32(spec.high_freq_factor)
    low_freq_wavelen = old_ctx / low
    high_freq_wavelen = old_ctx / high
    wavelen = (np.float32(2 * math.pi) / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old_ctx / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions_bt: jnp.ndarray, inv_freq: np.ndarray, dtype,
                 attention_factor: float = 1.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables [B, T, 2 * len(inv_freq)] for integer positions; angles in fp32 (and the
    product with ``attention_factor``), result in ``dtype``.

    Computed once per forward (outside the layer scan) and shared by every layer.
    """
    angles = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)  # HF "rotate_half" layout: [f0..f_{d/2}, f0..]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * jnp.float32(attention_factor), sin * jnp.float32(attention_factor)
    return cos.astype(dtype), sin.astype(dtype)


def rope_tables(spec: RopeSpec, head_dim: int, positions_bt: jnp.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin [B, T, rotary_dim] for any spec; longrope picks its short or long set for the whole
    call from the largest position, as transformers does (module docstring)."""
    if spec.rope_type != "longrope":
        return rope_cos_sin(positions_bt, inverse_frequencies(spec, head_dim), dtype)
    short, long = longrope_frequencies(spec, head_dim)
    is_long = jnp.max(positions_bt) + 1 > spec.original_max_position_embeddings
    return rope_cos_sin(positions_bt, jnp.where(is_long, long, short), dtype, spec.attention_factor)


def apply_rope(x_btnh: jnp.ndarray, cos_bth: jnp.ndarray, sin_bth: jnp.ndarray) -> jnp.ndarray:
    """Rotate [B, T, N, head_dim] by the per-position tables (HF half-split convention); tables
    narrower than head_dim rotate the leading dims and pass the rest (partial rotary)."""
    rot = cos_bth.shape[-1]
    if rot < x_btnh.shape[-1]:
        rotated = apply_rope(x_btnh[..., :rot], cos_bth, sin_bth)
        return jnp.concatenate([rotated, x_btnh[..., rot:]], axis=-1)
    half = x_btnh.shape[-1] // 2
    x1, x2 = x_btnh[..., :half], x_btnh[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_bth[:, :, None, :], sin_bth[:, :, None, :]
    return (x_btnh * cos + rotated * sin).astype(x_btnh.dtype)

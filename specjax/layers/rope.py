"""Rotary position embeddings (RoPE) for HF-style targets.

Reads both config layouts transformers has used:
  * transformers >= 5: ``rope_parameters = {"rope_type": ..., "rope_theta": ..., <scaling keys>}``
  * legacy:            ``rope_theta`` at top level and ``rope_scaling = {"type"|"rope_type": ..., ...}``

Supported rope types: ``default``, ``linear`` and ``llama3`` for every family; ``longrope``
(Phi-3 / Phi-4), ``yarn`` (DeepSeek-V3 / Kimi K2) and ``partial_rotary_factor`` < 1 only where a
family builds its tables with :func:`rope_tables` and asks :func:`rope_spec_from_hf` for them
(``longrope=True``, ``yarn=True``, ``partial_rotary=True``); the others refuse such configs. The
inverse frequencies are computed once in numpy float32, mirroring transformers' float32 arithmetic,
and become trace-time constants.

LongRoPE has two sets of frequencies, ``short_factor`` and ``long_factor``. transformers
(``modeling_rope_utils.longrope_frequency_update``) picks one per call: the long set when the
call's largest position + 1 exceeds ``original_max_position_embeddings``, else the short set, for
every position of that call; cos and sin are then scaled by the attention factor (from the config,
else sqrt(1 + ln(factor) / ln(original_max_position_embeddings)), factor defaulting to
max_position_embeddings / original_max_position_embeddings). :func:`rope_tables` does the same per
call (a select on the traced positions), so a training forward or a decoding chunk gets the tables
transformers computes for the same position ids. In cached decoding, as in transformers with a
cache, keys written by earlier calls keep the set they were written with.

YaRN (transformers' ``_compute_yarn_parameters``) has one set of frequencies: each one blends the
plain frequency and the frequency divided by ``factor``, with a linear ramp over the dimension
range that ``beta_fast`` / ``beta_slow`` rotations span within ``original_max_position_embeddings``
(range ends rounded outwards unless ``truncate`` is false). cos and sin are multiplied by the
attention factor: the config's ``attention_factor``, else mscale(factor, mscale) /
mscale(factor, mscale_all_dim) when both are set, else mscale(factor), where mscale(s, m) =
0.1 m ln(s) + 1 (1 for s <= 1). DeepSeek's multi-head latent attention also multiplies its softmax
scale by mscale(factor, mscale_all_dim)^2 (:func:`yarn_softmax_scale_factor`); DeepSeek-V3 and
Kimi K2 set mscale = mscale_all_dim, so their cos/sin factor is 1 and only the softmax scale moves.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LONGROPE_TYPES = ("longrope", "su")  # "su": the name older Phi-3 configs use for longrope
YARN_TYPE = "yarn"


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
    attention_factor: float = 1.0  # longrope and yarn: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn: rotations that bound the ramp on the fast (extrapolated) side
    beta_slow: float = 1.0  # yarn: rotations that bound the ramp on the slow (interpolated) side
    mscale: float = 0.0  # yarn: the config's mscale (0 = not set)
    mscale_all_dim: float = 0.0  # yarn: the config's mscale_all_dim (0 = not set; MLA's softmax scale)
    truncate: bool = True  # yarn: round the ramp's ends outwards to whole dimensions

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
        if self.rope_type == YARN_TYPE:
            out.update(factor=self.factor, original_max_position_embeddings=self.original_max_position_embeddings,
                       beta_fast=self.beta_fast, beta_slow=self.beta_slow)
            out.update({k: getattr(self, k) for k in ("mscale", "mscale_all_dim") if getattr(self, k)})
            if not self.truncate:
                out["truncate"] = False
            if self.attention_factor != yarn_attention_factor(self.factor, self.mscale, self.mscale_all_dim):
                out["attention_factor"] = self.attention_factor
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        return out


def rope_spec_from_hf(hf: Mapping[str, Any], *, longrope: bool = False, partial_rotary: bool = False,
                      yarn: bool = False) -> RopeSpec:
    """Build a RopeSpec from an HF config dict (either config layout). ``longrope`` / ``yarn`` /
    ``partial_rotary``: the caller's family builds its tables with :func:`rope_tables`, which
    handles LongRoPE / YaRN / partial rotary; without them such configs are refused."""
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
    if rope_type not in SUPPORTED_ROPE_TYPES + ((YARN_TYPE,) if yarn else ()):
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            + (" (and yarn)" if yarn else "")
        )
    if rope_type == "default":
        return RopeSpec("default", float(theta), partial_rotary_factor=partial)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} with rope type {rope_type!r} is not supported")
    if "factor" not in params:
        raise ValueError(f"rope type {rope_type!r} needs a 'factor' in the rope config: {params}")
    if rope_type == "linear":
        return RopeSpec("linear", float(theta), factor=float(params["factor"]))
    if rope_type == YARN_TYPE:
        return _yarn_spec(hf, params, float(theta))
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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The cos/sin factor of a yarn config without ``attention_factor`` (module docstring)."""
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor)


def yarn_softmax_scale_factor(spec: RopeSpec) -> float:
    """What multi-head latent attention (DeepSeek) multiplies its softmax scale by: mscale(factor,
    mscale_all_dim)^2 for a yarn spec with mscale_all_dim set, else 1 (transformers' yarn_apply_mscale)."""
    if spec.rope_type != YARN_TYPE or not spec.mscale_all_dim:
        return 1.0
    m = yarn_mscale(spec.factor, spec.mscale_all_dim)
    return m * m


def _yarn_spec(hf: Mapping[str, Any], params: Mapping[str, Any], theta: float) -> RopeSpec:
    """The yarn RopeSpec of an HF config (transformers' ``_compute_yarn_parameters``; factor required)."""
    # transformers prefers a top-level original_max_position_embeddings, then the rope dict's, then
    # max_position_embeddings (standardize_rope_params)
    orig = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or hf.get("max_position_embeddings")
    if orig is None:
        raise ValueError("yarn rope config is missing original_max_position_embeddings (and the config has no "
                         "max_position_embeddings to fall back on)")
    factor = float(params["factor"])
    mscale, mscale_all_dim = float(params.get("mscale") or 0.0), float(params.get("mscale_all_dim") or 0.0)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = yarn_attention_factor(factor, mscale, mscale_all_dim)
    truncate = params.get("truncate", True)
    return RopeSpec(YARN_TYPE, theta, factor=factor, original_max_position_embeddings=int(orig),
                    attention_factor=float(attention_factor), beta_fast=float(params.get("beta_fast") or 32),
                    beta_slow=float(params.get("beta_slow") or 1), mscale=mscale, mscale_all_dim=mscale_all_dim,
                    truncate=bool(True if truncate is None else truncate))


def _yarn_frequencies(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """float32 [rotary_dim // 2] YaRN inverse frequencies, in transformers' float32 order of operations
    (the ramp's ends are computed in float64 as Python floats, as there)."""
    dim = spec.rotary_dim(head_dim)
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    # theta ** (2i / dim), rounded once to float32 as torch's float32 pow is (numpy's float32 pow is
    # 1 ulp off in places; _base_frequencies keeps it, the other rope types' tables are unchanged)
    pos_freqs = (np.float64(spec.theta) ** exponent.astype(np.float64)).astype(np.float32)
    extrapolated = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolated = (np.float32(1.0) / (np.float32(spec.factor) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return (dim * math.log(spec.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    extrapolation_weight = (np.float32(1.0) - np.clip(ramp, np.float32(0.0), np.float32(1.0))).astype(np.float32)
    return (interpolated * (np.float32(1.0) - extrapolation_weight)
            + extrapolated * extrapolation_weight).astype(np.float32)


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
    if spec.rope_type == YARN_TYPE:  # its cos/sin factor is the tables' (rope_tables)
        return _yarn_frequencies(spec, head_dim)
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
    call from the largest position, as transformers does (module docstring); longrope and yarn
    scale cos and sin by their attention factor."""
    if spec.rope_type == YARN_TYPE:
        return rope_cos_sin(positions_bt, inverse_frequencies(spec, head_dim), dtype, spec.attention_factor)
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

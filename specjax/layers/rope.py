"""Rotary position embeddings (RoPE) for HF-style targets.

Reads both config layouts transformers has used:
  * transformers >= 5: ``rope_parameters = {"rope_type": ..., "rope_theta": ..., <scaling keys>}``
  * legacy:            ``rope_theta`` at top level and ``rope_scaling = {"type"|"rope_type": ..., ...}``

Supported rope types: ``default``, ``linear`` and ``llama3``. The inverse frequencies are computed
once in numpy float32, mirroring transformers' float32 arithmetic, and become trace-time constants.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Hashable RoPE description (safe to close over in jitted code)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3

    def to_hf(self) -> dict[str, Any]:
        """The transformers-5 ``rope_parameters`` dict for this spec."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.rope_type in ("linear", "llama3"):
            out["factor"] = self.factor
        if self.rope_type == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        return out


def rope_spec_from_hf(hf: Mapping[str, Any]) -> RopeSpec:
    """Build a RopeSpec from an HF config dict (either config layout)."""
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
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full-width RoPE)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeSpec("default", float(theta))
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


def inverse_frequencies(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """float32 [head_dim // 2] inverse frequencies, scaled per ``spec.rope_type``."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(spec.theta) ** exponent)).astype(np.float32)
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


def rope_cos_sin(positions_bt: jnp.ndarray, inv_freq: np.ndarray, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables [B, T, head_dim] for integer positions; angles in fp32, result in ``dtype``.

    Computed once per forward (outside the layer scan) and shared by every layer.
    """
    angles = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)  # HF "rotate_half" layout: [f0..f_{d/2}, f0..]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rope(x_btnh: jnp.ndarray, cos_bth: jnp.ndarray, sin_bth: jnp.ndarray) -> jnp.ndarray:
    """Rotate [B, T, N, head_dim] by the per-position tables (HF half-split convention)."""
    half = x_btnh.shape[-1] // 2
    x1, x2 = x_btnh[..., :half], x_btnh[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_bth[:, :, None, :], sin_bth[:, :, None, :]
    return (x_btnh * cos + rotated * sin).astype(x_btnh.dtype)

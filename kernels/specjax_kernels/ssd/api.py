"""Public Mamba-2 SSD scan entry point; ``implementation=`` picks the backend.

    y, final_state = ssd(x, dt, A, B, C, D=None, chunk_size=128, initial_state=None,
                         segment_ids=None, return_final_state=True, implementation=None)

  x [B, T, H, P]  dt [B, T, H] (positive step, after dt_bias/softplus/limits)  A [H] (negative)
  B, C [B, T, G, N] with H % G == 0   D [H] or None   initial_state [B, H, P, N]
  segment_ids [B, T] int: the state resets where the id changes (packed documents)
  -> y [B, T, H, P] fp32 (and the state after the last position, [B, H, P, N] fp32); fp64 for
     fp64 inputs (dtypes.accum_dtype: the tests' exact references)

  reference  sequential lax.scan over time, the definition (reference.py)
  xla        chunked state-space-duality form, chunk size ``chunk_size`` (xla.py); the default
Forward-only use in frozen targets (both are differentiable jnp anyway).
"""
from __future__ import annotations

from typing import Optional

from specjax_kernels.selection import select


def _reference():
    from specjax_kernels.ssd.reference import ssd as fn
    return fn


def _xla():
    from specjax_kernels.ssd.xla import ssd as fn
    return fn


IMPLEMENTATIONS = {"reference": _reference, "xla": _xla}
PREFERENCE = {"cpu": ["xla", "reference"], "gpu": ["xla", "reference"], "tpu": ["xla", "reference"]}


def check_inputs(x, dt, a, b, c, d, initial_state, segment_ids, chunk_size):
    """ValueError naming the first input of an `ssd` call whose shape or value does not fit."""
    if x.ndim != 4:
        raise ValueError(f"ssd: x must be [B, T, H, P], got shape {x.shape}")
    bsz, t, h, p = x.shape
    if dt.shape != (bsz, t, h):
        raise ValueError(f"ssd: dt must be [B, T, H] = {(bsz, t, h)}, got {dt.shape}")
    if a.shape != (h,):
        raise ValueError(f"ssd: A must be [H] = ({h},), got {a.shape}")
    if b.ndim != 4 or b.shape[:2] != (bsz, t) or c.shape != b.shape:
        raise ValueError(f"ssd: B and C must both be [B, T, G, N] with B, T = {bsz}, {t}; got {b.shape}, {c.shape}")
    if h % b.shape[2]:
        raise ValueError(f"ssd: the {h} heads must split evenly into the {b.shape[2]} B/C groups")
    if d is not None and d.shape != (h,):
        raise ValueError(f"ssd: D must be [H] = ({h},), got {d.shape}")
    if initial_state is not None and initial_state.shape != (bsz, h, p, b.shape[3]):
        raise ValueError(f"ssd: initial_state must be [B, H, P, N] = {(bsz, h, p, b.shape[3])}, got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (bsz, t):
        raise ValueError(f"ssd: segment_ids must be [B, T] = {(bsz, t)}, got {segment_ids.shape}")
    if int(chunk_size) < 1:
        raise ValueError(f"ssd: chunk_size must be >= 1, got {chunk_size}")


def ssd(x, dt, A, B, C, *, D=None, chunk_size: int = 128, initial_state=None, segment_ids=None,
        return_final_state: bool = False, implementation: Optional[str] = None):
    """Mamba-2 SSD scan (see the module docstring for shapes); fp32 outputs."""
    check_inputs(x, dt, A, B, C, D, initial_state, segment_ids, chunk_size)
    _, fn = select("ssd", IMPLEMENTATIONS, PREFERENCE, implementation)
    y, final = fn(x, dt, A, B, C, d_h=D, initial_state=initial_state, segment_ids=segment_ids,
                  chunk_size=int(chunk_size))
    return (y, final) if return_final_state else y

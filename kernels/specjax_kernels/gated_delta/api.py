"""Public gated delta rule (Gated DeltaNet) entry point; ``implementation=`` picks the backend.

    o, final_state = gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None,
                                      scale=None, use_qk_l2norm=True, chunk_size=64,
                                      return_final_state=False, implementation=None)

  q, k [B, T, Hk, Dk]   v [B, T, Hv, Dv] with Hv % Hk == 0 (value head h reads q/k head h // (Hv/Hk),
  transformers' repeat_interleave)   g [B, T, Hv] log decay (<= 0; Qwen3-Next: -exp(A_log) *
  softplus(a + dt_bias)), or [B, T, Hv, Dk]: one log decay per key channel (Kimi Delta Attention:
  the state's row c decays by exp(g[..., c]); reference.py)   beta [B, T, Hv] write strength (sigmoid(b))
  initial_state [B, Hv, Dk, Dv]   segment_ids [B, T] int: the state resets where the id changes
  scale: multiplies q after the optional L2 normalisation (None = Dk ** -0.5)
  -> o [B, T, Hv, Dv] fp32 (and the state after the last position, [B, Hv, Dk, Dv] fp32); fp64 for
     fp64 inputs (dtypes.accum_dtype: the tests' exact references)

  reference  sequential lax.scan over time, the definition (reference.py)
  xla        chunked WY/UT form, chunk size ``chunk_size`` (xla.py); the default

Forward only: the op serves frozen targets, so no custom VJP is defined (both backends are plain jnp
and differentiable, but no gradient is tested) and everything jits. Cached decoding (a chunk of new
tokens from a given state, per-row rollback) and the
short convolution in front of the rule: conv.py. T split over devices: context_parallel.py.
"""
from __future__ import annotations

from typing import Optional

from specjax_kernels.selection import select


def _reference():
    from specjax_kernels.gated_delta.reference import gated_delta_rule as fn
    return fn


def _xla():
    from specjax_kernels.gated_delta.xla import gated_delta_rule as fn
    return fn


IMPLEMENTATIONS = {"reference": _reference, "xla": _xla}
PREFERENCE = {"cpu": ["xla", "reference"], "gpu": ["xla", "reference"], "tpu": ["xla", "reference"]}
OP = "gated_delta"


def check_inputs(q, k, v, g, beta, initial_state=None, segment_ids=None, chunk_size=1, *, op=OP):
    """ValueError naming the first input of a gated delta rule call whose shape or value does not fit."""
    if k.ndim != 4:
        raise ValueError(f"{op}: k must be [B, T, Hk, Dk], got shape {k.shape}")
    bsz, t, hk, dk = k.shape
    if q.shape != k.shape:
        raise ValueError(f"{op}: q must have k's shape [B, T, Hk, Dk] = {k.shape}, got {q.shape}")
    if v.ndim != 4 or v.shape[:2] != (bsz, t):
        raise ValueError(f"{op}: v must be [B, T, Hv, Dv] with B, T = {bsz}, {t}; got {v.shape}")
    hv, dv = v.shape[2], v.shape[3]
    if hv % hk:
        raise ValueError(f"{op}: the {hv} value heads must split evenly over the {hk} query/key heads "
                         "(each q/k head serves Hv / Hk consecutive value heads)")
    if g.shape not in ((bsz, t, hv), (bsz, t, hv, dk)):
        raise ValueError(f"{op}: g must be [B, T, Hv] = {(bsz, t, hv)} (one log decay per value head) or "
                         f"[B, T, Hv, Dk] = {(bsz, t, hv, dk)} (one per key channel), got {g.shape}")
    if beta.shape != (bsz, t, hv):
        raise ValueError(f"{op}: beta must be [B, T, Hv] = {(bsz, t, hv)}, got {beta.shape}")
    if initial_state is not None and initial_state.shape != (bsz, hv, dk, dv):
        raise ValueError(f"{op}: the state must be [B, Hv, Dk, Dv] = {(bsz, hv, dk, dv)}, "
                         f"got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (bsz, t):
        raise ValueError(f"{op}: segment_ids must be [B, T] = {(bsz, t)}, got {segment_ids.shape}")
    if int(chunk_size) < 1:
        raise ValueError(f"{op}: chunk_size must be >= 1, got {chunk_size}")


def gated_delta_rule(q, k, v, g, beta, *, segment_ids=None, initial_state=None, scale=None,
                     use_qk_l2norm: bool = True, chunk_size: int = 64, return_final_state: bool = False,
                     implementation: Optional[str] = None):
    """Gated delta rule over a sequence (see the module docstring for shapes); fp32 outputs."""
    check_inputs(q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    _, fn = select(OP, IMPLEMENTATIONS, PREFERENCE, implementation)
    o, final = fn(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state, scale=scale,
                  use_qk_l2norm=use_qk_l2norm, chunk_size=int(chunk_size))
    return (o, final) if return_final_state else o

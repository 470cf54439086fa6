"""Public decode-attention entry point; `implementation=` picks the backend (reference.py is the math).

  reference   slice the layer out of the cache, plain masked softmax attention (what XLA runs)
  xla         the same (the name the other kernels use for "let XLA do it")
  pallas_gpu  one Triton program per (row, kv head) walking the live prefix of the stacked cache
              (pallas_gpu.py says why); interpret mode on the CPU
None / "auto" = pallas_gpu on a GPU when it takes the call (`pallas_gpu.supports`: short chunks, head_dim
a power of two), else xla; the fallback is logged once. The H200 regeneration numbers behind the GPU
choice are in benchmarks/results/kernels.md ("Decode attention").
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

from specjax_kernels._select import Unavailable, _select, log_once_fallback, record_choice, select, target_platform


def _reference():
    from specjax_kernels.decode_attention.reference import decode_attention as fn

    def call(q, k_cache, v_cache, layer, mask, limit, scale):
        return fn(q, k_cache, v_cache, layer, mask, limit, scale)
    return call


def _pallas_gpu():
    backend = target_platform()
    if backend not in ("gpu", "cpu"):
        raise Unavailable(f"Pallas GPU kernels need an NVIDIA GPU (or CPU interpret mode), not {backend}")
    from specjax_kernels.decode_attention.pallas_gpu import decode_attention as fn
    return functools.partial(fn, interpret=backend == "cpu")


IMPLEMENTATIONS = {"reference": _reference, "xla": _reference, "pallas_gpu": _pallas_gpu}
PREFERENCE = {"cpu": ["xla", "reference"], "gpu": ["pallas_gpu", "xla", "reference"],
              "tpu": ["xla", "reference"]}


def takes(q_shape, cache_shape, implementation: Optional[str] = None) -> bool:
    """Whether cached decoding should call `decode_attention` for this chunk (the chosen backend takes
    it), or keep its own slice-the-layer path (xla, and a pallas_gpu choice that cannot take the
    shape: a prefill chunk; that fallback is logged once)."""
    name, _ = _select("decode_attention", IMPLEMENTATIONS, PREFERENCE, implementation)
    if name == "pallas_gpu":
        from specjax_kernels.decode_attention.pallas_gpu import supports
        why = supports(q_shape, cache_shape)
        if why is not None:
            level = logging.INFO if implementation in (None, "auto") else logging.WARNING
            log_once_fallback("decode_attention", name, why, "xla", level)
            record_choice("decode_attention", "xla")
            return False
    record_choice("decode_attention", name)
    return name != "xla"


def decode_attention(q, k_cache, v_cache, layer, mask, limit, *, scale: float,
                     implementation: Optional[str] = None):
    """q [B,T,N,H] (the chunk's queries), k_cache / v_cache [L,B,S,K,H] (the new K/V already written),
    layer int32 [] (which cache layer), mask bool [B,T,S], limit int32 [B] (no slot >= limit[b] is
    visible: the chunk's last slot + 1) -> [B,T,N,H] in q's dtype. pallas_gpu raises on a shape it
    does not take (`takes` says beforehand)."""
    name, fn = select("decode_attention", IMPLEMENTATIONS, PREFERENCE, implementation)
    if name == "pallas_gpu":
        from specjax_kernels.decode_attention.pallas_gpu import supports
        why = supports(q.shape, k_cache.shape)
        if why is not None:
            raise ValueError(f"decode_attention pallas_gpu: {why}; use implementation='xla'")
    return fn(q, k_cache, v_cache, layer, mask, limit, scale)

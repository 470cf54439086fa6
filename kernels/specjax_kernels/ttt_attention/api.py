"""Public TTT-attention entry point; `implementation=` picks the backend (see reference.py for the math).

  reference   plain jnp, O(T^2) memory; the definition
  xla         blockwise causal online softmax in lax loops + LSE merge of the diagonal, custom VJP
  pallas_tpu  Pallas TPU flash kernels (fwd, dq, dk/dv): Mosaic when lowered for a TPU (from any host),
              the TPU interpreter on the CPU
  pallas_gpu  Pallas GPU kernels through the Triton lowering (fwd, dq, dk/dv); interpret mode on CPU
  triton      native @triton.jit kernels called through jax_triton (GPU only; import guarded)
None / "auto" = the first available of PREFERENCE[target_platform()] (jax.default_backend(), or the
platform `specjax_kernels.tpu_lowering.lowering_for` lowers for).
"""
from __future__ import annotations

import functools
from typing import Optional

from specjax_kernels.selection import Unavailable, select, target_platform


def _reference():
    from specjax_kernels.ttt_attention.reference import ttt_attention as fn

    def call(q, k0, v0, kd, vd, seg, scale, block_size=None, sinks=None):
        return fn(q, k0, v0, kd, vd, seg, scale, sinks)
    return call


def _xla():
    from specjax_kernels.ttt_attention.xla import ttt_attention as fn
    return fn


def _pallas_tpu():
    platform = target_platform()
    if platform not in ("tpu", "cpu"):
        raise Unavailable(f"Pallas TPU kernels need a TPU (or CPU interpret mode), not {platform}")
    from specjax_kernels.ttt_attention.pallas_tpu import ttt_attention as fn
    return functools.partial(fn, interpret=None)  # Mosaic when lowered for a TPU, the interpreter elsewhere


def _pallas_gpu():
    backend = target_platform()
    if backend not in ("gpu", "cpu"):
        raise Unavailable(f"Pallas GPU kernels need an NVIDIA GPU (or CPU interpret mode), not {backend}")
    from specjax_kernels.ttt_attention.pallas_gpu import ttt_attention as fn
    return functools.partial(fn, interpret=backend == "cpu")


def _triton():
    if target_platform() != "gpu":
        raise Unavailable("Triton kernels need an NVIDIA GPU")
    from specjax_kernels.ttt_attention.triton_gpu import ttt_attention as fn  # imports jax_triton
    return fn


IMPLEMENTATIONS = {"reference": _reference, "xla": _xla, "pallas_tpu": _pallas_tpu,
                   "pallas_gpu": _pallas_gpu, "triton": _triton}
# best-first per backend (benchmarks/results/kernels.md has the H200 numbers behind the GPU order).
# TPU: pallas_tpu, because its forward and backward lower for a TPU at the Llama-3.1-8B draft shapes up
# to T = 32768 (tests/kernels/test_tpu_lowering.py, lowered from a CPU host). Its TPU SPEED IS NOT YET
# MEASURED against xla (no TPU has run it), and Mosaic's own compile passes (libtpu) have not run on it;
# kernels.ttt_attention=xla keeps the XLA path.
PREFERENCE = {"cpu": ["xla", "reference"], "gpu": ["triton", "pallas_gpu", "xla", "reference"],
              "tpu": ["pallas_tpu", "xla", "reference"]}


def ttt_attention(q, k0, v0, k_diag=None, v_diag=None, segment_ids=None, *, scale=None,
                  implementation: Optional[str] = None, block_size: Optional[int] = None, sinks=None):
    """q [B,T,Hq,D] (step k), k0/v0 [B,T,Hkv,D] (step 0), k_diag/v_diag [k,B,T,Hkv,D] (steps 1..k) or None,
    segment_ids [B,T] or None -> [B,T,Hq,D] in q's dtype. `block_size` overrides the tile along T
    (the kernels' default otherwise; the reference ignores it). `sinks` [Hq]: attention sinks (gpt-oss),
    one more logit per head in every row's softmax denominator, with no value."""
    _, fn = select("ttt_attention", IMPLEMENTATIONS, PREFERENCE, implementation)
    if sinks is None:
        return fn(q, k0, v0, k_diag, v_diag, segment_ids, scale, block_size=block_size)
    return fn(q, k0, v0, k_diag, v_diag, segment_ids, scale, block_size=block_size, sinks=sinks)

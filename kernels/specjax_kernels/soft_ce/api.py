"""Public soft-CE entry points; `implementation=` picks the backend (see reference.py for the math).

  fused_linear_soft_ce(hidden, lm_head, teacher_logits=... | teacher_hidden=..., teacher_head=..., mask=...)
      the fused op: draft logits hidden @ lm_head.T are never stored in f32 (with bf16 inputs).
      reference  materialises the logits (the definition)
      xla        lax.scan over vocab tiles, online LSE for draft and teacher, custom VJP (recompute:
                 4 GEMMs of N*H*Vd forward+backward; only O(N) statistics saved)
      xla_saved  one GEMM, the logits saved in the input dtype (one [N,Vd] buffer, bf16: 2 bytes/elem)
                 and reused by the backward: 3 GEMMs, memory traded for the recompute
      pallas_tpu Pallas TPU kernels (grid reductions over vocab and H, VMEM scratch; stats + dlogits,
                 then the dh / dW GEMMs); Mosaic when lowered for a TPU (from any host), Pallas interpret
                 mode on the CPU; never compiled or run on a TPU
      pallas_gpu Pallas GPU kernels through the Triton lowering (same split); interpret mode on CPU
      triton     native @triton.jit kernels through jax_triton (GPU only; import guarded)
  soft_cross_entropy(draft_logits, teacher_logits)
      the logits API (kept for callers that already hold logits): reference, or the vocab-tiled
      xla path for every other name (no kernel can beat reading logits that already exist).
None / "auto" = the first available of PREFERENCE[target_platform()] (jax.default_backend(), or the
platform `specjax_kernels.tpu_lowering.lowering_for` lowers for).
"""
from __future__ import annotations

import functools
from typing import Optional

from specjax_kernels.selection import Unavailable, select, target_platform


def _reference():
    from specjax_kernels.soft_ce import reference

    def fused(hidden, lm_head, teacher_logits=None, teacher_hidden=None, teacher_head=None, mask=None,
              vocab_block=None, softcap=None):
        from specjax_kernels.soft_ce.common import check_inputs
        check_inputs(hidden, lm_head, teacher_logits, teacher_hidden, teacher_head, mask)
        lead = hidden.shape[:-1]
        flat = lambda x: None if x is None else x.reshape(-1, x.shape[-1])
        loss, amax = reference.fused_linear_soft_ce(flat(hidden), lm_head, flat(teacher_logits),
                                                    flat(teacher_hidden), teacher_head,
                                                    None if mask is None else mask.reshape(-1), softcap)
        return loss.reshape(lead), amax.reshape(lead)

    return {"fused": fused, "logits": lambda d, t, vocab_block=None: reference.soft_cross_entropy(d, t)}


def _xla():
    from specjax_kernels.soft_ce import xla
    return {"fused": xla.fused_linear_soft_ce, "logits": xla.soft_cross_entropy}


def _xla_saved():
    from specjax_kernels.soft_ce import xla, xla_saved
    return {"fused": xla_saved.fused_linear_soft_ce, "logits": xla.soft_cross_entropy}


def _pallas_tpu():
    platform = target_platform()
    if platform not in ("tpu", "cpu"):
        raise Unavailable(f"Pallas TPU kernels need a TPU (or CPU interpret mode), not {platform}")
    from specjax_kernels.soft_ce import pallas_tpu, xla
    # interpret=None: Mosaic when lowered for a TPU, the interpreter elsewhere
    return {"fused": functools.partial(pallas_tpu.fused_linear_soft_ce, interpret=None),
            "logits": xla.soft_cross_entropy}


def _pallas_gpu():
    backend = target_platform()
    if backend not in ("gpu", "cpu"):
        raise Unavailable(f"Pallas GPU kernels need an NVIDIA GPU (or CPU interpret mode), not {backend}")
    from specjax_kernels.soft_ce import pallas_gpu, xla
    return {"fused": functools.partial(pallas_gpu.fused_linear_soft_ce, interpret=backend == "cpu"),
            "logits": xla.soft_cross_entropy}


def _triton():
    if target_platform() != "gpu":
        raise Unavailable("Triton kernels need an NVIDIA GPU")
    from specjax_kernels.soft_ce import triton_gpu, xla  # imports jax_triton
    return {"fused": triton_gpu.fused_linear_soft_ce, "logits": xla.soft_cross_entropy}


IMPLEMENTATIONS = {"reference": _reference, "xla": _xla, "xla_saved": _xla_saved, "pallas_tpu": _pallas_tpu,
                   "pallas_gpu": _pallas_gpu, "triton": _triton}
# GPU: xla first. On the H200 the triton path is no faster at N = 8192 rows (16.9 vs 16.5 ms fwd+bwd); it
# stays selectable by name. xla_saved is faster (10.6 vs 15.9 ms at N = 8192, 1.08x the lm_head matmuls)
# but keeps one [N, Vd] bf16 buffer per call (2.1 GB per TTT step at 8x4096); it becomes the default once
# it has been measured inside the train step (benchmarks/results/kernels.md).
# TPU: pallas_tpu, because its stats and dlogits kernels lower for a TPU at the Llama-3.1-8B draft shape
# (N = 32768 rows, Vd = 32000, H = 4096, bf16; tests/kernels/test_tpu_lowering.py, from a CPU host). Its
# TPU SPEED IS NOT YET MEASURED against xla (no TPU has run it); kernels.soft_ce=xla keeps the XLA path.
PREFERENCE = {"cpu": ["xla", "reference"], "gpu": ["xla", "triton", "reference"],
              "tpu": ["pallas_tpu", "xla", "reference"]}


SOFTCAP_IMPLEMENTATIONS = ("xla", "reference")  # the backends that take `softcap`


def fused_linear_soft_ce(hidden, lm_head, *, teacher_logits=None, teacher_hidden=None, teacher_head=None,
                         mask=None, return_argmax: bool = False, implementation: Optional[str] = None,
                         vocab_block: Optional[int] = None, softcap: Optional[float] = None):
    """Soft-target CE of the draft logits hidden @ lm_head.T against the teacher's softmax.

    hidden [...,H] (bf16 or f32), lm_head [Vd,H]; teacher: teacher_logits [...,Vd], or teacher_hidden
    [...,Ht] with teacher_head [Vd,Ht] (the teacher logits are then computed per tile too, or once by
    xla_saved); mask [...]
    (row weights; 0 drops a row). Returns the per-row loss [...] f32 (mask applied), and with
    return_argmax=True also the draft logits' argmax [...] int32 (first index on ties) for accuracy
    metrics. Gradients flow to hidden and lm_head only. `softcap` c: the logits computed from hidden
    states (the draft's, and teacher_hidden's) are c * tanh(logits / c), a target's final-logit
    soft-cap; only SOFTCAP_IMPLEMENTATIONS take it (None / "auto" then picks xla)."""
    if softcap is None:
        _, fns = select("soft_ce", IMPLEMENTATIONS, PREFERENCE, implementation)
        extra = {}
    else:
        implementation = "xla" if implementation in (None, "auto") else implementation
        if implementation not in SOFTCAP_IMPLEMENTATIONS:
            raise ValueError(f"soft_ce: implementation {implementation!r} has no logit soft-cap; with softcap use one "
                             f"of {list(SOFTCAP_IMPLEMENTATIONS)} (kernels.soft_ce=xla)")
        _, fns = select("soft_ce", IMPLEMENTATIONS, PREFERENCE, implementation)
        extra = {"softcap": float(softcap)}
    loss, amax = fns["fused"](hidden, lm_head, teacher_logits=teacher_logits, teacher_hidden=teacher_hidden,
                              teacher_head=teacher_head, mask=mask, vocab_block=vocab_block, **extra)
    return (loss, amax) if return_argmax else loss


def soft_cross_entropy(draft_logits, teacher_logits, *, implementation: Optional[str] = None):
    """[..., Vd] x [..., Vd] -> [...] per-row loss in fp32. The teacher gets no gradient."""
    _, fns = select("soft_ce", IMPLEMENTATIONS, PREFERENCE, implementation)
    return fns["logits"](draft_logits, teacher_logits)

"""Public TTT-attention entry point; `implementation=` picks the backend (see reference.py for the math)."""
from __future__ import annotations

from typing import Optional

from specjax_kernels._select import select


def _reference():
    from specjax_kernels.ttt_attention.reference import ttt_attention as fn
    return fn


IMPLEMENTATIONS = {"reference": _reference}
# best-first per backend; faster backends are added here as they land
PREFERENCE = {"cpu": ["reference"], "gpu": ["reference"], "tpu": ["reference"]}


def ttt_attention(q, k0, v0, k_diag=None, v_diag=None, segment_ids=None, *, scale=None,
                  implementation: Optional[str] = None):
    _, fn = select("ttt_attention", IMPLEMENTATIONS, PREFERENCE, implementation)
    return fn(q, k0, v0, k_diag, v_diag, segment_ids, scale)

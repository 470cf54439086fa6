"""Public soft-CE entry point; `implementation=` picks the backend (see reference.py for the math)."""
from __future__ import annotations

from typing import Optional

from specjax_kernels._select import select


def _reference():
    from specjax_kernels.soft_ce.reference import soft_cross_entropy as fn
    return fn


IMPLEMENTATIONS = {"reference": _reference}
PREFERENCE = {"cpu": ["reference"], "gpu": ["reference"], "tpu": ["reference"]}


def soft_cross_entropy(draft_logits, teacher_logits, *, implementation: Optional[str] = None):
    _, fn = select("soft_ce", IMPLEMENTATIONS, PREFERENCE, implementation)
    return fn(draft_logits, teacher_logits)

"""Shared implementation selection: explicit name, or `auto` = best available, with a logged fallback."""
from __future__ import annotations

import logging
from typing import Callable

import jax

log = logging.getLogger("specjax_kernels")


def select(op: str, impls: dict[str, Callable[[], Callable | None]], preference: dict[str, list[str]],
           implementation: str | None) -> tuple[str, Callable]:
    """`impls` maps a name to a loader returning the function, or None when unavailable here."""
    if implementation in (None, "auto"):
        backend = jax.default_backend()
        order = preference.get(backend, preference["cpu"])
        for name in order:
            fn = impls[name]()
            if fn is not None:
                return name, fn
        raise RuntimeError(f"{op}: no implementation available on backend {backend}")
    if implementation not in impls:
        raise ValueError(
            f"{op}: unknown implementation {implementation!r}; choose one of {sorted(impls)} or 'auto'."
        )
    fn = impls[implementation]()
    if fn is None:
        fallback = preference["cpu"][0]
        log.warning("%s: implementation %r is not available here; falling back to %r",
                    op, implementation, fallback)
        return fallback, impls[fallback]()
    return implementation, fn

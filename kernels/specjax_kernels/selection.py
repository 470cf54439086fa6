"""Shared implementation selection: an explicit name, or `auto`/None = best available, with a logged fallback.

Each op has a table name -> loader. A loader returns the function, or raises `Unavailable(reason)`
(or returns None) when the implementation cannot run here (wrong backend, missing package). The
preference table lists names best-first per platform: `target_platform()` (cpu, gpu, tpu), which is
`jax.default_backend()` except while a step is traced for another platform inside
`specjax_kernels.tpu_lowering.lowering_for` (a TPU step lowered on a CPU host).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
from typing import Callable

import jax

log = logging.getLogger("specjax_kernels")

NAMES = ("reference", "xla", "pallas_tpu", "pallas_gpu", "triton")
_logged: set = set()
_PLATFORM: contextvars.ContextVar = contextvars.ContextVar("specjax_kernels_platform", default=None)
_CHOICES: contextvars.ContextVar = contextvars.ContextVar("specjax_kernels_choices", default=None)


def target_platform() -> str:
    """The platform kernels are chosen for: the one `tpu_lowering.lowering_for` names while a step is
    traced for another platform, else `jax.default_backend()`."""
    return _PLATFORM.get() or jax.default_backend()


@contextlib.contextmanager
def platform_override(platform: str):
    """Choose kernels for `platform` inside this block (use `tpu_lowering.lowering_for`, which also
    names the TPU chip to Mosaic's lowering and keys JAX's trace cache on it)."""
    token = _PLATFORM.set(platform)
    try:
        yield
    finally:
        _PLATFORM.reset(token)


@contextlib.contextmanager
def recording_choices():
    """Collect {op: set of implementation names} of every selection made inside this block."""
    choices: dict[str, set] = {}
    token = _CHOICES.set(choices)
    try:
        yield choices
    finally:
        _CHOICES.reset(token)


def record_choice(op: str, name: str) -> None:
    """Note a choice made outside `select` (the target attention's plain path) for `recording_choices`."""
    rec = _CHOICES.get()
    if rec is not None:
        rec.setdefault(op, set()).add(name)


class Unavailable(RuntimeError):
    """Raised by a loader whose implementation cannot run on this backend / install."""


def _load(impls, name):
    try:
        fn = impls[name]()
    except Unavailable as e:
        return None, str(e)
    except ImportError as e:  # an optional dependency (jax_triton, triton) is missing
        return None, f"import failed: {e}"
    return fn, None if fn is not None else "not available on this backend"


def _log_once(level, msg, *args):
    key = (level, msg, args)
    if key not in _logged:
        _logged.add(key)
        log.log(level, msg, *args)


def log_once_fallback(op: str, name: str, why: str, fallback: str, level: int = logging.WARNING) -> None:
    """The warning `select` gives when a chosen implementation cannot serve a call, for callers that
    find out only from the call's shapes (INFO when auto chose it: nothing the user asked for is lost)."""
    _log_once(level, "%s: implementation %r cannot take this call (%s); falling back to %r",
              op, name, why, fallback)


def select(op: str, impls: dict[str, Callable[[], Callable | None]], preference: dict[str, list[str]],
           implementation: str | None) -> tuple[str, Callable]:
    """(name, function) of the implementation chosen for `op` (see `resolve_implementation`), noted for
    `recording_choices`."""
    name, fn = resolve_implementation(op, impls, preference, implementation)
    record_choice(op, name)
    return name, fn


def resolve_implementation(op, impls, preference, implementation):
    """(name, function): `implementation` when it loads here (else the first of the platform's
    preference list that does, with a warning), or for None / "auto" the first that loads; not noted
    for `recording_choices` (a caller that may still fall back records its final choice itself)."""
    backend = target_platform()
    order = preference.get(backend, preference["cpu"])
    if implementation not in (None, "auto"):
        if implementation not in impls:
            raise ValueError(
                f"{op}: unknown implementation {implementation!r}; choose one of {sorted(impls)} or 'auto'.")
        fn, why = _load(impls, implementation)
        if fn is not None:
            return implementation, fn
        for name in order:
            fb, _ = _load(impls, name)
            if fb is not None:
                _log_once(logging.WARNING, "%s: implementation %r is not available on %s (%s); falling back to %r",
                          op, implementation, backend, why, name)
                return name, fb
        raise RuntimeError(f"{op}: {implementation!r} is not available ({why}) and no fallback works on {backend}.")
    reasons = []
    for name in order:
        fn, why = _load(impls, name)
        if fn is not None:
            if reasons:
                _log_once(logging.INFO, "%s auto on %s: using %r (skipped: %s)", op, backend, name, "; ".join(reasons))
            return name, fn
        reasons.append(f"{name}: {why}")
    raise RuntimeError(f"{op}: no implementation available on backend {backend} ({'; '.join(reasons)})")

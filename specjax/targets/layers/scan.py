"""Layer scans that keep only the tapped states.

A target's forward runs its layer stack as a few ``lax.scan`` calls, cut after every aux tap
(:func:`split_at_taps`), so only the tapped residual states are kept, never every layer's output.

The scans run over layer *indices* (static per-layer inputs ``xs``) and read each layer's weights
from the whole stacked tree with :func:`index_layer`, rather than scanning over a static slice
``layers[a:b]``: a static slice of the stack fed to a loop makes XLA materialise a copy of those
weights, while a per-step dynamic index reads one layer in place.

:func:`unrolled_layer_scans` traces the scans fully unrolled instead (each layer's index a constant).
It is a decoding experiment: in the H200 trace of a speculative step (a 6-token verification), each
layer's weights were copied out of the stack by ~9 separate dynamic-slice kernels, 277 of the step's 966
kernels and a quarter of its device time, where a 1-token greedy step fuses the same reads into its
matrix-vector kernels (benchmarks/results/decode_speed.md, run 5). Unrolled, the indices are constants
and XLA may fuse or hoist the slices; whether that is faster on the GPU is not measured yet, so the
default stays the scan.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from specjax.targets.quantized import dequantize_layer_weights


def split_at_taps(start: int, stop: int, taps: Sequence[int]) -> list[tuple[int, int, bool]]:
    """Layer range [start, stop) cut after every tap inside it: (a, b, ends_at_tap) pieces. Each
    piece becomes one layer scan, so only the tapped states are kept, never every layer's output."""
    pieces, a = [], start
    for k in taps:
        if start <= k < stop:
            pieces.append((a, k + 1, True))
            a = k + 1
    if a < stop:
        pieces.append((a, stop, False))
    return pieces


def index_layer(tree: Any, i) -> Any:
    """Layer ``i`` of a stacked subtree (leading layer axis), read in place with a dynamic index; a
    quantized checkpoint's weights come out dequantized, this layer's only (targets/quantized.py)."""
    layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), tree)
    return dequantize_layer_weights(layer)


_UNROLL = contextvars.ContextVar("specjax_unrolled_layer_scans", default=False)


@contextlib.contextmanager
def unrolled_layer_scans(on: bool = True) -> Iterator[None]:
    """Within this context, :func:`layer_scan` traces its scan fully unrolled. The setting is read when
    a function is traced, and jit caches traces by their arguments only: enter it before the first call
    of the jitted functions it should change (e.g. for a whole benchmark process)."""
    token = _UNROLL.set(bool(on))
    try:
        yield
    finally:
        _UNROLL.reset(token)


def layer_scan(step: Callable[[Any, Any], Any], carry: Any, xs: Any) -> Any:
    """``carry`` after ``step(carry, x)`` for each row x of the static per-layer inputs ``xs`` (a
    numpy array or a tuple of them, leading axis = layers), as one ``lax.scan`` (fully unrolled inside
    :func:`unrolled_layer_scans`)."""
    n = len(jax.tree.leaves(xs)[0])
    if n == 0:
        return carry
    carry, _ = jax.lax.scan(lambda c, x: (step(c, x), None), carry, jax.tree.map(jnp.asarray, xs),
                            unroll=n if _UNROLL.get() else 1)
    return carry


def scan_at_taps(
    run_span: Callable[[Any, int, int], Any],
    carry: Any,
    num_layers: int,
    taps: Sequence[int],
    *,
    tapped: Callable[[Any], Any] = lambda carry: carry,
) -> tuple[Any, tuple]:
    """Run layers [0, num_layers) as ``carry = run_span(carry, a, b)`` over the pieces of
    :func:`split_at_taps`; returns (carry, tuple of ``tapped(carry)`` after each tap). For stacks
    whose span needs static facts of its own layers (which block types it holds)."""
    aux = []
    for a, b, ends_at_tap in split_at_taps(0, num_layers, taps):
        carry = run_span(carry, a, b)
        if ends_at_tap:
            aux.append(tapped(carry))
    return carry, tuple(aux)


def scan_layers(
    step: Callable[[Any, Any], Any],
    carry: Any,
    xs: Any,
    taps: Sequence[int],
    *,
    tapped: Callable[[Any], Any] = lambda carry: carry,
) -> tuple[Any, tuple]:
    """``step(carry, xs[k])`` for every layer k (one scan body for all layers), one ``lax.scan`` per
    span between taps: (carry, tuple of ``tapped(carry)`` after each tap)."""
    num_layers = len(jax.tree.leaves(xs)[0])

    def run_span(c, a, b):
        return layer_scan(step, c, jax.tree.map(lambda v: v[a:b], xs))

    return scan_at_taps(run_span, carry, num_layers, taps, tapped=tapped)

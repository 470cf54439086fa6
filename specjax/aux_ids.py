"""EAGLE-3 aux layer ids (output-of-layer-k convention): the default taps and the range check.

Standard library only: specjax.targets.base re-exports both functions, and the draft-head converters
(validator, importer, serve_cmd) use them without importing jax (specjax.targets imports every
architecture).
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["default_aux_layer_ids", "validate_aux_layer_ids"]


def default_aux_layer_ids(num_layers: int, *, clamp: bool = True) -> tuple[int, int, int]:
    """The EAGLE-3 low/mid/high taps ``[1, L//2-1, L-4]`` (output-of-layer convention;
    docs/eagle3-format.md, "Aux layer ids").

    For small L the raw triple collides or leaves the range, so it is clamped into a strictly
    increasing triple inside [0, L-1]: low = min(1, L-3); mid = max(L//2-1, low+1);
    high = max(L-4, mid+1). For L >= 8 this is exactly the raw triple (Llama-3.1-8B: (1, 15, 28));
    L = 4..7 gives (1, 2, 3) and L = 3 gives (0, 1, 2). Needs L >= 3.

    ``clamp=False`` returns the raw triple for any L, unchecked: what vLLM and SGLang tap for a head
    whose config names no aux ids (they do not clamp). Use it only to predict what an engine does
    with such a head (the validator's aux.training rule, the importer, serve_cmd), never to choose
    the taps a draft trains on.
    """
    if not clamp:
        return (1, num_layers // 2 - 1, num_layers - 4)
    if num_layers < 3:
        raise ValueError(f"need at least 3 decoder layers for 3 aux taps, got {num_layers}")
    low = min(1, num_layers - 3)
    mid = max(num_layers // 2 - 1, low + 1)
    high = max(num_layers - 4, mid + 1)
    return (low, mid, high)


def validate_aux_layer_ids(aux_layer_ids: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """Return aux ids as a tuple of ints; raise ValueError unless strictly increasing in [0, L-1]."""
    if aux_layer_ids is None:
        return ()
    try:
        ids = tuple(int(i) for i in aux_layer_ids)
    except TypeError as e:
        raise ValueError(f"aux_layer_ids must be a sequence of ints, got {aux_layer_ids!r}") from e
    bad_range = [i for i in ids if not 0 <= i <= num_layers - 1]
    if bad_range:
        raise ValueError(
            f"aux_layer_ids {ids} out of range: valid ids are 0..{num_layers - 1} "
            f"(output of decoder layer k, {num_layers} layers)"
        )
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"aux_layer_ids {ids} must be strictly increasing (valid range 0..{num_layers - 1})")
    return ids

"""Public decode-attention entry point; `implementation=` picks the backend (reference.py is the math).

  reference   slice the layer out of the cache, plain masked softmax attention (what XLA runs)
  xla         the same (the name the other kernels use for "let XLA do it")
  pallas_gpu  one Triton program per (row, kv head) walking the live prefix of the stacked cache
              (pallas_gpu.py says why); interpret mode on the CPU
  pallas_gpu_split  the same kernel with split-K: SPLITS programs per (row, kv head) share the live
              blocks, one XLA fusion merges them (only by name until a GPU run times it)
None / "auto" = pallas_gpu on a GPU when it takes the call (`pallas_gpu.supports`: short chunks, head_dim
a power of two), else xla; the fallback is logged once. The H200 regeneration numbers behind the GPU
choice are in benchmarks/results/kernels.md ("Decode attention").

Every layer of a chunk attends under the same mask, and pallas_gpu reads it as int8 rows expanded to its
tile (`pallas_gpu.mask_rows`). `prepare_mask` builds that operand once per chunk, before the layer loop,
and `decode_attention` takes the `ChunkMask` it returns wherever it takes a bool mask. Built inside the
layer (a plain bool mask still works), the expansion ran once per layer (run 9's GPU profile): XLA does
not hoist a size-inflating op out of a loop. A one-token step's int8 convert sat in the layer loop too.
"""
from __future__ import annotations

import functools
import logging
from typing import Optional

import jax

from specjax_kernels.selection import (Unavailable, log_once_fallback, record_choice, resolve_implementation, select,
                                      target_platform)


@jax.tree_util.register_pytree_node_class
class ChunkMask:
    """A chunk's bool [B,T,S] cache mask (`mask`, what reference / xla read) and, when pallas_gpu takes
    the chunk, its kernel operand (`rows`, int8 [B,Rm,S]), built once for all layers (`prepare_mask`)."""

    def __init__(self, mask, rows=None):
        self.mask, self.rows = mask, rows

    def tree_flatten(self):
        return (self.mask, self.rows), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self):
        return self.mask.shape


def plain_mask(mask):
    """The bool [B,T,S] mask of a ChunkMask (or of a bool mask: itself)."""
    return mask.mask if isinstance(mask, ChunkMask) else mask


def prepare_mask(mask, num_heads: int, head_dim: int, cache_shape, implementation: Optional[str] = None):
    """The chunk's mask for every layer's `decode_attention`: a ChunkMask whose kernel operand is built
    here, once, when the backend chosen for these shapes is pallas_gpu and it takes the chunk
    (q [B,T,num_heads,head_dim] over a cache [..., S, K, head_dim]); otherwise it holds the bool mask alone."""
    b, t, s = mask.shape
    kv = cache_shape[-2]
    name, _ = resolve_implementation("decode_attention", IMPLEMENTATIONS, PREFERENCE, implementation)
    if name not in KERNELS:
        return ChunkMask(mask)
    from specjax_kernels.decode_attention.pallas_gpu import mask_rows, supports
    if supports((b, t, num_heads, head_dim), cache_shape) is not None:
        return ChunkMask(mask)
    return ChunkMask(mask, mask_rows(mask, num_heads // kv))


def _reference():
    from specjax_kernels.decode_attention.reference import decode_attention as fn

    def call(q, k_cache, v_cache, layer, mask, limit, scale):
        return fn(q, k_cache, v_cache, layer, plain_mask(mask), limit, scale)
    return call


def _pallas_gpu(splits: int = 1):
    backend = target_platform()
    if backend not in ("gpu", "cpu"):
        raise Unavailable(f"Pallas GPU kernels need an NVIDIA GPU (or CPU interpret mode), not {backend}")
    from specjax_kernels.decode_attention.pallas_gpu import decode_attention as fn

    def call(q, k_cache, v_cache, layer, mask, limit, scale):
        rows = isinstance(mask, ChunkMask) and mask.rows is not None
        return fn(q, k_cache, v_cache, layer, mask.rows if rows else plain_mask(mask), limit, scale,
                  interpret=backend == "cpu", rows=rows, splits=splits)
    return call


SPLITS = 4  # pallas_gpu_split's programs per (row, kv head); a guess until a GPU run times it
KERNELS = ("pallas_gpu", "pallas_gpu_split")  # the Triton kernels (same shapes taken, same mask operand)
IMPLEMENTATIONS = {"reference": _reference, "xla": _reference, "pallas_gpu": _pallas_gpu,
                   "pallas_gpu_split": lambda: _pallas_gpu(SPLITS)}
PREFERENCE = {"cpu": ["xla", "reference"], "gpu": ["pallas_gpu", "xla", "reference"],
              "tpu": ["xla", "reference"]}


def takes(q_shape, cache_shape, implementation: Optional[str] = None) -> bool:
    """Whether cached decoding should call `decode_attention` for this chunk (the chosen backend takes
    it), or keep its own slice-the-layer path (xla, and a pallas_gpu choice that cannot take the
    shape: a prefill chunk; that fallback is logged once)."""
    name, _ = resolve_implementation("decode_attention", IMPLEMENTATIONS, PREFERENCE, implementation)
    if name in KERNELS:
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
    layer int32 [] (which cache layer), mask bool [B,T,S] or its ChunkMask, limit int32 [B] (no slot >= limit[b] is
    visible: the chunk's last slot + 1) -> [B,T,N,H] in q's dtype. pallas_gpu raises on a shape it
    does not take (`takes` says beforehand)."""
    name, fn = select("decode_attention", IMPLEMENTATIONS, PREFERENCE, implementation)
    if name in KERNELS:
        from specjax_kernels.decode_attention.pallas_gpu import supports
        why = supports(q.shape, k_cache.shape)
        if why is not None:
            raise ValueError(f"decode_attention {name}: {why}; use implementation='xla'")
    return fn(q, k_cache, v_cache, layer, mask, limit, scale)

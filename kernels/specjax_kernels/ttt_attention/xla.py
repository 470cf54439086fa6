"""`xla` TTT attention: blockwise causal attention in plain JAX (lax loops), no [T,T] buffer.

Block 0 runs query block i against key blocks j <= i only (a fori_loop with a dynamic trip count,
so the upper triangle costs nothing), with an online softmax (running max m, sum l, acc). A key
block whose segment-id range cannot meet the query block's range is skipped with a lax.cond
(packed rows of short documents skip most of the triangle). The backward is one pass in the same
order: dq for block i accumulates in the loop carry, dk/dv accumulate into full-length f32
buffers (O(T*Hkv*D)). The diagonal merge and the custom VJP are in common.py.
`fwd0_offset`/`bwd0_offset` take queries that start at a global block index and a key sequence of
another length: the context-parallel path (context_parallel.py) runs a shard's queries against the
all-gathered keys with them; `fwd0`/`bwd0` are the offset-0, same-length case.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.ttt_attention.common import Backend, ttt_attention_with

DEFAULT_BLOCK = 512


def _split(x, bs):
    """[B, T, ...] -> [T/bs, B, bs, ...]."""
    B, T = x.shape[:2]
    x = x.reshape((B, T // bs, bs) + x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _mask(qi, j, bs, sq, sk):
    """[B,1,1,bs,bs]: causal within the pair of blocks (global block indices) and same segment."""
    qpos = qi * bs + jnp.arange(bs)
    kpos = j * bs + jnp.arange(bs)
    causal = qpos[:, None] >= kpos[None, :]
    same = sq[:, :, None] == sk[:, None, :]
    return (causal[None] & same)[:, None, None]


def _meets(qlo, qhi, klo, khi, i, j):
    """Can any row of query block i share a segment with key block j (any batch row)?"""
    return jnp.any(jnp.maximum(qlo[i], klo[j]) <= jnp.minimum(qhi[i], khi[j]))


def fwd0_offset(q, k, v, seg_q, seg_k, q_block0, scale, *, block):
    """Block 0 for queries that start at global block `q_block0` (may be traced) of a key sequence
    that starts at 0: q [B,Tq,Hq,D], k/v [B,Tk,Hkv,D], Tq and Tk multiples of `block`. With
    q_block0 = 0 and Tq = Tk this is the plain causal block 0; the context-parallel path passes a
    shard's queries and the all-gathered keys."""
    B, Tq, Hq, D = q.shape
    adt = accum_dtype(q)  # fp32 (fp64 for fp64 inputs)
    Hkv = k.shape[2]
    G = Hq // Hkv
    bs = block
    qb = _split(q.reshape(B, Tq, Hkv, G, D), bs)  # [nq,B,bs,Hkv,G,D]
    kb, vb = _split(k, bs), _split(v, bs)  # [nk,B,bs,Hkv,D]
    sqb, skb = _split(seg_q, bs), _split(seg_k, bs)
    qlo, qhi, klo, khi = sqb.min(-1), sqb.max(-1), skb.min(-1), skb.max(-1)

    def q_block(i):
        qi, si, gi = qb[i], sqb[i], q_block0 + i

        def step(j, carry):
            def run(carry):
                m, l, acc = carry
                s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kb[j], preferred_element_type=adt) * scale
                s = jnp.where(_mask(gi, j, bs, si, skb[j]), s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with nothing yet
                p = jnp.exp(s - m_use[..., None])
                alpha = jnp.exp(m - m_use)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vb[j], preferred_element_type=adt)
                return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

            return lax.cond(_meets(qlo, qhi, klo, khi, i, j), run, lambda c: c, carry)

        init = (jnp.full((B, Hkv, G, bs), -jnp.inf, adt), jnp.zeros((B, Hkv, G, bs), adt),
                jnp.zeros((B, Hkv, G, bs, D), adt))
        m, l, acc = lax.fori_loop(0, gi + 1, step, init)
        # every row sees at least its own key (s == t, same segment), so l > 0
        return acc / l[..., None], m + jnp.log(l)

    o, lse = lax.map(q_block, jnp.arange(Tq // bs))  # [nq,B,Hkv,G,bs,D], [nq,B,Hkv,G,bs]
    o = o.transpose(1, 0, 4, 2, 3, 5).reshape(B, Tq, Hq, D)
    lse = lse.transpose(1, 0, 4, 2, 3).reshape(B, Tq, Hq)
    return o, lse


def bwd0_offset(q, k, v, seg_q, seg_k, q_block0, do, lse, delta, scale, *, block):
    """Backward of fwd0_offset: (dq [B,Tq,Hq,D], dk, dv [B,Tk,Hkv,D]) in f32."""
    B, Tq, Hq, D = q.shape
    adt = accum_dtype(q)  # fp32 (fp64 for fp64 inputs)
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bs = block
    qb = _split(q.reshape(B, Tq, Hkv, G, D), bs)
    kb, vb = _split(k, bs), _split(v, bs)
    sqb, skb = _split(seg_q, bs), _split(seg_k, bs)
    qlo, qhi, klo, khi = sqb.min(-1), sqb.max(-1), skb.min(-1), skb.max(-1)
    dob = _split(do.reshape(B, Tq, Hkv, G, D), bs)
    # [nq,B,Hkv,G,bs] to line up with the scores' layout "bkgqs"
    lseb = jnp.moveaxis(_split(lse.reshape(B, Tq, Hkv, G), bs), 2, -1)
    deltab = jnp.moveaxis(_split(delta.reshape(B, Tq, Hkv, G), bs), 2, -1)

    def q_block(carry, i):
        dk_all, dv_all = carry
        qi, si, doi, lsei, deltai, gi = qb[i], sqb[i], dob[i], lseb[i], deltab[i], q_block0 + i

        def step(j, c):
            def run(c):
                dq, dk_all, dv_all = c
                kj, vj = kb[j], vb[j]
                s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=adt) * scale
                p = jnp.where(_mask(gi, j, bs, si, skb[j]), jnp.exp(s - lsei[..., None]), 0.0)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=adt)
                ds = p * (dp - deltai[..., None]) * scale
                dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), doi, preferred_element_type=adt)
                dk = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), qi, preferred_element_type=adt)
                dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), kj, preferred_element_type=adt)
                return dq, dk_all.at[j].add(dk), dv_all.at[j].add(dv)

            return lax.cond(_meets(qlo, qhi, klo, khi, i, j), run, lambda c: c, c)

        dq, dk_all, dv_all = lax.fori_loop(
            0, gi + 1, step, (jnp.zeros((B, bs, Hkv, G, D), adt), dk_all, dv_all))
        return (dk_all, dv_all), dq

    zeros = jnp.zeros((Tk // bs, B, bs, Hkv, D), adt)
    (dk, dv), dq = lax.scan(q_block, (zeros, zeros), jnp.arange(Tq // bs))
    dq = dq.transpose(1, 0, 2, 3, 4, 5).reshape(B, Tq, Hq, D)
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(B, Tk, Hkv, D)
    dv = dv.transpose(1, 0, 2, 3, 4).reshape(B, Tk, Hkv, D)
    return dq, dk, dv


def fwd0(q, k, v, seg, scale, *, block):
    return fwd0_offset(q, k, v, seg, seg, 0, scale, block=min(block, q.shape[1]))


def bwd0(q, k, v, seg, do, lse, delta, scale, *, block):
    return bwd0_offset(q, k, v, seg, seg, 0, do, lse, delta, scale, block=min(block, q.shape[1]))


@functools.lru_cache(maxsize=None)
def backend(block: int = DEFAULT_BLOCK) -> Backend:
    if block < 1:
        raise ValueError(f"xla ttt_attention block size must be >= 1, got {block}.")
    return Backend("xla", functools.partial(fwd0, block=block), functools.partial(bwd0, block=block), block)


def ttt_attention(q, k0, v0, k_diag=None, v_diag=None, segment_ids=None, scale=None, *, block_size=None,
                  sinks=None):
    T = q.shape[1]
    block = min(block_size or DEFAULT_BLOCK, T)
    return ttt_attention_with(backend(block), q, k0, v0, k_diag, v_diag, segment_ids, scale, sinks)

"""`xla` TTT attention: blockwise causal attention in plain JAX (lax loops), no [T,T] buffer.

Block 0 runs query block i against key blocks j <= i only (a fori_loop with a dynamic trip count,
so the upper triangle costs nothing), with an online softmax (running max m, sum l, acc). A key
block whose segment-id range cannot meet the query block's range is skipped with a lax.cond
(packed rows of short documents skip most of the triangle). The backward is one pass in the same
order: dq for block i accumulates in the loop carry, dk/dv accumulate into full-length f32
buffers (O(T*Hkv*D)). The diagonal merge and the custom VJP are in common.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from specjax_kernels.ttt_attention.common import Backend, f32, ttt_attention_with

DEFAULT_BLOCK = 512


def _blocks(q, k, v, seg, bs):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    nb = T // bs
    qb = q.reshape(B, nb, bs, Hkv, G, D).transpose(1, 0, 2, 3, 4, 5)  # [nb,B,bs,Hkv,G,D]
    kb = k.reshape(B, nb, bs, Hkv, D).transpose(1, 0, 2, 3, 4)  # [nb,B,bs,Hkv,D]
    vb = v.reshape(B, nb, bs, Hkv, D).transpose(1, 0, 2, 3, 4)
    sb = seg.reshape(B, nb, bs).transpose(1, 0, 2)  # [nb,B,bs]
    return qb, kb, vb, sb, sb.min(-1), sb.max(-1)


def _mask(i, j, bs, sq, sk):
    """[B,1,1,bs,bs]: causal within the pair of blocks and same segment."""
    qpos = i * bs + jnp.arange(bs)
    kpos = j * bs + jnp.arange(bs)
    causal = qpos[:, None] >= kpos[None, :]
    same = sq[:, :, None] == sk[:, None, :]
    return (causal[None] & same)[:, None, None]


def _meets(lo, hi, i, j):
    """Can any row of query block i share a segment with key block j (any batch row)?"""
    return jnp.any(jnp.maximum(lo[i], lo[j]) <= jnp.minimum(hi[i], hi[j]))


def fwd0(q, k, v, seg, scale, *, block):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    bs = min(block, T)
    qb, kb, vb, sb, lo, hi = _blocks(q, k, v, seg, bs)

    def q_block(i):
        qi, si = qb[i], sb[i]

        def step(j, carry):
            def run(carry):
                m, l, acc = carry
                s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kb[j], preferred_element_type=f32) * scale
                s = jnp.where(_mask(i, j, bs, si, sb[j]), s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(-1))
                m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a row with nothing yet
                p = jnp.exp(s - m_use[..., None])
                alpha = jnp.exp(m - m_use)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vb[j], preferred_element_type=f32)
                return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

            return lax.cond(_meets(lo, hi, i, j), run, lambda c: c, carry)

        init = (jnp.full((B, Hkv, G, bs), -jnp.inf, f32), jnp.zeros((B, Hkv, G, bs), f32),
                jnp.zeros((B, Hkv, G, bs, D), f32))
        m, l, acc = lax.fori_loop(0, i + 1, step, init)
        # every row sees at least its own key (s == t, same segment), so l > 0
        return acc / l[..., None], m + jnp.log(l)

    o, lse = lax.map(q_block, jnp.arange(T // bs))  # [nb,B,Hkv,G,bs,D], [nb,B,Hkv,G,bs]
    o = o.transpose(1, 0, 4, 2, 3, 5).reshape(B, T, Hq, D)
    lse = lse.transpose(1, 0, 4, 2, 3).reshape(B, T, Hq)
    return o, lse


def bwd0(q, k, v, seg, do, lse, delta, scale, *, block):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    bs = min(block, T)
    nb = T // bs
    qb, kb, vb, sb, lo, hi = _blocks(q, k, v, seg, bs)
    dob = do.reshape(B, nb, bs, Hkv, G, D).transpose(1, 0, 2, 3, 4, 5)
    # [nb,B,Hkv,G,bs] to line up with the scores' layout "bkgqs"
    lseb = lse.reshape(B, nb, bs, Hkv, G).transpose(1, 0, 3, 4, 2)
    deltab = delta.reshape(B, nb, bs, Hkv, G).transpose(1, 0, 3, 4, 2)

    def q_block(carry, i):
        dk_all, dv_all = carry
        qi, si, doi, lsei, deltai = qb[i], sb[i], dob[i], lseb[i], deltab[i]

        def step(j, c):
            def run(c):
                dq, dk_all, dv_all = c
                kj, vj = kb[j], vb[j]
                s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=f32) * scale
                p = jnp.where(_mask(i, j, bs, si, sb[j]), jnp.exp(s - lsei[..., None]), 0.0)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj, preferred_element_type=f32)
                ds = p * (dp - deltai[..., None]) * scale
                dv = jnp.einsum("bkgqs,bqkgd->bskd", p.astype(do.dtype), doi, preferred_element_type=f32)
                dk = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(q.dtype), qi, preferred_element_type=f32)
                dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(k.dtype), kj, preferred_element_type=f32)
                return dq, dk_all.at[j].add(dk), dv_all.at[j].add(dv)

            return lax.cond(_meets(lo, hi, i, j), run, lambda c: c, c)

        dq, dk_all, dv_all = lax.fori_loop(
            0, i + 1, step, (jnp.zeros((B, bs, Hkv, G, D), f32), dk_all, dv_all))
        return (dk_all, dv_all), dq

    zeros = jnp.zeros((nb, B, bs, Hkv, D), f32)
    (dk, dv), dq = lax.scan(q_block, (zeros, zeros), jnp.arange(nb))
    dq = dq.transpose(1, 0, 2, 3, 4, 5).reshape(B, T, Hq, D)
    dk = dk.transpose(1, 0, 2, 3, 4).reshape(B, T, Hkv, D)
    dv = dv.transpose(1, 0, 2, 3, 4).reshape(B, T, Hkv, D)
    return dq, dk, dv


@functools.lru_cache(maxsize=None)
def backend(block: int = DEFAULT_BLOCK) -> Backend:
    if block < 1:
        raise ValueError(f"xla ttt_attention block size must be >= 1, got {block}.")
    return Backend("xla", functools.partial(fwd0, block=block), functools.partial(bwd0, block=block), block)


def ttt_attention(q, k0, v0, k_diag=None, v_diag=None, segment_ids=None, scale=None, *, block_size=None):
    T = q.shape[1]
    block = min(block_size or DEFAULT_BLOCK, T)
    return ttt_attention_with(backend(block), q, k0, v0, k_diag, v_diag, segment_ids, scale)

"""What every fast TTT-attention backend shares: the LSE merge of the diagonal terms and the custom VJP.

A backend only supplies the step-0 block ("block 0"): causal, segment-masked GQA attention over the
step-0 keys, as
  fwd0(q, k0, v0, seg, scale)                      -> o0 [B,T,Hq,D] f32, lse0 [B,T,Hq] f32
  bwd0(q, k0, v0, seg, do, lse, delta, scale)      -> dq, dk0, dv0 (f32)
on inputs whose T is a multiple of `Backend.multiple` (padding is done here).

Why the split is exact (FlashAttention-2 backward, arXiv:2307.08691 §3.1.2): with the *final*
log-sum-exp `lse` over all keys (block 0 and the k diagonal keys) and delta = rowsum(dO * O),
every score's gradient is dS = P * (dP - delta) with P = exp(S - lse). The block-0 scores therefore
take exactly the flash backward with the merged lse/delta, and the k diagonal scores (one per row)
are elementwise. Memory is O(B*T*H*D): the residuals are q, k, v, the output and lse.

The forward merge: lse = logaddexp(lse0, s_1..s_k) with s_i = q[t]·K_i[t]*scale, and
out = o0 * exp(lse0 - lse) + sum_i exp(s_i - lse) V_i[t].
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype

f32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    fwd0: Callable  # (q, k, v, seg, scale) -> (o0 f32, lse0 f32)
    bwd0: Callable  # (q, k, v, seg, do, lse, delta, scale) -> (dq, dk, dv) f32
    multiple: int  # T is padded to a multiple of this before fwd0/bwd0


def check_inputs(q, k0, v0, kd, vd, seg):
    if q.ndim != 4 or k0.ndim != 4 or v0.shape != k0.shape:
        raise ValueError(
            f"ttt_attention wants q [B,T,Hq,D] and k0/v0 [B,T,Hkv,D]; got q {q.shape}, k0 {k0.shape}, "
            f"v0 {v0.shape}.")
    B, T, Hq, D = q.shape
    if k0.shape[0] != B or k0.shape[1] != T or k0.shape[3] != D:
        raise ValueError(f"k0 {k0.shape} does not match q {q.shape} in batch, length or head_dim.")
    if Hq % k0.shape[2]:
        raise ValueError(f"query heads {Hq} must be a multiple of kv heads {k0.shape[2]} (GQA).")
    if (kd is None) != (vd is None):
        raise ValueError("pass both k_diag and v_diag, or neither.")
    if kd is not None and (kd.ndim != 5 or kd.shape[1:] != k0.shape or vd.shape != kd.shape):
        raise ValueError(f"k_diag/v_diag must be [k,B,T,Hkv,D] with [B,T,Hkv,D] = {k0.shape}; "
                         f"got {kd.shape} and {vd.shape}.")
    if seg is not None and seg.shape != (B, T):
        raise ValueError(f"segment_ids must be [B,T] = {(B, T)}; got {seg.shape}.")


def segment_block_bounds(seg, q_block: int, k_block: int):
    """Which tiles of block 0 can hold a same-segment pair, for kernels that walk key blocks in a loop.

    seg [B, T] int32 (T a multiple of both blocks; any ids, equal ids need not be contiguous) ->
      kv_lo [B, T/q_block]: the first key block that shares a segment id with query block i
             (every earlier key block is masked for all of its rows, so a forward or dq loop may start there);
      q_hi  [B, T/k_block]: one past the last query block that shares a segment id with key block j
             (every later query block is masked for it, so a dk/dv loop may stop there).
    Exact for any id layout: a row's first (last) same-id position comes from a stable sort by id.
    Packed rows of short documents skip most of the causal triangle this way."""
    B, T = seg.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    order = jnp.argsort(seg, axis=1, stable=True).astype(jnp.int32)  # positions grouped by id, ascending
    sseg = jnp.take_along_axis(seg, order, axis=1)
    differs = sseg[:, 1:] != sseg[:, :-1]
    true = jnp.ones((B, 1), bool)
    starts = jnp.concatenate([true, differs], axis=1)  # sorted index opens a group of equal ids
    ends = jnp.concatenate([differs, true], axis=1)
    group_start = jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)
    group_end = jax.lax.cummin(jnp.where(ends, pos, T - 1), axis=1, reverse=True)
    rows = jnp.arange(B)[:, None]
    first = jnp.zeros_like(seg).at[rows, order].set(jnp.take_along_axis(order, group_start, axis=1))
    last = jnp.zeros_like(seg).at[rows, order].set(jnp.take_along_axis(order, group_end, axis=1))
    kv_lo = first.reshape(B, T // q_block, q_block).min(-1) // k_block
    q_hi = last.reshape(B, T // k_block, k_block).max(-1) // q_block + 1
    return kv_lo.astype(jnp.int32), q_hi.astype(jnp.int32)


def _pad_t(x, Tp, axis=1, value=0):
    T = x.shape[axis]
    if T == Tp:
        return x
    pads = [(0, 0)] * x.ndim
    pads[axis] = (0, Tp - T)
    return jnp.pad(x, pads, constant_values=value)


def _round_up(n, m):
    return -(-n // m) * m


def _diag_scores(q, kd, scale):
    """s[n,b,t,h] = q[b,t,h]·kd[n,b,t,h//G] * scale, in f32 ([n,B,T,Hkv,G])."""
    B, T, Hq, D = q.shape
    Hkv = kd.shape[3]
    qg = q.reshape(B, T, Hkv, Hq // Hkv, D)
    return jnp.einsum("btkgd,nbtkd->nbtkg", qg, kd, preferred_element_type=accum_dtype(q)) * scale


def merge_sinks(out, lse, sinks):
    """`out` [B,T,Hq,D] / `lse` [B,T,Hq] (f32) with one more logit per head, `sinks` [Hq], that has no
    value: the softmax's mass on the keys shrinks by exp(lse - lse'), lse' = logaddexp(lse, sink)."""
    if sinks is None:
        return out, lse
    new = jnp.logaddexp(lse, sinks.astype(lse.dtype)[None, None, :])
    return out * jnp.exp(lse - new)[..., None], new


def merge_diagonal(q, kd, vd, o0, lse0, scale):
    """Block 0's output o0 and lse0 merged with the diagonal keys kd / vd [n,B,T,Hkv,D] (the forward
    merge of the module docstring): (out f32 [B,T,Hq,D], lse f32 [B,T,Hq])."""
    B, T, Hq, D = q.shape
    if kd is None or kd.shape[0] == 0:
        return o0, lse0
    Hkv = kd.shape[3]
    G = Hq // Hkv
    sd = _diag_scores(q, kd, scale)  # [n,B,T,Hkv,G]
    l0 = lse0.reshape(B, T, Hkv, G)
    m = jnp.maximum(l0, jnp.max(sd, axis=0))
    lse = m + jnp.log(jnp.exp(l0 - m) + jnp.sum(jnp.exp(sd - m), axis=0))
    w0 = jnp.exp(l0 - lse)
    wd = jnp.exp(sd - lse)
    out = o0.reshape(B, T, Hkv, G, D) * w0[..., None] + jnp.einsum(
        "nbtkg,nbtkd->btkgd", wd, vd.astype(wd.dtype))
    return out.reshape(B, T, Hq, D), lse.reshape(B, T, Hq)


def diagonal_backward(q, kd, vd, do, lse, delta, scale):
    """The diagonal scores' share of the backward, from the final lse and delta: (dq [B,T,Hq,D], dkd,
    dvd [n,B,T,Hkv,D]) in the accumulation dtype."""
    B, T, Hq, D = q.shape
    Hkv = kd.shape[3]
    G = Hq // Hkv
    p = jnp.exp(_diag_scores(q, kd, scale) - lse.reshape(B, T, Hkv, G))  # [n,B,T,Hkv,G]
    acc = accum_dtype(q)
    dog = do.reshape(B, T, Hkv, G, D).astype(acc)
    dp = jnp.einsum("btkgd,nbtkd->nbtkg", dog, vd.astype(acc))
    ds = p * (dp - delta.reshape(B, T, Hkv, G)) * scale
    dq = jnp.einsum("nbtkg,nbtkd->btkgd", ds, kd.astype(acc)).reshape(B, T, Hq, D)
    dkd = jnp.einsum("nbtkg,btkgd->nbtkd", ds, q.reshape(B, T, Hkv, G, D).astype(acc))
    dvd = jnp.einsum("nbtkg,btkgd->nbtkd", p, dog)
    return dq, dkd, dvd


def _block0_fwd(be: Backend, q, k0, v0, seg, scale):
    T = q.shape[1]
    Tp = _round_up(T, be.multiple)
    o0, lse0 = be.fwd0(_pad_t(q, Tp), _pad_t(k0, Tp), _pad_t(v0, Tp), _pad_t(seg, Tp, value=-1), scale)
    return o0[:, :T], lse0[:, :T]


def _block0_bwd(be: Backend, q, k0, v0, seg, do, lse, delta, scale):
    T = q.shape[1]
    Tp = _round_up(T, be.multiple)
    p = functools.partial(_pad_t, Tp=Tp)
    # padded rows get a huge lse so that their probabilities are exactly 0 (and do = 0 there)
    dq, dk, dv = be.bwd0(p(q), p(k0), p(v0), p(seg, value=-1), p(do), p(lse, value=1e30), p(delta), scale)
    return dq[:, :T], dk[:, :T], dv[:, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 7))
def _ttt(be, q, k0, v0, kd, vd, seg, scale, sinks):
    out, _ = _ttt_fwd(be, q, k0, v0, kd, vd, seg, scale, sinks)
    return out


def _ttt_fwd(be, q, k0, v0, kd, vd, seg, scale, sinks):
    o0, lse0 = _block0_fwd(be, q, k0, v0, seg, scale)
    out, lse = merge_sinks(*merge_diagonal(q, kd, vd, o0, lse0, scale), sinks)
    out = out.astype(q.dtype)
    return out, (q, k0, v0, kd, vd, seg, out, lse, sinks)


def _ttt_bwd(be, scale, res, do):
    # With sinks the final lse holds them, so the keys' probabilities exp(s - lse) and the usual
    # dS = P (dP - delta) are exact; a sink has no value, so its own gradient is -sum(p_sink * delta).
    q, k0, v0, kd, vd, seg, out, lse, sinks = res
    # delta uses the output as returned (rounded to q.dtype), like FlashAttention-2
    acc = accum_dtype(q)
    delta = jnp.sum(do.astype(acc) * out.astype(acc), axis=-1)
    dq, dk0, dv0 = _block0_bwd(be, q, k0, v0, seg, do, lse, delta, scale)
    if kd is not None and kd.shape[0] > 0:
        dq_d, dkd, dvd = diagonal_backward(q, kd, vd, do, lse, delta, scale)
        dq = dq + dq_d
        dkd, dvd = dkd.astype(kd.dtype), dvd.astype(vd.dtype)
    else:
        dkd = None if kd is None else jnp.zeros_like(kd)
        dvd = None if vd is None else jnp.zeros_like(vd)
    dsinks = None
    if sinks is not None:
        p_sink = jnp.exp(sinks.astype(lse.dtype)[None, None, :] - lse)
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 1))).astype(sinks.dtype)
    return dq.astype(q.dtype), dk0.astype(k0.dtype), dv0.astype(v0.dtype), dkd, dvd, None, dsinks


_ttt.defvjp(_ttt_fwd, _ttt_bwd)


def ttt_attention_with(be: Backend, q, k0, v0, kd=None, vd=None, seg=None, scale=None, sinks=None):
    """The full TTT attention (block 0 by `be`, diagonal merged here) with its custom VJP. `sinks`
    [Hq] (gpt-oss): one more logit per head in every row's softmax denominator, with no value."""
    check_inputs(q, k0, v0, kd, vd, seg)
    B, T, Hq, D = q.shape
    scale = float(D**-0.5 if scale is None else scale)
    if seg is None:
        seg = jnp.zeros((B, T), jnp.int32)
    if sinks is not None and jnp.shape(sinks) != (Hq,):
        raise ValueError(f"sinks must be [Hq] = [{Hq}], got {jnp.shape(sinks)}")
    return _ttt(be, q, k0, v0, kd, vd, seg.astype(jnp.int32), scale, sinks)

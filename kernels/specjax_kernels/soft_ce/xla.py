"""`xla` soft-CE: a lax.scan over vocab tiles with an online max/LSE for the draft and the teacher.

Forward per tile: d = h @ W_tile.T (f32 accumulation), t = teacher tile; running (m_d, l_d),
(m_t, l_t), s = sum exp(t - m_t) * d (rescaled with m_t), and the running argmax of d.
Backward per tile: the same logits again, dd = g * (exp(d - lse_d) - exp(t - lse_t)) in the
input dtype, dh += dd @ W_tile, dW_tile = dd.T @ h. Live memory is one [N, tile] block, never
[N, Vd] in f32 (the gradient w.r.t. given logits is [N, Vd] by definition, in their dtype).
`softcap` c (the fused op only): the logits computed here, the draft's and a teacher given as
hidden states, are c * tanh(logits / c) (a target's final-logit soft-cap: EAGLE-1 scores with the
target's own head); the backward multiplies dd by the cap's derivative 1 - (d / c)^2.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.soft_ce.common import Backend, fused_with

DEFAULT_VOCAB_BLOCK = 4096
NEG = -1.0e30


def pick_block(V, target):
    """A tile size dividing V (no padding copy) when one in [target/4, target] exists, else target."""
    if V <= target:
        return V
    for step in (128, 8, 1):
        for b in range(target - target % step, max(target // 4, 1) - 1, -step):
            if b > 0 and V % b == 0:
                return b
    return target


def _pad_rows(x, Vp):  # [V, ...] -> [Vp, ...]
    return x if x.shape[0] == Vp else jnp.pad(x, [(0, Vp - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _pad_cols(x, Vp):  # [N, V] -> [N, Vp]
    return x if x.shape[1] == Vp else jnp.pad(x, [(0, 0), (0, Vp - x.shape[1])])


def _cap(x, softcap):
    return x if softcap is None else softcap * jnp.tanh(x / softcap)


def _tiles(h, w, t, th, tw, bv, softcap=None):
    """Closures producing (d, t) f32 tiles [N, bv] (fp64 for fp64 inputs) for tile index c, with
    columns >= V set to NEG; `softcap` caps the logits computed from hidden states."""
    acc = accum_dtype(h, t, th)
    V = (w if w is not None else t).shape[0 if w is not None else 1]
    nV = -(-V // bv)
    Vp = nV * bv
    w = None if w is None else _pad_rows(w, Vp)
    tw = None if tw is None else _pad_rows(tw, Vp)
    t = None if t is None else _pad_cols(t, Vp)

    def draft(c, d_given=None):
        if d_given is not None:
            d = lax.dynamic_slice_in_dim(d_given, c * bv, bv, axis=1).astype(acc)
        else:
            d = _cap(jnp.einsum("nh,vh->nv", h, lax.dynamic_slice_in_dim(w, c * bv, bv), preferred_element_type=acc),
                     softcap)
        return d

    def teacher(c):
        if t is not None:
            return lax.dynamic_slice_in_dim(t, c * bv, bv, axis=1).astype(acc)
        return _cap(jnp.einsum("nh,vh->nv", th, lax.dynamic_slice_in_dim(tw, c * bv, bv), preferred_element_type=acc),
                    softcap)

    def valid(c):
        return (c * bv + jnp.arange(bv)) < V

    return draft, teacher, valid, nV, Vp, w


def _stats_scan(N, draft, teacher, valid, nV, bv, acc):
    def body(carry, c):
        md, ld, mt, lt, s, bval, bidx = carry
        ok = valid(c)[None, :]
        d = jnp.where(ok, draft(c), NEG)
        t = jnp.where(ok, teacher(c), NEG)
        md_new = jnp.maximum(md, d.max(1))
        ld = ld * jnp.exp(md - md_new) + jnp.exp(d - md_new[:, None]).sum(1)
        mt_new = jnp.maximum(mt, t.max(1))
        a = jnp.exp(mt - mt_new)
        pt = jnp.exp(t - mt_new[:, None])
        s = s * a + jnp.sum(jnp.where(ok, pt * d, 0.0), 1)
        lt = lt * a + pt.sum(1)
        i = jnp.argmax(d, 1)
        v = jnp.take_along_axis(d, i[:, None], 1)[:, 0]
        better = v > bval  # strict: an earlier tile wins ties, as a global argmax does
        return (md_new, ld, mt_new, lt, s, jnp.where(better, v, bval),
                jnp.where(better, c * bv + i, bidx).astype(jnp.int32)), None

    z = jnp.zeros((N,), acc)
    init = (z + NEG, z, z + NEG, z, z, z - jnp.inf, jnp.zeros((N,), jnp.int32))
    (md, ld, mt, lt, s, _, idx), _ = lax.scan(body, init, jnp.arange(nV))
    return md + jnp.log(ld), mt + jnp.log(lt), s / lt, idx


def stats(h, w, t, th, tw, *, block, softcap=None):
    bv = pick_block(w.shape[0], block)
    draft, teacher, valid, nV, _, _ = _tiles(h, w, t, th, tw, bv, softcap)
    return _stats_scan(h.shape[0], draft, teacher, valid, nV, bv, accum_dtype(h, t, th))


def grads(h, w, t, th, tw, g, lse_d, lse_t, *, block, softcap=None):
    V, H = w.shape
    bv = pick_block(V, block)
    draft, teacher, valid, nV, Vp, wp = _tiles(h, w, t, th, tw, bv, softcap)
    acc = accum_dtype(h, t, th)

    def body(dh, c):
        ok = valid(c)[None, :]
        d = draft(c)
        p_d = jnp.exp(d - lse_d[:, None])
        p_t = jnp.exp(teacher(c) - lse_t[:, None])
        dd = g[:, None] * (p_d - p_t)
        if softcap is not None:  # d = c tanh(z / c): dd/dz = dd * (1 - (d / c)^2)
            dd = dd * (1.0 - jnp.square(d / softcap))
        dd = jnp.where(ok, dd, 0.0).astype(h.dtype)
        wc = lax.dynamic_slice_in_dim(wp, c * bv, bv)
        dh = dh + jnp.einsum("nv,vh->nh", dd, wc, preferred_element_type=acc)
        dw = jnp.einsum("nv,nh->vh", dd, h, preferred_element_type=acc)
        return dh, dw

    dh, dw = lax.scan(body, jnp.zeros(h.shape, acc), jnp.arange(nV))
    return dh, dw.reshape(Vp, H)[:V]


@functools.lru_cache(maxsize=None)
def backend(block: int = DEFAULT_VOCAB_BLOCK, softcap: float | None = None) -> Backend:
    return Backend("xla", functools.partial(stats, block=block, softcap=softcap),
                   functools.partial(grads, block=block, softcap=softcap))


def fused_linear_soft_ce(hidden, lm_head, teacher_logits=None, teacher_hidden=None, teacher_head=None, mask=None,
                         *, vocab_block=None, softcap=None):
    return fused_with(backend(vocab_block or DEFAULT_VOCAB_BLOCK, softcap), hidden, lm_head, teacher_logits,
                      teacher_hidden, teacher_head, mask)


# ---- the logits API: soft_cross_entropy(draft_logits, teacher_logits), vocab-tiled with a custom VJP ----

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _soft_ce_logits(d, t, bv):
    return _soft_ce_logits_fwd(d, t, bv)[0]


def _soft_ce_logits_fwd(d, t, bv):
    draft, teacher, valid, nV, _, _ = _tiles(None, None, t, None, None, bv)
    dp = _pad_cols(d, nV * bv)
    lse_d, lse_t, spd, _ = _stats_scan(d.shape[0], functools.partial(draft, d_given=dp), teacher, valid, nV, bv,
                                       accum_dtype(d, t))
    return lse_d - spd, (d, t, lse_d, lse_t)


def _soft_ce_logits_bwd(bv, res, g):
    d, t, lse_d, lse_t = res
    N, V = d.shape
    draft, teacher, valid, nV, Vp, _ = _tiles(None, None, t, None, None, bv)
    dp = _pad_cols(d, Vp)

    def body(_, c):
        p_d = jnp.exp(draft(c, d_given=dp) - lse_d[:, None])
        return None, (g[:, None].astype(accum_dtype(d, t)) * (p_d - jnp.exp(teacher(c) - lse_t[:, None]))).astype(d.dtype)

    _, dd = lax.scan(body, None, jnp.arange(nV))  # [nV, N, bv]
    dd = dd.transpose(1, 0, 2).reshape(N, Vp)[:, :V]
    return dd, None


_soft_ce_logits.defvjp(_soft_ce_logits_fwd, _soft_ce_logits_bwd)


def soft_cross_entropy(draft_logits, teacher_logits, *, vocab_block=None):
    """[..., Vd] x [..., Vd] -> [...] f32 (see reference.py)."""
    if draft_logits.shape != teacher_logits.shape:
        raise ValueError(f"draft {draft_logits.shape} and teacher {teacher_logits.shape} logits must match.")
    lead, V = draft_logits.shape[:-1], draft_logits.shape[-1]
    bv = pick_block(V, vocab_block or DEFAULT_VOCAB_BLOCK)
    loss = _soft_ce_logits(draft_logits.reshape(-1, V), jax.lax.stop_gradient(teacher_logits).reshape(-1, V), bv)
    return loss.reshape(lead)

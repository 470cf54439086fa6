"""`pallas_gpu` decode attention: one program per (row, kv head) reads the layer's K/V straight from
the stacked cache, block by block up to the row's `limit`, with an online softmax.

Why a kernel: in XLA the layer's K/V row of the [L,B,S,K,H] cache is first sliced out of the loop-
carried cache (a copy), then transposed so (row, kv head) lead for the batched GEMM (another copy),
and every slot of the static cache is read whether it is live or not. Here each K/V element of the
live prefix is read once. The G query heads x T chunk tokens of a kv head are the rows of one tile
(padded to 16, the smallest Triton dot); that is what makes it a decode kernel: `supports` limits
it to G*T <= MAX_ROWS, and longer chunks (a prefill) take the XLA path.

The cache may carry one leading batch axis of its own ([V,L,B,S,K,H]): that is how a vmapped
decoder (SpecLoop vmaps rows) calls it without copying the cache apart per member.

Split-K (`splits` > 1, the `pallas_gpu_split` implementation): the grid is (row, kv head) only, 24
programs at batch 8 with 3 kv heads (3 at batch 1), each walking its row's live blocks one after the
other; on a GPU with 132 SMs that is bound by one program's latency. A third grid axis gives each
program a share of the live blocks; each writes its partial softmax state (acc, max, sum) and one XLA
fusion merges them, the same fusion that cuts the padded rows. Not the default until a GPU run times it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax_kernels._pallas_gpu import compiler_params, dot_nt, mm

f32 = jnp.float32
MASK = -1.0e30
MAX_ROWS = 128  # G * T of one kv head; more (a prefill chunk) goes to the XLA path
BLOCK_S = 64


def _rows_padded(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())


def supports(q_shape, cache_shape) -> str | None:
    """None when the kernel takes this call, else why not."""
    _, t, n, h = q_shape
    s, kv = cache_shape[-3], cache_shape[-2]
    if t * (n // kv) > MAX_ROWS:
        return f"{t * (n // kv)} query rows per kv head > {MAX_ROWS} (a prefill chunk)"
    if h < 16 or h & (h - 1):
        return f"head_dim {h} is not a power of two >= 16"
    if s % BLOCK_S:
        return f"cache length {s} is not a multiple of {BLOCK_S}"
    return None


def _attend_blocks(q, mask_ref, k_ref, v_ref, v_i, layer, b, kh, lo, hi, *, scale, bs):
    """Online softmax of the tile's rows q [Rp, H] over key blocks lo..hi-1 of (member, layer, row, kv
    head): (unnormalised acc [Rp, H], running max m [Rp], running sum l [Rp]), all f32."""
    def body(j, carry):
        acc, m, l = carry
        k = k_ref[v_i, layer, b, pl.ds(j * bs, bs), kh, :]
        v = v_ref[v_i, layer, b, pl.ds(j * bs, bs), kh, :]
        s = dot_nt(q, k.astype(q.dtype)) * scale
        s = jnp.where(mask_ref[:, pl.ds(j * bs, bs)] != 0, s, MASK)  # [Rp or 1, bs] -> [Rp, bs]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + mm(p.astype(q.dtype), v.astype(q.dtype))
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    r = q.shape[0]
    return lax.fori_loop(lo, hi, body, (jnp.zeros(q.shape, f32), jnp.full((r,), MASK, f32), jnp.zeros((r,), f32)))


def _kernel(layer_ref, limit_ref, q_ref, mask_ref, k_ref, v_ref, o_ref, *, nb, scale, bs):
    vb, kh = pl.program_id(0), pl.program_id(1)
    n_blocks = (limit_ref[vb] + bs - 1) // bs
    acc, _, l = _attend_blocks(q_ref[...], mask_ref, k_ref, v_ref, vb // nb, layer_ref[0], vb % nb, kh, 0, n_blocks,
                               scale=scale, bs=bs)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def _split_kernel(layer_ref, limit_ref, q_ref, mask_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, nb, scale, bs,
                  splits):
    """Split-K: program (row, kv head, split) takes its share of the row's live key blocks and writes its
    partial softmax state; `_combine` merges the splits. A split past the live blocks writes the empty state
    (m = MASK, l = 0), which the merge weighs by exp(MASK - max) = 0."""
    vb, kh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n_blocks = (limit_ref[vb] + bs - 1) // bs
    per = (n_blocks + splits - 1) // splits
    lo = sp * per
    acc, m, l = _attend_blocks(q_ref[...], mask_ref, k_ref, v_ref, vb // nb, layer_ref[0], vb % nb, kh, lo,
                               jnp.minimum(lo + per, n_blocks), scale=scale, bs=bs)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _combine(acc, m, l):
    """[..., NS, Rp, H], [..., NS, Rp] x 2 -> [..., Rp, H]: the splits' partial softmax states merged."""
    w = jnp.exp(m - jnp.max(m, axis=-2, keepdims=True))
    return jnp.sum(acc * w[..., None], axis=-3) / jnp.sum(l * w, axis=-2)[..., None]


def mask_rows(mask, group: int):
    """The kernel's mask operand for a chunk's bool mask [..., T, S] and G = `group` query heads per kv
    head: int8 [..., Rm, S] whose row t*G+g is mask row t, padded to the tile (Rm = Rp); for one token
    (T = 1) its single row, which the kernel broadcasts over the G rows (Rm = 1, no copy Rp x the
    bytes). Every layer of a chunk reads the same operand: `api.prepare_mask` builds it once per chunk,
    outside the layer loop."""
    t, s = mask.shape[-2], mask.shape[-1]
    m = mask.astype(jnp.int8)
    if t == 1:
        return m
    r = t * group
    m = jnp.repeat(m, group, axis=-2)  # row t*G+g <- mask row t
    return jnp.pad(m, [(0, 0)] * (m.ndim - 2) + [(0, _rows_padded(r) - r), (0, 0)])


def decode_attention_stacked(q, k_cache, v_cache, layer, mask, limit, scale, *, interpret=False, rows=False,
                             splits=1):
    """q [V,B,T,N,H], caches [V,L,B,S,K,H], layer [], mask [V,B,T,S] bool (or, with `rows`, already
    `mask_rows`' [V,B,Rm,S]), limit [V,B] -> [V,B,T,N,H]. `splits` > 1: split-K (at most one split per
    key block of the cache)."""
    V, B, T, N, H = q.shape
    S, K = k_cache.shape[3], k_cache.shape[4]
    G = N // K
    R = T * G
    Rp = _rows_padded(R)
    # rows of kv head k: (t, g) -> t * G + g; padded rows see nothing useful and are cut below
    qr = q.reshape(V * B, T, K, G, H).transpose(0, 2, 1, 3, 4).reshape(V * B, K, R, H)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
    mr = mask if rows else mask_rows(mask, G)
    Rm = mr.shape[-2]
    if mr.shape != (V, B, Rm, S) or Rm not in (1, Rp) or (Rm == 1) != (T == 1):
        raise ValueError(f"decode_attention: mask rows {mr.shape} do not fit a chunk of {T} tokens x {G} query "
                         f"heads per kv head (want [{V}, {B}, {1 if T == 1 else Rp}, {S}]; build them with mask_rows)")
    mr = mr.reshape(V * B, Rm, S)
    lim = jnp.clip(limit.reshape(V * B).astype(jnp.int32), 1, S)
    whole = pl.BlockSpec()  # the whole stacked cache: the kernel indexes (member, layer, row, slots, kv head) itself
    kw = {} if interpret else {"compiler_params": compiler_params(4, 2)}
    args = (jnp.reshape(layer, (1,)).astype(jnp.int32), lim, qr, mr, k_cache, v_cache)
    splits = max(1, min(int(splits), S // BLOCK_S))
    if splits == 1:
        out = pl.pallas_call(
            functools.partial(_kernel, nb=B, scale=float(scale), bs=BLOCK_S), grid=(V * B, K),
            in_specs=[pl.BlockSpec((1,), lambda i, k: (0,)),
                      pl.BlockSpec((V * B,), lambda i, k: (0,)),
                      pl.BlockSpec((None, None, Rp, H), lambda i, k: (i, k, 0, 0)),
                      pl.BlockSpec((None, Rm, S), lambda i, k: (i, 0, 0)),
                      whole, whole],
            out_specs=pl.BlockSpec((None, None, Rp, H), lambda i, k: (i, k, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((V * B, K, Rp, H), q.dtype),
            interpret=interpret, name="decode_attention", **kw,
        )(*args)
    else:
        acc, m, l = pl.pallas_call(
            functools.partial(_split_kernel, nb=B, scale=float(scale), bs=BLOCK_S, splits=splits),
            grid=(V * B, K, splits),
            in_specs=[pl.BlockSpec((1,), lambda i, k, s: (0,)),
                      pl.BlockSpec((V * B,), lambda i, k, s: (0,)),
                      pl.BlockSpec((None, None, Rp, H), lambda i, k, s: (i, k, 0, 0)),
                      pl.BlockSpec((None, Rm, S), lambda i, k, s: (i, 0, 0)),
                      whole, whole],
            out_specs=[pl.BlockSpec((None, None, None, Rp, H), lambda i, k, s: (i, k, s, 0, 0)),
                       pl.BlockSpec((None, None, None, Rp), lambda i, k, s: (i, k, s, 0)),
                       pl.BlockSpec((None, None, None, Rp), lambda i, k, s: (i, k, s, 0))],
            out_shape=[jax.ShapeDtypeStruct((V * B, K, splits, Rp, H), f32),
                       jax.ShapeDtypeStruct((V * B, K, splits, Rp), f32),
                       jax.ShapeDtypeStruct((V * B, K, splits, Rp), f32)],
            interpret=interpret, name="decode_attention_split", **kw,
        )(*args)
        out = _combine(acc, m, l).astype(q.dtype)
    out = out[:, :, :R].reshape(V * B, K, T, G, H).transpose(0, 2, 1, 3, 4)
    return out.reshape(V, B, T, N, H)


@functools.lru_cache(maxsize=None)
def _batched(scale: float, interpret: bool, rows: bool, splits: int):
    """The [L,B,S,K,H] call with a vmap rule that folds the vmapped axis into the kernel's leading V."""
    @jax.custom_batching.custom_vmap
    def call(q, k_cache, v_cache, layer, mask, limit):
        return decode_attention_stacked(q[None], k_cache[None], v_cache[None], layer, mask[None], limit[None],
                                        scale, interpret=interpret, rows=rows, splits=splits)[0]

    @call.def_vmap
    def _rule(axis_size, in_batched, q, k_cache, v_cache, layer, mask, limit):
        if in_batched[3]:  # one layer per member: no shared cache walk; run them one by one
            out = jax.lax.map(lambda a: call(*a), (
                *(x if bt else jnp.broadcast_to(x, (axis_size, *x.shape))
                  for x, bt in zip((q, k_cache, v_cache, layer, mask, limit), in_batched)),))
            return out, True

        def lead(x, bt):
            return x if bt else jnp.broadcast_to(x, (axis_size, *x.shape))
        if not (in_batched[1] and in_batched[2]):  # a shared cache: broadcasting it would copy it per member
            k_cache, v_cache = lead(k_cache, in_batched[1]), lead(v_cache, in_batched[2])
        out = decode_attention_stacked(lead(q, in_batched[0]), k_cache, v_cache, layer, lead(mask, in_batched[4]),
                                       lead(limit, in_batched[5]), scale, interpret=interpret, rows=rows,
                                       splits=splits)
        return out, True

    return call


def decode_attention(q, k_cache, v_cache, layer, mask, limit, scale, *, interpret=False, rows=False, splits=1):
    """mask: bool [B,T,S], or with `rows` the [B,Rm,S] operand `mask_rows` made from it; `splits` > 1:
    split-K over the live key blocks (see module docstring)."""
    return _batched(float(scale), bool(interpret), bool(rows), int(splits))(
        q, k_cache, v_cache, jnp.asarray(layer, jnp.int32), mask, jnp.asarray(limit, jnp.int32))

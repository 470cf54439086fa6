"""Mamba-2 mixer for frozen targets (forward only), numerics as transformers' NemotronHMamba2Mixer.

    zxbcdt = x @ in_proj                       split [z: I | xBC: I + 2GN | dt: H]   (that order)
    xBC    = silu(causal depthwise conv1d(xBC) + conv bias)       kernel K (4) over time
    x, B, C = split(xBC, [I, GN, GN])          x -> [H, P] heads, B/C -> [G, N] groups
    dt     = clamp(softplus(dt + dt_bias), *dt_limit);  A = -exp(A_log)
    y      = SSD scan(x, dt, A, B, C) + D * x           (specjax_kernels.ssd, fp32)
    y      = grouped gated RMSNorm(y, z): (y * silu(z)) normalised per group of I / n_groups
             channels, times the weight (fp32), cast to the model dtype
    out    = y @ out_proj
with I = num_heads * head_dim. ``dt_limit`` is the config's ``time_step_limit`` (default (0, inf): no
clamp), as in mamba_ssm, vLLM and transformers >= 5.25; transformers <= 5.24 clamped at
(time_step_min, inf) instead, a bug it inherited from Zamba2's slow path.

Packed sequences: ``segment_ids`` [B, T] (0 = padding, its own segment). The conv window and the SSM
state both restart where the id changes, so each packed document sees exactly what it would see if
run alone (taps from the previous document are treated as zero padding).

Params (x@W layout): in_proj.kernel [D, I+conv_dim+H], conv1d.kernel [K, 1, conv_dim] (HF
[conv_dim, 1, K] transposed), conv1d.bias [conv_dim] (optional), dt_bias/A_log/D [H],
norm.scale [I], out_proj.kernel [I, D].
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from specjax import mesh as meshlib
from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.ssd import ssd
from specjax_kernels.ssd.context_parallel import previous_shard, ssd_context_parallel


@dataclasses.dataclass(frozen=True)
class Mamba2Dims:
    """Static shape/numerics of one Mamba-2 mixer (hashable; closed over by jitted code)."""

    num_heads: int  # H
    head_dim: int  # P
    n_groups: int  # G (B/C groups; also the gated-norm groups)
    state_size: int  # N
    conv_kernel: int = 4  # K
    chunk_size: int = 128  # SSD chunk length (xla implementation)
    eps: float = 1e-5  # gated RMSNorm epsilon
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    ssd_implementation: Optional[str] = None  # None/"auto" | "reference" | "xla"

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        return self.intermediate_size + self.conv_dim + self.num_heads

    def validate(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"mamba_num_heads={self.num_heads} must be a multiple of n_groups={self.n_groups} "
                "(each group of B/C serves num_heads / n_groups heads)"
            )
        if self.conv_kernel < 1 or self.chunk_size < 1:
            raise ValueError(f"conv_kernel={self.conv_kernel} and chunk_size={self.chunk_size} must be >= 1")


def causal_depthwise_conv1d(x_btc, kernel_kc, bias_c=None, segment_ids_bt=None):
    """out[t] = bias + sum_j kernel[K-1-j] * x[t-j], j = 0..K-1; taps before t = 0 or in an earlier
    segment count as zero. Accumulates in fp32 (fp64 for fp64 x), returns x's dtype (HF runs the conv
    in the weight dtype)."""
    k = kernel_kc.shape[0]
    acc = accum_dtype(x_btc)
    x32 = x_btc.astype(acc)
    w = kernel_kc.astype(acc)
    out = x32 * w[k - 1]
    for j in range(1, min(k, x_btc.shape[1] + 1)):
        shifted = jnp.pad(x32, [(0, 0), (j, 0), (0, 0)])[:, : x_btc.shape[1]]
        if segment_ids_bt is not None:
            prev = jnp.pad(segment_ids_bt, [(0, 0), (j, 0)], constant_values=-1)[:, : x_btc.shape[1]]
            shifted = jnp.where((prev == segment_ids_bt)[..., None], shifted, 0.0)
        out = out + shifted * w[k - 1 - j]
    if bias_c is not None:
        out = out + bias_c.astype(acc)
    return out.astype(x_btc.dtype)


def gated_group_rms_norm(y, z, scale, n_groups: int, eps: float, out_dtype):
    """(y * silu(z)) RMS-normalised over each of ``n_groups`` contiguous channel groups, times the
    weight; all fp32 (HF's scan output is fp32; fp64 when y or z is fp64), then cast to ``out_dtype``."""
    acc = accum_dtype(y, z)
    h = y.astype(acc) * jax.nn.silu(z.astype(acc))
    shape = h.shape
    hg = h.reshape(shape[:-1] + (n_groups, shape[-1] // n_groups))
    hg = hg * jax.lax.rsqrt(jnp.mean(jnp.square(hg), axis=-1, keepdims=True) + eps)
    return (scale.astype(acc) * hg.reshape(shape)).astype(out_dtype)


def mamba2_mixer(p: dict, dims: Mamba2Dims, x_btd, segment_ids_bt=None):
    """One Mamba-2 mixer (no residual, no pre-norm). x [B, T, D] -> [B, T, D] in x's dtype."""
    b, t, _ = x_btd.shape
    i_size, h, n, g = dims.intermediate_size, dims.num_heads, dims.state_size, dims.n_groups
    zxbcdt = x_btd @ p["in_proj"]["kernel"]
    z = zxbcdt[..., :i_size]
    xbc = zxbcdt[..., i_size : i_size + dims.conv_dim]
    dt = zxbcdt[..., i_size + dims.conv_dim :]

    conv = p["conv1d"]
    kernel = conv["kernel"].reshape(dims.conv_kernel, dims.conv_dim)
    cp_mesh = meshlib.context_mesh()
    if cp_mesh is not None:
        meshlib.check_context_divides(t, cp_mesh, "Mamba-2 mixer")
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones((b, t), jnp.int32)
        xbc = jax.nn.silu(_conv1d_context_parallel(xbc, kernel, conv.get("bias"), segment_ids_bt, cp_mesh))
    else:
        xbc = jax.nn.silu(causal_depthwise_conv1d(xbc, kernel, conv.get("bias"), segment_ids_bt))
    xs = xbc[..., :i_size].reshape(b, t, h, dims.head_dim)
    bm = xbc[..., i_size : i_size + g * n].reshape(b, t, g, n)
    cm = xbc[..., i_size + g * n :].reshape(b, t, g, n)

    acc = accum_dtype(x_btd)  # fp32 (fp64 for fp64 inputs: the tests' exact references)
    dt = jax.nn.softplus(dt.astype(acc) + p["dt_bias"].astype(acc))
    lo, hi = dims.dt_limit
    dt = jnp.clip(dt, lo, hi)
    a = -jnp.exp(p["A_log"].astype(acc))
    if cp_mesh is not None:
        y = ssd_context_parallel(xs, dt, a, bm, cm, D=p["D"], chunk_size=dims.chunk_size,
                                 segment_ids=segment_ids_bt, mesh=cp_mesh, axis=meshlib.CONTEXT_AXIS,
                                 batch_spec=_batch_axes(b, cp_mesh), implementation=dims.ssd_implementation)
    else:
        y = ssd(xs, dt, a, bm, cm, D=p["D"], chunk_size=dims.chunk_size, segment_ids=segment_ids_bt,
                implementation=dims.ssd_implementation)
    y = gated_group_rms_norm(y.reshape(b, t, i_size), z, p["norm"]["scale"], g, dims.eps, x_btd.dtype)
    return y @ p["out_proj"]["kernel"]


def _batch_axes(batch: int, mesh):
    return meshlib.spec_for((batch,), ("batch",), mesh)[0]


def _conv1d_context_parallel(x_btc, kernel_kc, bias_c, segment_ids_bt, mesh):
    """The causal conv with T split over `context`: each shard prepends a halo of the previous
    shard's last K-1 rows (and their segment ids; shard 0 gets ids -1, i.e. nothing before t = 0),
    convolves locally and drops the halo rows. Exact: the window of row t only reaches t-K+1."""
    k = kernel_kc.shape[0]
    axis, n = meshlib.CONTEXT_AXIS, mesh.shape[meshlib.CONTEXT_AXIS]
    t_local = x_btc.shape[1] // n
    if k > 1 and t_local < k - 1:
        raise ValueError(f"Mamba-2 conv1d under context parallelism: each of the {n} shards holds {t_local} "
                         f"rows, fewer than the conv halo {k - 1}; use a longer sequence or lower context.")
    bs = _batch_axes(x_btc.shape[0], mesh)

    def body(x, w, seg, *bias):
        if k > 1:
            c = jax.lax.axis_index(axis)
            halo = previous_shard(x[:, t_local - (k - 1):], axis, n)
            halo_seg = jnp.where(c > 0, previous_shard(seg[:, t_local - (k - 1):], axis, n), -1)
            x = jnp.concatenate([halo, x], axis=1)
            seg = jnp.concatenate([halo_seg, seg], axis=1)
        out = causal_depthwise_conv1d(x, w, bias[0] if bias else None, seg)
        return out[:, out.shape[1] - t_local:]

    args = (x_btc, kernel_kc, segment_ids_bt) + ((bias_c,) if bias_c is not None else ())
    specs = (P(bs, axis), P(), P(bs, axis)) + ((P(),) if bias_c is not None else ())
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(bs, axis), check_vma=False)(*args)


# =============================================================================================
# Cached decoding (generation / speculative decoding): conv inputs per slot, SSM states per window
# =============================================================================================
# A chunk of T tokens is written at slots start[b].. like a KV-cache chunk (layers/attention.py
# "KV cache"), and rollback is again "the next chunk starts at a smaller slot":
#   conv   [B, S, conv_dim]: the pre-conv inputs (xBC) of every written slot. A row's conv window is
#          its own input and the inputs of its K-1 predecessors, read from the chunk (its ancestors
#          under the chunk mask) and then from slots start-1, start-2, ... Rolling back needs nothing.
#   states [B, W, H, P, N] fp32 and labels [B, W] int32 (shared by the layers): the SSM state after
#          slot labels[b, w] (-2 = empty). A chunk stores the state after each of its rows (and the
#          one it started from) in the window, so the next chunk starts from the state labelled
#          start-1 whatever the accepted length was. A chunk longer than the window (a prefill) keeps
#          the states after its ``logits_index`` rows (where a decoder continues) and its last rows.
#          Starting where no state was kept gives NaN, never a silently wrong state.
# In a chunk, row i continues from its parent (the nearest earlier row its chunk mask shows; none:
# the state before the chunk), so a tree chunk gives each node the state of its own root-to-node path.
# Slots before valid_from (left padding) count as zero inputs and a zero state.
EMPTY_LABEL = -2


@dataclasses.dataclass(frozen=True)
class DecodeChunk:
    """Per-chunk index arrays every Mamba layer of one ``decode_chunk`` call shares (see
    :func:`decode_chunk_plan`)."""

    tree: bool  # static: rows follow explicit parents (any chunk mask) instead of the previous row
    slots: jax.Array  # [B, T] write slots
    row_valid: jax.Array  # [B, T] slot >= valid_from
    prev_slots: jax.Array  # [B, K-1] slots start-K+1 .. start-1 (the conv taps before the chunk)
    prev_valid: jax.Array  # [B, K-1]
    taps: jax.Array  # [B, T, K] index into [prev rows, chunk rows] of tap j of row i (-1: zero)
    parent: jax.Array  # [B, T] chunk row of the parent, -1 = the state before the chunk
    parent_entry: jax.Array  # [B, T] window entry holding the parent's state (tree only)
    out_entry: jax.Array  # [B, T+1] window entry of the state after offset o (W = not kept)
    entry_index: jax.Array  # [B] window entry of the state after slot start-1
    entry_found: jax.Array  # [B]
    entry_zero: jax.Array  # [B] the chunk starts a sequence: zero state
    labels: jax.Array  # [B, W] the new window labels


def decode_chunk_plan(conv_kernel: int, labels_bw, start_b, chunk_mask_btt=None, valid_from_b=None,
                      logits_index=None, *, t: int) -> DecodeChunk:
    """The shared index arrays of a chunk of ``t`` rows at slots start[b].. (see the section comment).
    ``chunk_mask_btt`` None = causal (row i continues from row i-1)."""
    b, w = labels_bw.shape
    k = conv_kernel
    rows = jnp.arange(b)[:, None]
    i = jnp.arange(t, dtype=jnp.int32)
    slots = start_b[:, None] + i[None, :]
    vf = jnp.zeros((b,), jnp.int32) if valid_from_b is None else jnp.asarray(valid_from_b, jnp.int32).reshape(b)
    row_valid = slots >= vf[:, None]
    prev_slots = start_b[:, None] + jnp.arange(-(k - 1), 0, dtype=jnp.int32)[None, :]
    prev_valid = prev_slots >= jnp.maximum(vf, 0)[:, None]
    tree = chunk_mask_btt is not None
    if tree:
        if t > w:
            raise ValueError(f"a tree chunk of {t} rows needs decode_state_window >= {t} (got {w}): every "
                             "node's state must stay in the window for its children and the commit")
        m = jnp.asarray(chunk_mask_btt, bool) & (i[None, None, :] < i[None, :, None])
        parent = jnp.max(jnp.where(m, i[None, None, :], -1), axis=-1).astype(jnp.int32)
    else:
        parent = jnp.broadcast_to(i - 1, (b, t))
    # conv taps: ext rows = [K-1 rows before the chunk, the T chunk rows]; a row's predecessor in ext
    ext_parent = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(-1, k - 2, dtype=jnp.int32), (b, k - 1)),
         jnp.where(parent >= 0, parent + (k - 1), k - 2)], axis=1)  # [B, K-1+T]
    cur = jnp.broadcast_to(i + (k - 1), (b, t))
    taps = [cur]
    for _ in range(1, k):
        cur = jnp.where(cur >= 0, jnp.take_along_axis(ext_parent, jnp.maximum(cur, 0), axis=1), -1)
        taps.append(cur)
    taps = jnp.stack(taps, axis=-1)
    # which states the window keeps: offset o = the state after chunk row o-1 (o = 0: before the chunk)
    offsets = jnp.arange(t + 1, dtype=jnp.int32)
    if t + 1 <= w:
        out_entry = jnp.broadcast_to(offsets, (b, t + 1))
    else:
        n = 0 if (tree or logits_index is None) else int(logits_index.shape[1])
        if n > w:
            raise ValueError(f"logits_index asks for {n} rows but decode_state_window is {w}")
        tail = w - n  # the last `tail` offsets, after the logits rows' states
        lo = t + 1 - tail
        out_entry = jnp.broadcast_to(jnp.where(offsets >= lo, n + offsets - lo, w), (b, t + 1))
        if n:
            out_entry = out_entry.at[rows, jnp.asarray(logits_index, jnp.int32) + 1].set(
                jnp.arange(n, dtype=jnp.int32)[None, :], mode="drop")
    parent_entry = jnp.take_along_axis(out_entry, parent + 1, axis=1)
    new_labels = jnp.full((b, w), EMPTY_LABEL, jnp.int32).at[rows, out_entry].set(
        start_b[:, None] - 1 + offsets[None, :], mode="drop")
    match = labels_bw == (start_b - 1)[:, None]
    return DecodeChunk(
        tree=tree, slots=slots, row_valid=row_valid, prev_slots=prev_slots, prev_valid=prev_valid, taps=taps,
        parent=parent, parent_entry=parent_entry, out_entry=out_entry,
        entry_index=jnp.argmax(match, axis=1).astype(jnp.int32), entry_found=jnp.any(match, axis=1),
        entry_zero=(start_b <= 0) | (start_b <= vf), labels=new_labels)


def mamba2_decode(p: dict, dims: Mamba2Dims, x_btd, conv_bsc, states_bwhpn, plan: DecodeChunk):
    """One Mamba-2 mixer over a chunk with this layer's cache (conv inputs [B,S,C], state window
    [B,W,H,P,N]). Same math as :func:`mamba2_mixer` (the SSD as its sequential definition, per row's
    parent). Returns (out [B,T,D], new conv cache, new state window)."""
    b, t, _ = x_btd.shape
    i_size, h, n, g, k = dims.intermediate_size, dims.num_heads, dims.state_size, dims.n_groups, dims.conv_kernel
    f32 = jnp.float32
    rows = jnp.arange(b)
    zxbcdt = x_btd @ p["in_proj"]["kernel"]
    z = zxbcdt[..., :i_size]
    xbc = zxbcdt[..., i_size : i_size + dims.conv_dim]
    dt = zxbcdt[..., i_size + dims.conv_dim :]

    # conv over each row's own window (ancestors in the chunk, then the cached slots before it)
    xbc = jnp.where(plan.row_valid[..., None], xbc, jnp.zeros((), xbc.dtype))
    num_slots = conv_bsc.shape[1]
    prev = jnp.take_along_axis(conv_bsc, jnp.clip(plan.prev_slots, 0, num_slots - 1)[..., None], axis=1)
    prev = jnp.where(plan.prev_valid[..., None], prev, jnp.zeros((), prev.dtype)).astype(xbc.dtype)
    ext = jnp.concatenate([prev, xbc], axis=1).astype(f32)  # [B, K-1+T, C]
    conv = p["conv1d"]
    w = conv["kernel"].reshape(k, dims.conv_dim).astype(f32)
    out = None
    for j in range(k):
        src = plan.taps[..., j]
        v = jnp.where((src >= 0)[..., None], jnp.take_along_axis(ext, jnp.maximum(src, 0)[..., None], axis=1), 0.0)
        out = v * w[k - 1 - j] if out is None else out + v * w[k - 1 - j]
    if conv.get("bias") is not None:
        out = out + conv["bias"].astype(f32)
    new_conv = conv_bsc.at[rows[:, None], plan.slots].set(xbc.astype(conv_bsc.dtype), mode="drop")
    xbc = jax.nn.silu(out.astype(x_btd.dtype))
    xs = xbc[..., :i_size].reshape(b, t, h, dims.head_dim).astype(f32)
    bm = jnp.repeat(xbc[..., i_size : i_size + g * n].reshape(b, t, g, n).astype(f32), h // g, axis=2)
    cm = jnp.repeat(xbc[..., i_size + g * n :].reshape(b, t, g, n).astype(f32), h // g, axis=2)
    dt = jnp.clip(jax.nn.softplus(dt.astype(f32) + p["dt_bias"].astype(f32)), *dims.dt_limit)
    a = -jnp.exp(p["A_log"].astype(f32))

    # the state before the chunk: zero at a sequence start, the window's state labelled start-1, else NaN
    entry = states_bwhpn[rows, plan.entry_index].astype(f32)
    entry = jnp.where(plan.entry_found[:, None, None, None], entry, jnp.nan)
    entry = jnp.where(plan.entry_zero[:, None, None, None], 0.0, entry)
    win = jnp.zeros(states_bwhpn.shape, f32).at[rows, plan.out_entry[:, 0]].set(entry, mode="drop")

    def step(carry, inp):
        cur, win = carry
        x_t, dt_t, b_t, c_t, par_t, pent_t, valid_t, out_t = inp
        if plan.tree:
            prev_state = jnp.where((par_t >= 0)[:, None, None, None], win[rows, jnp.clip(pent_t, 0, win.shape[1] - 1)],
                                   entry)
        else:
            prev_state = cur
        decay = jnp.exp(dt_t * a)[:, :, None, None]
        state = prev_state * decay + (dt_t[:, :, None] * x_t)[..., None] * b_t[:, :, None, :]
        state = jnp.where(valid_t[:, None, None, None], state, 0.0)
        y_t = jnp.einsum("bhpn,bhn->bhp", state, c_t, precision=jax.lax.Precision.HIGHEST)
        win = win.at[rows, out_t].set(state, mode="drop")
        return (state, win), y_t

    seq = (xs, dt, bm, cm, plan.parent, plan.parent_entry, plan.row_valid, plan.out_entry[:, 1:])
    (_, win), ys = jax.lax.scan(step, (entry, win), [jnp.moveaxis(v, 1, 0) for v in seq])
    y = jnp.moveaxis(ys, 0, 1) + p["D"].astype(f32)[:, None] * xs
    y = gated_group_rms_norm(y.reshape(b, t, i_size), z, p["norm"]["scale"], g, dims.eps, x_btd.dtype)
    return y @ p["out_proj"]["kernel"], new_conv, win.astype(states_bwhpn.dtype)

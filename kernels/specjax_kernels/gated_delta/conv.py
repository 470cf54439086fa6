"""The short causal convolution in front of a Gated DeltaNet layer, and both pieces in cached-decoding
form (a chunk of new tokens continued from saved state, with per-row rollback).

Qwen3-Next / Qwen3.5 run a depthwise causal conv1d (kernel K = linear_conv_kernel_dim = 4, no bias)
over the concatenated [q | k | v] projections, then SiLU, then split q, k, v for the rule (Kimi
Linear's three convs, one each over q, k and v, are this one over their concatenation):

    out[t, c] = act(bias[c] + sum_{j=0}^{K-1} kernel[K-1-j, c] * x[t-j, c])

``kernel`` is [K, C] (transformers' Conv1d weight [C, 1, K] transposed: kernel[j, c] = w[c, 0, j]).
Taps before t = 0 read the conv state (the raw inputs of the K-1 positions before the chunk, oldest
first; zeros when there is none), and taps across a segment start count as zero, so a packed document
sees exactly what it would see alone. Accumulation is fp32 (fp64 for fp64 x); the sum is cast to x's
dtype before the activation (transformers runs the conv in the weight dtype, then the activation).

Cached decoding. A target verifying a chunk of T draft tokens keeps, per layer, the conv state
[B, K-1, C] (raw conv inputs) and the recurrent state [B, Hv, Dk, Dv] (fp32). After the chunk it knows
how many tokens each row accepted, and the state it continues from must be the state after exactly
those tokens. Two ways, both offered here:

  * ``valid_len`` [B] (rows of the chunk to keep, 0..T): the returned conv state and recurrent state
    are the ones after row valid_len-1 (valid_len = 0: the states the chunk started from). Use it when
    the accepted length is known before the call: re-running the accepted prefix from the states kept
    from before the chunk (rollback = re-run), or prefill of rows of unequal length.
  * ``return_states=True`` (recurrent rule) returns the state after every row, [B, T, Hv, Dk, Dv];
    the target picks row n-1 after verification (no re-run, at T times the state memory; that is
    what transformers' cache does with ``recurrent_states_to_keep``). The conv state after any row
    is cheap to rebuild from the conv inputs: call ``causal_conv1d_update`` again with that
    ``valid_len`` (or keep the chunk's raw inputs and slice).

Which to use: the per-row states avoid a second target pass and match how this repo's Mamba-2
decoder keeps a window of per-slot states; their cost is memory: at the Qwen3.5-35B-A3B shape one
layer's state is 32 x 128 x 128 fp32 = 2 MiB per row, so a chunk of 8 keeps 16 MiB per layer and
480 MiB per row over its 30 linear-attention layers (transient, inside the verify step). valid_len
needs no extra memory but a re-run of the accepted tokens.

``parent`` [B, T] (tree verification): row i continues from the state after row parent[i] (-1 = the
states before the chunk; parent[i] < i), both for the conv taps (the window follows the ancestors)
and for the recurrence, so each node sees exactly its root-to-node path. Without it a chunk is a
chain (parent[i] = i - 1). Rows a target wants to skip (left padding) should carry beta = 0 and
g = 0 (an identity step; every channel of a per-key-channel g) and zero conv inputs.

The recurrent step is the reference's own per-token math (reference.delta_rule_step), so decoding
token by token and the whole-sequence op agree to summation order. Forward only, jit-able.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.gated_delta.api import check_inputs
from specjax_kernels.gated_delta.reference import delta_rule_step, expand_heads, prepare_qk, segment_starts

ACTIVATIONS = {"silu": jax.nn.silu, "swish": jax.nn.silu, None: None}


def _activation(name):
    if name not in ACTIVATIONS:
        raise ValueError(f"causal conv1d: unknown activation {name!r}; choose one of "
                         f"{[a for a in ACTIVATIONS if a]} or None (Qwen3-Next's hidden_act is 'silu').")
    return ACTIVATIONS[name]


def _check_conv(x, kernel, bias, conv_state, what):
    if x.ndim != 3:
        raise ValueError(f"{what}: x must be [B, T, C], got shape {x.shape}")
    ch = x.shape[2]
    if kernel.ndim != 2 or kernel.shape[1] != ch:
        raise ValueError(f"{what}: kernel must be [K, C] with C = {ch} (transformers' Conv1d weight "
                         f"[C, 1, K] transposed), got {kernel.shape}")
    if bias is not None and bias.shape != (ch,):
        raise ValueError(f"{what}: bias must be [C] = ({ch},), got {bias.shape}")
    want = (x.shape[0], kernel.shape[0] - 1, ch)
    if conv_state is not None and conv_state.shape != want:
        raise ValueError(f"{what}: conv_state must be [B, K-1, C] = {want}, got {conv_state.shape}")


def causal_conv1d(x, kernel, bias=None, *, segment_ids=None, conv_state=None, activation="silu",
                  return_conv_state: bool = False):
    """Segment-aware causal depthwise conv over a sequence. x [B, T, C] -> [B, T, C] in x's dtype.
    ``conv_state`` [B, K-1, C]: the inputs before t = 0 (they reach the first segment only).
    ``return_conv_state``: also the conv state to continue the last segment from, [B, K-1, C] in x's
    dtype (the last K-1 inputs of that segment, zeros where it is shorter)."""
    _check_conv(x, kernel, bias, conv_state, "causal_conv1d")
    act = _activation(activation)
    bsz, t, ch = x.shape
    kk = kernel.shape[0]
    acc = accum_dtype(x)
    prev = jnp.zeros((bsz, kk - 1, ch), acc) if conv_state is None else conv_state.astype(acc)
    ext = jnp.concatenate([prev, x.astype(acc)], axis=1)  # [B, K-1+T, C]; row e is time e-(K-1)
    run = jnp.cumsum(segment_starts(segment_ids, (bsz, t)).astype(jnp.int32), axis=1)
    ext_run = jnp.concatenate([jnp.zeros((bsz, kk - 1), run.dtype), run], axis=1)  # state joins run 0
    w = kernel.astype(acc)
    out = jnp.zeros((bsz, t, ch), acc) if bias is None else jnp.broadcast_to(bias.astype(acc), (bsz, t, ch))
    for j in range(kk):  # tap j: x[t - j]
        lo = kk - 1 - j
        tap = jnp.where((ext_run[:, lo:lo + t] == run)[..., None], ext[:, lo:lo + t], 0.0)
        out = out + tap * w[kk - 1 - j]
    out = out.astype(x.dtype)
    if act is not None:
        out = act(out)
    if not return_conv_state:
        return out
    tail = ext[:, t:]  # the last K-1 rows of ext
    tail = jnp.where((ext_run[:, t:] == run[:, -1:])[..., None], tail, 0.0)
    return out, tail.astype(x.dtype)


def _chunk_paths(parent, bsz: int, t: int, kk: int):
    """ext index (0..K-2: conv state rows, K-1+i: chunk row i; -1: nothing) of the j-th most recent
    input on the path that ends at chunk row i-1 (i = 0: the path before the chunk): [B, T+1, K]."""
    i = jnp.arange(t, dtype=jnp.int32)
    par = jnp.broadcast_to(i - 1, (bsz, t)) if parent is None else jnp.asarray(parent, jnp.int32)
    ext_parent = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(-1, kk - 2, dtype=jnp.int32), (bsz, kk - 1)),
         jnp.where(par >= 0, par + (kk - 1), kk - 2)], axis=1)  # [B, K-1+T]
    cur = jnp.broadcast_to(jnp.arange(kk - 2, kk - 1 + t, dtype=jnp.int32), (bsz, t + 1))
    taps = [cur]
    for _ in range(1, kk):
        cur = jnp.where(cur >= 0, jnp.take_along_axis(ext_parent, jnp.maximum(cur, 0), axis=1), -1)
        taps.append(cur)
    return jnp.stack(taps, axis=-1)


def _valid_len(valid_len, bsz, t):
    if valid_len is None:
        return jnp.full((bsz,), t, jnp.int32)
    vl = jnp.asarray(valid_len, jnp.int32)
    if vl.ndim == 0:
        vl = jnp.broadcast_to(vl, (bsz,))
    if vl.shape != (bsz,):
        raise ValueError(f"valid_len must be a scalar or [B] = ({bsz},), got shape {vl.shape}")
    return vl


def _nan_where_out_of_range(x, vl, t):
    """valid_len outside 0..T cannot raise under jit: its state comes back as NaN, never a wrong state."""
    bad = (vl < 0) | (vl > t)
    return jnp.where(bad.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.nan, x)


def _check_parent(parent, bsz, t):
    if parent is not None and jnp.shape(parent) != (bsz, t):
        raise ValueError(f"parent must be [B, T] = {(bsz, t)} (row i continues from row parent[i] < i, "
                         f"-1 = the state before the chunk), got shape {jnp.shape(parent)}")


def causal_conv1d_update(x, conv_state, kernel, bias=None, *, activation="silu", valid_len=None, parent=None):
    """A chunk of T new inputs continued from ``conv_state`` [B, K-1, C] (zeros at a sequence start).
    Returns (out [B, T, C] in x's dtype, the conv state after row valid_len-1 [B, K-1, C] in
    conv_state's dtype). ``valid_len`` [B] or scalar in 0..T (None = T; outside: a NaN state);
    ``parent`` [B, T] for tree chunks (see the module docstring)."""
    _check_conv(x, kernel, bias, conv_state, "causal_conv1d_update")
    if conv_state is None:
        raise ValueError("causal_conv1d_update: conv_state is required ([B, K-1, C]; zeros at a sequence start)")
    act = _activation(activation)
    bsz, t, ch = x.shape
    _check_parent(parent, bsz, t)
    kk = kernel.shape[0]
    acc = accum_dtype(x)
    vl = _valid_len(valid_len, bsz, t)
    ext = jnp.concatenate([conv_state.astype(acc), x.astype(acc)], axis=1)  # [B, K-1+T, C]
    paths = _chunk_paths(parent, bsz, t, kk)  # [B, T+1, K]

    def gather(idx):  # idx [B, n] -> [B, n, C], zeros for -1
        got = jnp.take_along_axis(ext, jnp.maximum(idx, 0)[..., None], axis=1)
        return jnp.where((idx >= 0)[..., None], got, 0.0)

    w = kernel.astype(acc)
    out = jnp.zeros((bsz, t, ch), acc) if bias is None else jnp.broadcast_to(bias.astype(acc), (bsz, t, ch))
    for j in range(kk):
        out = out + gather(paths[:, 1:, j]) * w[kk - 1 - j]
    out = out.astype(x.dtype)
    if act is not None:
        out = act(out)
    end = jnp.take_along_axis(paths, jnp.clip(vl, 0, t)[:, None, None], axis=1)[:, 0]  # [B, K]: path ending at row vl-1
    new_state = gather(end[:, kk - 2::-1] if kk > 1 else end[:, :0])  # oldest first
    new_state = _nan_where_out_of_range(new_state, vl, t)
    return out, new_state.astype(conv_state.dtype)


def gated_delta_rule_update(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm: bool = True,
                            valid_len=None, parent=None, return_states: bool = False):
    """The gated delta rule over a chunk of T new tokens continued from ``state`` [B, Hv, Dk, Dv] (shapes
    as api.gated_delta_rule, g per value head [B, T, Hv] or per key channel [B, T, Hv, Dk]; zeros at a
    sequence start). Returns (o [B, T, Hv, Dv] fp32, the state
    after row valid_len-1 [B, Hv, Dk, Dv] fp32) and, with ``return_states``, the state after every row
    [B, T, Hv, Dk, Dv] fp32. ``valid_len`` [B] or scalar in 0..T (None = T; outside: a NaN state);
    ``parent`` [B, T] for tree chunks (see the module docstring)."""
    if state is None:
        raise ValueError("gated_delta_rule_update: state is required ([B, Hv, Dk, Dv]; zeros at a sequence start)")
    check_inputs(q, k, v, g, beta, state, op="gated_delta_rule_update")
    bsz, t, hv, dv = v.shape
    _check_parent(parent, bsz, t)
    acc = accum_dtype(q, k, v, g, beta, state)
    vl = _valid_len(valid_len, bsz, t)
    q, k = prepare_qk(q, k, acc, scale=scale, use_qk_l2norm=use_qk_l2norm)
    seq = [expand_heads(q, hv), expand_heads(k, hv), v.astype(acc), g.astype(acc), beta.astype(acc)]
    seq = [jnp.moveaxis(x, 1, 0) for x in seq]
    rows = jnp.arange(t, dtype=jnp.int32)
    state = state.astype(acc)

    if parent is None:
        def step(carry, inp):
            s, after = carry
            i, q_t, k_t, v_t, g_t, b_t = inp
            s, o = delta_rule_step(s, q_t, k_t, v_t, g_t, b_t)
            after = jnp.where((vl == i + 1)[:, None, None, None], s, after)
            return (s, after), ((o, s) if return_states else (o, None))

        (_, after), (o, states) = jax.lax.scan(step, (state, state), [rows] + seq)
        o = jnp.moveaxis(o, 0, 1)
        after = _nan_where_out_of_range(after, vl, t)
        if return_states:
            return o, after, jnp.moveaxis(states, 0, 1)
        return o, after

    # tree: every row's state stays in a buffer (index 0 = the state before the chunk)
    par = jnp.moveaxis(jnp.asarray(parent, jnp.int32), 1, 0)  # [T, B]
    batch = jnp.arange(bsz)
    buf = jnp.zeros((bsz, t + 1) + state.shape[1:], acc).at[:, 0].set(state)

    def tree_step(buf, inp):
        i, p_t, q_t, k_t, v_t, g_t, b_t = inp
        s, o = delta_rule_step(buf[batch, p_t + 1], q_t, k_t, v_t, g_t, b_t)
        return jax.lax.dynamic_update_index_in_dim(buf, s, i + 1, axis=1), o

    buf, o = jax.lax.scan(tree_step, buf, [rows, par] + seq)
    o = jnp.moveaxis(o, 0, 1)
    after = _nan_where_out_of_range(buf[batch, jnp.clip(vl, 0, t)], vl, t)
    return (o, after, buf[:, 1:]) if return_states else (o, after)

"""Pieces shared by the MoE implementations: activations, the expert sort, the weighted unsort."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),  # squared ReLU (Nemotron-H experts)
    "relu": jax.nn.relu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def map_under_vmap(fn):
    """``fn`` with a vmap rule that runs it once per batch member (lax.map over the batched
    arguments; the others are shared): for kernels without a batching rule of their own."""
    @jax.custom_batching.custom_vmap
    def wrapped(*args):
        return fn(*args)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        batched = [a for a, b in zip(args, in_batched) if b]

        def one(xs):
            it = iter(xs)
            return wrapped(*[next(it) if b else a for a, b in zip(args, in_batched)])

        return jax.lax.map(one, batched), True

    return wrapped


def activation_fn(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"moe: unknown activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}") from None


def sort_by_expert(expert_ids_tk, n_experts: int):
    """(order, group_sizes): ``order`` lists the T*k flattened assignments grouped by expert (stable,
    so token order is kept inside a group); ``group_sizes[e]`` counts expert e's assignments.

    When expert * rows + row fits in int32 the sort is one sort of those packed keys: a one-operand
    integer sort, which XLA:GPU runs as a radix sort, where ``argsort`` sorts (key, index) pairs with
    its generic comparison sort. Same order either way (the row breaks ties, as a stable sort).
    The sizes are one [E, M] compare-and-sum (a fused reduction) rather than ``bincount``, a scatter-add
    of M ones into E bins (benchmarks/results/kernels.md, "MoE: the non-GEMM variants")."""
    flat = expert_ids_tk.reshape(-1).astype(jnp.int32)
    rows = flat.shape[0]
    group_sizes = jnp.sum(flat[None, :] == jnp.arange(n_experts, dtype=jnp.int32)[:, None], axis=1,
                          dtype=jnp.int32)
    if n_experts * rows < 2**31:
        packed = jnp.sort(flat * rows + jnp.arange(rows, dtype=jnp.int32))
        return packed % rows, group_sizes
    return jnp.argsort(flat, stable=True), group_sizes


def _gather_rows_u32(x, rows):
    t, d = x.shape
    pairs = jax.lax.bitcast_convert_type(x.reshape(t, d // 2, 2), jnp.uint32)
    got = pairs.at[rows].get(mode="promise_in_bounds")
    return jax.lax.bitcast_convert_type(got, x.dtype).reshape(rows.shape[0], d)


@jax.custom_vjp
def _gather_rows_paired(x, rows):
    return _gather_rows_u32(x, rows)


def _gather_rows_paired_fwd(x, rows):
    return _gather_rows_u32(x, rows), (rows, x.shape[0])


def _gather_rows_paired_bwd(res, ct):
    rows, t = res
    return jnp.zeros((t, ct.shape[1]), ct.dtype).at[rows].add(ct), None


_gather_rows_paired.defvjp(_gather_rows_paired_fwd, _gather_rows_paired_bwd)


def gather_rows(x_td, rows):
    """``x_td[rows]`` for in-bounds ``rows``. 16-bit rows of even width move as uint32 pairs: the same bytes
    in half as many elements, which XLA:GPU's gather copies faster (same bits out; the gradient is the
    usual scatter-add)."""
    if x_td.dtype.itemsize == 2 and x_td.shape[1] % 2 == 0:
        return _gather_rows_paired(x_td, rows)
    return x_td.at[rows].get(mode="promise_in_bounds")


def combine(ys_sorted, order, weights_tk, dtype):
    """Undo the sort, weight each assignment and sum the k choices of every token (fp32 sum; fp64
    when the outputs or weights are fp64). Multiply + sum rather than an einsum: one fused reduction
    over the gathered rows (kernels.md, "MoE: the non-GEMM variants")."""
    t, k = weights_tk.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                   unique_indices=True, mode="promise_in_bounds")
    ys = ys_sorted.at[inverse].get(mode="promise_in_bounds").reshape(t, k, -1)
    acc = accum_dtype(ys, weights_tk)
    return jnp.sum(ys.astype(acc) * weights_tk.astype(acc)[..., None], axis=1).astype(dtype)


def is_fused_gate_up(up_edf, down_efd, gate_edf) -> bool:
    """True when ``up_edf`` is [E, D, 2F] holding the gate's columns then the up projection's (one
    GEMM for both; F = down's input width) rather than [E, D, F]. The shapes decide: an ungated
    expert's up width always equals down's input width."""
    return gate_edf is None and up_edf.shape[2] == 2 * down_efd.shape[1]


def expert_hidden(proj, up_edf, down_efd, gate_edf, act):
    """The experts' hidden activations from ``proj(w) = rows @ w[e]``: act(gate) * up for gated
    experts, separate or fused [gate | up], act(up) for ungated ones."""
    if is_fused_gate_up(up_edf, down_efd, gate_edf):
        f = down_efd.shape[1]
        gu = proj(up_edf)
        return act(gu[..., :f]) * gu[..., f:]
    up = proj(up_edf)
    return act(proj(gate_edf)) * up if gate_edf is not None else act(up)


def grouped_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation, gmm):
    """The routed experts through a grouped GEMM ``gmm(lhs [M, K], rhs [E, K, N], group_sizes [E]) ->
    [M, N]`` over rows sorted by expert: the structure every grouped-GEMM backend shares (the
    reference passes ``jax.lax.ragged_dot``)."""
    act = activation_fn(activation)
    n_experts = up_edf.shape[0]
    order, group_sizes = sort_by_expert(expert_ids_tk, n_experts)
    k = expert_ids_tk.shape[1]
    xs = gather_rows(x_td, order // k)  # row r = the token of the r-th assignment in expert order
    h = expert_hidden(lambda w: gmm(xs, w, group_sizes), up_edf, down_efd, gate_edf, act)
    ys = gmm(h.astype(x_td.dtype), down_efd, group_sizes)
    return combine(ys, order, weights_tk, x_td.dtype)

"""Pieces shared by the MoE implementations: activations, the expert sort, the bias adds, the weighted
unsort. The bias adds and the activation live here, outside the grouped GEMMs, so every backend's
kernels stay plain [M, K] x [E, K, N] products and autodiff handles the rest."""
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


# Activations of the whole gated unit (they need the gate and up halves together), given as a hashable
# tuple (name, *parameters) instead of a name:
#   ("clamped_swiglu", alpha, limit)  gpt-oss: g = min(gate, limit), u = clip(up, -limit, limit),
#                                     h = (u + 1) * g * sigmoid(alpha * g)
GLU_ACTIVATIONS = {"clamped_swiglu": ("alpha", "limit")}


def activation_fn(name: str):
    """The elementwise activation ``name`` (a key of ACTIVATIONS)."""
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        glu = ", ".join(f"({n!r}, {', '.join(p)})" for n, p in GLU_ACTIVATIONS.items())
        raise ValueError(f"moe: unknown activation {name!r}; supported: {', '.join(sorted(ACTIVATIONS))} or "
                         f"the gated tuple {glu}") from None


def check_activation(activation, gated: bool):
    """The activation in canonical form (a name, or a (name, *float parameters) tuple) after checking
    it: a known elementwise name, or a GLU-level tuple for gated experts only."""
    if isinstance(activation, (tuple, list)) and activation and activation[0] in GLU_ACTIVATIONS:
        name, params = activation[0], GLU_ACTIVATIONS[activation[0]]
        if len(activation) != 1 + len(params):
            raise ValueError(f"moe: activation {name!r} takes ({name!r}, {', '.join(params)}), got {activation!r}")
        try:
            values = tuple(float(v) for v in activation[1:])
        except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
            raise ValueError(f"moe: the parameters of activation {activation!r} must be Python numbers "
                             f"({', '.join(params)}; static, not traced arrays)") from None
        if not gated:
            raise ValueError(f"moe: activation {name!r} acts on a gate and an up projection together, and these "
                             f"experts are ungated (up_edf without gate_edf); pass gate_up_edf= (or up_edf= with "
                             f"gate_edf=), or an elementwise activation ({', '.join(sorted(ACTIVATIONS))})")
        return (name, *values)
    activation_fn(activation)  # raises for an unknown name
    return activation


def clamped_swiglu(gate, up, alpha: float, limit: float):
    """gpt-oss's gated unit: the gate clamped from above, up clamped both sides and shifted by 1."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(alpha * gate))


_GLU_UNITS = {"clamped_swiglu": clamped_swiglu}  # name -> fn(gate, up, *GLU_ACTIVATIONS[name] values)


def _glu(activation):
    """unit(gate, up) for gated experts."""
    if isinstance(activation, tuple):  # canonical GLU-level activation (check_activation)
        fn = _GLU_UNITS[activation[0]]

        def unit(gate, up):  # in the accumulation dtype (fp32 for bf16 / fp16 experts)
            acc = accum_dtype(gate, up)
            return fn(gate.astype(acc), up.astype(acc), *activation[1:])
        return unit
    act = activation_fn(activation)
    return lambda gate, up: act(gate) * up


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


def combine(ys_sorted, order, weights_tk, dtype, *, down_bias_ed=None, expert_ids_tk=None):
    """Undo the sort, weight each assignment and sum the k choices of every token (fp32 sum; fp64
    when the outputs or weights are fp64). Multiply + sum rather than an einsum: one fused reduction
    over the gathered rows (kernels.md, "MoE: the non-GEMM variants").

    ``down_bias_ed`` [E, D] (with the unsorted ``expert_ids_tk``): each assignment's output gains its
    expert's bias row before weighting, added in the accumulation dtype. Added here, in token order,
    rather than to the sorted rows: the same sum, and the bias joins the fused fp32 reduction instead
    of being rounded to the GEMM's output dtype first."""
    t, k = weights_tk.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                   unique_indices=True, mode="promise_in_bounds")
    ys = ys_sorted.at[inverse].get(mode="promise_in_bounds").reshape(t, k, -1)
    if down_bias_ed is None:
        acc = accum_dtype(ys, weights_tk)
        return jnp.sum(ys.astype(acc) * weights_tk.astype(acc)[..., None], axis=1).astype(dtype)
    acc = accum_dtype(ys, weights_tk, down_bias_ed)
    bias = jnp.take(down_bias_ed, expert_ids_tk.astype(jnp.int32), axis=0)  # [T, k, D]
    ys = ys.astype(acc) + bias.astype(acc)
    return jnp.sum(ys * weights_tk.astype(acc)[..., None], axis=1).astype(dtype)


def is_fused_gate_up(up_edf, down_efd, gate_edf) -> bool:
    """True when ``up_edf`` is [E, D, 2F] holding the gate's columns then the up projection's (one
    GEMM for both; F = down's input width) rather than [E, D, F]. The shapes decide: an ungated
    expert's up width always equals down's input width."""
    return gate_edf is None and up_edf.shape[2] == 2 * down_efd.shape[1]


def check_biases(up_edf, down_efd, gate_edf, gate_up_bias=None, down_bias=None):
    """Raise unless the biases fit the experts: ``gate_up_bias`` [E, 2F] only with the fused gate_up
    weight, ``down_bias`` [E, D] with any form."""
    n_experts, f, d = down_efd.shape
    if gate_up_bias is not None:
        if not is_fused_gate_up(up_edf, down_efd, gate_edf):
            form = "separate up_edf / gate_edf" if gate_edf is not None else "ungated up_edf"
            raise ValueError(f"moe: gate_up_bias_ef needs the fused gate_up_edf [E, D, 2F] form, not {form}; "
                             f"pass gate_up_edf=concatenate([gate, up], -1) (gated experts) with the bias "
                             f"[E, 2F] laid out the same way")
        if gate_up_bias.shape != (n_experts, 2 * f):
            raise ValueError(f"moe: gate_up_bias_ef has shape {gate_up_bias.shape}, want [E, 2F] = "
                             f"{(n_experts, 2 * f)} (gate's F columns first, then up's)")
    if down_bias is not None and down_bias.shape != (n_experts, d):
        raise ValueError(f"moe: down_bias_ed has shape {down_bias.shape}, want [E, D] = {(n_experts, d)}")


def expert_hidden(proj, up_edf, down_efd, gate_edf, activation, gate_up_bias=None):
    """The experts' hidden activations from ``proj(w) = rows @ w[e]``: act(gate) * up (or a GLU-level
    activation's unit(gate, up)) for gated experts, separate or fused [gate | up], act(up) for ungated
    ones. ``gate_up_bias`` (fused form only) is the bias row of each row's expert, [rows, 2F] or one
    [2F] row for a block of one expert; it is added in the accumulation dtype, and the activation then
    runs on those fp32 (fp64) values. Without a bias an elementwise activation runs in the GEMM's output
    dtype."""
    gated = gate_edf is not None or is_fused_gate_up(up_edf, down_efd, gate_edf)
    activation = check_activation(activation, gated)
    if is_fused_gate_up(up_edf, down_efd, gate_edf):
        f = down_efd.shape[1]
        gu = proj(up_edf)
        if gate_up_bias is not None:
            acc = accum_dtype(gu, gate_up_bias)
            gu = gu.astype(acc) + gate_up_bias.astype(acc)
        return _glu(activation)(gu[..., :f], gu[..., f:])
    if gate_up_bias is not None:
        check_biases(up_edf, down_efd, gate_edf, gate_up_bias)  # raises: only the fused form takes it
    up = proj(up_edf)
    return _glu(activation)(proj(gate_edf), up) if gated else activation_fn(activation)(up)


def grouped_experts(x_td, expert_ids_tk, weights_tk, up_edf, down_efd, gate_edf, activation, gmm, *,
                    gate_up_bias=None, down_bias=None):
    """The routed experts through a grouped GEMM ``gmm(lhs [M, K], rhs [E, K, N], group_sizes [E]) ->
    [M, N]`` over rows sorted by expert: the structure every grouped-GEMM backend shares (the
    reference passes ``jax.lax.ragged_dot``). Biases ([E, 2F] fused gate_up, [E, D] down) are added
    outside ``gmm``: the gate_up bias to the sorted rows (each row's expert's row, gathered by the
    sorted ids), the down bias in ``combine``."""
    check_biases(up_edf, down_efd, gate_edf, gate_up_bias, down_bias)
    check_activation(activation, gate_edf is not None or is_fused_gate_up(up_edf, down_efd, gate_edf))
    n_experts = up_edf.shape[0]
    order, group_sizes = sort_by_expert(expert_ids_tk, n_experts)
    k = expert_ids_tk.shape[1]
    xs = gather_rows(x_td, order // k)  # row r = the token of the r-th assignment in expert order
    bias_rows = None
    if gate_up_bias is not None:
        sorted_ids = jnp.take(expert_ids_tk.reshape(-1).astype(jnp.int32), order)
        bias_rows = jnp.take(gate_up_bias, sorted_ids, axis=0)
    h = expert_hidden(lambda w: gmm(xs, w, group_sizes), up_edf, down_efd, gate_edf, activation, bias_rows)
    ys = gmm(h.astype(x_td.dtype), down_efd, group_sizes)
    return combine(ys, order, weights_tk, x_td.dtype, down_bias_ed=down_bias, expert_ids_tk=expert_ids_tk)

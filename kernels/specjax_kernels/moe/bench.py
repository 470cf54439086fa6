"""Time the routed-experts implementations on the current backend (forward only, after compile).

    python -m specjax_kernels.moe.bench [--tokens 8192] [--k 8] [--experts 128] [--hidden 2048]
        [--inter 768] [--dtype bfloat16] [--blocks 128,512] [--mgpu-sweep] [--gmm-sweep] [--breakdown]
        [--pallas-gpu-sweep] [--gmm-sweep-set wide_k] [--gmm-sweep-only down] [--adopt-best]
        [--layer-variants] [--grad]

Defaults are one Qwen3-30B-A3B MoE layer on 8192 tokens. Prints ms per call and the max relative
difference of each implementation against the first one timed (`reference` unless --skip-reference).
On a GPU it times xla, mgpu (Hopper) and pallas_gpu (any NVIDIA GPU); --grad also times
forward + backward (d x and the three weight gradients) for the differentiable ones (xla, pallas_gpu).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from specjax_kernels.moe import moe_experts
from specjax_kernels.moe import xla as xla_impl


def _time(fn, *args, iters=10, name=None):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    ms = (time.perf_counter() - t0) / iters * 1e3
    if name:  # printed as it comes, so a run cut short keeps what it measured
        print(f"{name:24s} {ms:9.2f} ms", flush=True)
    return ms, out


def _sorted_rows(x, ids, n_experts):
    from specjax_kernels.moe.common import sort_by_expert

    order, sizes = sort_by_expert(ids, n_experts)
    return jnp.take(x, order // ids.shape[1], axis=0), sizes, order


# (block_m, block_n, block_k, steps, grid_block_n) tried per projection by --gmm-sweep: every one fits the
# H200's 227 KiB of shared memory in bf16 (steps x (block_m + block_n) x 64 x 2 B + block_m x block_n x 2 B)
SWEEP = ([(128, 128, 64, s, g) for s in (4, 5, 6) for g in (1, 2, 4, 8)]
         + [(192, 128, 64, s, g) for s in (4, 5) for g in (2, 4)]
         + [(128, 192, 64, 4, g) for g in (1, 2, 4)]
         + [(64, 256, 64, 4, g) for g in (1, 2, 4)]
         + [(128, 256, 64, 3, g) for g in (1, 2)])


# Wider contraction tiles (half the pipeline steps per output tile; the down projection's K is only 768):
# stages x (block_m + block_n) x 128 x 2 B + the output tile stays under 227 KiB.
SWEEP_WIDE_K = ([(128, 128, 128, s, g) for s in (2, 3) for g in (4, 8)]
                + [(64, 256, 128, 2, g) for g in (2, 4)]
                + [(128, 192, 128, 2, g) for g in (2, 4)])


def _gmm_sweep(x, ids, gate_up, up, down, iters, budget_s, configs=SWEEP, only=None, adopt=False):
    """Each grouped GEMM of the layer alone over ``configs``; prints ms per config and the best per shape.
    ``only``: the labels to sweep (gate/up, gate_up, down). ``adopt``: a config faster than the current
    choice (``mgpu.blocks_for``, timed first) becomes that shape's ``mgpu.TUNED`` entry for the rest of the run."""
    from specjax_kernels.moe import mgpu

    xs, sizes, _ = _sorted_rows(x, ids, up.shape[0])
    # random activations, not ones: a product of constants can run faster than real data (METHOD.md)
    h = jax.random.normal(jax.random.key(7), (xs.shape[0], down.shape[1]), x.dtype)
    t_end = time.perf_counter() + budget_s
    for label, lhs, rhs in (("gate/up", xs, up), ("gate_up", xs, gate_up), ("down", h, down)):
        if only and label not in only:
            continue
        k, n = rhs.shape[1], rhs.shape[2]
        current = mgpu.blocks_for(k, n)
        best = None
        for cfg in [None] + list(configs):
            b = current if cfg is None else mgpu.Blocks(*cfg)
            cfg = cfg or ("current",) + dataclasses.astuple(b)
            if not b.fits(n) or k % b.block_k or time.perf_counter() > t_end:
                continue
            try:
                f = jax.jit(lambda lhs, rhs, sizes, b=b: mgpu.gmm(lhs, rhs, sizes, blocks=b))
                ms, _ = _time(f, lhs, rhs, sizes, iters=iters)
            except Exception as e:  # noqa: BLE001 - a config the kernel or the compiler refuses
                print(f"gmm {label} {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}")
                continue
            tf = 2 * xs.shape[0] * k * n / ms / 1e9
            print(f"gmm {label:14s} K={k:5d} N={n:5d} {cfg}: {ms:7.3f} ms {tf:6.1f} TFLOP/s", flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg, b)
        if best:
            print(f"BEST gmm {label} K={k} N={n}: {best[1]} {best[0]:.3f} ms", flush=True)
            if adopt and best[1][0] != "current":
                mgpu.TUNED[(k, n)] = best[2]
                print(f"ADOPTED for K={k} N={n}: {best[2]}", flush=True)


def _sort_bincount(expert_ids_tk, n_experts: int):
    """The layer's sort before 2026-12-04 (session 13): the packed-key sort with ``bincount`` for the sizes."""
    flat = expert_ids_tk.reshape(-1).astype(jnp.int32)
    rows = flat.shape[0]
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    return jnp.sort(flat * rows + jnp.arange(rows, dtype=jnp.int32)) % rows, sizes


def _combine_einsum(ys_sorted, order, weights_tk, dtype):
    """The layer's combine before 2026-12-04 (session 13): inverse by a plain scatter, ``take``, an einsum."""
    t, k = weights_tk.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    ys = jnp.take(ys_sorted, inverse, axis=0).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", ys.astype(jnp.float32), weights_tk.astype(jnp.float32)).astype(dtype)


def _sort_onehot(expert_ids_tk, n_experts: int):
    """(order, group_sizes, inverse) with no sort: each assignment's place in expert order is its expert's
    offset plus its rank among that expert's assignments, the rank from a cumulative sum of the [M, E]
    one-hot down the rows. ``inverse`` (assignment -> sorted row) comes out first; ``order`` is its
    scatter. Same (stable) order as ``common.sort_by_expert``."""
    flat = expert_ids_tk.reshape(-1).astype(jnp.int32)
    rows = flat.shape[0]
    running = jnp.cumsum((flat[:, None] == jnp.arange(n_experts, dtype=jnp.int32)[None, :]).astype(jnp.int32), axis=0)
    sizes = running[-1]
    offsets = jnp.cumsum(sizes) - sizes
    inverse = offsets[flat] + jnp.take_along_axis(running, flat[:, None], axis=1)[:, 0] - 1
    order = jnp.zeros_like(flat).at[inverse].set(jnp.arange(rows, dtype=jnp.int32), unique_indices=True,
                                                  mode="promise_in_bounds")
    return order, sizes, inverse


def _combine_inverse(ys_sorted, inverse, weights_tk, dtype):
    """``common.combine`` given the inverse permutation (``_sort_onehot`` has it): one gather of the
    sorted rows back into assignment order, then multiply + reduce."""
    t, k = weights_tk.shape
    ys = ys_sorted.at[inverse].get(mode="promise_in_bounds").reshape(t, k, -1)
    return jnp.sum(ys.astype(jnp.float32) * weights_tk.astype(jnp.float32)[..., None], axis=1).astype(dtype)


def _combine_scatter(ys_sorted, order, weights_tk, dtype):
    """``common.combine`` writing each sorted row back to its assignment's place (a scatter of unique rows,
    no inverse permutation), then multiply + reduce."""
    t, k = weights_tk.shape
    ys = jnp.zeros_like(ys_sorted).at[order].set(ys_sorted, unique_indices=True, mode="promise_in_bounds")
    ys = ys.reshape(t, k, -1)
    return jnp.sum(ys.astype(jnp.float32) * weights_tk.astype(jnp.float32)[..., None], axis=1).astype(dtype)


def _gather_rows(x, rows, mode):
    """x[rows] by one of the gathers --layer-variants compares: jnp's ``fill`` / ``promise_in_bounds``
    gathers of bf16 rows, or ``u32``: the layer's own ``common.gather_rows`` (rows as uint32 pairs)."""
    from specjax_kernels.moe import common

    return common.gather_rows(x, rows) if mode == "u32" else x.at[rows].get(mode=mode)


def _layer_variants(x, ids, w, gate, up, gate_up, down, iters, repeats):
    """The whole mgpu layer (separate and fused gate/up) with each alternative for the non-GEMM parts:
    how the group sizes are counted, how rows are gathered, how the outputs are combined. Each variant is
    timed ``repeats`` times (``iters`` calls each) in turn, interleaved, and reported by its median and min.
    The weights are arguments, not constants of the jitted function: 400 MB of constants made each
    compile take minutes (2026-12-04)."""
    from specjax_kernels.moe import common, mgpu

    # mgpu on a Hopper GPU; elsewhere (a CPU smoke run) the reference grouped GEMM stands in for it
    gmm = mgpu.gmm if mgpu.available() is None else (lambda lhs, rhs, sizes: jax.lax.ragged_dot(lhs, rhs, sizes))
    print(f"layer variants through {'mgpu' if mgpu.available() is None else 'ragged_dot (no Hopper GPU)'}")

    def layer(counts, gather_mode, comb, fused):
        sort = {"bincount": _sort_bincount, "compare": common.sort_by_expert,
                "onehot": lambda ids, e: _sort_onehot(ids, e)[:2]}[counts]
        combine = {"einsum": _combine_einsum, "mulsum": common.combine, "scatter": _combine_scatter,
                   "inverse": None}[comb]

        def fn(x, ids, w, gate, up, gate_up, down):
            act = "silu"
            if comb == "inverse":  # the one-hot placement's inverse permutation, no scatter to rebuild it
                order, sizes, inverse = _sort_onehot(ids, up.shape[0])
                unsort = lambda ys, order, w, dtype: _combine_inverse(ys, inverse, w, dtype)  # noqa: E731
            else:
                order, sizes = sort(ids, up.shape[0])
                unsort = combine
            xs = _gather_rows(x, order // ids.shape[1], gather_mode)
            proj = lambda wt: gmm(xs, wt, sizes)  # noqa: E731
            hh = (common.expert_hidden(proj, gate_up, down, None, act) if fused
                  else common.expert_hidden(proj, up, down, gate, act))
            return unsort(gmm(hh.astype(x.dtype), down, sizes), order, w, x.dtype)
        return jax.jit(fn)

    args = (x, ids, w, gate, up, gate_up, down)
    variants = {}
    for fused in (True, False):
        for counts, gather_mode, comb in (("bincount", "fill", "einsum"), ("compare", "fill", "einsum"),
                                          ("bincount", "promise_in_bounds", "einsum"), ("bincount", "u32", "einsum"),
                                          ("bincount", "fill", "mulsum"), ("bincount", "fill", "scatter"),
                                          ("compare", "u32", "mulsum"), ("compare", "u32", "scatter"),
                                          ("onehot", "fill", "einsum"), ("onehot", "fill", "inverse"),
                                          ("onehot", "u32", "inverse")):
            name = f"{'fused' if fused else 'separate'} counts={counts} gather={gather_mode} combine={comb}"
            variants[name] = layer(counts, gather_mode, comb, fused)
    first = None
    for name, fn in variants.items():  # compile and check every variant before any timing
        out = jax.block_until_ready(fn(*args)).astype(jnp.float32)
        first = out if first is None else first
        err = float(jnp.abs(out - first).max() / jnp.abs(first).max())
        print(f"variant {name}: rel diff vs the first {err:.1e}", flush=True)
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(_time(fn, *args, iters=iters)[0])
    flops = 2 * ids.size * x.shape[1] * down.shape[1] * 3
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"LAYER {name:70s} median {med:6.3f} ms  min {min(ts):6.3f} ms  "
              f"{flops / med / 1e9:6.1f} TFLOP/s (median)  [{', '.join(f'{t:.3f}' for t in ts)}]", flush=True)


def _breakdown(x, ids, w, gate_up, down, iters):
    """The fused mgpu layer's parts, each jitted alone (their sum exceeds the whole: no fusion across)."""
    from specjax_kernels.moe import mgpu
    from specjax_kernels.moe.common import combine

    n_experts, f = down.shape[0], down.shape[1]
    sort = jax.jit(lambda x, ids: _sorted_rows(x, ids, n_experts))
    _time(sort, x, ids, iters=iters, name="part: sort + gather")
    from specjax_kernels.moe.common import sort_by_expert

    _time(jax.jit(lambda ids: _sort_bincount(ids, n_experts)), ids, iters=iters, name="part: sort + bincount")
    _time(jax.jit(lambda ids: sort_by_expert(ids, n_experts)), ids, iters=iters,
          name="part: sort + compare counts")
    _time(jax.jit(lambda ids: _sort_onehot(ids, n_experts)), ids, iters=iters,
          name="part: one-hot placement (no sort) + counts + inverse")
    flat = ids.reshape(-1).astype(jnp.int32)
    _time(jax.jit(lambda f: jnp.bincount(f, length=n_experts)), flat, iters=iters, name="part: bincount alone")
    _time(jax.jit(lambda f: jnp.sort(f * f.shape[0] + jnp.arange(f.shape[0], dtype=jnp.int32))), flat,
          iters=iters, name="part: packed sort alone")
    order = jax.jit(lambda ids: sort_by_expert(ids, n_experts)[0])(ids)
    for mode in ("fill", "promise_in_bounds", "u32"):
        _time(jax.jit(lambda x, o, mode=mode: _gather_rows(x, o // ids.shape[1], mode)), x, order,
              iters=iters, name=f"part: gather alone ({mode})")
    xs, sizes, order = sort(x, ids)
    g1 = jax.jit(mgpu.gmm)
    _time(g1, xs, gate_up, sizes, iters=iters, name="part: gmm gate_up")
    gu = g1(xs, gate_up, sizes)
    act = jax.jit(lambda gu: (jax.nn.silu(gu[:, :f]) * gu[:, f:]).astype(x.dtype))
    _time(act, gu, iters=iters, name="part: silu(gate) * up")
    hh = act(gu)
    _time(g1, hh, down, sizes, iters=iters, name="part: gmm down")
    ys = g1(hh, down, sizes)
    _time(jax.jit(lambda ys, order, w: combine(ys, order, w, x.dtype)), ys, order, w, iters=iters,
          name="part: unsort + weighted sum")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--blocks", default="128,512")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--mgpu-sweep", action="store_true",
                    help="also time mgpu at several (block_m, block_n, block_k, max_concurrent_steps)")
    ap.add_argument("--pallas-gpu-sweep", action="store_true",
                    help="also time pallas_gpu at several (block_m, block_n, block_k, num_warps, num_stages)")
    ap.add_argument("--gmm-sweep", action="store_true",
                    help="time each mgpu grouped GEMM of the layer alone (gate/up, fused gate_up, down) over "
                         "block configurations and print the best per projection")
    ap.add_argument("--sweep-budget-s", type=float, default=240.0, help="stop --gmm-sweep after this long")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the mgpu layer's parts alone: sort + gather, each grouped GEMM, activation, combine")
    ap.add_argument("--gmm-sweep-set", choices=("default", "wide_k"), default="default",
                    help="the configurations --gmm-sweep tries: SWEEP, or SWEEP_WIDE_K (block_k 128)")
    ap.add_argument("--gmm-sweep-only", default="", help="comma-separated: gate/up, gate_up, down (default: all)")
    ap.add_argument("--adopt-best", action="store_true",
                    help="--gmm-sweep's fastest config per shape, if faster than the current, is used for the rest of the run")
    ap.add_argument("--layer-variants", action="store_true",
                    help="time the whole mgpu layer with each alternative for its non-GEMM parts (counts, gather, combine)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per variant for --layer-variants")
    ap.add_argument("--grad", action="store_true", help="also time forward + backward of xla and pallas_gpu")
    ap.add_argument("--interpret", action="store_true", help="run pallas_gpu in interpret mode (a CPU smoke run)")
    a = ap.parse_args(argv)
    dt = jnp.dtype(a.dtype)
    ks = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(ks[0], (a.tokens, a.hidden), dt)
    w, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (a.tokens, a.experts))), a.k)
    w = w.astype(dt)
    s = a.hidden**-0.5
    up = (s * jax.random.normal(ks[2], (a.experts, a.hidden, a.inter))).astype(dt)
    gate = (s * jax.random.normal(ks[3], (a.experts, a.hidden, a.inter))).astype(dt)
    down = (a.inter**-0.5 * jax.random.normal(ks[4], (a.experts, a.inter, a.hidden))).astype(dt)
    flops = 2 * a.tokens * a.k * a.hidden * a.inter * 3
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"T={a.tokens} k={a.k} E={a.experts} D={a.hidden} F={a.inter} {a.dtype}; useful GFLOP {flops / 1e9:.1f}")
    results = {}
    if not a.skip_reference:
        f = jax.jit(lambda x, ids, w: moe_experts(x, ids, w, up_edf=up, down_efd=down, gate_edf=gate,
                                                  implementation="reference"))
        results["reference (ragged_dot)"] = _time(f, x, ids, w, iters=a.iters, name="reference (ragged_dot)")
    for b in [int(v) for v in a.blocks.split(",")]:
        f = jax.jit(lambda x, ids, w, b=b: xla_impl.moe_experts(x, ids, w, up, down, gate, "silu", block=b))
        results[f"xla block={b}"] = _time(f, x, ids, w, iters=a.iters, name=f"xla block={b}")
    from specjax_kernels.moe import mgpu

    if mgpu.available() is None and mgpu.supports(x, up, down) is None:
        f = jax.jit(lambda x, ids, w: mgpu.moe_experts(x, ids, w, up, down, gate, "silu"))
        results["mgpu (ragged_dot_mgpu)"] = _time(f, x, ids, w, iters=a.iters, name="mgpu default")
        # the same layer with [gate | up] fused into one [E, D, 2F] weight (one grouped GEMM of width 2F)
        gate_up = jnp.concatenate([gate, up], axis=-1)
        f = jax.jit(lambda x, ids, w: mgpu.moe_experts(x, ids, w, gate_up, down, None, "silu"))
        results["mgpu fused gate_up"] = _time(f, x, ids, w, iters=a.iters, name="mgpu fused gate_up")
        if a.gmm_sweep:
            _gmm_sweep(x, ids, gate_up, up, down, a.iters, a.sweep_budget_s,
                       configs=SWEEP_WIDE_K if a.gmm_sweep_set == "wide_k" else SWEEP,
                       only=[v for v in a.gmm_sweep_only.split(",") if v], adopt=a.adopt_best)
        if a.breakdown:
            _breakdown(x, ids, w, gate_up, down, a.iters)
        default = mgpu.DEFAULT
        # configurations that fit the H200's 227 KiB of shared memory in bf16 (stages x (lhs + rhs tile) + out tile)
        for cfg in ([(64, 128, 64, 6), (128, 128, 64, 2), (128, 128, 64, 6), (128, 256, 64, 3), (192, 128, 64, 4)]
                    if a.mgpu_sweep else []):
            mgpu.DEFAULT = mgpu.Blocks(*cfg)
            try:
                f = jax.jit(lambda x, ids, w: mgpu.moe_experts(x, ids, w, up, down, gate, "silu"))
                results[f"mgpu {cfg}"] = _time(f, x, ids, w, iters=a.iters, name=f"mgpu {cfg}")
            except Exception as e:  # noqa: BLE001 - a config that does not fit shared memory, or the widths
                print(f"mgpu {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        mgpu.DEFAULT = default
    else:
        print("mgpu skipped:", mgpu.available() or mgpu.supports(x, up, down))
    if a.layer_variants:
        _layer_variants(x, ids, w, gate, up, jnp.concatenate([gate, up], axis=-1), down, a.iters, a.repeats)
    from specjax_kernels.moe import pallas_gpu

    pg_ok = pallas_gpu.available() is None or a.interpret
    if pg_ok:
        pg = pallas_gpu
        f = jax.jit(lambda x, ids, w: pg.moe_experts(x, ids, w, up, down, gate, "silu", interpret=a.interpret))
        results["pallas_gpu"] = _time(f, x, ids, w, iters=a.iters, name="pallas_gpu default")
        default = (pg.BLOCK_M, pg.BLOCK_N, pg.BLOCK_K, pg.NUM_WARPS, pg.NUM_STAGES)
        for cfg in ([(64, 128, 64, 4, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                     (128, 128, 32, 4, 4), (64, 64, 64, 4, 3)] if a.pallas_gpu_sweep else []):
            pg.BLOCK_M, pg.BLOCK_N, pg.BLOCK_K, pg.NUM_WARPS, pg.NUM_STAGES = cfg
            try:
                f = jax.jit(lambda x, ids, w: pg.moe_experts(x, ids, w, up, down, gate, "silu",
                                                             interpret=a.interpret))
                results[f"pallas_gpu {cfg}"] = _time(f, x, ids, w, iters=a.iters, name=f"pallas_gpu {cfg}")
            except Exception as e:  # noqa: BLE001 - a configuration Triton refuses (shared memory, registers)
                print(f"pallas_gpu {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
        pg.BLOCK_M, pg.BLOCK_N, pg.BLOCK_K, pg.NUM_WARPS, pg.NUM_STAGES = default
    else:
        print("pallas_gpu skipped:", pallas_gpu.available())
    if a.grad:
        def fb(fn):
            def loss(x, up, gate, down):
                return jnp.sum(fn(x, ids, w, up, down, gate, "silu").astype(jnp.float32))
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        impls = [("xla", lambda *a_: xla_impl.moe_experts(*a_, block=int(a.blocks.split(",")[-1])))]
        if pg_ok:
            impls.append(("pallas_gpu", lambda *a_: pallas_gpu.moe_experts(*a_, interpret=a.interpret)))
        grads = {}
        for name, fn in impls:
            ms, g = _time(fb(fn), x, up, gate, down, iters=a.iters, name=f"{name} fwd+bwd")
            grads[name] = (ms, g)
        first = next(iter(grads.values()))[1]
        for name, (ms, g) in grads.items():
            errs = [float(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32)).max() / jnp.abs(v.astype(jnp.float32)).max())
                    for u, v in zip(g, first)]
            print(f"{name + ' fwd+bwd':24s} {ms:9.2f} ms  {3 * flops / ms / 1e9:8.1f} TFLOP/s useful  "
                  f"rel diff of dx, dup, dgate, ddown vs first {', '.join(f'{e:.1e}' for e in errs)}")
    ref = next(iter(results.values()))[1].astype(jnp.float32)
    for name, (ms, out) in results.items():
        err = float(jnp.abs(out.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())
        print(f"{name:24s} {ms:9.2f} ms  {flops / ms / 1e9:8.1f} TFLOP/s useful  rel diff vs first {err:.1e}")


if __name__ == "__main__":
    main()

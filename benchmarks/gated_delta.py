"""Gated delta rule (Qwen3-Next / Qwen3.5 linear attention) on one device: the chunked xla op vs the
sequential reference vs the Mamba-2 SSD op, at a Qwen3.5-35B-A3B linear-attention layer's shape.

    JAX_PLATFORMS=cuda PYTHONPATH=kernels:. python benchmarks/gated_delta.py --out results.json
    PYTHONPATH=kernels:. python benchmarks/gated_delta.py --tiny      # CPU smoke run at a toy shape

Shape (Qwen3.5-35B-A3B config.json: linear_num_key_heads 16, linear_num_value_heads 32,
linear_key_head_dim = linear_value_head_dim = 128, linear_conv_kernel_dim 4): q, k [B, T, 16, 128],
v [B, T, 32, 128], bf16 inputs, fp32 state and outputs; T = 4096 packed (``--docs`` documents of
random lengths in each row, so the segment masks are exercised). The SSD row runs a Mamba-2 scan
with the same per-head state ([32 heads, P = 128, N = 128], B/C in 16 groups): the same state memory
and a comparable recurrence, diagonal instead of delta-rule transitions.

Rows: each implementation's compile time and median forward time (wall clock around
block_until_ready after a warm-up), tokens/s; the xla path at several chunk sizes, at matmul precision
HIGHEST (the op's default: fp32 products) and DEFAULT (TF32 / bf16 passes on GPUs), and with the UT
solve as lax.linalg.triangular_solve instead of the blocked inverse; each xla row's max relative error
vs the reference on this device; forward + backward of the xla gated delta rule and of SSD (a train
step's cost); the short conv over the concatenated qkv (conv_dim 8192); the cached
decoding step (gated_delta_rule_update) for chunks of 1 and 8 tokens.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from _results import write_results  # noqa: E402
from specjax_kernels.gated_delta import gated_delta_rule  # noqa: E402
from specjax_kernels.gated_delta import xla as gd_xla  # noqa: E402
from specjax_kernels.gated_delta.conv import causal_conv1d, gated_delta_rule_update  # noqa: E402
from specjax_kernels.ssd import ssd  # noqa: E402

QWEN35_35B_A3B = dict(hk=16, hv=32, dk=128, dv=128, conv_kernel=4)
TINY = dict(hk=2, hv=4, dk=16, dv=16, conv_kernel=4)


def timeit(f, *args, iters=10):
    """(compile + first call seconds, median seconds of `iters` later calls)."""
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t0
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return first, statistics.median(ts)


def packed_segments(b, t, docs, seed=0):
    """[B, T] int32 ids 1..docs per row: `docs` documents of random lengths (each >= 1 token)."""
    rng = np.random.RandomState(seed)
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=docs - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(t), side="right") + 1)
    return jnp.asarray(np.stack(rows), jnp.int32)


def inputs(shape, b, t, docs, key):
    ks = jax.random.split(key, 6)
    hk, hv, dk, dv = shape["hk"], shape["hv"], shape["dk"], shape["dv"]
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (b, t, hk, dk), bf)
    k = jax.random.normal(ks[1], (b, t, hk, dk), bf)
    v = jax.random.normal(ks[2], (b, t, hv, dv), bf)
    # as Qwen3-Next builds them: g = -exp(A_log) * softplus(a + dt_bias), A in (0, 16]; beta = sigmoid(b)
    a_log = jnp.log(jax.random.uniform(ks[3], (hv,), jnp.float32, 0.01, 16.0))
    g = -jnp.exp(a_log) * jax.nn.softplus(jax.random.normal(ks[4], (b, t, hv), jnp.float32) - 4.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (b, t, hv), jnp.float32)).astype(bf)
    return q, k, v, g, beta, packed_segments(b, t, docs)


def rel_err(a, b):
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def bench_rule(shape, b, t, docs, iters, chunks, out, with_reference=True):
    q, k, v, g, beta, seg = inputs(shape, b, t, docs, jax.random.key(0))
    runs = [("reference", 1, "highest", None)] if with_reference else []
    runs += [("xla", c, "highest", "blocked") for c in chunks]
    runs += [("xla", chunks[0], "default", "blocked"), ("xla", chunks[0], "highest", "lax")]
    outs = {}
    for impl, chunk, precision, solve in runs:
        if impl == "reference":
            f = jax.jit(lambda *a: gated_delta_rule(*a[:5], segment_ids=a[5], implementation="reference"))
        else:
            prec = jax.lax.Precision.HIGHEST if precision == "highest" else jax.lax.Precision.DEFAULT
            f = jax.jit(lambda *a, c=chunk, p=prec, s=solve: gd_xla.gated_delta_rule(
                *a[:5], segment_ids=a[5], chunk_size=c, precision=p, solve=s)[0])
        first, sec = timeit(f, q, k, v, g, beta, seg, iters=iters)
        outs[(impl, chunk, precision, solve)] = f(q, k, v, g, beta, seg)
        row = {"op": "gated_delta", "impl": impl, "chunk": chunk, "precision": precision, "solve": solve, "B": b,
               "T": t, "compile_s": round(first, 3), "ms": 1e3 * sec, "tok_per_s": b * t / sec}
        print(row, flush=True)
        out.setdefault("rows", []).append(row)
    if not with_reference:
        return
    ref = outs[runs[0]]
    for (impl, chunk, precision, solve), o in outs.items():
        if impl == "xla":
            out.setdefault("rel_err_vs_reference", {})[f"xla_c{chunk}_{precision}_{solve}"] = rel_err(o, ref)
    print("rel err vs reference", out["rel_err_vs_reference"], flush=True)


def ssd_inputs(shape, b, t):
    """Mamba-2 SSD inputs with the same per-head state: H = Hv heads, P = Dv, N = Dk, G = Hk groups:
    (x, dt, A, B, C)."""
    ks = jax.random.split(jax.random.key(1), 4)
    h, p, n, grp = shape["hv"], shape["dv"], shape["dk"], shape["hk"]
    x = jax.random.normal(ks[0], (b, t, h, p), jnp.bfloat16)
    dt = jax.nn.softplus(jax.random.normal(ks[1], (b, t, h), jnp.float32) - 2.0)
    a = -jnp.arange(1, h + 1, dtype=jnp.float32)
    bm = jax.random.normal(ks[2], (b, t, grp, n), jnp.bfloat16)
    cm = jax.random.normal(ks[3], (b, t, grp, n), jnp.bfloat16)
    return x, dt, a, bm, cm


def bench_ssd(shape, b, t, docs, iters, out):
    """Mamba-2 SSD with the same per-head state (ssd_inputs)."""
    x, dt, a, bm, cm = ssd_inputs(shape, b, t)
    h, p, n, grp = shape["hv"], shape["dv"], shape["dk"], shape["hk"]
    seg = packed_segments(b, t, docs)
    for chunk in (64, 128):
        f = jax.jit(lambda *args, c=chunk: ssd(*args[:5], chunk_size=c, segment_ids=args[5], implementation="xla"))
        first, sec = timeit(f, x, dt, a, bm, cm, seg, iters=iters)
        row = {"op": "ssd", "impl": "xla", "chunk": chunk, "B": b, "T": t, "H": h, "P": p, "N": n, "G": grp,
               "compile_s": round(first, 3), "ms": 1e3 * sec, "tok_per_s": b * t / sec}
        print(row, flush=True)
        out.setdefault("rows", []).append(row)


def bench_train(shape, b, t, docs, iters, chunk, out):
    """Forward + backward (what a train step pays): the gradient of a random projection of the output
    with respect to every differentiable input, gated delta (xla, HIGHEST and DEFAULT) beside SSD (xla)."""
    q, k, v, g, beta, seg = inputs(shape, b, t, docs, jax.random.key(0))
    w = jax.random.normal(jax.random.key(5), (b, t, shape["hv"], shape["dv"]), jnp.float32)
    for precision in ("highest", "default"):
        prec = jax.lax.Precision.HIGHEST if precision == "highest" else jax.lax.Precision.DEFAULT

        def loss(q, k, v, g, beta, p=prec):
            o = gd_xla.gated_delta_rule(q, k, v, g, beta, segment_ids=seg, chunk_size=chunk, precision=p)[0]
            return jnp.sum(o * w)

        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        first, sec = timeit(f, q, k, v, g, beta, iters=iters)
        row = {"op": "gated_delta_fwd_bwd", "impl": "xla", "chunk": chunk, "precision": precision, "B": b, "T": t,
               "compile_s": round(first, 3), "ms": 1e3 * sec, "tok_per_s": b * t / sec}
        print(row, flush=True)
        out.setdefault("rows", []).append(row)
    x, dt, a, bm, cm = ssd_inputs(shape, b, t)
    for c in (64, 128):
        f = jax.jit(jax.grad(lambda x, dt, bm, cm, c=c: jnp.sum(
            ssd(x, dt, a, bm, cm, chunk_size=c, segment_ids=seg, implementation="xla") * w), argnums=(0, 1, 2, 3)))
        first, sec = timeit(f, x, dt, bm, cm, iters=iters)
        row = {"op": "ssd_fwd_bwd", "impl": "xla", "chunk": c, "B": b, "T": t, "compile_s": round(first, 3),
               "ms": 1e3 * sec, "tok_per_s": b * t / sec}
        print(row, flush=True)
        out.setdefault("rows", []).append(row)


def bench_conv(shape, b, t, docs, iters, out):
    conv_dim = 2 * shape["hk"] * shape["dk"] + shape["hv"] * shape["dv"]
    ks = jax.random.split(jax.random.key(2), 2)
    x = jax.random.normal(ks[0], (b, t, conv_dim), jnp.bfloat16)
    kern = 0.3 * jax.random.normal(ks[1], (shape["conv_kernel"], conv_dim), jnp.bfloat16)
    seg = packed_segments(b, t, docs)
    f = jax.jit(lambda x, w, s: causal_conv1d(x, w, segment_ids=s))
    first, sec = timeit(f, x, kern, seg, iters=iters)
    row = {"op": "causal_conv1d", "C": conv_dim, "B": b, "T": t, "compile_s": round(first, 3), "ms": 1e3 * sec}
    print(row, flush=True)
    out.setdefault("rows", []).append(row)


def bench_decode(shape, b, iters, out):
    for t in (1, 8):
        q, k, v, g, beta, _ = inputs(shape, b, t, 1, jax.random.key(3))
        state = jnp.zeros((b, shape["hv"], shape["dk"], shape["dv"]), jnp.float32)
        f = jax.jit(lambda *a: gated_delta_rule_update(*a, valid_len=max(t - 1, 0)))
        first, sec = timeit(f, q, k, v, g, beta, state, iters=iters)
        row = {"op": "gated_delta_rule_update", "B": b, "T": t, "compile_s": round(first, 3), "ms": 1e3 * sec}
        print(row, flush=True)
        out.setdefault("rows", []).append(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy shape, T = 64 (CPU smoke run)")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--docs", type=int, default=6, help="packed documents per row")
    ap.add_argument("--chunks", default="64,32,128", help="xla chunk sizes; the first is also timed at DEFAULT")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-reference", action="store_true", help="(the sequential scan is slow on GPUs)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shape = TINY if args.tiny else QWEN35_35B_A3B
    t = 64 if args.tiny else args.T
    iters = 2 if args.tiny else args.iters
    chunks = [int(c) for c in args.chunks.split(",")]
    if args.tiny:
        chunks = [c for c in chunks if c <= t] or [16]
    out = {"device": str(jax.devices()[0]), "shape": shape, "B": args.B, "T": t, "docs": args.docs}
    print(out, flush=True)
    bench_rule(shape, args.B, t, args.docs, iters, chunks, out, with_reference=not args.skip_reference)
    bench_ssd(shape, args.B, t, args.docs, iters, out)
    bench_train(shape, args.B, t, args.docs, iters, chunks[0], out)
    bench_conv(shape, args.B, t, args.docs, iters, out)
    bench_decode(shape, args.B, iters, out)
    return write_results(out, args.out)


if __name__ == "__main__":
    sys.exit(main())

"""Kernel benchmarks: TTT attention, fused soft-CE and routed MoE experts, every implementation vs the
XLA baselines.

    JAX_PLATFORMS=cuda PYTHONPATH=kernels:. python benchmarks/kernel_speed.py --T 2048,8192,32768 --out results.json
    JAX_PLATFORMS=cpu PYTHONPATH=kernels:. python benchmarks/kernel_speed.py --small --ops moe --T 512
    # packed rows (segment ids), where pallas_gpu and triton skip the tiles of other documents:
    JAX_PLATFORMS=cuda PYTHONPATH=kernels:. python benchmarks/kernel_speed.py --ops ttt_attention --T 4096 \
        --ttt-doc-lens 0,1024 --ttt-impls triton,pallas_gpu,xla

Shapes (issue "Kernels", Llama-3.1-8B draft): B=1, 32 query heads, 8 KV heads, D=128, Vd=32000,
H=4096, bf16; TTT step k=6 (the last of K=7 steps, the most keys: k0 plus 6 diagonal keys).
MoE (`--ops moe`, T = tokens): one Qwen3-30B-A3B expert layer, E=128 experts, top-8, D=2048, F=768,
gated SiLU, bf16; `--small`: E=32, top-2, D=F=64 in fp32 (the CPU case for which `auto` picks xla
over the reference ragged_dot, which off TPU is expanded to a dense product over all E experts).
Baselines:
  ttt  masked : the naive form, keys of all steps concatenated ([T,(k+1)T] scores) with an explicit mask
  ttt  reference: specjax's jnp definition ([T,T] scores plus k diagonal columns)
  ce   matmuls: the lm_head GEMMs alone (fwd h@W.T, bwd dd@W and dd.T@h) the fused op is compared to
  moe  reference: ragged_dot grouped GEMMs (the definition) vs xla, the block-sparse grouped GEMM
Times are the median of repeated runs after a warm-up (wall clock around block_until_ready).
Memory is XLA's compiled plan (arguments + outputs + temporaries, `memory_analysis()`); Triton kernels
hold no hidden buffers. TFLOP/s use model FLOPs: attention 4*B*Hq*D*(T^2/2 + k*T) forward and 2.5x that
for the backward (FlashAttention convention); soft-CE 2*N*H*Vd per GEMM (+ teacher GEMMs when the
teacher comes as hidden states), 1 GEMM forward and 3 forward+backward; MoE 2*T*k*3*D*F (the routed
tokens' three expert GEMMs) forward and 3x that forward+backward.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # before jax starts its backend

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

PEAK = 789e12  # measured bf16 matmul ceiling on the H200 (device README); re-measured below

B, HQ, HKV, D, K_STEP = 1, 32, 8, 128, 6
H, VD = 4096, 32000
MOE_E, MOE_K, MOE_D, MOE_F, MOE_DTYPE = 128, 8, 2048, 768, jnp.bfloat16


def timeit(f, args, budget_s=2.0, max_iters=20):
    jax.block_until_ready(f(*args))  # warm-up (compile outside)
    ts = []
    t_end = time.perf_counter() + budget_s
    while len(ts) < max_iters and (len(ts) < 3 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def plan_bytes(f, args):
    m = f.lower(*args).compile().memory_analysis()
    if m is None:
        return None
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes


def device_bytes():
    try:
        return jax.devices()[0].memory_stats()["bytes_limit"]
    except Exception:
        return None


def masked_ttt(q, k0, v0, kd, vd):
    """The naive version: all steps' keys concatenated, one [T,(k+1)T] masked softmax."""
    Bq, T, Hq, Dh = q.shape
    rep = Hq // k0.shape[2]
    Kc = jnp.repeat(jnp.concatenate([k0] + list(kd), 1), rep, 2)
    Vc = jnp.repeat(jnp.concatenate([v0] + list(vd), 1), rep, 2)
    n = kd.shape[0] + 1
    qpos = jnp.arange(T)[:, None]
    kv = jnp.arange(n * T)[None, :]
    mask = ((kv < T) & (kv <= qpos)) | ((kv >= T) & (kv % T == qpos))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, Kc, preferred_element_type=jnp.float32) / np.sqrt(Dh)
    s = jnp.where(mask[None, None], s, -1e30)
    w = jax.nn.softmax(s, -1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", w, Vc)


def record(rows, **r):
    rows.append(r)
    print(json.dumps(r), flush=True)


def run_case(rows, op, impl, T, mode, f, args, flops, deadline, extra=None):
    base = dict(op=op, impl=impl, T=T, mode=mode, **(extra or {}))
    if time.time() > deadline:
        record(rows, **base, status="skipped (time budget)")
        return
    try:
        jf = jax.jit(f)
        need = plan_bytes(jf, args)
        limit = device_bytes()
        if need is not None and limit is not None and need > limit:
            record(rows, **base, status=f"OOM: plan needs {need / 2**30:.0f} GiB > {limit / 2**30:.0f} GiB")
            return
        t = timeit(jf, args)
        record(rows, **base, status="ok", ms=t * 1e3, mem_gib=None if need is None else need / 2**30,
               tflops=flops / t / 1e12, frac_peak=flops / t / PEAK)
    except Exception as e:  # keep going: one failing implementation must not stop the table
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        record(rows, **base, status="error: " + msg)
        traceback.print_exc(limit=3)


def bench_ttt(rows, T, impls, deadline, doc_len=0):
    """doc_len > 0: each row packs T / doc_len documents (segment ids), as training rows do; the FLOPs
    are then the documents' own triangles (what a kernel that skips other documents' tiles must do)."""
    from specjax_kernels.ttt_attention import ttt_attention
    ks = jax.random.split(jax.random.key(T), 6)
    n = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)
    q, k0, v0 = n(ks[0], (B, T, HQ, D)), n(ks[1], (B, T, HKV, D)), n(ks[2], (B, T, HKV, D))
    kd, vd = n(ks[3], (K_STEP, B, T, HKV, D)), n(ks[4], (K_STEP, B, T, HKV, D))
    do = n(ks[5], (B, T, HQ, D))
    seg = None
    fl = 4 * B * HQ * D * (T * T / 2 + K_STEP * T)
    extra = None
    if doc_len:
        seg = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // doc_len + 1, (B, T))
        docs = [min(doc_len, T - s) for s in range(0, T, doc_len)]
        fl = 4 * B * HQ * D * (sum(d * d / 2 for d in docs) + K_STEP * T)
        extra = {"doc_len": doc_len}
    for impl in impls:
        if impl == "masked":
            if seg is not None:
                continue  # the naive form has no segment ids
            f = masked_ttt
        else:
            f = (lambda impl: lambda *a: ttt_attention(*a, seg, implementation=impl))(impl)
        run_case(rows, "ttt_attention", impl, T, "fwd", f, (q, k0, v0, kd, vd), fl, deadline, extra)

        def fb(q, k0, v0, kd, vd, f=f):
            out, vjp = jax.vjp(f, q, k0, v0, kd, vd)
            return vjp(do)
        run_case(rows, "ttt_attention", impl, T, "fwd+bwd", fb, (q, k0, v0, kd, vd), 3.5 * fl, deadline, extra)


def bench_ce(rows, N, impls, deadline, teachers):
    from specjax_kernels.soft_ce import fused_linear_soft_ce
    ks = jax.random.split(jax.random.key(N), 6)
    h = jax.random.normal(ks[0], (N, H), jnp.float32).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(ks[1], (VD, H), jnp.float32)).astype(jnp.bfloat16)
    th = jax.random.normal(ks[2], (N, H), jnp.float32).astype(jnp.bfloat16)
    tw = (0.02 * jax.random.normal(ks[3], (VD, H), jnp.float32)).astype(jnp.bfloat16)
    gemm = 2 * N * H * VD
    dd = (1e-3 * jax.random.normal(ks[4], (N, VD), jnp.float32)).astype(jnp.bfloat16)
    f32 = jnp.float32
    # the baseline the goal is stated against: the draft lm_head GEMMs alone
    run_case(rows, "soft_ce", "matmuls", N, "fwd", lambda h, w: jnp.einsum("nh,vh->nv", h, w, preferred_element_type=f32)
             .astype(jnp.bfloat16), (h, w), gemm, deadline)
    run_case(rows, "soft_ce", "matmuls", N, "fwd+bwd",
             lambda h, w, dd: (jnp.einsum("nh,vh->nv", h, w, preferred_element_type=f32).astype(jnp.bfloat16),
                               jnp.dot(dd, w, preferred_element_type=f32), jnp.einsum("nv,nh->vh", dd, h,
                                                                                      preferred_element_type=f32)),
             (h, w, dd), 3 * gemm, deadline)
    tlog = None
    for teacher in teachers:
        if teacher == "logits":
            tlog = jnp.einsum("nh,vh->nv", th, tw, preferred_element_type=f32).astype(jnp.bfloat16)
        for impl in impls:
            if teacher == "logits":
                f = (lambda impl: lambda h, w, t: fused_linear_soft_ce(h, w, teacher_logits=t, implementation=impl))(impl)
                args, tf = (h, w, tlog), 0
            else:
                f = (lambda impl: lambda h, w, th, tw: fused_linear_soft_ce(
                    h, w, teacher_hidden=th, teacher_head=tw, implementation=impl))(impl)
                args, tf = (h, w, th, tw), gemm
            run_case(rows, "soft_ce", impl, N, "fwd", f, args, gemm + tf, deadline, dict(teacher=teacher))

            def fb(h, w, *rest, f=f):
                return jax.grad(lambda h, w: jnp.sum(f(h, w, *rest)), argnums=(0, 1))(h, w)
            run_case(rows, "soft_ce", impl, N, "fwd+bwd", fb, args, 3 * gemm + tf, deadline, dict(teacher=teacher))
        if tlog is not None:
            del tlog
            tlog = None


def bench_moe(rows, T, impls, deadline):
    from specjax_kernels.moe import moe_experts
    ks = jax.random.split(jax.random.key(T), 5)
    x = jax.random.normal(ks[0], (T, MOE_D), jnp.float32).astype(MOE_DTYPE)
    top, ids = jax.lax.top_k(jax.random.normal(ks[1], (T, MOE_E), jnp.float32), MOE_K)
    w = jax.nn.softmax(top, -1).astype(MOE_DTYPE)
    wt = lambda k, s: (0.05 * jax.random.normal(k, s, jnp.float32)).astype(MOE_DTYPE)  # noqa: E731
    up, gate = wt(ks[2], (MOE_E, MOE_D, MOE_F)), wt(ks[3], (MOE_E, MOE_D, MOE_F))
    down = wt(ks[4], (MOE_E, MOE_F, MOE_D))
    fl = 2 * T * MOE_K * 3 * MOE_D * MOE_F
    extra = dict(experts=MOE_E, top_k=MOE_K)
    for impl in impls:
        f = (lambda impl: lambda x, up, gate, down: moe_experts(
            x, ids, w, up_edf=up, down_efd=down, gate_edf=gate, implementation=impl))(impl)
        run_case(rows, "moe", impl, T, "fwd", f, (x, up, gate, down), fl, deadline, extra)

        def fb(x, up, gate, down, f=f):
            return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3))(x, up, gate, down)
        run_case(rows, "moe", impl, T, "fwd+bwd", fb, (x, up, gate, down), 3 * fl, deadline, extra)


def measure_peak(rows):
    a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    t = timeit(f, (a, b), max_iters=10)
    record(rows, op="matmul_8192_bf16", impl="xla", T=8192, mode="fwd", status="ok", ms=t * 1e3,
           tflops=2 * 8192**3 / t / 1e12)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", default="2048,8192,32768")
    ap.add_argument("--ops", default="ttt_attention,soft_ce")
    # fast paths first, the O(T^2) baselines last (at T=32768 they spend minutes failing to compile)
    ap.add_argument("--ttt-impls", default="triton,pallas_gpu,xla,reference,masked")
    ap.add_argument("--ttt-doc-lens", default="0", help="comma list: 0 = one document a row; L > 0 = rows "
                    "packed with documents of L tokens (segment ids), e.g. 0,1024 for a 4096-token row")
    ap.add_argument("--quadratic-max-T", type=int, default=8192,
                    help="skip the O(T^2) baselines (masked, reference) above this T")
    ap.add_argument("--ce-impls", default="triton,pallas_gpu,xla_saved,xla,reference")
    ap.add_argument("--ce-teachers", default="hidden,logits")
    ap.add_argument("--moe-impls", default="xla,reference", help="with --ops moe")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip the remaining cases after this long")
    ap.add_argument("--out", default=None, help="JSON lines file for the results")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU smoke test of this script)")
    a = ap.parse_args()
    if a.small:
        global HQ, HKV, D, H, VD, MOE_E, MOE_K, MOE_D, MOE_F, MOE_DTYPE
        HQ, HKV, D, H, VD = 4, 2, 16, 64, 500
        MOE_E, MOE_K, MOE_D, MOE_F, MOE_DTYPE = 32, 2, 64, 64, jnp.float32
    deadline = time.time() + a.budget_s
    rows: list = []
    dev = jax.devices()[0]
    print(f"# {dev.device_kind} jax {jax.__version__} python {sys.version.split()[0]} "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    if not a.small:
        measure_peak(rows)
    for T in [int(x) for x in a.T.split(",")]:
        if "ttt_attention" in a.ops:
            impls = [i for i in a.ttt_impls.split(",") if T <= a.quadratic_max_T or i not in ("masked", "reference")]
            for doc_len in [int(x) for x in a.ttt_doc_lens.split(",")]:
                bench_ttt(rows, T, impls, deadline, doc_len)
        if "soft_ce" in a.ops:
            bench_ce(rows, T, a.ce_impls.split(","), deadline, a.ce_teachers.split(","))
        if "moe" in a.ops:
            bench_moe(rows, T, a.moe_impls.split(","), deadline)
    if a.out:
        with open(a.out, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    ok = [r for r in rows if r.get("status") == "ok"]
    print(f"\n{'op':14s} {'impl':10s} {'T':>6s} {'mode':8s} {'ms':>9s} {'GiB':>7s} {'TFLOP/s':>8s}")
    for r in ok:
        print(f"{r['op'][:14]:14s} {r['impl']:10s} {r['T']:6d} {r['mode']:8s} {r['ms']:9.3f} "
              f"{(r.get('mem_gib') or 0):7.2f} {r['tflops']:8.1f} {r.get('teacher', '')}")
    for r in rows:
        if r.get("status") != "ok":
            print(r["op"], r["impl"], r["T"], r["mode"], r.get("teacher", ""), r["status"])


if __name__ == "__main__":
    main()

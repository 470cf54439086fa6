"""One routed-expert layer under jax.vmap, as the batched decoders call it: V vmapped rows of T tokens.

Three ways per backend, in one process:
  fold      `moe_experts` under vmap: its rule folds the vmapped axis into the token axis (one call)
  map       each vmapped row as its own call (lax.map), what the mgpu path did before the fold
  native    the backend's own vmap (the backend function vmapped directly; mgpu has none)

    python benchmarks/moe_vmap.py [--impl mgpu,pallas_gpu,xla] [--v 8] [--t 6] [--experts 128] [--k 8]
        [--hidden 2048] [--inter 768] [--dtype bfloat16] [--iters 20] [--out results.json]

Defaults: one Qwen3-30B-A3B MoE layer. The weights are arguments of the jitted functions (captured as
constants they would be folded into the program and the compiles stall). ms = median of `--iters`
calls after one warm-up; `rel` = max |out - fold| / max |fold| per way.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_results  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "kernels"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="mgpu,pallas_gpu,xla")
    ap.add_argument("--v", type=int, default=8)
    ap.add_argument("--t", type=int, default=6)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from specjax_kernels.moe import api

    dt = jnp.dtype(a.dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    e, d, f = a.experts, a.hidden, a.inter
    x = jax.random.normal(keys[0], (a.v, a.t, d), dt)
    logits = jax.random.normal(keys[1], (a.v, a.t, e), jnp.float32)
    w, ids = jax.lax.top_k(jax.nn.softmax(logits, -1), a.k)
    w = w.astype(dt)
    gate = (jax.random.normal(keys[2], (e, d, f), jnp.float32) * 0.02).astype(dt)
    up = (jax.random.normal(keys[3], (e, d, f), jnp.float32) * 0.02).astype(dt)
    down = (jax.random.normal(keys[4], (e, f, d), jnp.float32) * 0.02).astype(dt)

    def timed(fn, *args):
        out = jax.block_until_ready(fn(*args))
        walls = []
        for _ in range(a.iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            walls.append(time.perf_counter() - t0)
        return out, 1e3 * statistics.median(walls)

    rows = []
    for impl in a.impl.split(","):
        one = lambda x, i, w, g, u, dn: api.moe_experts(  # noqa: E731
            x, i, w, up_edf=u, down_efd=dn, gate_edf=g, implementation=impl)
        ways = {"fold": jax.jit(jax.vmap(one, in_axes=(0, 0, 0, None, None, None))),
                "map": jax.jit(lambda x, i, w, g, u, dn: jax.lax.map(lambda r: one(*r, g, u, dn), (x, i, w)))}
        try:
            _, backend = api.select("moe", api.IMPLEMENTATIONS, api.PREFERENCE, impl)
            if impl != "mgpu":
                ways["native"] = jax.jit(jax.vmap(lambda x, i, w, g, u, dn: backend(x, i, w, u, dn, g, "silu"),
                                                  in_axes=(0, 0, 0, None, None, None)))
        except Exception as err:  # noqa: BLE001 - an unavailable backend is reported, not fatal
            print(f"{impl}: unavailable ({err})", flush=True)
            continue
        ref = None
        row = {"impl": impl}
        for name, fn in ways.items():
            try:
                out, ms = timed(fn, x, ids, w, gate, up, down)
            except Exception as err:  # noqa: BLE001
                row[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
                continue
            out = out.astype(jnp.float32)
            ref = out if ref is None else ref
            rel = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
            row[name] = {"ms": round(ms, 3), "rel": rel}
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": platform.node(), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "shape": {"V": a.v, "T": a.t, "E": e, "k": a.k, "D": d, "F": f, "dtype": a.dtype}, "rows": rows}
    return write_results(result, a.out)


if __name__ == "__main__":
    sys.exit(main())

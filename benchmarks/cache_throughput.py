"""Training from a state cache against the online step (issue 58's goals): EAGLE-3 training tokens/s
cached vs online, bytes per token on disk (bf16, FP8, top-k teacher) and precompute tokens/s, one GPU.

    # one GPU (H100 80 GB or H200), both shapes, one model per subprocess (clean GPU memory); about
    # 200-250 s per model with these defaults (the --budget-s guards skip stages past it)
    JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:$PWD:$PWD/kernels:$PWD/converters XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 \
        python3 benchmarks/cache_throughput.py --models llama3_8b,qwen3_30b_a3b --rows 32 --steps 6 \
        --work-dir /tmp/cachebench --out cache_throughput.json
    # one model, more rows, the caches kept afterwards
    ... python3 benchmarks/cache_throughput.py --models llama3_8b --rows 64 --keep-caches --work-dir DIR --out FILE
    # CPU smoke run at toy widths, both shapes in this process (tests/unit/test_cache_throughput_script.py)
    PYTHONPATH=.:kernels:converters python benchmarks/cache_throughput.py --tiny

Per model (the shapes of benchmarks/train_throughput.py: model_hf(), its EAGLE-3 draft with Vd=32000,
K=7 TTT steps, AdamW, bf16 compute, and its random target weights made on the device, so nothing is
downloaded and no checkpoint is written), rows of B x 4096 random tokens (one document per row,
every token a loss token; B = 4 for the 8B shape, 2 for the MoE):
  online   : specjax.train.step.build_step_fns with the whole target (target forward + teacher from
             its final hidden and lm_head + TTT unroll + AdamW), batches already on the device.
  per storage variant (bf16 states; fp8 states; top-k teacher k=64 with fp8 states), in turn:
    precompute : specjax.precompute's own states_fn / write_split (the jitted target forward, device_get,
                 quantisation and the tensorstore writes) over --rows rows into a fresh StateCache;
                 tokens/s over the write loop (the forward compiled before; the loop ends with the
                 writes in the page cache, as precompute's does: fsync_drop_s is the flush after it),
                 also the forward alone;
                 bytes per token from the files on disk beside state_bytes_per_token's estimate.
    cached     : the same step built as a target.source=cache run builds it (batch_keys =
                 cached_batch_keys(k), target params = the embedding and lm_head only), fed by
                 make_cache_iterator (grain, the batch size above) and the training loop's global_batch;
                 the cache's pages are dropped from the page cache first (fsync + POSIX_FADV_DONTNEED),
                 so reads come from the disk. Also the step alone on one batch already on the device.
    then the cache folder is removed (--keep-caches keeps it).
Memory: the compiled step's plan (arguments + outputs + temporaries - donated aliases), which holds the
whole target online and only the embedding + lm_head cached; the target weights' bytes beside it
(the cached runs here keep the target resident for the next precompute; a real cached run does not).
Timing: wall clock over --steps steps after --warmup steps, synchronised at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (os.path.join(ROOT, "converters"), os.path.join(ROOT, "kernels"), ROOT, HERE):
    if p not in sys.path:
        sys.path.insert(0, p)

from _results import write_results  # noqa: E402
import train_throughput as tt  # noqa: E402

VARIANTS = {"bf16": ("bfloat16", 0), "fp8": ("float8_e4m3fn", 0), "topk": ("float8_e4m3fn", None)}
DEFAULT_BATCH = {"llama3_8b": 4, "qwen3_30b_a3b": 2}


def variant_names(spec: str, top_k: int) -> list[tuple[str, str, int]]:
    """(name, cache dtype, teacher_top_k) of each comma-separated variant: bf16, fp8, topk."""
    out = []
    for v in filter(None, spec.split(",")):
        if v not in VARIANTS:
            raise ValueError(f"unknown variant {v!r}; choose from {list(VARIANTS)}")
        dtype, k = VARIANTS[v]
        out.append((f"topk{top_k}_fp8" if k is None else v, dtype, top_k if k is None else 0))
    return out


def folder_bytes(path: str) -> tuple[int, int]:
    """(sum of file sizes, bytes allocated on disk) of every file below `path`."""
    size = alloc = 0
    for d, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(d, f))
            size += st.st_size
            alloc += getattr(st, "st_blocks", 0) * 512
    return size, alloc


def drop_page_cache(path: str) -> bool:
    """Write back and evict `path`'s files from the page cache, so the next reads come from the disk."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for d, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def plan_bytes(compiled) -> int | None:
    ma = compiled.memory_analysis()
    if ma is None:
        return None
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes)


def tree_bytes(tree) -> int:
    import jax
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


def run_model(model: str, args, emit) -> None:
    """Every measurement of one model shape; each result row goes to `emit` as it is made."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    from jax.sharding import NamedSharding

    from specjax import mesh as meshlib
    from specjax.config import OptimConfig
    from specjax.data.state_cache import StateCache, state_bytes_per_token
    from specjax.drafts import eagle3
    from specjax.drafts.ttt import TTTConfig
    from specjax.precompute import states_fn, write_split
    from specjax.targets.abstract import make_target
    from specjax.targets.base import tree_get, tree_set
    from specjax.targets.loading import embedding_and_head_paths
    from specjax.train.cache_source import make_cache_iterator
    from specjax.train.loop import global_batch
    from specjax.train.optim import make_optimizer
    from specjax.train.step import build_step_fns, cached_batch_keys, init_state

    t_model = time.perf_counter()
    tiny = args.tiny
    hf = tt.model_hf(model, tiny)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    state_dtype = np.float32 if tiny else ml_dtypes.bfloat16  # what a run reads a cache as (target.dtype)
    K, Vd, T = (2, 64, 64) if tiny else (7, 32000, args.seq)
    B = args.batch or (4 if tiny else DEFAULT_BATCH.get(model, 2))
    n_rows = max(args.rows, B)
    V = hf["vocab_size"]

    t0 = time.perf_counter()
    target = make_target(hf)
    tparams = tt.jax_random_params(target, dtype, 0)
    jax.block_until_ready(tparams)
    head = {}
    for path in embedding_and_head_paths(type(target), target.config):
        tree_set(head, path, tree_get(tparams, path))
    aux = tt.default_aux_ids(hf["num_hidden_layers"])
    dcfg = eagle3.config_from_target(target.config, draft_vocab_size=Vd, aux_layer_ids=aux)
    ids, t2d, d2t = tt.vocab_arrays(V, Vd, 0)
    vocab = {"draft_ids": jnp.asarray(ids, jnp.int32), "t2d": jnp.asarray(t2d), "d2t": jnp.asarray(d2t, jnp.int32)}
    mesh = meshlib.make_mesh({}, devices=jax.devices()[:1])  # one device
    opt = make_optimizer(OptimConfig(lr=1e-3 if tiny else 1e-4, warmup_ratio=0.0, grad_clip=0.5), 100000)
    draft0 = eagle3.init_draft_params(dcfg, jax.random.key(1))
    ttt = TTTConfig(ttt_steps=K, step_decay=0.8)
    batch_sharding = NamedSharding(mesh, meshlib.logical_to_pspec(meshlib.BATCH_LOGICAL, mesh))
    copts = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    data = tt.fixed_batch(n_rows, T, V, 100)
    rows = [{k: v[i] for k, v in data.items()} for i in range(n_rows)]
    common = {"model": model, "batch": B, "seq": T, "rows": n_rows, "aux_ids": list(aux),
              "hidden": hf["hidden_size"], "backend": jax.default_backend(), "device": str(jax.devices()[0]),
              "target_bytes": tree_bytes(tparams), "head_bytes": tree_bytes(head)}
    emit({**common, "variant": "setup", "setup_s": time.perf_counter() - t0})

    def over_budget():
        return time.perf_counter() - t_model > args.budget_s

    def new_state(fns):
        return jax.jit(lambda p: init_state(p, opt), out_shardings=fns.state_shardings)(draft0)

    def timed_steps(compiled, state, params, batches, warmup=args.warmup, steps=args.steps):
        """(seconds per step, state, losses) over `steps` batches (batches(i) gives a device batch) after
        `warmup` more."""
        for i in range(warmup):
            state, m = compiled(state, params, vocab, batches(i))
        jax.block_until_ready(state)
        t = time.perf_counter()
        ms = []
        for i in range(steps):
            state, m = compiled(state, params, vocab, batches(warmup + i))
            ms.append(m)
        jax.block_until_ready((state, ms))
        return (time.perf_counter() - t) / steps, state, [float(m["loss"]) for m in ms]

    def compile_step(fns, params, batch):
        t = time.perf_counter()
        compiled = fns.train_step.lower(new_state(fns), params, vocab, batch).compile(compiler_options=copts)
        return compiled, time.perf_counter() - t

    # ---- online: the whole target in the step
    online_tok_s = None
    res = {**common, "variant": "online"}
    t_stage = time.perf_counter()
    try:
        fns = build_step_fns(target, tparams, draft0, dcfg, ttt, opt, mesh, dtype)
        pool = [{k: jax.device_put(jnp.asarray(v[i * B:(i + 1) * B]), batch_sharding) for k, v in data.items()}
                for i in range(min(2, n_rows // B))]
        compiled, res["compile_s"] = compile_step(fns, tparams, pool[0])
        res["plan_bytes"] = plan_bytes(compiled)
        step_s, _, res["losses"] = timed_steps(compiled, new_state(fns), tparams, lambda i: pool[i % len(pool)])
        res.update(ok=True, step_s=step_s, tok_s=B * T / step_s)
        online_tok_s = res["tok_s"]
        del compiled, pool
    except Exception as e:  # one failing stage must not lose the others' numbers
        res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}", trace=traceback.format_exc()[-2000:])
    res["stage_s"] = time.perf_counter() - t_stage
    emit(res)

    # ---- per storage variant: precompute, train from the cache, remove it
    states_fns: dict = {}
    for name, cdtype, k in variant_names(args.variants, args.top_k):
        res = {**common, "variant": name, "cache_dtype": cdtype, "teacher_top_k": k}
        if over_budget():
            emit({**res, "ok": False, "error": f"skipped: the model's time budget ({args.budget_s:.0f} s) is spent"})
            continue
        t_stage = time.perf_counter()
        path = os.path.join(args.work_dir, f"{model}_{name}")
        shutil.rmtree(path, ignore_errors=True)
        try:
            # precompute (specjax.precompute's states_fn and write_split, as `python -m specjax.precompute` runs them)
            cache = StateCache.create(path, {"benchmark": "cache_throughput", "model": model}, {"train": n_rows},
                                      seq_length=T, num_aux=len(aux), hidden=hf["hidden_size"], dtype=cdtype,
                                      rows_per_shard=B, teacher_top_k=k)  # precompute's default: a shard per write
            if k not in states_fns:
                states_fns[k] = states_fn(target, aux, k, vocab["draft_ids"] if k else None)
            states = states_fns[k]
            first = {key: jax.device_put(v[:B], batch_sharding) for key, v in data.items()}
            fwd = lambda: states(tparams, first["input_ids"], first["positions"], first["segment_ids"])  # noqa: E731
            t = time.perf_counter()
            jax.block_until_ready(fwd())
            res["precompute_compile_s"] = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(2):
                out = fwd()
            jax.block_until_ready(out)
            del out
            res["precompute_forward_tok_s"] = 2 * B * T / (time.perf_counter() - t)
            t = time.perf_counter()
            write_split(cache.split("train"), rows, states, tparams, B, batch_sharding, k, progress=False)
            res["precompute_s"] = time.perf_counter() - t
            res["precompute_tok_s"] = n_rows * T / res["precompute_s"]
            size, alloc = folder_bytes(path)
            res.update(disk_bytes=size, disk_alloc_bytes=alloc, bytes_per_token=size / (n_rows * T),
                       alloc_bytes_per_token=alloc / (n_rows * T),
                       estimate_bytes_per_token=state_bytes_per_token(len(aux), hf["hidden_size"], cdtype, k))
            t = time.perf_counter()  # precompute_s above ends with the writes in the page cache; this flushes them
            res["page_cache_dropped"] = drop_page_cache(path)
            res["fsync_drop_s"] = time.perf_counter() - t
            # training from the cache, as a target.source=cache run: embedding + lm_head only, grain reads
            keys = cached_batch_keys(k)
            cfns = build_step_fns(target, head, draft0, dcfg, ttt, opt, mesh, dtype, batch_keys=keys)
            it = make_cache_iterator(StateCache.open(path), B, 0, state_dtype)
            b0 = global_batch(next(it), cfns.batch_sharding, keys)
            compiled, res["compile_s"] = compile_step(cfns, head, b0)
            res["plan_bytes"] = plan_bytes(compiled)
            step_s, state, res["losses"] = timed_steps(
                compiled, new_state(cfns), head, lambda i: global_batch(next(it), cfns.batch_sharding, keys))
            res.update(step_s=step_s, tok_s=B * T / step_s)
            # the step alone (its batch already on the device): what the reads cost beside it
            only_s, _, _ = timed_steps(compiled, state, head, lambda i: b0, warmup=0, steps=min(args.steps, 3))
            res.update(step_only_s=only_s, step_only_tok_s=B * T / only_s, ok=True)
            if online_tok_s:
                res["ratio_vs_online"] = res["tok_s"] / online_tok_s
            del compiled, state, b0, it
        except Exception as e:
            res.update(ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}", trace=traceback.format_exc()[-2000:])
        if not args.keep_caches:
            shutil.rmtree(path, ignore_errors=True)
        res["stage_s"] = time.perf_counter() - t_stage
        emit(res)


# --------------------------------------------------------------------------------------------------
# driver: one subprocess per model (clean GPU memory), the table and the JSON
# --------------------------------------------------------------------------------------------------


def run_worker(model: str, args) -> list[dict]:
    """Run `model` in a subprocess under --model-timeout-s; its rows (also the ones before a crash)."""
    os.makedirs(args.work_dir, exist_ok=True)
    rows_file = os.path.join(args.work_dir, f"{model}_rows.jsonl")
    if os.path.exists(rows_file):
        os.remove(rows_file)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", model, "--worker-rows", rows_file,
           *[a for a in sys.argv[1:] if a != "--inprocess"], "--work-dir", args.work_dir]
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, timeout=args.model_timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    rows = []
    if os.path.exists(rows_file):
        with open(rows_file) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    if rc != 0:
        rows.append({"model": model, "variant": "worker", "ok": False, "error": f"worker exit {rc}",
                     "wall_s": time.perf_counter() - t})
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """One line per (model, variant) measured: the table's columns."""
    out = []
    for r in rows:
        if r.get("variant") in ("setup", "worker"):
            continue
        line = {"model": r["model"], "variant": r["variant"], "ok": bool(r.get("ok"))}
        for key in ("tok_s", "ratio_vs_online", "step_only_tok_s", "bytes_per_token", "alloc_bytes_per_token",
                    "estimate_bytes_per_token", "precompute_tok_s", "precompute_forward_tok_s", "plan_bytes",
                    "batch", "seq", "error"):
            if key in r:
                line[key] = r[key]
        # the target weights the step needs resident: all of them online, the embedding + lm_head cached
        line["step_weights_bytes"] = r.get("target_bytes" if r["variant"] == "online" else "head_bytes")
        out.append(line)
    return out


def table(lines: list[dict]) -> str:
    def f(v, fmt):
        return format("-", ">" + fmt.rstrip("f").split(".")[0]) if v is None else format(v, fmt)
    head = (f"{'model':<15} {'variant':<11} {'tok/s':>9} {'vs online':>9} {'step-only':>9} {'B/token':>9} "
            f"{'estimate':>9} {'precomp tok/s':>13} {'fwd tok/s':>10} {'plan GiB':>8}")
    out = [head, "-" * len(head)]
    for ln in lines:
        if not ln["ok"]:
            out.append(f"{ln['model']:<15} {ln['variant']:<11} FAILED: {ln.get('error', '')[:100]}")
            continue
        pb = ln.get("plan_bytes")
        out.append(f"{ln['model']:<15} {ln['variant']:<11} {f(ln.get('tok_s'), '9.0f')} "
                   f"{f(ln.get('ratio_vs_online'), '9.2f')} {f(ln.get('step_only_tok_s'), '9.0f')} "
                   f"{f(ln.get('bytes_per_token'), '9.0f')} {f(ln.get('estimate_bytes_per_token'), '9.0f')} "
                   f"{f(ln.get('precompute_tok_s'), '13.0f')} {f(ln.get('precompute_forward_tok_s'), '10.0f')} "
                   f"{f(None if pb is None else pb / 2**30, '8.2f')}")
    return "\n".join(out)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama3_8b,qwen3_30b_a3b")
    ap.add_argument("--variants", default="bf16,fp8,topk", help="bf16, fp8, topk (the top-k teacher, fp8 states)")
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--rows", type=int, default=32, help="rows precomputed per variant (>= the batch)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=0, help="rows per step (0: 4 for the 8B shape, 2 for the MoE)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=230.0,
                    help="per model: a variant not started by then is skipped")
    ap.add_argument("--model-timeout-s", type=float, default=270.0, help="per model subprocess: killed after")
    ap.add_argument("--work-dir", default=None, help="where the caches go (default: a folder in /tmp)")
    ap.add_argument("--keep-caches", action="store_true", help="leave the cache folders in --work-dir")
    ap.add_argument("--tiny", action="store_true", help="toy widths on CPU, both shapes in this process")
    ap.add_argument("--inprocess", action="store_true", help="every model in this process (no subprocess)")
    ap.add_argument("--out", default=None, help="the JSON results file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-rows", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        args.rows, args.steps, args.warmup = max(min(args.rows, 8), 4), min(args.steps, 3), 1
    args.work_dir = args.work_dir or os.path.join("/tmp", f"cache_throughput_{os.getpid()}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:  # one model in this process, each row appended to --worker-rows as it is made
        def emit(row):
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            with open(args.worker_rows, "a") as f:
                f.write(json.dumps(row) + "\n")
        run_model(args.worker, args, emit)
        return 0
    t0 = time.perf_counter()
    models = [m for m in args.models.split(",") if m]
    rows: list[dict] = []
    for model in models:
        if args.tiny or args.inprocess:
            os.makedirs(args.work_dir, exist_ok=True)
            run_model(model, args, rows.append)
        else:
            rows += run_worker(model, args)
    lines = summarise(rows)
    print(table(lines))
    if not args.keep_caches:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    result = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv,
              "wall_s": time.perf_counter() - t0, "summary": lines, "rows": rows}
    return write_results(result, args.out)


if __name__ == "__main__":
    sys.exit(main())

"""1 -> 2 GPU scaling and context-parallel sequence length of the EAGLE-3 train step (issue 7, item 8).

    # two H200 of one host (nvidia-h200-x2), < 8 minutes with the defaults
    JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:$PWD/kernels:$PWD python3 benchmarks/scaling.py --out DIR
    # CPU smoke run on 8 fake devices at tiny widths (tests/sharding/test_scaling_script.py)
    PYTHONPATH=kernels:. python benchmarks/scaling.py --tiny --out DIR

Target: a Llama-3.1-8B-shaped dense model (H 4096, MLP 14336, 32/8 heads of 128, vocab 128256) with
random bf16 weights; `--layers` (default 32 = the full depth) reduces the depth if memory or time
requires, and the JSON/markdown state the depth used. Draft: EAGLE-3 from the target's shape, draft
vocab 32000, 7 TTT steps, AdamW, bf16 compute. Target attention runs in query blocks of 512
(attention_q_block) so its score buffer is [B, 32, 512, T], not [B, 32, T, T].

(i) throughput, the same run (global batch B x T) on: 1 GPU; 2 GPUs data=2; 2 GPUs fsdp=2, the frozen target
    sharded over fsdp and kept whole (parallelism.target_sharding=replicated).
    tokens/s = B*T*steps / wall time of the timed steps (after a warm-up step that compiles),
    per GPU = / devices; scaling = tokens/s(2 GPUs) / tokens/s(1 GPU).
(ii) longest sequence at batch 1 that trains, context=1 (1 GPU) vs context=2 (2 GPUs, the explicit
    context-parallel paths of docs/architecture.md): doubling from --search-start (or a jump to just
    below where the last two plans extrapolate to the limit), then bisection to --search-step
    tokens. A length "fits" when XLA's compiled per-device plan (arguments + outputs
    + temporaries - donated) is below the device's bytes_limit and one real step then runs without a
    RESOURCE_EXHAUSTED error. The search stops at the time budget and reports the bracket it has.
Everything is written to --out: scaling.json and scaling.md (a markdown table).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (ROOT, os.path.join(ROOT, "kernels")):
    if p not in sys.path:
        sys.path.insert(0, p)

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=65536)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for scaling.json and scaling.md")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny widths on 8 fake devices")
    ap.add_argument("--layers", type=int, default=None, help="target depth (default: 32, --tiny: 3)")
    ap.add_argument("--batch", type=int, default=None, help="global batch rows for (i) (default 4; tiny 4)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length for (i) (default 4096; tiny 64)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per config (default 5; tiny 2)")
    ap.add_argument("--ttt-steps", type=int, default=None, help="TTT steps (default 7; tiny 2)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="draft vocab (default 32000; tiny 128)")
    ap.add_argument("--search-start", type=int, default=None, help="first length tried in (ii) (default 16384)")
    ap.add_argument("--search-step", type=int, default=None, help="bisection resolution (default 4096)")
    ap.add_argument("--search-max", type=int, default=None, help="largest length tried (default 1048576)")
    ap.add_argument("--mem-limit-gb", type=float, default=None,
                    help="per-device memory limit for (ii); default: the device's bytes_limit (CPU: required, "
                         "--tiny uses 0.02)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget for the whole script (default 390 s; tiny 300 s); probes that would not finish in it are not started")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-context", action="store_true")
    return ap.parse_args(argv)


def _defaults(a):
    tiny = a.tiny
    d = dict(layers=3 if tiny else 32, batch=4, seq=64 if tiny else 4096, steps=2 if tiny else 5,
             ttt_steps=2 if tiny else 7, draft_vocab=128 if tiny else 32000,
             search_start=128 if tiny else 16384, search_step=128 if tiny else 4096,
             search_max=4096 if tiny else 1 << 20, mem_limit_gb=0.02 if tiny else None,
             budget_s=300.0 if tiny else 390.0)
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


class Bench:
    def __init__(self, args):
        import jax
        import jax.numpy as jnp
        import numpy as np

        from specjax.targets.llama import LlamaTarget, LlamaTargetConfig

        self.a, self.jax, self.jnp, self.np = args, jax, jnp, np
        self.t0 = time.time()
        shape = dict(TINY if args.tiny else LLAMA_8B, num_hidden_layers=args.layers)
        self.shape = shape
        self.dtype = jnp.float32 if args.tiny else jnp.bfloat16
        base = LlamaTargetConfig.create(architecture="LlamaForCausalLM", **shape)
        self.cfg = dataclasses.replace(base, kernels=dataclasses.replace(base.kernels, target_attention_q_block=512))
        t = time.time()
        self.target = LlamaTarget.init(self.cfg, jax.random.key(0), self.dtype)
        jax.block_until_ready(self.target.params)
        self.init_s = time.time() - t
        self.devices = jax.devices()
        self.probe_s = 0.0  # longest compile + one step seen so far (budget planning)

    def left(self):
        return self.a.budget_s - (time.time() - self.t0)

    # ---- one configuration: build, compile, (run) -------------------------------------------------
    def build(self, sizes, n_dev, B, T, target_exclude=()):
        jax, jnp, np = self.jax, self.jnp, self.np
        from specjax import mesh as meshlib
        from specjax.config import OptimConfig
        from specjax.drafts import eagle3
        from specjax.drafts.ttt import TTTConfig
        from specjax.train.optim import make_optimizer
        from specjax.train.step import BATCH_KEYS, build_step_fns, init_state

        mesh = meshlib.make_mesh(sizes, self.devices[:n_dev])
        V, Vd = self.cfg.vocab_size, self.a.draft_vocab
        dcfg = eagle3.config_from_target(self.cfg, draft_vocab_size=Vd,
                                         aux_layer_ids=self.target.default_aux_layer_ids())
        dparams = eagle3.init_draft_params(dcfg, jax.random.key(1))
        opt = make_optimizer(OptimConfig(), 1000)
        ttt = TTTConfig(ttt_steps=self.a.ttt_steps)
        fns = build_step_fns(self.target, self.target.params, dparams, dcfg, ttt, opt, mesh, self.dtype,
                             target_exclude=target_exclude)
        rng = np.random.default_rng(0)
        draft_ids = np.sort(rng.choice(V, Vd, replace=False))
        vocab = {"draft_ids": jnp.asarray(draft_ids, jnp.int32),
                 "t2d": jnp.zeros(V, bool).at[draft_ids].set(True),
                 "d2t": jnp.asarray(draft_ids - np.arange(Vd), jnp.int32)}
        # packed rows: documents of 1024 tokens (or T when shorter), positions restart per document
        doc = min(T, 1024)
        seg = (np.arange(T) // doc + 1).astype(np.int32)
        batch = {"input_ids": rng.integers(0, V, (B, T)).astype(np.int32),
                 "loss_mask": np.ones((B, T), np.int32),
                 "segment_ids": np.broadcast_to(seg, (B, T)).copy(),
                 "positions": np.broadcast_to((np.arange(T) % doc).astype(np.int32), (B, T)).copy()}

        def abstract(tree, sh):
            return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)

        state_abs = jax.eval_shape(lambda p: init_state(p, opt), dparams)
        batch_abs = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=fns.batch_sharding) for k in BATCH_KEYS}
        with meshlib.use_mesh(mesh):  # the explicit context-parallel paths are traced under the mesh
            lowered = fns.train_step.lower(abstract(state_abs, fns.state_shardings),
                                           abstract(self.target.params, fns.target_shardings),
                                           abstract(vocab, fns.vocab_shardings), batch_abs)
        t = time.time()
        compiled = lowered.compile()
        compile_s = time.time() - t
        mem = compiled.memory_analysis()
        plan = None
        if mem is not None:
            plan = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                    - mem.alias_size_in_bytes)

        def materialise():
            state = jax.device_put(init_state(dparams, opt), fns.state_shardings)
            tparams = jax.device_put(self.target.params, fns.target_shardings)
            v = jax.device_put(vocab, fns.vocab_shardings)
            b = {k: jax.device_put(batch[k], fns.batch_sharding) for k in BATCH_KEYS}
            return state, tparams, v, b

        return compiled, materialise, compile_s, plan

    # ---- (i) throughput --------------------------------------------------------------------------
    def throughput(self):
        a, jax = self.a, self.jax
        rows = []
        # fsdp=2 twice: the frozen target sharded like the draft (all-gathered every step) and kept whole
        # on both GPUs (parallelism.target_sharding=replicated: only the draft and optimizer are sharded)
        configs = [("1 GPU", {"data": 1}, 1, ()), ("2 GPUs data=2", {"data": 2}, 2, ()),
                   ("2 GPUs fsdp=2", {"fsdp": 2}, 2, ()),
                   ("2 GPUs fsdp=2, target replicated", {"fsdp": 2}, 2, ("fsdp",))]
        for name, sizes, n, exclude in configs:
            row = {"config": name, "mesh": sizes, "devices": n, "batch": [a.batch, a.seq],
                   "target_sharding": "replicated" if exclude else "fsdp"}
            try:
                compiled, materialise, compile_s, plan = self.build(sizes, n, a.batch, a.seq, exclude)
                state, tparams, vocab, batch = materialise()
                state, m = compiled(state, tparams, vocab, batch)  # warm-up (first touch, autotuning)
                jax.block_until_ready(m["loss"])
                t = time.time()
                for _ in range(a.steps):
                    state, m = compiled(state, tparams, vocab, batch)
                jax.block_until_ready(m["loss"])
                wall = time.time() - t
                tps = a.batch * a.seq * a.steps / wall
                self.note({"compile_s": compile_s, "step_s": wall / a.steps})
                row.update(compile_s=round(compile_s, 1), step_s=wall / a.steps, tokens_per_s=tps,
                           tokens_per_s_per_gpu=tps / n, plan_bytes_per_device=plan, loss=float(m["loss"]))
                del state, tparams, vocab, batch, compiled
            except Exception as e:  # report and go on: one failed config must not lose the others
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                traceback.print_exc()
            print(json.dumps(row), flush=True)
            rows.append(row)
        base = next((r for r in rows if r["devices"] == 1 and "tokens_per_s" in r), None)
        for r in rows:
            if base and "tokens_per_s" in r:
                r["scaling_vs_1gpu"] = r["tokens_per_s"] / base["tokens_per_s"]
        return rows

    # ---- (ii) longest sequence ------------------------------------------------------------------------
    def fits(self, sizes, n, T, limit):
        rec = {"seq": T}
        try:
            compiled, materialise, compile_s, plan = self.build(sizes, n, 1, T)
            rec.update(compile_s=round(compile_s, 1), plan_bytes_per_device=plan)
            if plan is not None and plan > limit:
                rec["fits"] = False
                rec["why"] = "compiled plan above the memory limit"
                return rec
            state, tparams, vocab, batch = materialise()
            t = time.time()
            state, m = compiled(state, tparams, vocab, batch)
            loss = float(m["loss"])
            rec.update(step_s=round(time.time() - t, 2), loss=loss, fits=bool(loss == loss))
            del state, tparams, vocab, batch, compiled
        except Exception as e:
            msg = str(e)
            if "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower():
                rec.update(fits=False, why="RESOURCE_EXHAUSTED (compiling or running)")
            else:
                raise
        return rec

    def longest(self, context, budget):
        a = self.a
        sizes = {"context": context}
        limit = self.limit_bytes()
        t_end = time.time() + budget
        probes, good, bad = [], 0, None
        T = a.search_start
        # a probe is a compile plus one step: do not start one that cannot finish inside the budget
        room = lambda: time.time() + 1.5 * self.probe_s < t_end
        while T <= a.search_max and room():  # doubling
            r = self.fits(sizes, context, T, limit)
            self.note(r)
            probes.append(r)
            print(json.dumps({"context": context, **r}), flush=True)
            if not r["fits"]:
                bad = T
                break
            good = T
            T = self.next_length(probes, T, limit)
        while bad is not None and bad - good > a.search_step and room():  # bisection
            mid = (good + bad) // 2 // a.search_step * a.search_step
            if mid <= good:
                break
            r = self.fits(sizes, context, mid, limit)
            self.note(r)
            probes.append(r)
            print(json.dumps({"context": context, **r}), flush=True)
            good, bad = (mid, bad) if r["fits"] else (good, mid)
        done = bad is not None and bad - good <= a.search_step or (bad is None and T > a.search_max)
        return {"context": context, "devices": context, "longest_fitting_seq": good, "first_failing_seq": bad,
                "resolution": a.search_step, "complete": bool(done), "probes": probes}

    def note(self, r):
        """Keep the longest compile + step seen: the time a new probe is expected to take."""
        self.probe_s = max(self.probe_s, r.get("compile_s", 0) + r.get("step_s", 0))

    def next_length(self, probes, T, limit):
        """Double, unless the last two fitting plans extrapolate (linearly in T) to the limit sooner:
        then jump just below that point (memory grows at least linearly, so this rarely overshoots)."""
        a = self.a
        fit = [p for p in probes if p.get("fits") and p.get("plan_bytes_per_device")]
        if len(fit) >= 2:
            (t0, p0), (t1, p1) = [(p["seq"], p["plan_bytes_per_device"]) for p in fit[-2:]]
            if p1 > p0 and t1 > t0:
                guess = t1 + (limit - p1) * (t1 - t0) / (p1 - p0)
                guess = int(0.97 * guess) // a.search_step * a.search_step
                if T + a.search_step <= guess < 2 * T:
                    return guess
        return 2 * T

    def limit_bytes(self):
        if self.a.mem_limit_gb is not None:
            return int(self.a.mem_limit_gb * 2**30)
        stats = self.devices[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            raise SystemExit("this device reports no bytes_limit; pass --mem-limit-gb")
        return int(stats["bytes_limit"])


def markdown(report) -> str:
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"
    s = report["setup"]
    shape = "tiny Llama (--tiny smoke run)" if s["tiny"] else "Llama-3.1-8B shape"
    lines = [f"# Scaling of the EAGLE-3 train step ({s['platform']}, {s['device_kind']})", "",
             f"Target: {shape} at depth {s['target_layers']} of 32 ({s['dtype']}, random weights), "
             f"draft vocab {s['draft_vocab']}, {s['ttt_steps']} TTT steps. Target init {s['init_s']:.1f} s.", ""]
    if report.get("throughput"):
        lines += ["## (i) Throughput, the same run on 1 and 2 GPUs", "",
                  "| config | global batch | step (s) | tokens/s | tokens/s per GPU | scaling vs 1 GPU | plan/device (GiB) |",
                  "|---|---|---|---|---|---|---|"]
        for r in report["throughput"]:
            if "error" in r:
                lines.append(f"| {r['config']} | {r['batch'][0]}x{r['batch'][1]} | error: {r['error'][:80]} | | | | |")
                continue
            lines.append(f"| {r['config']} | {r['batch'][0]}x{r['batch'][1]} | {r['step_s']:.3f} | "
                         f"{r['tokens_per_s']:.0f} | {r['tokens_per_s_per_gpu']:.0f} | "
                         f"{r.get('scaling_vs_1gpu', float('nan')):.2f} | {gib(r['plan_bytes_per_device'])} |")
        lines.append("")
    if report.get("longest_sequence"):
        lines += ["## (ii) Longest sequence at batch 1", "",
                  f"Memory limit per device {gib(report['setup']['mem_limit_bytes'])} GiB.", "",
                  "| context (GPUs) | longest that trains | first that does not | resolution | search complete |",
                  "|---|---|---|---|---|"]
        for r in report["longest_sequence"]:
            lines.append(f"| {r['context']} | {r['longest_fitting_seq']} | {r['first_failing_seq'] or '-'} | "
                         f"{r['resolution']} | {'yes' if r['complete'] else 'no (time budget)'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = _defaults(parse_args(argv))
    # the search compares plans with the allocator's limit: let XLA's GPU allocator use most of the HBM
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    if a.tiny:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        try:  # before any JAX op; a no-op error when the caller (the test) already set up devices
            jax.config.update("jax_num_cpu_devices", 8)
        except RuntimeError:
            pass
    import jax

    if len(jax.devices()) < 2:
        raise SystemExit(f"scaling.py needs 2 devices, found {len(jax.devices())}")
    os.makedirs(a.out, exist_ok=True)
    bench = Bench(a)
    dev = jax.devices()[0]
    report = {"setup": {"platform": jax.default_backend(), "device_kind": dev.device_kind,
                        "jax": jax.__version__, "target_layers": a.layers, "target_shape": bench.shape,
                        "dtype": str(bench.dtype.dtype if hasattr(bench.dtype, "dtype") else bench.dtype),
                        "draft_vocab": a.draft_vocab, "ttt_steps": a.ttt_steps, "init_s": bench.init_s,
                        "tiny": a.tiny}}
    if not a.skip_throughput:
        report["throughput"] = bench.throughput()
    if not a.skip_context:
        report["setup"]["mem_limit_bytes"] = bench.limit_bytes()
        results = []
        for i, c in enumerate((1, 2)):
            results.append(bench.longest(c, max(bench.left(), 0) / (2 - i)))
        report["longest_sequence"] = results
    report["wall_s"] = time.time() - bench.t0
    with open(os.path.join(a.out, "scaling.json"), "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(os.path.join(a.out, "scaling.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

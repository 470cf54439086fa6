"""EAGLE-3 training and export on every target family (the tiny random targets of
tests/parity/test_decoding_families.py): a few jitted train steps (the loop's step functions, its
target forward with the family's aux taps, its teacher: soft-capped for Gemma 4) lower the loss on a
fixed batch, and the trained head exports with the target's config.json (the export validator's
draft/target rules: hidden sizes, aux ids against the depth, RoPE, the hybrids' KV heads) and reads
back through specjax.eval's importer as the same draft.

The families whose cache kind another one covers run under `-m slow` (loop_family_params: the same
split as the decoding loops); Nemotron-H has its own (tests/parity/test_targets_nemotron_h.py).
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))
import test_decoding_families as fam  # noqa: E402

from specjax import mesh as meshlib  # noqa: E402
from specjax.config import OptimConfig  # noqa: E402
from specjax.drafts import eagle3  # noqa: E402
from specjax.drafts.ttt import TTTConfig  # noqa: E402
from specjax.drafts.vocab import DraftVocab  # noqa: E402
from specjax.train.optim import make_optimizer  # noqa: E402
from specjax.train.step import build_step_fns, init_state  # noqa: E402

STEPS = 6
B, T = 2, 16


@pytest.mark.parametrize("name", fam.loop_family_params(list(fam.FAMILIES)))
def test_eagle3_steps_lower_the_loss_and_the_head_exports(name, tmp_path):
    from specjax_converters.eagle3_export import export_eagle3
    from specjax_converters.eagle3_import import read_head

    target = fam.build(name)
    aux = target.default_aux_layer_ids()
    V = target.config.vocab_size
    cfg = eagle3.config_from_target(target.config, draft_vocab_size=V // 2, aux_layer_ids=aux)
    vocab = DraftVocab.from_ids(np.arange(0, V, 2), V)
    params = eagle3.init_draft_params(cfg, jax.random.key(0))
    mesh = meshlib.make_mesh({"data": -1}, jax.devices()[:1])
    optimizer = make_optimizer(OptimConfig(lr=3e-3, warmup_ratio=0.0), STEPS)
    fns = build_step_fns(target, target.params, params, cfg, TTTConfig(ttt_steps=2), optimizer, mesh)
    tparams = jax.device_put(target.params, fns.target_shardings)
    varr = jax.device_put({"draft_ids": jnp.asarray(vocab.draft_ids, jnp.int32), "t2d": jnp.asarray(vocab.t2d),
                           "d2t": jnp.asarray(vocab.d2t, jnp.int32)}, fns.vocab_shardings)
    state = jax.jit(lambda p: init_state(p, optimizer), out_shardings=fns.state_shardings)(params)
    ids = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
    batch = jax.device_put({"input_ids": ids, "loss_mask": np.ones((B, T), np.int32),
                            "segment_ids": np.ones((B, T), np.int32),
                            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()},
                           fns.batch_sharding)
    losses = []
    for _ in range(STEPS):
        state, metrics = fns.train_step(state, tparams, varr, batch)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    trained = jax.tree_util.tree_map(np.asarray, state["params"])
    out = export_eagle3(trained, cfg, vocab, target.config.to_hf(), tmp_path / "head", dtype="fp32")
    head = read_head(out)
    assert head.config == cfg
    np.testing.assert_array_equal(head.params["fc"]["kernel"], trained["fc"]["kernel"])

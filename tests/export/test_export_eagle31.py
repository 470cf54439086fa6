"""EAGLE-3.1 training options in the JAX draft (Eagle3Config.fc_norm / norm_output, off by default).

Their forward semantics are checked against speculators (test_export_loaders.py); here: the
options only add to the plain draft (same other params, same logits when off), the TTT objective
uses them (gradient reaches fc_norm.{i}.scale; norm_output changes steps >= 1 only)."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from export._heads import FAST_COMPILE, H, V, inputs, make_draft
from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig, ttt_loss


def test_options_add_to_the_plain_draft():
    _, cfg, _, _ = make_draft(seed=0)
    plain = eagle3.init_draft_params(cfg, jax.random.key(3))
    with31 = eagle3.init_draft_params(dataclasses.replace(cfg, fc_norm=True, norm_output=True), jax.random.key(3))
    assert set(with31) - set(plain) == {"fc_norm"}
    assert {k: v["scale"].shape for k, v in with31["fc_norm"].items()} == {str(i): (H,) for i in range(3)}
    same = jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), plain,
                                  {k: v for k, v in with31.items() if k != "fc_norm"})
    assert all(jax.tree_util.tree_leaves(same))
    axes = eagle3.param_logical_axes(dataclasses.replace(cfg, fc_norm=True))
    assert axes["fc_norm"]["0"] == {"scale": ("norm",)}


@functools.partial(jax.jit, static_argnums=(1,), compiler_options=FAST_COMPILE)
def _loss_and_grad(params, cfg, batch):
    def f(p):
        return ttt_loss(p, cfg, TTTConfig(ttt_steps=3), **batch)

    (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(params)
    return loss, metrics["loss_k"], grads


def _batch(vocab, seed=0):
    d = inputs(seed, B=2, T=12)
    rng = np.random.default_rng(seed)
    B, T = d["x"].shape
    return {
        "input_ids": jnp.asarray(d["x"]), "loss_mask": jnp.ones((B, T), jnp.int32),
        "segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.asarray(d["positions"]),
        "aux_hidden": tuple(jnp.asarray(a) for a in d["aux"]),
        "final_hidden": jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32),
        "embed_table": jnp.asarray(0.5 * rng.standard_normal((V, H)), jnp.float32),
        "lm_head": jnp.asarray(rng.standard_normal((V, H)), jnp.float32),
        "draft_ids": jnp.asarray(vocab.draft_ids, jnp.int32), "t2d": jnp.asarray(vocab.t2d),
        "d2t": jnp.asarray(vocab.d2t, jnp.int32),
    }


def test_ttt_objective_uses_the_options():
    _, cfg, params, vocab = make_draft(seed=1, fc_norm=True)
    batch = _batch(vocab)
    cfg_no = dataclasses.replace(cfg, norm_output=False)
    cfg_yes = dataclasses.replace(cfg, norm_output=True)
    loss_no, steps_no, grads = _loss_and_grad(params, cfg_no, batch)
    loss_yes, steps_yes, _ = _loss_and_grad(params, cfg_yes, batch)
    assert np.isfinite(float(loss_no)) and np.isfinite(float(loss_yes))
    for i in range(3):  # fc_norm is trained
        assert float(jnp.max(jnp.abs(grads["fc_norm"][str(i)]["scale"]))) > 0
    # norm_output only changes what later steps read: step 0 identical, steps 1.. differ
    assert float(steps_no[0]) == float(steps_yes[0])
    assert abs(float(steps_no[1]) - float(steps_yes[1])) > 1e-6

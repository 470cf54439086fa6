"""The long-context TTT path (TTTConfig.long_context_tokens; specjax.drafts.ttt, "Long context"): each
TTT step rematerialised and the soft CE's teacher computed per vocab tile from the final hidden state.
It must compute the same function as the default path: loss, per-step losses, accuracies and every
gradient leaf, in fp64 to rtol 1e-10 (same math, another order) and in fp32 to rtol 1e-5 (gradients:
1e-5 of each leaf's norm, as tests/unit/test_ttt_reference.py states for fp32). And it must be the
other path: a remat in the jaxpr and no [B, T, Vd] teacher logits."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts.ttt import TTTConfig, ttt_loss, uses_long_context

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_ttt_reference import ttt_problem  # noqa: E402

T = 24  # ttt_problem's rows


def problem(norm_output=False, parallel=False, num_layers=1):
    return ttt_problem(norm_output, parallel=parallel, num_layers=num_layers, seed=3)


def cast(dtype, tree):
    return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def loss_and_grad(cfg, params, batch, dtype, long_context_tokens, cod_key=None):
    ttt = TTTConfig(ttt_steps=4, vocab_chunk=8, long_context_tokens=long_context_tokens)
    loss = lambda p: ttt_loss(p, cfg, ttt, **cast(dtype, batch), compute_dtype=dtype, cod_key=cod_key)
    fn = jax.value_and_grad(loss, has_aux=True)
    (total, m), g = jax.jit(fn, compiler_options={"xla_backend_optimization_level": 0})(cast(dtype, params))
    return loss, float(total), m, g


def assert_same(got, want, rtol, fp64):
    (_, gl, gm, gg), (_, wl, wm, wg) = got, want
    assert wl > 0 and np.all(np.asarray(wm["loss_k"]) > 0)
    np.testing.assert_allclose(gl, wl, rtol=rtol)
    np.testing.assert_allclose(np.asarray(gm["loss_k"]), np.asarray(wm["loss_k"]), rtol=rtol)
    np.testing.assert_array_equal(np.asarray(gm["acc_k"]), np.asarray(wm["acc_k"]))
    for x, y in zip(jax.tree_util.tree_leaves(gg), jax.tree_util.tree_leaves(wg), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if fp64:
            np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-13 * float(np.abs(y).max()))
        else:
            assert np.linalg.norm(x - y) <= rtol * np.linalg.norm(y), (np.linalg.norm(x - y), np.linalg.norm(y))


def eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from eqns(inner)


def test_threshold():
    assert not uses_long_context(TTTConfig(), 4096)
    assert uses_long_context(TTTConfig(), 32768) and uses_long_context(TTTConfig(), 131072)
    assert uses_long_context(TTTConfig(long_context_tokens=0), 1)


@pytest.mark.parametrize("norm_output,parallel,layers", [(False, False, 1), (True, False, 2), (False, True, 1)])
def test_long_context_path_equals_the_default_fp32(norm_output, parallel, layers):
    cfg, params, batch = problem(norm_output, parallel, layers)
    key = jax.random.key(5) if parallel else None
    long = loss_and_grad(cfg, params, batch, jnp.float32, 0, key)
    short = loss_and_grad(cfg, params, batch, jnp.float32, 10**9, key)
    assert_same(long, short, 1e-5, fp64=False)
    # the paths differ: the long one has a remat per step and never forms the [B, T, Vd] teacher logits
    for run, remat, teacher in ((long, True, False), (short, False, True)):
        jaxpr = jax.make_jaxpr(run[0])(params).jaxpr
        names = [e.primitive.name for e in eqns(jaxpr)]
        assert names.count("remat2") == (4 if remat else 0), sorted(set(names))  # jax.checkpoint
        shapes = {tuple(v.aval.shape) for e in eqns(jaxpr) for v in e.outvars if hasattr(v.aval, "shape")}
        assert ((2, T, cfg.draft_vocab_size) in shapes) == teacher


def test_long_context_path_equals_the_default_fp64():
    with jax.enable_x64(True):
        cfg, params, batch = problem(norm_output=True, num_layers=2)
        assert_same(loss_and_grad(cfg, params, batch, jnp.float64, 0),
                    loss_and_grad(cfg, params, batch, jnp.float64, 10**9), 1e-10, fp64=True)


def is_slow_case(test_name: str, params: dict) -> bool:
    """tests/conftest.py marks the two-layer EAGLE-3.1 case slow: the default run keeps the one-layer
    EAGLE-3 and P-EAGLE cases (fp32) and the fp64 case of the same path."""
    return test_name == "test_long_context_path_equals_the_default_fp32" and params["layers"] == 2

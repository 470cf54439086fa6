"""Checkpoints written before the train state lost its never-read "rng" entry still resume: the entry
is restored and dropped, and nothing else about the state is relaxed (a real shape change is still
refused)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specjax import checkpoint as ckpt
from specjax.train.step import init_state


def _params(width=4):
    return {"w": jnp.arange(width * 3, dtype=jnp.float32).reshape(width, 3), "b": jnp.ones((3,), jnp.float32)}


def _abstract(state):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), state)


def test_checkpoint_with_a_legacy_rng_entry_resumes_without_it(tmp_path):
    opt = optax.adam(1e-3)
    state = init_state(_params(), opt)
    assert "rng" not in state
    old_format = {**state, "step": jnp.asarray(7, jnp.int32), "rng": jax.random.key_data(jax.random.key(3))}
    mngr = ckpt.manager(str(tmp_path))
    ckpt.save(mngr, 7, old_format, meta={"note": "old format"})

    restored, meta, step = ckpt.restore_verified(mngr, _abstract(state))
    assert step == 7 and meta == {"note": "old format"}
    assert set(restored) == {"step", "params", "opt_state"}
    assert int(restored["step"]) == 7
    np.testing.assert_array_equal(np.asarray(restored["params"]["w"]), np.asarray(state["params"]["w"]))


def test_legacy_entries_do_not_hide_a_real_shape_change(tmp_path):
    opt = optax.adam(1e-3)
    old_format = {**init_state(_params(width=4), opt), "rng": jax.random.key_data(jax.random.key(3))}
    mngr = ckpt.manager(str(tmp_path))
    ckpt.save(mngr, 1, old_format)
    with pytest.raises(ckpt.CheckpointMismatch, match=r"params\.w: checkpoint \(4, 3\) != this config \(5, 3\)"):
        ckpt.restore_verified(mngr, _abstract(init_state(_params(width=5), opt)))

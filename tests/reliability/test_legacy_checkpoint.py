"""Checkpoints of older specjax versions still resume. One saved before the train state lost its
never-read "rng" entry: the entry is restored and dropped, and nothing else about the state is
relaxed (a real shape change is still refused). One saved before checkpoints recorded their run's
identity: it resumes with a warning that its data and draft vocabulary could not be checked, and
its settings are still compared with run_meta.json."""
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


def test_checkpoint_without_a_run_identity_resumes_with_a_warning(tiny_target, tmp_path, caplog):
    """A checkpoint of a specjax from before run identities (its meta: step and metrics only) still
    resumes; the log says its data and draft vocabulary could not be checked, and its settings are
    still compared with run_meta.json."""
    import json
    import logging

    from specjax.train.loop import train

    from _runs import inprocess_config

    out = tmp_path / "run"

    def cfg(*extra):
        return inprocess_config(tiny_target, out, "train.steps=4", "checkpoint.every_steps=2", *extra)

    assert train(cfg("train.stop_at_step=2")).final_step == 2
    meta_file = out / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert ckpt.IDENTITY in meta
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != ckpt.IDENTITY}))
    ckpt.write_checksums(str(out / "checkpoints"), 2)  # as the older specjax wrote it: it verifies
    with pytest.raises(ValueError, match=r"config optim\.lr: 0\.0001 -> 0\.002"):
        train(cfg("optim.lr=0.002"))  # run_meta.json still guards the settings
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specjax"):
        assert train(cfg()).final_step == 4
    warned = [r.getMessage() for r in caplog.records if "records no run identity" in r.getMessage()]
    assert len(warned) == 1 and f"checkpoint {out / 'checkpoints' / '2'} records no run identity" in warned[0]
    assert "data and draft vocabulary could not be checked" in warned[0]
    # the run's new checkpoint records the identity again
    assert ckpt.IDENTITY in json.loads((out / "checkpoints" / "4" / "meta" / "metadata").read_text())

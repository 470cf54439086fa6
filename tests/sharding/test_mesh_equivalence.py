"""Sharded training equals single-device training: 3 steps of the real jitted train step on meshes
of 8 fake CPU devices vs one device. Loss, gradient norm and the updated draft params must agree
within 1e-5 (fp32), and the shardings of params / optimizer state / batch must match the golden
table in golden_shardings.json (regenerate deliberately with SPECJAX_WRITE_GOLDEN=1)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import mesh as meshlib
from specjax.config import OptimConfig
from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig
from specjax.targets.llama import LlamaTarget, LlamaTargetConfig
from specjax.train.optim import make_optimizer
from specjax.train.step import BATCH_KEYS, build_step_fns, init_state

GOLDEN = os.path.join(os.path.dirname(__file__), "golden_shardings.json")
MESHES = {
    "fsdp8": {"data": 1, "fsdp": 8},
    "fsdp2_tp2_cp2": {"data": 1, "fsdp": 2, "tensor": 2, "context": 2},
    "dp2_tp4": {"data": 2, "tensor": 4},
}


def _setup():
    cfg = LlamaTargetConfig.create(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                                   intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16)
    target = LlamaTarget.init(cfg, jax.random.key(0), jnp.float32)
    dcfg = eagle3.config_from_target(cfg, draft_vocab_size=128, aux_layer_ids=(0, 1, 2))
    params = eagle3.init_draft_params(dcfg, jax.random.key(1), std=0.05)
    rng = np.random.default_rng(0)
    B, T = 8, 32
    ids = rng.integers(0, 256, (B, T)).astype(np.int32)
    seg = np.ones((B, T), np.int32)
    seg[:, 20:] = 2  # two packed documents per row
    seg[::2, 28:] = 0  # and padding
    pos = np.where(np.arange(T) < 20, np.arange(T), np.arange(T) - 20).astype(np.int32) * np.ones((B, 1), np.int32)
    batch = {"input_ids": ids, "loss_mask": (rng.random((B, T)) > 0.2).astype(np.int32) * (seg > 0),
             "segment_ids": seg, "positions": pos}
    draft_ids = np.sort(rng.choice(256, 128, replace=False))
    vocab = {"draft_ids": jnp.asarray(draft_ids, jnp.int32), "t2d": jnp.zeros(256, bool).at[draft_ids].set(True),
             "d2t": jnp.asarray(draft_ids - np.arange(128), jnp.int32)}
    return target, dcfg, params, batch, vocab


def _train(mesh_sizes, n_devices, target_exclude=()):
    target, dcfg, params, batch, vocab = _setup()
    mesh = meshlib.make_mesh(mesh_sizes, jax.devices()[:n_devices])
    opt = make_optimizer(OptimConfig(lr=1e-4, warmup_ratio=0.0), 10)  # the default lr
    fns = build_step_fns(target, target.params, params, dcfg, TTTConfig(ttt_steps=3, vocab_chunk=64), opt, mesh,
                         target_exclude=target_exclude)
    state = jax.device_put(init_state(params, opt), fns.state_shardings)
    tparams = jax.device_put(target.params, fns.target_shardings)
    vocab = jax.device_put(vocab, fns.vocab_shardings)
    gbatch = {k: jax.device_put(batch[k], fns.batch_sharding) for k in BATCH_KEYS}
    metrics = []
    for _ in range(3):
        state, m = fns.train_step(state, tparams, vocab, gbatch)
        metrics.append({k: float(m[k]) for k in ("loss", "grad_norm")})
    shardings = {
        "params": {jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in jax.tree_util.tree_flatten_with_path(state["params"])[0]},
        "opt_state": sorted({str(x.sharding.spec) for x in jax.tree_util.tree_leaves(state["opt_state"])}),
        "batch": str(gbatch["input_ids"].sharding.spec),
        "target": {jax.tree_util.keystr(p): str(x.sharding.spec) for p, x in jax.tree_util.tree_flatten_with_path(tparams)[0]},
    }
    return metrics, jax.device_get(state["params"]), shardings


@pytest.fixture(scope="module")
def single():
    return _train({"data": 1}, 1)


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_equals_single_device(single, name):
    ref_metrics, ref_params, _ = single
    metrics, params, shardings = _train(MESHES[name], 8)
    for a, b in zip(metrics, ref_metrics):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-5)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), params, ref_params)
    # the params really are sharded (not silently replicated) on these meshes
    assert any("fsdp" in s or "tensor" in s for s in shardings["params"].values())
    golden = json.load(open(GOLDEN)) if os.path.exists(GOLDEN) else {}
    if os.environ.get("SPECJAX_WRITE_GOLDEN"):
        golden[name] = shardings
        json.dump(golden, open(GOLDEN, "w"), indent=1, sort_keys=True)
    assert golden.get(name) == shardings, f"shardings for {name} changed; see {GOLDEN}"


def test_fsdp_with_the_target_replicated(single):
    """parallelism.target_sharding=replicated: on data=2 x fsdp=2 x tensor=2 the frozen target's weights
    keep no `fsdp` axis (whole on each fsdp shard, still tensor-sharded) while the draft stays
    FSDP-sharded, and three steps equal the single-device run (fp32, 1e-5)."""
    from specjax.config import ParallelismConfig

    assert ParallelismConfig(target_sharding="replicated").target_excluded_axes == ("fsdp",)
    assert ParallelismConfig().target_excluded_axes == ()
    ref_metrics, ref_params, _ = single
    for exclude in ((), ("fsdp",)):
        metrics, params, shardings = _train({"data": 2, "fsdp": 2, "tensor": 2}, 8, target_exclude=exclude)
        assert any("fsdp" in s for s in shardings["params"].values())  # the draft is FSDP-sharded either way
        assert any("fsdp" in s for s in shardings["target"].values()) == (not exclude), shardings["target"]
        assert any("tensor" in s for s in shardings["target"].values())
        np.testing.assert_allclose([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics], rtol=1e-5)
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), params, ref_params)

"""Shared by the sharding tests: packed batches and "train 3 steps on a mesh" (the real jitted step)."""
import jax
import jax.numpy as jnp
import numpy as np

from specjax import mesh as meshlib
from specjax.config import OptimConfig
from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig
from specjax.train.optim import make_optimizer
from specjax.train.step import BATCH_KEYS, build_step_fns, init_state

TOL = 1e-5


def packed_batch(B, T, vocab, seed=0):
    """Rows of several packed documents; boundaries at 5, 8 (a shard edge for C=4), 19, 27, padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        cuts = [0, 5, 8, 19, 27 if b % 2 else T, T]
        for s, (a, e) in enumerate(zip(cuts[:-1], cuts[1:])):
            seg[b, a:e] = s + 1
            pos[b, a:e] = np.arange(e - a)
        if b % 2:
            seg[b, 27:] = 0  # padding at the end of odd rows
            pos[b, 27:] = 0
    ids = rng.integers(0, vocab, (B, T)).astype(np.int32)
    lmask = (rng.random((B, T)) > 0.2).astype(np.int32) * (seg > 0)
    return {"input_ids": ids, "loss_mask": lmask, "segment_ids": seg, "positions": pos}


def train_3_steps(target, mesh_sizes, n_devices, batch, vocab_size, draft_vocab=128):
    dcfg = eagle3.config_from_target(target.config, draft_vocab_size=draft_vocab, aux_layer_ids=(0, 1, 2))
    params = eagle3.init_draft_params(dcfg, jax.random.key(1), std=0.05)
    rng = np.random.default_rng(0)
    draft_ids = np.sort(rng.choice(vocab_size, draft_vocab, replace=False))
    vocab = {"draft_ids": jnp.asarray(draft_ids, jnp.int32),
             "t2d": jnp.zeros(vocab_size, bool).at[draft_ids].set(True),
             "d2t": jnp.asarray(draft_ids - np.arange(draft_vocab), jnp.int32)}
    mesh = meshlib.make_mesh(mesh_sizes, jax.devices()[:n_devices])
    opt = make_optimizer(OptimConfig(lr=1e-4, warmup_ratio=0.0), 10)  # the default lr
    fns = build_step_fns(target, target.params, params, dcfg, TTTConfig(ttt_steps=2, vocab_chunk=128), opt, mesh)
    state = jax.device_put(init_state(params, opt), fns.state_shardings)
    tparams = jax.device_put(target.params, fns.target_shardings)
    vocab = jax.device_put(vocab, fns.vocab_shardings)
    gbatch = {k: jax.device_put(batch[k], fns.batch_sharding) for k in BATCH_KEYS}
    metrics = []
    with meshlib.use_mesh(mesh):  # traced here: the explicit context-parallel paths are on
        for _ in range(3):
            state, m = fns.train_step(state, tparams, vocab, gbatch)
            metrics.append((float(m["loss"]), float(m["grad_norm"])))
    return metrics, jax.device_get(state["params"]), fns


def assert_same_training(got, ref):
    (m, p, _), (m_ref, p_ref, _) = got, ref
    np.testing.assert_allclose(np.asarray(m), np.asarray(m_ref), rtol=TOL)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL), p, p_ref)

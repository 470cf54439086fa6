"""The train step: one pure function of (train state, target params, vocab arrays, batch), jitted
once with explicit in/out shardings and the train state donated.

state = {"step": int32[], "params": draft params, "opt_state": optax state}. The loss, the logical
axes of the params and the leaves the optimizer leaves alone come from the draft config's family
(specjax.drafts.family). The only randomness is the family's (P-EAGLE's COD row sampling, DFlash's
anchor draw), keyed by the step number, so the state holds no RNG; the draft's initial params come
from run.seed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax import mesh as meshlib
from specjax.drafts.families import family_of
from specjax.drafts.family import cached_state_keys

BATCH_KEYS = ("input_ids", "loss_mask", "segment_ids", "positions")


def cached_batch_keys(teacher_top_k: int = 0) -> tuple[str, ...]:
    """The arrays a batch read from an offline state cache (target.source: cache) feeds the step."""
    return BATCH_KEYS + cached_state_keys(teacher_top_k)


@dataclass(frozen=True)
class StepFns:
    train_step: Callable  # (state, target_params, vocab, batch) -> (state, metrics)
    eval_step: Callable  # (params, target_params, vocab, batch) -> metrics
    state_shardings: Any
    target_shardings: Any
    vocab_shardings: Any
    batch_sharding: NamedSharding
    batch_keys: tuple = BATCH_KEYS  # the arrays a batch feeds the step (cached_batch_keys: states from a cache)


def make_loss_fn(target, draft_cfg, objective, compute_dtype):
    """`loss_fn(draft_params, target_params, vocab, batch, step=None) -> (loss, metrics)` of the draft
    config's family (`objective`: what that family's make_objective built, e.g. a TTTConfig)."""
    return family_of(draft_cfg).loss_fn(target, draft_cfg, objective, compute_dtype)


def opt_state_shardings(optimizer, params, param_shardings, mesh: Mesh):
    abstract = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        optimizer, lambda _, s: s, abstract, param_shardings,
        transform_non_params=lambda _: replicated,
    )


def present_subtree(tree, like):
    """The part of nested dict `tree` at the paths `like` has (a target's logical axes for the weights
    a cache-fed run loads: the embedding and lm_head only)."""
    if not isinstance(like, dict):
        return tree
    return {k: present_subtree(tree[k], v) for k, v in like.items()}


def accumulated_value_and_grad(loss_fn, n: int, mesh: Mesh, batch_sharding):
    """`value_and_grad(loss_fn, has_aux=True)` over a batch split into `n` micro-batches computed in turn
    (lax.scan): the mean loss, metrics and gradient. Micro-batch m holds rows m, m + n, m + 2n, ...: with
    the rows block-sharded over the batch axes, every device keeps its share of each micro-batch."""
    vg = jax.value_and_grad(loss_fn, has_aux=True)
    if n == 1:
        return vg

    def split(x):
        return x.reshape((x.shape[0] // n, n) + x.shape[1:]).swapaxes(0, 1)

    def accumulated(params, target_params, vocab, batch, step=None):
        micro = jax.tree.map(split, batch)

        def one(carry, mb):
            mb = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, batch_sharding), mb)
            (loss, metrics), grads = vg(params, target_params, vocab, mb, step)
            metrics = jax.tree.map(lambda v: v.astype(jnp.float32), metrics)
            out = (loss.astype(jnp.float32), metrics, grads)
            return jax.tree.map(jnp.add, carry, out), None

        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(lambda: vg(params, target_params, vocab, first, step))
        (loss_s, metrics_s), grads_s = shapes
        zero = lambda s, dt=None: jnp.zeros(s.shape, dt or s.dtype)
        init = (jnp.zeros((), jnp.float32), jax.tree.map(lambda s: zero(s, jnp.float32), metrics_s),
                jax.tree.map(zero, grads_s))
        (loss, metrics, grads), _ = jax.lax.scan(one, init, micro)
        mean = lambda v: v / n
        return (mean(loss), jax.tree.map(mean, metrics)), jax.tree.map(mean, grads)

    return accumulated


def build_step_fns(target, target_params, draft_params, draft_cfg, objective, optimizer,
                   mesh: Mesh, compute_dtype=jnp.float32, target_exclude=(), batch_keys=BATCH_KEYS,
                   grad_accum_steps: int = 1) -> StepFns:
    """The jitted train and eval steps of `draft_cfg`'s family (its loss on `objective`, its logical
    axes, its frozen leaves) with explicit shardings on `mesh`. `target_params` may hold only some of
    the target's weights (a run fed from a state cache needs the embedding and lm_head); `batch_keys`:
    the batch's arrays, each sharded over the batch (and sequence) axes; `grad_accum_steps`: micro-batches
    per step (`accumulated_value_and_grad`)."""
    family = family_of(draft_cfg)
    loss_fn = family.loss_fn(target, draft_cfg, objective, compute_dtype)
    replicated = NamedSharding(mesh, P())
    param_sh = meshlib.tree_shardings(mesh, family.param_logical_axes(draft_cfg), draft_params)
    state_sh = {
        "step": replicated,
        "params": param_sh,
        "opt_state": opt_state_shardings(optimizer, draft_params, param_sh, mesh),
    }
    target_sh = meshlib.tree_shardings(mesh, present_subtree(target.param_logical_axes(), target_params),
                                       target_params, target_exclude)
    vocab_sh = {"draft_ids": replicated, "t2d": replicated, "d2t": replicated}
    batch_sh = NamedSharding(mesh, meshlib.logical_to_pspec(meshlib.BATCH_LOGICAL, mesh))
    batch_shs = {k: batch_sh for k in batch_keys}

    value_and_grad = accumulated_value_and_grad(loss_fn, int(grad_accum_steps), mesh, batch_sh)

    def train_step(state, target_params, vocab, batch):
        with meshlib.use_mesh(mesh):  # context > 1: the explicit context-parallel attention/scan paths
            (loss, metrics), grads = value_and_grad(state["params"], target_params, vocab, batch, state["step"])
        metrics["grad_norm"] = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], family.frozen_leaves_kept(draft_cfg, updates))
        # numerical guard: a non-finite loss or gradient leaves params and optimizer untouched
        finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
        keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
        metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        new_state = {"step": state["step"] + 1, "params": keep(params, state["params"]),
                     "opt_state": keep(opt_state, state["opt_state"])}
        return new_state, metrics

    def eval_step(params, target_params, vocab, batch):
        with meshlib.use_mesh(mesh):
            _, metrics = loss_fn(params, target_params, vocab, batch)
        return metrics

    train_jit = jax.jit(
        train_step,
        in_shardings=(state_sh, target_sh, vocab_sh, batch_shs),
        out_shardings=(state_sh, replicated),
        donate_argnums=(0,),
    )
    eval_jit = jax.jit(
        eval_step,
        in_shardings=(param_sh, target_sh, vocab_sh, batch_shs),
        out_shardings=replicated,
    )
    return StepFns(train_jit, eval_jit, state_sh, target_sh, vocab_sh, batch_sh, tuple(batch_keys))


def init_state(draft_params, optimizer):
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": draft_params,
        "opt_state": optimizer.init(draft_params),
    }

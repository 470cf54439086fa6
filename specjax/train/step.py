"""The train step: one pure function of (train state, target params, vocab arrays, batch), jitted
once with explicit in/out shardings and the train state donated.

state = {"step": int32[], "params": draft params, "opt_state": optax state}. The only randomness
is P-EAGLE's COD row sampling and DFlash's anchor draw, both keyed by the step number (cod_key,
anchor_key), so the state holds no RNG; the draft's initial params come from run.seed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specjax import mesh as meshlib
from specjax.drafts import dflash, draft_types, eagle3
from specjax.drafts.ttt import TTTConfig, ttt_loss

BATCH_KEYS = ("input_ids", "loss_mask", "segment_ids", "positions")


@dataclass(frozen=True)
class StepFns:
    train_step: Callable  # (state, target_params, vocab, batch) -> (state, metrics)
    eval_step: Callable  # (params, target_params, vocab, batch) -> metrics
    state_shardings: Any
    target_shardings: Any
    vocab_shardings: Any
    batch_sharding: NamedSharding


@dataclass(frozen=True)
class DFlashObjective:
    """What a DFlash loss reads besides the draft config (specjax.train.setup.make_dflash_objective)."""
    loss: dflash.DFlashLossConfig
    anchor_seed: int  # run.seed


def make_loss_fn(target, draft_cfg, ttt, compute_dtype):
    if draft_types.is_dflash(draft_cfg):
        return make_dflash_loss_fn(target, draft_cfg, ttt, compute_dtype)
    aux_ids = tuple(draft_cfg.aux_layer_ids)

    def loss_fn(draft_params, target_params, vocab, batch, step=None):
        final_hidden, aux = target.forward(
            target_params, batch["input_ids"], aux_layer_ids=aux_ids,
            positions=batch["positions"], segment_ids=batch["segment_ids"],
        )
        return ttt_loss(
            draft_params, draft_cfg, ttt,
            input_ids=batch["input_ids"], loss_mask=batch["loss_mask"],
            segment_ids=batch["segment_ids"], positions=batch["positions"],
            aux_hidden=aux, final_hidden=final_hidden,
            embed_table=target.embed_table(target_params), lm_head=target.lm_head_weight(target_params),
            draft_ids=vocab["draft_ids"], t2d=vocab["t2d"], d2t=vocab["d2t"],
            compute_dtype=compute_dtype, cod_key=cod_key(ttt, draft_cfg, step),
        )

    return loss_fn


def make_dflash_loss_fn(target, draft_cfg: dflash.DFlashConfig, objective: DFlashObjective, compute_dtype):
    """DFlash's loss on one packed batch: anchors drawn from the loss-masked rows (anchor_key), the
    target's taps at draft_cfg.target_layer_ids. The lm_head stays the target's copy (a constant
    to the optimizer, as in both references)."""
    tap_ids = tuple(draft_cfg.target_layer_ids)
    loss_cfg = objective.loss

    def loss_fn(draft_params, target_params, vocab, batch, step=None):
        final_hidden, aux = target.forward(
            target_params, batch["input_ids"], aux_layer_ids=tap_ids,
            positions=batch["positions"], segment_ids=batch["segment_ids"],
        )
        candidates = dflash.anchor_candidates(batch["loss_mask"], draft_cfg.block_size, loss_cfg.objective)
        anchors, valid = dflash.select_anchors(anchor_key(objective, step), candidates, loss_cfg.num_anchors)
        params = dict(draft_params, lm_head=jax.lax.stop_gradient(draft_params["lm_head"]))
        loss, m = dflash.dflash_loss(
            params, draft_cfg, loss_cfg, anchors=anchors, anchor_valid=valid,
            input_ids=batch["input_ids"], loss_mask=batch["loss_mask"], segment_ids=batch["segment_ids"],
            positions=batch["positions"], aux_hidden=aux, embed_table=target.embed_table(target_params),
            final_hidden=final_hidden, lm_head=target.lm_head_weight(target_params), draft_ids=vocab["draft_ids"],
            compute_dtype=compute_dtype)
        first = draft_cfg.first_trained_slot
        # the loop's columns: acc_k / slot_tokens_k become acc_0.. (draft token 0 = the first drafted slot)
        metrics = {"loss": loss, "acc_k": m["acc_pos"][first:], "slot_tokens_k": m["total_pos"][first:],
                   "acc": m["acc"], "accept_len": m["accept_len"], "num_blocks": m["num_blocks"]}
        return loss, metrics

    return loss_fn


def frozen_leaves_kept(draft_cfg, updates):
    """DFlash's lm_head gets no update (not even weight decay): both references keep the target's copy."""
    if not draft_types.is_dflash(draft_cfg):
        return updates
    return dict(updates, lm_head=jax.tree_util.tree_map(jnp.zeros_like, updates["lm_head"]))


def anchor_key(objective: DFlashObjective, step):
    """DFlash's anchor draw for train step `step` (a function of the step: a resumed run draws the
    same blocks); evaluation (`step` None) uses step 0's."""
    return jax.random.fold_in(jax.random.key(objective.anchor_seed), 0 if step is None else step)


def cod_key(ttt: TTTConfig, draft_cfg: eagle3.Eagle3Config, step):
    """P-EAGLE's COD sampling key for train step `step` (a function of the step, so a resumed run
    samples the same rows); evaluation (`step` None) uses step 0's. None for EAGLE-3."""
    if not draft_cfg.parallel_drafting:
        return None
    return jax.random.fold_in(jax.random.key(ttt.cod_seed), 0 if step is None else step)


def opt_state_shardings(optimizer, params, param_shardings, mesh: Mesh):
    abstract = jax.eval_shape(optimizer.init, params)
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        optimizer, lambda _, s: s, abstract, param_shardings,
        transform_non_params=lambda _: replicated,
    )


def build_step_fns(target, target_params, draft_params, draft_cfg, ttt, optimizer,
                   mesh: Mesh, compute_dtype=jnp.float32, target_exclude=()) -> StepFns:
    loss_fn = make_loss_fn(target, draft_cfg, ttt, compute_dtype)
    replicated = NamedSharding(mesh, P())
    param_sh = meshlib.tree_shardings(mesh, draft_types.param_logical_axes(draft_cfg), draft_params)
    state_sh = {
        "step": replicated,
        "params": param_sh,
        "opt_state": opt_state_shardings(optimizer, draft_params, param_sh, mesh),
    }
    target_sh = meshlib.tree_shardings(mesh, target.param_logical_axes(), target_params, target_exclude)
    vocab_sh = {"draft_ids": replicated, "t2d": replicated, "d2t": replicated}
    batch_sh = NamedSharding(mesh, meshlib.logical_to_pspec(meshlib.BATCH_LOGICAL, mesh))
    batch_shs = {k: batch_sh for k in BATCH_KEYS}

    def train_step(state, target_params, vocab, batch):
        with meshlib.use_mesh(mesh):  # context > 1: the explicit context-parallel attention/scan paths
            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state["params"], target_params, vocab, batch, state["step"])
        metrics["grad_norm"] = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], frozen_leaves_kept(draft_cfg, updates))
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
    return StepFns(train_jit, eval_jit, state_sh, target_sh, vocab_sh, batch_sh)


def init_state(draft_params, optimizer):
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": draft_params,
        "opt_state": optimizer.init(draft_params),
    }

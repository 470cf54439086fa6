"""What every head family's warm start (`draft.init_from`) does once the head's params are read: its
lm_head rows matched to the run's draft vocab by target token id (`match_lm_head_rows`), the tree
checked against the run's fresh params and cast to their dtypes (`params_like`). numpy at import; jax
inside `params_like` only.
"""
from __future__ import annotations

import logging
from typing import Mapping

import numpy as np

__all__ = ["match_lm_head_rows", "params_like"]

log = logging.getLogger("specjax")


def match_lm_head_rows(folder: str, head_kernel, head_vocab, run_vocab, init_kernel) -> np.ndarray:
    """The warm-start lm_head kernel ([H, Vd] of the run) from a head's kernel: when the two draft
    vocabs differ, columns are matched by target token id (shared tokens keep the head's column, the
    others `init_kernel`'s fresh one)."""
    run_ids = np.asarray(run_vocab.draft_ids)
    head_ids = np.asarray(head_vocab.draft_ids)
    if np.array_equal(run_ids, head_ids):
        return head_kernel
    kernel = np.asarray(init_kernel, np.float32).copy()
    pos = {int(t): j for j, t in enumerate(head_ids)}
    shared = [(i, pos[int(t)]) for i, t in enumerate(run_ids) if int(t) in pos]
    if shared:
        run_idx, head_idx = map(np.asarray, zip(*shared))
        kernel[:, run_idx] = np.asarray(head_kernel)[:, head_idx]
    log.warning("draft.init_from=%s: draft vocab differs from the run's; %d of %d lm_head rows taken from the "
                "head (matched by target token id), the rest freshly initialised", folder, len(shared),
                run_ids.size)
    return kernel


def params_like(folder: str, head_params: Mapping, head_vocab, run_vocab, init_params: Mapping) -> dict:
    """The head's params (`head_params`, read from `folder`) as the run's initial params: lm_head
    columns matched by target token id (match_lm_head_rows), the tree equal to `init_params`' (else a
    ValueError), each leaf a jax array of init_params' dtype."""
    import jax
    import jax.numpy as jnp

    params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), head_params)
    params["lm_head"]["kernel"] = match_lm_head_rows(folder, params["lm_head"]["kernel"], head_vocab, run_vocab,
                                                     init_params["lm_head"]["kernel"])
    want = jax.tree_util.tree_structure(init_params)
    got = jax.tree_util.tree_structure(params)
    if want != got:
        raise ValueError(f"draft.init_from={folder}: imported params {got} do not match the draft's {want}")
    return jax.tree_util.tree_map(lambda new, old: jnp.asarray(new, dtype=old.dtype), params, dict(init_params))

"""MoE routers as pure functions: router logits in, (expert ids int32 [T, k], weights [T, k]) out.

Every rule here picks k experts per token; the expert math itself is ``specjax_kernels.moe``'s
(``moe_experts`` takes these ids and weights). The rules, with the families that use them:

  * :func:`softmax_topk`: softmax over all experts, the k largest probabilities, optionally
    renormalised to sum to one over the k (Qwen3-MoE, Mixtral: ``norm_topk_prob``); optionally
    limited to the ``topk_group`` best of ``n_group`` expert groups as :func:`sigmoid_topk` is (a
    group's score the sum of its two largest probabilities) and the weights times
    ``scaling_factor`` (Mistral 4; transformers masks the other groups' probabilities to 0 rather
    than -inf, which picks the same experts since k never exceeds the kept groups' experts and a
    kept probability is > 0; its +1e-20 in the renormalisation is below an fp32 ulp of the sum).
  * :func:`topk_softmax`: the k largest logits, then a softmax over those k (gpt-oss).
  * :func:`sigmoid_topk`: DeepSeek-V3's "noaux_tc" rule (Kimi K2 too; Nemotron-H's router is the
    same rule): sigmoid scores; the choice adds a per-expert ``correction_bias`` to the scores (load
    balancing without an aux loss) and is limited to the ``topk_group`` best of ``n_group`` expert
    groups (a group's score is the sum of its two best biased scores); the weights are the unbiased
    sigmoid scores of the chosen experts, optionally renormalised (+1e-20 in the denominator, as
    transformers), times ``scaling_factor``.

Routing decides discrete choices, so the logits are fp32 at full matmul precision
(:func:`router_logits`; a bf16 logit can flip an expert): transformers keeps DeepSeek's router weight
and bias in fp32 too. The order of the k picks is unspecified (the expert sum does not depend on it).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax_kernels.dtypes import accum_dtype


def router_logits(x_td, kernel_de, bias_e=None):
    """x [T, D] @ router kernel [D, E] (+ bias [E]) in fp32 (fp64 for fp64 inputs), full precision."""
    acc = accum_dtype(x_td)
    logits = jnp.dot(x_td.astype(acc), kernel_de.astype(acc), precision=jax.lax.Precision.HIGHEST)
    return logits if bias_e is None else logits + bias_e.astype(acc)


def softmax_topk(logits_te, k: int, *, renormalize: bool = False, n_group: int = 1, topk_group: int = 1,
                 scaling_factor: float = 1.0):
    """Softmax over all E experts, then the top k: (ids int32 [T, k], weights [T, k] in the logits'
    float dtype, at least fp32). ``renormalize``: the k weights divided by their sum. ``n_group`` > 1:
    the k are picked within the ``topk_group`` best groups (:func:`group_limited`); the weights are
    then multiplied by ``scaling_factor`` (the defaults change nothing)."""
    probs = jax.nn.softmax(logits_te.astype(accum_dtype(logits_te)), axis=-1)
    if n_group == 1:
        weights, ids = jax.lax.top_k(probs, k)
    else:
        _, ids = jax.lax.top_k(group_limited(probs, n_group, topk_group), k)
        weights = jnp.take_along_axis(probs, ids, axis=1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if scaling_factor != 1.0:
        weights = weights * jnp.asarray(scaling_factor, weights.dtype)
    return ids.astype(jnp.int32), weights


def topk_softmax(logits_te, k: int):
    """The top k logits, then a softmax over those k: (ids int32 [T, k], weights [T, k])."""
    top, ids = jax.lax.top_k(logits_te.astype(accum_dtype(logits_te)), k)
    return ids.astype(jnp.int32), jax.nn.softmax(top, axis=-1)


def group_limited(choice_te, n_group: int, topk_group: int):
    """``choice`` [T, E] with every expert outside the ``topk_group`` best of ``n_group`` equal groups
    set to -inf; a group's score is the sum of its two largest entries. n_group = 1 keeps all."""
    if n_group == 1:
        return choice_te
    t, e = choice_te.shape
    per = e // n_group
    group_score = jax.lax.top_k(choice_te.reshape(t, n_group, per), 2)[0].sum(-1)  # [T, n_group]
    _, groups = jax.lax.top_k(group_score, topk_group)
    keep = jax.nn.one_hot(groups, n_group, dtype=jnp.bool_).any(axis=1)  # [T, n_group]
    return jnp.where(jnp.repeat(keep, per, axis=1), choice_te, -jnp.inf)


def sigmoid_topk(logits_te, k: int, *, correction_bias=None, n_group: int = 1, topk_group: int = 1,
                 renormalize: bool = True, scaling_factor: float = 1.0):
    """DeepSeek-V3's router (module docstring): (ids int32 [T, k], weights [T, k] in the logits'
    float dtype, at least fp32). ``correction_bias`` [E] steers the choice only."""
    logits = logits_te.astype(accum_dtype(logits_te))
    scores = jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(logits.dtype)
    _, ids = jax.lax.top_k(group_limited(choice, n_group, topk_group), k)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * jnp.asarray(scaling_factor, logits.dtype)


def check_grouped_topk(num_experts: int, k: int, n_group: int, topk_group: int, owner: str) -> None:
    """ValueError (naming ``owner``'s config keys) unless :func:`sigmoid_topk` can pick k experts:
    E splits into n_group equal groups of at least two (a group's score sums its best two),
    1 <= topk_group <= n_group, and 1 <= k <= the experts in topk_group groups."""
    if n_group < 1 or num_experts % n_group or (n_group > 1 and num_experts // n_group < 2):
        raise ValueError(f"{owner}: n_routed_experts={num_experts} must split into n_group={n_group} equal groups "
                         f"of at least 2 experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"{owner}: topk_group={topk_group} must be in 1..n_group={n_group}")
    reachable = topk_group * (num_experts // n_group)
    if not 1 <= k <= reachable:
        raise ValueError(f"{owner}: num_experts_per_tok={k} must be in 1..{reachable} (the experts of the "
                         f"topk_group={topk_group} chosen groups)")

"""The training-time-test (TTT) objective: K draft steps unrolled over a whole packed sequence.

Alignment (docs/eagle3-format.md, "TTT training semantics"), for row t of a packed row whose tokens are x:
  step k input token  : x[t+1+k]          (teacher-forced ground truth)
  step k input hidden : fc(aux[t]) at k=0, else the draft's own pre-norm output of step k-1, row t
                        (its final-norm output with cfg.norm_output, EAGLE-3.1)
  step k teacher      : the target's distribution at position t+1+k (it predicts x[t+2+k]),
                        renormalised over the draft vocab
  step k loss mask    : loss_mask[t+k]  (SpecForge shifts the mask left once per step)
                        AND position t+1+k exists and lies in the same packed segment as t
  position mask       : loss mask AND the target's full-vocab argmax at t+1+k is in the draft vocab
Per-step loss = sum over rows of position_mask * softCE / (B*T)  (SpecForge normalises by all rows);
total = sum_k decay^k * loss_k. acc_k = top-1 agreement (draft argmax mapped through d2t vs the
target's full-vocab argmax) over the loss mask. tau_sim = sum_k prod_{i<=k} acc_i (no bonus token).

The teacher is computed here from the target's final hidden state and its lm_head rows for the
draft vocab; the full-vocab argmax is taken in vocab chunks, so no [B,T,V] fp32 tensor exists.

Loss kernel: each step's soft CE goes through the fused linear +
soft-CE kernel (specjax_kernels.soft_ce), so the draft logits [B,T,Vd] are never stored in fp32 and
nothing of size Vd is saved for the backward but the one teacher-logits buffer. The step is computed
in the *target frame*: the draft rows are shifted right by 1+k (row t -> t+1+k) instead of shifting
the teacher left, so all K steps read the same unshifted teacher buffer (no K shifted [B,T,Vd] copies
kept alive as residuals). Sums over rows are unchanged by the relabelling. The same objective written
in the loss frame with plain fp32 logits is the reference in tests/unit/test_ttt_reference.py.

Long context (TTTConfig.long_context_tokens, train.long_context_tokens): from that row length T on,
two things change, neither the function: (1) each TTT step is rematerialised (jax.checkpoint, nothing
saved): its backward recomputes the step's draft layer from the step's inputs (the embedding rows, the
hidden state and the earlier steps' keys and values, all kept anyway) instead of keeping its MLP
([T, intermediate] x a few) and attention activations for all K steps at once; (2) with the soft CE, no
softcap and the target's final hidden state (not a cached top-k teacher), the [B,T,Vd] fp32 teacher
logits are never formed: the fused soft CE takes the final hidden state and the lm_head's draft-vocab
rows and computes each [rows, vocab tile] teacher block where it needs it (one more GEMM per tile
forward and backward). Below the threshold the step is the faster one that keeps both.
benchmarks/results/long_context_plan.md has the memory figures.

LK losses (TTTConfig.loss other than "soft_ce"; specjax.drafts.lk_losses): the step's objective needs
the whole draft distribution of each row, so those steps compute the draft logits in the loss frame
(fp32 [B,T,Vd]) under jax.checkpoint (recomputed in the backward instead of kept), not through the
fused kernel; lk_alpha / lk_lambda also take the target's full-vocab logsumexp, found in the same
chunked pass over the vocab as its argmax.

P-EAGLE (cfg.parallel_drafting; docs/eagle3-format.md, "P-EAGLE (parallel drafting)"): the same K
steps ("depths") and the same attention pattern, but the inputs of depth d >= 1 do not come from depth
d-1: every row reads the embedding of cfg.mask_token_id and fc(mask_hidden), so the K depths form one
parallel forward (computed here step by step, which is the same function because depth d attends only
to depth 0 and to its own rows of depth <= d). Depth 0 is EAGLE-3's step 0. COD sampling
(speculators' generate_cod_sample_indices) picks which rows of depth d >= 1 are trained: among the rows
whose chain survived depth d-1 and whose depth-d target is in the loss mask, a uniformly random
floor((n - d) * max(r^d, r_min)) of them (n = the row's loss-masked positions), so every chain is a
prefix of depths. Here it is a row mask over the dense [K, B, T] layout (all rows are computed; the mask
only picks the trained ones). The loss is speculators' P-EAGLE reduction: sum over depths and kept
rows of step_decay^d * loss_row / the number of kept masked rows (step_decay 1 in the references), the
rows masked by loss mask and same document but not by the draft-vocab filter; lk_alpha / lk_lambda are
per-depth objectives (SpecForge's form) weighted by step_decay^d.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from specjax.drafts import lk_losses
from specjax.drafts.eagle3 import (Eagle3Config, draft_logits, draft_step, mask_hidden_projected, next_step_hidden,
                                   project_aux)
from specjax.drafts.teacher import TopKTeacher, dense_logits
from specjax.layers.logits import soft_cap
from specjax.layers.norms import rms_norm
from specjax_kernels.dtypes import accum_dtype
from specjax_kernels.soft_ce import fused_linear_soft_ce


@dataclass(frozen=True)
class TTTConfig:
    ttt_steps: int = 7
    step_decay: float = 0.8
    vocab_chunk: int = 8192
    attention_impl: Optional[str] = None
    soft_ce_impl: Optional[str] = None
    # the per-step objective (train.loss) and the LK settings (specjax.drafts.lk_losses)
    loss: lk_losses.LossName = "soft_ce"
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    eta: float = 3.0
    # P-EAGLE's COD sampling: depth d keeps about max(cod_ratio**d, cod_ratio_min) of its rows
    cod_ratio: float = 0.7
    cod_ratio_min: float = 0.2
    cod_seed: int = 0  # the COD key of train step s is fold_in(key(cod_seed), s) (run.seed)
    # rows of this many tokens or more take the long-context path (module doc); 0: always
    long_context_tokens: int = 32768


def shift_left(x: jnp.ndarray, n: int, fill=0) -> jnp.ndarray:
    """x[:, t+n] at row t, `fill` past the end (axis 1)."""
    if n == 0:
        return x
    T = x.shape[1]
    if n >= T:
        return jnp.full_like(x, fill)
    pad = jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def shift_right(x: jnp.ndarray, n: int, fill=0) -> jnp.ndarray:
    """x[:, t-n] at row t, `fill` before the start (axis 1); the inverse relabelling of shift_left."""
    if n == 0:
        return x
    T = x.shape[1]
    if n >= T:
        return jnp.full_like(x, fill)
    pad = jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([pad, x[:, : T - n]], axis=1)


def chunked_argmax(h_nd: jnp.ndarray, w_vd: jnp.ndarray, chunk: int, *, with_lse: bool = False,
                   softcap: float | None = None):
    """argmax_v (h @ w.T) without materialising all V logits at once (first index wins on ties);
    with `with_lse`, (argmax, logsumexp_v) from the same pass (online logsumexp, fp32). `softcap`:
    the logits are soft_cap(h @ w.T, softcap), as the target's (Gemma 4)."""
    V, D = w_vd.shape
    chunk = min(chunk, V)
    n_chunks = -(-V // chunk)
    pad = n_chunks * chunk - V
    w = jnp.pad(w_vd, ((0, pad), (0, 0))).reshape(n_chunks, chunk, D)

    acc = accum_dtype(h_nd)  # fp32, or fp64 for fp64 inputs

    def body(carry, inp):
        best_val, best_idx, sum_exp = carry
        wc, c = inp
        logits = soft_cap(jnp.einsum("nd,vd->nv", h_nd, wc.astype(h_nd.dtype), preferred_element_type=acc), softcap)
        col = c * chunk + jnp.arange(chunk)
        logits = jnp.where(col[None, :] < V, logits, -jnp.inf)
        idx = jnp.argmax(logits, axis=-1)
        val = jnp.take_along_axis(logits, idx[:, None], axis=-1)[:, 0]
        better = val > best_val  # strict: keep the earlier chunk on ties, like a global argmax
        new_max = jnp.maximum(best_val, val)
        if with_lse:  # sum of exp(logit - running max), rescaled when the max grows
            sum_exp = sum_exp * jnp.exp(best_val - new_max) + jnp.sum(jnp.exp(logits - new_max[:, None]), axis=-1)
        return (new_max, jnp.where(better, c * chunk + idx, best_idx).astype(jnp.int32), sum_exp), None

    n = h_nd.shape[0]
    init = (jnp.full((n,), -jnp.inf, acc), jnp.zeros((n,), jnp.int32), jnp.zeros((n,), acc))
    (best_val, best, sum_exp), _ = jax.lax.scan(body, init, (w, jnp.arange(n_chunks)))
    if with_lse:
        return best.astype(jnp.int32), best_val + jnp.log(sum_exp)
    return best.astype(jnp.int32)


def teacher_from_hidden(final_hidden_btd, lm_head_vd, draft_ids, vocab_chunk: int, with_lse: bool = False,
                        softcap: float | None = None):
    """(teacher logits over the draft vocab [B,T,Vd] fp32 (fp64 for fp64 input), full-vocab argmax
    [B,T]) and, with `with_lse`, the full-vocab logsumexp [B,T] as a third entry. `softcap`: the
    target's final-logit soft-cap (Target.logit_softcap), applied to every logit. A TopKTeacher (read
    from a state cache) gives its dense logits and its stored argmax / logsumexp instead."""
    if isinstance(final_hidden_btd, TopKTeacher):
        t = final_hidden_btd
        dense = dense_logits(t, draft_ids.shape[0])
        return (dense, t.argmax, t.lse) if with_lse else (dense, t.argmax)
    B, T, D = final_hidden_btd.shape
    rows = jnp.take(lm_head_vd, draft_ids, axis=0)  # [Vd, D]
    teacher = soft_cap(jnp.einsum("btd,vd->btv", final_hidden_btd, rows.astype(final_hidden_btd.dtype),
                                  preferred_element_type=accum_dtype(final_hidden_btd)), softcap)
    flat = final_hidden_btd.reshape(B * T, D)
    if with_lse:
        argmax, lse = chunked_argmax(flat, lm_head_vd, vocab_chunk, with_lse=True, softcap=softcap)
        return teacher, argmax.reshape(B, T), lse.reshape(B, T)
    return teacher, chunked_argmax(flat, lm_head_vd, vocab_chunk, softcap=softcap).reshape(B, T)


def teacher_argmax(final_hidden_btd, lm_head_vd, vocab_chunk: int, softcap: float | None = None):
    """The target's full-vocab argmax [B,T] alone (teacher_from_hidden's second entry), in vocab chunks."""
    B, T, D = final_hidden_btd.shape
    flat = final_hidden_btd.reshape(B * T, D)
    return chunked_argmax(flat, lm_head_vd, vocab_chunk, softcap=softcap).reshape(B, T)


def uses_long_context(ttt: TTTConfig, seq_len: int) -> bool:
    """Whether rows of `seq_len` tokens take the long-context path (module doc)."""
    return seq_len >= ttt.long_context_tokens


def ttt_loss(
    draft_params: dict,
    cfg: Eagle3Config,
    ttt: TTTConfig,
    *,
    input_ids: jnp.ndarray,  # [B,T] int32
    loss_mask: jnp.ndarray,  # [B,T]
    segment_ids: jnp.ndarray,  # [B,T], 0 = padding
    positions: jnp.ndarray,  # [B,T]
    aux_hidden: tuple,  # 3 x [B,T,tH]   (target, no gradient)
    final_hidden: jnp.ndarray,  # [B,T,tH]   target's final-norm hidden (or a cached TopKTeacher)
    embed_table: jnp.ndarray,  # [V,H]      target's token embedding (frozen; unused with draft_params' own)
    lm_head: jnp.ndarray,  # [V,H]      target's lm_head rows
    draft_ids: jnp.ndarray,  # [Vd] int32 (sorted)
    t2d: jnp.ndarray,  # [V] bool
    d2t: jnp.ndarray,  # [Vd] int
    compute_dtype=jnp.float32,
    cod_key: Optional[jax.Array] = None,  # P-EAGLE: the COD sampling key (None: keep every row)
    logit_softcap: Optional[float] = None,  # the target's final-logit soft-cap (Target.logit_softcap)
):
    """Returns (weighted loss, metrics dict of per-step arrays and scalars)."""
    B, T = input_ids.shape
    sg = jax.lax.stop_gradient
    aux_hidden = tuple(sg(a) for a in aux_hidden)
    lk = ttt.loss != "soft_ce"
    needs_lse = ttt.loss in ("lk_alpha", "lk_lambda")
    long = uses_long_context(ttt, T)
    # long context: the soft CE computes the teacher tiles from the final hidden state (module doc)
    tile_teacher = long and not lk and logit_softcap is None and not isinstance(final_hidden, TopKTeacher)
    if tile_teacher:
        teacher_hidden = sg(final_hidden)
        teacher_head = sg(jnp.take(lm_head, draft_ids, axis=0)).astype(final_hidden.dtype)  # [Vd, D]
        teacher_logits, target_argmax = None, teacher_argmax(teacher_hidden, sg(lm_head), ttt.vocab_chunk)
        target_lse = None
    else:
        teacher = teacher_from_hidden(sg(final_hidden), sg(lm_head), draft_ids, ttt.vocab_chunk,
                                      with_lse=needs_lse, softcap=logit_softcap)
        teacher_logits, target_argmax = sg(teacher[0]), teacher[1]
        target_lse = sg(teacher[2]) if needs_lse else None
        teacher_hidden = teacher_head = None
    params = jax.tree_util.tree_map(lambda p: p.astype(compute_dtype), draft_params)
    # draft.train_embedding: the draft's own embedding, trained; else the target's, frozen
    own_embedding = "embed_tokens" in params
    embed_table = params["embed_tokens"]["embedding"] if own_embedding else embed_table
    embed_sg = (lambda x: x) if own_embedding else sg

    seg = segment_ids.astype(jnp.int32)
    lmask = loss_mask.astype(jnp.float32)
    h = project_aux(params, aux_hidden, cfg, compute_dtype)
    parallel = cfg.parallel_drafting
    step_masks = [shift_left(lmask, k) * ((shift_left(seg, 1 + k, fill=-1) == seg) & (seg > 0))
                  for k in range(ttt.ttt_steps)]
    if parallel:  # the depth >= 1 inputs and the COD rows (module doc)
        mask_emb = jnp.broadcast_to(embed_sg(embed_table[int(cfg.mask_token_id)]).astype(compute_dtype), h.shape)
        mask_h = jnp.broadcast_to(mask_hidden_projected(params, cfg, compute_dtype), h.shape)
        keeps = cod_row_masks(cod_key, step_masks, ttt.cod_ratio, ttt.cod_ratio_min)
        trained = [m * c for m, c in zip(step_masks, keeps)]
        n_trained = jnp.maximum(sum(jnp.sum(m) for m in trained), 1.0)

    def one_step(params, emb, h, kv_caches, positions, seg):
        return draft_step(params, cfg, emb, h, positions, seg, kv_caches, attention_impl=ttt.attention_impl)

    if long:  # recomputed in the backward from its inputs, nothing else kept (module doc)
        remat_step = jax.checkpoint(one_step)
        run_step = lambda params, emb, h, kv_caches: remat_step(params, emb, h, kv_caches, positions, seg)
    else:
        run_step = lambda params, emb, h, kv_caches: one_step(params, emb, h, kv_caches, positions, seg)
    kv_caches: list = [[] for _ in range(cfg.num_layers)]  # per layer: (k, v) of each earlier step
    losses, accs, lmask_sums, pmask_sums, ces, alphas = [], [], [], [], [], []
    for k in range(ttt.ttt_steps):
        step_mask = step_masks[k]
        tgt_ids = shift_left(target_argmax, 1 + k)
        pos_mask = step_mask * jnp.take(t2d, tgt_ids).astype(jnp.float32)
        if parallel:
            loss_rows = trained[k]
            if k > 0:
                emb, h = mask_emb, mask_h
        if not parallel or k == 0:
            emb = embed_sg(jnp.take(embed_table, shift_left(input_ids, 1 + k), axis=0)).astype(compute_dtype)
        h, kvs = run_step(params, emb, h, kv_caches)
        for cache, kv in zip(kv_caches, kvs):
            cache.append(kv)
        if not parallel:
            loss_rows = pos_mask
        if lk:  # loss frame, explicit draft logits, recomputed in the backward (see module doc)
            obj, ce_k, alpha_k, pred = _lk_step(
                ttt, cfg, {"norm": params["norm"], "lm_head": params["lm_head"]}, h,
                shift_left(teacher_logits, 1 + k), None if target_lse is None else shift_left(target_lse, 1 + k),
                loss_rows)
            if parallel:  # pooled over depths (module doc): sum/(B*T) and masked means -> sum/n_trained
                ce_k = ce_k * (B * T) / n_trained
                if ttt.loss == "lk_hybrid":
                    obj = obj * (jnp.sum(loss_rows) + lk_losses.HYBRID_EPS) / n_trained
            losses.append(obj)
            ces.append(ce_k)
            alphas.append(alpha_k)
            pred_target = pred + jnp.take(d2t, pred).astype(pred.dtype)
            correct = jnp.sum((pred_target == tgt_ids) * step_mask)
        else:
            # target frame: draft row t sits at row t+1+k, next to its teacher row (see module doc)
            hn = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps)
            ce, pred = fused_linear_soft_ce(
                shift_right(hn, 1 + k), params["lm_head"]["kernel"].T, teacher_logits=teacher_logits,
                teacher_hidden=teacher_hidden, teacher_head=teacher_head,
                mask=shift_right(loss_rows, 1 + k), return_argmax=True, implementation=ttt.soft_ce_impl)
            losses.append(jnp.sum(ce) / (n_trained if parallel else B * T))
            pred_target = pred + jnp.take(d2t, pred).astype(pred.dtype)
            correct = jnp.sum((pred_target == target_argmax) * shift_right(step_mask, 1 + k))
        h = next_step_hidden(params, cfg, h)  # the same array unless cfg.norm_output (EAGLE-3.1)
        denom = jnp.sum(step_mask)  # P-EAGLE too: the accuracy is over every row, not only the COD ones
        accs.append(correct / jnp.maximum(denom, 1e-6))
        lmask_sums.append(denom)
        pmask_sums.append(jnp.sum(pos_mask))
    losses = jnp.stack(losses)
    accs = sg(jnp.stack(accs))
    weights = ttt.step_decay ** jnp.arange(ttt.ttt_steps, dtype=losses.dtype)
    total = jnp.sum(weights * losses)
    metrics = {
        "loss": total,
        "loss_k": sg(losses),
        "acc_k": accs,
        "tau_sim": jnp.sum(jnp.cumprod(accs)),
        "mask_tokens_k": jnp.stack(lmask_sums),
        "in_vocab_tokens_k": jnp.stack(pmask_sums),
    }
    if parallel:
        metrics["cod_rows_k"] = jnp.stack([jnp.sum(m) for m in trained])
    if lk:
        metrics["soft_ce_k"] = sg(jnp.stack(ces))
        metrics["lk_acceptance_k"] = jnp.stack(alphas)  # expected acceptance alpha (lk_losses)
    return total, metrics


def cod_row_masks(key: Optional[jax.Array], step_masks: list, ratio: float, ratio_min: float) -> list:
    """P-EAGLE's COD sampling as [B,T] row masks, one per depth (module doc): depth 0 keeps every row;
    depth d keeps, per batch row, a uniformly random floor(max(0, n - d) * max(ratio^d, ratio_min)) of
    the rows that survived depth d-1 and are masked in at depth d (all of them when there are fewer),
    n = the batch row's loss-masked positions at depth 0. `key` None keeps every masked row."""
    ones = jnp.ones_like(step_masks[0])
    if key is None:
        return [ones] + [(m > 0).astype(ones.dtype) for m in step_masks[1:]]
    n_valid = jnp.sum(step_masks[0] > 0, axis=1).astype(jnp.float32)  # [B]
    T = ones.shape[1]
    keeps, alive = [ones], ones
    for d in range(1, len(step_masks)):
        cand = alive * (step_masks[d] > 0)
        size = jnp.floor(jnp.maximum(n_valid - d, 0.0) * max(ratio ** d, ratio_min)).astype(jnp.int32)
        score = jnp.where(cand > 0, jax.random.uniform(jax.random.fold_in(key, d), cand.shape), -1.0)
        ranked = -jnp.sort(-score, axis=1)  # descending
        thresh = jnp.take_along_axis(ranked, jnp.clip(size - 1, 0, T - 1)[:, None], axis=1)
        keep = cand * (score >= thresh) * (size > 0)[:, None]  # fewer candidates than size: thresh -1 keeps all
        keeps.append(keep)
        alive = keep
    return keeps


def _lk_step(ttt: TTTConfig, cfg: Eagle3Config, head: dict, h, teacher_k, lse_k, mask):
    """One TTT step's LK objective in the loss frame: (objective, soft CE, mean alpha, draft argmax)."""

    @jax.checkpoint
    def f(head, h, teacher_k, lse_k, mask):
        logits = draft_logits(head, cfg, h)
        obj, ce, alpha = lk_losses.step_loss(ttt.loss, logits, teacher_k, lse_k, mask, kl_scale=ttt.kl_scale,
                                             kl_decay=ttt.kl_decay, eta=ttt.eta)
        return obj, ce, alpha, jnp.argmax(logits, axis=-1)

    return f(head, h, teacher_k, lse_k, mask)

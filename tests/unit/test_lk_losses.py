"""LK losses (specjax.drafts.lk_losses, train.loss) against the reference implementations on the same
inputs, fp32 on the CPU:

- lk_alpha / lk_lambda: SpecForge 0.2.0 `specforge.core.lk_loss` (compute_acceptance_rate,
  compute_lk_loss) fed the soft cross entropy its Eagle-3 model pairs them with (LogSoftmaxLoss: the
  masked row soft CE averaged over all B*T rows; its Triton kernel does not run on a CPU, so the test
  writes that sum in torch);
- lk_hybrid: speculators 0.9.0 `speculators.losses.eager.lk_hybrid_loss` reduced as its
  `loss_function` does (sum over masked rows / (mask sum + 1e-5)).
Values and gradients with respect to the draft logits agree within rtol 1e-5. Then the TTT objective
with each loss: the per-step objectives in its metrics equal the references' on the draft logits of
the loss-frame reference TTT (tests/unit/test_ttt_reference.py), and its gradients equal that
reference's with the same step objective (rtol 1e-5).
"""
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts import lk_losses
from specjax.drafts.ttt import TTTConfig, shift_left, teacher_from_hidden, ttt_loss

torch = pytest.importorskip("torch")
lk_ref = pytest.importorskip("specforge.core.lk_loss")


def _speculators_eager():
    spec = importlib.util.find_spec("speculators")
    if spec is None:
        pytest.skip("speculators not installed")
    # the module file alone: speculators/__init__ imports its data stack (`datasets`)
    path = os.path.join(os.path.dirname(spec.origin), "losses", "eager.py")
    mod_spec = importlib.util.spec_from_file_location("speculators_losses_eager", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def _inputs(seed=0, B=2, T=7, V=23, VD=9):
    rng = np.random.default_rng(seed)
    draft_ids = np.sort(rng.choice(V, VD, replace=False))
    full = 2.0 * rng.standard_normal((B, T, V)).astype(np.float32)
    logits = 1.5 * rng.standard_normal((B, T, VD)).astype(np.float32)
    mask = (rng.random((B, T)) > 0.3).astype(np.float32)
    mask[0, 0] = 1.0
    teacher = full[..., draft_ids]
    lse = np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1)) + full.max(-1)
    return logits, teacher, lse.astype(np.float32), mask


def _specforge(kind, logits, teacher, lse, mask, kl_scale, kl_decay):
    lg = torch.tensor(logits, requires_grad=True)
    t = torch.tensor(teacher)
    m = torch.tensor(mask)
    B, T = mask.shape
    p = torch.softmax(t, -1)
    kl = (m * -(p * torch.log_softmax(lg, -1)).sum(-1)).sum() / (B * T)  # LogSoftmaxLoss's value
    p_on_draft = torch.exp(t - torch.tensor(lse)[..., None])
    acc, log_acc = lk_ref.compute_acceptance_rate(logits=lg, target_probs=p_on_draft, position_mask=m[..., None])
    loss = lk_ref.compute_lk_loss(kl_loss=kl, acceptance_rate=acc, log_acceptance_rate=log_acc,
                                  lk_loss_type=kind, kl_scale=kl_scale, kl_decay=kl_decay)
    loss.backward()
    return float(loss.detach()), lg.grad.numpy(), float(acc.detach())


def _speculators(eager, logits, teacher, mask, eta):
    lg = torch.tensor(logits, requires_grad=True)
    m = torch.tensor(mask)
    per = eager.lk_hybrid_loss(lg, torch.tensor(teacher), eta=eta)
    loss = ((per * m).sum(1) / (m.sum(1) + 1e-5)).mean()  # speculators.losses.utils.loss_function
    loss.backward()
    return float(loss.detach()), lg.grad.numpy()


def _ours(kind, logits, teacher, lse, mask, **kw):
    lse = None if lse is None else jnp.asarray(lse)
    f = lambda lg: lk_losses.step_loss(kind, lg, jnp.asarray(teacher), lse, jnp.asarray(mask), **kw)
    (obj, aux), g = jax.value_and_grad(lambda lg: (lambda r: (r[0], r[1:]))(f(lg)), has_aux=True)(jnp.asarray(logits))
    return float(obj), np.asarray(g), float(aux[1])


@pytest.mark.parametrize("kind", ["alpha", "lambda"])
@pytest.mark.parametrize("seed", [0, 1])
def test_lk_alpha_and_lambda_equal_specforge(kind, seed):
    logits, teacher, lse, mask = _inputs(seed)
    ref_loss, ref_grad, ref_acc = _specforge(kind, logits, teacher, lse, mask, kl_scale=1.5, kl_decay=0.7)
    loss, grad, acc = _ours(f"lk_{kind}", logits, teacher, lse, mask, kl_scale=1.5, kl_decay=0.7)
    assert np.abs(ref_grad).max() > 1e-4  # the comparison is not between zeros
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1])
def test_lk_hybrid_equals_speculators(seed):
    eager = _speculators_eager()
    logits, teacher, lse, mask = _inputs(seed, B=1)
    ref_loss, ref_grad = _speculators(eager, logits, teacher, mask, eta=2.5)
    loss, grad, _ = _ours("lk_hybrid", logits, teacher, None, mask, eta=2.5)
    assert np.abs(ref_grad).max() > 1e-4
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_soft_ce_objective_is_the_soft_cross_entropy():
    logits, teacher, lse, mask = _inputs(3)
    obj, ce, _ = lk_losses.step_loss("soft_ce", jnp.asarray(logits), jnp.asarray(teacher), None, jnp.asarray(mask))
    p = jax.nn.softmax(teacher, -1)
    want = np.sum(mask * -np.sum(p * jax.nn.log_softmax(logits, -1), -1)) / mask.size
    np.testing.assert_allclose([float(obj), float(ce)], [want, want], rtol=1e-6)


def test_unknown_loss_and_missing_lse_are_named():
    logits, teacher, lse, mask = _inputs(0)
    with pytest.raises(ValueError, match="train.loss='kl'"):
        lk_losses.step_loss("kl", logits, teacher, lse, mask)
    with pytest.raises(ValueError, match="full-vocab logsumexp"):
        lk_losses.step_loss("lk_alpha", logits, teacher, None, mask)


# ---- the TTT objective with each loss ------------------------------------------------------------
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_ttt_reference as ttt_ref  # noqa: E402


def _reference_lk_ttt(draft_params, cfg, ttt, **batch):
    """The loss-frame reference TTT (test_ttt_reference) with its per-step soft CE replaced by the
    step objective; also returns every step's (logits, teacher, lse, mask) for the torch references."""
    from specjax.drafts import eagle3

    B, T = batch["input_ids"].shape
    sg = jax.lax.stop_gradient
    teacher, argmax, lse = teacher_from_hidden(batch["final_hidden"], batch["lm_head"], batch["draft_ids"],
                                               ttt.vocab_chunk, with_lse=True)
    seg = batch["segment_ids"]
    lmask = batch["loss_mask"].astype(jnp.float32)
    h = eagle3.project_aux(draft_params, tuple(sg(a) for a in batch["aux_hidden"]), cfg, jnp.float32)
    cache, losses, steps = [], [], []
    for k in range(ttt.ttt_steps):
        tok = shift_left(batch["input_ids"], 1 + k)
        same_doc = (shift_left(seg, 1 + k, fill=-1) == seg) & (seg > 0)
        step_mask = shift_left(lmask, k) * same_doc
        pos_mask = step_mask * jnp.take(batch["t2d"], shift_left(argmax, 1 + k)).astype(jnp.float32)
        emb = jnp.take(batch["embed_table"], tok, axis=0)
        h, kv = eagle3.decoder_layer(draft_params, cfg, emb, h, batch["positions"], seg, cache)
        cache.append(kv)
        logits = eagle3.draft_logits(draft_params, cfg, h)
        t_k, l_k = shift_left(teacher, 1 + k), shift_left(lse, 1 + k)
        obj, _, _ = lk_losses.step_loss(ttt.loss, logits, t_k, l_k, pos_mask, kl_scale=ttt.kl_scale,
                                        kl_decay=ttt.kl_decay, eta=ttt.eta)
        losses.append(obj)
        steps.append((logits, t_k, l_k, pos_mask))
        h = eagle3.next_step_hidden(draft_params, cfg, h)
    total = jnp.sum(ttt.step_decay ** jnp.arange(ttt.ttt_steps, dtype=jnp.float32) * jnp.stack(losses))
    return total, steps


@pytest.mark.parametrize("loss", ["lk_alpha", "lk_lambda", "lk_hybrid"])
def test_ttt_objective_with_each_lk_loss(loss):
    cfg, params, batch = ttt_ref.ttt_problem(norm_output=False)
    ttt = TTTConfig(ttt_steps=3, vocab_chunk=5, loss=loss, kl_scale=1.2, kl_decay=0.5, eta=2.0)
    (total, m), g = jax.jit(jax.value_and_grad(lambda p: ttt_loss(p, cfg, ttt, **batch), has_aux=True),
                            compiler_options={"xla_backend_optimization_level": 0})(params)  # -O0: faster compile
    (ref_total, steps), ref_g = jax.value_and_grad(lambda p: _reference_lk_ttt(p, cfg, ttt, **batch),
                                                   has_aux=True)(params)
    np.testing.assert_allclose(float(total), float(ref_total), rtol=1e-5)
    for x, y in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref_g)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6 * float(np.abs(y).max()))
    # each step's objective against the torch reference on the same logits
    eager = _speculators_eager() if loss == "lk_hybrid" else None
    for k, (logits, t_k, l_k, mask) in enumerate(steps):
        lg, t_np, l_np, m_np = (np.asarray(a) for a in (logits, t_k, l_k, mask))
        if loss == "lk_hybrid":  # speculators trains on one packed row: compare row by row
            for b in range(lg.shape[0]):
                want = _speculators(eager, lg[b:b + 1], t_np[b:b + 1], m_np[b:b + 1], eta=2.0)[0]
                got = lk_losses.step_loss(loss, lg[b:b + 1], t_np[b:b + 1], None, m_np[b:b + 1], eta=2.0)[0]
                np.testing.assert_allclose(float(got), want, rtol=1e-5)
        else:
            want = _specforge(loss[3:], lg, t_np, l_np, m_np, kl_scale=1.2, kl_decay=0.5)[0]
            np.testing.assert_allclose(float(m["loss_k"][k]), want, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(m["lk_acceptance_k"])))

"""The TTT objective against its reference: the same loss written in the *loss frame* with plain
draft logits per step and a jnp soft cross entropy (the teacher shifted left by 1+k, as the objective
is stated in docs/eagle3-format.md, "TTT training semantics"). specjax.drafts.ttt computes it in the
target frame through the fused linear + soft-CE kernel and the TTT attention kernel (packed rows with
padding).

Exactness is checked in fp64 (x64 on): both sides run the same math in a different order, so loss,
per-step losses and every gradient entry must agree to rtol 1e-10. In fp32 the summation order is
the CPU's (the vector width differs between hosts), so there the per-step losses must agree to rtol
1e-5, the accuracies exactly, and each gradient leaf to 1e-5 of its norm; one tiny entry of a leaf
can differ by more than 1e-5 of itself (6.8e-8 on 7.9e-4 was seen on an AMD EPYC)."""
import jax
import jax.numpy as jnp
import numpy as np

from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig, shift_left, teacher_from_hidden, ttt_loss
from specjax.layers.rope import RopeSpec


def reference_ttt_loss(draft_params, cfg, ttt, *, input_ids, loss_mask, segment_ids, positions, aux_hidden,
                       final_hidden, embed_table, lm_head, draft_ids, t2d, d2t):
    """Loss frame: row t of step k is scored against the teacher at t+1+k; draft logits in fp32."""
    B, T = input_ids.shape
    acc = jnp.promote_types(final_hidden.dtype, jnp.float32)  # fp32, or fp64 for the exact run
    sg = jax.lax.stop_gradient
    teacher, target_argmax = teacher_from_hidden(sg(final_hidden), sg(lm_head), draft_ids, ttt.vocab_chunk)
    teacher = sg(teacher)
    seg = segment_ids.astype(jnp.int32)
    lmask = loss_mask.astype(acc)
    h = eagle3.project_aux(draft_params, tuple(sg(a) for a in aux_hidden), cfg, acc)
    cache, losses, accs = [], [], []
    for k in range(ttt.ttt_steps):
        tok = shift_left(input_ids, 1 + k)
        same_doc = (shift_left(seg, 1 + k, fill=-1) == seg) & (seg > 0)
        step_mask = shift_left(lmask, k) * same_doc
        tgt_ids = shift_left(target_argmax, 1 + k)
        pos_mask = step_mask * jnp.take(t2d, tgt_ids).astype(acc)
        emb = sg(jnp.take(embed_table, tok, axis=0))
        h, kv = eagle3.decoder_layer(draft_params, cfg, emb, h, positions, seg, cache)
        cache.append(kv)
        logits = eagle3.draft_logits(draft_params, cfg, h).astype(acc)
        p_teacher = jax.nn.softmax(shift_left(teacher, 1 + k).astype(acc), axis=-1)
        ce = -jnp.sum(p_teacher * jax.nn.log_softmax(logits, axis=-1), axis=-1)
        losses.append(jnp.sum(ce * pos_mask) / (B * T))
        pred = jnp.argmax(logits, axis=-1)
        correct = jnp.sum(((pred + jnp.take(d2t, pred)) == tgt_ids) * step_mask)
        accs.append(correct / jnp.maximum(jnp.sum(step_mask), 1e-6))
        h = eagle3.next_step_hidden(draft_params, cfg, h)
    losses = jnp.stack(losses)
    total = jnp.sum(ttt.step_decay ** jnp.arange(ttt.ttt_steps, dtype=acc) * losses)
    return total, {"loss_k": losses, "acc_k": jnp.stack(accs)}


def ttt_problem(norm_output, *, parallel=False, num_layers=1, seed=0):
    """A small packed TTT batch (two rows: two documents and padding, one document), its EAGLE-3 config
    and draft params; `parallel` gives P-EAGLE's config (mask token 0), `seed` other draws."""
    H, V, VD, T = 32, 13, 6, 24  # a small vocab, so untrained drafts still agree with the target on some rows
    cfg = eagle3.Eagle3Config(hidden_size=H, target_hidden_size=H, intermediate_size=64, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, vocab_size=V, draft_vocab_size=VD,
                              aux_layer_ids=(0, 1, 2), rope=RopeSpec("default", 10000.0), norm_output=norm_output,
                              parallel_drafting=parallel, mask_token_id=0 if parallel else None,
                              num_layers=num_layers)
    ks = jax.random.split(jax.random.key(seed), 9)
    ids = jnp.asarray(np.sort(np.random.default_rng(seed).choice(V, VD, replace=False)), jnp.int32)
    seg = jnp.asarray([[1] * 11 + [2] * 9 + [0] * 4, [1] * 24], jnp.int32)
    pos = jnp.asarray([list(range(11)) + list(range(9)) + list(range(4)), list(range(24))], jnp.int32)
    batch = dict(input_ids=jax.random.randint(ks[0], (2, T), 0, V),
                 loss_mask=(jax.random.uniform(ks[1], (2, T)) > 0.2).astype(jnp.int32) * (seg > 0),
                 segment_ids=seg, positions=pos,
                 aux_hidden=tuple(jax.random.normal(ks[2 + i], (2, T, H)) for i in range(3)),
                 final_hidden=3 * jax.random.normal(ks[5], (2, T, H)), embed_table=jax.random.normal(ks[6], (V, H)),
                 lm_head=jax.random.normal(ks[7], (V, H)), draft_ids=ids,
                 t2d=jnp.zeros((V,), bool).at[ids].set(True), d2t=ids - jnp.arange(VD))
    return cfg, eagle3.init_draft_params(cfg, ks[8], std=0.2), batch


def _as(dtype, tree):
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _run(loss, cfg, params, batch, dtype):
    ttt = TTTConfig(ttt_steps=4, vocab_chunk=16)
    kwargs = {"compute_dtype": dtype} if loss is ttt_loss else {}
    # LLVM -O0: halves the CPU compile, computes the same
    f = jax.jit(jax.value_and_grad(lambda p: loss(p, cfg, ttt, **_as(dtype, batch), **kwargs), has_aux=True),
                compiler_options={"xla_backend_optimization_level": 0})
    (total, m), g = f(_as(dtype, params))
    assert total.dtype == dtype, total.dtype  # nothing on either side ran below `dtype`
    return float(total), np.asarray(m["loss_k"]), np.asarray(m["acc_k"]), g


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def test_ttt_loss_equals_the_loss_frame_reference_fp64():
    with jax.enable_x64(True):
        for norm_output in (False, True):  # EAGLE-3 and EAGLE-3.1
            cfg, params, batch = ttt_problem(norm_output)
            got = _run(ttt_loss, cfg, params, batch, jnp.float64)
            want = _run(reference_ttt_loss, cfg, params, batch, jnp.float64)
            assert want[0] > 0 and np.all(want[1] > 0) and np.any(want[2] > 0), want[:3]
            np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
            np.testing.assert_allclose(got[1], want[1], rtol=1e-10)
            # the accuracies are count ratios, an fp32 metric in ttt_loss: the same counts give the
            # same correctly rounded quotient
            np.testing.assert_array_equal(got[2], want[2].astype(np.float32))
            for x, y in zip(_leaves(got[3]), _leaves(want[3]), strict=True):
                assert x.dtype == np.float64
                np.testing.assert_allclose(x, y, rtol=1e-10, atol=1e-13 * float(np.abs(y).max()))


def test_ttt_loss_equals_the_loss_frame_reference_fp32():
    for norm_output in (False, True):
        cfg, params, batch = ttt_problem(norm_output)
        got = _run(ttt_loss, cfg, params, batch, jnp.float32)
        want = _run(reference_ttt_loss, cfg, params, batch, jnp.float32)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
        np.testing.assert_array_equal(got[2], want[2])
        for x, y in zip(_leaves(got[3]), _leaves(want[3]), strict=True):
            assert np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(y), (np.linalg.norm(x - y), np.linalg.norm(y))

"""TTT objective semantics that need no external reference: packing isolation and the teacher."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig, chunked_argmax, shift_left, ttt_loss
from specjax.layers.rope import RopeSpec

H, V, VD, K = 32, 97, 40, 4
CFG = eagle3.Eagle3Config(hidden_size=H, target_hidden_size=H, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=V, draft_vocab_size=VD,
                          aux_layer_ids=(0, 1, 2), rope=RopeSpec("default", 10000.0))


def _world(seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    params = eagle3.init_draft_params(CFG, ks[0], std=0.2)
    embed = jax.random.normal(ks[1], (V, H))
    lm_head = jax.random.normal(ks[2], (V, H))
    draft_ids = jnp.asarray(np.sort(np.random.default_rng(seed).choice(V, VD, replace=False)), jnp.int32)
    t2d = jnp.zeros((V,), bool).at[draft_ids].set(True)
    d2t = draft_ids - jnp.arange(VD)
    return params, embed, lm_head, draft_ids, t2d, d2t


def _doc(key, n):
    ks = jax.random.split(key, 5)
    return dict(ids=jax.random.randint(ks[0], (n,), 0, V), mask=(jax.random.uniform(ks[1], (n,)) > 0.3).astype(jnp.int32),
                aux=tuple(jax.random.normal(ks[2 + i], (n, H)) for i in range(3)),
                final=jax.random.normal(jax.random.fold_in(key, 9), (n, H)) * 3)


def _run(world, rows, T):
    """rows: list of lists of docs packed left to right, padded to T."""
    params, embed, lm_head, draft_ids, t2d, d2t = world

    def pack(field, pad):
        out = []
        for docs in rows:
            parts = [d[field] for d in docs]
            n = sum(p.shape[0] for p in parts)
            parts.append(jnp.full((T - n,) + parts[0].shape[1:], pad, parts[0].dtype))
            out.append(jnp.concatenate(parts))
        return jnp.stack(out)

    seg = jnp.stack([jnp.concatenate([jnp.full((d["ids"].shape[0],), i + 1, jnp.int32) for i, d in enumerate(docs)]
                                     + [jnp.zeros((T - sum(d["ids"].shape[0] for d in docs),), jnp.int32)]) for docs in rows])
    pos = jnp.stack([jnp.concatenate([jnp.arange(d["ids"].shape[0]) for d in docs]
                                     + [jnp.arange(T - sum(d["ids"].shape[0] for d in docs))]) for docs in rows])
    aux = tuple(jnp.stack([jnp.concatenate([d["aux"][i] for d in docs] + [jnp.zeros((T - sum(d["ids"].shape[0] for d in docs), H))])
                           for docs in rows]) for i in range(3))
    loss, m = jax.jit(lambda p: ttt_loss(
        p, CFG, TTTConfig(ttt_steps=K, vocab_chunk=16), input_ids=pack("ids", 0), loss_mask=pack("mask", 0),
        segment_ids=seg, positions=pos, aux_hidden=aux, final_hidden=pack("final", 0.0), embed_table=embed,
        lm_head=lm_head, draft_ids=draft_ids, t2d=t2d, d2t=d2t))(params)
    B = len(rows)
    # un-normalise: per-step sums of masked CE and of correct predictions
    return np.asarray(m["loss_k"]) * B * T, np.asarray(m["acc_k"]) * np.asarray(m["mask_tokens_k"]), np.asarray(m["mask_tokens_k"])


def test_packed_equals_separate_documents():
    world = _world()
    a, b = _doc(jax.random.key(1), 11), _doc(jax.random.key(2), 9)
    packed = _run(world, [[a, b]], T=24)
    sep_a, sep_b = _run(world, [[a]], T=24), _run(world, [[b]], T=24)
    for got, x, y in zip(packed, sep_a, sep_b):
        np.testing.assert_allclose(got, x + y, rtol=1e-4, atol=1e-4)
    assert packed[2][0] > 0  # the test exercised supervised rows


def test_rows_past_the_end_of_a_document_are_not_supervised():
    world = _world()
    d = _doc(jax.random.key(3), 10)
    d["mask"] = jnp.ones_like(d["mask"])
    _, _, n_tok = _run(world, [[d]], T=16)
    # step k supervises row t only if t+1+k < 10 and loss_mask[t+k] = 1: 9-k rows
    np.testing.assert_array_equal(n_tok, [10 - 1 - k for k in range(K)])


def test_chunked_argmax_matches_dense_with_ties_and_padding():
    h = jax.random.normal(jax.random.key(0), (30, 8))
    w = jax.random.normal(jax.random.key(1), (101, 8))
    w = w.at[77].set(w[13])  # exact tie: the lower id wins, like jnp.argmax
    for chunk in (7, 16, 101, 500):
        np.testing.assert_array_equal(chunked_argmax(h, w, chunk), jnp.argmax(h @ w.T, -1))
        # the same pass's full-vocab logsumexp (LK losses), padded columns excluded (fp32, 1e-5)
        idx, lse = chunked_argmax(h, w, chunk, with_lse=True)
        np.testing.assert_array_equal(idx, jnp.argmax(h @ w.T, -1))
        np.testing.assert_allclose(lse, jax.scipy.special.logsumexp(h @ w.T, axis=-1), rtol=1e-5)


def test_soft_capped_teacher_is_the_targets_distribution():
    """A target whose logits are soft-capped (Gemma 4's final_logit_softcapping, Target.logit_softcap):
    the teacher over the draft vocab, the full-vocab argmax and logsumexp are those of
    cap * tanh(h @ w.T / cap), not of the raw product (fp32, 1e-5)."""
    from specjax.drafts.ttt import teacher_from_hidden

    h = 3.0 * jax.random.normal(jax.random.key(2), (2, 5, 8))
    w = jax.random.normal(jax.random.key(3), (37, 8))
    ids = jnp.array([1, 4, 9, 20, 36])
    capped = 4.0 * jnp.tanh((h @ w.T) / 4.0)
    teacher, argmax, lse = teacher_from_hidden(h, w, ids, 10, with_lse=True, softcap=4.0)
    np.testing.assert_allclose(teacher, capped[..., ids], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(argmax, jnp.argmax(capped, -1))
    np.testing.assert_allclose(lse, jax.scipy.special.logsumexp(capped, axis=-1), rtol=1e-5)
    raw = teacher_from_hidden(h, w, ids, 10, with_lse=True)
    assert float(jnp.abs(raw[2] - lse).max()) > 1.0  # the cap changes the distribution at this scale


def test_shift_left():
    x = jnp.arange(10).reshape(2, 5)
    np.testing.assert_array_equal(shift_left(x, 2), [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]])
    np.testing.assert_array_equal(shift_left(x, 7, fill=-1), -np.ones((2, 5)))


def test_draft_config_validation():
    with pytest.raises(ValueError, match="larger than the target vocab"):
        eagle3.Eagle3Config(**{**eagle3.config_to_dict(CFG), "draft_vocab_size": V + 1, "rope": CFG.rope}).validate()
    d = eagle3.config_to_dict(CFG)
    assert eagle3.config_from_dict(d) == CFG

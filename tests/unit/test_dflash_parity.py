"""The DFlash block drafter (specjax.drafts.dflash) against its two PyTorch references, fp32 on the CPU.

- speculators 0.9.0 `DFlashDraftModel` (objective "teacher_kl"): its own forward over a packed row
  (two documents with restarting positions, right padding), its anchor-block mask, its KL loss with
  the DFlash slot decay, with sample_from_anchor off and on.
- SpecForge 0.2.0 `DFlashDraftModel` + `OnlineDFlashModel` (objective "token_ce"): a batch of two
  rows, its dense SDPA mask, its hard-label CE with the decay on.

Both reference models get our weights through the export state dict
(specjax_converters.dflash_export.dflash_state_dict), loaded with strict=True, so a file name or
shape the engines would not accept fails here. Anchors are drawn by specjax.drafts.dflash.select_anchors
and handed to the reference in place of its own random draw. Compared: the draft logits of every
block, the loss and the gradient of every weight (lm_head included). TOLERANCE: max|ours - ref| /
max|ref| <= 1e-4 for each tensor (and |loss - ref| / |ref| <= 1e-4); the measured errors are around
1e-6. The perturbation tests check that a changed weight, or a mask without the document boundary,
breaks that tolerance.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from export._heads import (import_speculators_model, jitter_params, speculators_anchors, speculators_block_model,
                           speculators_inputs)
from specjax.drafts import dflash as D
from specjax.drafts.vocab import DraftVocab
from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec
from specjax_converters.dflash_export import dflash_hf_config, dflash_state_dict, export_dflash

TOL = 1e-4  # max|ours - ref| / max|ref| per tensor

V, H, I, NH, NKV, HD, VD = 50, 32, 64, 4, 2, 8, 24
MASK = V - 1
TAPS = (0, 2)  # output-of-layer-k; speculators' aux_hidden_state_layer_ids are (1, 3)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 1e-30))


def make_cfg(vd=VD, block_size=4, num_layers=2, sample_from_anchor=False):
    cfg = D.DFlashConfig(hidden_size=H, num_layers=num_layers, num_attention_heads=NH, num_key_value_heads=NKV,
                         head_dim=HD, intermediate_size=I, vocab_size=V, draft_vocab_size=vd, aux_layer_ids=TAPS,
                         mask_token_id=MASK, block_size=block_size, rms_norm_eps=1e-6,
                         rope=RopeSpec("default", 10000.0), max_position_embeddings=256, num_target_layers=4,
                         sample_from_anchor=sample_from_anchor)
    cfg.validate()
    return cfg


def make_params(cfg, seed=0):
    """Random weights away from the init (kernels std 0.15, norm scales 1 +- 0.3)."""
    return jitter_params(D.init_draft_params(cfg, jax.random.key(seed), std=0.15), seed)


def make_vocab(vd, seed=0):
    if vd == V:
        return None
    rng = np.random.default_rng(seed)
    return DraftVocab.from_ids(rng.choice(V, vd, replace=False), V)


def make_batch(B, T, seed=0, docs=((14, 7),), pad=3):
    """Rows of documents (lengths per row from `docs`) then `pad` padding rows; positions restart per
    document; loss mask random over the documents, 0 on padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((B, T), np.int32)
    pos = np.zeros((B, T), np.int32)
    for b in range(B):
        t = 0
        for d, n in enumerate(docs[b % len(docs)]):
            seg[b, t:t + n] = d + 1
            pos[b, t:t + n] = np.arange(n)
            t += n
    assert t + pad <= T
    lm = ((rng.random((B, T)) > 0.25) & (seg > 0)).astype(np.float32)
    return dict(
        input_ids=rng.integers(0, V - 1, (B, T)).astype(np.int32), loss_mask=lm, segment_ids=seg, positions=pos,
        aux=[(1.5 * rng.standard_normal((B, T, H))).astype(np.float32) for _ in TAPS],
        pre_norm=(2.0 * rng.standard_normal((B, T, H))).astype(np.float32),
        verifier_norm=(1.0 + 0.3 * rng.standard_normal(H)).astype(np.float32),
        embed=rng.standard_normal((V, H)).astype(np.float32),
        lm_head_full=(0.7 * rng.standard_normal((V, H))).astype(np.float32),
    )


def ours(params, cfg, loss_cfg, batch, anchors, valid, vocab, segment_ids=None):
    """(loss, metrics, grads, logits [B, N, S, Vd]) of specjax's DFlash on `batch`."""
    final_hidden = rms_norm(jnp.asarray(batch["pre_norm"]), jnp.asarray(batch["verifier_norm"]), 1e-6)
    seg = jnp.asarray(batch["segment_ids"] if segment_ids is None else segment_ids)
    kw = dict(anchors=jnp.asarray(anchors), anchor_valid=jnp.asarray(valid), input_ids=jnp.asarray(batch["input_ids"]),
              loss_mask=jnp.asarray(batch["loss_mask"]), segment_ids=seg,
              positions=jnp.asarray(batch["positions"]), aux_hidden=[jnp.asarray(a) for a in batch["aux"]],
              embed_table=jnp.asarray(batch["embed"]), final_hidden=final_hidden,
              lm_head=jnp.asarray(batch["lm_head_full"]),
              draft_ids=None if vocab is None else jnp.asarray(vocab.draft_ids, jnp.int32))
    (loss, metrics), grads, logits = _loss_grads_logits(params, cfg, loss_cfg, kw)
    return float(loss), jax.device_get(metrics), jax.device_get(grads), np.asarray(logits)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _loss_grads_logits(params, cfg, loss_cfg, kw):
    (loss, metrics), grads = jax.value_and_grad(lambda p: D.dflash_loss(p, cfg, loss_cfg, **kw), has_aux=True)(params)
    h = D.draft_forward(params, cfg, aux_hidden=kw["aux_hidden"], input_ids=kw["input_ids"],
                        positions=kw["positions"], segment_ids=kw["segment_ids"], anchors=kw["anchors"],
                        embed_table=kw["embed_table"], anchor_chunk=loss_cfg.anchor_chunk)
    return (loss, metrics), grads, D.draft_logits(params, cfg, h)


def exported(params, cfg, vocab) -> dict:
    return dflash_state_dict(jax.device_get(params), cfg, vocab, "float32")


# ---------------------------------------------------------------------------------------------
# speculators
# ---------------------------------------------------------------------------------------------
def import_speculators_dflash():
    """speculators' DFlash model without its training-data stack: `speculators/__init__` imports
    `datasets` (only its offline loader uses it); a stand-in sits in sys.modules during the import."""
    return import_speculators_model("dflash", "DFlashDraftModel", "DFlashSpeculatorConfig",
                              metrics="speculators.models.metrics")


def speculators_model(sp, cfg, params, vocab, batch):
    rows = batch["lm_head_full"] if vocab is None else batch["lm_head_full"][vocab.draft_ids]
    return speculators_block_model(sp, cfg, "dflash", exported(params, cfg, vocab), embed=batch["embed"],
                                   verifier_norm=batch["verifier_norm"], verifier_head=rows)


def speculators_run(sp, model, cfg, batch, anchors, valid, gamma):
    """speculators' own DFlash forward (logits) and loss + gradients, with our anchors."""
    torch = sp.torch
    with speculators_anchors(sp, anchors, valid) as n_anchors:
        kw = speculators_inputs(torch, batch)
        with torch.no_grad():
            _, logits, _, _, _ = model._backbone_forward(**kw, max_anchors=n_anchors)
        model.zero_grad()
        _, loss, metrics = model(**kw, loss_config={"kl_div": (sp.eager.kl_div_loss, 1.0)}, gamma=gamma,
                                 max_anchors=n_anchors)
        loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()}, grads, logits.detach().numpy()


def compare_speculators(cfg, vocab, batch, anchors, valid, gamma=4.0, params=None, segment_ids=None, perturb=None):
    sp = import_speculators_dflash()
    params = make_params(cfg) if params is None else params
    model = speculators_model(sp, cfg, params, vocab, batch)
    if perturb is not None:
        with sp.torch.no_grad():
            dict(model.named_parameters())[perturb].add_(0.02)
    ref_loss, ref_metrics, ref_grads, ref_logits = speculators_run(sp, model, cfg, batch, anchors, valid, gamma)
    loss_cfg = D.DFlashLossConfig(objective="teacher_kl", num_anchors=anchors.shape[1], loss_decay_gamma=gamma,
                                  anchor_chunk=3)
    loss, metrics, grads, logits = ours(params, cfg, loss_cfg, batch, anchors, valid, vocab, segment_ids=segment_ids)
    our_grads = exported(grads, cfg, vocab)
    errs = {"logits": rel_err(logits.reshape(ref_logits.shape), ref_logits), "loss": abs(loss - ref_loss) / abs(ref_loss)}
    errs.update({f"grad {n}": rel_err(our_grads[n], g) for n, g in ref_grads.items()})
    return errs, (metrics, ref_metrics), set(ref_grads)


def speculators_case(sample_from_anchor=False, num_anchors=6, seed=0):
    cfg = make_cfg(sample_from_anchor=sample_from_anchor)
    vocab = make_vocab(VD)
    batch = make_batch(1, 24, seed=seed)
    anchors, valid = D.select_anchors(jax.random.key(seed + 7),
                                      D.anchor_candidates(jnp.asarray(batch["loss_mask"]), cfg.block_size, "teacher_kl"),
                                      num_anchors)
    return cfg, vocab, batch, np.asarray(anchors), np.asarray(valid)


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_speculators_logits_loss_grads(sample_from_anchor):
    cfg, vocab, batch, anchors, valid = speculators_case(sample_from_anchor)
    assert valid.all() and len(set(batch["segment_ids"][0, anchors[0]])) == 2  # blocks in both documents
    errs, (metrics, ref_metrics), graded = compare_speculators(cfg, vocab, batch, anchors, valid)
    # every weight the file carries has a gradient in the reference (the vocab maps are buffers)
    assert graded == set(exported(make_params(cfg), cfg, vocab)) - {"d2t", "t2d"}
    print({k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL, errs
    for pos in range(cfg.first_trained_slot, cfg.block_size):
        assert metrics["correct_pos"][pos] == ref_metrics[f"position_{pos}_acc_sum"]
        assert metrics["total_pos"][pos] == ref_metrics[f"position_{pos}_acc_total"]
    assert metrics["accept_len_sum"] == pytest.approx(ref_metrics["eal_sum"])
    assert metrics["num_blocks"] == ref_metrics["eal_total"]


def test_speculators_padded_anchors():
    """More anchors than candidate rows: the unused ones are anchor 0 and invalid in both."""
    cfg, vocab, batch, anchors, valid = speculators_case(num_anchors=30, seed=3)
    assert 0 < valid.sum() < 30
    errs, _, _ = compare_speculators(cfg, vocab, batch, anchors, valid)
    assert max(errs.values()) <= TOL, errs


def test_speculators_comparison_can_fail():
    cfg, vocab, batch, anchors, valid = speculators_case()
    errs, _, _ = compare_speculators(cfg, vocab, batch, anchors, valid, perturb="layers.1.self_attn.k_norm.weight")
    assert errs["logits"] > TOL and errs["loss"] > TOL
    assert errs["grad fc.weight"] > TOL
    # the document boundary is part of the mask: without it (one segment) the logits move
    errs, _, _ = compare_speculators(cfg, vocab, batch, anchors, valid,
                                     segment_ids=np.where(batch["segment_ids"] > 0, 1, 0))
    assert errs["logits"] > TOL


def test_speculators_block_metrics():
    """Per-slot accuracy and accepted length against speculators' own counting functions."""
    sp = import_speculators_dflash()
    torch = sp.torch
    rng = np.random.default_rng(5)
    cfg = make_cfg(block_size=5)
    N, S = 7, 5
    pred = rng.integers(0, 3, (1, N, S))
    target = rng.integers(0, 3, (1, N, S))
    mask = (rng.random((1, N, S)) > 0.2).astype(np.float32)
    mask[..., 0] = 0.0
    m = D.block_metrics(jnp.asarray(pred), jnp.asarray(target), jnp.asarray(mask), cfg)
    flat = lambda x: torch.from_numpy(x.reshape(1, -1))  # noqa: E731
    pos_idx = torch.arange(N * S).unsqueeze(0) % S
    correct, total = sp.metrics.compute_accuracy_multi_step(flat(pred), flat(target), flat(mask), pos_idx, S)
    np.testing.assert_array_equal(m["correct_pos"], correct.numpy())
    np.testing.assert_array_equal(m["total_pos"], total.numpy())
    eal_sum, eal_total = sp.metrics.compute_accepted_length_counts(
        torch.from_numpy(pred == target).reshape(-1, S)[:, 1:], torch.from_numpy(mask > 0).reshape(-1, S)[:, 1:])
    assert float(m["accept_len_sum"]) == pytest.approx(float(eal_sum))
    assert float(m["num_blocks"]) == float(eal_total)


# ---------------------------------------------------------------------------------------------
# SpecForge
# ---------------------------------------------------------------------------------------------
def specforge_run(cfg, params, batch, anchors, valid, gamma, perturb=None):
    torch = pytest.importorskip("torch")
    pytest.importorskip("specforge")
    from transformers import Qwen3Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns at import that flash_attn (a GPU backend) is missing
        from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
        from specforge.modeling.draft.dflash import DFlashDraftModel
    conf = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=cfg.num_layers,
                       num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD, rms_norm_eps=cfg.rms_norm_eps,
                       max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       layer_types=["full_attention"] * cfg.num_layers)
    conf.block_size, conf.num_target_layers = cfg.block_size, 4
    conf.dflash_config = {"target_layer_ids": list(cfg.aux_layer_ids), "mask_token_id": cfg.mask_token_id}
    conf._attn_implementation = "eager"
    draft = DFlashDraftModel(conf).float()
    state = {k: torch.from_numpy(np.array(v)) for k, v in exported(params, cfg, None).items()}
    lm_head = torch.nn.Linear(H, V, bias=False)
    lm_head.weight.data.copy_(state.pop("lm_head.weight"))  # SpecForge drafts through the target's head
    draft.load_state_dict(state, strict=True)
    if perturb is not None:
        with torch.no_grad():
            dict(draft.named_parameters())[perturb].add_(0.02)
    embed = torch.nn.Embedding(V, H)
    embed.weight.data.copy_(torch.from_numpy(batch["embed"]))
    embed.weight.requires_grad_(False)
    online = OnlineDFlashModel(draft, lm_head, embed, mask_token_id=cfg.mask_token_id, block_size=cfg.block_size,
                               attention_backend="sdpa", num_anchors=anchors.shape[1], loss_decay_gamma=gamma,
                               objective_chunk_blocks=0)
    a = torch.from_numpy(np.array(anchors, np.int64))
    keep = torch.from_numpy(np.array(valid))
    online._sample_anchor_positions = lambda seq_len, loss_mask, device: (a.clone(), keep.clone())
    caught = []
    hook = lm_head.register_forward_hook(lambda m, i, o: caught.append(o.detach().numpy().copy()))
    try:
        loss, acc, _ = online(input_ids=torch.from_numpy(batch["input_ids"].astype(np.int64)),
                              hidden_states=torch.from_numpy(np.concatenate(batch["aux"], -1)),
                              loss_mask=torch.from_numpy(batch["loss_mask"]))
        loss.backward()
    finally:
        hook.remove()
    grads = {n: p.grad.numpy().copy() for n, p in draft.named_parameters() if p.grad is not None}
    grads["lm_head.weight"] = lm_head.weight.grad.numpy().copy()
    return float(loss.detach()), float(acc), grads, caught[0]


def specforge_case(num_anchors=5, seed=11):
    cfg = make_cfg(vd=V)  # SpecForge's DFlash predicts over the target's full vocab
    # one document per row (SpecForge has no packing): every row before the padding is segment 1
    batch = make_batch(2, 20, seed=seed, docs=((17,), (15,)), pad=3)
    batch["positions"] = np.broadcast_to(np.arange(20, dtype=np.int32), (2, 20)).copy()  # SpecForge: arange(T)
    anchors, valid = D.select_anchors(jax.random.key(seed),
                                      D.anchor_candidates(jnp.asarray(batch["loss_mask"]), cfg.block_size, "token_ce"),
                                      num_anchors)
    return cfg, batch, np.asarray(anchors), np.asarray(valid)


def compare_specforge(cfg, batch, anchors, valid, gamma=7.0, perturb=None):
    params = make_params(cfg, seed=4)
    ref_loss, ref_acc, ref_grads, ref_logits = specforge_run(cfg, params, batch, anchors, valid, gamma, perturb)
    loss_cfg = D.DFlashLossConfig(objective="token_ce", num_anchors=anchors.shape[1], loss_decay_gamma=gamma,
                                  anchor_chunk=2)
    loss, metrics, grads, logits = ours(params, cfg, loss_cfg, batch, anchors, valid, None)
    our_grads = exported(grads, cfg, None)
    rows = np.repeat(valid, cfg.block_size, axis=1)  # SpecForge masks a padded block entirely: compare real ones
    logits = logits.reshape(ref_logits.shape)
    errs = {"logits": rel_err(logits[rows], ref_logits[rows]), "loss": abs(loss - ref_loss) / abs(ref_loss),
            "acc": abs(float(metrics["acc"]) - ref_acc)}
    errs.update({f"grad {n}": rel_err(our_grads[n], g) for n, g in ref_grads.items()})
    return errs, set(ref_grads)


def test_specforge_logits_loss_grads():
    cfg, batch, anchors, valid = specforge_case()
    assert valid.all()
    errs, graded = compare_specforge(cfg, batch, anchors, valid)
    assert graded == set(exported(make_params(cfg), cfg, None))
    print({k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL, errs


def test_specforge_padded_anchors_and_failure():
    cfg, batch, anchors, valid = specforge_case(num_anchors=14, seed=12)
    assert 0 < valid[1].sum() < 14  # row 1 has fewer candidates than anchors
    errs, _ = compare_specforge(cfg, batch, anchors, valid)
    assert max(errs.values()) <= TOL, errs
    errs, _ = compare_specforge(cfg, batch, anchors, valid, perturb="layers.0.mlp.up_proj.weight")
    assert errs["logits"] > TOL and errs["loss"] > TOL and errs["grad norm.weight"] > TOL


# ---------------------------------------------------------------------------------------------
# our own pieces: attention forms, anchors, decoding, config, export
# ---------------------------------------------------------------------------------------------
def test_chunked_attention_equals_reference():
    rng = np.random.default_rng(0)
    B, N, S, T = 2, 7, 4, 19
    q = jnp.asarray(rng.standard_normal((B, N, S, NH, HD)), jnp.float32)
    kc, vc = (jnp.asarray(rng.standard_normal((B, T, NKV, HD)), jnp.float32) for _ in range(2))
    kb, vb = (jnp.asarray(rng.standard_normal((B, N, S, NKV, HD)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.concatenate([np.ones((B, 9)), 2 * np.ones((B, 7)), np.zeros((B, 3))], 1), jnp.int32)
    anchors = jnp.asarray(np.sort(rng.integers(0, 16, (B, N)), 1), jnp.int32)

    def value_and_grads(attend):  # the attention output and the gradients of a scalar of it wrt q, k, v
        f = lambda *a: attend(*a, anchors, seg)  # noqa: E731
        return jax.jit(lambda *a: (f(*a), jax.grad(lambda *b: jnp.sum(jnp.sin(f(*b))), argnums=(0, 1, 2, 3, 4))(*a)))

    want, want_grads = value_and_grads(D.dflash_attention_reference)(q, kc, vc, kb, vb)
    for chunk in (1, 3, 7, 16):
        got, got_grads = value_and_grads(functools.partial(D.dflash_attention, anchor_chunk=chunk))(q, kc, vc, kb, vb)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(got_grads, want_grads):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_select_anchors():
    rng = np.random.default_rng(1)
    cand = jnp.asarray(rng.random((3, 40)) > 0.5).at[2].set(False).at[2, 5].set(True)
    anchors, valid = D.select_anchors(jax.random.key(0), cand, 8)
    anchors, valid, cand = np.asarray(anchors), np.asarray(valid), np.asarray(cand)
    for b in range(3):
        picked = anchors[b][valid[b]]
        assert len(picked) == min(8, cand[b].sum()) and cand[b][picked].all()
        assert np.all(np.diff(picked) > 0)  # sorted, without replacement
        assert np.all(anchors[b][~valid[b]] == 0)
    # the candidate rules
    lm = jnp.asarray([[1, 1, 0, 1, 1, 1, 1, 1, 0, 1]], jnp.float32)
    assert np.asarray(D.anchor_candidates(lm, 4, "teacher_kl"))[0].tolist() == [1, 1, 0, 1, 1, 1] + [0] * 4
    assert np.asarray(D.anchor_candidates(lm, 4, "token_ce"))[0].tolist() == [1, 0, 0, 1, 1, 1, 1, 0, 0, 0]


def test_propose_block_matches_training_forward():
    """Greedy drafts from the context cache equal the argmax of the training forward at the same
    anchor; a cache filled in two appends (with stale rows past the valid count) gives the same."""
    cfg = make_cfg()
    vocab = make_vocab(VD)
    params = make_params(cfg)
    batch = make_batch(1, 24, docs=((21,),), pad=3)
    a = 13
    aux = [jnp.asarray(x) for x in batch["aux"]]
    ids, pos = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["positions"])
    h = D.draft_forward(params, cfg, aux_hidden=aux, input_ids=ids, positions=pos,
                        segment_ids=jnp.asarray(batch["segment_ids"]), anchors=jnp.asarray([[a]]),
                        embed_table=jnp.asarray(batch["embed"]))
    want = np.asarray(jnp.argmax(D.draft_logits(params, cfg, h)[0, 0, 1:], -1))
    want = want + vocab.d2t[want]
    common = dict(embed_table=jnp.asarray(batch["embed"]), last_token_b=ids[:, a], last_position_b=pos[:, a],
                  d2t=jnp.asarray(vocab.d2t, jnp.int32))
    one = D.append_context(params, cfg, D.init_context_cache(cfg, 1, 32), [x[:, :a] for x in aux], pos[:, :a])
    tokens, _ = D.propose_block(params, cfg, one, **common)
    np.testing.assert_array_equal(np.asarray(tokens)[0], want)
    two = D.append_context(params, cfg, D.init_context_cache(cfg, 1, 32), [x[:, :9] for x in aux], pos[:, :9],
                           jnp.asarray([5]))  # rows 5..8 written but not counted
    two = D.append_context(params, cfg, two, [x[:, 5:a] for x in aux], pos[:, 5:a])
    assert int(two["length"][0]) == a
    tokens2, logits2 = D.propose_block(params, cfg, two, **common)
    np.testing.assert_array_equal(np.asarray(tokens2), np.asarray(tokens))
    assert logits2.shape == (1, cfg.num_draft_tokens, VD)


def test_config_validation_names_field_and_fix():
    with pytest.raises(ValueError, match=r"DFlashConfig.aux_layer_ids=.*Fix: use ids in \[0, 3\]"):
        D.DFlashConfig(**{**D.config_to_dict(make_cfg()), "rope": RopeSpec(), "aux_layer_ids": (1, 4)}).validate()
    with pytest.raises(ValueError, match=r"DFlashConfig.mask_token_id=.*Fix:"):
        D.DFlashConfig(**{**D.config_to_dict(make_cfg()), "rope": RopeSpec(), "aux_layer_ids": TAPS,
                          "mask_token_id": V}).validate()
    with pytest.raises(ValueError, match=r"DFlashConfig.num_attention_heads=.*Fix:"):
        D.DFlashConfig(**{**D.config_to_dict(make_cfg()), "rope": RopeSpec(), "aux_layer_ids": TAPS,
                          "num_key_value_heads": 3}).validate()
    assert D.config_from_dict(D.config_to_dict(make_cfg())) == make_cfg()
    saved = D.config_to_dict(make_cfg())  # run_meta.json / manifests written before the rename
    saved["target_layer_ids"] = saved.pop("aux_layer_ids")
    assert D.config_from_dict(saved) == make_cfg()
    assert D.spread_aux_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # SpecForge's spread over 36 layers


def test_export_folder(tmp_path):
    cfg = make_cfg()
    vocab = make_vocab(VD)
    params = make_params(cfg)
    target = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
              "num_hidden_layers": 4, "rope_theta": 10000.0, "max_position_embeddings": 256, "eos_token_id": 1}
    out = export_dflash(jax.device_get(params), cfg, target, tmp_path / "head", vocab=vocab, dtype="fp32")
    from safetensors.numpy import load_file

    tensors = load_file(f"{out}/model.safetensors")
    assert set(tensors) == set(exported(params, cfg, vocab)) and tensors["d2t"].dtype == np.int64
    assert tensors["layers.1.self_attn.q_proj.weight"].shape == (NH * HD, H)
    conf = dflash_hf_config(cfg, target, "fp32")
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["dflash_config"]["target_layer_ids"] == [0, 2]
    assert conf["dflash_config"]["mask_token_id"] == MASK and conf["dflash_config"]["causal"] is False
    export_dflash(jax.device_get(params), cfg, target, out, vocab=vocab)  # an earlier export is replaced
    with pytest.raises(ValueError, match="aux_layer_ids.*Fix"):
        dflash_hf_config(cfg, {**target, "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="vocab.*Fix"):
        dflash_state_dict(jax.device_get(params), cfg, None)

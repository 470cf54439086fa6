"""The DSpark drafter (specjax.drafts.dspark, draft.type dspark) against speculators 0.9.0's
`DSparkDraftModel`, fp32 on the CPU, and its own pieces: the Markov-chain proposer, the family, the
export / validator / reader round trip.

Reference comparison: speculators' own DSpark forward (DFlash backbone `_backbone_forward`, its Markov
bias and confidence head, `compute_metrics` with the eager kl_div and tv losses) over one packed row
(two documents with restarting positions, right padding), our anchors handed to its anchor draw, our
weights loaded through the export state dict with strict=True (so a file name or shape vLLM's and
speculators' loaders would not accept fails here). Compared: the Markov-corrected logits of every
block, the total loss, its KL and confidence terms, and the gradient of every weight, for each of
speculators' Markov heads (markov_head_type vanilla, gated, rnn). TOLERANCE: max|ours - ref| / max|ref|
<= 1e-5 per tensor, |loss - ref| / |ref| <= 1e-5 (measured: logits <= 3.5e-7, loss <= 2.1e-7, gradients
<= 2.3e-6 vanilla, 1.8e-6 gated, 3.7e-6 rnn). A perturbed Markov, gate or recurrence weight breaks it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from export._heads import import_speculators_model, speculators_block_model
from specjax.drafts import dflash as D
from specjax.drafts import dspark as P
from specjax.layers.norms import rms_norm
from unit.test_dflash_parity import H, TAPS, V, VD, MASK, make_batch, make_cfg, make_vocab, rel_err

TOL = 1e-5
R = 6  # markov rank


def dspark_cfg(sample_from_anchor=True, confidence=True, with_markov=True, block_size=4, head_type="vanilla"):
    return P.as_dspark(make_cfg(block_size=block_size, sample_from_anchor=sample_from_anchor), markov_rank=R,
                       markov_head_type=head_type, enable_confidence_head=confidence,
                       confidence_head_with_markov=confidence and with_markov)


def dspark_params(cfg, seed=0):
    """Random weights away from the init (kernels std 0.15, norm scales 1 +- 0.3, Markov code std 0.5)."""
    params = P.init_draft_params(cfg, jax.random.key(seed), std=0.15)
    rng = np.random.default_rng(seed + 100)

    def jitter(path, x):
        name = path[-2].key if len(path) > 1 else ""
        if path[-1].key == "scale":
            return jnp.asarray(1.0 + 0.3 * rng.standard_normal(x.shape), jnp.float32)
        if name == "markov_w1" or path[0].key == "confidence_head":
            return jnp.asarray(0.5 * rng.standard_normal(x.shape), jnp.float32)
        return x

    return jax.tree_util.tree_map_with_path(jitter, params)


def exported(params, cfg, vocab) -> dict:
    from specjax_converters.dspark_export import dspark_state_dict

    return dspark_state_dict(jax.device_get(params), cfg, vocab, "float32")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _ours(params, cfg, loss_cfg, kw):
    (loss, m), grads = jax.value_and_grad(lambda p: P.dspark_loss(p, cfg, loss_cfg, **kw), has_aux=True)(params)
    h = D.draft_forward(params, cfg, aux_hidden=kw["aux_hidden"], input_ids=kw["input_ids"], positions=kw["positions"],
                        segment_ids=kw["segment_ids"], anchors=kw["anchors"], embed_table=kw["embed_table"])
    _, gather = D.block_slot_mask(cfg, kw["anchors"], kw["anchor_valid"], kw["loss_mask"])
    logits, conf = P.dspark_logits(params, cfg, h, P.markov_prev_tokens(cfg, gather(kw["input_ids"])))
    return loss, m, grads, logits


def ours(params, cfg, batch, anchors, valid, vocab, gamma, alpha):
    final_hidden = rms_norm(jnp.asarray(batch["pre_norm"]), jnp.asarray(batch["verifier_norm"]), 1e-6)
    kw = dict(anchors=jnp.asarray(anchors), anchor_valid=jnp.asarray(valid), input_ids=jnp.asarray(batch["input_ids"]),
              loss_mask=jnp.asarray(batch["loss_mask"]), segment_ids=jnp.asarray(batch["segment_ids"]),
              positions=jnp.asarray(batch["positions"]), aux_hidden=[jnp.asarray(a) for a in batch["aux"]],
              embed_table=jnp.asarray(batch["embed"]), final_hidden=final_hidden,
              lm_head=jnp.asarray(batch["lm_head_full"]),
              draft_ids=None if vocab is None else jnp.asarray(vocab.draft_ids, jnp.int32))
    loss_cfg = P.DSparkLossConfig(num_anchors=anchors.shape[1], loss_decay_gamma=gamma, anchor_chunk=3,
                                  confidence_alpha=alpha)
    loss, m, grads, logits = _ours(params, cfg, loss_cfg, kw)
    return float(loss), jax.device_get(m), jax.device_get(grads), np.asarray(logits)


def import_speculators_dspark():
    return import_speculators_model("dspark", "DSparkDraftModel", "DSparkSpeculatorConfig")


def speculators_model(sp, cfg, params, vocab, batch):
    rows = batch["lm_head_full"] if vocab is None else batch["lm_head_full"][vocab.draft_ids]
    return speculators_block_model(
        sp, cfg, "dspark", exported(params, cfg, vocab), embed=batch["embed"], verifier_norm=batch["verifier_norm"],
        verifier_head=rows, markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
        enable_confidence_head=cfg.enable_confidence_head, confidence_head_with_markov=cfg.confidence_head_with_markov)


def speculators_run(sp, model, batch, anchors, valid, gamma, alpha):
    """speculators' DSpark forward: its Markov-corrected logits (caught at compute_metrics), loss,
    metrics and gradients, with our anchors."""
    import speculators.models.dspark.core as dspark_core

    torch = sp.torch
    a = torch.from_numpy(np.array(anchors[0], np.int64))
    v = torch.from_numpy(np.array(valid[0]))
    caught = {}
    orig_select, orig_metrics = sp.core.select_anchors, dspark_core.compute_metrics

    def metrics_spy(logits, *args, **kw):
        caught["logits"] = logits.detach().numpy().copy()
        return orig_metrics(logits, *args, **kw)

    sp.core.select_anchors = lambda loss_mask, num_anchors, block_size: (a.clone(), v.clone())
    dspark_core.compute_metrics = metrics_spy
    try:
        doc = np.where(batch["segment_ids"] > 0, batch["segment_ids"], -1)
        model.zero_grad()
        _, loss, metrics = model(
            hidden_states=torch.from_numpy(np.concatenate(batch["aux"], -1)),
            input_ids=torch.from_numpy(batch["input_ids"].astype(np.int64)),
            loss_mask=torch.from_numpy(batch["loss_mask"]),
            verifier_last_hidden_states=torch.from_numpy(batch["pre_norm"]),
            document_ids=torch.from_numpy(doc.astype(np.int64)),
            position_ids=torch.from_numpy(batch["positions"].astype(np.int64)),
            loss_config={"kl_div": (sp.eager.kl_div_loss, 1.0)}, tv_loss_fn=sp.eager.tv_loss, gamma=gamma,
            max_anchors=len(a), confidence_head_alpha=alpha)
        loss.backward()
    finally:
        sp.core.select_anchors, dspark_core.compute_metrics = orig_select, orig_metrics
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), {k: float(x) for k, x in metrics.items()}, grads, caught["logits"]


def compare(cfg, *, seed=0, num_anchors=6, gamma=4.0, alpha=0.7, perturb=None):
    sp = import_speculators_dspark()
    vocab = make_vocab(VD)
    batch = make_batch(1, 24, seed=seed)
    anchors, valid = (np.asarray(x) for x in D.select_anchors(
        jax.random.key(seed + 7), D.anchor_candidates(jnp.asarray(batch["loss_mask"]), cfg.block_size, "teacher_kl"),
        num_anchors))
    params = dspark_params(cfg)
    model = speculators_model(sp, cfg, params, vocab, batch)
    if perturb is not None:
        with sp.torch.no_grad():
            dict(model.named_parameters())[perturb].add_(0.05)
    ref_loss, ref_m, ref_grads, ref_logits = speculators_run(sp, model, batch, anchors, valid, gamma, alpha)
    loss, m, grads, logits = ours(params, cfg, batch, anchors, valid, vocab, gamma, alpha)
    our_grads = exported(grads, cfg, vocab)
    errs = {"logits": rel_err(logits.reshape(ref_logits.shape), ref_logits),
            "loss": abs(loss - ref_loss) / abs(ref_loss)}
    if cfg.enable_confidence_head:
        errs["confidence_loss"] = abs(float(m["confidence_loss"]) - ref_m["confidence_loss_sum"]) / ref_m["confidence_loss_sum"]
    errs.update({f"grad {n}": rel_err(our_grads[n], g) for n, g in ref_grads.items()})
    return errs, (m, ref_m), set(ref_grads), set(our_grads)


@pytest.mark.parametrize("head_type,sample_from_anchor,confidence,with_markov",
                         [("vanilla", True, True, True), ("vanilla", False, True, False), ("vanilla", True, False, False),
                          ("gated", True, True, True), ("gated", False, False, False),
                          ("rnn", True, True, True), ("rnn", False, True, False)])
def test_forward_loss_grads_equal_speculators(head_type, sample_from_anchor, confidence, with_markov):
    cfg = dspark_cfg(sample_from_anchor, confidence, with_markov, head_type=head_type)
    errs, (m, ref_m), graded, files = compare(cfg)
    assert graded == files - {"d2t", "t2d"}  # every exported weight has a reference gradient
    print({k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL, errs
    assert float(m["accept_rate"]) == pytest.approx(ref_m["accept_rate_sum"] / ref_m["accept_rate_total"], rel=TOL)
    assert float(m["accept_len_sum"]) == pytest.approx(ref_m["eal_sum"])
    assert float(m["num_blocks"]) == ref_m["eal_total"]
    if confidence:
        total = ref_m["confidence_abs_error_total"]
        assert float(m["confidence_abs_error"]) == pytest.approx(ref_m["confidence_abs_error_sum"] / total, rel=1e-4)


def test_comparison_can_fail():
    """A perturbed Markov code table moves the logits, the KL and the confidence term (it feeds both heads)."""
    errs, _, _, _ = compare(dspark_cfg(), perturb="markov_head.markov_w1.weight")
    assert errs["logits"] > TOL and errs["loss"] > TOL and errs["confidence_loss"] > TOL


@pytest.mark.parametrize("head_type,weight", [("gated", "markov_head.gate_proj.weight"),
                                              ("rnn", "markov_head.joint_proj.weight")])
def test_comparison_can_fail_per_head_type(head_type, weight):
    """A perturbed gate / recurrence weight moves the Markov-corrected logits and the loss."""
    errs, _, _, _ = compare(dspark_cfg(head_type=head_type), perturb=weight)
    assert errs["logits"] > TOL and errs["loss"] > TOL


# ---------------------------------------------------------------------------------------------
# decoding: one backbone pass, then the Markov chain left to right
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("sample_from_anchor", [True, False])
def test_proposer_is_the_markov_chain_over_the_training_forward(sample_from_anchor, head_type):
    """Greedy: each draft is the argmax of the training forward's Markov-corrected logits of its slot with
    the earlier drafts as the block's tokens (dspark_logits, teacher forcing on the drafts), and for the
    vanilla head vLLM's DSparkSpeculator._sample_sequential by hand. Sampled: each q_i is the softmax of
    those logits (temperature 0.7) given the sampled drafts."""
    cfg = dspark_cfg(sample_from_anchor, head_type=head_type)
    vocab = make_vocab(VD)
    params = dspark_params(cfg)
    batch = make_batch(1, 24, docs=((21,),), pad=3)
    a, k = 13, cfg.num_draft_tokens
    aux = [jnp.asarray(x) for x in batch["aux"]]
    ids, pos = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["positions"])
    h = D.draft_forward(params, cfg, aux_hidden=aux, input_ids=ids, positions=pos,
                        segment_ids=jnp.asarray(batch["segment_ids"]), anchors=jnp.asarray([[a]]),
                        embed_table=jnp.asarray(batch["embed"]))
    base = np.asarray(D.draft_logits(params, cfg, h))[0, 0, cfg.first_trained_slot:]
    w1, w2 = (np.asarray(params["markov_head"][n][leaf]) for n, leaf in (("markov_w1", "embedding"),
                                                                           ("markov_w2", "kernel")))
    d2t = np.asarray(vocab.d2t)

    def forward_logits(drafts):  # the training forward with the block's tokens [x_a, d_0, d_1, ...]
        block = np.zeros((1, 1, cfg.block_size), np.int32)
        block[0, 0, 0], block[0, 0, 1:1 + len(drafts)] = int(ids[0, a]), drafts[:cfg.block_size - 1]
        logits, _ = P.dspark_logits(params, cfg, h, P.markov_prev_tokens(cfg, jnp.asarray(block)))
        return np.asarray(logits)[0, 0, cfg.first_trained_slot:]

    want = []
    for i in range(k):
        d = int(np.argmax(forward_logits(want)[i]))
        want.append(d + int(d2t[d]))
    if head_type == "vanilla":  # vLLM's DSparkSpeculator._sample_sequential
        by_hand, prev = [], int(ids[0, a])
        for i in range(k):
            d = int(np.argmax(base[i] + w1[prev] @ w2))
            prev = d + int(d2t[d])
            by_hand.append(prev)
        assert by_hand == want

    def propose(sample, key=0, temperature=1.0):
        cache = D.append_context(params, cfg, D.init_context_cache(cfg, 1, 32), [x[:, :a - 2] for x in aux],
                                 pos[:, :a - 2])
        pend = [jnp.pad(x[:, a - 2:a], ((0, 0), (0, 3), (0, 0))) for x in aux]  # 2 valid pending rows + stale ones
        drafts, q, _ = P.draft_block(params, jnp.asarray(batch["embed"]), jnp.asarray(d2t, jnp.int32), cache, pend,
                                     jnp.int32(2), jnp.int32(a - 2), ids[0, a], jax.random.key(key),
                                     jnp.float32(temperature), dcfg=cfg, k=k, sample=sample)
        return np.asarray(drafts).tolist(), np.asarray(q)

    assert propose(False)[0] == want
    drafts, q = propose(True, key=3, temperature=0.7)
    want_q = np.asarray(jax.nn.softmax(forward_logits(drafts) / 0.7, axis=-1))
    np.testing.assert_allclose(q, want_q, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# the family and the head format
# ---------------------------------------------------------------------------------------------
def test_family_lookups_and_config():
    from specjax.drafts.families import family_for_type, family_from_meta, family_of

    fam = family_for_type("dspark")
    cfg = dspark_cfg()
    assert family_of(cfg) is fam and family_of(make_cfg()).draft_type == "dflash"
    assert fam.run_meta(cfg)["draft_family"] == "dspark"
    assert family_from_meta("dspark").config_from_dict(fam.config_to_dict(cfg)) == cfg
    assert cfg.num_draft_tokens == 4 and dspark_cfg(False).num_draft_tokens == 3
    with pytest.raises(ValueError, match="markov_rank.*Fix"):
        dataclasses.replace(cfg, markov_rank=0).validate()
    with pytest.raises(ValueError, match="confidence_head_with_markov.*Fix"):
        dataclasses.replace(cfg, enable_confidence_head=False).validate()
    with pytest.raises(ValueError, match="markov_head_type='lstm'.*vanilla, gated, rnn.*Fix"):
        dataclasses.replace(cfg, markov_head_type="lstm").validate()
    rnn = dspark_cfg(head_type="rnn")
    assert family_from_meta("dspark").config_from_dict(fam.config_to_dict(rnn)) == rnn
    assert fam.param_logical_axes(rnn)["markov_head"]["joint_proj"]["kernel"] == (None, None)
    assert "gate_proj" not in fam.param_logical_axes(rnn)["markov_head"]
    axes = fam.param_logical_axes(cfg)
    assert axes["markov_head"]["markov_w2"]["kernel"] == (None, "draft_vocab")


TARGET = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
          "num_hidden_layers": 4, "rope_theta": 10000.0, "max_position_embeddings": 256, "eos_token_id": 1}


def test_export_validate_read_back(tmp_path):
    import json

    from safetensors.numpy import load_file, save_file

    from specjax.drafts.families import family_for_folder
    from specjax_converters.dspark_export import export_dspark
    from specjax_converters.head_formats import errors, validate_folder

    cfg = dspark_cfg()
    vocab = make_vocab(VD)
    params = jax.device_get(dspark_params(cfg))
    out = export_dspark(params, cfg, TARGET, tmp_path / "head", vocab=vocab, dtype="float32")
    conf = json.load(open(f"{out}/config.json"))
    # the keys vLLM 0.32's Qwen3DSparkModel path reads (qwen3_dspark.py, config/speculative.py, eagle3_utils.py)
    assert conf["architectures"] == ["Qwen3DSparkModel"] and conf["model_type"] == "qwen3"
    assert conf["target_layer_ids"] == list(TAPS) and conf["mask_token_id"] == MASK and "dflash_config" not in conf
    assert (conf["markov_rank"], conf["markov_head_type"], conf["block_size"]) == (R, "vanilla", 4)
    assert conf["sample_from_anchor"] and conf["enable_confidence_head"] and conf["confidence_head_with_markov"]
    tensors = load_file(f"{out}/model.safetensors")
    assert tensors["markov_head.markov_w1.weight"].shape == (V, R)
    assert tensors["markov_head.markov_w2.weight"].shape == (VD, R)
    assert tensors["confidence_head.proj.weight"].shape == (1, H + R) and tensors["confidence_head.proj.bias"].shape == (1,)
    findings, info = validate_folder(out, target=TARGET)
    assert info["layout"] == "dspark" and not errors(findings), [str(f) for f in findings]

    fam = family_for_folder(out)
    assert fam.draft_type == "dspark"
    params2, cfg2, vocab2 = fam.load_head(out)
    assert cfg2 == cfg and np.array_equal(vocab2.draft_ids, vocab.draft_ids)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)
    spec = fam.vllm_speculative_config(out, conf, 7)
    assert spec == {"method": "dspark", "model": out, "num_speculative_tokens": 4}

    def broken(edit_conf=None, edit_tensors=None):
        c, t = dict(conf), dict(tensors)
        (edit_conf or (lambda c: None))(c)
        (edit_tensors or (lambda t: None))(t)
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        json.dump(c, open(d / "config.json", "w"))
        save_file(t, str(d / "model.safetensors"))
        found, _ = validate_folder(str(d), target=TARGET)
        return {f.rule for f in errors(found)}, [str(f) for f in errors(found)]

    assert "dspark.markov_head_type" in broken(lambda c: c.update(markov_head_type="lstm"))[0]
    rules, text = broken(lambda c: c.update(markov_head_type="gated"))  # a vanilla head's tensors
    assert "keys.missing" in rules and any("markov_head.gate_proj.weight" in t for t in text)
    assert "keys.missing" in broken(edit_tensors=lambda t: t.pop("markov_head.markov_w1.weight"))[0]
    assert "shapes" in broken(lambda c: c.update(confidence_head_with_markov=False))[0]
    assert "dspark.dflash_config" in broken(lambda c: c.update(dflash_config={"mask_token_id": 3}))[0]
    rules, text = broken(lambda c: c.update(target_layer_ids=[0, 5]))
    assert "dspark.target_layer_ids" in rules and any("Fix:" in s for s in text)
    assert "keys.unknown" in broken(edit_tensors=lambda t: t.update({"markov_head.gate_proj.weight": np.zeros(2, np.float32)}))[0]


@pytest.mark.parametrize("head_type", ["gated", "rnn"])
def test_export_read_back_gated_rnn(tmp_path, head_type):
    """The gated / rnn head's config field and tensors (speculators' names and HF [out, in] shapes)
    round-trip; the validator passes them with a warning (vLLM 0.32 builds only the vanilla head) and
    serve_cmd refuses them; a missing recurrence / gate tensor is an error."""
    import json

    from safetensors.numpy import load_file

    from specjax.drafts.families import family_for_folder
    from specjax_converters.dspark_export import export_dspark
    from specjax_converters.dspark_validate import check_dspark_head
    from specjax_converters.head_formats import errors, validate_folder

    cfg = dspark_cfg(head_type=head_type)
    vocab = make_vocab(VD)
    params = jax.device_get(dspark_params(cfg))
    out = export_dspark(params, cfg, TARGET, tmp_path / "head", vocab=vocab, dtype="float32")
    conf = json.load(open(f"{out}/config.json"))
    assert conf["markov_head_type"] == head_type
    tensors = load_file(f"{out}/model.safetensors")
    name = {"gated": "markov_head.gate_proj", "rnn": "markov_head.joint_proj"}[head_type]
    other = {"gated": "markov_head.joint_proj", "rnn": "markov_head.gate_proj"}[head_type]
    shape = {"gated": (R, H + R), "rnn": (3 * R, 2 * R + H)}[head_type]
    assert tensors[f"{name}.weight"].shape == shape and tensors[f"{name}.bias"].shape == shape[:1]
    assert not any(k.startswith(other) for k in tensors)
    findings, info = validate_folder(out, target=TARGET)
    assert info["layout"] == "dspark" and not errors(findings), [str(f) for f in findings]
    assert any(f.rule == "dspark.markov_head_type" and f.level == "warning" for f in findings)

    fam = family_for_folder(out)
    params2, cfg2, vocab2 = fam.load_head(out)
    assert cfg2 == cfg and np.array_equal(vocab2.draft_ids, vocab.draft_ids)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)
    assert "markov_head_type" in fam.serve_plan(out, "unused-target", 4).error

    missing = {k: v for k, v in tensors.items() if not k.startswith(name)}
    assert {f.rule for f in errors(check_dspark_head(conf, missing))} == {"keys.missing"}

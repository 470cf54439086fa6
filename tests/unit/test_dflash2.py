"""draft.type=dflash2 (specjax.drafts.dflash2, dflash2_family): DFlash plus the dynamic convolutions and
the candidate selector, against speculators 0.9.0's DFlash2DraftModel, fp32 on the CPU.

(1) Reference equality: speculators' own forward and loss (its anchor-block mask over a packed row of
two documents, its unary KL + selector cross-entropy, kl_div eager, gamma 4) on our weights, loaded
through the export's state dict with strict=True; the anchors are ours, handed to it in place of
its random draw. Compared: the unary logits of every block, the candidate scores, the loss and both
terms, the selector-path accepted length ("eal") and the gradient of every weight. TOLERANCE:
max|ours - ref| / max|ref| <= 1e-5 per tensor and |loss - ref| / |ref| <= 1e-5 (measured ~1e-7).
Random convolution / selector weights (not the identity init), so the added parts are exercised;
a perturbed conv or selector weight breaks the tolerance.
(2) The convolution is causal inside a block, and the decoding proposer equals the training forward.
(3) The family: lookups, run_meta round trip, config keys and the full-vocab rule.
(4) The head: export -> validate -> read back; speculators' DFlash2DraftModel.from_pretrained loads
the folder and gives the same logits; serve_cmd's vLLM method.
(5) Lossless speculative decoding (greedy and sampled drafts).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from export._heads import (import_speculators_model, jitter_params, speculators_anchors, speculators_block_model,
                           speculators_inputs)
from specjax.drafts import dflash
from specjax.drafts import dflash2 as D2
from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec
from specjax_converters.dflash2_export import dflash2_state_dict

TOL = 1e-5
V, H, I, NH, NKV, HD = 50, 32, 64, 4, 2, 8
MASK = V - 1
TAPS = (0, 2)


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 1e-30))


def make_cfg(block_size=4, num_layers=2, sample_from_anchor=False, top_k=16):
    cfg = D2.DFlash2Config(hidden_size=H, num_layers=num_layers, num_attention_heads=NH, num_key_value_heads=NKV,
                           head_dim=HD, intermediate_size=I, vocab_size=V, draft_vocab_size=V, aux_layer_ids=TAPS,
                           mask_token_id=MASK, block_size=block_size, rope=RopeSpec("default", 10000.0),
                           max_position_embeddings=256, num_target_layers=4, sample_from_anchor=sample_from_anchor,
                           conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=top_k)
    cfg.validate()
    return cfg


def make_params(cfg, seed=0):
    """Random weights away from the init: kernels std 0.15, norm scales 1 +- 0.3, conv taps and
    deltas random, codebooks std 0.5 (so the selector moves the ranking)."""
    def rule(path, x, rng):
        name = path[-1].key
        if name == "base_kernel":
            return jnp.asarray(x + 0.4 * rng.standard_normal(x.shape), jnp.float32)
        if name.endswith("codebook"):
            return jnp.asarray(0.5 * rng.standard_normal(x.shape), jnp.float32)
        if "kernel_projection" in [getattr(p, "key", None) for p in path]:
            return jnp.asarray(0.2 * rng.standard_normal(x.shape), jnp.float32)
        return x

    return jitter_params(D2.init_draft_params(cfg, jax.random.key(seed), std=0.15), seed, rule)


def make_batch(T=24, seed=0, docs=(14, 7), pad=3):
    rng = np.random.default_rng(seed)
    seg = np.zeros((1, T), np.int32)
    pos = np.zeros((1, T), np.int32)
    t = 0
    for d, n in enumerate(docs):
        seg[0, t:t + n], pos[0, t:t + n] = d + 1, np.arange(n)
        t += n
    assert t + pad <= T
    lm = ((rng.random((1, T)) > 0.25) & (seg > 0)).astype(np.float32)
    return dict(input_ids=rng.integers(0, V - 1, (1, T)).astype(np.int32), loss_mask=lm, segment_ids=seg,
                positions=pos, aux=[(1.5 * rng.standard_normal((1, T, H))).astype(np.float32) for _ in TAPS],
                pre_norm=(2.0 * rng.standard_normal((1, T, H))).astype(np.float32),
                verifier_norm=(1.0 + 0.3 * rng.standard_normal(H)).astype(np.float32),
                embed=rng.standard_normal((V, H)).astype(np.float32),
                lm_head=(0.7 * rng.standard_normal((V, H))).astype(np.float32))


def loss_inputs(batch, anchors, valid, vocab=None) -> dict:
    """The block loss's keyword inputs for a make_batch batch and our anchors (the target's final states
    its verifier norm of the pre-norm ones; `vocab`: the draft vocabulary's ids, when reduced)."""
    kw = dict(anchors=jnp.asarray(anchors), anchor_valid=jnp.asarray(valid), input_ids=jnp.asarray(batch["input_ids"]),
              loss_mask=jnp.asarray(batch["loss_mask"]), segment_ids=jnp.asarray(batch["segment_ids"]),
              positions=jnp.asarray(batch["positions"]), aux_hidden=[jnp.asarray(a) for a in batch["aux"]],
              embed_table=jnp.asarray(batch["embed"]),
              final_hidden=rms_norm(jnp.asarray(batch["pre_norm"]), jnp.asarray(batch["verifier_norm"]), 1e-6),
              lm_head=jnp.asarray(batch["lm_head"]))
    return kw if vocab is None else dict(kw, draft_ids=jnp.asarray(vocab.draft_ids, jnp.int32))


def ours(params, cfg, batch, anchors, valid, gamma=4.0, alpha=1.0):
    loss_cfg = D2.DFlash2LossConfig(num_anchors=anchors.shape[1], loss_decay_gamma=gamma, selector_loss_alpha=alpha,
                                    anchor_chunk=3)
    (loss, m), grads = loss_and_grads(params, cfg, loss_cfg, loss_inputs(batch, anchors, valid))
    return float(loss), jax.device_get(m), jax.device_get(grads)


@functools.partial(jax.jit, static_argnums=(1, 2))
def loss_and_grads(params, cfg, loss_cfg, kw):
    kw = dict(kw, return_scores=True)
    return jax.value_and_grad(lambda p: D2.dflash2_loss(p, cfg, loss_cfg, **kw), has_aux=True)(params)


# ---------------------------------------------------------------------------------------------
# (1) speculators
# ---------------------------------------------------------------------------------------------
def import_speculators_dflash2():
    return import_speculators_model("dflash2", "DFlash2DraftModel", "DFlash2SpeculatorConfig",
                              candidates="speculators.models.dflash2.metrics:selector_training_candidates")


def verifier_weights(sp, batch):
    t = lambda a: sp.torch.from_numpy(np.array(a))  # noqa: E731
    return {"embed_tokens.weight": t(batch["embed"]), "verifier_norm.weight": t(batch["verifier_norm"]),
            "verifier_lm_head.weight": t(batch["lm_head"])}


def speculators_model(sp, cfg, params, batch):
    return speculators_block_model(
        sp, cfg, "dflash2", dflash2_state_dict(params, cfg, "float32"), embed=batch["embed"],
        verifier_norm=batch["verifier_norm"], verifier_head=batch["lm_head"], conv_kernel_size=cfg.conv_kernel_size,
        conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)


def speculators_run(sp, model, batch, anchors, valid, gamma=4.0, alpha=1.0):
    torch = sp.torch
    with speculators_anchors(sp, anchors, valid) as n_anchors:
        kw = speculators_inputs(torch, batch)
        with torch.no_grad():
            hidden, logits, targets, _, idx = model._backbone_forward(**kw, max_anchors=n_anchors)
            cand = logits.topk(model.candidate_selector.top_k, dim=-1).indices
            train_cand, _, _ = sp.candidates(cand, targets.argmax(-1))
            scores = model.candidate_selector.score_candidates(
                logits, hidden, model._predecessor_ids(kw["input_ids"], idx).reshape(1, -1), train_cand)
        model.zero_grad()
        _, loss, metrics = model(**kw, loss_config={"kl_div": (sp.eager.kl_div_loss, 1.0)}, tv_loss_fn=sp.eager.tv_loss,
                                 gamma=gamma, max_anchors=n_anchors, selector_loss_alpha=alpha)
        loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return (float(loss.detach()), {k: float(x) for k, x in metrics.items()}, grads, logits.numpy(), scores.numpy(),
            train_cand.numpy())


def case(sample_from_anchor=False, num_anchors=6, seed=0):
    cfg = make_cfg(sample_from_anchor=sample_from_anchor)
    batch = make_batch(seed=seed)
    cands = dflash.anchor_candidates(jnp.asarray(batch["loss_mask"]), cfg.block_size, "teacher_kl")
    anchors, valid = dflash.select_anchors(jax.random.key(seed + 7), cands, num_anchors)
    return cfg, batch, np.asarray(anchors), np.asarray(valid)


def compare(cfg, batch, anchors, valid, params=None, perturb=None, alpha=1.0):
    sp = import_speculators_dflash2()
    params = make_params(cfg) if params is None else params
    model = speculators_model(sp, cfg, params, batch)
    if perturb is not None:
        with sp.torch.no_grad():
            dict(model.named_parameters())[perturb].add_(0.05)
    ref_loss, ref_m, ref_grads, ref_logits, ref_scores, ref_cand = speculators_run(sp, model, batch, anchors, valid,
                                                                                  alpha=alpha)
    loss, m, grads = ours(params, cfg, batch, anchors, valid, alpha=alpha)
    our_grads = dflash2_state_dict(grads, cfg, "float32")
    errs = {"logits": rel_err(m["logits"].reshape(ref_logits.shape), ref_logits),
            "scores": rel_err(m["scores"].reshape(ref_scores.shape), ref_scores),
            "loss": abs(loss - ref_loss) / abs(ref_loss),
            "unary_loss": abs(float(m["unary_loss"]) - ref_m["unary_loss_sum"]) / abs(ref_m["unary_loss_sum"]),
            "selector_loss": abs(float(m["selector_loss"]) - ref_m["selector_loss_sum"]) / abs(ref_m["selector_loss_sum"])}
    errs.update({f"grad {n}": rel_err(our_grads[n], g) for n, g in ref_grads.items()})
    same_candidates = np.array_equal(m["candidates"].reshape(ref_cand.shape), ref_cand)
    return errs, (m, ref_m), set(ref_grads), same_candidates


@pytest.mark.parametrize("sample_from_anchor", [False, True])
def test_speculators_forward_loss_grads(sample_from_anchor):
    cfg, batch, anchors, valid = case(sample_from_anchor)
    assert valid.all() and len(set(batch["segment_ids"][0, anchors[0]])) == 2  # blocks in both documents
    errs, (m, ref_m), graded, same_candidates = compare(cfg, batch, anchors, valid)
    assert same_candidates
    # every exported weight has a gradient in the reference: the convolutions and the selector too
    assert graded == set(dflash2_state_dict(make_params(cfg), cfg, "float32"))
    print({k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL, errs
    assert float(m["accept_len_sum"]) == pytest.approx(ref_m["eal_sum"])
    assert float(m["num_blocks"]) == ref_m["eal_total"]
    assert float(m["recall"]) == pytest.approx(ref_m["unary_candidate_recall_at_16_sum"]
                                               / ref_m["unary_candidate_recall_at_16_total"])
    # the selector is exercised: the target is missing from some top-k (injected) and the selector
    # path differs from the unary argmax somewhere
    assert 0 < float(m["recall"]) < 1


def test_speculators_comparison_can_fail():
    cfg, batch, anchors, valid = case()
    for name in ("layers.0.mlp_conv.base_kernel", "layers.1.attention_conv.kernel_projection.weight",
                 "candidate_selector.predecessor_codebook"):
        errs, _, _, _ = compare(cfg, batch, anchors, valid, perturb=name)
        assert errs["loss"] > TOL and errs["grad fc.weight"] > TOL, name


# ---------------------------------------------------------------------------------------------
# (2) the convolution and the proposer
# ---------------------------------------------------------------------------------------------
def test_convolution_reads_only_earlier_slots_of_its_block():
    cfg = make_cfg(block_size=5)
    rng = np.random.default_rng(3)
    z = jnp.asarray(rng.standard_normal((2, 3, 5, H)), jnp.float32)  # [B, N blocks, S, H]
    delta = jnp.asarray(rng.standard_normal((2, 3, 5, 2, cfg.num_groups)), jnp.float32)
    base = jnp.asarray(rng.standard_normal((2, H)), jnp.float32)
    for s in range(5):
        g = jax.grad(lambda x: jnp.sum(D2.grouped_conv(x, delta, base, cfg.conv_group_size)[:, 1, s] ** 2))(z)
        moved = np.abs(np.asarray(g)).sum(axis=(0, 3))  # [N, S]
        assert np.all(moved[[0, 2]] == 0) and np.all(moved[1, s + 1:] == 0), s  # no other block, no later slot
        assert np.all(moved[1, max(s - 1, 0):s + 1] > 0), s  # slot s and s-1 (two taps)
        assert np.all(moved[1, :max(s - 1, 0)] == 0), s
    # the identity init: a fresh DFlash 2 layer is the DFlash layer
    params = D2.init_draft_params(cfg, jax.random.key(0), std=0.2)
    b = make_batch()
    kw = dict(aux_hidden=[jnp.asarray(a) for a in b["aux"]], input_ids=jnp.asarray(b["input_ids"]),
              positions=jnp.asarray(b["positions"]), segment_ids=jnp.asarray(b["segment_ids"]),
              anchors=jnp.asarray([[2, 9]]), embed_table=jnp.asarray(b["embed"]))
    np.testing.assert_allclose(np.asarray(D2.draft_forward(params, cfg, **kw)),
                               np.asarray(dflash.draft_forward(params, cfg, **kw)), rtol=1e-5, atol=1e-5)


def test_proposer_equals_the_training_forward():
    """The decoding path (context cache, a block of k+1 slots) gives the training forward's unary
    logits, and its greedy walk picks what the selector scores best with the chosen predecessors."""
    cfg = make_cfg(block_size=4)
    params = make_params(cfg, seed=4)
    b = make_batch(seed=4)
    anchor = 11
    aux = [jnp.asarray(a) for a in b["aux"]]
    cache = dflash.init_context_cache(cfg, 1, 32)
    cache = dflash.append_context(params, cfg, cache, [a[:, :anchor] for a in aux], jnp.asarray(b["positions"])[:, :anchor])
    seg = jnp.ones((1, 24), jnp.int32)
    pos = jnp.arange(24, dtype=jnp.int32)[None]
    cache = dflash.append_context(params, cfg, dflash.init_context_cache(cfg, 1, 32), [a[:, :anchor] for a in aux],
                                  pos[:, :anchor])
    embed = jnp.asarray(b["embed"])
    ids = jnp.asarray(b["input_ids"])
    hn, logits = D2.block_forward(params, cfg, cache, embed_table=embed, last_token_b=ids[:, anchor],
                                  last_position_b=jnp.asarray([anchor]))
    h = D2.draft_forward(params, cfg, aux_hidden=aux, input_ids=ids, positions=pos, segment_ids=seg,
                         anchors=jnp.asarray([[anchor]]), embed_table=embed)
    want_hn, want = D2.final_states(params, cfg, h[0])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), rtol=1e-4, atol=1e-5)
    tokens, q = D2.propose_block(params, cfg, cache, embed_table=embed, last_token_b=ids[:, anchor],
                                 last_position_b=jnp.asarray([anchor]))
    pred = int(ids[0, anchor])
    for j in range(cfg.num_draft_tokens):
        slot = j + 1
        cand = np.argsort(-np.asarray(want[0, slot]))[:cfg.selector_top_k]
        scores = D2.candidate_scores(params, want[0, slot], want_hn[0, slot], jnp.asarray(pred), jnp.asarray(cand))
        pred = int(cand[int(np.argmax(np.asarray(scores)))])
        assert int(tokens[0, j]) == pred and float(q[0, j, pred]) == 1.0
    # sampled drafts: each q sums to 1 over its k candidates and the drawn token is one of them
    tokens, q = D2.propose_block(params, cfg, cache, embed_table=embed, last_token_b=ids[:, anchor],
                                 last_position_b=jnp.asarray([anchor]), key=jax.random.key(1), temperature=0.7)
    np.testing.assert_allclose(np.asarray(q.sum(-1)), 1.0, rtol=1e-5)
    assert np.all(np.asarray((q > 0).sum(-1)) <= cfg.selector_top_k)
    assert all(float(q[0, j, int(tokens[0, j])]) > 0 for j in range(cfg.num_draft_tokens))


# ---------------------------------------------------------------------------------------------
# (3) the family
# ---------------------------------------------------------------------------------------------
def test_family_lookups_run_meta_and_config_keys():
    from specjax.config import ConfigError, load_config
    from specjax.drafts.dflash2_family import DFLASH2
    from specjax.drafts.families import draft_config_from_meta, family_for_type, family_of

    cfg = make_cfg()
    assert family_for_type("dflash2") is DFLASH2 and family_of(cfg) is DFLASH2
    plain = dflash.DFlashConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(dflash.DFlashConfig)})
    assert family_of(plain) is family_for_type("dflash")
    meta = json.loads(json.dumps(DFLASH2.run_meta(cfg)))
    assert meta["draft_family"] == "dflash2" and meta["draft_config"]["selector_top_k"] == 16
    back = draft_config_from_meta(meta)
    assert type(back) is D2.DFlash2Config and back == cfg
    axes = DFLASH2.param_logical_axes(cfg)
    assert jax.tree_util.tree_structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == \
        jax.tree_util.tree_structure(D2.init_draft_params(cfg, jax.random.key(0)))

    run = load_config(None, ["draft.type=dflash2", "draft.block_size=4", "draft.selector_top_k=8",
                             "draft.selector_loss_alpha=0.5", "train.dflash_anchors=8"])
    assert run.draft.selector_top_k == 8 and DFLASH2.make_objective(run, cfg).loss.selector_loss_alpha == 0.5
    for overrides, match in (
            (["draft.type=dflash2", "train.dflash_objective=token_ce"],
             r"`train.dflash_objective` = 'token_ce' is not read by draft.type=dflash2"),
            (["draft.type=dflash", "draft.selector_top_k=4"],
             r"`draft.selector_top_k` is not a key of draft.type=dflash \(DFlash\); it belongs to draft.type=dflash2"),
            (["draft.type=dflash2", "draft.block_size=2", "draft.conv_kernel_size=3"],
             r"`draft.conv_kernel_size` = 3 exceeds `draft.block_size` = 2")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)
    with pytest.raises(ValueError, match=r"draft_vocab_size=24: is not the target vocab \(50\).*Fix: set "
                                         r"draft_vocab_size=50"):
        dataclasses.replace(cfg, draft_vocab_size=24).validate()
    with pytest.raises(ValueError, match=r"conv_group_size=5: does not divide hidden_size=32"):
        dataclasses.replace(cfg, conv_group_size=5).validate()


# ---------------------------------------------------------------------------------------------
# (4) the head
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    from eval._models import build_target
    from specjax.targets.loading import load_target

    path = build_target(tmp_path_factory.mktemp("dflash2"), "LlamaForCausalLM", False, seed=1)
    target = load_target(path, dtype="float32")
    base = dflash.config_from_target(target.config, draft_vocab_size=target.config.vocab_size, mask_token_id=3,
                                     num_layers=1, block_size=4, aux_layer_ids=(0, 2))
    cfg = D2.as_dflash2(base, conv_group_size=8, selector_rank=8, selector_top_k=8)
    cfg.validate()
    params = make_params(cfg, seed=2)
    # what a trained head holds: the target's lm_head (DFlash keeps it frozen; speculators' loader
    # rebuilds it from the verifier at speculators_config.verifier.name_or_path)
    params["lm_head"]["kernel"] = jnp.asarray(target.lm_head_weight(target.params), jnp.float32).T
    return path, target, cfg, params


def test_export_validate_read_back_and_speculators_loads_it(target_and_draft, tmp_path):
    from specjax import serve_cmd
    from specjax.drafts.dflash2_family import DFLASH2
    from specjax.drafts.families import family_for_folder
    from specjax_converters.head_formats import errors, validate_folder

    path, target, cfg, params = target_and_draft
    hf = json.load(open(os.path.join(path, "config.json")))
    out = DFLASH2.export(jax.device_get(params), cfg, None, hf, tmp_path / "head", dtype="float32",
                         extra_manifest={"target_path": path})
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["speculators_model_type"] == "dflash2" and conf["architectures"] == ["DFlash2DraftModel"]
    assert conf["aux_hidden_state_layer_ids"] == [1, 3] and conf["speculators_config"]["verifier"]["name_or_path"] == path
    findings, info = validate_folder(out, target=path)
    assert info["layout"] == "dflash2" and not errors(findings), [str(f) for f in findings]
    assert family_for_folder(out) is DFLASH2
    head_params, head_cfg, vocab = DFLASH2.load_head(out)
    assert head_cfg == cfg and int(np.abs(np.asarray(vocab.d2t)).sum()) == 0
    flat = jax.tree_util.tree_leaves_with_path
    assert [p for p, _ in flat(head_params)] == [p for p, _ in flat(params)]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), (_, b) in zip(flat(head_params), flat(params)))
    # draft.init_from: a run of the same shape starts from the head's weights
    start = DFLASH2.warm_start(out, cfg, vocab, D2.init_draft_params(cfg, jax.random.key(5)))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), (_, b) in zip(flat(start), flat(params)))
    with pytest.raises(ValueError, match=r"does not fit this run's draft: selector_rank: head 8 vs run 4"):
        DFLASH2.warm_start(out, dataclasses.replace(cfg, selector_rank=4), vocab, {})
    assert serve_cmd.vllm_speculative_config(out, 7) == {"method": "dflash", "model": out, "num_speculative_tokens": 3}
    code, text = serve_cmd.build(out, path, engine="vllm")
    assert code == 0 and '"method": "dflash"' in text and "V2 model runner" in text, text

    # speculators' own loader reads the folder (config and every weight) and runs the same network
    sp = import_speculators_dflash2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = sp.Model.from_pretrained(out)
    assert type(model.config) is sp.Config and model.config.selector_top_k == 8
    loaded = {k: v.numpy() for k, v in model.state_dict().items()}
    for k, v in dflash2_state_dict(params, cfg, "float32").items():
        assert np.array_equal(loaded[k], v), k
    b = make_batch(seed=6)
    b["embed"] = np.asarray(target.embed_table(target.params))
    b["lm_head"] = np.asarray(target.lm_head_weight(target.params))
    b["input_ids"] = b["input_ids"] % cfg.vocab_size
    b["aux"] = [np.random.default_rng(i).standard_normal((1, 24, cfg.hidden_size)).astype(np.float32) for i in range(2)]
    b["pre_norm"] = np.random.default_rng(9).standard_normal((1, 24, cfg.hidden_size)).astype(np.float32)
    b["verifier_norm"] = np.ones(cfg.hidden_size, np.float32)
    model.load_state_dict({**model.state_dict(), **verifier_weights(sp, b)})
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", sp.core.create_float_mask
    anchors, valid = np.array([[2, 9, 15]]), np.ones((1, 3), bool)
    _, _, _, ref_logits, _, _ = speculators_run(sp, model.float(), b, anchors, valid)
    _, m, _ = ours(params, cfg, b, anchors, valid)
    assert rel_err(m["logits"].reshape(ref_logits.shape), ref_logits) <= TOL

    # a broken config is named by the validator
    conf["draft_vocab_size"] = 10
    conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7
    from specjax_converters.dflash2_validate import check_dflash2_head

    bad = {f.rule for f in errors(check_dflash2_head(conf, dflash2_state_dict(params, cfg, "float32")))}
    assert {"dflash2.vocab", "dflash2.speculative_tokens"} <= bad, bad


# ---------------------------------------------------------------------------------------------
# (5) lossless speculative decoding
# ---------------------------------------------------------------------------------------------
def test_lossless_speculative_decoding(target_and_draft):
    from specjax.drafts.vocab import DraftVocab
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import Draft, SpecDecoder

    _, target, cfg, params = target_and_draft
    prompt, n = [5, 17, 3, 9, 11, 2, 40], 13
    want = generate(target, [prompt], max_new_tokens=n)[0]
    draft = Draft(params, cfg, DraftVocab.identity(cfg.vocab_size))
    res = SpecDecoder(target, draft, num_spec_tokens=cfg.num_draft_tokens).generate(prompt, max_new_tokens=n)
    assert res.tokens == want[:n] and sum(res.accept_lengths) == n - 1

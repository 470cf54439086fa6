"""draft.type=xpress (specjax.drafts.xpress, xpress_family): DFlash plus the causal refiner head and its
Jacobi passes, against speculators 0.9.0's XPressDraftModel, fp32 on the CPU.

(1) Reference equality: speculators' own forward and loss (its anchor-block mask over a packed row of
two documents; the teacher-forced refiner pass, 3 Jacobi consistency rounds, the base-anchor term; its
eager ce 0.1 + tv 0.9 compound loss, gamma 4) on our weights loaded through the export's state dict with
strict=True, our anchors handed to it. Compared: the base logits of every block, the loss and the
gradient of every weight, with a reduced draft vocab (d2t maps the rounds' argmax to target ids) and
with the full vocab and sample_from_anchor. TOLERANCE: max|ours - ref| / max|ref| <= 1e-5 per tensor,
|loss - ref| / |ref| <= 1e-5. A perturbed refiner weight breaks it.
(2) Decoding: the Jacobi passes of the proposer equal passes run by hand on the training forward's
states; lossless speculative decoding; sampled (temperature 1.0): the device loop draws what the host
decoder draws with the same seeds, and the second new token follows the target's marginal.
(3) The family and the head: lookups, run_meta, config keys, export -> validate -> read back ->
speculators' XPressDraftModel.from_pretrained; serve_cmd prints no engine command.
(4) Training end to end on the tiny target: the loss falls, the export validates, decoding is lossless.
(5) draft.xpress_slot0_prev=anchor (vLLM 0.34's convention): the loss equals the default's on a batch
whose token before the anchor is the anchor (brute force); the proposer's last pass equals a NumPy
float64 transcription of vLLM 0.34's Jacobi refinement (qwen3_xpress.py jacobi_refine_greedy with
xpress_topc 0 and kernels.py's latent pass: slot 0 reads the anchor) on the weights of the 0.34-layout
export, to 1e-5 in the drafted probabilities and token for token, while the reference with slot 0
reading the token before the anchor (speculators') matches the default setting instead and not this
one; decoding is lossless; the 0.34-layout export validates, reads back (same config, same params, same
drafts) and serve_cmd prints 0.34's command (method dflash, block_size - 1 tokens).
"""
from __future__ import annotations

import functools
import json
import os
import shlex
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from export._heads import (import_speculators_model, jitter_params, speculators_anchors, speculators_block_model,
                           speculators_inputs)
from specjax.drafts import dflash
from specjax.drafts import xpress as X
from specjax.drafts.vocab import DraftVocab
from specjax.drafts.xpress_weights import XPRESS_WEIGHTS
from specjax.layers.norms import rms_norm
from specjax.layers.rope import RopeSpec
from specjax_converters.dflash2_export import speculators_state_dict
from test_dflash2 import HD, I, MASK, NH, NKV, TAPS, H, V, loss_inputs, make_batch, rel_err

TOL = 1e-5


def make_cfg(vd=24, sample_from_anchor=False, block_size=4, slot0_prev="before_anchor"):
    cfg = X.XPressConfig(hidden_size=H, num_layers=2, num_attention_heads=NH, num_key_value_heads=NKV, head_dim=HD,
                         intermediate_size=I, vocab_size=V, draft_vocab_size=vd, aux_layer_ids=TAPS,
                         mask_token_id=MASK, block_size=block_size, rope=RopeSpec("default", 10000.0),
                         max_position_embeddings=256, num_target_layers=4, sample_from_anchor=sample_from_anchor,
                         xpress_rank=8, xpress_mlp_ratio=2, num_jacobi_passes=3, xpress_slot0_prev=slot0_prev)
    cfg.validate()
    return cfg


def make_params(cfg, seed=0):
    def rule(path, x, rng):
        name = path[-1].key
        if name in ("mix_l", "embedding"):
            return jnp.asarray(0.5 * rng.standard_normal(x.shape), jnp.float32)
        if name == "kernel" and path[0].key == "refiner_head":
            return jnp.asarray(0.4 * rng.standard_normal(x.shape), jnp.float32)
        return x

    return jitter_params(X.init_draft_params(cfg, jax.random.key(seed), std=0.15), seed, rule)


def make_vocab(vd, seed=0):
    return None if vd == V else DraftVocab.from_ids(np.random.default_rng(seed).choice(V, vd, replace=False), V)


def ours(params, cfg, batch, anchors, valid, vocab):
    loss_cfg = X.XPressLossConfig(num_anchors=anchors.shape[1], anchor_chunk=3)
    (loss, m), grads = loss_and_grads(params, cfg, loss_cfg, loss_inputs(batch, anchors, valid, vocab))
    return float(loss), jax.device_get(m), jax.device_get(grads)


@functools.partial(jax.jit, static_argnums=(1, 2))
def loss_and_grads(params, cfg, loss_cfg, kw):
    kw = dict(kw, return_logits=True)
    return jax.value_and_grad(lambda p: X.xpress_loss(p, cfg, loss_cfg, **kw), has_aux=True)(params)


# ---------------------------------------------------------------------------------------------
# (1) speculators
# ---------------------------------------------------------------------------------------------
def import_speculators_xpress():
    return import_speculators_model("xpress", "XPressDraftModel", "XPressSpeculatorConfig")


def speculators_model(sp, cfg, params, batch, vocab):
    rows = batch["lm_head"] if vocab is None else batch["lm_head"][vocab.draft_ids]
    return speculators_block_model(
        sp, cfg, "xpress", speculators_state_dict(params, cfg, XPRESS_WEIGHTS, vocab, "float32"), embed=batch["embed"],
        verifier_norm=batch["verifier_norm"], verifier_head=rows, xpress_rank=cfg.xpress_rank,
        xpress_mlp_ratio=cfg.xpress_mlp_ratio, num_jacobi_passes=cfg.num_jacobi_passes)


def speculators_run(sp, model, batch, anchors, valid):
    torch = sp.torch
    with speculators_anchors(sp, anchors, valid) as n_anchors:
        kw = speculators_inputs(torch, batch)
        with torch.no_grad():
            _, logits, _, _, _ = model._backbone_forward(**kw, max_anchors=n_anchors)
        model.zero_grad()
        _, loss, metrics = model(**kw, loss_config={"ce": (sp.eager.ce_loss, 0.1), "tv": (sp.eager.tv_loss, 0.9)},
                                 gamma=4.0, max_anchors=n_anchors, consistency_weight=0.3, consistency_passes=3,
                                 base_anchor_weight=0.6)
        loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), {k: float(x) for k, x in metrics.items()}, grads, logits.numpy()


def compare(cfg, vocab, batch, anchors, valid, perturb=None):
    sp = import_speculators_xpress()
    params = make_params(cfg)
    model = speculators_model(sp, cfg, params, batch, vocab)
    if perturb is not None:
        with sp.torch.no_grad():
            dict(model.named_parameters())[perturb].add_(0.05)
    ref_loss, ref_m, ref_grads, ref_logits = speculators_run(sp, model, batch, anchors, valid)
    loss, m, grads = ours(params, cfg, batch, anchors, valid, vocab)
    our_grads = speculators_state_dict(grads, cfg, XPRESS_WEIGHTS, vocab, "float32")
    errs = {"base_logits": rel_err(m["base"].reshape(ref_logits.shape), ref_logits),
            "loss": abs(loss - ref_loss) / abs(ref_loss),
            "tf_loss": abs(float(m["tf_loss"]) - ref_m["tf_loss_sum"]) / abs(ref_m["tf_loss_sum"]),
            "consistency_loss": abs(float(m["consistency_loss"]) - ref_m["consistency_loss_sum"])
            / abs(ref_m["consistency_loss_sum"])}
    errs.update({f"grad {n}": rel_err(our_grads[n], g) for n, g in ref_grads.items()})
    return errs, set(ref_grads), our_grads


def case(vd=24, sample_from_anchor=False, seed=0):
    cfg = make_cfg(vd=vd, sample_from_anchor=sample_from_anchor)
    batch = make_batch(seed=seed)
    cands = dflash.anchor_candidates(jnp.asarray(batch["loss_mask"]), cfg.block_size, "teacher_kl")
    anchors, valid = dflash.select_anchors(jax.random.key(seed + 7), cands, 6)
    return cfg, make_vocab(vd), batch, np.asarray(anchors), np.asarray(valid)


@pytest.mark.parametrize("vd,sample_from_anchor", [(24, False), (V, True)])
def test_speculators_forward_loss_grads(vd, sample_from_anchor):
    cfg, vocab, batch, anchors, valid = case(vd, sample_from_anchor)
    assert valid.all() and len(set(batch["segment_ids"][0, anchors[0]])) == 2
    errs, graded, ours_grads = compare(cfg, vocab, batch, anchors, valid)
    assert graded == set(ours_grads) - {"d2t", "t2d"}  # every exported weight, the refiner's too
    print({k: f"{x:.1e}" for k, x in errs.items()})
    assert max(errs.values()) <= TOL, errs


def test_speculators_comparison_can_fail():
    cfg, vocab, batch, anchors, valid = case()
    for name in ("refiner_head.mix_l", "refiner_head.token_embed.weight"):
        errs, _, _ = compare(cfg, vocab, batch, anchors, valid, perturb=name)
        assert errs["loss"] > TOL, name


# ---------------------------------------------------------------------------------------------
# (2) decoding
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    from eval._models import build_target
    from specjax.targets.loading import load_target

    path = build_target(tmp_path_factory.mktemp("xpress"), "LlamaForCausalLM", False, seed=1)
    target = load_target(path, dtype="float32")
    tv = target.config.vocab_size
    base = dflash.config_from_target(target.config, draft_vocab_size=48, mask_token_id=3, num_layers=1, block_size=4,
                                     aux_layer_ids=(0, 2))
    cfg = X.as_xpress(base, xpress_rank=8, xpress_mlp_ratio=2, num_jacobi_passes=2)
    vocab = DraftVocab.from_ids(np.arange(0, tv, 2), tv)
    params = make_params(cfg, seed=3)
    params["lm_head"]["kernel"] = jnp.asarray(target.lm_head_weight(target.params), jnp.float32)[vocab.draft_ids].T
    return path, target, cfg, params, vocab


def test_proposer_runs_the_jacobi_passes_of_the_training_forward(target_and_draft):
    _, _, cfg, params, vocab = target_and_draft
    rng = np.random.default_rng(4)
    T, anchor = 20, 11
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, T)), jnp.int32)
    aux = [jnp.asarray(rng.standard_normal((1, T, cfg.hidden_size)), jnp.float32) for _ in cfg.aux_layer_ids]
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32)
    pend_tok = ids[:, 1:anchor + 1]  # pend_tok[i]: the token at position i + 1 (the last one is the anchor)
    d2t = jnp.asarray(vocab.d2t, jnp.int32)
    cache = X.init_decode_cache(cfg, 32)
    tokens, _, _ = X.draft_block(params, embed, d2t, cache, pend_tok, [a[:, :anchor] for a in aux], jnp.int32(anchor),
                                 jnp.int32(0), ids[0, anchor], jax.random.key(0), jnp.float32(1.0), dcfg=cfg,
                                 k=cfg.num_draft_tokens, sample=False)
    h = dflash.draft_forward(params, cfg, aux_hidden=aux, input_ids=ids, positions=jnp.arange(T)[None],
                             segment_ids=jnp.ones((1, T), jnp.int32), anchors=jnp.asarray([[anchor]]),
                             embed_table=embed)
    hn = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps)
    base = hn @ params["lm_head"]["kernel"]
    draft_ids = jnp.asarray(vocab.draft_ids, jnp.int32)
    pred = draft_ids[jnp.argmax(base, -1)][0, 0]  # [S]
    ref = params["refiner_head"]
    for _ in range(cfg.num_jacobi_passes):  # by hand: slot 0 reads x[a-1], slot k the previous pass's token k-1
        prev = jnp.concatenate([ids[0, anchor - 1:anchor], ids[0, anchor:anchor + 1], pred[1:-1]])
        pred = draft_ids[jnp.argmax(base[0, 0] + X.block_bias(ref, prev, X.hidden_cache(ref, hn[0, 0])), -1)]
    assert np.asarray(tokens).tolist() == np.asarray(pred[1:]).tolist()


def test_lossless_speculative_decoding(target_and_draft):
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import Draft, SpecDecoder

    _, target, cfg, params, vocab = target_and_draft
    prompt, n = [5, 17, 3, 9, 11, 2, 40], 13
    want = generate(target, [prompt], max_new_tokens=n)[0]
    res = SpecDecoder(target, Draft(params, cfg, vocab), num_spec_tokens=cfg.num_draft_tokens).generate(
        prompt, max_new_tokens=n)
    assert res.tokens == want[:n] and sum(res.accept_lengths) == n - 1


def test_sampled_loop_equals_host_decoder(target_and_draft):
    """Temperature 1.0: the batched device loop's rows are the host decoder's draws with the same
    seeds (row r: seed + r), token for token and accept length for accept length. The refiner's
    weights are scaled by 0.3 (its Jacobi passes still run): with the fixture's large ones the drafts
    are almost never accepted at this temperature, and the accept path would go unchecked."""
    from specjax.eval.spec_decode import Draft, SpecDecoder
    from specjax.eval.spec_loop import SpecLoop

    _, target, cfg, params, vocab = target_and_draft
    prompts = [[5, 17, 3, 9, 11, 2, 40], [1, 8, 30], [12, 2, 2, 7, 19]]
    milder = {**params, "refiner_head": jax.tree_util.tree_map(lambda a: 0.3 * a, params["refiner_head"])}
    dec = SpecDecoder(target, Draft(milder, cfg, vocab), num_spec_tokens=cfg.num_draft_tokens)
    got = SpecLoop(dec).generate(prompts, max_new_tokens=10, temperature=1.0, seed=5)
    for r, (row, prompt) in enumerate(zip(got, prompts)):
        want = dec.generate(prompt, max_new_tokens=10, temperature=1.0, seed=5 + r)
        assert (row.tokens, list(row.accept_lengths)) == (want.tokens, list(want.accept_lengths))
    assert sum(sum(row.accepted_per_position) for row in got) > 0


def test_sampled_decoding_follows_the_target(target_and_draft):
    """Temperature 1.0 with a peaked XPress head (lm_head x 10, Jacobi passes on): the second new token
    (the first a verification step emits) follows the target's marginal (eval/_sampling.py's bound)."""
    from eval._sampling import assert_second_token_follows_target
    from specjax.eval.spec_decode import Draft

    _, target, cfg, params, vocab = target_and_draft
    draft = Draft({**params, "lm_head": dict(params["lm_head"])}, cfg, vocab)  # the helper scales lm_head
    assert_second_token_follows_target(target, lambda seqs: target(jnp.asarray(seqs)).logits, temp=1.0, draft=draft)


# ---------------------------------------------------------------------------------------------
# (3) the family and the head
# ---------------------------------------------------------------------------------------------
def test_family_and_head(target_and_draft, tmp_path):
    from specjax import serve_cmd
    from specjax.config import ConfigError, load_config
    from specjax.drafts.families import draft_config_from_meta, family_for_folder, family_for_type, family_of
    from specjax.drafts.xpress_family import XPRESS
    from specjax_converters.head_formats import errors, validate_folder

    path, target, cfg, params, vocab = target_and_draft
    assert family_for_type("xpress") is XPRESS and family_of(cfg) is XPRESS
    meta = json.loads(json.dumps(XPRESS.run_meta(cfg)))
    assert meta["draft_family"] == "xpress" and draft_config_from_meta(meta) == cfg
    run = load_config(None, ["draft.type=xpress", "draft.block_size=4", "draft.num_jacobi_passes=0",
                             "draft.consistency_weight=0.5", "train.dflash_anchors=8"])
    loss_cfg = XPRESS.make_objective(run, cfg).loss
    assert loss_cfg.consistency_weight == 0.5 and loss_cfg.ce_weight == 0.1 and loss_cfg.tv_weight == 0.9
    with pytest.raises(ConfigError, match=r"`draft.xpress_rank` is not a key of draft.type=dflash2"):
        load_config(None, ["draft.type=dflash2", "draft.xpress_rank=8"])

    hf = json.load(open(os.path.join(path, "config.json")))
    out = XPRESS.export(jax.device_get(params), cfg, vocab, hf, tmp_path / "head", dtype="float32",
                        extra_manifest={"target_path": path})
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["speculators_model_type"] == "xpress" and conf["num_jacobi_passes"] == 2
    findings, info = validate_folder(out, target=path)
    assert info["layout"] == "xpress" and not errors(findings), [str(f) for f in findings]
    assert family_for_folder(out) is XPRESS
    head_params, head_cfg, head_vocab = XPRESS.load_head(out)
    assert head_cfg == cfg and np.array_equal(head_vocab.draft_ids, vocab.draft_ids)
    flat = jax.tree_util.tree_leaves_with_path
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), (_, b) in zip(flat(head_params), flat(params)))
    code, text = serve_cmd.build(out, path, engine="vllm")
    assert code == 0 and "vLLM 0.32 has no XPress model" in text and "--speculative" not in text, text

    sp = import_speculators_xpress()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = sp.Model.from_pretrained(out)
    assert type(model.config) is sp.Config and model.config.num_jacobi_passes == 2
    loaded = {k: v.numpy() for k, v in model.state_dict().items()}
    for k, v in speculators_state_dict(params, cfg, XPRESS_WEIGHTS, vocab, "float32").items():
        assert np.array_equal(loaded[k], v), k


# ---------------------------------------------------------------------------------------------
# (5) draft.xpress_slot0_prev=anchor: vLLM 0.34's convention and layout
# ---------------------------------------------------------------------------------------------
def test_anchor_convention_settings():
    import dataclasses

    from specjax.config import ConfigError, load_config

    with pytest.raises(ValueError, match="full draft vocab"):
        make_cfg(vd=24, slot0_prev="anchor")
    with pytest.raises(ValueError, match="refuses sample_from_anchor"):
        make_cfg(vd=V, sample_from_anchor=True, slot0_prev="anchor")
    with pytest.raises(ValueError, match="not one of"):
        dataclasses.replace(make_cfg(), xpress_slot0_prev="previous").validate()
    run = load_config(None, ["draft.type=xpress", "draft.xpress_slot0_prev=anchor"])
    assert run.draft.xpress_slot0_prev == "anchor"
    assert load_config(None, ["draft.type=xpress"]).draft.xpress_slot0_prev == "before_anchor"
    for bad, phrase in ((["draft.xpress_slot0_prev=previous"], "must be one of"),
                        (["draft.xpress_slot0_prev=anchor", "draft.sample_from_anchor=true"], "refuses")):
        with pytest.raises(ConfigError, match=phrase):
            load_config(None, ["draft.type=xpress", *bad])


def test_anchor_loss_is_the_default_loss_with_the_anchor_before_it():
    """Brute force: with one block per row, slot 0 reading the anchor is slot 0 reading the token before
    the anchor on a batch where that token is the anchor (nothing else reads it: the context comes from
    the target's states, the teacher from its final states)."""
    batch = make_batch(seed=2)
    a = 6  # inside the first document, not its first token
    assert batch["segment_ids"][0, a - 1] == batch["segment_ids"][0, a] and batch["input_ids"][0, a - 1] != \
        batch["input_ids"][0, a]
    anchors, valid = np.asarray([[a]]), np.asarray([[True]])
    anchored, default = make_cfg(vd=V, slot0_prev="anchor"), make_cfg(vd=V)
    params = make_params(default)
    moved = dict(batch, input_ids=batch["input_ids"].copy())
    moved["input_ids"][0, a - 1] = batch["input_ids"][0, a]
    loss_a, m_a, g_a = ours(params, anchored, batch, anchors, valid, None)
    loss_m, m_m, g_m = ours(params, default, moved, anchors, valid, None)
    loss_d, _, _ = ours(params, default, batch, anchors, valid, None)
    assert abs(loss_a - loss_m) <= 1e-6 * abs(loss_m) and rel_err(m_a["logits_tf"], m_m["logits_tf"]) <= 1e-6
    assert rel_err(g_a["refiner_head"]["token_embed"]["embedding"], g_m["refiner_head"]["token_embed"]["embedding"]) \
        <= 1e-6
    assert abs(loss_a - loss_d) > 1e-4 * abs(loss_d)  # the setting matters on the real batch


def vllm034_jacobi(sd, hn, base, anchor, am1, passes):
    """NumPy float64 of vLLM 0.34's XPress refinement of one block with xpress_topc 0, written from
    its code on the tensors of its own layout `sd` (file names, HF [out, in]): mix.L folded to
    L*tril + I (qwen3_xpress.py:86-95); the hidden cache [down_h(h); down_g(mean h)] through in_proj's
    first 2r columns (:97-101, 195); the block seeded [anchor, argmax base[1:]] (:132-146); each pass:
    slot b reads blk[b - 1], slot 0 reads `am1` (kernels.py:136-138; 0.34 passes the anchor,
    xpress/speculator.py:87-90), x = hc + w1[prev] @ in_proj[:, 2r:].T, u[b] = sum_j L[:, b, j] x[j],
    x = u + SwiGLU(u), logits = base[1:] + x[1:] @ w2.T, blk[1:] = argmax (kernels.py:124-186,
    qwen3_xpress.py:198-214). Returns (draft ids [B - 1], last pass's logits [B - 1, V])."""
    f = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    hn, base = np.asarray(hn, np.float64), np.asarray(base, np.float64)
    B, r = hn.shape[0], f["xpress_head.down_h.weight"].shape[0]
    L = f["xpress_head.mix.L"] * np.tril(np.ones((B, B))) + np.eye(B)
    g = np.broadcast_to(hn.mean(0, keepdims=True), hn.shape)
    hc = np.concatenate([hn @ f["xpress_head.down_h.weight"].T, g @ f["xpress_head.down_g.weight"].T], -1)
    w_in = f["xpress_head.in_proj.weight"]
    xh = hc @ w_in[:, :2 * r].T
    blk = np.concatenate([[anchor], base[1:].argmax(-1)])
    silu = lambda z: z / (1.0 + np.exp(-z))  # noqa: E731
    logits = base[1:]
    for _ in range(passes):
        prev = np.concatenate([[am1], blk[:-1]])
        x = xh + f["xpress_head.w1.weight"][prev] @ w_in[:, 2 * r:].T
        u = np.einsum("rbj,jr->br", L, x)
        x = u + (silu(u @ f["xpress_head.mlp.gate_proj.weight"].T) * (u @ f["xpress_head.mlp.up_proj.weight"].T)) \
            @ f["xpress_head.mlp.down_proj.weight"].T
        logits = base[1:] + x[1:] @ f["xpress_head.w2.weight"].T
        blk = np.concatenate([[anchor], logits.argmax(-1)])
    return blk[1:], logits


@pytest.fixture(scope="module")
def anchored_draft(target_and_draft):
    """A full-vocab XPress head (0.34 needs it) with slot 0 reading the anchor, on the fixture's target."""
    import dataclasses

    _, target, small, _, _ = target_and_draft
    cfg = dataclasses.replace(small, draft_vocab_size=target.config.vocab_size, num_jacobi_passes=3,
                              xpress_slot0_prev="anchor")
    cfg.validate()
    params = make_params(cfg, seed=5)
    params["lm_head"]["kernel"] = jnp.asarray(target.lm_head_weight(target.params), jnp.float32).T
    return cfg, params, DraftVocab.identity(cfg.vocab_size)


def softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_anchor_proposer_equals_vllm034_refinement(anchored_draft):
    import dataclasses

    from specjax_converters.xpress_export import xpress_vllm034_state_dict

    cfg, params, vocab = anchored_draft
    rng = np.random.default_rng(8)
    T, anchor = 20, 11
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, T)), jnp.int32)
    ids = ids.at[0, anchor - 1].set((ids[0, anchor] + 1) % cfg.vocab_size)  # the token before differs
    aux = [jnp.asarray(rng.standard_normal((1, T, cfg.hidden_size)), jnp.float32) for _ in cfg.aux_layer_ids]
    embed = jnp.asarray(rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), jnp.float32)
    d2t = jnp.zeros((cfg.vocab_size,), jnp.int32)

    def propose(c, sample):
        return X.draft_block(params, embed, d2t, X.init_decode_cache(c, 32), ids[:, 1:anchor + 1],
                             [x[:, :anchor] for x in aux], jnp.int32(anchor), jnp.int32(0), ids[0, anchor],
                             jax.random.key(0), jnp.float32(1.0), dcfg=c, k=c.num_draft_tokens, sample=sample)[:2]

    h = dflash.draft_forward(params, cfg, aux_hidden=aux, input_ids=ids, positions=jnp.arange(T)[None],
                             segment_ids=jnp.ones((1, T), jnp.int32), anchors=jnp.asarray([[anchor]]),
                             embed_table=embed)
    hn = rms_norm(h, params["norm"]["scale"], cfg.rms_norm_eps)[0, 0]
    base = hn @ params["lm_head"]["kernel"]
    sd = xpress_vllm034_state_dict(jax.device_get(params), cfg, "float32")
    want, logits = vllm034_jacobi(sd, hn, base, int(ids[0, anchor]), int(ids[0, anchor]), cfg.num_jacobi_passes)
    other, other_logits = vllm034_jacobi(sd, hn, base, int(ids[0, anchor]), int(ids[0, anchor - 1]),
                                         cfg.num_jacobi_passes)
    default = dataclasses.replace(cfg, xpress_slot0_prev="before_anchor")
    got, q = propose(cfg, False)[0], propose(cfg, True)[1]
    q_default = propose(default, True)[1]
    assert np.asarray(got).tolist() == want.tolist()
    assert rel_err(q, softmax(logits)) <= TOL and rel_err(q_default, softmax(other_logits)) <= TOL
    assert rel_err(q, softmax(other_logits)) > 1e-3  # the reference tells the two conventions apart


def test_anchor_decoding_is_lossless_and_exports_in_vllm034_layout(target_and_draft, anchored_draft, tmp_path):
    from specjax import serve_cmd
    from specjax.drafts.families import family_for_folder
    from specjax.drafts.xpress_family import XPRESS
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import Draft, SpecDecoder
    from specjax.export import validate_cli
    from specjax_converters.head_formats import errors, validate_folder

    path, target, _, _, _ = target_and_draft
    cfg, params, vocab = anchored_draft
    prompt, n = [5, 17, 3, 9, 11, 2, 40], 13
    want = generate(target, [prompt], max_new_tokens=n)[0]
    res = SpecDecoder(target, Draft(params, cfg, vocab), num_spec_tokens=cfg.num_draft_tokens).generate(
        prompt, max_new_tokens=n)
    assert res.tokens == want[:n] and sum(res.accept_lengths) == n - 1

    hf = json.load(open(os.path.join(path, "config.json")))
    with pytest.raises(ValueError, match="layout of its draft.xpress_slot0_prev"):
        XPRESS.export(jax.device_get(params), cfg, None, hf, tmp_path / "x", variant="vllm034")
    out = XPRESS.export(jax.device_get(params), cfg, None, hf, tmp_path / "head", dtype="float32",
                        extra_manifest={"target_path": path})
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["architectures"] == ["Qwen3XPressModel"] and conf["xpress_topc"] == 0 and "dflash_config" not in conf
    findings, info = validate_folder(out, target=path)
    assert info["layout"] == "xpress_vllm034" and not errors(findings), [str(f) for f in findings]
    assert validate_cli(out, path, out=open(os.devnull, "w")) == 0
    assert family_for_folder(out) is XPRESS
    head_params, head_cfg, head_vocab = XPRESS.load_head(out)
    assert head_cfg == cfg and np.array_equal(head_vocab.draft_ids, vocab.draft_ids)
    flat = jax.tree_util.tree_leaves_with_path
    assert [p for p, _ in flat(head_params)] == [p for p, _ in flat(params)]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), (_, b) in zip(flat(head_params), flat(params)))
    again = SpecDecoder(target, Draft(head_params, head_cfg, head_vocab), num_spec_tokens=cfg.num_draft_tokens)
    res2 = again.generate(prompt, max_new_tokens=n)
    assert (res2.tokens, list(res2.accept_lengths)) == (res.tokens, list(res.accept_lengths))

    code, text = serve_cmd.build(out, path, engine="vllm")
    argv = shlex.split(next(line for line in text.splitlines() if "--speculative-config" in line))
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert code == 0 and spec == {"method": "dflash", "model": out, "num_speculative_tokens": cfg.block_size - 1}, text
    assert "needs vLLM >= 0.34" in text and "triton-cpu" in text and "slot 0 reads the anchor" in text

    # 0.34's top-C scoring (its default when the key is absent) would not draft as specjax.eval does
    del conf["xpress_topc"]
    json.dump(conf, open(os.path.join(out, "config.json"), "w"))
    findings, _ = validate_folder(out, target=path)
    assert any(f.rule == "xpress.xpress_topc" and f.level == "warning" for f in findings)


TARGET = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
          "num_hidden_layers": 4, "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
          "rope_theta": 10000.0, "max_position_embeddings": 256, "eos_token_id": 1}
VLLM034_BREAKS = [  # (what, edit(config, tensors), the error rule it must raise)
    ("another architecture", lambda c, t: c.update(architectures=["DFlashDraftModel"]), "xpress.architectures"),
    ("a dflash_config block", lambda c, t: c.update(dflash_config={"mask_token_id": 3}), "xpress.overrides"),
    ("no top-level taps", lambda c, t: c.pop("target_layer_ids"), "xpress.target_layer_ids"),
    ("sample_from_anchor", lambda c, t: c.update(sample_from_anchor=True), "xpress.sample_from_anchor"),
    ("a reduced draft vocab", lambda c, t: c.update(draft_vocab_size=24), "xpress.vocab"),
    ("no xpress_rank (0.34: 256)", lambda c, t: c.pop("xpress_rank"), "xpress.xpress_rank"),
    ("another rank", lambda c, t: c.update(xpress_rank=4), "shapes"),
    ("the raw mixer missing", lambda c, t: t.pop("xpress_head.mix.L"), "keys.missing"),
    ("speculators' name", lambda c, t: t.__setitem__("xpress_head.token_embed.weight", t.pop("xpress_head.w1.weight")),
     "keys.unknown"),
    ("a backbone tensor missing", lambda c, t: t.pop("fc.weight"), "keys.missing"),
]


@pytest.mark.parametrize("what,edit,rule", VLLM034_BREAKS, ids=[b[0] for b in VLLM034_BREAKS])
def test_vllm034_layout_rules_can_fail(what, edit, rule):
    from specjax_converters.head_rules import errors
    from specjax_converters.xpress_export import xpress_vllm034_hf_config, xpress_vllm034_state_dict
    from specjax_converters.xpress_validate import check_xpress_vllm034_head

    cfg = make_cfg(vd=V, slot0_prev="anchor")
    config = xpress_vllm034_hf_config(cfg, TARGET, "float32")
    tensors = xpress_vllm034_state_dict(jax.device_get(make_params(cfg)), cfg, "float32")
    assert not errors(check_xpress_vllm034_head(config, tensors, target_config=TARGET))
    edit(config, tensors)
    found = errors(check_xpress_vllm034_head(config, tensors, target_config=TARGET))
    assert any(f.rule == rule for f in found), (what, [str(f) for f in found])

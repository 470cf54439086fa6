"""draft.type=jetspec: DFlash's block drafter with causal attention inside the block, trained by
forward KL to the target (specjax.drafts.jetspec_family).

Bars: (1) the causal block: no slot's output depends on a later slot (the gradient of slot s's
attention output with respect to the keys/values of slots u > s is exactly 0, and > 0 for u <= s;
a block cut to its first slots leaves those slots' logits unchanged), the chunked attention equals
the dense reference, and the decoding proposer (context cache) equals the training forward;
(2) the objective is KL(p_target || q_draft) per drafted slot: dflash_loss equals a NumPy float64
computation on a tiny case, with and without slot decay; (3) the family: lookups, run_meta
(draft_family "jetspec") and its round trip, the config keys; (4) export -> validate -> load_head
gives a JetSpecConfig and the same params, serve_cmd prints vLLM's dflash method, and a JetSpec
manifest with a bidirectional config.json is an error; (5) lossless speculative decoding.
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.drafts import dflash
from specjax.drafts.families import (draft_config_from_meta, family_for_folder, family_for_type, family_of)
from specjax.drafts.jetspec_family import JETSPEC, as_jetspec
from specjax.drafts.vocab import DraftVocab

V, H, S, T = 64, 32, 5, 20


def make_cfg(cls=dflash.JetSpecConfig, **kw):
    base = dict(hidden_size=H, num_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, vocab_size=V, draft_vocab_size=40, aux_layer_ids=(0, 2), mask_token_id=3,
                block_size=S, num_target_layers=4)
    return cls(**{**base, **kw})


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return dict(
        ids=jnp.asarray(rng.integers(0, V, (1, T)), jnp.int32), pos=jnp.arange(T, dtype=jnp.int32)[None],
        seg=jnp.ones((1, T), jnp.int32), aux=[jnp.asarray(rng.standard_normal((1, T, H)), jnp.float32) for _ in range(2)],
        embed=jnp.asarray(rng.standard_normal((V, H)), jnp.float32),
        final=jnp.asarray(rng.standard_normal((1, T, H)), jnp.float32),
        lm_head=jnp.asarray(rng.standard_normal((V, H)), jnp.float32),
        draft_ids=jnp.asarray(np.sort(rng.choice(V, 40, replace=False)), jnp.int32))


def block_logits(params, cfg, b, anchors, attention="reference"):
    h = dflash.draft_forward(params, cfg, aux_hidden=b["aux"], input_ids=b["ids"], positions=b["pos"],
                             segment_ids=b["seg"], anchors=jnp.asarray([anchors], jnp.int32), embed_table=b["embed"],
                             attention=attention, anchor_chunk=2)
    return dflash.draft_logits(params, cfg, h)[0]  # [N, S, Vd]


# ---------------------------------------------------------------------------------------------
# (1) the causal block
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["reference", "chunked"])
def test_no_slot_sees_a_later_slot(attention):
    rng = np.random.default_rng(1)
    B, N, nH, nKV, D = 1, 2, 4, 2, 8
    q = jnp.asarray(rng.standard_normal((B, N, S, nH, D)), jnp.float32)
    k_ctx, v_ctx = (jnp.asarray(rng.standard_normal((B, T, nKV, D)), jnp.float32) for _ in range(2))
    k_blk, v_blk = (jnp.asarray(rng.standard_normal((B, N, S, nKV, D)), jnp.float32) for _ in range(2))
    anchors, seg = jnp.asarray([[6, 12]], jnp.int32), jnp.ones((B, T), jnp.int32)
    attend = dflash.dflash_attention_reference if attention == "reference" else dflash.dflash_attention

    for causal in (True, False):
        def slot_out(kb, vb, s):
            return jnp.sum(attend(q, k_ctx, v_ctx, kb, vb, anchors, seg, causal=causal)[:, :, s] ** 2)

        for s in range(S):
            gk, gv = jax.grad(slot_out, argnums=(0, 1))(k_blk, v_blk, s)
            moved = np.abs(np.asarray(gk)).sum(axis=(0, 1, 3, 4)) + np.abs(np.asarray(gv)).sum(axis=(0, 1, 3, 4))
            if causal:
                assert np.all(moved[s + 1:] == 0.0) and np.all(moved[: s + 1] > 0), (s, moved)
            else:
                assert np.all(moved > 0), (s, moved)
    ref = dflash.dflash_attention_reference(q, k_ctx, v_ctx, k_blk, v_blk, anchors, seg, causal=True)
    chunked = dflash.dflash_attention(q, k_ctx, v_ctx, k_blk, v_blk, anchors, seg, anchor_chunk=1, causal=True)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_a_shorter_block_leaves_the_earlier_slots_unchanged(batch):
    """The whole network: slots 0..j of a block do not depend on the block's length (JetSpec);
    a DFlash block's slots do."""
    for cls, same in ((dflash.JetSpecConfig, True), (dflash.DFlashConfig, False)):
        cfg = make_cfg(cls)
        params = dflash.init_draft_params(cfg, jax.random.key(0), std=0.2)
        full = np.asarray(block_logits(params, cfg, batch, [4, 9], "chunked"))
        short = np.asarray(block_logits(params, dataclasses.replace(cfg, block_size=3), batch, [4, 9], "chunked"))
        assert type(dataclasses.replace(cfg, block_size=3)) is cls
        assert np.allclose(full[:, :3], short, rtol=1e-5, atol=1e-5) == same, cls.__name__


def test_proposer_equals_the_training_forward(batch):
    cfg = make_cfg()
    params = dflash.init_draft_params(cfg, jax.random.key(2), std=0.2)
    anchor = 11
    cache = dflash.init_context_cache(cfg, 1, 32)
    cache = dflash.append_context(params, cfg, cache, [a[:, :anchor] for a in batch["aux"]], batch["pos"][:, :anchor])
    _, logits = dflash.propose_block(params, cfg, cache, embed_table=batch["embed"],
                                     last_token_b=batch["ids"][:, anchor], last_position_b=jnp.asarray([anchor]))
    want = block_logits(params, cfg, batch, [anchor])[0, cfg.first_trained_slot:]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(want), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# (2) the objective: forward KL per drafted slot
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", [0.0, 2.0])
def test_objective_is_forward_kl(batch, gamma):
    from specjax.config import load_config

    cfg = make_cfg()
    run = load_config(None, ["draft.type=jetspec", f"draft.block_size={S}", "train.dflash_anchors=2",
                             f"train.dflash_decay_gamma={gamma}"])
    loss_cfg = JETSPEC.make_objective(run, cfg).loss
    assert loss_cfg.objective == "teacher_kl" and loss_cfg.num_anchors == 2
    params = dflash.init_draft_params(cfg, jax.random.key(3), std=0.2)
    anchors = [3, 10]
    loss_mask = np.ones((1, T), np.float32)
    loss_mask[0, 12] = 0.0  # slot 2 of the second block is not trained
    loss, _ = dflash.dflash_loss(
        params, cfg, loss_cfg, anchors=jnp.asarray([anchors], jnp.int32), anchor_valid=jnp.ones((1, 2), bool),
        input_ids=batch["ids"], loss_mask=jnp.asarray(loss_mask), segment_ids=batch["seg"], positions=batch["pos"],
        aux_hidden=batch["aux"], embed_table=batch["embed"], final_hidden=batch["final"], lm_head=batch["lm_head"],
        draft_ids=batch["draft_ids"])

    q_logits = np.asarray(block_logits(params, cfg, batch, anchors), np.float64)  # [N, S, Vd]
    rows = np.asarray(batch["lm_head"], np.float64)[np.asarray(batch["draft_ids"])]
    final = np.asarray(batch["final"], np.float64)[0]

    def log_softmax(x):
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    total = weight = 0.0
    for n, a in enumerate(anchors):
        for i in range(1, S):  # slot 0 is the anchor; slot i predicts x[a+i] from the target at a+i-1
            m = loss_mask[0, a + i]
            log_p, log_q = log_softmax(final[a + i - 1] @ rows.T), log_softmax(q_logits[n, i])
            kl = float(np.sum(np.exp(log_p) * (log_p - log_q)))
            total += m * (np.exp(-(i - 1) / gamma) if gamma else 1.0) * kl
            weight += m
    want = total / (weight + 1e-5)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# (3) the family
# ---------------------------------------------------------------------------------------------
def test_family_lookups_and_run_meta():
    from specjax.config import ConfigError, load_config

    jet, df = make_cfg(), make_cfg(dflash.DFlashConfig)
    assert family_for_type("jetspec") is JETSPEC and family_of(jet) is JETSPEC
    assert family_of(df) is family_for_type("dflash")
    assert jet != df and dflash.config_to_dict(jet) == dflash.config_to_dict(df)  # same fields, other class
    meta = JETSPEC.run_meta(jet)
    assert meta["draft_family"] == "jetspec" and "causal" not in meta["draft_config"]
    back = draft_config_from_meta(json.loads(json.dumps(meta)))
    assert type(back) is dflash.JetSpecConfig and back == jet
    assert family_for_type("dflash").run_meta(df) == {"draft_config": dflash.config_to_dict(df), "draft_family": "dflash"}

    run = load_config(None, ["draft.type=jetspec", "draft.block_size=4", "draft.mask_token_id=3",
                             "train.dflash_anchors=8", "train.dflash_decay_gamma=0"])
    assert isinstance(run.draft, JETSPEC.section_class) and run.draft.block_size == 4
    for overrides, match in (
            (["draft.type=jetspec", "train.dflash_objective=token_ce"],
             r"`train.dflash_objective` = 'token_ce' is not read by draft.type=jetspec \(JetSpec; its objective is "
             r"the forward KL to the target, fixed\); it is read by draft.type=dflash"),
            (["draft.type=jetspec", "draft.sample_from_anchor=true"],
             r"`draft.sample_from_anchor` is not a key of draft.type=jetspec \(JetSpec\); it belongs to draft.type=dflash"),
            (["draft.type=jetspec", "draft.block_size=1"], r"`draft.block_size` = 1 must be >= 2")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)


# ---------------------------------------------------------------------------------------------
# (4) the head: export, validate, read back, serve
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_and_draft(tmp_path_factory):
    from eval._models import build_target
    from specjax.targets.loading import load_target

    path = build_target(tmp_path_factory.mktemp("jetspec"), "LlamaForCausalLM", False, seed=1)
    target = load_target(path, dtype="float32")
    tv = target.config.vocab_size
    cfg = dflash.config_from_target(target.config, draft_vocab_size=48, mask_token_id=3, num_layers=1, block_size=S,
                                    aux_layer_ids=(0, 2))
    cfg = as_jetspec(cfg)
    params = dflash.init_draft_params(cfg, jax.random.key(0), std=0.1)
    return path, target, cfg, params, DraftVocab.from_ids(np.arange(0, tv, 2), tv)


def test_export_validate_load_round_trip(target_and_draft, tmp_path):
    from specjax import serve_cmd
    from specjax_converters.head_formats import errors, validate_folder

    path, target, cfg, params, vocab = target_and_draft
    hf = json.load(open(os.path.join(path, "config.json")))
    out = JETSPEC.export(jax.device_get(params), cfg, vocab, hf, tmp_path / "head", dtype="float32")
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["dflash_config"]["causal"] is True
    manifest = json.load(open(os.path.join(out, "specjax_manifest.json")))
    assert manifest["draft_config"]["causal"] is True and manifest["variant"] == "jetspec"
    findings, info = validate_folder(out, target=path)
    assert info["layout"] == "dflash" and not errors(findings), [str(f) for f in findings]

    assert family_for_folder(out) is JETSPEC
    head_params, head_cfg, head_vocab = JETSPEC.load_head(out)
    assert type(head_cfg) is dflash.JetSpecConfig and head_cfg == cfg
    flat = lambda t: jax.tree_util.tree_leaves_with_path(t)  # noqa: E731
    assert [p for p, _ in flat(head_params)] == [p for p, _ in flat(params)]
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for (_, a), (_, b) in zip(flat(head_params), flat(params)))
    assert np.array_equal(np.asarray(head_vocab.d2t), np.asarray(vocab.d2t))

    assert serve_cmd.vllm_speculative_config(out, 7) == {"method": "dflash", "model": out,
                                                         "num_speculative_tokens": S - 1}
    code, text = serve_cmd.build(out, path, engine="vllm")
    assert code == 0 and '"method": "dflash"' in text and "JetSpec block drafter" in text, text

    # a DFlash export of the same params stays bidirectional and is DFlash's
    df_cfg = make_cfg(dflash.DFlashConfig, **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    df_out = family_for_type("dflash").export(jax.device_get(params), df_cfg, vocab, hf, tmp_path / "df",
                                              dtype="float32")
    df_conf = json.load(open(os.path.join(df_out, "config.json")))
    assert df_conf["dflash_config"]["causal"] is False and family_for_folder(df_out) is family_for_type("dflash")
    assert "causal" not in json.load(open(os.path.join(df_out, "specjax_manifest.json")))["draft_config"]
    assert {k: v for k, v in df_conf.items() if k != "dflash_config"} == {k: v for k, v in conf.items()
                                                                          if k != "dflash_config"}


def test_a_causal_head_with_a_bidirectional_config_is_an_error(target_and_draft, tmp_path):
    from specjax_converters.head_files import MANIFEST_FILE, file_sha256
    from specjax_converters.head_formats import errors, validate_folder

    path, target, cfg, params, vocab = target_and_draft
    hf = json.load(open(os.path.join(path, "config.json")))
    out = JETSPEC.export(jax.device_get(params), cfg, vocab, hf, tmp_path / "head", dtype="float32")
    conf = json.load(open(os.path.join(out, "config.json")))
    conf["dflash_config"]["causal"] = False
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f)
    manifest = json.load(open(os.path.join(out, MANIFEST_FILE)))
    manifest["files"]["config.json"] = {"sha256": file_sha256(os.path.join(out, "config.json")),
                                        "bytes": os.path.getsize(os.path.join(out, "config.json"))}
    with open(os.path.join(out, MANIFEST_FILE), "w") as f:
        json.dump(manifest, f)
    findings, _ = validate_folder(out, target=path)
    hits = [f for f in errors(findings) if f.rule == "dflash.causal"]
    assert [f.field for f in errors(findings)] == ["dflash_config.causal"] and hits, [str(f) for f in findings]
    assert "trained with causal attention" in str(hits[0]) and 'write "causal": true' in str(hits[0])


# ---------------------------------------------------------------------------------------------
# (5) lossless speculative decoding
# ---------------------------------------------------------------------------------------------
def test_lossless_speculative_decoding(target_and_draft):
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import Draft, SpecDecoder

    _, target, cfg, params, vocab = target_and_draft
    prompt, n = [5, 17, 3, 9, 11, 2, 40], 13
    want = generate(target, [prompt], max_new_tokens=n)[0]
    draft = Draft(params, cfg, vocab)
    for k in (1, cfg.num_draft_tokens):
        res = SpecDecoder(target, draft, num_spec_tokens=k).generate(prompt, max_new_tokens=n)
        assert res.tokens == want[:n] and sum(res.accept_lengths) == n - 1, k

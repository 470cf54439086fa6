"""draft.type=eagle (EAGLE-1 / EAGLE-2, specjax.drafts.eagle1 and eagle1_family).

Reference: no EAGLE-1 implementation is installed (nemo-automodel is not in the venv; speculators 0.9.0
has none), so the forward and the loss are written here in NumPy float64 from the EAGLE paper's
definitions: x = fc([embed(x_{t+1}), f_t]); one Llama layer without an input norm (GQA attention
with RoPE, causal within each packed sequence; post-attention RMSNorm; SwiGLU); L = 1.0 * SmoothL1(f^,
f_{t+1}) + 0.1 * CE(softmax(W f_{t+1}), softmax(W f^)), averaged over the rows in the loss. The jax
fp32 values must equal them to 1e-5 relative. Also: the decoding layer over a KV cache equals the
training forward, the export round-trips and the validator refuses what vLLM cannot load, and the
family's config rules.
"""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from specjax.drafts import eagle1
from specjax.drafts.families import draft_config_from_meta, family_for_folder, family_for_type, family_of
from specjax.layers.rope import RopeSpec

V, H, T = 48, 32, 14
CFG = eagle1.Eagle1Config(hidden_size=H, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, vocab_size=V, rms_norm_eps=1e-5, rope=RopeSpec(theta=500.0))
NOISE_OFF = eagle1.Eagle1Objective(feature_noise=0.0)


@pytest.fixture(scope="module")
def case():
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: a * 4.0, eagle1.init_draft_params(CFG, jax.random.key(1)))  # not near zero
    params["midlayer"]["post_attention_layernorm"]["scale"] = jnp.asarray(1 + 0.3 * rng.standard_normal(H), jnp.float32)
    seg = np.array([[1] * 8 + [2] * 5 + [0], [1] * T], np.int32)  # two packed sequences, then padding
    pos = np.concatenate([np.arange(8), np.arange(5), [0]])[None].repeat(2, 0)
    pos[1] = np.arange(T)
    mask = (rng.random((2, T)) > 0.2).astype(np.int32)
    return dict(params=params, ids=rng.integers(0, V, (2, T)).astype(np.int32), seg=seg, pos=pos.astype(np.int32),
                mask=mask, final=rng.standard_normal((2, T, H)).astype(np.float32),
                embed=rng.standard_normal((V, H)).astype(np.float32),
                lm_head=(0.5 * rng.standard_normal((V, H))).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# NumPy float64 reference (from the definitions)
# ---------------------------------------------------------------------------------------------
def np_params(params):
    return jax.tree.map(lambda a: np.asarray(a, np.float64), params)


def np_rope(x, pos, theta):
    """HF Llama rotate-half RoPE, x [T, n, d], pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def np_rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def np_forward(p, emb, feat, pos, seg):
    """f^ [T, H] of one row."""
    m = p["midlayer"]
    x = np.concatenate([emb, feat], -1) @ p["fc"]["kernel"]
    a = m["self_attn"]
    nH, nKV, d = CFG.num_attention_heads, CFG.num_key_value_heads, CFG.head_dim
    q = np_rope((x @ a["q_proj"]["kernel"]).reshape(-1, nH, d), pos, CFG.rope.theta)
    k = np_rope((x @ a["k_proj"]["kernel"]).reshape(-1, nKV, d), pos, CFG.rope.theta)
    v = (x @ a["v_proj"]["kernel"]).reshape(-1, nKV, d)
    k, v = np.repeat(k, nH // nKV, 1), np.repeat(v, nH // nKV, 1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    t = np.arange(len(pos))
    allowed = (t[None, :] <= t[:, None]) & (seg[None, :] == seg[:, None])
    s = np.where(allowed[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    h = x + np.einsum("hqk,khd->qhd", w, v).reshape(len(pos), -1) @ a["o_proj"]["kernel"]
    mp = m["mlp"]
    hn = np_rms(h, m["post_attention_layernorm"]["scale"], CFG.rms_norm_eps)
    g = hn @ mp["gate_proj"]["kernel"]
    return h + ((g / (1 + np.exp(-g))) * (hn @ mp["up_proj"]["kernel"])) @ mp["down_proj"]["kernel"]


def np_loss(c, w_reg=1.0, w_cls=0.1):
    p = np_params(c["params"])
    emb_table, lm, final = (np.asarray(c[k], np.float64) for k in ("embed", "lm_head", "final"))
    reg_sum = cls_sum = n = 0.0
    for b in range(2):
        ids, seg, pos = c["ids"][b], c["seg"][b], c["pos"][b]
        nxt_ids = np.concatenate([ids[1:], [0]])
        pred = np_forward(p, emb_table[nxt_ids], final[b], pos, seg)
        for t in range(T - 1):
            if not (c["mask"][b, t] and seg[t] > 0 and seg[t + 1] == seg[t]):
                continue
            diff = pred[t] - final[b, t + 1]
            reg_sum += np.mean(np.where(np.abs(diff) < 1, 0.5 * diff**2, np.abs(diff) - 0.5))
            zt, zd = lm @ final[b, t + 1], lm @ pred[t]
            pt = np.exp(zt - zt.max())
            pt /= pt.sum()
            cls_sum += -np.sum(pt * (zd - zd.max() - np.log(np.sum(np.exp(zd - zd.max())))))
            n += 1
    return w_reg * reg_sum / n + w_cls * cls_sum / n, reg_sum / n, cls_sum / n


def jax_loss(c, objective=NOISE_OFF, key=None):
    return eagle1.eagle1_loss(c["params"], CFG, objective, input_ids=jnp.asarray(c["ids"]),
                              loss_mask=jnp.asarray(c["mask"]), segment_ids=jnp.asarray(c["seg"]),
                              positions=jnp.asarray(c["pos"]), final_hidden=jnp.asarray(c["final"]),
                              embed_table=jnp.asarray(c["embed"]), lm_head=jnp.asarray(c["lm_head"]), noise_key=key)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ---------------------------------------------------------------------------------------------
def test_forward_equals_the_numpy_reference(case):
    c = case
    emb = jnp.take(jnp.asarray(c["embed"]), eagle1.shift_left(jnp.asarray(c["ids"]), 1), axis=0)
    got = eagle1.draft_forward(c["params"], CFG, emb, jnp.asarray(c["final"]), jnp.asarray(c["pos"]),
                               jnp.asarray(c["seg"]))
    p = np_params(c["params"])
    for b in range(2):
        nxt = np.concatenate([c["ids"][b, 1:], [0]])
        want = np_forward(p, np.asarray(c["embed"], np.float64)[nxt], c["final"][b].astype(np.float64), c["pos"][b],
                          c["seg"][b])
        live = c["seg"][b] > 0
        assert rel(np.asarray(got[b])[live], want[live]) < 1e-5


def test_loss_equals_the_paper_definition_in_numpy(case):
    total, m = jax_loss(case)
    want, want_reg, want_cls = np_loss(case)
    assert rel(total, want) < 1e-5 and rel(m["loss_reg"], want_reg) < 1e-5 and rel(m["loss_token"], want_cls) < 1e-5
    # the weights are the paper's and they are applied: total = 1.0 * reg + 0.1 * token
    assert float(total) == pytest.approx(float(m["loss_reg"]) + 0.1 * float(m["loss_token"]), rel=1e-6)
    other, _ = jax_loss(case, eagle1.Eagle1Objective(regression_weight=0.5, token_weight=1.0, feature_noise=0.0))
    assert rel(other, 0.5 * want_reg + want_cls) < 1e-5


def test_feature_noise_is_uniform_in_the_half_width_and_off_for_evaluation(case):
    noisy = eagle1.Eagle1Objective(feature_noise=0.1)
    a, _ = jax_loss(case, noisy, jax.random.key(0))
    b, _ = jax_loss(case, noisy, jax.random.key(0))
    clean, _ = jax_loss(case, noisy, None)
    assert float(a) == float(b) and float(a) != float(clean)
    assert rel(clean, np_loss(case)[0]) < 1e-5
    grads = jax.grad(lambda p: jax_loss(dict(case, params=p), noisy, jax.random.key(3))[0])(case["params"])
    assert all(np.all(np.isfinite(g)) and np.any(g != 0) for g in jax.tree.leaves(grads))


def dense_token_loss(pred, nxt, lm_head, rows, softcap=None):
    """The token loss as it was written before the fused op: full [B, T, V] fp32 logits."""
    def logits(f, w):
        z = jnp.einsum("btd,vd->btv", f.astype(jnp.float32), w.astype(jnp.float32))
        return z if softcap is None else softcap * jnp.tanh(z / softcap)

    teacher = jax.lax.stop_gradient(logits(nxt, lm_head))
    student = logits(pred, jax.lax.stop_gradient(lm_head))
    ce = -jnp.sum(jax.nn.softmax(teacher, -1) * jax.nn.log_softmax(student, -1), -1)
    acc = jnp.sum((jnp.argmax(student, -1) == jnp.argmax(teacher, -1)) * rows)
    return jnp.sum(ce * rows) / jnp.maximum(jnp.sum(rows), 1.0), acc / jnp.maximum(jnp.sum(rows), 1.0)


def dense_loss(c, objective, softcap=None):
    """eagle1_loss with the dense token loss above (regression term and rows as in eagle1_loss)."""
    def f(params):
        feat = jnp.asarray(c["final"])
        emb = jnp.take(jnp.asarray(c["embed"]), eagle1.shift_left(jnp.asarray(c["ids"]), 1), axis=0)
        pred = eagle1.draft_forward(params, CFG, emb, feat, jnp.asarray(c["pos"]), jnp.asarray(c["seg"]))
        nxt = eagle1.shift_left(feat, 1)
        rows = eagle1.loss_rows(jnp.asarray(c["mask"]), jnp.asarray(c["seg"]))
        n = jnp.maximum(jnp.sum(rows), 1.0)
        reg = jnp.sum(jnp.mean(eagle1.smooth_l1(pred - nxt), -1) * rows) / n
        tok, acc = dense_token_loss(pred, nxt, jnp.asarray(c["lm_head"]), rows, softcap)
        return objective.regression_weight * reg + objective.token_weight * tok, (tok, acc)
    return f


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_fused_token_loss_equals_the_dense_form_with_its_gradients(case, softcap):
    """The token loss runs through the fused soft CE (no [B,T,V] logits); loss, token loss, accuracy
    and every parameter gradient equal the dense fp32 form to 1e-5 relative (CPU, fp32), with and
    without a target soft-cap; token weight 1 so the token term dominates the gradient."""
    obj = eagle1.Eagle1Objective(token_weight=1.0, feature_noise=0.0)
    c = case
    new = lambda p: jax_loss(dict(c, params=p), obj) if softcap is None else eagle1.eagle1_loss(
        p, CFG, obj, input_ids=jnp.asarray(c["ids"]), loss_mask=jnp.asarray(c["mask"]),
        segment_ids=jnp.asarray(c["seg"]), positions=jnp.asarray(c["pos"]), final_hidden=jnp.asarray(c["final"]),
        embed_table=jnp.asarray(c["embed"]), lm_head=jnp.asarray(c["lm_head"]), logit_softcap=softcap)
    (got, m), g_new = jax.value_and_grad(new, has_aux=True)(c["params"])
    (want, (tok, acc)), g_old = jax.value_and_grad(dense_loss(c, obj, softcap), has_aux=True)(c["params"])
    assert rel(got, want) < 1e-5 and rel(m["loss_token"], tok) < 1e-5
    assert float(m["tau_sim"]) == pytest.approx(float(acc), abs=1e-7)
    for a, b in zip(jax.tree.leaves(g_new), jax.tree.leaves(g_old)):
        assert rel(a, b) < 1e-5


def test_token_loss_holds_no_full_vocab_logits():
    """At a vocab of 20000 (tiles of 4000), no array in the loss-and-gradient program has B*T*V
    elements or more with a V-wide last axis: the [B, T, V] logits are never formed."""
    Vb, B, Tb, Hb = 20000, 1, 8, 16
    cfg = dataclasses.replace(CFG, hidden_size=Hb, intermediate_size=24, num_attention_heads=2,
                              num_key_value_heads=1, vocab_size=Vb)
    rng = np.random.default_rng(1)
    params = eagle1.init_draft_params(cfg, jax.random.key(0))
    kw = dict(input_ids=jnp.asarray(rng.integers(0, Vb, (B, Tb)), jnp.int32), loss_mask=jnp.ones((B, Tb), jnp.int32),
              segment_ids=jnp.ones((B, Tb), jnp.int32), positions=jnp.arange(Tb, dtype=jnp.int32)[None],
              final_hidden=jnp.asarray(rng.standard_normal((B, Tb, Hb)), jnp.float32),
              embed_table=jnp.asarray(rng.standard_normal((Vb, Hb)), jnp.float32),
              lm_head=jnp.asarray(rng.standard_normal((Vb, Hb)), jnp.float32))
    loss = lambda p: eagle1.eagle1_loss(p, cfg, NOISE_OFF, **kw)[0]

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (v.aval.shape for v in eqn.outvars if hasattr(v.aval, "shape"))
            for sub in jax.core.jaxprs_in_params(eqn.params):
                yield from shapes(sub)

    seen = list(shapes(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr))
    assert seen and not [s for s in seen if s and s[-1] >= Vb and np.prod(s) >= B * Tb * Vb]
    # the check can fail: the dense form holds [B, T, V] logits
    dense = lambda p: dense_token_loss(jnp.einsum("btd,dk->btk", kw["final_hidden"], p), kw["final_hidden"],
                                       kw["lm_head"], jnp.ones((B, Tb)))[0]
    seen = list(shapes(jax.make_jaxpr(jax.grad(dense))(jnp.eye(Hb)).jaxpr))
    assert (B, Tb, Vb) in seen


def test_the_cached_decoding_layer_equals_the_training_forward(case):
    c = case
    ids, final = jnp.asarray(c["ids"][1:]), jnp.asarray(c["final"][1:])
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    emb = jnp.take(jnp.asarray(c["embed"]), eagle1.shift_left(ids, 1), axis=0)
    want = eagle1.draft_forward(c["params"], CFG, emb, final, pos, jnp.ones((1, T), jnp.int32))
    from specjax.drafts.eagle3_decoding import init_draft_cache
    from specjax.targets.layers.attention import cache_attention_mask

    cache = init_draft_cache(CFG, 32)
    mask = cache_attention_mask(jnp.zeros((1,), jnp.int32), cache["k"].shape[2], jnp.tril(jnp.ones((T, T), bool))[None])
    got, _ = eagle1.layer_cached(c["params"], CFG, cache, eagle1.fuse(c["params"], emb, final), pos, pos, mask)
    assert rel(got, want) < 1e-5


# ---------------------------------------------------------------------------------------------
# export, validation, read-back
# ---------------------------------------------------------------------------------------------
TARGET_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "vocab_size": V,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500.0,
             "max_position_embeddings": 256, "eos_token_id": 2}


def test_export_validates_round_trips_and_serves_as_vllm_eagle(case, tmp_path):
    from specjax.serve_cmd import vllm_speculative_config
    from specjax_converters.head_formats import errors, validate_folder

    fam = family_for_type("eagle")
    out = fam.export(case["params"], CFG, None, TARGET_HF, tmp_path / "head", dtype="float32")
    conf = json.load(open(os.path.join(out, "config.json")))
    assert conf["architectures"] == ["EagleLlamaForCausalLM"] and conf["model_type"] == "llama"
    assert load_file(os.path.join(out, "model.safetensors"))["fc.weight"].shape == (H, 2 * H)
    findings, info = validate_folder(out, target=TARGET_HF)
    assert info["layout"] == "eagle1" and not errors(findings), [str(f) for f in findings]
    assert family_for_folder(out) is fam
    head = fam.load_head(out)
    assert head.config == dataclasses.replace(CFG, max_position_embeddings=256) and head.vocab.draft_vocab_size == V
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(jax.tree.leaves(head.params),
                                                                jax.tree.leaves(case["params"])))
    assert vllm_speculative_config(out, 4) == {"method": "eagle", "model": out, "num_speculative_tokens": 4}

    # what vLLM's EagleLlamaForCausalLM cannot place, and a target of another width, are errors
    tensors = load_file(os.path.join(out, "model.safetensors"))
    for extra in ("lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight", "fc.bias"):
        bad = tmp_path / extra
        os.makedirs(bad)
        json.dump(conf, open(bad / "config.json", "w"))
        save_file({**tensors, extra: np.zeros((H,), np.float32)}, str(bad / "model.safetensors"))
        findings, _ = validate_folder(str(bad), target=TARGET_HF)
        assert [f.field for f in errors(findings)] == [extra], [str(f) for f in findings]
        with pytest.raises(ValueError, match=extra):
            fam.load_head(str(bad))
    findings, _ = validate_folder(out, target={**TARGET_HF, "hidden_size": 64})
    assert [f.rule for f in errors(findings)] == ["target.hidden_size"]


# ---------------------------------------------------------------------------------------------
# the family
# ---------------------------------------------------------------------------------------------
def test_family_lookups_meta_and_config_rules(tiny_target):
    from specjax.config import load_config
    from specjax.config_fields import ConfigError
    from specjax.train.setup import check_draft_fits_target

    fam = family_for_type("eagle")
    assert family_of(CFG) is fam and fam.decode_taps(CFG) == () and fam.reads_final_hidden(CFG)
    meta = fam.run_meta(CFG)
    assert meta["draft_family"] == "eagle" and draft_config_from_meta(meta) == CFG
    cfg = load_config(None, ["draft.type=eagle"])
    assert (cfg.draft.regression_weight, cfg.draft.token_weight, cfg.draft.feature_noise) == (1.0, 0.1, 0.1)
    with pytest.raises(ConfigError, match="draft.num_layers=1"):
        load_config(None, ["draft.type=eagle", "draft.num_layers=2"])
    with pytest.raises(ConfigError, match="remove target.aux_layer_ids"):
        load_config(None, ["draft.type=eagle", "target.aux_layer_ids=[0,1,2]"])
    with pytest.raises(ConfigError, match="not a key of draft.type=eagle"):
        load_config(None, ["draft.type=eagle", "draft.ttt_steps=3"])
    with pytest.raises(ValueError, match="set draft.draft_vocab_size=320"):
        check_draft_fits_target(load_config(None, ["draft.type=eagle", f"target.path={tiny_target}",
                                                   "draft.draft_vocab_size=64"]))
    check_draft_fits_target(load_config(None, ["draft.type=eagle", f"target.path={tiny_target}",
                                               "draft.draft_vocab_size=320"]))
    assert dataclasses.replace(CFG, hidden_act="silu") == CFG

"""P-EAGLE heads (draft.type p_eagle) against speculators 0.9.0's PEagleDraftModel, CPU, fp32.

The specjax head is exported, its tensors (mask_hidden included) loaded *strictly* into speculators'
model (`midlayer.` read as `layers.0.`, the target's embedding as its embed_tokens). The COD rows
specjax samples (specjax.drafts.ttt.cod_row_masks) are handed to speculators in its own
(anchor_pos, depth) form, so both train the same rows; then on the same inputs:
- per-depth draft logits: max|diff| / max|ref| <= 1e-4;
- the loss: speculators' pooled KL equals specjax's pooled soft CE minus the teacher's pooled
  entropy (the two differ by that constant), relative 1e-5; also with train.loss=lk_hybrid;
- the gradient of every draft weight (mask_hidden included): max|diff| / max|ref| <= 1e-4.
Also: the export validates (a parallel-drafting warning, no error), writes mask_token_id and
mask_hidden [1, 1, aux*tH], and imports back to the same params; COD keeps chains as depth prefixes
with the reference's per-depth counts.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from export._heads import (
    AUX, FAST_COMPILE, VD, H, V, exported_head, import_speculators, load_exported_head, rel_err, speculators_configs,
)
from safetensors.numpy import load_file

from specjax.drafts import eagle3
from specjax.drafts.eagle3 import mask_hidden_projected
from specjax.drafts.ttt import TTTConfig, cod_row_masks, shift_left, ttt_loss
from specjax_converters.eagle3_import import read_head
from specjax_converters.head_formats import errors, validate_folder

K = 4
T = 24
MASK_ID = 7


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return exported_head(tmp_path_factory.mktemp("p_eagle"), 31, mask_token_id=MASK_ID)


def _batch(head, seed=0):
    rng = np.random.default_rng(seed)
    lmask = (rng.random((1, T)) < 0.8).astype(np.float32)
    lmask[0, :3] = 0  # a prompt
    ids = np.asarray(head["vocab"].draft_ids, np.int32)
    return dict(
        input_ids=jnp.asarray(rng.integers(0, V, (1, T)), jnp.int32), loss_mask=jnp.asarray(lmask),
        segment_ids=jnp.ones((1, T), jnp.int32), positions=jnp.arange(T, dtype=jnp.int32)[None],
        aux_hidden=tuple(jnp.asarray(rng.standard_normal((1, T, H)), jnp.float32) for _ in AUX),
        final_hidden=jnp.asarray(rng.standard_normal((1, T, H)), jnp.float32),
        embed_table=jnp.asarray(head["embed"]), lm_head=jnp.asarray(0.5 * rng.standard_normal((V, H)), jnp.float32),
        draft_ids=jnp.asarray(ids), t2d=jnp.asarray(head["vocab"].t2d), d2t=jnp.asarray(head["vocab"].d2t, jnp.int32))


def _step_masks(batch):
    seg, lmask = batch["segment_ids"], batch["loss_mask"]
    return [shift_left(lmask, k) * ((shift_left(seg, 1 + k, fill=-1) == seg) & (seg > 0)) for k in range(K)]


def _jax_depth_logits(params, cfg, batch):
    """The P-EAGLE forward written out: depth 0 = EAGLE-3 step 0, depth d >= 1 reads the mask token's
    embedding and fc(mask_hidden); logits per depth [T, Vd]."""
    p = jax.tree_util.tree_map(jnp.asarray, params)
    x, pos, seg = batch["input_ids"], batch["positions"], batch["segment_ids"]
    h = eagle3.project_aux(p, batch["aux_hidden"], cfg)
    mask_emb = jnp.broadcast_to(batch["embed_table"][MASK_ID], h.shape)
    mask_h = jnp.broadcast_to(mask_hidden_projected(p, cfg), h.shape)
    caches, out = [[] for _ in range(cfg.num_layers)], []
    for k in range(K):
        emb = jnp.take(batch["embed_table"], shift_left(x, 1), axis=0) if k == 0 else mask_emb
        h, kvs = eagle3.draft_step(p, cfg, emb, h if k == 0 else mask_h, pos, seg, caches)
        for c, kv in zip(caches, kvs):
            c.append(kv)
        out.append(np.asarray(eagle3.draft_logits(p, cfg, h))[0])
    return out


def _speculators_model(sp, head, loss_name="kl_div"):
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    conf = json.loads(open(os.path.join(head["out"], "config.json")).read())
    tl_conf, spec = speculators_configs("peagle", K, head["root"] / "target", rms_norm_eps=conf["rms_norm_eps"])
    config = PEagleSpeculatorConfig(transformer_layer_config=tl_conf, draft_vocab_size=VD,
                                    eagle_aux_hidden_state_layer_ids=conf["eagle_aux_hidden_state_layer_ids"],
                                    norm_before_residual=False, mask_token_id=conf["mask_token_id"],
                                    speculators_config=spec)
    model = PEagleDraftModel(config)
    load_exported_head(model, head["out"], head["embed"])
    return model.float()


def _run_speculators(sp, head, batch, keeps, loss_name):
    """speculators' forward + backward on the same rows: (per-depth logits, loss, {file name: grad})."""
    import speculators.models.peagle.core as core
    import torch
    from speculators.losses import resolve_loss_config

    model = _speculators_model(sp, head)
    draft_ids = np.asarray(batch["draft_ids"])
    with torch.no_grad():  # the teacher over the draft vocab from the target's final-norm hidden
        model.verifier_lm_head.weight.copy_(torch.from_numpy(np.asarray(batch["lm_head"])[draft_ids]))
    model.verifier_norm = torch.nn.Identity()  # final_hidden is already the target's final-norm output
    model.lm_head.weight.requires_grad_(True)  # speculators freezes its verifier-initialised lm_head; specjax trains it
    # speculators' frame: row i = specjax row i (token x[i+1], aux at i, teacher at i+1), T-1 rows
    anchors = [np.arange(T - 1)] + [np.flatnonzero(np.asarray(k[0])) for k in keeps[1:]]
    depth = np.concatenate([np.full(len(a), d) for d, a in enumerate(anchors)])
    fixed = (torch.from_numpy(np.concatenate(anchors)).long(), torch.from_numpy(depth).long())
    caught = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: caught.append(o.detach()[0].numpy()))
    orig = core.generate_cod_sample_indices
    core.generate_cod_sample_indices = lambda **kw: fixed
    try:
        x = np.asarray(batch["input_ids"])
        _, loss, _ = model(
            hidden_states=torch.from_numpy(np.concatenate([np.asarray(a) for a in batch["aux_hidden"]], -1)[:, :T - 1]),
            input_ids=torch.from_numpy(x[:, 1:]).long(), document_ids=torch.zeros((1, T - 1), dtype=torch.long),
            loss_mask=torch.from_numpy(np.asarray(batch["loss_mask"])[:, :T - 1]),
            verifier_last_hidden_states=torch.from_numpy(np.asarray(batch["final_hidden"])[:, 1:]),
            loss_config=resolve_loss_config(loss_name, "eager"), num_depths=K)
        loss.backward()
    finally:
        core.generate_cod_sample_indices = orig
        hook.remove()
    logits = caught[0]
    per_depth, start = [], 0
    for a in anchors:
        per_depth.append((a, logits[start:start + len(a)]))
        start += len(a)
    grads = {("midlayer." + n[len("layers.0."):] if n.startswith("layers.0.") else n): p.grad.numpy()
             for n, p in model.named_parameters() if p.grad is not None and n != "embed_tokens.weight"}
    return per_depth, float(loss), grads


def _teacher_entropy(batch, trained):
    ids = np.asarray(batch["draft_ids"])
    logits = np.einsum("btd,vd->btv", np.asarray(batch["final_hidden"], np.float64),
                       np.asarray(batch["lm_head"], np.float64)[ids])
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    ent = jnp.asarray(-(np.exp(logp) * logp).sum(-1))  # [1, T] at target position t
    num = sum(float((np.asarray(m) * np.asarray(shift_left(ent, 1 + k))).sum()) for k, m in enumerate(trained))
    return num / sum(float(np.asarray(m).sum()) for m in trained)


@pytest.mark.parametrize("loss_name", ["soft_ce", "lk_hybrid"])
def test_p_eagle_matches_speculators(head, loss_name):
    sp = import_speculators()
    cfg, params = head["cfg"], jax.tree_util.tree_map(jnp.asarray, head["params"])
    batch = _batch(head)
    key = jax.random.key(3)
    keeps = cod_row_masks(key, _step_masks(batch), 0.7, 0.2)
    trained = [m * c for m, c in zip(_step_masks(batch), keeps)]
    assert all(float(jnp.sum(c)) > 0 for c in keeps[1:]), "every depth must train some rows"
    ttt = TTTConfig(ttt_steps=K, step_decay=1.0, vocab_chunk=64, loss=loss_name)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(lambda p: ttt_loss(p, cfg, ttt, cod_key=key, **batch),
                                                        has_aux=True), compiler_options=FAST_COMPILE)(params)
    ref_depths, ref_loss, ref_grads = _run_speculators(sp, head, batch, keeps,
                                                       "kl_div" if loss_name == "soft_ce" else "lk_hybrid")
    ours = _jax_depth_logits(head["params"], cfg, batch)
    errs = [rel_err(ours[d][anchors], ref) for d, (anchors, ref) in enumerate(ref_depths)]
    print(f"P-EAGLE vs speculators ({loss_name}): logits per depth", ", ".join(f"{e:.2e}" for e in errs))
    assert max(errs) <= 1e-4
    mine = float(loss) - (_teacher_entropy(batch, trained) if loss_name == "soft_ce" else 0.0)
    print(f"  loss {mine:.6f} vs {ref_loss:.6f}")
    assert abs(mine - ref_loss) <= 1e-5 * abs(ref_loss)
    flat = {e.file_name: np.asarray(_leaf(grads, e.path)) for e in _entries(cfg)}
    gerrs = {}
    for name, g in flat.items():
        ref = ref_grads[name]
        g = g.T if g.ndim == 2 else g
        gerrs[name] = rel_err(g.reshape(ref.shape), ref)
    print("  grads:", ", ".join(f"{n} {e:.1e}" for n, e in gerrs.items()))
    assert set(flat) == set(ref_grads)
    assert max(gerrs.values()) <= 1e-4
    assert float(np.abs(flat["mask_hidden"]).max()) > 0


def _entries(cfg):
    from specjax.drafts import weights

    return weights.entries(weights.EAGLE3_WEIGHTS, cfg)


def _leaf(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def test_a_wrong_mask_hidden_breaks_the_parity(head):
    """The parity above can fail: a perturbed mask_hidden moves every depth >= 1 logit."""
    cfg = head["cfg"]
    batch = _batch(head)
    bad = jax.tree_util.tree_map(np.array, head["params"])
    bad["mask_hidden"] = bad["mask_hidden"] + 0.5
    a, b = _jax_depth_logits(head["params"], cfg, batch), _jax_depth_logits(bad, cfg, batch)
    assert rel_err(a[0], b[0]) == 0.0
    assert min(rel_err(a[d], b[d]) for d in range(1, K)) > 1e-2


def test_cod_rows_are_depth_prefixes_with_the_reference_counts(head):
    batch = _batch(head, seed=4)
    masks = _step_masks(batch)
    keeps = [np.asarray(k[0]) for k in cod_row_masks(jax.random.key(9), masks, 0.7, 0.2)]
    n = int(np.asarray(masks[0]).sum())
    for d in range(1, K):
        assert np.all(keeps[d] <= keeps[d - 1]), "a chain kept at depth d must be kept at d-1"
        assert np.all(keeps[d] <= (np.asarray(masks[d][0]) > 0))
        cand = int((keeps[d - 1] * (np.asarray(masks[d][0]) > 0)).sum())
        want = min(cand, int(max(0, n - d) * max(0.7 ** d, 0.2)))
        assert int(keeps[d].sum()) == want, (d, int(keeps[d].sum()), want)
    assert keeps[0].all()


def test_p_eagle_export_validates_and_round_trips(head):
    findings, _ = validate_folder(head["out"], target=head["target_hf"])
    assert errors(findings) == [], errors(findings)
    assert any(f.rule == "config.parallel_drafting" and f.level == "warning" for f in findings)
    conf = json.loads(open(os.path.join(head["out"], "config.json")).read())
    assert conf["mask_token_id"] == MASK_ID
    tensors = load_file(os.path.join(head["out"], "model.safetensors"))
    assert tensors["mask_hidden"].shape == (1, 1, len(AUX) * H)
    imported = read_head(head["out"], target_config=head["target_hf"])
    assert imported.config.parallel_drafting and imported.config.mask_token_id == MASK_ID
    np.testing.assert_array_equal(np.asarray(imported.params["mask_hidden"]), np.asarray(head["params"]["mask_hidden"]))
    # a P-EAGLE head without its mask_hidden is refused, naming the tensor
    from export._heads import read_folder, write_folder

    config, tensors, _ = read_folder(head["out"])
    del tensors["mask_hidden"]
    broken = write_folder(head["root"] / "no_mask_hidden", config, tensors)
    findings, _ = validate_folder(broken, target=head["target_hf"])
    assert any("mask_hidden" in (f.problem + f.field) for f in errors(findings)), errors(findings)


def test_serve_cmd_asks_vllm_for_parallel_drafting(head, tmp_path):
    from specjax import serve_cmd

    spec = serve_cmd.vllm_speculative_config(head["out"], 4)
    assert spec == {"method": "eagle3", "model": head["out"], "num_speculative_tokens": 4, "parallel_drafting": True}
    plain_cfg = {k: v for k, v in json.load(open(os.path.join(head["out"], "config.json"))).items()
                 if k != "mask_token_id"}
    os.makedirs(tmp_path / "plain")
    json.dump(plain_cfg, open(tmp_path / "plain" / "config.json", "w"))
    assert "parallel_drafting" not in serve_cmd.vllm_speculative_config(str(tmp_path / "plain"), 4)


def test_p_eagle_config_errors_name_the_key(head):
    import dataclasses

    cfg = head["cfg"]
    with pytest.raises(ValueError, match="draft.mask_token_id"):
        dataclasses.replace(cfg, mask_token_id=V).validate()
    with pytest.raises(ValueError, match="draft.norm_output=false"):
        dataclasses.replace(cfg, norm_output=True).validate()
    with pytest.raises(ValueError, match="draft.type p_eagle"):
        dataclasses.replace(cfg, parallel_drafting=False).validate()

"""Parity of the JAX EAGLE-3 draft and TTT objective with SpecForge (the PyTorch reference), fp32/CPU.

(a) draft forward, TTT steps 0..2: project_aux / decoder_layer / draft_logits against SpecForge's
    project_hidden_states / backbone (sdpa path, shared cache_hidden) / compute_logits, with the
    default RoPE and with llama3 RoPE scaling;
(b) the whole TTT objective: ttt_loss against OnlineEagle3Model fed inputs shifted as in
    docs/eagle3-format.md, "TTT training semantics":
    per-step losses, accuracies and the gradient of the 0.8^k-weighted loss.

The JAX params go into SpecForge through the exporter's key map (load_state_dict strict=True), and
SpecForge's model is built from the exporter's config.json, so these also check the export mapping.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from parity._specforge import (TorchSoftCE, build_draft, eagle3_trainer_module, rel_err, run_draft_steps,
                               to_numpy, to_torch, torch)
from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig, shift_left, ttt_loss
from specjax.drafts.vocab import DraftVocab
from specjax.layers.norms import rms_norm
from specjax.targets.llama import LlamaTargetConfig, hf_config_dict
from specjax_converters.eagle3_export import eagle3_hf_config, eagle3_state_dict

B, T, K = 2, 24, 3
H, N_HEADS, N_KV, HEAD_DIM, INTER = 64, 4, 2, 16, 128
V, VD = 300, 120
TOL = 1e-4
# LLVM -O0 halves XLA:CPU compile time for these small test graphs (the fwd+bwd TTT graph takes ~8 s
# at the default level); it changes how the same ops are code-generated, not what they compute.
FAST_COMPILE = {"xla_backend_optimization_level": 0}

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# head_dim 16 / theta 1e4 wavelengths run 6..2e4 tokens; with original_max_position_embeddings 64 the
# llama3 rule keeps one band, smooths two and divides five by `factor`: every branch is exercised.


def make_case(rope_parameters=None, seed=0):
    target_hf = hf_config_dict(
        vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=6, num_attention_heads=N_HEADS,
        num_key_value_heads=N_KV, head_dim=HEAD_DIM, rms_norm_eps=1e-5, max_position_embeddings=256,
        rope_parameters=rope_parameters,
    )
    cfg = eagle3.config_from_target(LlamaTargetConfig.from_hf(target_hf), draft_vocab_size=VD,
                                    aux_layer_ids=(1, 2, 3))
    rng = np.random.default_rng(seed)
    params = jax.tree_util.tree_map(np.asarray, eagle3.init_draft_params(cfg, jax.random.key(seed), std=0.08))
    # Norm scales away from 1 so a swapped or dropped norm weight cannot go unnoticed.
    for norm in (params["norm"], *(params["midlayer"][n] for n in
                                   ("hidden_norm", "input_layernorm", "post_attention_layernorm"))):
        norm["scale"] = (norm["scale"] + 0.3 * rng.standard_normal(norm["scale"].shape)).astype(np.float32)
    vocab = DraftVocab.from_ids(rng.choice(V, VD, replace=False), V)
    data = {
        "x": rng.integers(0, V, (B, T)).astype(np.int32),
        "aux": tuple(rng.standard_normal((B, T, H)).astype(np.float32) for _ in range(3)),
        "embed": (0.5 * rng.standard_normal((V, H))).astype(np.float32),
        "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
    }
    return target_hf, cfg, params, vocab, data, rng


def specforge_draft(target_hf, cfg, params, vocab, embed):
    conf = eagle3_hf_config(cfg, target_hf, "float32")
    return build_draft(conf, eagle3_state_dict(params, cfg, vocab, "float32"), embed)


def jax_draft_steps(params, cfg, data, n_steps):
    """Per-step draft logits and pre-norm hiddens with the TTT token alignment (step k reads x[t+1+k])."""
    logits, hiddens = _jax_draft_steps(params, cfg, n_steps, data["x"], data["aux"], data["embed"],
                                       data["positions"])
    return [np.asarray(x) for x in logits], hiddens


@functools.partial(jax.jit, static_argnums=(1, 2), compiler_options=FAST_COMPILE)  # 1 compile, not ~100 eager
def _jax_draft_steps(params, cfg, n_steps, x, aux, embed, positions):
    seg = jnp.ones(x.shape, jnp.int32)
    h = eagle3.project_aux(params, aux, cfg)
    cache, logits, hiddens = [], [], []
    for k in range(n_steps):
        emb = jnp.take(embed, shift_left(x, 1 + k), axis=0)
        h, kv = eagle3.decoder_layer(params, cfg, emb, h, positions, seg, cache)
        cache.append(kv)
        hiddens.append(h)
        logits.append(eagle3.draft_logits(params, cfg, h))
    return logits, hiddens


def torch_step_inputs(data, n_steps):
    aux_cat = torch.from_numpy(np.concatenate(data["aux"], axis=-1))
    ids = [to_torch(shift_left(jnp.asarray(data["x"]), 1 + k)).long() for k in range(n_steps)]
    return aux_cat, ids, torch.from_numpy(data["positions"]).long()


def test_draft_forward_matches_specforge():
    ours_by_rope = {}
    for rope, rope_parameters in (("default", None), ("llama3", LLAMA3_ROPE)):
        target_hf, cfg, params, vocab, data, _ = make_case(rope_parameters)
        draft = specforge_draft(target_hf, cfg, params, vocab, data["embed"])
        ours, _ = jax_draft_steps(params, cfg, data, K)
        ref = run_draft_steps(draft, *torch_step_inputs(data, K))
        errs = [rel_err(a, b) for a, b in zip(ours, ref)]
        print(f"draft forward ({rope} rope) max|diff|/max|ref| per TTT step: {['%.2e' % e for e in errs]}")
        assert max(errs) <= TOL, (rope, errs)
        ours_by_rope[rope] = ours
    # Same params and inputs in both cases: the scaled case must really differ, or it tests nothing.
    assert rel_err(ours_by_rope["llama3"][0], ours_by_rope["default"][0]) > 100 * TOL


def _teacher(cfg, params, vocab, data, rng):
    """Target final hidden + lm_head built so the teacher often agrees with the draft's step 0 (acc
    well above 0) and ~20% of target argmaxes fall outside the draft vocab (position mask used)."""
    _, hiddens = jax_draft_steps(params, cfg, data, 1)
    normed = np.asarray(rms_norm(hiddens[0], params["norm"]["scale"], cfg.rms_norm_eps))
    lm_head = (0.15 * rng.standard_normal((V, H))).astype(np.float32)
    lm_head[vocab.draft_ids] = 3.0 * np.asarray(params["lm_head"]["kernel"]).T
    final_hidden = (0.3 * rng.standard_normal((B, T, H))).astype(np.float32)
    final_hidden[:, 1:] += normed[:, :-1]  # target at t+1 ~ draft step 0 at row t
    oov = rng.random((B, T)) < 0.2
    rows = lm_head[rng.choice(np.flatnonzero(~vocab.t2d), int(oov.sum()))]
    final_hidden[oov] += 4.0 * rows / np.linalg.norm(rows, axis=-1, keepdims=True)
    return final_hidden, lm_head


def _top2_gap(logits):
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def test_ttt_objective_matches_specforge(monkeypatch):
    target_hf, cfg, params, vocab, data, rng = make_case(seed=1)
    final_hidden, lm_head = _teacher(cfg, params, vocab, data, rng)
    loss_mask = (rng.random((B, T)) < 0.85).astype(np.int32)
    loss_mask[:, -(K + 1):] = 0  # rows whose targets run past the sequence end: conventions differ there
    loss_mask[:, 0] = 0

    # ---- specjax ----
    ttt = TTTConfig(ttt_steps=K, step_decay=0.8, vocab_chunk=128)  # > 1 vocab chunk for the argmax

    def loss_fn(p):
        return ttt_loss(
            p, cfg, ttt, input_ids=jnp.asarray(data["x"]), loss_mask=jnp.asarray(loss_mask),
            segment_ids=jnp.ones((B, T), jnp.int32), positions=jnp.asarray(data["positions"]),
            aux_hidden=tuple(jnp.asarray(a) for a in data["aux"]), final_hidden=jnp.asarray(final_hidden),
            embed_table=jnp.asarray(data["embed"]), lm_head=jnp.asarray(lm_head),
            draft_ids=jnp.asarray(vocab.draft_ids, jnp.int32), t2d=jnp.asarray(vocab.t2d),
            d2t=jnp.asarray(vocab.d2t, jnp.int32),
        )

    (total, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), compiler_options=FAST_COMPILE)(params)

    # ---- SpecForge, inputs shifted as its TargetHead.preprocess does (docs/eagle3-format.md, "Input shift") ----
    mod = eagle3_trainer_module()
    monkeypatch.setattr(mod, "LogSoftmaxLoss", TorchSoftCE)  # its Triton kernel cannot run on CPU
    draft = specforge_draft(target_hf, cfg, params, vocab, data["embed"]).train()
    # as SpecForge trains (docs/eagle3-format.md, "Frozen embedding"); ttt_loss stops its gradient too
    draft.freeze_embedding()
    trainer = mod.OnlineEagle3Model(draft, length=K, attention_backend="sdpa")
    target_logits = torch.from_numpy(final_hidden) @ torch.from_numpy(lm_head).T  # [B,T,V] fp32
    shifted_ids = to_torch(shift_left(jnp.asarray(data["x"]), 1)).long()
    shifted_target = torch.cat([target_logits[:, 1:], torch.zeros_like(target_logits[:, :1])], dim=1)
    plosses, _, accs, *_ = trainer(
        input_ids=shifted_ids, attention_mask=torch.ones((B, T), dtype=torch.bool), target=shifted_target,
        loss_mask=torch.from_numpy(loss_mask).float()[..., None],
        hidden_states=torch.from_numpy(np.concatenate(data["aux"], axis=-1)),
    )
    ref_total = sum(0.8**k * plosses[k] for k in range(K))
    ref_total.backward()

    # The accuracy comparison is exact, so check that no argmax it counts is a near-tie that
    # rounding could flip: draft row t at step k and target row t+1+k, where loss_mask[t+k] = 1.
    step_logits, _ = jax_draft_steps(params, cfg, data, K)
    target_gap = _top2_gap(to_numpy(target_logits))
    for k, lg in enumerate(step_logits):
        rows = loss_mask[:, k:] > 0
        assert _top2_gap(lg)[:, : T - k][rows].min() > 1e-5
        assert target_gap[:, 1 + k:][rows[:, : T - 1 - k]].min() > 1e-5

    ours_loss = np.asarray(metrics["loss_k"])
    ref_loss = np.array([float(x.detach()) for x in plosses])
    ours_acc = np.asarray(metrics["acc_k"])
    ref_acc = np.array([float(x) for x in accs])
    loss_rel = np.abs(ours_loss - ref_loss) / np.abs(ref_loss)
    print(f"TTT loss_k ours {ours_loss} ref {ref_loss} rel {loss_rel}")
    print(f"TTT acc_k ours {ours_acc} ref {ref_acc}; in-vocab rows {np.asarray(metrics['in_vocab_tokens_k'])} "
          f"of {np.asarray(metrics['mask_tokens_k'])}")
    assert np.all(loss_rel <= TOL)
    ref_total = float(ref_total.detach())
    assert abs(float(total) - ref_total) <= TOL * abs(ref_total)
    np.testing.assert_allclose(ours_acc, ref_acc, rtol=0, atol=1e-7)
    assert ours_acc[0] > 0.2  # the test data makes step 0 agree often; 0 everywhere would prove little
    # Some masked rows have a target argmax outside the draft vocab (exercises the position mask).
    assert np.all(np.asarray(metrics["in_vocab_tokens_k"]) < np.asarray(metrics["mask_tokens_k"]))

    ours_g = eagle3_state_dict(grads, cfg, vocab, "float32")
    ref_g = {name: to_numpy(p.grad) for name, p in draft.named_parameters() if p.grad is not None}
    assert set(ref_g) == set(ours_g) - {"d2t", "t2d"}  # embed_tokens gets no gradient on either side
    errs = {k: rel_err(ours_g[k], ref_g[k]) for k in sorted(ref_g)}
    print("grad max|diff|/max|ref|: " + ", ".join(f"{k}={v:.1e}" for k, v in errs.items()))
    assert errs["fc.weight"] <= TOL and errs["lm_head.weight"] <= TOL
    assert max(errs.values()) <= TOL, errs

"""Shared by test_targets_train_*.py: a few EAGLE-3 training steps against a tiny new target,
then an export that the exporter validates.

Targets: Qwen3-MoE (mixed MoE / dense layers), a looped Llama (4 layers x 2 loops, virtual taps
past the physical depth) and HRM-Text, each built with transformers, saved with save_pretrained and
loaded with specjax's loader. The draft uses the target's default aux taps ([1, Lv//2-1, Lv-4] over
the virtual depth for looped targets). The jitted train step runs data-parallel on 2 fake CPU
devices over one fixed packed batch. Pass criteria after 40 AdamW steps: every loss is finite, the
loss on that batch falls by more than 0.1 (absolute: the soft CE's floor is the teacher's entropy),
the step-0 accuracy rises by more than 0.2 (measured: drops of ~0.35-0.43, gains of ~0.3-0.5), and
export_eagle3 validates and writes the draft.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

import torch  # the test files importorskip torch / transformers before importing this module
import transformers

from specjax import mesh as meshlib
from specjax.config import OptimConfig
from specjax.drafts import eagle3
from specjax.drafts.ttt import TTTConfig
from specjax.drafts.vocab import build_draft_vocab
from specjax.targets import load_target
from specjax.train.optim import make_optimizer
from specjax.train.step import build_step_fns, init_state
from specjax_converters.eagle3_export import export_eagle3

VOCAB, B, T, STEPS = 128, 8, 32, 40
MESH_DEVICES = 2


def _hf_model(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  max_position_embeddings=512)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(num_hidden_layers=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                                          norm_topk_prob=True, **common)
        return transformers.AutoModelForCausalLM.from_config(cfg), {}
    if kind == "looped_llama":
        cfg = transformers.LlamaConfig(num_hidden_layers=4, num_key_value_heads=2, **common)
        return transformers.AutoModelForCausalLM.from_config(cfg), {
            "architectures": ["LoopedLlamaForCausalLM"], "num_loops": 2}
    cfg = transformers.HrmTextConfig(num_hidden_layers=1, head_dim=8, H_cycles=2, L_cycles=2, **common)
    return transformers.AutoModelForCausalLM.from_config(cfg), {}


def _sharpen_(model) -> None:
    """Larger weights than HF's std-0.02 init, so the target's next-token distribution is peaked
    (a near-uniform teacher leaves the soft CE almost nothing to learn)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_((0.5 if "embed" in name else 0.2) * torch.randn(p.shape, generator=g))


def _batch():
    """Two packed documents per row built from short repeated phrases (learnable), then padding."""
    rng = np.random.RandomState(0)
    phrases = rng.randint(0, VOCAB, (6, 5))
    ids, seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for r in range(B):
        doc = np.concatenate([phrases[rng.randint(6)] for _ in range(6)])
        n1, n2 = 14, 12
        ids[r, :n1], ids[r, n1:n1 + n2] = doc[:n1], doc[n1:n1 + n2]
        seg[r, :n1], seg[r, n1:n1 + n2] = 1, 2
        pos[r, :n1], pos[r, n1:n1 + n2] = np.arange(n1), np.arange(n2)
    return {"input_ids": ids, "loss_mask": (seg > 0).astype(np.int32), "segment_ids": seg, "positions": pos}


def train_and_export(kind, tmp_path):
    """Build the tiny `kind` target, train STEPS steps, check the loss/accuracy, export."""
    torch.manual_seed(0)
    model, config_updates = _hf_model(kind)
    _sharpen_(model)
    path = tmp_path / "target"
    model.save_pretrained(str(path))
    if config_updates:
        hf = json.loads((path / "config.json").read_text())
        hf.update(config_updates)
        (path / "config.json").write_text(json.dumps(hf))
    target = load_target(str(path), dtype="float32")
    aux = target.default_aux_layer_ids()
    if kind == "looped_llama":
        assert target.num_layers == 8 and aux == (1, 3, 4) and max(aux) >= target.config.num_hidden_layers

    batch = _batch()
    vocab = build_draft_vocab(np.bincount(batch["input_ids"].ravel(), minlength=VOCAB), 64)
    draft_cfg = eagle3.config_from_target(target.config, draft_vocab_size=64, aux_layer_ids=aux)
    mesh = meshlib.make_mesh({"data": -1}, jax.devices()[:MESH_DEVICES])
    optimizer = make_optimizer(OptimConfig(lr=1e-2, warmup_ratio=0.0), STEPS)
    draft_params = eagle3.init_draft_params(draft_cfg, jax.random.key(0))
    fns = build_step_fns(target, target.params, draft_params, draft_cfg, TTTConfig(ttt_steps=2), optimizer, mesh)
    target_params = jax.device_put(target.params, fns.target_shardings)
    vocab_arrays = jax.device_put({"draft_ids": jnp.asarray(vocab.draft_ids, jnp.int32), "t2d": jnp.asarray(vocab.t2d),
                                   "d2t": jnp.asarray(vocab.d2t, jnp.int32)}, fns.vocab_shardings)
    state = jax.jit(lambda p: init_state(p, optimizer), out_shardings=fns.state_shardings)(draft_params)
    dev_batch = jax.device_put({k: jnp.asarray(v) for k, v in batch.items()}, fns.batch_sharding)

    losses, accs = [], []
    for _ in range(STEPS):
        state, metrics = fns.train_step(state, target_params, vocab_arrays, dev_batch)
        losses.append(float(metrics["loss"]))
        accs.append(float(metrics["acc_k"][0]))
    final = fns.eval_step(state["params"], target_params, vocab_arrays, dev_batch)
    loss, acc = float(final["loss"]), float(final["acc_k"][0])
    print(f"{kind}: aux {aux}, loss {losses[0]:.3f} -> {loss:.3f}, acc_0 {accs[0]:.2f} -> {acc:.2f}")
    assert np.all(np.isfinite(losses)), losses
    assert loss < losses[0] - 0.1, (losses, loss)
    assert acc > accs[0] + 0.2, (accs, acc)

    # the raw config.json, as the training loop passes it: the exporter works out the virtual depth
    out = export_eagle3(jax.device_get(state["params"]), draft_cfg, vocab, target.hf_config,
                        tmp_path / "export", dtype="bfloat16")
    exported = json.loads(open(os.path.join(out, "config.json")).read())
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(aux)
    assert exported["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in aux]
    assert exported["hidden_size"] == target.config.hidden_size and exported["vocab_size"] == VOCAB
    if kind == "looped_llama":  # vLLM must name the draft layer after the virtual depth (Nanbeige card)
        assert exported["target_layer_count"] == 8 and exported["target_num_loops"] == 2

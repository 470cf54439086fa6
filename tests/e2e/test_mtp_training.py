"""draft.type=mtp end to end on a tiny Qwen3.5 target (transformers' Qwen3_5ForCausalLM, the demo
tokenizer, fp32) whose checkpoint carries mtp.* tensors: the run starts from those tensors, the loop
trains the layer (speculators' 3-step weighted token CE) and the loss falls over 40 steps, run_meta.json
names the family, the export at the end holds exactly the checkpoint's MTP tensor names and shapes with
config.json declaring one MTP layer, and specjax.eval reads it back and decodes a chain of 3 MTP steps
losslessly (equal to the target's greedy output, also in the batched device loop). The tiny target is
random, so the demo data's tokens (the labels of the run) are not its predictions and the run's head is
not accepted; the layer fine-tuned further on the target's own greedy continuations (token ids) is
(accepted drafts > 0 on a prompt it trained on). tests/unit/test_mtp.py checks the drafted chain against
the forward step by step.
A checkpoint without mtp.* tensors trains from the target layers' init (the log says so)."""
import json
import logging
import os
import shutil
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reliability"))
from _runs import inprocess_config  # noqa: E402

RUN = ("draft.type=mtp", "draft.draft_vocab_size=320", "optim.lr=1e-2", "optim.warmup_ratio=0.0", "train.steps=40",
       "export.dtype=float32")
PROMPT = [1, 274, 201, 50, 281, 262, 71, 223, 69, 81, 79, 82]


def build_qwen3_5_target(tiny_target, out, with_mtp: bool):
    """The tiny target's tokenizer files beside a random Qwen3.5 (2 layers: DeltaNet, full attention)."""
    import jax

    from specjax.drafts import mtp
    from specjax.targets import get_target_class

    os.makedirs(out, exist_ok=True)
    for name in os.listdir(tiny_target):
        if name not in ("config.json", "model.safetensors", "BUILD_COMPLETE.json", "demo_build.json"):
            shutil.copy(os.path.join(tiny_target, name), out)
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=512,
        tie_word_embeddings=False)
    model = transformers.Qwen3_5ForCausalLM(cfg)
    with torch.no_grad():  # a peaked target: larger weights than HF's init
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.copy_(0.3 * torch.randn(p.shape))
    model.save_pretrained(out, safe_serialization=True)
    conf = json.load(open(os.path.join(out, "config.json")))
    conf["architectures"] = ["Qwen3_5ForCausalLM"]
    json.dump(conf, open(os.path.join(out, "config.json"), "w"))
    native = {}
    if with_mtp:
        tc = get_target_class(conf).config_class.from_hf(conf)
        mcfg = mtp.MtpConfig(target=tc)
        native = mtp.file_tensors_of_params(mtp.init_params(mcfg, jax.random.key(5), std=0.1), mcfg, np.float32)
        tensors = load_file(os.path.join(out, "model.safetensors"))
        save_file({**tensors, **native}, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out, native


def test_mtp_layer_trains_exports_and_decodes(tiny_target, tmp_path, caplog):
    from specjax.drafts.mtp_family import read_mtp_tensors
    from specjax.eval.generate import generate
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.eval.spec_loop import SpecLoop
    from specjax.serve_cmd import build
    from specjax.targets.loading import load_target
    from specjax.train.loop import train
    from specjax.train.metrics import read_metrics

    target_dir, native = build_qwen3_5_target(tiny_target, str(tmp_path / "qwen3_5"), with_mtp=True)
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="specjax"):
        head = train(inprocess_config(target_dir, run, *RUN, "export.at_end=true")).export_dir
    assert "starting from the" in caplog.text and "MTP tensors" in caplog.text
    rows = read_metrics(str(run))
    losses = [r["loss"] for r in rows]
    assert len(losses) == 40 and all(np.isfinite(losses)) and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses
    assert json.loads((run / "run_meta.json").read_text())["draft_family"] == "mtp"

    exported = load_file(os.path.join(head, "model.safetensors"))
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in native.items()}
    assert max(float(np.max(np.abs(exported[k] - native[k]))) for k in native) > 1e-3  # trained, not copied
    conf = json.load(open(os.path.join(head, "config.json")))
    assert conf["architectures"] == ["Qwen3_5ForCausalLM"] and conf["mtp_num_hidden_layers"] == 1
    # the export is what a checkpoint's MTP tensors read back as (the same names and layout)
    back = read_mtp_tensors(head, load_draft(head).config)
    assert back is not None

    target = load_target(target_dir, dtype="float32")
    draft = load_draft(head)
    greedy = generate(target, [PROMPT], max_new_tokens=16)[0][:16]
    chain = SpecDecoder(target, draft, num_spec_tokens=3)
    got = chain.generate(PROMPT, max_new_tokens=16)
    assert got.tokens == greedy and got.num_steps > 0, got
    (loop,) = SpecLoop(chain).generate([PROMPT], max_new_tokens=16)
    assert loop.tokens == greedy and loop.accepted_per_position == got.accepted_per_position

    code, text = build(head, target_dir, engine="vllm")
    assert code == 0 and '"method": "mtp"' in text and '"num_speculative_tokens": 3' in text, text

    # trained on the target's own greedy continuations (token ids, so the labels are its predictions),
    # the layer is accepted: the draft's quality, not only its losslessness
    import jax
    import jax.numpy as jnp
    import optax

    from specjax.drafts import mtp
    from specjax.eval.spec_decode import Draft

    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 320, 8).tolist() for _ in range(16)]
    ids = jnp.asarray([p + g[:40] for p, g in zip(prompts, generate(target, prompts, max_new_tokens=40))], jnp.int32)
    B, T = ids.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    seg = jnp.ones((B, T), jnp.int32)
    final, _ = target.forward(target.params, ids, aux_layer_ids=(), positions=pos, segment_ids=seg)
    mask = seg.at[:, :8].set(0)  # the continuation's tokens are the labels
    kw = dict(input_ids=ids, loss_mask=mask, segment_ids=seg, positions=pos, final_hidden=final,
              embed_table=target.embed_table(target.params), lm_head=target.lm_head_weight(target.params))
    opt = optax.adam(1e-2)
    params = draft.params
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        (loss, _), g = jax.value_and_grad(lambda p: mtp.mtp_loss(p, draft.config, **kw), has_aux=True)(params)
        updates, state = opt.update(g, state)
        return optax.apply_updates(params, updates), state, loss

    first = None
    for _ in range(150):
        params, state, loss = step(params, state)
        first = float(loss) if first is None else first
    assert float(loss) < 0.5 * first, (first, float(loss))
    tuned = SpecDecoder(target, Draft(params=params, config=draft.config, vocab=draft.vocab), num_spec_tokens=3)
    prompt = prompts[0]
    res = tuned.generate(prompt, max_new_tokens=16)
    assert res.tokens == generate(target, [prompt], max_new_tokens=16)[0][:16]
    assert sum(res.accepted_per_position) > 0, res.accepted_per_position


def test_checkpoint_without_mtp_tensors_starts_from_random_layer(tiny_target, tmp_path, caplog):
    from specjax.train.loop import train

    target_dir, _ = build_qwen3_5_target(tiny_target, str(tmp_path / "plain"), with_mtp=False)
    with caplog.at_level(logging.INFO, logger="specjax"):
        train(inprocess_config(target_dir, tmp_path / "run", "draft.type=mtp", "draft.draft_vocab_size=320"))
    assert "has no MTP tensors" in caplog.text and "target layers' init" in caplog.text

"""The demo target: a tiny LlamaForCausalLM pretrained from scratch on the ChatML-rendered demo
conversations (packed documents, causal-LM loss, the project's optimizer from
`specjax.train.optim`) and written as an HF folder with the tokenizer files."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Sequence

from specjax.config import OptimConfig
from specjax.demo.tasks import DEMO_DATA_PATH, EOT, IM_END, read_demo_conversations, render_chatml
from specjax.demo.tokenizer import save_tokenizer_portable

# Defaults sized so a 2-core CPU builds the target in one to two minutes: 200 steps x 8 x 256 tokens
# (~1.5 passes over the data). More steps give a markedly sharper target (e.g. 400 steps: held-out
# assistant-token accuracy 0.85 vs 0.72) at proportionally more build time.
DEMO_TARGET_DEFAULTS = dict(
    hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384,
    steps=200, seq_len=256, batch_size=8, lr=6e-3, seed=0,
)

# Optimizer recipe beside the target's lr (specjax.train.optim.make_optimizer: global-norm clip, then
# AdamW with linear warmup + cosine decay to lr * min_lr_ratio; 1-D norm scales are not decayed).
DEMO_OPTIM = dict(warmup_ratio=0.1, min_lr_ratio=0.1, weight_decay=0.01, b1=0.9, b2=0.98, eps=1e-8,
                  grad_clip=1.0)


def demo_optim_config(lr: float) -> OptimConfig:
    return OptimConfig(lr=lr, **DEMO_OPTIM)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def demo_target_hf_config(tokenizer, *, hidden, layers, heads, kv_heads, intermediate,
                          max_positions: int = 2048) -> dict:
    """HF config.json dict (transformers-5 layout, via the target module) plus our token ids."""
    from specjax.targets import llama

    cfg = llama.hf_config_dict(
        "LlamaForCausalLM",
        vocab_size=_round_up(len(tokenizer), 64),  # spare rows are never produced by the tokenizer
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=max_positions,
        rope_theta=10000.0, dtype="float32",
    )
    cfg.update(
        bos_token_id=None,  # ChatML text starts with <|im_start|>; there is no BOS
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),  # a chat turn ends at <|im_end|>
        pad_token_id=tokenizer.pad_token_id,
    )
    return cfg


def tokenize_demo_documents(rows: Sequence[dict], tokenizer, max_len: int):
    """Each conversation rendered with ChatML and tokenized whole (every token is trained on)."""
    docs = []
    for r in rows:
        ids = tokenizer(render_chatml(r["messages"]), add_special_tokens=False)["input_ids"]
        docs.append(ids[:max_len])
    return docs


def pack_documents(docs: Sequence[Sequence[int]], seq_len: int, pad_id: int, seed: int):
    """First-fit packing of shuffled documents into rows of `seq_len`. Returns int32 arrays
    (input_ids, segment_ids, positions) of shape [rows, seq_len]; segment 0 marks padding and
    positions restart at 0 per document, the same layout the data pipeline feeds the target."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(docs))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = len(docs[i])
        for b in range(len(bins)):
            if room[b] >= n:
                bins[b].append(int(i))
                room[b] -= n
                break
        else:
            bins.append([int(i)])
            room.append(seq_len - n)
    ids = np.full((len(bins), seq_len), pad_id, np.int32)
    seg = np.zeros((len(bins), seq_len), np.int32)
    pos = np.zeros((len(bins), seq_len), np.int32)
    for r, members in enumerate(bins):
        t = 0
        for s, i in enumerate(members, start=1):
            n = len(docs[i])
            ids[r, t:t + n] = docs[i]
            seg[r, t:t + n] = s
            pos[r, t:t + n] = np.arange(n)
            t += n
    return ids, seg, pos


def causal_lm_loss(params, cfg, ids, seg, pos):
    """Mean next-token cross entropy over every position whose successor is in the same
    document; also returns top-1 accuracy over the same positions."""
    import jax.numpy as jnp
    import optax

    from specjax.targets import llama

    hidden, _ = llama.forward(params, cfg, ids, aux_layer_ids=(), positions=pos, segment_ids=seg)
    logits = llama.logits(params, cfg, hidden[:, :-1])
    labels = ids[:, 1:]
    valid = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    denom = jnp.maximum(valid.sum(), 1.0)
    acc = ((jnp.argmax(logits, -1) == labels) * valid).sum() / denom
    return (ce * valid).sum() / denom, acc


def pretrain_demo_target(hf_config: dict, docs, *, steps: int, seq_len: int, batch_size: int,
                         lr: float, seed: int, log=None, log_every: int = 50):
    """Train fp32 params from scratch with the project's optimizer (`demo_optim_config(lr)`:
    AdamW, warmup + cosine, clipping). Returns (params, cfg, history) where history lists
    (step, loss, acc) for every step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from specjax.targets import llama
    from specjax.train.optim import make_optimizer

    cfg = llama.LlamaTargetConfig.from_hf(hf_config)
    params = llama.init_params(cfg, jax.random.PRNGKey(seed), jnp.float32)
    ids, seg, pos = pack_documents(docs, seq_len, hf_config.get("pad_token_id") or 0, seed)

    opt = make_optimizer(demo_optim_config(lr), steps)
    opt_state = opt.init(params)

    @jax.jit
    def train_step(params, opt_state, ids, seg, pos):
        (loss, acc), grads = jax.value_and_grad(causal_lm_loss, has_aux=True)(params, cfg, ids, seg, pos)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    rng = np.random.default_rng(seed + 1)
    perm, cursor = rng.permutation(len(ids)), 0
    metrics = []  # device scalars; read back once at the end so steps don't wait on the host
    for step in range(steps):
        if cursor + batch_size > len(perm):  # new epoch, reshuffled rows
            perm, cursor = rng.permutation(len(ids)), 0
        sel = perm[cursor:cursor + batch_size]
        cursor += batch_size
        params, opt_state, loss, acc = train_step(params, opt_state, ids[sel], seg[sel], pos[sel])
        metrics.append((loss, acc))
        if log and (step % log_every == 0 or step == steps - 1):
            log(f"[demo target] step {step:4d}/{steps} loss {float(loss):.4f} acc {float(acc):.3f}")
    history = [(i, float(l), float(a)) for i, (l, a) in enumerate(jax.device_get(metrics))]
    return params, cfg, history


def build_demo_target(out_dir: str | os.PathLike, *, data_path: str | os.PathLike = DEMO_DATA_PATH,
                      tokenizer_dir: str | os.PathLike, hidden: int = 128, layers: int = 4,
                      heads: int = 4, kv_heads: int = 2, intermediate: int = 384,
                      steps: int = DEMO_TARGET_DEFAULTS["steps"],
                      seq_len: int = DEMO_TARGET_DEFAULTS["seq_len"],
                      batch_size: int = DEMO_TARGET_DEFAULTS["batch_size"],
                      lr: float = DEMO_TARGET_DEFAULTS["lr"], seed: int = 0, log=print) -> dict:
    """Pretrain a tiny LlamaForCausalLM on the demo conversations and write an HF folder
    (config.json, model.safetensors, generation_config.json, tokenizer files) to `out_dir`.
    Returns build info (final loss/accuracy, seconds, parameter count, history)."""
    import jax
    import numpy as np
    from transformers import AutoTokenizer

    from specjax.targets import llama

    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    hf_config = demo_target_hf_config(tokenizer, hidden=hidden, layers=layers, heads=heads,
                                      kv_heads=kv_heads, intermediate=intermediate)
    docs = tokenize_demo_documents(read_demo_conversations(data_path), tokenizer, seq_len)
    params, cfg, history = pretrain_demo_target(hf_config, docs, steps=steps, seq_len=seq_len,
                                                batch_size=batch_size, lr=lr, seed=seed, log=log)
    train_seconds = time.time() - t0

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    llama.save_hf_checkpoint(jax.device_get(params), cfg, str(out_dir), hf_config=hf_config)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    (out_dir / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [hf_config["eos_token_id"], eot], "pad_token_id": hf_config["pad_token_id"],
    }, indent=2) + "\n")
    save_tokenizer_portable(tokenizer, out_dir)

    tail = history[-max(1, steps // 10):]  # last 10% of steps: less noisy than one batch
    info = {
        "final_loss": float(np.mean([h[1] for h in tail])),
        "final_acc": float(np.mean([h[2] for h in tail])),
        "first_loss": history[0][1],
        "last_batch_loss": history[-1][1],
        "steps": steps, "train_seconds": round(train_seconds, 2),
        "n_params": int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params))),
        "n_docs": len(docs), "history": history,
    }
    (out_dir / "demo_build.json").write_text(json.dumps(info, indent=2) + "\n")
    return info

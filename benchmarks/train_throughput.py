"""EAGLE-3 training throughput: specjax's train step against SpecForge's OnlineEagle3Model, same GPU, same tokens.

    # one H200 (issue 9): both systems, dense Llama-3.1-8B shape, all jobs in one invocation: 353 s measured
    # with these flags (benchmarks/results/train_throughput.md, run 3)
    JAX_PLATFORMS=cuda PYTHONPATH=/tmp/site:$PWD/kernels:$PWD python3 benchmarks/train_throughput.py \
        --steps 5 --maxlen-cap-s 45 --worker-budget-s 215 --worker-timeout-s 275 --specforge-timeout-s 265 --out DIR
    # gpt-oss-120b on one GPU (random MXFP4 experts kept quantized; sinks run the plain attention path, so
    # bound its score buffer with the query block)
    ... python3 benchmarks/train_throughput.py --models gpt_oss_120b --systems specjax:q_block=512 --jobs fixed_4096 \
        --tokens-per-step 16384 --no-sharegpt --no-profile --no-maxlen --out DIR
    # the Qwen3-30B-A3B shape (SpecForge's HF target runs out of memory at 8x4096; 4x4096 fits)
    ... python3 benchmarks/train_throughput.py --models qwen3_30b_a3b --jobs fixed_4096 --tokens-per-step 16384 --out DIR
    # the Qwen3.5-35B-A3B shape (Gated DeltaNet + gated attention + MoE; SpecForge gets transformers' torch
    # fallbacks for the delta rule and the short convolution, what its users get without flash-linear-attention)
    ... python3 benchmarks/train_throughput.py --models qwen3_5_35b_a3b --jobs fixed_4096 --tokens-per-step 8192 --out DIR
    # CPU smoke run at tiny widths, both systems in this process (tests/unit/test_train_throughput_script.py)
    PYTHONPATH=kernels:. python benchmarks/train_throughput.py --tiny
    # specjax variants side by side (kernels.moe, draft type), e.g. the MoE kernel inside the train step
    ... python3 benchmarks/train_throughput.py --models qwen3_30b_a3b --systems specjax,specjax:moe=mgpu ...
    # the frozen target's projection GEMMs in FP8 (target.compute_dtype fp8; Hopper) against bf16 and SpecForge;
    # the aux-state errors of the same switch: benchmarks/fp8_target.py
    ... python3 benchmarks/train_throughput.py --models llama3_8b --systems specjax,specjax:target_fp8=1,specforge \
        --jobs fixed_4096 --out DIR

Both systems train an EAGLE-3 draft (Vd=32000, K=7 TTT steps, 0.8^k weights, AdamW lr 1e-4, clip 0.5,
fp32 master weights, bf16 compute) against a frozen target with random bf16 weights of a real model's
shape; nothing is downloaded. The two targets hold the same weights (one counter-based generator,
transformers' init law: normal(0, 0.02), norms 1; "the random target weights" below), so both train
against the same teacher and route tokens to the same experts.
  specjax   : specjax.train.step.build_step_fns (one jit: target forward + teacher + TTT unroll + AdamW).
  SpecForge : specforge==0.2.0 OnlineEagle3Model around LlamaForCausalLMEagle3(attention_backend=
              "flex_attention"), its Triton LogSoftmaxLoss, its compact teacher (target_hidden_for_compact =
              the target's final hidden, target_head_weight = its lm_head), its BF16Optimizer (AdamW over
              fp32 masters, clip 0.5); the target is transformers' model (bf16, SDPA) run under no_grad with
              forward hooks capturing the three aux layers (no full-vocab logits, no all-layer hidden list).
Workloads (same tokens for both): fixed-length random batches (B x T), and ShareGPT conversation
lengths (benchmarks/data/sharegpt_lengths.json) where specjax packs documents into B rows of 4096 and
SpecForge runs each conversation alone at batch 1, unpadded.

Each system runs in its own subprocess (clean GPU memory); jobs in a worker share the target weights.
Timing: wall clock over the timed steps after warm-up, synchronised at the end (torch.cuda.synchronize /
block_until_ready). Memory: torch max_memory_allocated per job (reset before it); JAX: the compiled
step's plan (arguments + outputs + temporaries - donated aliases) and the process's peak_bytes_in_use.

MFU = model FLOPs / step time / 789e12 (bf16 matmul ceiling measured on the H200, device README).
Model FLOPs per step, counted on real tokens only (padding excluded), P = matmul parameters:
  target forward   2 * P_target_active * n  (+ lm_head V*H: both systems take the full-vocab argmax)
                   + 4 * Hq * hd * pairs * L_target      (causal attention, pairs = sum_docs l(l+1)/2)
  teacher          2 * Vd * H * n                           (target lm_head rows of the draft vocab)
  draft fwd+bwd    3 * [ 2 * 3H*H * n                       (fc)
                         + sum_k ( 2 * P_layer * n + 2 * Vd * H * n     (decoder layer, draft lm_head)
                                   + 4 * Hq * hd * (pairs + k * n) ) ]  (TTT attention: causal + k diagonals)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
import traceback

import numpy as np

PEAK_FLOPS = 789e12  # bf16 matmul ceiling measured on this H200 (the device notes for the lent H200, 2026-10-28)
# fixed-length jobs cycle through POOL random batches, so the loss trend compares the same batches
# (first POOL steps against the last POOL); batch-to-batch differences would hide it at tiny sizes
POOL = 2
HERE = os.path.dirname(os.path.abspath(__file__))
LENGTHS_FILE = os.path.join(HERE, "data", "sharegpt_lengths.json")
ROOT = os.path.dirname(HERE)

# --------------------------------------------------------------------------------------------------
# model shapes (HF config dicts; no weights)
# --------------------------------------------------------------------------------------------------


def llama_hf(vocab, hidden, inter, layers, heads, kv, head_dim, max_pos=131072, theta=500000.0):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "rms_norm_eps": 1e-5, "max_position_embeddings": max_pos, "tie_word_embeddings": False,
            "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16"}


def qwen3_moe_hf(tiny=False):
    with open(os.path.join(ROOT, "configs", "targets", "qwen3_30b_a3b", "config.json")) as f:
        hf = json.load(f)
    if tiny:
        hf.update(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=8, num_experts_per_tok=2, max_window_layers=4)
    return hf


def gpt_oss_hf(name: str, tiny=False):
    """gpt-oss-20b / -120b (configs/targets; MXFP4 experts kept quantized on the device); the name with
    "_bf16" appended is the same shape with bf16 experts (what transformers dequantizes MXFP4 to, and
    what SpecForge trains against)."""
    base, bf16 = (name[:-len("_bf16")], True) if name.endswith("_bf16") else (name, False)
    with open(os.path.join(ROOT, "configs", "targets", base, "config.json")) as f:
        hf = json.load(f)
    if bf16:
        hf.pop("quantization_config", None)
    if tiny:
        hf.update(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"] * 2, pad_token_id=0, eos_token_id=1)
    return hf


def qwen3_5_moe_hf(tiny=False):
    """Qwen3.5-35B-A3B's text backbone (configs/targets): Gated DeltaNet layers, every 4th layer gated
    full attention, 256 routed experts + a shared expert."""
    with open(os.path.join(ROOT, "configs", "targets", "qwen3_5_35b_a3b", "config.json")) as f:
        hf = json.load(f)
    if tiny:
        hf.update(vocab_size=512, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
                  layer_types=["linear_attention"] * 3 + ["full_attention"])
    return hf


def model_hf(name: str, tiny: bool) -> dict:
    if name == "llama3_8b":  # Llama-3.1-8B shape (RoPE kept default with theta 5e5: same cost as llama3 scaling)
        return llama_hf(512, 64, 128, 4, 4, 2, 16, 4096) if tiny else llama_hf(128256, 4096, 14336, 32, 32, 8, 128)
    if name == "qwen3_30b_a3b":
        return qwen3_moe_hf(tiny)
    if name == "qwen3_5_35b_a3b":
        return qwen3_5_moe_hf(tiny)
    if name in ("gpt_oss_20b", "gpt_oss_120b", "gpt_oss_20b_bf16", "gpt_oss_120b_bf16"):
        return gpt_oss_hf(name, tiny)
    if name == "smollm2_135m":  # the README's first real head (SmolLM2-135M-Instruct's shape); sizing table
        with open(os.path.join(ROOT, "configs", "targets", "smollm2_135m", "config.json")) as f:
            return json.load(f)
    raise ValueError(f"unknown model {name!r}; choose llama3_8b, qwen3_30b_a3b, qwen3_5_35b_a3b, gpt_oss_20b, gpt_oss_120b "
                     f"(either with _bf16: bf16 experts) or smollm2_135m")


def draft_shape(hf: dict, Vd: int) -> dict:
    """The EAGLE-3 draft both systems build (specjax's config_from_target rule: the target's widths; a
    target with no dense feed-forward width, Qwen3.5-MoE, gives its family's default draft width)."""
    from specjax.targets.abstract import make_target

    cfg = make_target(hf).config
    return {"H": cfg.hidden_size, "I": cfg.intermediate_size, "heads": cfg.num_attention_heads,
            "kv": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "V": cfg.vocab_size, "Vd": Vd}


def default_aux_ids(L: int) -> tuple[int, int, int]:
    low = min(1, L - 3)
    mid = max(L // 2 - 1, low + 1)
    return (low, mid, max(L - 4, mid + 1))


# --------------------------------------------------------------------------------------------------
# model FLOPs
# --------------------------------------------------------------------------------------------------


def target_active_matmul_params(hf: dict) -> int:
    """Matmul parameters one token goes through in the target, lm_head (full vocab) included,
    embedding lookup excluded; MoE: the routed top-k experts plus the router (and the shared expert with
    its gate where there is one). Qwen3.5's full-attention layers project a gate beside the query; its
    Gated DeltaNet layers count their projections (q, k, v, z in; beta, a; out), not the delta rule's
    own state products."""
    H, L, V = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    nH, nKV = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or H // nH
    gated_q = 2 if hf.get("model_type", "").startswith(("qwen3_5", "qwen3_next")) else 1
    attn = gated_q * H * nH * hd + 2 * H * nKV * hd + nH * hd * H
    types = hf.get("layer_types") or ["full_attention"] * L
    if "linear_attention" in types:
        nk, nv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
        dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        linear = H * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * H
        n_linear = sum(t == "linear_attention" for t in types)
        attn_total = n_linear * linear + (L - n_linear) * attn
    else:
        attn_total = L * attn
    if hf.get("model_type") == "gpt_oss":  # every layer routed: experts of width intermediate_size
        mlp = hf["num_experts_per_tok"] * 3 * H * hf["intermediate_size"] + H * hf["num_local_experts"]
    elif hf.get("num_experts"):
        mlp = hf["num_experts_per_tok"] * 3 * H * hf["moe_intermediate_size"] + H * hf["num_experts"]
        if hf.get("shared_expert_intermediate_size"):
            mlp += 3 * H * hf["shared_expert_intermediate_size"] + H
    else:
        mlp = 3 * H * hf["intermediate_size"]
    return attn_total + L * mlp + V * H


def causal_pairs(doc_lengths, window: int | None = None) -> int:
    """(query, key) pairs of causal attention over the documents; within a sliding window if given."""
    if window is None:
        return int(sum(int(n) * (int(n) + 1) // 2 for n in doc_lengths))
    return int(sum(min(i + 1, window) for n in doc_lengths for i in range(int(n))))


def target_attention_pairs(hf: dict, doc_lengths) -> int:
    """Attention pairs summed over the target's layers (sliding layers see only their window; linear-attention
    layers count none: their state products are not attention pairs)."""
    types = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
    full = causal_pairs(doc_lengths)
    window = hf.get("sliding_window")
    slid = causal_pairs(doc_lengths, window) if window else full
    return sum(slid if t == "sliding_attention" else 0 if t == "linear_attention" else full for t in types)


def step_flops(hf: dict, d: dict, K: int, doc_lengths) -> dict:
    """Model FLOPs of one train step over documents of the given lengths (see the module doc)."""
    n = int(sum(doc_lengths))
    pairs = causal_pairs(doc_lengths)
    H, Vd = d["H"], d["Vd"]
    nH_t = hf["num_attention_heads"]
    hd_t = hf.get("head_dim") or hf["hidden_size"] // nH_t
    target = 2 * target_active_matmul_params(hf) * n + 4 * nH_t * hd_t * target_attention_pairs(hf, doc_lengths)
    teacher = 2 * Vd * H * n
    layer = 2 * H * (d["heads"] + 2 * d["kv"]) * d["head_dim"] + d["heads"] * d["head_dim"] * H + 3 * H * d["I"]
    fwd = 2 * 3 * H * H * n
    for k in range(K):
        fwd += 2 * layer * n + 2 * Vd * H * n + 4 * d["heads"] * d["head_dim"] * (pairs + k * n)
    return {"target": target, "teacher": teacher, "draft": 3 * fwd, "total": target + teacher + 3 * fwd}


# --------------------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------------------


def load_lengths(path: str = LENGTHS_FILE) -> np.ndarray:
    with open(path) as f:
        return np.asarray(json.load(f)["lengths"], np.int64)


def sample_packed_rows(lengths, n_rows: int, seq: int, seed: int, min_len: int = 16):
    """Documents drawn (seeded) from the length distribution, packed first-fit in arrival order into
    rows of `seq` tokens until n_rows rows are closed. Returns the rows (lists of doc lengths)."""
    rng = np.random.default_rng(seed)
    rows: list[list[int]] = []
    open_rows: list[list[int]] = []
    while len(rows) + len(open_rows) < n_rows or open_rows:
        n = int(max(min(int(rng.choice(lengths)), seq), min_len))
        for r in open_rows:
            if sum(r) + n <= seq:
                r.append(n)
                break
        else:
            if len(rows) + len(open_rows) >= n_rows:  # no new rows: close the fullest and go on
                open_rows.sort(key=sum)
                rows.append(open_rows.pop())
                continue
            open_rows.append([n])
        # a row with no room for a short document is closed
        for r in [r for r in open_rows if seq - sum(r) < min_len]:
            open_rows.remove(r)
            rows.append(r)
    return rows[:n_rows]


def doc_tokens(length: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, length, dtype=np.int64)


def build_plan(model: str, tiny: bool, args) -> dict:
    hf = model_hf(model, tiny)
    if tiny:
        K, Vd, seqs, toks = 2, 64, (32,), 128
        warmup, steps = 1, 4
    else:
        K, Vd, seqs, toks = 7, 32000, (2048, 4096), args.tokens_per_step
        warmup, steps = args.warmup, args.steps
    jobs = []
    for T in sorted(seqs, reverse=True):  # the 4096 configuration first: it matters most
        if args.only_seq and T != args.only_seq:
            continue
        jobs.append({"name": f"fixed_{T}", "kind": "fixed", "seq": T, "batch": max(toks // T, 1),
                     "warmup": warmup, "steps": steps})
    if args.sharegpt and model == "llama3_8b":
        T = seqs[-1]
        B = max(toks // T, 1)
        lengths = load_lengths() if not tiny else np.array([5, 9, 17, 30, 40, 64, 12, 23])
        rows = sample_packed_rows(np.minimum(lengths, T), B * args.sharegpt_steps, T, seed=1)
        warm_rows = sample_packed_rows(np.minimum(lengths, T), B, T, seed=2)
        jobs.insert(1, {"name": f"sharegpt_{T}", "kind": "docs", "seq": T, "batch": B, "rows": rows,
                        "warm_rows": warm_rows, "warmup": 1, "steps": len(rows) // B})
    if args.maxlen:
        start = getattr(args, "maxlen_start", None) or (128 if tiny else 16384)
        jobs.append({"name": "maxlen", "kind": "maxlen", "start": start,
                     "limit": 512 if tiny else 262144, "cap_s": args.maxlen_cap_s, "quantum": 32 if tiny else 4096})
    if args.profile and not tiny:
        jobs.append({"name": "profile_4096", "kind": "profile", "seq": 4096, "batch": max(toks // 4096, 1)})
    if getattr(args, "jobs", None):
        keep = set(args.jobs.split(","))
        jobs = [j for j in jobs if j["name"] in keep]
    return {"model": model, "tiny": tiny, "hf": hf, "K": K, "Vd": Vd, "lr": 1e-3 if tiny else 1e-4,
            "seed": 0, "jobs": jobs, "soft_budget_s": args.worker_budget_s}


def fixed_batch(B: int, T: int, V: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, V, (B, T), dtype=np.int64).astype(np.int32),
            "loss_mask": np.ones((B, T), np.int32), "segment_ids": np.ones((B, T), np.int32),
            "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()}


def packed_batch(rows, T: int, V: int, seed0: int) -> dict:
    """specjax's packed layout: documents left to right, segment ids 1.., positions restart, 0-padding."""
    B = len(rows)
    out = {k: np.zeros((B, T), np.int32) for k in ("input_ids", "loss_mask", "segment_ids", "positions")}
    doc = 0
    for b, row in enumerate(rows):
        t = 0
        for s, n in enumerate(row):
            out["input_ids"][b, t:t + n] = doc_tokens(n, V, seed0 + doc)
            out["loss_mask"][b, t:t + n] = 1
            out["segment_ids"][b, t:t + n] = s + 1
            out["positions"][b, t:t + n] = np.arange(n)
            t += n
            doc += 1
    return out


def vocab_arrays(V: int, Vd: int, seed: int):
    ids = np.sort(np.random.default_rng(seed).choice(V, Vd, replace=False)).astype(np.int64)
    t2d = np.zeros(V, bool)
    t2d[ids] = True
    return ids, t2d, ids - np.arange(Vd)


def job_docs(job) -> list[list[int]]:
    """Per timed step, the document lengths it trains on (the FLOP count's input)."""
    if job["kind"] == "fixed":
        return [[job["seq"]] * job["batch"]] * job["steps"]
    B = job["batch"]
    return [sum(job["rows"][i * B:(i + 1) * B], []) for i in range(job["steps"])]


# --------------------------------------------------------------------------------------------------
# the random target weights, the same on both sides
# --------------------------------------------------------------------------------------------------
# Both systems fill their target from one counter-based generator, so they train against the same
# target (results/train_throughput.md, "Random MoE target: why the first losses differed"). The law is
# transformers' init for these models: normal(0, initializer_range = 0.02) for every Linear, expert,
# router and embedding weight, 1 for the RMSNorm scales. Value of element j (C order) of slot s of the
# leaf at `path` (s = the index on the stacked layer axis, in specjax's layout):
#   key = mix(seed ^ mix(crc32(path) ^ mix(s + 0x9E3779B9)))     (python ints, per slice)
#   u1 = ((mix(key ^ mix(2j)) >> 9) + 0.5) / 2^23,  u2 = (mix(key ^ mix(2j + 1)) >> 9) / 2^23
#   w = 0.02 * sqrt(-2 ln u1) * cos(2 pi u2)                       (Box-Muller, fp32, then the dtype)
# with mix a 32-bit integer hash (multipliers of C. Wellons' "lowbias32"). The integer part is exact
# in numpy, JAX (uint32) and torch (int64, masked); log/cos round within an ulp of fp32 in each.
INIT_STD = 0.02
_MUL1, _MUL2, _M32 = 0x7FEB352D, 0x846CA68B, 0xFFFFFFFF


def _mix_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL1) & _M32
    x ^= x >> 15
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def slice_key(seed: int, path, slot: int) -> int:
    import zlib
    return _mix_int(seed ^ _mix_int(zlib.crc32("/".join(path).encode()) ^ _mix_int(slot + 0x9E3779B9)))


def _mix_u32(x):  # numpy / jax uint32 arrays: multiplication wraps modulo 2^32
    x = x ^ (x >> 16)
    x = x * x.dtype.type(_MUL1)
    x = x ^ (x >> 15)
    x = x * x.dtype.type(_MUL2)
    return x ^ (x >> 16)


def _box_muller(h1, h2, xp):
    u1 = ((h1 >> 9).astype(xp.float32) + xp.float32(0.5)) * xp.float32(2.0**-23)
    u2 = (h2 >> 9).astype(xp.float32) * xp.float32(2.0**-23)
    return xp.float32(INIT_STD) * xp.sqrt(xp.float32(-2.0) * xp.log(u1)) * xp.cos(xp.float32(2 * math.pi) * u2)


def shared_normal_np(key: int, shape) -> np.ndarray:
    """The generator in numpy (float32), the reference the JAX and torch versions are tested against."""
    n = math.prod(shape)
    assert n < 2**31, shape
    j = np.arange(n, dtype=np.uint32)
    k = np.uint32(key)
    h1, h2 = _mix_u32(k ^ _mix_u32(2 * j)), _mix_u32(k ^ _mix_u32(2 * j + np.uint32(1)))
    return _box_muller(h1, h2, np).reshape(shape)


_JAX_LEAF_FNS: dict = {}


def shared_normal_jax(keys, slice_shape, dtype):
    """[len(keys), *slice_shape] (one slice per key) in `dtype`, made on the device in one fused
    computation (only the output is materialised; a 48-layer expert stack is one call)."""
    import jax
    import jax.numpy as jnp

    n = math.prod(slice_shape)
    assert n < 2**31, slice_shape
    sig = (tuple(slice_shape), jnp.dtype(dtype).name)
    if sig not in _JAX_LEAF_FNS:
        def make(keys_u32):
            j = jax.lax.broadcasted_iota(jnp.uint32, (keys_u32.shape[0], n), 1)
            k = keys_u32[:, None]
            h1, h2 = _mix_u32(k ^ _mix_u32(2 * j)), _mix_u32(k ^ _mix_u32(2 * j + jnp.uint32(1)))
            return _box_muller(h1, h2, jnp).astype(dtype).reshape((keys_u32.shape[0], *slice_shape))
        _JAX_LEAF_FNS[sig] = jax.jit(make)
    return _JAX_LEAF_FNS[sig](jnp.asarray(np.asarray(keys, np.uint32)))


def shared_normal_torch(key: int, shape, device, chunk: int = 1 << 25):
    """The generator in torch (float32 on `device`), in chunks of `chunk` elements (int64 counters)."""
    import torch

    n = math.prod(shape)
    assert n < 2**31, shape
    out = torch.empty(n, dtype=torch.float32, device=device)

    def mix(x):  # x in [0, 2^32) as int64; products wrap mod 2^64, so the low 32 bits are exact
        x = x ^ (x >> 16)
        x = (x * _MUL1) & _M32
        x = x ^ (x >> 15)
        x = (x * _MUL2) & _M32
        return x ^ (x >> 16)

    for a in range(0, n, chunk):
        j = torch.arange(a, min(n, a + chunk), dtype=torch.int64, device=device)
        h1, h2 = mix(key ^ mix(2 * j)), mix(key ^ mix(2 * j + 1))
        u1 = ((h1 >> 9).to(torch.float32) + 0.5) * 2.0**-23
        u2 = (h2 >> 9).to(torch.float32) * 2.0**-23
        out[a:a + len(j)] = INIT_STD * torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)
    return out.reshape(shape)


def _slots(spec):
    """(slot, layer id) of each slice of a leaf: the stacked layer axis, or one unstacked slice."""
    if not spec.stacked:
        return [(0, None)]
    ids = spec.layer_ids if spec.layer_ids is not None else range(spec.shape[0])
    return list(enumerate(ids))


def jax_random_params(target, dtype, seed):
    """specjax's target params from the shared generator (norm scales 1)."""
    import jax.numpy as jnp

    from specjax.targets.base import tree_set

    import jax

    tree: dict = {}
    for spec in type(target).weight_specs(target.config):
        if spec.path[-1] == "scale":
            value = jnp.ones(spec.shape, dtype)
        elif spec.dtype == "uint8":  # MXFP4 experts: random nibbles, every group scaled by 2^-7 (|w| <= 0.047)
            if spec.path[-1] == "scales":
                value = jnp.full(spec.shape, 127 - 7, jnp.uint8)
            else:  # generated on the device: the 120b's blocks are 58 GiB
                value = jax.jit(lambda k, shape=spec.shape: jax.random.bits(k, shape, jnp.uint8))(
                    jax.random.key(slice_key(seed, spec.path, 0) % 2**31))
        else:
            slots = _slots(spec)
            keys = [slice_key(seed, spec.path, s) for s, _ in slots]
            shape = spec.shape[1:] if spec.stacked else spec.shape
            if math.prod(spec.shape) < 2**22:  # small leaves: on the host (no compile per shape)
                value = jnp.asarray(np.stack([shared_normal_np(k, shape) for k in keys]), dtype)
            else:
                value = shared_normal_jax(keys, shape, dtype)
            value = value if spec.stacked else value[0]
        tree_set(tree, spec.path, value)
    return tree


def target_random_params(target, dtype, seed):
    """`jax_random_params` of the target's checkpoint layout; with target.compute_dtype fp8, those same
    weights then quantized on the device as a loaded checkpoint's are (specjax.targets.fp8_compute)."""
    from specjax.targets.fp8_compute import checkpoint_config, fp8_compute_params, is_fp8

    stored = type(target)(checkpoint_config(target.config), target.hf_config, None)
    params = jax_random_params(stored, dtype, seed)
    if is_fp8(target.config):
        params = fp8_compute_params(params, type(target).weight_specs(target.config),
                                    getattr(target.config, "weight_quant", None))
    return params


def fill_hf_target_shared(model, hf: dict, seed: int) -> int:
    """Overwrite a transformers model's weights with the values `jax_random_params` gives specjax
    (same generator, placed through specjax's weight map: transposes, layer slots, and the expert stack
    transformers 5 keeps fused as gate_up_proj [E, 2F, D] / down_proj [E, D, F]). Returns the number
    of tensors written; every model parameter must be written once (else ValueError)."""
    import torch

    from specjax.targets.abstract import make_target

    target = make_target(hf)
    params = dict(model.named_parameters())
    written: set = set()

    def put(name, value, index=None):
        if name not in params:
            raise ValueError(f"fill_hf_target_shared: transformers' model has no parameter {name!r}")
        p = params[name]
        dst = p if index is None else p[index]
        if tuple(dst.shape) != tuple(value.shape):
            raise ValueError(f"fill_hf_target_shared: {name}{'' if index is None else index}: shape "
                             f"{tuple(dst.shape)} != {tuple(value.shape)}")
        with torch.no_grad():
            dst.copy_(value.to(p.dtype))
        written.add(name)

    for spec in type(target).weight_specs(target.config):
        for slot, layer in _slots(spec):
            shape = spec.shape[1:] if spec.stacked else spec.shape
            if spec.path[-1] == "scale":
                value = torch.ones(shape, device=next(iter(params.values())).device)
            else:
                value = shared_normal_torch(slice_key(seed, spec.path, slot), shape,
                                            next(iter(params.values())).device)
            if spec.expert_stacked:  # value [E, in, out] (specjax) -> HF [E, out, in]
                value = value.transpose(1, 2)
                per_expert = spec.hf_name.format(i=layer, e=0)
                if per_expert in params:  # an unfused ModuleList of experts
                    for e in range(value.shape[0]):
                        put(spec.hf_name.format(i=layer, e=e), value[e])
                    continue
                prefix = spec.hf_name.split("{e}")[0].format(i=layer)  # "model.layers.{i}.mlp.experts."
                kind = spec.path[-2]
                if kind == "down_proj":
                    put(prefix + "down_proj", value)
                else:
                    f = value.shape[1]
                    put(prefix + "gate_up_proj", value, (slice(None), slice(0, f) if kind == "gate_proj" else slice(f, 2 * f)))
                continue
            value = value.permute(*reversed(range(value.ndim))) if spec.transpose else value  # numpy .T: all axes
            if spec.deinterleave_axis is not None:  # specjax's [gate | up] halves -> the file's alternating entries
                half = value.shape[spec.deinterleave_axis] // 2
                gate, up = value.split(half, dim=spec.deinterleave_axis)
                axis = spec.deinterleave_axis % value.ndim
                value = torch.stack((gate, up), dim=axis + 1).flatten(axis, axis + 1)
            put(spec.hf_name.format(i=layer), value)
    missing = sorted(set(params) - written)
    if missing:
        raise ValueError(f"fill_hf_target_shared: parameters not in specjax's weight map: {missing[:5]}")
    return len(written)


# --------------------------------------------------------------------------------------------------
# specjax worker
# --------------------------------------------------------------------------------------------------


def _jax_mem_stats():
    import jax
    try:
        return jax.devices()[0].memory_stats() or {}
    except Exception:  # CPU devices may have none
        return {}


def specjax_variant(system: str) -> dict:
    """The options of a specjax system name: "specjax" (the defaults) or "specjax:moe=mgpu,draft=p_eagle"
    (moe: kernels.moe implementation; draft: eagle3 | p_eagle; q_block: the target attention's query
    block, which bounds its score buffer where the plain path runs: gpt-oss's sinks; long_context:
    train.long_context_tokens, the row length from which the TTT steps are rematerialised and the teacher
    formed per vocab tile; target_fp8=1: target.compute_dtype fp8, the target's projection GEMMs in e4m3
    with scales, specjax/targets/fp8_compute.py), so variants run side by side."""
    name, _, opts = system.partition(":")
    if name != "specjax":
        raise ValueError(f"not a specjax system: {system!r}")
    out = {}
    for kv in filter(None, opts.split(",")):
        key, _, value = kv.partition("=")
        if key not in ("moe", "draft", "q_block", "long_context", "target_fp8") or not value:
            raise ValueError(f"system {system!r}: options are moe=<kernels.moe>, draft=eagle3|p_eagle, "
                             f"q_block=<kernels.target_attention_q_block>, "
                             f"long_context=<train.long_context_tokens> and target_fp8=0|1")
        out[key] = int(value) if key in ("q_block", "long_context", "target_fp8") else value
    if out.get("target_fp8", 0) not in (0, 1):
        raise ValueError(f"system {system!r}: target_fp8 must be 0 or 1")
    if out.get("draft", "eagle3") not in ("eagle3", "p_eagle"):
        raise ValueError(f"system {system!r}: draft must be eagle3 or p_eagle")
    return out


def split_systems(text: str) -> list[str]:
    """--systems' comma list, where a variant's own options are comma-separated too: an item with "="
    and no ":" continues the system before it ("specjax,specjax:moe=mgpu,draft=p_eagle,specforge" is
    three systems)."""
    systems: list[str] = []
    for item in filter(None, text.split(",")):
        if "=" in item and ":" not in item:
            if not systems or ":" not in systems[-1]:
                raise ValueError(f"--systems {text!r}: option {item!r} follows no 'specjax:' variant")
            systems[-1] += "," + item
        else:
            systems.append(item)
    return systems


def run_specjax(plan: dict, emit, system: str = "specjax") -> None:
    import jax
    import jax.numpy as jnp

    from specjax import mesh as meshlib
    from specjax.config import OptimConfig
    from specjax.drafts import eagle3
    from specjax.drafts.ttt import TTTConfig, teacher_from_hidden
    from specjax.targets.abstract import make_target
    from specjax.train.optim import make_optimizer
    from specjax.train.step import build_step_fns, init_state, make_loss_fn

    tiny = plan["tiny"]
    hf = plan["hf"]
    dtype = jnp.float32 if tiny else jnp.bfloat16
    t0 = time.perf_counter()
    variant = specjax_variant(system)
    kw = {"moe_implementation": variant["moe"]} if "moe" in variant else {}
    if "q_block" in variant:
        kw["attention_q_block"] = variant["q_block"]
    if variant.get("target_fp8"):
        kw["compute_dtype"] = "fp8"
    target = make_target(hf, **kw)
    tparams = target_random_params(target, dtype, plan["seed"])
    aux = default_aux_ids(hf["num_hidden_layers"])
    parallel = variant.get("draft") == "p_eagle"  # same FLOPs: P-EAGLE computes every row of every depth
    dcfg = eagle3.config_from_target(target.config, draft_vocab_size=plan["Vd"], aux_layer_ids=aux,
                                     parallel_drafting=parallel, mask_token_id=0 if parallel else None)
    V = hf["vocab_size"]
    ids, t2d, d2t = vocab_arrays(V, plan["Vd"], plan["seed"])
    vocab = {"draft_ids": jnp.asarray(ids, jnp.int32), "t2d": jnp.asarray(t2d), "d2t": jnp.asarray(d2t, jnp.int32)}
    mesh = meshlib.make_mesh({})
    opt = make_optimizer(OptimConfig(lr=plan["lr"], warmup_ratio=0.0, grad_clip=0.5), 100000)
    draft0 = eagle3.init_draft_params(dcfg, jax.random.key(1))
    jax.block_until_ready(tparams)
    setup_s = time.perf_counter() - t0
    fns_cache: dict = {}

    def fns_for():
        if not fns_cache:
            kw = {"long_context_tokens": variant["long_context"]} if "long_context" in variant else {}
            ttt = TTTConfig(ttt_steps=plan["K"], step_decay=0.8, **kw)
            fns_cache["step"] = (build_step_fns(target, tparams, draft0, dcfg, ttt, opt, mesh, dtype), ttt)
        return fns_cache["step"]

    def to_dev(b, fns):
        return {k: jax.device_put(jnp.asarray(v, jnp.int32), fns.batch_sharding) for k, v in b.items()}

    def new_state(fns):
        return jax.jit(lambda p: init_state(p, opt), out_shardings=fns.state_shardings)(draft0)

    # CPU smoke runs: LLVM -O0 halves XLA:CPU compile time and does not change what is computed
    copts = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None

    compiled_cache: dict = {}

    def compile_step(fns, state, b, keep=True):
        key = (id(fns), b["input_ids"].shape)
        if key in compiled_cache:
            return compiled_cache[key][0], 0.0, compiled_cache[key][1]
        t = time.perf_counter()
        compiled = fns.train_step.lower(state, tparams, vocab, b).compile(compiler_options=copts)
        ma = compiled.memory_analysis()
        plan_b = None
        if ma is not None:
            plan_b = int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                         + ma.temp_size_in_bytes)
        if keep:
            compiled_cache[key] = (compiled, plan_b)
        return compiled, time.perf_counter() - t, plan_b

    def train_job(job, batches_np, warm_np):
        fns, _ = fns_for()
        batches = [to_dev(b, fns) for b in batches_np]
        warm = [to_dev(b, fns) for b in warm_np]
        state = new_state(fns)
        compiled, compile_s, plan_bytes = compile_step(fns, state, batches[0])
        for b in warm:
            state, m = compiled(state, tparams, vocab, b)
        jax.block_until_ready(state)
        t = time.perf_counter()
        ms = []
        for b in batches:
            state, m = compiled(state, tparams, vocab, b)
            ms.append(m)
        jax.block_until_ready((state, ms))
        wall = time.perf_counter() - t
        losses = [float(m["loss"]) for m in ms]
        return {"compile_s": compile_s, "step_s": wall / len(batches), "time_s": wall, "losses": losses,
                "acc0": [float(m["acc_k"][0]) for m in ms], "plan_bytes": plan_bytes,
                # the share of step-0 rows whose target argmax is in the draft vocab (the loss counts
                # only those rows; with a random MoE target it is a lottery, see the results file)
                "in_vocab0": [float(m["in_vocab_tokens_k"][0] / max(float(m["mask_tokens_k"][0]), 1.0))
                              for m in ms if "in_vocab_tokens_k" in m],
                "skipped": sum(float(m["skipped"]) for m in ms)}

    emit({"event": "setup", "system": system, "setup_s": setup_s, "aux_ids": list(aux),
          "backend": jax.default_backend(), "jax": jax.__version__,
          "target_compute_dtype": getattr(target.config, "compute_dtype", "bfloat16"),
          "target_param_bytes": int(sum(x.nbytes for x in jax.tree.leaves(tparams)))})
    t_worker = time.perf_counter() - setup_s
    for job in plan["jobs"]:
        t_job = time.perf_counter()
        if t_job - t_worker > plan.get("soft_budget_s", 1e9):
            emit({"system": system, "job": job["name"], "ok": False, "error": "skipped: worker time budget spent"})
            continue
        try:
            V_ = V
            if job["kind"] == "fixed":
                def fixed_run(B, T=job["seq"]):
                    pool = [fixed_batch(B, T, V_, 100 + i) for i in range(POOL)]
                    batches = [pool[i % len(pool)] for i in range(job["steps"])]
                    return train_job(job, batches, [fixed_batch(B, T, V_, 99)] * job["warmup"])
                res = with_halving(job, fixed_run)
            elif job["kind"] == "docs":
                B, T = job["batch"], job["seq"]
                rows = job["rows"]
                batches = [packed_batch(rows[i * B:(i + 1) * B], T, V_, 1000 + i * 1000) for i in range(job["steps"])]
                warm = [packed_batch(job["warm_rows"], T, V_, 7)] * job["warmup"]
                res = train_job(job, batches, warm)
                res["padding_fraction"] = 1.0 - sum(map(sum, rows[: B * job["steps"]])) / (B * T * job["steps"])
            elif job["kind"] == "profile":
                res = profile_specjax(job, fns_for, to_dev, new_state, compile_step, target, tparams, vocab,
                                      dcfg, aux, V_, make_loss_fn, teacher_from_hidden, dtype)
            elif job["kind"] == "maxlen":
                res = maxlen_search(job, lambda T: _jax_try_len(T, fns_for, to_dev, new_state, compile_step,
                                                                tparams, vocab, V_))
            else:
                raise ValueError(job["kind"])
            res["ok"] = True
        except Exception as e:  # one failing job must not lose the others' numbers
            res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}", "trace": traceback.format_exc()[-3000:]}
        st = _jax_mem_stats()
        res.update(system=system, job=job["name"], job_s=time.perf_counter() - t_job,
                   process_peak_bytes=st.get("peak_bytes_in_use"), bytes_limit=st.get("bytes_limit"))
        emit(res)


def _jax_try_len(T, fns_for, to_dev, new_state, compile_step, tparams, vocab, V):
    import jax
    fns, _ = fns_for()
    b = to_dev(fixed_batch(1, T, V, 5), fns)
    state = new_state(fns)
    compiled, cs, plan_b = compile_step(fns, state, b, keep=False)
    state, m = compiled(state, tparams, vocab, b)
    loss = float(m["loss"])
    jax.block_until_ready(state)
    del state, compiled
    return {"compile_s": cs, "plan_bytes": plan_b, "loss": loss}


def profile_specjax(job, fns_for, to_dev, new_state, compile_step, target, tparams, vocab, dcfg, aux, V,
                    make_loss_fn, teacher_from_hidden, dtype):
    """Timing by elimination at one shape: target forward, target forward + teacher and the full step;
    plus a what-if target forward with a flash-style attention kernel. (Until 2026-12 it also timed the
    step with the unfused soft-CE; that path now lives only in tests/unit/test_ttt_reference.py as the
    reference, and earlier results files keep its figures.)"""
    import jax

    B, T = job["batch"], job["seq"]
    out = {}

    def bench(f, *a, n=3):
        jax.block_until_ready(f(*a))
        t = time.perf_counter()
        for _ in range(n):
            r = f(*a)
        jax.block_until_ready(r)
        return (time.perf_counter() - t) / n

    fns, ttt = fns_for()
    b = to_dev(fixed_batch(B, T, V, 3), fns)

    def tfwd(p, b):
        return target.forward(p, b["input_ids"], aux_layer_ids=aux, positions=b["positions"],
                              segment_ids=b["segment_ids"])

    def tfwd_teacher(p, b, v):
        h, a = tfwd(p, b)
        t, am = teacher_from_hidden(h, target.lm_head_weight(p), v["draft_ids"], ttt.vocab_chunk)
        return a, t, am

    out["target_forward_s"] = bench(jax.jit(tfwd), tparams, b)
    # what-if (not the product path): the target's O(T^2) masked attention swapped for the TTT attention
    # kernel at k=0 (causal flash attention; these rows hold one document each, so no segment ids)
    jaxpr_before = str(jax.make_jaxpr(tfwd)(tparams, b))
    from specjax.targets.layers import attention as attn_mod  # where every target's attention block calls it
    from specjax_kernels.ttt_attention import ttt_attention
    orig = attn_mod.dot_product_attention
    attn_mod.dot_product_attention = (lambda q, k, v, mask, scale, q_block=0, implementation=None:
                                      ttt_attention(q, k, v, scale=scale))

    def tfwd_whatif(p, b):  # a new function object: jax would reuse the cached trace of `tfwd`
        return tfwd(p, b)

    try:
        # guard against measuring the unpatched trace again (the first H200 run did: same time)
        out["whatif_changes_jaxpr"] = str(jax.make_jaxpr(tfwd_whatif)(tparams, b)) != jaxpr_before
        out["target_forward_flash_whatif_s"] = bench(jax.jit(tfwd_whatif), tparams, b)
    except Exception as e:
        out["target_forward_flash_whatif_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    finally:
        attn_mod.dot_product_attention = orig
    if job.get("teacher", False):  # off by default: its FLOPs (~8% of the step) say enough
        out["target_forward_teacher_s"] = bench(jax.jit(tfwd_teacher), tparams, b, vocab)
    # the step's executable is the fixed job's (same shape), if it ran
    st = new_state(fns)
    compiled, cs, plan_b = compile_step(fns, st, b)

    def run(st, step, n=3):
        for _ in range(n):
            st, m = step(st, tparams, vocab, b)
        return st, m

    st, _ = run(st, compiled, 1)
    jax.block_until_ready(st)
    t = time.perf_counter()
    st, m = run(st, compiled)
    jax.block_until_ready(st)
    out["step_fused_s"] = (time.perf_counter() - t) / 3
    out["plan_bytes_fused"] = plan_b
    del st, compiled
    return out


def with_halving(job, run):
    """Run a fixed-length job at job['batch']; on out-of-memory retry once at half the batch (the
    batch used is reported: tokens/s stays comparable, the tokens per step do not)."""
    try:
        res = run(job["batch"])
        res["batch"] = job["batch"]
        return res
    except Exception as e:
        if not _is_oom(e) or job["batch"] < 2:
            raise
        res = run(job["batch"] // 2)
        res.update(batch=job["batch"] // 2, oom_at_batch=job["batch"], oom_error=f"{type(e).__name__}: {str(e)[:300]}")
        return res


# --------------------------------------------------------------------------------------------------
# longest sequence at batch 1
# --------------------------------------------------------------------------------------------------


def _is_oom(e: BaseException) -> bool:
    s = f"{type(e).__name__} {e}".lower()
    return any(w in s for w in ("out of memory", "resource_exhausted", "outofmemory", "resource exhausted",
                                "allocat"))


def maxlen_search(job, try_len) -> dict:
    """Doubling from job['start'] until a length fails (or job['limit']), then bisection in multiples of
    job['quantum'], all under job['cap_s'] seconds. Non-OOM failures are reported as such."""
    t0 = time.perf_counter()
    q = job["quantum"]
    best, fail, tried = None, None, []
    T = job["start"]
    while T <= job["limit"] and time.perf_counter() - t0 < job["cap_s"]:
        ok, info = _attempt(try_len, T)
        tried.append({"seq": T, "ok": ok, **info})
        if not ok:
            fail = T
            break
        best = T
        T *= 2
    while best is not None and fail is not None and fail - best > q and time.perf_counter() - t0 < job["cap_s"]:
        mid = (best + fail) // 2 // q * q
        if mid <= best:
            break
        ok, info = _attempt(try_len, mid)
        tried.append({"seq": mid, "ok": ok, **info})
        best, fail = (mid, fail) if ok else (best, mid)
    return {"max_seq_ok": best, "min_seq_failed": fail, "tried": tried, "search_s": time.perf_counter() - t0,
            "capped": time.perf_counter() - t0 >= job["cap_s"]}


def _attempt(try_len, T):
    t = time.perf_counter()
    try:
        info = try_len(T)
        return True, {"s": time.perf_counter() - t, **info}
    except Exception as e:
        return False, {"s": time.perf_counter() - t, "oom": _is_oom(e), "error": f"{type(e).__name__}: {str(e)[:300]}"}


# --------------------------------------------------------------------------------------------------
# SpecForge worker
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _triton_stub_if_missing():
    """specforge.core.loss imports triton at module level (its Triton soft-CE). On CPU machines without
    triton, a minimal stand-in lets the import run; the kernel is replaced before use (CPU only)."""
    import importlib.util
    import types

    if importlib.util.find_spec("triton") is not None:
        yield False
        return
    import torch._dynamo  # noqa: F401  (imported before the stand-in exists: it probes triton)

    tr, tl = types.ModuleType("triton"), types.ModuleType("triton.language")
    tr.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    tr.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    tl.constexpr = object
    tr.language = tl
    sys.modules["triton"], sys.modules["triton.language"] = tr, tl
    try:
        yield True
    finally:
        for name, mod in (("triton", tr), ("triton.language", tl)):
            if sys.modules.get(name) is mod:
                del sys.modules[name]


class _TorchSoftCE:
    """CPU stand-in for specforge.core.loss.LogSoftmaxLoss (same value: -sum(mask * p * log_softmax(logits))
    averaged over B*T rows), differentiated by autograd. Used only when triton is absent (--tiny on CPU)."""

    @staticmethod
    def apply(logits, target_p, position_mask):
        import torch
        return -torch.sum(position_mask * target_p * torch.log_softmax(logits.float(), dim=2), dim=2).mean()


def run_specforge(plan: dict, emit) -> None:
    import warnings

    import torch

    tiny = plan["tiny"]
    dev = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flash_attn is not found")
        with _triton_stub_if_missing() as stubbed:
            from specforge.algorithms.eagle3 import model as sf_model
            from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
            from specforge.optimizer import BF16Optimizer
    if stubbed:
        sf_model.LogSoftmaxLoss = _TorchSoftCE
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig

    # transformers' model in bf16 whatever the target's stored format: SpecForge's users get MXFP4
    # dequantized to bf16 (its kernels need triton_kernels' MXFP4 ops, which do not train)
    hf = {k: v for k, v in plan["hf"].items() if k != "quantization_config"}
    K, Vd = plan["K"], plan["Vd"]
    dt = torch.float32 if tiny else torch.bfloat16
    d = draft_shape(hf, Vd)
    aux = default_aux_ids(hf["num_hidden_layers"])
    t0 = time.perf_counter()
    torch.manual_seed(plan["seed"])
    conf = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k not in ("model_type",)})
    # gpt-oss's sinks have no SDPA path in transformers: flex_attention on the GPU (its fastest
    # built-in path; flash kernels come from the Hub), eager on CPU smoke runs
    target_attn = "sdpa"
    if hf["model_type"] == "gpt_oss":
        target_attn = "flex_attention" if dev.type == "cuda" else "eager"
    with torch.device(dev):
        target = AutoModelForCausalLM.from_config(conf, dtype=dt, attn_implementation=target_attn).eval()
    # transformers' own init draws the same law, but another sample: the weights specjax's side uses
    fill_hf_target_shared(target, hf, plan["seed"])
    target.requires_grad_(False)
    captured: dict = {}
    for i in aux:  # output of decoder layer i (= HF hidden_states[i+1])
        target.model.layers[i].register_forward_hook(
            lambda m, inp, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))

    dconf = LlamaConfig(hidden_size=d["H"], intermediate_size=d["I"], num_attention_heads=d["heads"],
                        num_key_value_heads=d["kv"], head_dim=d["head_dim"], vocab_size=d["V"],
                        draft_vocab_size=Vd, num_hidden_layers=1, rms_norm_eps=hf["rms_norm_eps"],
                        max_position_embeddings=max(hf["max_position_embeddings"], 262144),
                        rope_theta=hf.get("rope_theta", 10000.0), hidden_act="silu", tie_word_embeddings=False,
                        target_hidden_size=d["H"])
    # flex_attention has no CPU backward (torch 2.13): CPU smoke runs use SpecForge's sdpa path
    attn_backend = "flex_attention" if dev.type == "cuda" else "sdpa"
    with torch.device(dev):
        draft = LlamaForCausalLMEagle3(dconf, attention_backend=attn_backend).to(dt)
    ids, t2d, d2t = vocab_arrays(d["V"], Vd, plan["seed"])
    draft.t2d.copy_(torch.from_numpy(t2d))
    draft.d2t.copy_(torch.from_numpy(d2t))
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    draft.freeze_embedding()
    trainer = sf_model.OnlineEagle3Model(draft, length=K, attention_backend=attn_backend).train()
    head_w = target.lm_head.weight

    def make_opt():
        return BF16Optimizer(draft, lr=plan["lr"], max_grad_norm=0.5, total_steps=100000, warmup_ratio=0.0)

    def step(opt, input_ids, loss_mask):
        """One SpecForge train step on [B,T] int64 ids (unpadded when B=1)."""
        with torch.no_grad():
            captured.clear()
            final = target.model(input_ids=input_ids, use_cache=False).last_hidden_state
            aux_cat = torch.cat([captured[i] for i in aux], dim=-1)
            # inputs shifted left by one as SpecForge's data path does
            # (docs/eagle3-format.md, "TTT training semantics")
            sh_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
            sh_final = torch.cat([final[:, 1:], torch.zeros_like(final[:, :1])], dim=1)
        plosses, _, accs, *_ = trainer(
            input_ids=sh_ids, attention_mask=torch.ones_like(input_ids, dtype=torch.bool), target=None,
            loss_mask=loss_mask[..., None].to(dt), hidden_states=aux_cat,
            target_hidden_for_compact=sh_final, target_head_weight=head_w)
        loss = sum(0.8 ** k * plosses[k] for k in range(len(plosses)))
        loss.backward()
        opt.step()
        return loss.detach(), accs[0]

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run_steps(opt, batches):
        out = []
        for ids_, lm in batches:
            out.append(step(opt, ids_, lm))
        sync()
        return out

    def tt(a):
        return torch.from_numpy(np.asarray(a, np.int64)).to(dev)

    setup_s = time.perf_counter() - t0
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = None
    emit({"event": "setup", "system": "specforge", "triton": triton_v, "target_attention": target_attn,
          "target_experts": getattr(target.config, "_experts_implementation", None), "setup_s": setup_s, "aux_ids": list(aux), "device": str(dev),
          "torch": torch.__version__, "transformers": transformers.__version__, "attention_backend": attn_backend,
          "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None})

    def train_job(batches, warm):
        opt = make_opt()
        t = time.perf_counter()
        run_steps(opt, warm)
        warm_s = time.perf_counter() - t
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        outs = run_steps(opt, batches)
        wall = time.perf_counter() - t
        del opt
        return {"warmup_s": warm_s, "time_s": wall, "step_s": wall / len(batches),
                "losses": [float(l) for l, _ in outs], "acc0": [float(a) for _, a in outs],
                "peak_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else None}

    def try_len(T):
        opt = make_opt()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            b = fixed_batch(1, T, d["V"], 5)
            loss, _ = step(opt, tt(b["input_ids"]), tt(b["loss_mask"]))
            sync()
            return {"loss": float(loss), "peak_bytes": torch.cuda.max_memory_allocated() if dev.type == "cuda" else None}
        finally:
            draft.zero_grad(set_to_none=True)
            del opt
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    t_worker = time.perf_counter() - setup_s
    for job in plan["jobs"]:
        t_job = time.perf_counter()
        if t_job - t_worker > plan.get("soft_budget_s", 1e9):
            emit({"system": "specforge", "job": job["name"], "ok": False, "error": "skipped: worker time budget spent"})
            continue
        try:
            if job["kind"] == "fixed":
                def fixed_run(B, T=job["seq"]):
                    pool = [fixed_batch(B, T, d["V"], 100 + i) for i in range(POOL)]
                    batches = [(tt(pool[i % len(pool)]["input_ids"]), tt(pool[i % len(pool)]["loss_mask"]))
                               for i in range(job["steps"])]
                    wb = fixed_batch(B, T, d["V"], 99)
                    try:
                        return train_job(batches, [(tt(wb["input_ids"]), tt(wb["loss_mask"]))] * job["warmup"])
                    finally:
                        draft.zero_grad(set_to_none=True)
                        if dev.type == "cuda":
                            torch.cuda.empty_cache()
                res = with_halving(job, fixed_run)
            elif job["kind"] == "docs":  # one conversation per step, batch 1, unpadded (SpecForge's usual way)
                B = job["batch"]
                docs = sum(job["rows"][: B * job["steps"]], [])
                seeds = [1000 + i * 1000 + j for i in range(job["steps"])
                         for j in range(sum(len(r) for r in job["rows"][i * B:(i + 1) * B]))]
                batches = [(tt(doc_tokens(n, d["V"], s)[None]), tt(np.ones((1, n)))) for n, s in zip(docs, seeds)]
                warm_docs = sum(job["warm_rows"], [])[:8]
                warm = [(tt(doc_tokens(n, d["V"], 7)[None]), tt(np.ones((1, n)))) for n in warm_docs]
                res = train_job(batches, warm)
                res["n_docs"] = len(docs)
            elif job["kind"] == "maxlen":
                res = maxlen_search(job, try_len)
            else:
                res = {"skipped": f"{job['kind']} is specjax-only"}
            res["ok"] = True
        except Exception as e:
            res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}", "trace": traceback.format_exc()[-3000:]}
            draft.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        res.update(system="specforge", job=job["name"], job_s=time.perf_counter() - t_job)
        emit(res)


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------


def summarise(plan: dict, rows: list[dict], systems=None) -> list[dict]:
    """One line per (job) with each system's tokens/s, MFU and memory, from the workers' rows, keyed by
    the full system label ("specjax", "specforge", "specjax:q_block=512", ...). `systems`: the labels
    asked for (a label with no row shows {"error": "not run"}); default: specjax and specforge plus every
    specjax variant with a row. Ratios: "ratio" (specjax / specforge), and per variant
    "ratio <variant> / specforge" and "ratio <variant> / specjax" where both sides ran."""
    hf = plan["hf"]
    d = draft_shape(hf, plan["Vd"])
    by = {(r.get("system"), r.get("job")): r for r in rows if "job" in r}
    if systems is None:
        variants = sorted({r.get("system") for r in rows if str(r.get("system", "")).startswith("specjax:")})
        systems = ("specjax", "specforge", *variants)
    variants = [s for s in systems if s not in ("specjax", "specforge")]
    out = []
    for job in plan["jobs"]:
        if job["kind"] not in ("fixed", "docs"):
            continue
        line = {"model": plan["model"], "job": job["name"]}
        for sysname in systems:
            r = by.get((sysname, job["name"]))
            if not r or not r.get("ok"):
                line[sysname] = {"error": (r or {}).get("error", "not run")}
                continue
            docs = job_docs(dict(job, batch=r.get("batch", job["batch"])))
            tokens = sum(map(sum, docs))
            flops = sum(step_flops(hf, d, plan["K"], s)["total"] for s in docs)
            L = r["losses"]
            h = POOL if job["kind"] == "fixed" else max(len(L) // 3, 1)
            line[sysname] = {
                "tokens": tokens, "model_tflop": flops / 1e12, "batch": r.get("batch", job["batch"]),
                "tokens_per_s": tokens / r["time_s"], "mfu": flops / r["time_s"] / PEAK_FLOPS,
                "step_s": r["step_s"], "peak_gib": (r.get("peak_bytes") or r.get("plan_bytes") or 0) / 2**30,
                "loss_first": float(np.mean(L[:h])), "loss_last": float(np.mean(L[-h:])),
                "finite": bool(np.all(np.isfinite(L))), "decreasing": float(np.mean(L[-h:])) < float(np.mean(L[:h])),
            }
        a, b = line.get("specjax", {}), line.get("specforge", {})
        if "tokens_per_s" in a and "tokens_per_s" in b:
            line["ratio"] = a["tokens_per_s"] / b["tokens_per_s"]
        for v in variants:  # each variant against SpecForge and the default specjax step, same worker plan
            tps = line[v].get("tokens_per_s")
            if tps is None:
                continue
            if "tokens_per_s" in b:
                line[f"ratio {v} / specforge"] = tps / b["tokens_per_s"]
            if "tokens_per_s" in a:
                line[f"ratio {v} / specjax"] = tps / a["tokens_per_s"]
        out.append(line)
    return out


def summary_text(model: str, line: dict) -> list[str]:
    """The printed table for one summary line: one row per system under its full label, with its
    tokens/s against SpecForge (and, for a variant, against plain specjax) where both ran."""
    def fmt(r):
        if "tokens_per_s" not in r:
            return str(r)[:120]
        return (f"{r['tokens_per_s']:9.0f} tok/s MFU {100 * r['mfu']:5.1f}% {r['peak_gib']:6.1f} GiB "
                f"step {r['step_s']:.4g} s loss {r['loss_first']:.3f}->{r['loss_last']:.3f}")

    out = []
    for label, r in line.items():
        if not isinstance(r, dict) or label in ("model", "job"):
            continue
        ratios = [(k, line[k]) for k in (("ratio",) if label == "specjax" else
                                         (f"ratio {label} / specforge", f"ratio {label} / specjax")) if k in line]
        tail = " | ".join(("specjax / specforge" if k == "ratio" else k[len("ratio "):]) + f" {v:.3f}"
                          for k, v in ratios)
        out.append(f"{model:14s} {line['job']:14s} {label:22s} {fmt(r)}" + (f" | {tail}" if tail else ""))
    return out


def _worker_main(system: str, plan_path: str, out_path: str) -> None:
    if system == "specforge":  # it reads specjax's weight map only: JAX must not take the GPU's memory
        os.environ["JAX_PLATFORMS"] = "cpu"
    with open(plan_path) as f:
        plan = json.load(f)

    def emit(row):
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[{system}] {json.dumps({k: v for k, v in row.items() if k not in ('trace', 'losses', 'acc0', 'tried')})}",
              flush=True)

    _run_system(system, plan, emit)


def _run_system(system: str, plan: dict, emit) -> None:
    if system.startswith("specjax"):
        run_specjax(plan, emit, system)
    elif system == "specforge":
        run_specforge(plan, emit)
    else:
        raise ValueError(f"unknown system {system!r}: specjax[:options] or specforge")


def run_inprocess(plan: dict, systems=("specjax", "specforge")) -> list[dict]:
    rows: list[dict] = []
    for s in systems:
        _run_system(s, plan, rows.append)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run at tiny widths, both systems in-process")
    ap.add_argument("--models", default="llama3_8b",
                    help="comma list: llama3_8b, qwen3_30b_a3b, qwen3_5_35b_a3b, gpt_oss_20b, gpt_oss_120b, smollm2_135m")
    ap.add_argument("--systems", default="specjax,specforge",
                    help="comma list of specjax, specforge and specjax variants: specjax:moe=mgpu, "
                         "specjax:draft=p_eagle (a variant is also compared with plain specjax)")
    ap.add_argument("--tokens-per-step", type=int, default=32768, help="B x T of the fixed batches")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--jobs", default=None, help="comma list of job names to run (default: all), e.g. "
                    "fixed_4096,sharegpt_4096,fixed_2048,maxlen,profile_4096")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only-seq", type=int, default=None)
    ap.add_argument("--no-sharegpt", dest="sharegpt", action="store_false")
    ap.add_argument("--sharegpt-steps", type=int, default=4, help="specjax packed steps (SpecForge gets their documents)")
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--no-maxlen", dest="maxlen", action="store_false")
    ap.add_argument("--maxlen-cap-s", type=float, default=60.0)
    ap.add_argument("--maxlen-start", type=int, default=None,
                    help="the maxlen search's first length (default 16384; --tiny 128); it doubles from there, "
                         "so 65536 tries 131072 second")
    ap.add_argument("--worker-budget-s", type=float, default=1e9,
                    help="per worker: jobs starting after this many seconds are skipped (and reported so)")
    ap.add_argument("--worker-timeout-s", type=float, default=420.0, help="per worker: killed after this")
    ap.add_argument("--specforge-timeout-s", type=float, default=None, help="the SpecForge worker's, if different")
    ap.add_argument("--out", default=None, help="folder for results.json and the worker logs")
    ap.add_argument("--subprocess", action="store_true", help="--tiny with one worker process per system")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker, args.plan, args.rows)
    if args.tiny:  # SpecForge wraps norms/RoPE in torch.compile: eager on CPU smoke runs
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    systems = split_systems(args.systems)
    out_dir = args.out or ("/tmp/train_throughput_tiny" if args.tiny else "train_throughput_out")
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.time()
    results = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "argv": sys.argv,
               "peak_flops": PEAK_FLOPS, "models": {}}
    for model in [m for m in args.models.split(",") if m]:
        plan = build_plan(model, args.tiny, args)
        if args.tiny and not args.subprocess:
            rows = run_inprocess(plan, systems)
        else:
            plan_path = os.path.join(out_dir, f"plan_{model}.json")
            rows_path = os.path.join(out_dir, f"rows_{model}.jsonl")
            with open(plan_path, "w") as f:
                json.dump(plan, f)
            open(rows_path, "w").close()
            env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION="0.95", PYTHONUNBUFFERED="1")
            for s in systems:
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", s, "--plan", plan_path, "--rows", rows_path]
                t = time.time()
                try:
                    subprocess.run(cmd, env=env, check=False, timeout=args.worker_timeout_s if s == "specjax"
                                   else (args.specforge_timeout_s or args.worker_timeout_s))
                except subprocess.TimeoutExpired:
                    with open(rows_path, "a") as f:
                        f.write(json.dumps({"system": s, "event": "timeout", "after_s": time.time() - t}) + "\n")
                print(f"== {model}/{s} worker done in {time.time() - t:.0f} s", flush=True)
            rows = [json.loads(x) for x in open(rows_path) if x.strip()]
        summary = summarise(plan, rows, systems)
        results["models"][model] = {"summary": summary, "rows": rows,
                                    "plan": {k: v for k, v in plan.items() if k != "jobs"},
                                    "jobs": [{k: v for k, v in j.items() if k not in ("rows", "warm_rows")}
                                             for j in plan["jobs"]]}
        for line in summary:
            for text in summary_text(model, line):
                print(text)
    results["elapsed_s"] = time.time() - t_start
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()

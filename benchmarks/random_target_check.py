"""What a random-weight target does to the benchmark's teacher (issue 25, item 3): per layer, how much
of the hidden state is shared by all positions and how the router spreads tokens; at the end, the
target's argmax (the loss counts only rows whose argmax is in the draft vocab) and the teacher entropy.

    # real widths, first 4 layers, CPU (transformers' model in bf16; results/train_throughput.md)
    PYTHONPATH=kernels:. python benchmarks/random_target_check.py --model qwen3_30b_a3b --layers 4 --T 512 --seeds 0,1
    PYTHONPATH=kernels:. python benchmarks/random_target_check.py --model llama3_8b --layers 4 --T 512
    # the first train-step loss of both systems at a reduced MoE shape (shared weights, fp32, CPU)
    PYTHONPATH=kernels:. python benchmarks/random_target_check.py --model qwen3_30b_a3b --first-loss \
        --layers 12 --hidden 256 --moe-inter 96 --heads 4 --kv-heads 1 --T 256 --seeds 0,1,2,3,4

--init transformers keeps transformers' own init (what SpecForge's side used before 2026-12-02);
--init shared fills it from the generator both systems now use (train_throughput.fill_hf_target_shared).
The draft vocabulary is the benchmark's: Vd = 32000 ids drawn with the seed (train_throughput.vocab_arrays).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import train_throughput as tt  # noqa: E402

VD = 32000


def shape(a) -> dict:
    hf = {k: v for k, v in tt.model_hf(a.model, False).items() if k not in ("bos_token_id", "eos_token_id")}
    hf.update(num_hidden_layers=a.layers, max_window_layers=a.layers)
    for key, value in (("hidden_size", a.hidden), ("moe_intermediate_size", a.moe_inter),
                       ("num_attention_heads", a.heads), ("num_key_value_heads", a.kv_heads)):
        if value:
            hf[key] = value
    return hf


def layer_report(a, hf, seed) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(conf, dtype=getattr(torch, a.dtype),
                                                          attn_implementation="sdpa").eval()
    if a.init == "shared":
        tt.fill_hf_target_shared(model, hf, seed)
    parts, routes = {}, {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(lambda m, x, o, i=i: parts.__setitem__(("attn", i), o[0][0].float()))
        layer.mlp.register_forward_hook(lambda m, x, o, i=i: parts.__setitem__(("ffn", i), o[0].float()))
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            layer.mlp.gate.register_forward_hook(lambda m, x, o, i=i: routes.__setitem__(i, o[2].numpy()))
    ids = torch.as_tensor(tt.fixed_batch(1, a.T, hf["vocab_size"], 100)["input_ids"])
    with torch.no_grad():
        out = model.model(input_ids=ids, output_hidden_states=True)

    def rms(x):
        return float(x.pow(2).mean().sqrt())

    for i in range(hf["num_hidden_layers"]):
        h = out.hidden_states[i + 1][0].float()
        hn = h / h.norm(dim=-1, keepdim=True)
        mean_dir = hn.mean(0) / hn.mean(0).norm()
        row = {"seed": seed, "layer": i, "cos_to_mean_direction": round(float((hn @ mean_dir).mean()), 3)}
        for kind in ("attn", "ffn"):
            x = parts[(kind, i)]
            row[f"{kind}_rms"], row[f"{kind}_shared_rms"] = round(rms(x), 3), round(rms(x.mean(0)), 3)
        if i in routes:
            counts = np.bincount(routes[i].reshape(-1), minlength=hf["num_experts"])
            k = hf["num_experts_per_tok"]
            row["experts_used"] = int((counts > 0).sum())
            row[f"top{k}_experts_share"] = round(float(np.sort(counts)[-k:].sum() / counts.sum()), 3)
        print(json.dumps(row), flush=True)
    final = out.last_hidden_state[0].float()
    logits = final @ model.lm_head.weight.detach().float().T
    argmax = logits.argmax(-1).numpy()
    draft_ids, t2d, _ = tt.vocab_arrays(hf["vocab_size"], VD, seed)
    p = torch.softmax(logits[:, torch.as_tensor(draft_ids)], -1)
    _, counts = np.unique(argmax, return_counts=True)
    print(json.dumps({"seed": seed, "final": True, "distinct_argmax": len(counts), "rows": a.T,
                      "top_token_share": round(float(counts.max() / a.T), 3),
                      "argmax_in_draft_vocab": round(float(t2d[argmax].mean()), 3), "Vd_over_V": round(VD / hf["vocab_size"], 3),
                      "logit_std": round(float(logits.std(-1).mean()), 3),
                      "teacher_entropy": round(float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean()), 3),
                      "ln_Vd": round(float(np.log(VD)), 3)}), flush=True)


def first_loss(a, hf, seed) -> None:
    plan = {"model": a.model, "tiny": True, "hf": hf, "K": 7, "Vd": VD, "lr": 1e-4, "seed": seed,
            "jobs": [{"name": f"fixed_{a.T}", "kind": "fixed", "seq": a.T, "batch": 1, "warmup": 0, "steps": 1}]}
    t = time.time()
    rows = tt.run_inprocess(plan)
    out = {r["system"]: round(r["losses"][0], 3) for r in rows if "losses" in r}
    for r in rows:
        if r.get("in_vocab0"):  # specjax's: the share of step-0 rows the loss counts
            out["in_vocab0"] = round(r["in_vocab0"][0], 3)
    print(json.dumps({"seed": seed, "first_loss": out, "s": round(time.time() - t)}), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_30b_a3b", help="llama3_8b or qwen3_30b_a3b (real widths)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=0, help="override the width (0: the model's)")
    ap.add_argument("--moe-inter", type=int, default=0)
    ap.add_argument("--heads", type=int, default=0)
    ap.add_argument("--kv-heads", type=int, default=0)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--dtype", default="bfloat16", help="transformers' model dtype for the layer report")
    ap.add_argument("--init", choices=("transformers", "shared"), default="transformers")
    ap.add_argument("--first-loss", action="store_true", help="run one train step of both systems instead (fp32)")
    a = ap.parse_args(argv)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    hf = shape(a)
    for seed in (int(s) for s in a.seeds.split(",")):
        (first_loss if a.first_loss else layer_report)(a, hf, seed)


if __name__ == "__main__":
    main()

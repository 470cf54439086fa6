"""Run vLLM 0.32's own DFlash 2 pieces on a specjax DFlash 2 export, under the engine venv's python
(tests/engine/test_vllm_dflash2.py calls it):

    $SPECJAX_VLLM_PYTHON tests/engine/vllm_dflash2_pieces.py HEAD_DIR TARGET_DIR IN.npz OUT.npz OUT.json

vLLM 0.32 serves DFlash2DraftModel heads only through its V2 (GPU, Triton) model runner, so the engine
cannot run one on the CPU; this script checks what can be checked without it:
  - the speculators config conversion vLLM applies to the head (transformers_utils/configs/speculators:
    architectures, dflash_config, method and num_speculative_tokens), written to OUT.json;
  - its grouped convolution module (qwen3_dflash2.DFlashGroupedConv, CPU path) built for a block of
    1 + num_speculative_tokens rows, loaded with the head's attention_conv weights of layer 0 through
    its parameter names, run on IN.npz's rows (prepare, then finish on the given sublayer output);
  - its candidate scoring (qwen3_dflash2._score_edges) with the head's codebooks and hidden projection
    on IN.npz's slot states and unary logits, and the greedy walk its speculator runs over them
    (dflash2/speculator.py, _selector_walk_kernel at temperature 0: each step takes the argmax of the
    row of the previous step's pick);
  - what `vllm.LLM` says when asked to serve the head (its refusal message, in OUT.json).
"""
from __future__ import annotations

import json
import os
import socket
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(head: str, target: str, inp: str, out_npz: str, out_json: str) -> None:
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    conf = json.load(open(os.path.join(head, "config.json")))
    pre = SpeculatorsConfig.extract_transformers_pre_trained_config(dict(conf))
    spec = SpeculatorsConfig.extract_vllm_speculative_config(dict(conf))
    facts = {"architectures": pre["architectures"], "dflash_config": pre["dflash_config"], "speculative": spec,
             "input": inp}

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):  # the defaults: only the TP group of one process is needed
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1)
        pieces(head, conf, pre, spec, facts, out_npz)
    try_serving(head, target, spec, facts)
    with open(out_json, "w") as f:
        json.dump(facts, f)


def pieces(head, conf, pre, spec, facts, out_npz):
    import numpy as np
    import torch
    from safetensors.numpy import load_file

    from vllm.model_executor.models import qwen3_dflash2 as m

    w = {k: torch.from_numpy(np.array(v)) for k, v in load_file(os.path.join(head, "model.safetensors")).items()}
    x = np.load(facts.pop("input"))
    dc = pre["dflash_config"]
    hidden = int(conf["transformer_layer_config"]["hidden_size"])
    conv = m.DFlashGroupedConv(hidden_size=hidden, taps=int(dc["conv_kernel_size"]),
                               group_size=int(dc["conv_group_size"]), block_size=1 + int(spec["num_speculative_tokens"]),
                               params_dtype=torch.float32, prefix="layers.0.attention_conv")
    names = sorted(n for n, _ in conv.named_parameters())
    conv.load_state_dict({n: w[f"layers.0.attention_conv.{n}"] for n in names}, strict=True)
    for module in conv.modules():  # what vLLM's loader does after loading (the CPU gemm is set up here)
        if getattr(module, "quant_method", None) is not None:
            module.quant_method.process_weights_after_loading(module)
    with torch.no_grad():
        u, delta = conv.prepare(torch.from_numpy(x["rows"]))
        y = conv.finish(torch.from_numpy(x["sublayer_out"]), delta)
        proj = w["candidate_selector.hidden_projection.weight"]
        cand = torch.from_numpy(x["candidates"].astype(np.int64))  # [1, K, k] the unary top-k ids
        top = torch.from_numpy(x["top_values"])  # [1, K, k] their unary logits
        scores = m._score_edges(w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"],
                                cand, top, torch.from_numpy(x["hidden_n"]) @ proj.T,
                                torch.from_numpy(x["anchor"].astype(np.int64)), cand.shape[-1])
    prev, tokens = 0, []
    for step in range(cand.shape[1]):
        prev = int(torch.argmax(scores[0, step, prev]))
        tokens.append(int(cand[0, step, prev]))
    np.savez(out_npz, conv_in=u.numpy(), conv_out=y.numpy(), tokens=np.asarray(tokens, np.int64))
    facts["conv_parameters"] = names


def try_serving(head, target, spec, facts):
    from vllm import LLM

    try:
        LLM(model=target, dtype="float32", max_model_len=256, enforce_eager=True,
            speculative_config={"method": "dflash", "model": head, "num_speculative_tokens": spec["num_speculative_tokens"]})
        facts["llm"] = "started"
    except Exception as e:  # noqa: BLE001 - the refusal is what is recorded
        facts["llm"] = f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    main(*sys.argv[1:6])

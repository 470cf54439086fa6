"""Load a specjax MTP export with vLLM 0.32's own MTP model class and its own load_weights, under the
engine venv's python (tests/engine/test_vllm_mtp.py calls it):

    $SPECJAX_VLLM_PYTHON tests/engine/vllm_mtp_load.py HEAD_DIR TOKENIZER_DIR OUT.json

What it does, on the CPU: vLLM's ModelConfig of HEAD_DIR with SpeculativeConfig.hf_config_override (the
rewrite vLLM applies to a draft of method "mtp": DeepSeekMTPModel, Glm4MoeMTPModel, Qwen3NextMTP ...),
the model class vLLM's registry picks for it, built under a one-process TP group, then
`model.load_weights` over every tensor of model.safetensors. OUT.json: the architecture and n_predict
after the rewrite, the class, the parameters load_weights reported loaded and those it did not, and
per file tensor whose vLLM parameter holds it unfused (same name after vLLM's own name rewrite, same
shape) whether the loaded values are the file's exactly.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import types

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def vllm_name(model, name: str) -> str:
    """The parameter name vLLM's loader gives a checkpoint tensor, before fusing (its own rewrite)."""
    from vllm.model_executor.models.utils import get_spec_layer_idx_from_weight_name

    if name.startswith("mtp."):
        return "model." + name[len("mtp."):]
    spec = get_spec_layer_idx_from_weight_name(model.config, name)
    return name if spec is None else model._rewrite_spec_layer_name(spec, name)


def main(head: str, tokenizer: str, out_json: str) -> None:
    import torch
    from safetensors.torch import load_file
    from vllm.config import ModelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import get_model_architecture

    mc = ModelConfig(model=head, tokenizer=tokenizer, dtype="float32", hf_overrides=SpeculativeConfig.hf_config_override)
    facts = {"architectures": list(mc.hf_config.architectures), "n_predict": getattr(mc.hf_config, "n_predict", None)}
    vc = VllmConfig(model_config=mc)
    # the draft's own config where the MTP layer reads it (deepseek_mtp: speculative_config.draft_model_config)
    object.__setattr__(vc, "speculative_config", types.SimpleNamespace(
        draft_model_config=mc, enable_adaptive_verification=False, method="mtp", num_speculative_tokens=1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1)
        cls, arch = get_model_architecture(mc)
        model = cls(vllm_config=vc)
        tensors = load_file(os.path.join(head, "model.safetensors"))
        loaded = set(model.load_weights(iter(tensors.items())))
        params = dict(model.named_parameters())
        equal = {}
        for name, t in tensors.items():
            p = params.get(vllm_name(model, name))
            if p is not None and tuple(p.shape) == tuple(t.shape):
                equal[name] = bool(torch.equal(p.detach().float(), t.float()))
    facts.update(cls=cls.__name__, arch=arch, loaded=sorted(loaded), not_loaded=sorted(set(params) - loaded),
                 unfused_equal=equal)
    with open(out_json, "w") as f:
        json.dump(facts, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])

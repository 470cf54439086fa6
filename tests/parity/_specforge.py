"""Drive SpecForge (installed --no-deps) as the independent PyTorch reference for the EAGLE-3 draft.

Import as `parity._specforge` (tests/ is on sys.path through its conftest). Nothing here computes
an expected value itself: it only builds SpecForge objects and moves tensors between jax and torch.
"""
from __future__ import annotations

import importlib.util
import sys
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("specforge")


def draft_class():
    """SpecForge's Llama EAGLE-3 draft model class."""
    with warnings.catch_warnings():  # it warns at import that flash_attn (a GPU backend) is missing
        warnings.filterwarnings("ignore", message="flash_attn is not found")
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    return LlamaForCausalLMEagle3


def _import_with_triton_stub(module_name: str):
    """Import `module_name` while a minimal `triton` stand-in is in sys.modules.

    specforge.core.loss imports triton at module level for its fused soft-CE kernel and decorates
    the kernels with @triton.jit; triton does not exist on CPU machines. The stand-in only has to
    survive those import-time lines (the kernel is replaced by `torch_soft_ce` before any call).
    It is removed right after the import so torch never mistakes it for a real triton; torch's
    dynamo is imported first for the same reason (it probes triton when it first loads).
    """
    if module_name in sys.modules:
        return sys.modules[module_name]
    if importlib.util.find_spec("triton") is not None:
        return __import__(module_name, fromlist=["_"])
    import torch._dynamo  # noqa: F401

    tr = types.ModuleType("triton")
    tl = types.ModuleType("triton.language")
    tr.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
    tr.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    tl.constexpr = object  # used only as a parameter annotation
    tr.language = tl
    sys.modules["triton"], sys.modules["triton.language"] = tr, tl
    try:
        return __import__(module_name, fromlist=["_"])
    finally:
        for name, mod in (("triton", tr), ("triton.language", tl)):
            if sys.modules.get(name) is mod:
                del sys.modules[name]


def eagle3_trainer_module():
    """specforge.algorithms.eagle3.model (holds OnlineEagle3Model and the LogSoftmaxLoss it calls)."""
    return _import_with_triton_stub("specforge.algorithms.eagle3.model")


class TorchSoftCE:
    """Drop-in for specforge.core.loss.LogSoftmaxLoss on CPU: the semantics of its reference
    `_compute_loss`, -sum_v(position_mask * p * log_softmax(logits)) averaged over all B*T rows,
    differentiated by autograd instead of its Triton backward kernel."""

    @staticmethod
    def apply(logits, target_p, position_mask):
        logp = torch.log_softmax(logits.float(), dim=2)
        return -torch.sum(position_mask * target_p * logp, dim=2).mean()


def build_draft(export_config: dict, state_dict: dict, embed_table) -> "torch.nn.Module":
    """A fp32 SpecForge draft built from our exported config.json dict and loaded strictly.

    `norm_output` is forced to True: in SpecForge it means "apply the final norm before lm_head"
    (what specjax trains and engines do), whereas the exported `norm_output: false` carries the
    vLLM/SGLang meaning "feed the pre-norm hidden to the next step"
    (docs/eagle3-format.md, "EAGLE-3.1 flags (fc_norm, norm_output)").
    """
    from transformers import LlamaConfig

    conf = {k: v for k, v in export_config.items() if k not in ("torch_dtype", "dtype")}
    conf["norm_output"] = True
    model = draft_class()(LlamaConfig(**conf), attention_backend="sdpa").to(torch.float32)
    sd = {k: to_torch(v) for k, v in state_dict.items()}
    sd["embed_tokens.weight"] = to_torch(embed_table)  # not exported: engines use the target's
    model.load_state_dict(sd, strict=True)
    return model.eval()


def to_torch(x):
    if isinstance(x, torch.Tensor):
        return x
    a = np.asarray(x)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(a, copy=True))  # copy: torch wants writable memory


def to_numpy(t) -> np.ndarray:
    return t.detach().to(torch.float32).numpy() if t.is_floating_point() else t.detach().numpy()


def causal_mask(draft, batch: int, seq: int, hidden):
    """The additive [B,1,T,T] causal mask SpecForge's sdpa path adds to the block-0 scores."""
    ones = torch.ones((batch, seq), dtype=torch.bool)
    return draft.prepare_decoder_attention_mask(ones, hidden, batch, seq, 0)


def run_draft_steps(draft, aux_cat, step_ids, positions):
    """SpecForge's TTT unroll without the loss: fc once, then per step embed -> backbone (shared
    cache_hidden, positions + step inside) -> compute_logits. Returns per-step logits (numpy)."""
    with torch.no_grad():
        h = draft.project_hidden_states(aux_cat)
        B, T, _ = h.shape
        mask = causal_mask(draft, B, T, h)
        cache = [[], []]
        out = []
        for ids in step_ids:
            emb = draft.embed_input_ids(ids).to(h.dtype)
            h = draft.backbone(input_embeds=emb, hidden_states=h, cache_hidden=cache, attention_mask=mask,
                               position_ids=positions)
            out.append(to_numpy(draft.compute_logits(h)))
    return out


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / max(np.max(np.abs(ref)), 1e-30))

"""The target-side kernel choices of a run, as one hashable value every target config holds.

``KernelChoices.of(cfg.kernels)`` builds it from the run config's ``kernels`` section (the one
place a run does); ``KernelChoices.take_keywords`` turns the keyword names callers of
``load_target`` / ``make_target`` / ``config_from_hf`` pass (``moe_implementation=``,
``attention_q_block=``, ...) into it. A family reads only the fields it has a kernel for: MoE
experts (Qwen3-MoE, Nemotron-H), the SSD scan (Nemotron-H), attention (every target).
"""
from __future__ import annotations

import dataclasses
from typing import Any

# the keyword a loader caller passes -> the KernelChoices field it sets
KEYWORDS = {
    "moe_implementation": "moe",
    "ssd_implementation": "ssd",
    "attention_implementation": "target_attention",
    "attention_q_block": "target_attention_q_block",
    "decode_attention_implementation": "decode_attention",
}


@dataclasses.dataclass(frozen=True)
class KernelChoices:
    """Which implementation each target-side op runs ("auto": the platform's default pick)."""

    moe: str = "auto"  # specjax_kernels.moe: routed experts
    ssd: str = "auto"  # specjax_kernels.ssd: the Mamba-2 scan
    # the training forward's self-attention: "auto", "plain" or a specjax_kernels.ttt_attention
    # implementation (layers/attention.dot_product_attention)
    target_attention: str = "auto"
    # queries in blocks of this many tokens (0 = one block): bounds the [B, N, Tq, T] score buffer
    target_attention_q_block: int = 0
    decode_attention: str = "auto"  # cached decoding's attention (specjax_kernels.decode_attention)

    @classmethod
    def of(cls, section: Any) -> "KernelChoices":
        """From the run config's ``kernels`` section (its ``target_attention_q_block`` 0 keeps the default)."""
        return cls(moe=section.moe, ssd=section.ssd, target_attention=section.target_attention,
                   target_attention_q_block=section.target_attention_q_block or cls.target_attention_q_block,
                   decode_attention=section.decode_attention)

    @classmethod
    def take_keywords(cls, overrides: dict) -> dict:
        """``overrides`` (config_from_hf's keyword arguments) with the loader keywords of :data:`KEYWORDS`
        removed and folded into its ``kernels`` entry (a KernelChoices, the default one if absent)."""
        out = dict(overrides)
        picked = {KEYWORDS[k]: out.pop(k) for k in list(out) if k in KEYWORDS}
        if picked or "kernels" in out:
            base = out.get("kernels") or cls()
            out["kernels"] = dataclasses.replace(base, **{k: v for k, v in picked.items() if v is not None})
        return out

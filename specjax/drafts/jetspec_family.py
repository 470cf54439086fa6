"""The JetSpec family (draft.type jetspec), registered with specjax.drafts.family: DFlash's block
drafter with causal attention inside the block, trained by forward-KL distillation from the target.

Model: specjax.drafts.dflash run with a `dflash.JetSpecConfig`, whose class attribute `causal` makes
slot j of a block attend to its context rows and to block slots 0..j only (DFlash: all S slots);
every other part of the network, the anchors, the context cache and the block proposer are DFlash's.
Slot 0 is the anchor and never drafts (vLLM's DFlash drafter, which serves the head, refuses slot-0
drafting), so one block drafts block_size - 1 tokens.

Objective: fixed, `dflash.dflash_loss` with objective "teacher_kl": per drafted slot the forward KL
KL(p_target || q_draft) over the draft vocab (the target's logits at the predicting position,
restricted to the draft vocab and renormalised there), weighted by the slot's loss mask and the
decay exp(-j/gamma) of the j-th drafted slot, per row divided by its mask count. Train keys:
train.dflash_anchors (blocks per row) and train.dflash_decay_gamma (0 = no decay);
train.dflash_objective is DFlash's and refused here.

Head: the DFlash folder (specjax_converters.dflash_export) with `dflash_config.causal: true`, served
by vLLM 0.32's "dflash" method, which then runs the block causally; read back as a JetSpecConfig.
run_meta.json names it with `draft_family: "jetspec"`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

from specjax.config_fields import DraftSection, ranged
from specjax.drafts import dflash
from specjax.drafts.dflash_family import DFlashFamily, DFlashObjective
from specjax.drafts.family import register

FORWARD_KL = "teacher_kl"  # dflash_loss's objective that is KL(p_target || q_draft) per slot


@dataclass(frozen=True)
class JetSpecSection(DraftSection):
    """draft.* keys of draft.type=jetspec."""
    DOC: ClassVar[str] = ("JetSpec: DFlash's block drafter with causal attention inside the block, trained by "
                          "forward KL.")
    type: str = "jetspec"
    # the token the mask slots read (None: the target's pad_token_id, else its EOS)
    mask_token_id: Optional[int] = ranged(None, ge=0, doc="Token the block's mask slots read; null: the "
                                                          "target's pad_token_id, else its EOS")
    # slots per block (the anchor + block_size-1 drafted slots; vLLM num_speculative_tokens = block_size-1)
    block_size: int = ranged(16, ge=2, doc="Slots per block: the anchor and block_size - 1 drafted slots (vLLM "
                                           "num_speculative_tokens)")

    @property
    def sample_from_anchor(self) -> bool:
        """Not a key: the anchor never drafts (see the module doc); DFlash's shared set-up reads it."""
        return False


def as_jetspec(cfg: dflash.DFlashConfig) -> dflash.JetSpecConfig:
    """The JetSpecConfig with the fields of `cfg`."""
    return dflash.JetSpecConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})


class JetSpecFamily(DFlashFamily):
    """DFlash's family with the JetSpec config class, section, objective and names; owns(),
    recognises_head() and the head reader tell the two apart by the block attention."""
    draft_type = meta_name = "jetspec"
    display_name = export_name = "JetSpec"
    head_name = "JetSpec head (a causal block drafter)"
    section_class = JetSpecSection
    config_class = dflash.JetSpecConfig
    # the objective is fixed (FORWARD_KL): DFlash's train.dflash_objective is not read
    train_keys = ("dflash_anchors", "dflash_decay_gamma")
    objective_note = "its objective is the forward KL to the target, fixed"

    def make_draft_config(self, cfg, target, aux_ids) -> dflash.JetSpecConfig:
        return as_jetspec(super().make_draft_config(cfg, target, aux_ids))

    def config_from_dict(self, d: Mapping) -> dflash.JetSpecConfig:
        return as_jetspec(dflash.config_from_dict(dict(d)))

    def make_objective(self, cfg, draft_cfg) -> DFlashObjective:
        """train.dflash_anchors / dflash_decay_gamma with the forward-KL objective."""
        out = super().make_objective(cfg, draft_cfg)
        loss = dataclasses.replace(out.loss, objective=FORWARD_KL)
        loss.validate(draft_cfg)
        return dataclasses.replace(out, loss=loss)


JETSPEC = register(JetSpecFamily())

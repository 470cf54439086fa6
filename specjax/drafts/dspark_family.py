"""The DSpark family (draft.type dspark), registered with specjax.drafts.family: DFlash's parallel
block backbone with a serial Markov logit-bias head and a per-position confidence head
(specjax.drafts.dspark; speculators 0.9 `DSparkDraftModel`, vLLM 0.32 `Qwen3DSparkModel`).

Set-up is DFlash's (dflash_family: the taps, the mask token, the lm_head started from and frozen at
the target's rows of the draft vocab, the anchors, the context cache); the draft config is a
`dspark.DSparkConfig`, the loss `dspark.dspark_loss` (forward KL on the Markov-corrected logits plus
draft.confidence_alpha x the confidence BCE), decoding `dspark.draft_block` (one backbone pass, then
the Markov chain left to right). With draft.sample_from_anchor (the default, DSpark's convention)
slot 0 drafts too, so one block drafts block_size tokens. draft.markov_head_type picks speculators'
Markov head (vanilla, gated, rnn); vLLM 0.32 builds only the vanilla one, so serve_plan refuses the others.

Head: the folder vLLM 0.32 loads as `Qwen3DSparkModel` (specjax_converters.dspark_export, validated by
specjax_converters.dspark_validate), served with `"method": "dspark"`. vLLM runs that method only in
its V2 model runner (v1/worker/gpu/spec_decode/dspark), which needs Triton: vLLM CPU refuses it
(VLLM_CPU_REASON); serve_cmd says so.
run_meta.json names it with `draft_family: "dspark"`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional


from specjax.config_fields import DraftSection, described, ranged
from specjax.drafts import dspark
from specjax.drafts.dflash_family import DFlashFamily, DFlashObjective, block_loss_fn
from specjax.drafts.family import DraftFamily, ServePlan, register, target_config_for_serving
from specjax_converters.dspark_export import export_dspark
from specjax_converters.dspark_import import read_dspark_head
from specjax_converters.dspark_validate import VLLM_MARKOV_HEAD_TYPE
from specjax_converters.head_formats import format_of
from specjax_converters.target_facts import target_text_config

# why vLLM 0.32 CPU cannot run the method (serve_plan notes it; the engine tier xfails on it)
VLLM_CPU_REASON = ("vLLM 0.32 implements DSpark only in its V2 (GPU) model runner: config/vllm.py:2976-2979 lists "
                   "'dspark speculative decoding' as unsupported by the V1 runner (refused at config/vllm.py:3199-3203, "
                   "'Model Runner V1 does not support: dspark speculative decoding'); the CPU build has no Triton, so "
                   "it runs the V1 runner (config/vllm.py:724-728), and V2 refuses to start without Triton "
                   "(config/vllm.py:3189-3190)")


@dataclass(frozen=True)
class DSparkSection(DraftSection):
    """draft.* keys of draft.type=dspark."""
    DOC: ClassVar[str] = ("DSpark: DFlash's parallel block backbone, a serial low-rank Markov logit bias and a "
                          "per-position confidence head.")
    type: str = "dspark"
    mask_token_id: Optional[int] = ranged(None, ge=0, doc="Token the block's mask slots read; null: the "
                                                          "target's pad_token_id, else its EOS")
    # block_size draft tokens per step with sample_from_anchor, else block_size - 1
    block_size: int = ranged(8, ge=1, doc="Slots per block: the anchor and the mask slots (vLLM "
                                          "num_speculative_tokens with sample_from_anchor)")
    sample_from_anchor: bool = described(True, "Slot 0 (the anchor) drafts too, each slot predicting the token "
                                               "after its own (DSpark's convention)")
    markov_rank: int = ranged(256, ge=1, doc="Rank r of the Markov bias markov_w2 @ markov_w1 (target vocab -> r -> "
                                             "draft vocab)")
    # vanilla: the first-order bias; gated: the bias of a code gated by the slot's hidden state; rnn: a
    # recurrent state over the block's slots (speculators 0.9's MarkovHead); vLLM 0.32 serves vanilla only
    markov_head_type: str = described("vanilla", "Markov head: vanilla, gated or rnn (speculators' "
                                                 "markov_head_type; vLLM 0.32 serves vanilla only)")
    confidence_head: bool = described(True, "Train the per-position acceptance (confidence) head")
    confidence_head_with_markov: bool = described(True, "The confidence head also reads the Markov code of the "
                                                        "previous token")
    confidence_alpha: float = ranged(1.0, ge=0.0, doc="Weight of the confidence head's BCE in the loss "
                                                      "(speculators' confidence_head_alpha)")


class DSparkFamily(DFlashFamily):
    draft_type = meta_name = "dspark"
    display_name = export_name = "DSpark"
    head_name = "DSpark head (a block drafter with a Markov head)"
    section_class = DSparkSection
    draft_module = dspark
    config_class = dspark.DSparkConfig
    train_keys = ("dflash_anchors", "dflash_decay_gamma")
    objective_note = "its objective is the forward KL to the target plus draft.confidence_alpha x the confidence BCE"

    # -- the draft config ----------------------------------------------------------------------
    def make_draft_config(self, cfg, target, aux_ids) -> dspark.DSparkConfig:
        d = cfg.draft
        try:
            return dspark.as_dspark(super().make_draft_config(cfg, target, aux_ids), markov_rank=d.markov_rank,
                                    markov_head_type=d.markov_head_type, enable_confidence_head=d.confidence_head,
                                    confidence_head_with_markov=d.confidence_head and d.confidence_head_with_markov)
        except ValueError as e:
            raise ValueError(f"draft.type={self.draft_type}: {e} (the draft.* key of the same name sets it)") from None

    def owns(self, draft_cfg) -> bool:
        return type(draft_cfg) is dspark.DSparkConfig

    def init_params(self, draft_cfg, key, *, std: float = 0.02, lm_head_rows=None) -> dict:
        return dspark.init_draft_params(draft_cfg, key, std=std, lm_head_rows=lm_head_rows)

    def warm_start(self, folder: str, draft_cfg, vocab, init_params: Mapping) -> dict:
        return DraftFamily.warm_start(self, folder, draft_cfg, vocab, init_params)

    # -- training ------------------------------------------------------------------------------
    def make_objective(self, cfg, draft_cfg) -> DFlashObjective:
        t = cfg.train
        loss = dspark.DSparkLossConfig(objective="teacher_kl", num_anchors=t.dflash_anchors,
                                       loss_decay_gamma=t.dflash_decay_gamma or None,
                                       confidence_alpha=float(cfg.draft.confidence_alpha))
        loss.validate(draft_cfg)
        return DFlashObjective(loss=loss, anchor_seed=cfg.run.seed)

    def loss_fn(self, target, draft_cfg, objective: DFlashObjective, compute_dtype):
        """dspark_loss on one packed batch, anchors as DFlash draws them for its KL objective."""
        return block_loss_fn(target, draft_cfg, objective, compute_dtype, dspark.dspark_loss, anchors_for="teacher_kl",
                             extra_metrics=("kl_loss", "accept_rate", "confidence_loss"))

    # -- the head format -----------------------------------------------------------------------
    def export(self, params, draft_cfg, vocab, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
               extra_manifest: Optional[Mapping] = None, variant: Optional[str] = None) -> str:
        if variant not in (None, self.draft_type):
            raise ValueError(f"--variant {variant!r} is an EAGLE-3 choice; a DSpark run exports as DSpark (drop "
                             "--variant)")
        return export_dspark(params, draft_cfg, target_hf_config, out_dir, dtype=dtype, vocab=vocab,
                             extra_manifest=extra_manifest)

    def recognises_head(self, head_config: Mapping) -> bool:
        return format_of(head_config).name == "dspark"

    def load_head(self, folder: str):
        return read_dspark_head(folder)

    # -- speculative decoding ------------------------------------------------------------------
    def propose_chain(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                      temperature, *, dcfg, k: int, sample: bool):
        return dspark.draft_block(dp, embed, d2t, dcache, pend_aux, pend_count, start, last_tok, key, temperature,
                                  dcfg=dcfg, k=k, sample=sample)

    def vllm_speculative_config(self, draft: str, head_config: Optional[Mapping], num_spec_tokens: int) -> dict:
        """One block drafts what the head was trained to draft (block_size with sample_from_anchor)."""
        return {"method": "dspark", "model": draft, "num_speculative_tokens": trained_draft_tokens(draft, head_config)}

    def serve_plan(self, draft_abs: str, target: str, num_spec_tokens: int) -> ServePlan:
        head = read_dspark_head(draft_abs)  # raises ValueError naming what is wrong
        if head.config.markov_head_type != VLLM_MARKOV_HEAD_TYPE:
            return ServePlan(error=f"error: {draft_abs} is a DSpark head with markov_head_type "
                                   f"{head.config.markov_head_type!r}; vLLM 0.32 builds only the "
                                   f"{VLLM_MARKOV_HEAD_TYPE!r} Markov head (qwen3_dspark.py: markov_w1, markov_w2), "
                                   "so it cannot load this one; train with draft.markov_head_type=vanilla to serve it")
        target_config, _ = target_config_for_serving(target, None)
        if target_config is not None:
            tc = target_text_config(target_config)
            if int(tc.get("hidden_size", head.config.hidden_size)) != head.config.hidden_size:
                return ServePlan(error=f"error: {draft_abs} is a DSpark head for hidden_size {head.config.hidden_size} "
                                       f"but the target has {tc['hidden_size']}; serve it with the target it was "
                                       "trained on")
        n = head.config.num_draft_tokens
        header = (f"# draft  {draft_abs}  (DSpark block drafter, block_size {head.config.block_size}: {n} draft tokens "
                  "per step; --num-spec-tokens does not apply)",)
        notes = {"vllm": ("needs vLLM's V2 model runner (a GPU build with Triton); vLLM CPU cannot serve it: "
                          + VLLM_CPU_REASON,)}
        return ServePlan(header=header, notes=notes, num_spec_tokens=n,
                         not_printed={"sglang": "not printed: specjax prints SGLang commands for EAGLE-3 heads only"})


def trained_draft_tokens(draft: str, head_config: Optional[Mapping]) -> int:
    """The draft tokens per block a DSpark head's config.json records (block_size, - 1 without
    sample_from_anchor)."""
    conf = head_config or {}
    if "block_size" not in conf:
        raise ValueError(f"{os.path.join(os.path.expanduser(draft), 'config.json')}: a DSpark head without "
                         "block_size; add the block size it was trained with")
    return int(conf["block_size"]) - (0 if conf.get("sample_from_anchor", True) else 1)


DSPARK = register(DSparkFamily())

"""The DFlash 2 family (draft.type dflash2), registered with specjax.drafts.family: DFlash's block
drafter with a two-tap dynamic convolution around each draft sublayer and a pairwise path selector
over each drafted slot's top-k tokens (specjax.drafts.dflash2, after speculators 0.9's
DFlash2DraftModel).

Everything DFlash's family does stays (DFlashFamily: taps, mask token, anchors keyed by the step, the
frozen lm_head copied from the target, chain decoding of block_size - 1 tokens); this module changes
the config class, the section (draft.conv_* / draft.selector_*), the objective (fixed: DFlash's
teacher KL of the unary logits + selector_loss_alpha x the selector's k-way cross-entropy), the
decoding step (the selector's walk) and the head format: speculators' DFlash2 layout
(specjax_converters.dflash2_export / dflash2_validate), which vLLM 0.32 serves with method "dflash"
through its V2 (GPU) model runner only. DFlash 2 drafts over the full target vocab:
draft.draft_vocab_size must be the target's vocab size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional


from specjax.config_fields import ConfigError, DraftSection, described, ranged
from specjax.drafts import dflash, dflash2
from specjax.drafts.dflash_family import DFlashFamily, DFlashObjective, block_loss_fn
from specjax.drafts.family import ServePlan, read_head_config, register, target_config_for_serving
from specjax.targets.layers.attention import cache_size_for
from specjax_converters.dflash2_export import export_dflash2, read_dflash2_head
from specjax_converters.head_formats import format_of
from specjax_converters.target_facts import target_text_config
from specjax_converters.warm_start import params_like

# fields a warm start must share with the run (the param shapes, taps and mask token)
FIT_FIELDS = ("hidden_size", "vocab_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "mask_token_id", "aux_layer_ids", "conv_kernel_size", "conv_group_size",
              "selector_rank")


@dataclass(frozen=True)
class DFlash2Section(DraftSection):
    """draft.* keys of draft.type=dflash2."""
    DOC: ClassVar[str] = ("DFlash 2: DFlash's block drafter plus a dynamic convolution around each sublayer and a "
                          "candidate selector over each slot's top-k; needs draft.draft_vocab_size = the target vocab.")
    type: str = "dflash2"
    mask_token_id: Optional[int] = ranged(None, ge=0, doc="Token the block's mask slots read; null: the "
                                                          "target's pad_token_id, else its EOS")
    block_size: int = ranged(16, ge=2, doc="Slots per block: the anchor and block_size - 1 drafted slots (vLLM "
                                           "num_speculative_tokens)")
    sample_from_anchor: bool = described(False, "Train slot 0 (the anchor) to draft too, so a block drafts "
                                                "block_size tokens (specjax.eval only)")
    conv_kernel_size: int = ranged(2, ge=1, doc="Taps of each dynamic convolution (slot s reads slots s, s-1, ...)")
    conv_group_size: int = ranged(16, ge=1, doc="Hidden channels sharing one dynamic delta (must divide the hidden "
                                                "size)")
    selector_rank: int = ranged(256, ge=1, doc="Rank of the selector's codebooks and hidden projection")
    selector_top_k: int = ranged(16, ge=1, doc="Unary candidates per drafted slot the selector rescores")
    selector_loss_alpha: float = ranged(1.0, ge=0.0, doc="Weight of the selector's cross-entropy in the loss "
                                                         "(0: the unary head only)")


class DFlash2Family(DFlashFamily):
    draft_type = meta_name = "dflash2"
    display_name = export_name = "DFlash 2"
    head_name = "DFlash 2 head (a block drafter with a candidate selector)"
    section_class = DFlash2Section
    draft_module = dflash2
    config_class = dflash2.DFlash2Config
    # the objective is fixed (teacher KL + selector CE): train.dflash_objective is DFlash's
    train_keys = ("dflash_anchors", "dflash_decay_gamma")
    objective_note = "its objective is the teacher KL of the unary logits plus draft.selector_loss_alpha x the selector CE"

    def check_config(self, cfg) -> None:
        super().check_config(cfg)
        d = cfg.draft
        if d.conv_kernel_size > d.block_size:
            raise ConfigError(f"`draft.conv_kernel_size` = {d.conv_kernel_size} exceeds `draft.block_size` = "
                              f"{d.block_size}; set draft.conv_kernel_size <= {d.block_size}.")

    def make_draft_config(self, cfg, target, aux_ids) -> dflash2.DFlash2Config:
        d = cfg.draft
        V = int(target.config.vocab_size)
        if int(d.draft_vocab_size) != V:
            raise ValueError(f"draft.type=dflash2: draft.draft_vocab_size={d.draft_vocab_size} but DFlash 2 drafts over "
                             f"the full target vocab ({V} tokens; its selector's codebooks are indexed by target ids). "
                             f"Fix: set draft.draft_vocab_size={V}")
        base = super().make_draft_config(cfg, target, aux_ids)
        out = dflash2.as_dflash2(base, conv_kernel_size=d.conv_kernel_size, conv_group_size=d.conv_group_size,
                                 selector_rank=d.selector_rank, selector_top_k=d.selector_top_k)
        try:
            out.validate()
        except ValueError as e:
            raise ValueError(f"draft.type=dflash2: {e} (the draft.* key of the same name sets it)") from None
        return out

    def init_params(self, draft_cfg, key, *, std: float = 0.02, lm_head_rows=None) -> dict:
        return dflash2.init_draft_params(draft_cfg, key, std=std, lm_head_rows=lm_head_rows)

    def check_init_from(self, folder: str) -> None:
        config = read_head_config(folder)
        if config is None or format_of(config).name != "dflash2":
            raise ValueError(f"draft.init_from={folder}: not a DFlash 2 head (config.json without speculators_model_type "
                             "\"dflash2\"); a draft.type=dflash2 run starts from a DFlash 2 export. Fix: point "
                             "draft.init_from at one, or remove it")

    def warm_start(self, folder: str, draft_cfg, vocab, init_params: Mapping) -> dict:
        head = read_dflash2_head(folder)
        diff = [f for f in FIT_FIELDS if getattr(head.config, f) != getattr(draft_cfg, f)]
        if diff:
            lines = "; ".join(f"{f}: head {getattr(head.config, f)} vs run {getattr(draft_cfg, f)}" for f in diff)
            raise ValueError(f"draft.init_from={folder}: the DFlash 2 head does not fit this run's draft: {lines}. Fix: "
                             "set the draft.* / target.aux_layer_ids keys to the head's values")
        return params_like(folder, head.params, head.vocab, vocab, init_params)

    # -- training ------------------------------------------------------------------------------
    def make_objective(self, cfg, draft_cfg) -> DFlashObjective:
        t = cfg.train
        loss = dflash2.DFlash2LossConfig(num_anchors=t.dflash_anchors, loss_decay_gamma=t.dflash_decay_gamma or None,
                                         selector_loss_alpha=cfg.draft.selector_loss_alpha)
        loss.validate(draft_cfg)
        return DFlashObjective(loss=loss, anchor_seed=cfg.run.seed)

    def loss_fn(self, target, draft_cfg, objective: DFlashObjective, compute_dtype):
        """DFlash 2's loss on one packed batch (full vocabulary: no draft ids)."""
        return block_loss_fn(target, draft_cfg, objective, compute_dtype, dflash2.dflash2_loss, draft_ids=False,
                             extra_metrics=("unary_loss", "selector_loss", "selector_acc", "recall"))

    # -- the head format -----------------------------------------------------------------------
    def export(self, params, draft_cfg, vocab, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
               extra_manifest: Optional[Mapping] = None, variant: Optional[str] = None) -> str:
        if variant not in (None, self.draft_type):
            raise ValueError(f"--variant {variant!r} is an EAGLE-3 choice; a DFlash 2 run exports as DFlash 2 (drop "
                             "--variant)")
        verifier = (extra_manifest or {}).get("target_path")
        return export_dflash2(params, draft_cfg, target_hf_config, out_dir, dtype=dtype, extra_manifest=extra_manifest,
                              verifier=verifier if isinstance(verifier, str) else None)

    def recognises_head(self, head_config: Mapping) -> bool:
        return format_of(head_config).name == "dflash2"

    def load_head(self, folder: str):
        return read_dflash2_head(folder)

    # -- speculative decoding ------------------------------------------------------------------
    def init_decode_cache(self, draft_cfg, max_len: int, dtype):
        return dflash.init_context_cache(draft_cfg, 1, cache_size_for(max_len))

    def propose_chain(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                      temperature, *, dcfg, k: int, sample: bool):
        """The selector's walk over one block (d2t is the identity: a DFlash 2 head has the full vocab)."""
        return dflash2.draft_block(dp, embed, dcache, pend_aux, pend_count, start, last_tok, key, temperature,
                                   dcfg=dcfg, k=k, sample=sample)

    def vllm_speculative_config(self, draft: str, head_config: Optional[Mapping], num_spec_tokens: int) -> dict:
        conf = head_config if head_config is not None else read_head_config(draft) or {}
        drafted = int(conf.get("block_size", 2)) - (0 if conf.get("sample_from_anchor") else 1)
        return {"method": "dflash", "model": draft, "num_speculative_tokens": drafted}

    def serve_plan(self, draft_abs: str, target: str, num_spec_tokens: int) -> ServePlan:
        head = read_dflash2_head(draft_abs)  # raises ValueError naming what is wrong
        target_config, _ = target_config_for_serving(target, None)
        if target_config is not None:
            tc = target_text_config(target_config)
            for key in ("hidden_size", "vocab_size"):
                if tc.get(key) is not None and int(tc[key]) != getattr(head.config, key):
                    return ServePlan(error=f"error: {draft_abs} is a DFlash 2 head for {key} {getattr(head.config, key)} "
                                           f"but the target has {tc[key]}; serve it with the target it was trained on")
        k = head.config.num_draft_tokens
        header = (f"# draft  {draft_abs}  (DFlash 2 block drafter with a candidate selector, block_size "
                  f"{head.config.block_size}: {k} draft tokens per step; --num-spec-tokens does not apply)",)
        note = ("vLLM runs DFlash 2 heads (DFlash2DraftModel) with its V2 model runner only (GPU, Triton): vLLM "
                "0.32 refuses them on the V1 runner and the CPU backend",)
        return ServePlan(header=header, num_spec_tokens=k, notes={"vllm": note},
                         not_printed={"sglang": "not printed: specjax prints SGLang commands for EAGLE-3 heads only"})


DFLASH2 = register(DFlash2Family())

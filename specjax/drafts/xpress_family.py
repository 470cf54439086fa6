"""The XPress family (draft.type xpress), registered with specjax.drafts.family: DFlash's block drafter
plus a causal refiner head whose per-slot logit bias reads each slot's previous token, resolved at
decoding time by num_jacobi_passes parallel passes (specjax.drafts.xpress, after speculators 0.9's
XPressDraftModel).

From DFlash's family it keeps the taps, the mask token, the anchors keyed by the step, the frozen
lm_head (the target's rows of the draft vocab) and chain decoding of block_size - 1 tokens; it
changes the config class, the section (draft.xpress_* and the objective's weights), the objective
(fixed: speculators' teacher-forced + Jacobi-consistency + base-anchor compound ce/tv loss), the
decoding step (the Jacobi passes) and the head format, which follows draft.xpress_slot0_prev (slot
0's previous token; specjax_converters.xpress_export):
  before_anchor (default)  speculators' XPress layout (specjax_converters.xpress_validate), which vLLM
                           0.32 cannot serve (no XPress model) and vLLM 0.34 refuses (no speculators
                           "xpress" type): serve_cmd prints no engine command; specjax.eval decodes it;
  anchor                   vLLM 0.34's own layout (architectures ["Qwen3XPressModel"]), served with
                           `"method": "dflash"` and block_size - 1 speculative tokens by vLLM >= 0.34's
                           V2 model runner (GPU, or x86 CPU with triton-cpu); 0.34 drafts it as
                           specjax.eval does (slot 0 reads the anchor, every pass scored on the whole
                           vocab: xpress_topc 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional


from specjax.config_fields import ConfigError, DraftSection, described, ranged
from specjax.drafts import xpress
from specjax.drafts.dflash_family import DFlashFamily, DFlashObjective, block_loss_fn
from specjax.drafts.family import ServePlan, read_head_config, register, target_config_for_serving
from specjax.targets.layers.attention import cache_size_for
from specjax_converters.head_formats import format_of
from specjax_converters.target_facts import target_text_config
from specjax_converters.warm_start import params_like
from specjax_converters.xpress_export import export_xpress, read_xpress_head
from specjax_converters.xpress_validate import VLLM034_LAYOUT_NAME

FIT_FIELDS = ("hidden_size", "vocab_size", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "mask_token_id", "aux_layer_ids", "block_size", "xpress_rank", "xpress_mlp_ratio")
HEAD_FORMATS = ("xpress", VLLM034_LAYOUT_NAME)  # speculators' layout, vLLM 0.34's (specjax_converters.xpress_export)
NO_ENGINE = ("not printed: vLLM 0.32 has no XPress model (its speculators reader knows no \"xpress\"), and vLLM 0.34 "
             "reads XPress heads in its own layout only (a head trained with draft.xpress_slot0_prev=anchor is "
             "exported in it); decode with specjax.eval")
VLLM034_NOTE = ("needs vLLM >= 0.34 (Qwen3XPressModel; 0.32 has no XPress model), whose V2 model runner drafts XPress "
                "with Triton kernels: a GPU build, or vLLM's x86 CPU build with triton-cpu installed")


@dataclass(frozen=True)
class XPressSection(DraftSection):
    """draft.* keys of draft.type=xpress."""
    DOC: ClassVar[str] = ("XPress: DFlash's block drafter plus a causal refiner head (a logit bias from each slot's "
                          "previous token) resolved by Jacobi passes.")
    type: str = "xpress"
    mask_token_id: Optional[int] = ranged(None, ge=0, doc="Token the block's mask slots read; null: the "
                                                          "target's pad_token_id, else its EOS")
    block_size: int = ranged(16, ge=2, doc="Slots per block: the anchor and block_size - 1 drafted slots")
    sample_from_anchor: bool = described(False, "Train slot 0 (the anchor) to draft too, so a block drafts "
                                                "block_size tokens")
    xpress_rank: int = ranged(256, ge=1, doc="Width r of the refiner (embedding, projections, mixer, MLP)")
    xpress_mlp_ratio: int = ranged(2, ge=1, doc="The refiner MLP's hidden width as a multiple of r")
    num_jacobi_passes: int = ranged(6, ge=0, doc="Refiner passes when drafting (0: plain DFlash drafts)")
    # before_anchor: speculators' convention and export layout; anchor: vLLM 0.34's (it reads the anchor
    # there), exported in 0.34's own layout; needs sample_from_anchor false and the full draft vocab
    xpress_slot0_prev: str = described("before_anchor", "Slot 0's previous token: before_anchor (speculators) or "
                                                        "anchor (vLLM 0.34; exports its layout)")
    consistency_passes: int = ranged(3, ge=0, doc="Jacobi rounds trained per step (each re-reads the previous "
                                                  "round's argmax)")
    consistency_weight: float = ranged(0.3, ge=0.0, doc="Weight of the mean loss of the Jacobi rounds")
    base_anchor_weight: float = ranged(0.6, ge=0.0, doc="Weight of the loss of the backbone's own logits")
    loss_ce_weight: float = ranged(0.1, ge=0.0, doc="Weight of the CE against the target's argmax in each loss term")
    loss_tv_weight: float = ranged(0.9, ge=0.0, doc="Weight of the total variation to the target in each loss term")


class XPressFamily(DFlashFamily):
    draft_type = meta_name = "xpress"
    display_name = export_name = "XPress"
    head_name = "XPress head (a block drafter with a causal refiner)"
    section_class = XPressSection
    draft_module = xpress
    config_class = xpress.XPressConfig
    train_keys = ("dflash_anchors", "dflash_decay_gamma")
    objective_note = "its objective is set by the draft.consistency_* / base_anchor_weight / loss_*_weight keys"

    def check_config(self, cfg) -> None:
        super().check_config(cfg)
        d = cfg.draft
        if d.xpress_slot0_prev not in xpress.SLOT0_PREV:
            raise ConfigError(f"`draft.xpress_slot0_prev` = {d.xpress_slot0_prev!r} must be one of "
                              f"{', '.join(xpress.SLOT0_PREV)}.")
        if d.xpress_slot0_prev == "anchor" and d.sample_from_anchor:
            raise ConfigError("`draft.xpress_slot0_prev` = 'anchor' with `draft.sample_from_anchor` = true: the "
                              "anchor convention is vLLM 0.34's, whose XPress drafter refuses sample_from_anchor. "
                              "Fix: set draft.sample_from_anchor=false.")

    def make_draft_config(self, cfg, target, aux_ids) -> xpress.XPressConfig:
        d = cfg.draft
        out = xpress.as_xpress(super().make_draft_config(cfg, target, aux_ids), xpress_rank=d.xpress_rank,
                               xpress_mlp_ratio=d.xpress_mlp_ratio, num_jacobi_passes=d.num_jacobi_passes,
                               xpress_slot0_prev=d.xpress_slot0_prev)
        try:
            out.validate()
        except ValueError as e:
            raise ValueError(f"draft.type=xpress: {e} (the draft.* key of the same name sets it)") from None
        return out

    def init_params(self, draft_cfg, key, *, std: float = 0.02, lm_head_rows=None) -> dict:
        return xpress.init_draft_params(draft_cfg, key, std=std, lm_head_rows=lm_head_rows)

    def check_init_from(self, folder: str) -> None:
        config = read_head_config(folder)
        if config is None or format_of(config).name not in HEAD_FORMATS:
            raise ValueError(f"draft.init_from={folder}: not an XPress head (config.json with neither "
                             "speculators_model_type \"xpress\" nor architectures [\"Qwen3XPressModel\"]). Fix: "
                             "point draft.init_from at an XPress export")

    def warm_start(self, folder: str, draft_cfg, vocab, init_params: Mapping) -> dict:
        head = self.load_head(folder)
        diff = [f for f in FIT_FIELDS if getattr(head.config, f) != getattr(draft_cfg, f)]
        if diff:
            lines = "; ".join(f"{f}: head {getattr(head.config, f)} vs run {getattr(draft_cfg, f)}" for f in diff)
            raise ValueError(f"draft.init_from={folder}: the XPress head does not fit this run's draft: {lines}. Fix: "
                             "set the draft.* / target.aux_layer_ids keys to the head's values")
        return params_like(folder, head.params, head.vocab, vocab, init_params)

    def make_objective(self, cfg, draft_cfg) -> DFlashObjective:
        t, d = cfg.train, cfg.draft
        loss = xpress.XPressLossConfig(num_anchors=t.dflash_anchors, loss_decay_gamma=t.dflash_decay_gamma or None,
                                       ce_weight=d.loss_ce_weight, tv_weight=d.loss_tv_weight,
                                       consistency_weight=d.consistency_weight,
                                       consistency_passes=d.consistency_passes,
                                       base_anchor_weight=d.base_anchor_weight)
        loss.validate(draft_cfg)
        return DFlashObjective(loss=loss, anchor_seed=cfg.run.seed)

    def loss_fn(self, target, draft_cfg, objective: DFlashObjective, compute_dtype):
        """XPress's loss on one packed batch."""
        return block_loss_fn(target, draft_cfg, objective, compute_dtype, xpress.xpress_loss,
                             extra_metrics=("tf_loss", "consistency_loss", "base_loss", "tf_acc"))

    def export(self, params, draft_cfg, vocab, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
               extra_manifest: Optional[Mapping] = None, variant: Optional[str] = None) -> str:
        """The layout follows draft.xpress_slot0_prev (specjax_converters.xpress_export), not --variant:
        each layout's reader drafts slot 0 one way, so the head goes where it drafts as trained."""
        if variant not in (None, self.draft_type):
            raise ValueError(f"--variant {variant!r} is an EAGLE-3 choice; an XPress run exports as XPress, in the "
                             "layout of its draft.xpress_slot0_prev (before_anchor: speculators', anchor: vLLM "
                             "0.34's) (drop --variant)")
        verifier = (extra_manifest or {}).get("target_path")
        return export_xpress(params, draft_cfg, vocab, target_hf_config, out_dir, dtype=dtype,
                             extra_manifest=extra_manifest, verifier=verifier if isinstance(verifier, str) else None)

    def recognises_head(self, head_config: Mapping) -> bool:
        return format_of(head_config).name in HEAD_FORMATS

    def load_head(self, folder: str):
        return read_xpress_head(folder, xpress.XPressConfig)

    def init_decode_cache(self, draft_cfg, max_len: int, dtype):
        return xpress.init_decode_cache(draft_cfg, cache_size_for(max_len))

    def propose_chain(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                      temperature, *, dcfg, k: int, sample: bool):
        return xpress.draft_block(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                                  temperature, dcfg=dcfg, k=k, sample=sample)

    def vllm_speculative_config(self, draft: str, head_config: Optional[Mapping], num_spec_tokens: int) -> dict:
        """vLLM 0.34's layout: method "dflash" (its Qwen3XPressModel declares XPressSpeculatorConfig, whose
        base method is dflash), and the trained block's xpress_block_size - 1 tokens (0.34's refiner kernel
        takes the block from the query count, so it must be the trained one)."""
        conf = head_config if head_config is not None else read_head_config(draft) or {}
        if format_of(conf).name != VLLM034_LAYOUT_NAME:
            raise ValueError(f"{draft}: an XPress head in speculators' layout has no vLLM speculative config: vLLM "
                             "0.32 has no XPress model and vLLM 0.34 reads XPress heads in its own layout only. Fix: "
                             "decode it with specjax.eval, or train with draft.xpress_slot0_prev=anchor")
        return {"method": "dflash", "model": draft, "num_speculative_tokens": int(conf["xpress_block_size"]) - 1}

    def serve_plan(self, draft_abs: str, target: str, num_spec_tokens: int) -> ServePlan:
        head = self.load_head(draft_abs)  # raises ValueError naming what is wrong
        k = head.config.num_draft_tokens
        header = (f"# draft  {draft_abs}  (XPress block drafter, block_size {head.config.block_size}: {k} draft "
                  f"tokens per step after {head.config.num_jacobi_passes} Jacobi passes; slot 0 reads the "
                  f"{'anchor' if head.config.xpress_slot0_prev == 'anchor' else 'token before the anchor'}"
                  f"{'; --num-spec-tokens does not apply' if head.config.xpress_slot0_prev == 'anchor' else ''})",)
        sglang = "not printed: specjax prints SGLang commands for EAGLE-3 heads only"
        if head.config.xpress_slot0_prev != "anchor":
            return ServePlan(header=header, num_spec_tokens=k, not_printed={"vllm": NO_ENGINE, "sglang": sglang})
        target_config, _ = target_config_for_serving(target, None)
        if target_config is not None:
            tc = target_text_config(target_config)
            for key in ("hidden_size", "vocab_size"):
                if tc.get(key) is not None and int(tc[key]) != getattr(head.config, key):
                    return ServePlan(error=f"error: {draft_abs} is an XPress head for {key} "
                                           f"{getattr(head.config, key)} but the target has {tc[key]}; serve it with "
                                           "the target it was trained on (vLLM 0.34's XPress model needs the "
                                           "target's full vocab)")
        return ServePlan(header=header, num_spec_tokens=k, notes={"vllm": (VLLM034_NOTE,)},
                         not_printed={"sglang": sglang})


XPRESS = register(XPressFamily())

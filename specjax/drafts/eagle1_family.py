"""The EAGLE-1 family (draft.type eagle), registered with specjax.drafts.family: feature regression at
the target's top layer (specjax.drafts.eagle1), served by vLLM as `"method": "eagle"`.

Why `eagle`: it is the name vLLM users give this head (`--speculative-config '{"method": "eagle"}'`,
vllm/model_executor/models/llama_eagle.py), beside "eagle3" for EAGLE-3; EAGLE-2 is not another head
but the same one decoded with a dynamic draft tree, which specjax.eval's tree mode does (see
eagle1.draft_tree), so one type covers both.

The draft reads the target's final hidden state (reads_final_hidden; no intermediate taps) and the
target's embedding and lm_head (decoding_params adds the lm_head for specjax.eval; training reads
both from the target), drafts over the whole target vocab (draft.draft_vocab_size must be the
target's), and trains with eagle1.eagle1_loss: regression weight, token weight and feature noise
are draft.regression_weight / token_weight / feature_noise (the paper's 1.0 / 0.1 / 0.1).
run_meta.json names it with `draft_family: "eagle"`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

import jax
import jax.numpy as jnp

from specjax.config_fields import DraftSection, ranged
from specjax.drafts import eagle1, eagle3_decoding
from specjax.drafts.family import (DraftFamily, ServePlan, check_one_layer_on_final_hidden, register,
                                    target_config_for_serving, target_states)
from specjax_converters.eagle1_export import VARIANT, export_eagle1, read_eagle1_head
from specjax_converters.eagle1_validate import is_eagle1_config
from specjax_converters.head_formats import errors, validate_folder


@dataclass(frozen=True)
class Eagle1Section(DraftSection):
    """draft.* keys of draft.type=eagle."""
    DOC: ClassVar[str] = ("EAGLE-1 / EAGLE-2: one decoder layer regressing the target's next final feature from "
                          "(token, feature); EAGLE-2 is its tree decoding.")
    type: str = "eagle"
    regression_weight: float = ranged(eagle1.PAPER_REGRESSION_WEIGHT, ge=0.0,
                                      doc="Weight of the SmoothL1 loss on the predicted next feature (EAGLE paper: 1.0)")
    # the cross-entropy of the target's lm_head on the predicted feature against the target's distribution
    token_weight: float = ranged(eagle1.PAPER_TOKEN_WEIGHT, ge=0.0,
                                 doc="Weight of the token loss on the predicted feature (EAGLE paper: 0.1)")
    feature_noise: float = ranged(eagle1.PAPER_FEATURE_NOISE, ge=0.0,
                                  doc="Half-width of the uniform noise added to the input features in training "
                                      "(EAGLE paper: 0.1; 0 = none)")


class Eagle1Family(DraftFamily):
    draft_type: ClassVar[str] = "eagle"
    display_name: ClassVar[str] = "EAGLE-1"
    meta_name: ClassVar[str] = "eagle"
    export_name: ClassVar[str] = "EAGLE-1"
    head_name: ClassVar[str] = "EAGLE-1 head (feature regression)"
    section_class: ClassVar[type] = Eagle1Section
    draft_module: ClassVar = eagle1
    config_class: ClassVar[type] = eagle1.Eagle1Config
    train_keys: ClassVar[tuple[str, ...]] = ()
    objective_note: ClassVar[str] = "its objective is draft.regression_weight / token_weight / feature_noise"

    # -- the config ----------------------------------------------------------------------------
    def check_config(self, cfg) -> None:
        check_one_layer_on_final_hidden(cfg, "an EAGLE-1 head (draft.type=eagle)")

    # -- the draft config ----------------------------------------------------------------------
    def default_aux_layer_ids(self, cfg, target) -> tuple[int, ...]:
        return ()

    def make_draft_config(self, cfg, target, aux_ids) -> eagle1.Eagle1Config:
        d = cfg.draft
        V = int(target.config.vocab_size)
        if int(d.draft_vocab_size) != V:
            raise ValueError(f"draft.type=eagle: draft.draft_vocab_size={d.draft_vocab_size}, but an EAGLE-1 head "
                             f"scores the target's whole vocab with the target's lm_head (vLLM's EAGLE-1 head has no "
                             f"draft vocab). Fix: set draft.draft_vocab_size={V}")
        try:
            return eagle1.config_from_target(target.config, intermediate_size=d.intermediate_size,
                                             num_attention_heads=d.num_attention_heads,
                                             num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim)
        except ValueError as e:
            raise ValueError(f"draft.type=eagle: {e}") from None

    def init_params(self, draft_cfg, key, *, std: float = 0.02, lm_head_rows=None) -> dict:
        return eagle1.init_draft_params(draft_cfg, key, std=std)

    # -- training ------------------------------------------------------------------------------
    def make_objective(self, cfg, draft_cfg) -> eagle1.Eagle1Objective:
        d = cfg.draft
        return eagle1.Eagle1Objective(regression_weight=d.regression_weight, token_weight=d.token_weight,
                                      feature_noise=d.feature_noise, noise_seed=cfg.run.seed,
                                      attention_impl=cfg.kernels.ttt_attention, soft_ce_impl=cfg.kernels.soft_ce)

    def loss_fn(self, target, draft_cfg, objective: eagle1.Eagle1Objective, compute_dtype):
        """The loss of one batch; the feature noise of train step `step` is keyed by (run.seed, step)
        (a resumed run draws the same); evaluation (`step` None) adds none."""

        def loss_fn(draft_params, target_params, vocab, batch, step=None):
            final_hidden, _ = target_states(target, target_params, batch, ())
            key = None if step is None else jax.random.fold_in(jax.random.key(objective.noise_seed), step)
            return eagle1.eagle1_loss(
                draft_params, draft_cfg, objective, input_ids=batch["input_ids"], loss_mask=batch["loss_mask"],
                segment_ids=batch["segment_ids"], positions=batch["positions"], final_hidden=final_hidden,
                embed_table=target.embed_table(target_params), lm_head=target.lm_head_weight(target_params),
                noise_key=key, compute_dtype=compute_dtype, logit_softcap=target.logit_softcap)

        return loss_fn

    # -- speculative decoding ------------------------------------------------------------------
    def decode_taps(self, draft_cfg) -> tuple[int, ...]:
        return ()

    def reads_final_hidden(self, draft_cfg) -> bool:
        return True

    def decoding_params(self, draft_cfg, draft_params, target):
        """The draft's params and the target's lm_head [V, H] (`target_lm_head`), which scores f^."""
        return dict(draft_params, target_lm_head=target.lm_head_weight(target.params))

    def check_decoding(self, draft_cfg, *, mode: str, num_spec_tokens: int) -> None:
        pass  # chain (EAGLE-1) and tree (EAGLE-2), any length

    def resolve_draft_dtype(self, draft_dtype: str, target_dtype) -> str:
        if draft_dtype == "auto":
            return "bfloat16" if target_dtype == jnp.bfloat16 else "float32"
        return draft_dtype

    def init_decode_cache(self, draft_cfg, max_len: int, dtype):
        return eagle3_decoding.init_draft_cache(draft_cfg, max_len, dtype)

    def propose_chain(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                      temperature, *, dcfg, k: int, sample: bool):
        return eagle1.draft_chain(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, key, temperature,
                                  dcfg=dcfg, k=k, sample=sample)

    def propose_tree(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, *, dcfg,
                     widths: tuple[int, ...], top_k: int, total: Optional[int] = None):
        return eagle1.draft_tree(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, dcfg=dcfg,
                                 widths=widths, top_k=top_k, total=total)

    # -- the head format -----------------------------------------------------------------------
    def export(self, params, draft_cfg, vocab, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
               extra_manifest: Optional[Mapping] = None, variant: Optional[str] = None) -> str:
        if variant not in (None, VARIANT):
            raise ValueError(f"--variant {variant!r} is an EAGLE-3 choice; an {self.display_name} run exports as "
                             f"{self.display_name} (drop --variant)")
        return export_eagle1(params, draft_cfg, target_hf_config, out_dir, dtype=dtype, extra_manifest=extra_manifest)

    def recognises_head(self, head_config: Mapping) -> bool:
        return is_eagle1_config(head_config)

    def load_head(self, folder: str):
        return read_eagle1_head(folder)

    def vllm_speculative_config(self, draft: str, head_config: Optional[Mapping], num_spec_tokens: int) -> dict:
        return {"method": "eagle", "model": draft, "num_speculative_tokens": int(num_spec_tokens)}

    def serve_plan(self, draft_abs: str, target: str, num_spec_tokens: int) -> ServePlan:
        """The head validated with the EAGLE-1 rules (against the target's config when it can be read); vLLM only."""
        target_config, source = target_config_for_serving(target, None)
        findings, info = validate_folder(draft_abs, target=target_config, check_finite=False)
        errs = errors(findings)
        if errs:
            return ServePlan(error="\n".join([f"error: {draft_abs} fails validation; fix these before serving it:"]
                                             + [f"  {f}" for f in errs]))
        header = (f"# draft  {draft_abs}  ({self.display_name} head, validated"
                  f"{'; target config from ' + source if source else ''}; --num-spec-tokens drafts a chain)",)
        return ServePlan(header=header, num_spec_tokens=num_spec_tokens,
                         not_printed={"sglang": "not printed: specjax prints SGLang commands for EAGLE-3 heads only"})


EAGLE1 = register(Eagle1Family())

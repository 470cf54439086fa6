"""The EAGLE-3 family (EAGLE-3 / EAGLE-3.1: draft.type eagle3) and P-EAGLE (draft.type p_eagle: the
same head with parallel drafting), registered with specjax.drafts.family.

Both build an `eagle3.Eagle3Config` (P-EAGLE's has parallel_drafting and a mask token), train with
`drafts.ttt.ttt_loss` (P-EAGLE's K depths in one forward, rows sampled by COD), and export the same
head format (specjax_converters.eagle3_export: LlamaForCausalLMEagle3; a P-EAGLE head carries
mask_token_id). Their run_meta.json has no `draft_family` (runs written before DFlash existed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

import jax
import jax.numpy as jnp

from specjax.aux_ids import default_aux_layer_ids as engine_default_aux_ids
from specjax.config_fields import DraftSection, described, ranged
from specjax.drafts import eagle3, eagle3_decoding
from specjax.drafts.family import (DEFAULT_META_NAME, DraftFamily, ServePlan, family_for_folder, register,
                                   resolve_mask_token_id, target_config_for_serving, target_states)
from specjax.drafts.ttt import TTTConfig, ttt_loss
from specjax_converters.eagle3_export import export_eagle3
from specjax_converters.eagle3_import import read_head, warm_start_params
from specjax_converters.head_files import read_head_files
from specjax_converters.head_formats import errors, format_of, validate_folder
from specjax_converters.target_facts import is_hybrid_target, target_text_config, target_virtual_depth


@dataclass(frozen=True)
class Eagle3Section(DraftSection):
    """draft.* keys of draft.type=eagle3."""
    DOC: ClassVar[str] = "EAGLE-3 / EAGLE-3.1: K sequential draft steps, trained by training-time test (TTT)."
    type: str = "eagle3"
    ttt_steps: int = ranged(7, ge=1, doc="K: draft steps trained per position (eagle3: sequential TTT steps; "
                                         "p_eagle: parallel depths)")
    step_decay: float = ranged(0.8, gt=0.0, le=1.0, doc="Loss weight of draft step k: step_decay**k")
    # EAGLE-3.1 (needs 2026+ engines): per-aux-chunk RMSNorms before fc; feed norm(h) to the next step
    fc_norm: bool = described(False, "EAGLE-3.1: an RMSNorm on each target tap before the fc layer (needs a "
                                     "2026+ engine)")
    norm_output: bool = described(False, "EAGLE-3.1: the next draft step reads norm(h), not h (needs a 2026+ "
                                         "engine; not for p_eagle)")
    # a [V, H] trainable copy (optimizer state included): V*H*12 bytes in fp32 + Adam, 6.3 GB for Llama-3.1-8B
    train_embedding: bool = described(False, "Train the draft's own copy of the token embedding (started from the "
                                             "target's; exported as embed_tokens.weight)")


@dataclass(frozen=True)
class PEagleSection(Eagle3Section):
    """draft.* keys of draft.type=p_eagle: EAGLE-3's and the mask token."""
    DOC: ClassVar[str] = "P-EAGLE: the EAGLE-3 head drafting all K tokens in one parallel forward."
    type: str = "p_eagle"
    # the token the undrafted positions read (None: the target's pad_token_id, else its EOS)
    mask_token_id: Optional[int] = ranged(None, ge=0, doc="Token the undrafted positions read; null: the "
                                                          "target's pad_token_id, else its EOS")


def draft_embedding(draft_params, target_embedding):
    """The table a head embeds its input tokens with: its own (draft.train_embedding), else the target's."""
    own = draft_params.get("embed_tokens")
    return target_embedding if own is None else own["embedding"]


class Eagle3Family(DraftFamily):
    draft_type: ClassVar[str] = "eagle3"
    display_name: ClassVar[str] = "EAGLE-3"
    meta_name: ClassVar[str] = DEFAULT_META_NAME
    export_name: ClassVar[str] = "EAGLE-3"  # the export's log line: "exported the EAGLE-3 draft"
    head_name: ClassVar[str] = "EAGLE-3 head"
    section_class: ClassVar[type] = Eagle3Section
    draft_module: ClassVar = eagle3
    config_class: ClassVar[type] = eagle3.Eagle3Config
    train_keys: ClassVar[tuple[str, ...]] = ("loss", "lk_kl_scale", "lk_kl_decay", "lk_eta", "long_context_tokens")
    objective_note: ClassVar[str] = "its objective is train.loss"
    parallel_drafting: ClassVar[bool] = False

    # -- the draft config ----------------------------------------------------------------------
    def default_aux_layer_ids(self, cfg, target) -> tuple[int, ...]:
        return tuple(target.default_aux_layer_ids())

    def make_draft_config(self, cfg, target, aux_ids):
        d = cfg.draft
        return eagle3.config_from_target(
            target.config, draft_vocab_size=d.draft_vocab_size, aux_layer_ids=aux_ids,
            intermediate_size=d.intermediate_size, num_attention_heads=d.num_attention_heads,
            num_key_value_heads=d.num_key_value_heads, head_dim=d.head_dim,
            fc_norm=d.fc_norm, norm_output=d.norm_output, num_layers=d.num_layers,
            parallel_drafting=self.parallel_drafting,
            mask_token_id=resolve_mask_token_id(cfg, target) if self.parallel_drafting else None,
            train_embedding=d.train_embedding,
        )

    def owns(self, draft_cfg) -> bool:
        return isinstance(draft_cfg, eagle3.Eagle3Config) and draft_cfg.parallel_drafting == self.parallel_drafting

    def init_params(self, draft_cfg, key, *, std: float = 0.02, lm_head_rows=None, embedding=None) -> dict:
        """Random init; with train_embedding the draft's embedding is `embedding` (the target's table)
        or, without one (abstract shapes), zeros of its shape."""
        params = eagle3.init_draft_params(draft_cfg, key, std=std)
        if draft_cfg.train_embedding:
            shape = (draft_cfg.vocab_size, draft_cfg.hidden_size)
            table = jnp.zeros(shape, jnp.float32) if embedding is None else jnp.asarray(embedding, jnp.float32)
            if table.shape != shape:
                raise ValueError(f"the target's embedding is {table.shape}; the draft's must be {shape}")
            params["embed_tokens"] = {"embedding": table}
        return params

    def initial_embedding(self, target, draft_cfg):
        """draft.train_embedding: the run's draft starts from the target's embedding."""
        if not draft_cfg.train_embedding:
            return None
        table = target.embed_table(target.params)
        return None if isinstance(table, jax.ShapeDtypeStruct) else table

    def param_logical_axes(self, draft_cfg) -> dict:
        axes = eagle3.param_logical_axes(draft_cfg)
        if draft_cfg.train_embedding:
            axes["embed_tokens"] = {"embedding": ("vocab", "embed")}
        return axes

    def check_init_from(self, folder: str) -> None:
        """Another family's head is refused with the draft.type that reads it."""
        other = family_for_folder(folder, default=self)
        if other.meta_name != self.meta_name:
            raise ValueError(f"draft.init_from={folder} is a {other.head_name} but draft.type is "
                             f"{self.draft_type!r}. Fix: set draft.type={other.draft_type} to start from it, or "
                             f"point draft.init_from at an {self.head_name}")

    def warm_start(self, folder: str, draft_cfg, vocab, init_params: Mapping) -> dict:
        """A published EAGLE-3 head (SpecForge / speculators / specjax export)."""
        return warm_start_params(folder, draft_cfg, vocab, init_params)

    # -- training ------------------------------------------------------------------------------
    def make_objective(self, cfg, draft_cfg) -> TTTConfig:
        """draft.ttt_steps / step_decay with the configured kernels (kernels.ttt_attention / soft_ce)
        and objective (train.loss and its LK settings; P-EAGLE's COD sampling keyed by run.seed;
        train.long_context_tokens)."""
        t = cfg.train
        return TTTConfig(ttt_steps=cfg.draft.ttt_steps, step_decay=cfg.draft.step_decay,
                         attention_impl=cfg.kernels.ttt_attention, soft_ce_impl=cfg.kernels.soft_ce,
                         loss=t.loss, kl_scale=t.lk_kl_scale, kl_decay=t.lk_kl_decay, eta=t.lk_eta,
                         cod_ratio=t.cod_ratio, cod_ratio_min=t.cod_ratio_min, cod_seed=cfg.run.seed,
                         long_context_tokens=t.long_context_tokens)

    def cod_key(self, ttt: TTTConfig, step):
        """P-EAGLE's COD sampling key for train step `step`; None: every row is kept (EAGLE-3)."""
        return None

    def loss_fn(self, target, draft_cfg, ttt: TTTConfig, compute_dtype):
        aux_ids = tuple(draft_cfg.aux_layer_ids)

        def loss_fn(draft_params, target_params, vocab, batch, step=None):
            final_hidden, aux = target_states(target, target_params, batch, aux_ids)
            return ttt_loss(
                draft_params, draft_cfg, ttt,
                input_ids=batch["input_ids"], loss_mask=batch["loss_mask"],
                segment_ids=batch["segment_ids"], positions=batch["positions"],
                aux_hidden=aux, final_hidden=final_hidden,
                embed_table=target.embed_table(target_params), lm_head=target.lm_head_weight(target_params),
                draft_ids=vocab["draft_ids"], t2d=vocab["t2d"], d2t=vocab["d2t"],
                compute_dtype=compute_dtype, cod_key=self.cod_key(ttt, step), logit_softcap=target.logit_softcap,
            )

        return loss_fn

    # -- the head format -----------------------------------------------------------------------
    def export(self, params, draft_cfg, vocab, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
               extra_manifest: Optional[Mapping] = None, variant: Optional[str] = None) -> str:
        return export_eagle3(params, draft_cfg, vocab, target_hf_config, out_dir, dtype=dtype,
                             extra_manifest=extra_manifest, variant=variant)

    # -- speculative decoding ------------------------------------------------------------------
    def decode_taps(self, draft_cfg) -> tuple[int, ...]:
        return tuple(draft_cfg.aux_layer_ids)

    def target_hidden_size(self, draft_cfg) -> int:
        return draft_cfg.target_hidden_size

    def check_decoding(self, draft_cfg, *, mode: str, num_spec_tokens: int) -> None:
        pass  # chain and tree, any length

    def resolve_draft_dtype(self, draft_dtype: str, target_dtype) -> str:
        # the target's dtype, as a serving engine runs a head beside a bf16 target
        if draft_dtype == "auto":
            return "bfloat16" if target_dtype == jnp.bfloat16 else "float32"
        return draft_dtype

    def init_decode_cache(self, draft_cfg, max_len: int, dtype):
        return eagle3_decoding.init_draft_cache(draft_cfg, max_len, dtype)

    def propose_chain(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                      temperature, *, dcfg, k: int, sample: bool):
        return eagle3_decoding.draft_chain(dp, draft_embedding(dp, embed), d2t, dcache, pend_tok, pend_aux,
                                           pend_count, start, key, temperature, dcfg=dcfg, k=k, sample=sample)

    def propose_tree(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, *, dcfg,
                     widths: tuple[int, ...], top_k: int, total: Optional[int] = None):
        return eagle3_decoding.draft_tree(dp, draft_embedding(dp, embed), d2t, dcache, pend_tok, pend_aux,
                                          pend_count, start, dcfg=dcfg, widths=widths, top_k=top_k, total=total)

    def recognises_head(self, head_config: Mapping) -> bool:
        return format_of(head_config).name == "eagle3"

    def load_head(self, folder: str):
        return read_head(folder)

    def vllm_speculative_config(self, draft: str, head_config: Optional[Mapping], num_spec_tokens: int) -> dict:
        # method must be explicit: vLLM auto-detects eagle3 only from "eagle3" in the path
        # (docs/eagle3-format.md, "How engines load the weights")
        spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": int(num_spec_tokens)}
        # P-EAGLE: vLLM drafts all K tokens in one forward only when told; its config.json names the mask
        # token (docs/eagle3-format.md, "P-EAGLE (parallel drafting)")
        if (head_config or {}).get("mask_token_id") is not None:
            spec["parallel_drafting"] = True
        return spec

    def serve_plan(self, draft_abs: str, target: str, num_spec_tokens: int) -> ServePlan:
        """The head validated with every EAGLE-3 rule (against the target's config when it can be
        read), and the caveats the validator knows (engine versions, hybrid and looped targets,
        non-default taps)."""
        config, _, manifest, _ = read_head_files(draft_abs)
        target_config, source = target_config_for_serving(target, manifest)
        findings, _ = validate_folder(draft_abs, target=target_config, check_finite=False)
        errs = errors(findings)
        if errs:
            return ServePlan(error="\n".join([f"error: {draft_abs} fails validation; fix these before serving it:"]
                                             + [f"  {f}" for f in errs]))
        notes = caveats(config, target_config)
        if ((manifest or {}).get("draft_config") or {}).get("train_embedding"):
            notes.setdefault("sglang", []).append(
                "UNSUPPORTED: SGLang replaces the head's trained embedding (embed_tokens.weight) by the target's; "
                "vLLM serves it as the draft's own")
        header = [f"# draft  {draft_abs}  (validated{'; target config from ' + source if source else ''})"]
        header += [f"# note: {note}" for note in notes["all"]]
        hybrid = target_config is not None and is_hybrid_target(target_config)
        return ServePlan(header=tuple(header), notes={k: tuple(v) for k, v in notes.items() if k != "all"},
                         num_spec_tokens=num_spec_tokens,
                         sglang_extra=("--disable-radix-cache",) if hybrid else ())


class PEagleFamily(Eagle3Family):
    """P-EAGLE: an EAGLE-3 head drafting its K tokens in one forward (Eagle3Config.parallel_drafting)."""
    draft_type: ClassVar[str] = "p_eagle"
    display_name: ClassVar[str] = "P-EAGLE"
    section_class: ClassVar[type] = PEagleSection
    train_keys: ClassVar[tuple[str, ...]] = Eagle3Family.train_keys + ("cod_ratio", "cod_ratio_min")
    parallel_drafting: ClassVar[bool] = True

    def check_decoding(self, draft_cfg, *, mode: str, num_spec_tokens: int) -> None:
        if mode != "chain":
            raise ValueError("a P-EAGLE head drafts one chain in one forward (parallel drafting); use mode='chain'")

    def propose_chain(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                      temperature, *, dcfg, k: int, sample: bool):
        return eagle3_decoding.draft_parallel(dp, draft_embedding(dp, embed), d2t, dcache, pend_tok, pend_aux,
                                              pend_count, start, key, temperature, dcfg=dcfg, k=k, sample=sample)

    def cod_key(self, ttt: TTTConfig, step):
        """The COD sampling key of train step `step` (a function of the step, so a resumed run samples
        the same rows); evaluation (`step` None) uses step 0's."""
        return jax.random.fold_in(jax.random.key(ttt.cod_seed), 0 if step is None else step)


# target model_type -> why vLLM cannot serve an EAGLE-3 draft for it (read in vLLM 0.32's source: the
# target class must implement SupportsEagle3, which exports the aux hidden states)
VLLM_NO_EAGLE3 = {
    "gemma3_text": ("vLLM 0.32's Gemma3ForCausalLM (model_executor/models/gemma3.py) does not implement "
                    "SupportsEagle3, so it stops with \"Model does not support EAGLE3 interface\"; Gemma 4 does"),
}


def caveats(draft_config: dict, target_config: Optional[dict]) -> dict[str, list[str]]:
    """Engine -> notes for serving an EAGLE-3 head (the first word "UNSUPPORTED" marks a pair that will
    not work upstream); "all" holds the notes for every engine."""
    out: dict[str, list[str]] = {"vllm": [], "sglang": [], "all": []}
    if draft_config.get("fc_norm") or draft_config.get("norm_output"):
        out["all"].append("EAGLE-3.1 head (fc_norm/norm_output): needs 2026+ vLLM/SGLang that read these flags; "
                          "older engines ignore them and run a different function.")
        if draft_config.get("fc_norm"):
            out["sglang"].append("a published fc_norm head measured acceptance ~1.5 on SGLang vs 3.19 on vLLM "
                                 "(Nemotron 3.5 card): measure acceptance before relying on SGLang.")
    if target_config is None:
        out["all"].append("target config not readable here: target-specific caveats were not checked.")
        return out
    tc = target_text_config(target_config)
    if tc.get("model_type") in VLLM_NO_EAGLE3:
        out["vllm"].append(f"UNSUPPORTED: {VLLM_NO_EAGLE3[tc['model_type']]}.")
    if is_hybrid_target(target_config):
        mt = tc.get("model_type", "hybrid")
        out["sglang"].append(f"UNSUPPORTED: upstream SGLang has no EAGLE-3 aux-state capture for {mt} "
                             "(ModelOpt PR #1568; the Nemotron card needed a patched SGLang plus "
                             "--disable-radix-cache).")
        out["vllm"].append(f"{mt} needs a vLLM whose target class implements SupportsEagle3 (NemotronH: PR #43130); "
                           "the draft's num_key_value_heads must equal the target's (checked).")
    loops = int(tc.get("num_loops") or 1)
    if loops > 1:
        depth = target_virtual_depth(target_config)
        note = (f"looped target ({tc['num_hidden_layers']} layers, {loops} loops = virtual depth {depth}): the engine "
                "must capture the aux states at virtual-depth ids "
                f"{draft_config.get('eagle_aux_hidden_state_layer_ids')} "
                f"(input convention) and place the draft's layer after depth {depth} (config target_layer_count). "
                "Upstream engines index physical layers: this needs an engine-side tap definition "
                "(e.g. a vLLM plugin as in the Nanbeige4.2 card).")
        out["vllm"].append(note)
        out["sglang"].append(note)
    nested = (draft_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested and (tuple(int(i) for i in nested)
                   != engine_default_aux_ids(target_virtual_depth(target_config), clamp=False)):
        out["all"].append(f"non-default aux taps {nested} (output convention): vLLM and SGLang read them from "
                          "config.json; tpu-inference ignores them (hard-coded (2, L//2, L-3)).")
    return out


EAGLE3 = register(Eagle3Family())
P_EAGLE = register(PEagleFamily())

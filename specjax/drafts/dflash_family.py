"""The DFlash family (draft.type dflash: a block drafter, specjax.drafts.dflash), registered with
specjax.drafts.family.

Its draft reads one target tap per draft layer, starts its lm_head from the target's rows of the draft
vocab and keeps it frozen, trains on anchored blocks (`dflash.dflash_loss`, objective train.dflash_*),
and exports the folder vLLM serves with `"method": "dflash"` (specjax_converters.dflash_export),
drafting block_size - 1 tokens per step. run_meta.json names it with `draft_family: "dflash"`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

import jax
import jax.numpy as jnp

from specjax.config_fields import ConfigError, DraftSection, described, ranged
from specjax.drafts import dflash, dflash_decoding
from specjax.targets.layers.attention import cache_size_for
from specjax.drafts.family import (DraftFamily, ServePlan, read_head_config, register, resolve_mask_token_id,
                                   target_config_for_serving, target_states)
from specjax_converters.dflash_export import export_dflash
from specjax_converters.dflash_import import read_dflash_head, warm_start_dflash_params
from specjax_converters.dflash_validate import block_attention_causal
from specjax_converters.head_formats import format_of
from specjax_converters.target_facts import target_text_config


@dataclass(frozen=True)
class DFlashSection(DraftSection):
    """draft.* keys of draft.type=dflash."""
    DOC: ClassVar[str] = "DFlash: a block drafter, block_size - 1 tokens from one forward over a masked block."
    type: str = "dflash"
    # the token the mask slots read (None: the target's pad_token_id, else its EOS)
    mask_token_id: Optional[int] = ranged(None, ge=0, doc="Token the block's mask slots read; null: the "
                                                          "target's pad_token_id, else its EOS")
    # slots per block (the anchor + block_size-1 mask slots; vLLM num_speculative_tokens = block_size-1),
    # and whether slot 0 (the anchor) is trained to draft too
    block_size: int = ranged(16, ge=2, doc="Slots per block: the anchor and block_size - 1 drafted slots (vLLM "
                                           "num_speculative_tokens)")
    sample_from_anchor: bool = described(False, "Train slot 0 (the anchor) to draft too, so a block drafts "
                                                "block_size tokens; not with token_ce")


@dataclass(frozen=True)
class DFlashObjective:
    """What a DFlash loss reads besides the draft config."""
    loss: dflash.DFlashLossConfig
    anchor_seed: int  # run.seed


def anchor_key(objective: DFlashObjective, step):
    """DFlash's anchor draw for train step `step` (a function of the step: a resumed run draws the
    same blocks); evaluation (`step` None) uses step 0's."""
    return jax.random.fold_in(jax.random.key(objective.anchor_seed), 0 if step is None else step)


def block_loss_fn(target, draft_cfg, objective: DFlashObjective, compute_dtype, block_loss, *,
                  extra_metrics: tuple = (), anchors_for: str | None = None, draft_ids: bool = True):
    """`loss_fn` of a family on DFlash's block backbone: anchors drawn from the loss-masked rows
    (anchor_key; `anchors_for`: the objective they are drawn for, default the loss config's), the
    target's taps at draft_cfg.aux_layer_ids, and `block_loss(params, draft_cfg, loss_cfg, **batch
    arrays)` -> (loss, metrics). The lm_head stays the target's copy (a constant to the optimizer, as
    in the references); `draft_ids`: pass the draft vocabulary (False: a full-vocab method); the loop
    gets the block metrics plus those of `extra_metrics` the loss returns."""
    tap_ids = tuple(draft_cfg.aux_layer_ids)
    loss_cfg = objective.loss

    def loss_fn(draft_params, target_params, vocab, batch, step=None):
        final_hidden, aux = target_states(target, target_params, batch, tap_ids)
        candidates = dflash.anchor_candidates(batch["loss_mask"], draft_cfg.block_size,
                                              anchors_for or loss_cfg.objective)
        anchors, valid = dflash.select_anchors(anchor_key(objective, step), candidates, loss_cfg.num_anchors)
        params = dict(draft_params, lm_head=jax.lax.stop_gradient(draft_params["lm_head"]))
        vocab_kw = {"draft_ids": vocab["draft_ids"]} if draft_ids else {}
        loss, m = block_loss(
            params, draft_cfg, loss_cfg, anchors=anchors, anchor_valid=valid,
            input_ids=batch["input_ids"], loss_mask=batch["loss_mask"], segment_ids=batch["segment_ids"],
            positions=batch["positions"], aux_hidden=aux, embed_table=target.embed_table(target_params),
            final_hidden=final_hidden, lm_head=target.lm_head_weight(target_params), compute_dtype=compute_dtype,
            logit_softcap=target.logit_softcap, **vocab_kw)
        first = draft_cfg.first_trained_slot
        # the loop's columns: acc_k / slot_tokens_k become acc_0.. (draft token 0 = the first drafted slot)
        metrics = {"loss": loss, "acc_k": m["acc_pos"][first:], "slot_tokens_k": m["total_pos"][first:],
                   "acc": m["acc"], "accept_len": m["accept_len"], "num_blocks": m["num_blocks"],
                   **{k: m[k] for k in extra_metrics if k in m}}
        return loss, metrics

    return loss_fn


def lm_head_rows(target, vocab):
    """The target's lm_head rows of the draft vocab (draft order, fp32 on the host): a DFlash head's
    initial lm_head. None without a vocab or with abstract target params."""
    if vocab is None:
        return None
    head = target.lm_head_weight(target.params)
    if isinstance(head, jax.ShapeDtypeStruct):
        return None
    return jnp.take(jnp.asarray(head, jnp.float32), jnp.asarray(vocab.draft_ids, jnp.int32), axis=0)


class DFlashFamily(DraftFamily):
    draft_type: ClassVar[str] = "dflash"
    display_name: ClassVar[str] = "DFlash"
    meta_name: ClassVar[str] = "dflash"
    export_name: ClassVar[str] = "DFlash"  # the export's log line: "exported the DFlash draft"
    head_name: ClassVar[str] = "DFlash head (a block drafter)"
    section_class: ClassVar[type] = DFlashSection
    draft_module: ClassVar = dflash
    config_class: ClassVar[type] = dflash.DFlashConfig
    train_keys: ClassVar[tuple[str, ...]] = ("dflash_objective", "dflash_anchors", "dflash_decay_gamma")
    objective_note: ClassVar[str] = "its objective is train.dflash_objective"

    # -- the config ----------------------------------------------------------------------------
    def check_config(self, cfg) -> None:
        d = cfg.draft
        if d.sample_from_anchor and cfg.train.dflash_objective == "token_ce":
            raise ConfigError("`draft.sample_from_anchor` = true with `train.dflash_objective` = 'token_ce': the "
                              "token CE objective (SpecForge) never trains slot 0; use train.dflash_objective=teacher_kl "
                              "or draft.sample_from_anchor=false.")
        de = cfg.decode_eval
        drafted = d.block_size - (0 if d.sample_from_anchor else 1)
        if (de.every_steps or de.at_end) and de.backend == "jax" and de.num_spec_tokens > drafted:
            raise ConfigError(f"`decode_eval.num_spec_tokens` = {de.num_spec_tokens} exceeds the {drafted} tokens one "
                              f"{self.display_name} block drafts (draft.block_size={d.block_size}); set "
                              f"decode_eval.num_spec_tokens <= {drafted}.")

    # -- the draft config ----------------------------------------------------------------------
    def default_aux_layer_ids(self, cfg, target) -> tuple[int, ...]:
        """One tap per draft layer, spread over the target (dflash.spread_aux_layer_ids)."""
        ids = dflash.spread_aux_layer_ids(target.num_layers, cfg.draft.num_layers)
        if len(set(ids)) != len(ids):
            raise ValueError(f"draft.type={self.draft_type}: the default taps {list(ids)} for {cfg.draft.num_layers} draft layers "
                             f"of a {target.num_layers}-layer target repeat a layer; set target.aux_layer_ids.")
        return tuple(ids)

    def make_draft_config(self, cfg, target, aux_ids) -> dflash.DFlashConfig:
        """The draft's width, norms and RoPE are the target's; heads / head_dim / MLP width default to
        the target's too. A config problem is reported with the draft.* key to change."""
        d, t = cfg.draft, target.config
        base = dflash.config_from_target(
            t, draft_vocab_size=d.draft_vocab_size, mask_token_id=resolve_mask_token_id(cfg, target),
            num_layers=d.num_layers, block_size=d.block_size, aux_layer_ids=aux_ids,
            intermediate_size=d.intermediate_size, sample_from_anchor=d.sample_from_anchor)
        overrides = {k: v for k, v in (("num_attention_heads", d.num_attention_heads),
                                       ("num_key_value_heads", d.num_key_value_heads), ("head_dim", d.head_dim))
                     if v is not None}
        out = dataclasses.replace(base, **overrides) if overrides else base
        try:
            out.validate()
        except ValueError as e:
            raise ValueError(f"draft.type={self.draft_type}: {e} (the draft.* key of the same name sets it)") from None
        return out

    def owns(self, draft_cfg) -> bool:
        """A draft config of exactly the family's class: a subclass (JetSpec's causal block, DSpark's
        Markov and confidence heads, DFlash 2's convolutions and selector, XPress's refiner) is its own
        family's."""
        return type(draft_cfg) is self.config_class

    def init_params(self, draft_cfg, key, *, std: float = 0.02, lm_head_rows=None) -> dict:
        """Random init; the lm_head starts as `lm_head_rows` (the target's rows of the draft vocab)
        when given, as both DFlash references start it."""
        return dflash.init_draft_params(draft_cfg, key, std=std, lm_head_rows=lm_head_rows)

    def initial_lm_head_rows(self, target, vocab):
        return lm_head_rows(target, vocab)

    def warm_start(self, folder: str, draft_cfg, vocab, init_params: Mapping) -> dict:
        """A specjax DFlash export (another family's head is refused by dflash_import)."""
        return warm_start_dflash_params(folder, draft_cfg, vocab, init_params)

    # -- training ------------------------------------------------------------------------------
    def make_objective(self, cfg, draft_cfg) -> DFlashObjective:
        """train.dflash_* as DFlash's loss config (checked against the draft config), anchors keyed by run.seed."""
        t = cfg.train
        loss = dflash.DFlashLossConfig(objective=t.dflash_objective, num_anchors=t.dflash_anchors,
                                       loss_decay_gamma=t.dflash_decay_gamma or None)
        loss.validate(draft_cfg)
        return DFlashObjective(loss=loss, anchor_seed=cfg.run.seed)

    def loss_fn(self, target, draft_cfg, objective: DFlashObjective, compute_dtype):
        """DFlash's loss on one packed batch (block_loss_fn)."""
        return block_loss_fn(target, draft_cfg, objective, compute_dtype, dflash.dflash_loss)

    def frozen_leaves_kept(self, draft_cfg, updates):
        """The lm_head gets no update (not even weight decay): both references keep the target's copy."""
        return dict(updates, lm_head=jax.tree_util.tree_map(jnp.zeros_like, updates["lm_head"]))

    # -- the head format -----------------------------------------------------------------------
    def export(self, params, draft_cfg, vocab, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
               extra_manifest: Optional[Mapping] = None, variant: Optional[str] = None) -> str:
        if variant not in (None, self.draft_type):
            raise ValueError(f"--variant {variant!r} is an EAGLE-3 choice; a {self.display_name} run exports as "
                             f"{self.display_name} (drop --variant)")
        return export_dflash(params, draft_cfg, target_hf_config, out_dir, dtype=dtype, vocab=vocab,
                             extra_manifest=extra_manifest, variant=self.draft_type)

    def recognises_head(self, head_config: Mapping) -> bool:
        """A DFlash-format head whose block attends as the family's config class does."""
        return (format_of(head_config).name == "dflash"
                and block_attention_causal(head_config) == self.config_class.causal)

    # -- speculative decoding ------------------------------------------------------------------
    def decode_taps(self, draft_cfg) -> tuple[int, ...]:
        return tuple(draft_cfg.aux_layer_ids)

    def check_decoding(self, draft_cfg, *, mode: str, num_spec_tokens: int) -> None:
        if mode != "chain":
            raise ValueError(f"a {self.display_name} head drafts one block (a chain) per step; use mode='chain'")
        if int(num_spec_tokens) > draft_cfg.num_draft_tokens:
            raise ValueError(f"num_spec_tokens={num_spec_tokens} exceeds the {draft_cfg.num_draft_tokens} tokens one "
                             f"block of this {self.display_name} head drafts (block_size={draft_cfg.block_size}); use "
                             f"num_spec_tokens <= {draft_cfg.num_draft_tokens}")

    def resolve_draft_dtype(self, draft_dtype: str, target_dtype) -> str:
        if draft_dtype not in ("auto", "float32"):
            raise ValueError(f"draft_dtype={draft_dtype!r}: a {self.display_name} head drafts in float32 here; use "
                             "draft_dtype='float32'")
        return "float32"

    def init_decode_cache(self, draft_cfg, max_len: int, dtype):
        # one context row per position instead of draft rows
        return dflash.init_context_cache(draft_cfg, 1, cache_size_for(max_len))

    def propose_chain(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                      temperature, *, dcfg, k: int, sample: bool):
        return dflash_decoding.draft_block(dp, embed, d2t, dcache, pend_aux, pend_count, start, last_tok, key,
                                           temperature, dcfg=dcfg, k=k, sample=sample)

    def load_head(self, folder: str):
        return read_dflash_head(folder)

    def vllm_speculative_config(self, draft: str, head_config: Optional[Mapping], num_spec_tokens: int) -> dict:
        """One block drafts block_size - 1 tokens, which is what the head was trained for
        (docs/eagle3-format.md, "DFlash (block drafting)"); `num_spec_tokens` does not apply."""
        return {"method": "dflash", "model": draft, "num_speculative_tokens": trained_block_size(draft, head_config) - 1}

    def serve_plan(self, draft_abs: str, target: str, num_spec_tokens: int) -> ServePlan:
        """The head read back completely (config and every weight's shape: the EAGLE-3 rules do not
        apply), its width checked against a local target; vLLM only."""
        trained_block_size(draft_abs, read_head_config(draft_abs))
        head = read_dflash_head(draft_abs)  # raises ValueError naming what is wrong
        target_config, _ = target_config_for_serving(target, None)
        if target_config is not None:
            tc = target_text_config(target_config)
            if int(tc.get("hidden_size", head.config.hidden_size)) != head.config.hidden_size:
                return ServePlan(error=f"error: {draft_abs} is a {self.display_name} head for hidden_size {head.config.hidden_size} "
                                       f"but the target has {tc['hidden_size']}; serve it with the target it was "
                                       "trained on")
        block = head.config.block_size
        header = (f"# draft  {draft_abs}  ({self.display_name} block drafter, block_size {block}: {block - 1} draft tokens per "
                  "step; --num-spec-tokens does not apply)",)
        return ServePlan(header=header, num_spec_tokens=block - 1,
                         not_printed={"sglang": "not printed: specjax prints SGLang commands for EAGLE-3 heads only"})


def trained_block_size(draft: str, head_config: Optional[Mapping]) -> int:
    """The block_size a DFlash head's config.json records (vLLM does not need it; serving and decoding do)."""
    if "block_size" not in (head_config or {}):
        path = os.path.join(os.path.expanduser(draft), "config.json")
        raise ValueError(f"{path}: a DFlash head without block_size; add the block size it was trained with")
    return int(head_config["block_size"])


DFLASH = register(DFlashFamily())

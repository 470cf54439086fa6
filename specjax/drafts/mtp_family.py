"""The MTP family (draft.type mtp), registered with specjax.drafts.family: the target's own
multi-token-prediction layer (specjax.drafts.mtp) fine-tuned as the draft, served by vLLM's native
`"method": "mtp"`.

Initial weights: the MTP tensors of the target checkpoint (target.path; model.layers.{L}.* for
DeepSeek-V3 / GLM-4.5, mtp.* for Qwen3-Next / Qwen3.5), read by their checkpoint names; a checkpoint
without them starts from the target layers' init (normal(0, draft.init_std), identity norms), which
the log says. draft.init_from starts from an earlier MTP export instead.

Export (one folder vLLM loads as the draft `model` of method "mtp"):
  model.safetensors      the layer's tensors under the checkpoint's own names (no embedding, no
                         lm_head: vLLM 0.32 shares both with the target for every MTP draft,
                         llm_base_proposer._maybe_share_embeddings / _maybe_share_lm_head)
  config.json            the target's config.json with the MTP layer count set to 1
                         (num_nextn_predict_layers; Qwen3.5: mtp_num_hidden_layers), which vLLM's
                         SpeculativeConfig turns into DeepSeekMTPModel / Glm4MoeMTPModel /
                         Qwen3NextMTP / Qwen3_5(Moe)MTP
  specjax_manifest.json  the manifest every specjax export writes
The same tensors stitched into a copy of the target checkpoint (speculators' `stitch-mtp`) serve the
target with `{"method": "mtp"}` and no draft model.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import ClassVar, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config_fields import DraftSection, ranged
from specjax.drafts import mtp
from specjax.drafts.family import DraftFamily, ServePlan, check_one_layer_on_final_hidden, register, target_states
from specjax_converters.head_files import (CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE, HeadTensors, export_dtype,
                                           manifest_extra, numpy_dtype, read_head_files, write_head_folder)
from specjax_converters.head_formats import written_head_check
from specjax_converters.head_rules import ExportValidationError, errors
from specjax_converters.mtp_validate import check_mtp_head, is_mtp_config

log = logging.getLogger("specjax")

FORMAT, VARIANT = "specjax-mtp", "mtp"


class MtpHead(NamedTuple):
    params: dict  # numpy fp32 leaves, the tree of specjax.drafts.mtp.init_params
    config: mtp.MtpConfig
    vocab: object  # the identity DraftVocab over the target vocab


@dataclass(frozen=True)
class MtpSection(DraftSection):
    """draft.* keys of draft.type=mtp."""
    DOC: ClassVar[str] = ("MTP: the target's own multi-token-prediction layer (DeepSeek-V3, GLM-4.5, Qwen3-Next, "
                          "Qwen3.5) fine-tuned as the draft; vLLM's native mtp method serves it.")
    type: str = "mtp"
    # speculators' num_speculative_steps: step k (0-based) reads step k-1's state and predicts the token k+2 ahead
    mtp_train_steps: int = ranged(mtp.SPECULATORS_NUM_STEPS, ge=1,
                                  doc="Teacher-forced steps of the one MTP layer per training row (speculators' 3)")
    step_weight_beta: float = ranged(mtp.SPECULATORS_STEP_WEIGHT_BETA, gt=0.0,
                                     doc="Step k's loss weight is beta^k, normalised over the steps (FastMTP, "
                                         "speculators' default 0.6)")


def mtp_hf_config(target_hf_config: Mapping) -> dict:
    """The export's config.json: the target's with one MTP layer declared (both spellings vLLM reads)."""
    conf = dict(target_hf_config)
    conf["num_nextn_predict_layers"] = 1
    if str((conf.get("architectures") or [""])[0]).startswith("Qwen3_5"):
        conf["mtp_num_hidden_layers"] = 1
    return conf


def read_mtp_tensors(folder: str, cfg: mtp.MtpConfig) -> Optional[dict]:
    """The MTP layer's params from a checkpoint folder's safetensors; None when it has none of them
    (ValueError naming the missing ones when it has only some)."""
    from safetensors import safe_open

    from specjax.targets.loading import checkpoint_files

    files = checkpoint_files(folder)
    names = mtp.file_tensor_names(cfg)
    have = [n for n in names if n in files]
    if not have:
        return None
    if len(have) != len(names):
        missing = sorted(set(names) - set(have))
        raise ValueError(f"{folder}: the checkpoint has {len(have)} of the {len(names)} MTP tensors; missing "
                         f"{missing[:8]}{' ...' if len(missing) > 8 else ''}. Fix: use the complete checkpoint "
                         "(or one without MTP tensors, to start from a random layer)")
    with_handles: dict = {}

    def get(name):
        path = files[name]
        if path not in with_handles:
            with_handles[path] = safe_open(path, framework="flax")  # flax: bf16 reads as jnp bfloat16
        return np.asarray(jnp.asarray(with_handles[path].get_tensor(name), jnp.float32))

    return mtp.params_from_file_tensors(cfg, get)


class MtpFamily(DraftFamily):
    draft_type: ClassVar[str] = "mtp"
    display_name: ClassVar[str] = "MTP"
    meta_name: ClassVar[str] = "mtp"
    export_name: ClassVar[str] = "MTP"
    head_name: ClassVar[str] = "MTP layer"
    section_class: ClassVar[type] = MtpSection
    draft_module: ClassVar = mtp
    config_class: ClassVar[type] = mtp.MtpConfig
    train_keys: ClassVar[tuple[str, ...]] = ()
    objective_note: ClassVar[str] = "its objective is draft.mtp_train_steps / step_weight_beta"

    # -- the config ----------------------------------------------------------------------------
    def check_config(self, cfg) -> None:
        check_one_layer_on_final_hidden(cfg, "an MTP draft (draft.type=mtp: the target's one MTP layer)")

    # -- the draft config ----------------------------------------------------------------------
    def default_aux_layer_ids(self, cfg, target) -> tuple[int, ...]:
        return ()

    def make_draft_config(self, cfg, target, aux_ids) -> mtp.MtpConfig:
        d = cfg.draft
        V = int(target.config.vocab_size)
        if int(d.draft_vocab_size) != V:
            raise ValueError(f"draft.type=mtp: draft.draft_vocab_size={d.draft_vocab_size}, but the MTP layer scores "
                             f"the target's whole vocab with its lm_head. Fix: set draft.draft_vocab_size={V}")
        draft_cfg = mtp.MtpConfig(target=target.config, num_steps=int(d.mtp_train_steps),
                                  step_weight_beta=float(d.step_weight_beta))
        try:
            draft_cfg.validate()
            layers = mtp.mtp_layers_in_config(target.config, getattr(target, "hf_config", None))
        except ValueError as e:
            raise ValueError(f"draft.type=mtp: {e}") from None
        if layers > 1:
            raise ValueError(f"draft.type=mtp: the target declares {layers} MTP layers; specjax trains one (vLLM "
                             "chains it). Fix: use a target with one MTP layer")
        return draft_cfg

    def init_params(self, draft_cfg, key, *, std: float = 0.02, lm_head_rows=None) -> dict:
        return mtp.init_params(draft_cfg, key, std=std)

    def initial_params(self, cfg, draft_cfg, target, vocab) -> dict:
        """draft.init_from's MTP export, else the target checkpoint's MTP tensors, else a random layer."""
        if cfg.draft.init_from:
            return self.warm_start(cfg.draft.init_from, draft_cfg, vocab, None)
        params = read_mtp_tensors(cfg.target.path, draft_cfg)
        if params is not None:
            log.info("draft.type=mtp: starting from the %d MTP tensors of %s", len(mtp.file_tensor_names(draft_cfg)),
                     cfg.target.path)
            return jax.tree.map(jnp.asarray, params)
        log.warning("draft.type=mtp: %s has no MTP tensors (%s...); the layer starts from the target layers' init "
                    "(normal(0, %g) matrices, identity norms)", cfg.target.path, draft_cfg.file_prefix,
                    cfg.draft.init_std)
        return self.init_params(draft_cfg, jax.random.key(cfg.run.seed), std=cfg.draft.init_std)

    def warm_start(self, folder: str, draft_cfg, vocab, init_params) -> dict:
        params, head_cfg, _ = self.load_head(folder)
        if mtp.config_to_dict(head_cfg)["target_config"] != mtp.config_to_dict(draft_cfg)["target_config"]:
            raise ValueError(f"draft.init_from={folder}: that MTP layer belongs to another target config. Fix: point "
                             "draft.init_from at an MTP export of this target")
        return jax.tree.map(jnp.asarray, params)

    # -- training ------------------------------------------------------------------------------
    def make_objective(self, cfg, draft_cfg):
        return None  # the steps and their weights are fields of the draft config

    def loss_fn(self, target, draft_cfg, objective, compute_dtype):
        def loss_fn(draft_params, target_params, vocab, batch, step=None):
            final_hidden, _ = target_states(target, target_params, batch, ())
            return mtp.mtp_loss(draft_params, draft_cfg, input_ids=batch["input_ids"], loss_mask=batch["loss_mask"],
                                segment_ids=batch["segment_ids"], positions=batch["positions"],
                                final_hidden=final_hidden, embed_table=target.embed_table(target_params),
                                lm_head=target.lm_head_weight(target_params), compute_dtype=compute_dtype,
                                logit_softcap=target.logit_softcap)

        return loss_fn

    # -- speculative decoding ------------------------------------------------------------------
    def decode_taps(self, draft_cfg) -> tuple[int, ...]:
        return ()

    def reads_final_hidden(self, draft_cfg) -> bool:
        return True

    def decoding_params(self, draft_cfg, draft_params, target):
        return dict(draft_params, target_lm_head=target.lm_head_weight(target.params))

    def init_decode_cache(self, draft_cfg, max_len: int, dtype):
        return mtp.init_decode_cache(draft_cfg, max_len, dtype)

    def propose_chain(self, dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, last_tok, key,
                      temperature, *, dcfg, k: int, sample: bool):
        return mtp.draft_chain(dp, embed, d2t, dcache, pend_tok, pend_aux, pend_count, start, key, temperature,
                               dcfg=dcfg, k=k, sample=sample)

    # -- the head format -----------------------------------------------------------------------
    def export(self, params, draft_cfg, vocab, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
               extra_manifest: Optional[Mapping] = None, variant: Optional[str] = None) -> str:
        if variant not in (None, VARIANT):
            raise ValueError(f"--variant {variant!r} is an EAGLE-3 choice; an MTP run exports as MTP (drop --variant)")
        dtype = export_dtype(dtype, "MTP export")
        extra = manifest_extra(extra_manifest, "MTP export")
        arch = str((target_hf_config.get("architectures") or [""])[0])
        if arch != draft_cfg.target.architecture:
            raise ValueError(f"MTP export: the target config is {arch!r}, the layer was trained for "
                             f"{draft_cfg.target.architecture!r}. Fix: export with the run's target config.json")
        tensors = mtp.file_tensors_of_params(params, draft_cfg, numpy_dtype(dtype))
        config = mtp_hf_config(target_hf_config)
        findings = check_mtp_head(config, HeadTensors.from_arrays(tensors), target_config=target_hf_config)
        if errors(findings):
            raise ExportValidationError(findings, "MTP export")

        def replaceable(path):
            names = set(os.listdir(path)) if os.path.isdir(path) else None
            return names is not None and (not names or names == {WEIGHTS_FILE, CONFIG_FILE, MANIFEST_FILE})

        def refuse(path):
            raise ValueError(f"MTP export: {path} exists and is not an earlier export. Fix: choose a new folder")

        return write_head_folder(out_dir, tensors, config, replaceable=replaceable, refuse_existing=refuse,
                                 check_written=written_head_check(target_hf_config, (), "MTP export"), format=FORMAT,
                                 variant=VARIANT, dtype=dtype, draft_config=mtp.config_to_dict(draft_cfg),
                                 target_config=target_hf_config, warnings=findings, extra=extra)

    def recognises_head(self, head_config: Mapping) -> bool:
        return is_mtp_config(head_config)

    def load_head(self, folder: str):
        """(params, MtpConfig, identity DraftVocab) of an MTP export (or of a target checkpoint with MTP tensors)."""
        from specjax.drafts.vocab import DraftVocab
        from specjax.targets.registry import get_target_class

        folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
        conf, tensors, manifest, _ = read_head_files(folder)
        bad = errors(check_mtp_head(conf, tensors, check_finite=False))
        if bad:
            raise ValueError(f"{folder} is not an MTP export specjax can read:\n" + "\n".join(f"  {f}" for f in bad))
        target = get_target_class(conf).config_class.from_hf(conf)
        saved = (manifest or {}).get("draft_config") or {}
        cfg = mtp.MtpConfig(target=target, num_steps=int(saved.get("num_steps", mtp.SPECULATORS_NUM_STEPS)),
                            step_weight_beta=float(saved.get("step_weight_beta", mtp.SPECULATORS_STEP_WEIGHT_BETA)))
        params = mtp.params_from_file_tensors(cfg, lambda n: np.asarray(tensors.array(n), np.float32))
        return MtpHead(params, cfg, DraftVocab.identity(cfg.vocab_size))

    def vllm_speculative_config(self, draft: str, head_config: Optional[Mapping], num_spec_tokens: int) -> dict:
        return {"method": "mtp", "model": draft, "num_speculative_tokens": int(num_spec_tokens)}

    def serve_plan(self, draft_abs: str, target: str, num_spec_tokens: int) -> ServePlan:
        try:
            self.load_head(draft_abs)
        except (OSError, ValueError) as e:
            return ServePlan(error=f"error: {draft_abs} is not a readable MTP export: {e}")
        header = (f"# draft  {draft_abs}  (MTP layer in the target checkpoint's layout; vLLM's native mtp method "
                  "chains it --num-spec-tokens times)",)
        return ServePlan(header=header, num_spec_tokens=num_spec_tokens,
                         not_printed={"sglang": "not printed: specjax prints SGLang commands for EAGLE-3 heads only"})


MTP = register(MtpFamily())

"""Export a specjax DSpark drafter as the folder vLLM 0.32 loads as `Qwen3DSparkModel` (method "dspark").

Layout (the keys and why: specjax_converters.dspark_validate's module doc):
  model.safetensors  the DFlash backbone's tensors as dflash_export writes them (no embed_tokens, no
                     `model.` prefix, d2t/t2d when the draft vocab is smaller) plus the DSpark heads
                     (specjax.drafts.dspark_weights.DSPARK_HEADS: markov_head.markov_w1.weight [V, r],
                     markov_head.markov_w2.weight [Vd, r], the gated head's markov_head.gate_proj /
                     the rnn head's markov_head.joint_proj weight and bias, confidence_head.proj.weight
                     [1, H(+r)] and .bias [1]), all weights in one float dtype
  config.json        dflash_export's Qwen3 decoder config without its dflash_config block, with
                     architectures ["Qwen3DSparkModel"] and the top-level mask_token_id, target_layer_ids,
                     markov_rank, markov_head_type (the config's), block_size, sample_from_anchor,
                     enable_confidence_head, confidence_head_with_markov, use_aux_hidden_state
  specjax_manifest.json  format "specjax-dspark", variant "dspark", the DSparkConfig, the target config
Every rule of dspark_validate runs before anything is written and again on the written folder before
it is published (atomically: a temporary folder renamed at the end). No jax at import.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

import numpy as np

from specjax.drafts import weights
from specjax.drafts.dspark_weights import DSPARK_HEADS
from specjax_converters.dflash_export import dflash_hf_config, dflash_state_dict
from specjax_converters.dspark_validate import ARCHITECTURE, check_dspark_head
from specjax_converters.head_files import earlier_export, file_arrays, manifest_extra, write_head_folder
from specjax_converters.head_formats import written_head_check
from specjax_converters.head_rules import ExportValidationError, errors

__all__ = ["FORMAT", "VARIANT", "dspark_hf_config", "dspark_state_dict", "export_dspark"]

FORMAT = "specjax-dspark"
VARIANT = "dspark"


def dspark_state_dict(params: Mapping, cfg, vocab=None, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """File-named numpy tensors of a DSpark draft: dflash_state_dict of the backbone leaves, then one
    tensor per DSPARK_HEADS entry (kernels transposed to HF [out, in]) in the same dtype."""
    heads = {e.path[0] for e in weights.entries(DSPARK_HEADS, cfg)}
    absent = [p for p in sorted(heads) if p not in params]
    if absent:
        raise ValueError(f"DSpark export: params: {absent} missing. Fix: export the param tree "
                         "specjax.drafts.dspark.init_draft_params builds for the same DSparkConfig.")
    out = dflash_state_dict({k: v for k, v in params.items() if k not in ("markov_head", "confidence_head")},
                            cfg, vocab, dtype)
    dt = next(a.dtype for k, a in out.items() if k not in ("d2t", "t2d"))
    out.update(file_arrays(weights.entries(DSPARK_HEADS, cfg), params, dt, "DSpark export", "DSparkConfig"))
    if "confidence_head" in params and not cfg.enable_confidence_head:
        raise ValueError("DSpark export: params have a confidence_head but the config has enable_confidence_head="
                         "False. Fix: export with the run's own draft config.")
    return out


def dspark_hf_config(cfg, target_hf_config: Mapping, dtype: str = "bfloat16") -> dict:
    """The head's config.json (see the module doc)."""
    conf = dflash_hf_config(cfg, target_hf_config, dtype)
    conf.pop("dflash_config")
    conf["architectures"] = [ARCHITECTURE]
    conf.update(
        mask_token_id=int(cfg.mask_token_id), target_layer_ids=[int(i) for i in cfg.aux_layer_ids],
        use_aux_hidden_state=True, markov_rank=int(cfg.markov_rank), markov_head_type=str(cfg.markov_head_type),
        sample_from_anchor=bool(cfg.sample_from_anchor), enable_confidence_head=bool(cfg.enable_confidence_head),
        confidence_head_with_markov=bool(cfg.confidence_head_with_markov))
    return conf


def _is_replaceable(path: str) -> bool:
    """An existing out_dir may be replaced when empty or an earlier DSpark export."""
    return earlier_export(path, lambda conf: conf.get("architectures") == [ARCHITECTURE])


def _refuse_existing(out_dir: str) -> None:
    raise ValueError(f"DSpark export: out_dir: {out_dir} exists and is not an earlier DSpark export. Fix: choose an "
                     "empty or new folder (the export will not overwrite other files).")


def export_dspark(params: Mapping, cfg, target_hf_config: Mapping, out_dir: str | os.PathLike, *, vocab=None,
                  dtype: str = "bfloat16", extra_manifest: Optional[Mapping] = None) -> str:
    """Validate, then write model.safetensors + config.json + specjax_manifest.json to `out_dir`;
    an error raises ExportValidationError (a ValueError) and leaves no folder. Returns the absolute
    out_dir."""
    extra = manifest_extra(extra_manifest, "DSpark export")
    tensors = dspark_state_dict(params, cfg, vocab, dtype)
    config = dspark_hf_config(cfg, target_hf_config, dtype)
    ids = [int(i) for i in cfg.aux_layer_ids]
    findings = check_dspark_head(config, tensors, target_config=target_hf_config, training_layer_ids=ids)
    if errors(findings):
        raise ExportValidationError(findings, "DSpark export")
    return write_head_folder(
        out_dir, tensors, config, replaceable=_is_replaceable, refuse_existing=_refuse_existing,
        check_written=written_head_check(target_hf_config, ids, "DSpark export"), format=FORMAT, variant=VARIANT,
        dtype=config["torch_dtype"], draft_config=cfg, target_config=target_hf_config, warnings=findings,
        extra=extra)

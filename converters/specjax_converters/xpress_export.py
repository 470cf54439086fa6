"""Export a specjax XPress draft, and read an XPress head folder back, in the layout its slot-0
convention belongs to (draft.xpress_slot0_prev, specjax.drafts.xpress):

  before_anchor (default)  speculators 0.9's layout (speculators_model_type "xpress", refiner_head.*;
                           dflash2_export.export_speculators_head with xpress_validate.XPRESS_LAYOUT),
                           which speculators' XPressDraftModel loads and which drafts slot 0 from the
                           token before the anchor, as speculators does;
  anchor                   vLLM 0.34's own layout (architectures ["Qwen3XPressModel"], xpress_head.*;
                           the keys and their vllm-0.34.0 FILE:LINE: xpress_validate's module doc),
                           whose XPressSpeculator drafts slot 0 from the anchor.
The layout follows the setting, not an export option: each reader has one fixed slot-0 convention, so
writing a head in the other's layout would give an engine that drafts differently from specjax.eval.
A 0.34-layout folder reads back with xpress_slot0_prev "anchor" (the layout implies it).

The 0.34 layout (`xpress_vllm034_hf_config`, `xpress_vllm034_state_dict`):
  config.json        dflash_export's Qwen3 decoder config without its dflash_config block and block_size,
                     with architectures ["Qwen3XPressModel"] and the top-level mask_token_id,
                     target_layer_ids (output-of-layer-k), use_aux_hidden_state true, sample_from_anchor
                     false, xpress_block_size (block_size), xpress_rank, xpress_mlp_hidden
                     (xpress_rank * xpress_mlp_ratio), xpress_num_passes (num_jacobi_passes) and
                     xpress_topc 0 (every pass scored on the whole vocab, as specjax.eval does)
  model.safetensors  the DFlash backbone as dflash_export writes it (full vocab: no d2t / t2d), then the
                     refiner under 0.34's names (specjax.drafts.xpress_weights.XPRESS_VLLM034_WEIGHTS;
                     xpress_head.mix.L is the raw mixer, which 0.34 folds to L*tril + I), one float dtype
  specjax_manifest.json  format "specjax-xpress-vllm034", variant "xpress_vllm034", the XPressConfig
Every rule of xpress_validate.check_xpress_vllm034_head runs before anything is written and again on the
written folder before it is published (atomically). Plain numpy + safetensors; no jax at import.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

import numpy as np

from specjax.drafts import weights
from specjax.drafts.dflash_weights import DFLASH_WEIGHTS
from specjax.drafts.xpress_weights import XPRESS_VLLM034_WEIGHTS
from specjax.hf_config_checks import read_config_json
from specjax_converters.dflash2_export import DFlash2Head, export_speculators_head, read_speculators_head
from specjax_converters.dflash_export import dflash_hf_config, dflash_state_dict
from specjax_converters.dflash_import import config_from_hf, read_dflash_tensors
from specjax_converters.head_files import (CONFIG_FILE, WEIGHTS_FILE, earlier_export, export_dtype, file_arrays,
                                           manifest_extra, read_head_files, write_head_folder)
from specjax_converters.head_formats import written_head_check
from specjax_converters.head_rules import ExportValidationError, errors
from specjax_converters.xpress_validate import (VLLM034_ARCHITECTURE, VLLM034_LAYOUT_NAME, XPRESS_LAYOUT,
                                                check_xpress_vllm034_head, names_xpress_vllm034_head,
                                                vllm034_backbone_view)

__all__ = ["FORMAT_VLLM034", "export_xpress", "export_xpress_vllm034", "read_xpress_head", "read_xpress_vllm034_head",
           "xpress_vllm034_hf_config", "xpress_vllm034_state_dict"]

FORMAT_VLLM034 = "specjax-xpress-vllm034"  # specjax_manifest.json's format of a 0.34-layout head
_REFINER_ROWS = XPRESS_VLLM034_WEIGHTS[len(DFLASH_WEIGHTS):]


def _fail(field: str, problem: str, fix: str):
    raise ValueError(f"XPress export (vLLM 0.34 layout): {field}: {problem}. Fix: {fix}.")


def _check_cfg(cfg) -> None:
    cfg.validate()
    if cfg.xpress_slot0_prev != "anchor":
        _fail("xpress_slot0_prev", f"{cfg.xpress_slot0_prev!r}: vLLM 0.34's XPress drafter reads the anchor as slot "
              "0's previous token, so a head trained otherwise would draft differently there",
              "train with draft.xpress_slot0_prev=anchor (the speculators layout is written for before_anchor)")


def xpress_vllm034_state_dict(params: Mapping, cfg, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """File-named numpy tensors of the 0.34 layout: dflash_state_dict of the backbone leaves (full
    vocab), then one tensor per refiner row of XPRESS_VLLM034_WEIGHTS (kernels as HF [out, in])."""
    if "refiner_head" not in params:
        _fail("params", "no refiner_head", "export the tree specjax.drafts.xpress.init_draft_params builds")
    out = dflash_state_dict({k: v for k, v in params.items() if k != "refiner_head"}, cfg, None, dtype)
    dt = out["fc.weight"].dtype
    out.update(file_arrays(weights.entries(_REFINER_ROWS, cfg), params, dt, "XPress export (vLLM 0.34 layout)",
                           "XPressConfig"))
    return out


def xpress_vllm034_hf_config(cfg, target_hf_config: Mapping, dtype: str = "bfloat16") -> dict:
    """config.json of the 0.34 layout (the module doc)."""
    _check_cfg(cfg)
    conf = dflash_hf_config(cfg, target_hf_config, dtype)
    conf.pop("dflash_config")
    conf.pop("block_size")
    conf["architectures"] = [VLLM034_ARCHITECTURE]
    conf.update(
        mask_token_id=int(cfg.mask_token_id), target_layer_ids=[int(i) for i in cfg.aux_layer_ids],
        use_aux_hidden_state=True, sample_from_anchor=False, xpress_block_size=int(cfg.block_size),
        xpress_rank=int(cfg.xpress_rank), xpress_mlp_hidden=int(cfg.xpress_rank * cfg.xpress_mlp_ratio),
        xpress_num_passes=int(cfg.num_jacobi_passes), xpress_topc=0)
    return conf


def _replaceable(path: str) -> bool:
    return earlier_export(path, names_xpress_vllm034_head)


def _refuse(out_dir: str):
    _fail("out_dir", f"{out_dir} exists and is not an earlier XPress export of this layout",
          "choose an empty or new folder (the export will not overwrite other files)")


def export_xpress_vllm034(params: Mapping, cfg, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
                          extra_manifest: Optional[Mapping] = None) -> str:
    """Validate, then write the 0.34-layout folder atomically; returns its absolute path."""
    dtype = export_dtype(dtype, "XPress export")
    extra = manifest_extra(extra_manifest, "XPress export")
    config = xpress_vllm034_hf_config(cfg, target_hf_config, dtype)
    tensors = xpress_vllm034_state_dict(params, cfg, dtype)
    ids = [int(i) for i in cfg.aux_layer_ids]
    findings = check_xpress_vllm034_head(config, tensors, target_config=target_hf_config, training_layer_ids=ids)
    if errors(findings):
        raise ExportValidationError(findings, "XPress export (vLLM 0.34 layout)")
    return write_head_folder(
        out_dir, tensors, config, replaceable=_replaceable, refuse_existing=_refuse,
        check_written=written_head_check(target_hf_config, ids, "XPress export (vLLM 0.34 layout)"),
        format=FORMAT_VLLM034, variant=VLLM034_LAYOUT_NAME, dtype=dtype, draft_config=dataclasses.asdict(cfg),
        target_config=target_hf_config, warnings=findings, extra=extra)


def export_xpress(params: Mapping, cfg, vocab, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
                  extra_manifest: Optional[Mapping] = None, verifier: Optional[str] = None) -> str:
    """The head in the layout of its slot-0 convention (the module doc); `vocab` (a reduced draft
    vocab's DraftVocab) and `verifier` apply to the speculators layout."""
    if cfg.xpress_slot0_prev == "anchor":
        return export_xpress_vllm034(params, cfg, target_hf_config, out_dir, dtype=dtype,
                                     extra_manifest=extra_manifest)
    return export_speculators_head(params, cfg, target_hf_config, out_dir, XPRESS_LAYOUT, vocab=vocab, dtype=dtype,
                                   extra_manifest=extra_manifest, verifier=verifier)


def read_xpress_vllm034_head(folder: str) -> DFlash2Head:
    """(params as fp32 numpy, XPressConfig with xpress_slot0_prev "anchor", identity DraftVocab) of a
    0.34-layout XPress head folder."""
    from specjax.drafts.xpress import as_xpress

    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    conf, tensors, _, _ = read_head_files(folder)
    if not names_xpress_vllm034_head(conf):
        raise ValueError(f"{folder}: config.json is not a vLLM 0.34-layout XPress head's (architectures "
                         f"{conf.get('architectures')!r}). Fix: pass an XPress export")
    found = [f for f in check_xpress_vllm034_head(conf, tensors, check_finite=False) if f.level == "error"]
    if found:
        raise ValueError(f"{folder}: " + "; ".join(str(f) for f in found))
    r, m = int(conf["xpress_rank"]), int(conf["xpress_mlp_hidden"])
    if m % r:
        raise ValueError(f"{folder}: xpress_mlp_hidden {m} is not a multiple of xpress_rank {r}; specjax's refiner "
                         "MLP is xpress_rank x xpress_mlp_ratio wide. Fix: export the head with specjax.export")
    try:
        cfg = as_xpress(config_from_hf(vllm034_backbone_view(conf), folder), xpress_rank=r, xpress_mlp_ratio=m // r,
                        num_jacobi_passes=int(conf.get("xpress_num_passes", 6)), xpress_slot0_prev="anchor")
        cfg.validate()
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{folder}: config.json: {e}. Fix: export the head with specjax.export") from None
    params, vocab = read_dflash_tensors(folder, cfg, tensors)
    leaves = []
    for e in weights.entries(_REFINER_ROWS, cfg):
        if e.file_name not in tensors:
            raise ValueError(f"{folder}: {WEIGHTS_FILE} lacks {e.file_name}. Fix: export the head with specjax.export")
        arr = np.asarray(tensors.array(e.file_name), np.float32)
        leaves.append((e.path, np.ascontiguousarray(arr.T) if e.row.transpose else arr))
    return DFlash2Head({**params, **weights.nest(leaves)}, cfg, vocab)


def read_xpress_head(folder: str, config_class) -> DFlash2Head:
    """An XPress head folder of either layout (`config_class`: XPressConfig, for the speculators one)."""
    path = os.path.join(os.path.expanduser(os.fspath(folder)), CONFIG_FILE)
    conf = read_config_json(path, "head config") if os.path.isfile(path) else {}
    if names_xpress_vllm034_head(conf):
        return read_xpress_vllm034_head(folder)
    return read_speculators_head(folder, XPRESS_LAYOUT, config_class)

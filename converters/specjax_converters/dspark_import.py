"""Read a DSpark head folder (what specjax_converters.dspark_export writes: config.json with
architectures ["Qwen3DSparkModel"], model.safetensors) back into specjax's DSparkConfig, param tree
and draft vocab. The backbone is read by dflash_import from the head's DFlash view
(dspark_validate.backbone_view), the Markov and confidence heads from the DSPARK_HEADS rows. Plain
numpy + safetensors; no jax at import.
"""
from __future__ import annotations

import os

import numpy as np

from specjax.drafts import weights
from specjax.drafts.dspark_weights import DSPARK_HEADS
from specjax_converters.dflash_import import DFlashHead, config_from_hf, read_dflash_tensors
from specjax_converters.dspark_validate import backbone_view, is_dspark_config
from specjax_converters.head_files import read_head_files

__all__ = ["read_dspark_head"]


def _fail(folder: str, problem: str, fix: str):
    raise ValueError(f"{folder}: {problem}. Fix: {fix}.")


def read_dspark_head(folder: str) -> DFlashHead:
    """(params as fp32 numpy, DSparkConfig, DraftVocab) of a DSpark head folder."""
    from specjax.drafts.dspark import as_dspark

    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    conf, tensors, _, _ = read_head_files(folder)
    if not is_dspark_config(conf):
        _fail(folder, f"config.json is not a DSpark head's (architectures {conf.get('architectures')!r})",
              "pass a DSpark export (specjax.export of a draft.type=dspark run)")
    for key in ("markov_rank", "sample_from_anchor"):
        if key not in conf:
            _fail(folder, f"config.json has no {key}", "export the head with specjax.export")
    view = backbone_view(conf)
    try:
        cfg = as_dspark(config_from_hf(view, folder), markov_rank=int(conf["markov_rank"]),
                        markov_head_type=conf.get("markov_head_type", "vanilla"),
                        enable_confidence_head=bool(conf.get("enable_confidence_head", False)),
                        confidence_head_with_markov=bool(conf.get("confidence_head_with_markov", False)))
    except ValueError as e:
        _fail(folder, str(e), "check the head's config.json")
    params, vocab = read_dflash_tensors(folder, cfg, tensors)
    leaves = []
    for e in weights.entries(DSPARK_HEADS, cfg):
        if e.file_name not in tensors:
            _fail(folder, f"model.safetensors lacks {e.file_name}", "export the head with specjax.export")
        if tuple(tensors.shape(e.file_name)) != e.file_shape:
            _fail(folder, f"{e.file_name} has shape {tensors.shape(e.file_name)}, expected {e.file_shape}",
                  "check that config.json belongs to these weights")
        arr = np.asarray(tensors.array(e.file_name), np.float32)
        leaves.append((e.path, np.ascontiguousarray(arr.T) if e.row.transpose else arr))
    return DFlashHead({**params, **weights.nest(leaves)}, cfg, vocab)

"""Read a DFlash head folder (what specjax_converters.dflash_export writes: config.json with
architectures ["DFlashDraftModel"] and a dflash_config block, model.safetensors) back into specjax's
DFlashConfig, param tree and draft vocab. The file layout is the table in
specjax.drafts.dflash_weights; the keys read from config.json are the ones dflash_export documents.
Plain numpy + safetensors; no jax at import.
"""
from __future__ import annotations

import json
import os
from typing import Mapping, NamedTuple

import numpy as np

from specjax.drafts import weights
from specjax.drafts.dflash_weights import DFLASH_WEIGHTS
from specjax_converters.dflash_export import ARCHITECTURE, CONFIG_FILE, WEIGHTS_FILE

__all__ = ["DFlashHead", "config_from_hf", "is_dflash_config", "is_dflash_folder", "read_dflash_head"]


class DFlashHead(NamedTuple):
    params: dict  # numpy leaves, the tree of specjax.drafts.dflash.init_draft_params
    config: object  # specjax.drafts.dflash.DFlashConfig
    vocab: object  # specjax.drafts.vocab.DraftVocab


def is_dflash_config(conf: Mapping) -> bool:
    return list(conf.get("architectures") or []) == [ARCHITECTURE] or "dflash_config" in conf


def is_dflash_folder(folder: str) -> bool:
    path = os.path.join(os.path.expanduser(os.fspath(folder)), CONFIG_FILE)
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            return is_dflash_config(json.load(f))
    except (OSError, ValueError):
        return False


def _fail(folder: str, problem: str, fix: str):
    raise ValueError(f"{folder}: {problem}. Fix: {fix}.")


def config_from_hf(conf: Mapping, folder: str = "<config>"):
    """The DFlashConfig of a DFlash config.json (the inverse of dflash_export.dflash_hf_config)."""
    from specjax.drafts.dflash import DFlashConfig
    from specjax.targets.layers.rope import rope_spec_from_hf

    dc = conf.get("dflash_config") or {}
    missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dc]
    if missing:
        _fail(folder, f"config.json's dflash_config lacks {missing}", "export the head with specjax.export")
    if dc.get("causal"):
        _fail(folder, "dflash_config.causal is true; specjax drafts blocks with bidirectional attention",
              "use a head trained with causal=false")
    if "block_size" not in conf:
        _fail(folder, "config.json has no block_size (the trained block; vLLM does not need it, the decoder does)",
              "add block_size (the number of slots the head was trained with) to config.json")
    hidden = int(conf["hidden_size"])
    n_heads = int(conf["num_attention_heads"])
    cfg = DFlashConfig(
        hidden_size=hidden, num_layers=int(conf["num_hidden_layers"]), num_attention_heads=n_heads,
        num_key_value_heads=int(conf.get("num_key_value_heads") or n_heads),
        head_dim=int(conf.get("head_dim") or hidden // n_heads), intermediate_size=int(conf["intermediate_size"]),
        vocab_size=int(conf["vocab_size"]), draft_vocab_size=int(conf.get("draft_vocab_size") or conf["vocab_size"]),
        target_layer_ids=tuple(int(i) for i in dc["target_layer_ids"]), mask_token_id=int(dc["mask_token_id"]),
        block_size=int(conf["block_size"]), rms_norm_eps=float(conf.get("rms_norm_eps", 1e-6)),
        rope=rope_spec_from_hf(conf), max_position_embeddings=int(conf.get("max_position_embeddings", 2048)),
        num_target_layers=conf.get("num_target_layers"), sample_from_anchor=bool(dc.get("sample_from_anchor", False)),
        hidden_act=str(conf.get("hidden_act", "silu")))
    if int(conf.get("target_hidden_size") or hidden) != hidden:
        _fail(folder, f"target_hidden_size {conf['target_hidden_size']} differs from hidden_size {hidden}",
              "specjax DFlash heads have the target's width")
    try:
        cfg.validate()
    except ValueError as e:
        _fail(folder, str(e), "check the head's config.json")
    return cfg


def read_dflash_head(folder: str) -> DFlashHead:
    """params (fp32 numpy), DFlashConfig and DraftVocab of a DFlash head folder."""
    from safetensors.numpy import load_file

    from specjax.drafts.vocab import DraftVocab

    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    with open(os.path.join(folder, CONFIG_FILE)) as f:
        conf = json.load(f)
    cfg = config_from_hf(conf, folder)
    wpath = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(wpath):
        _fail(folder, f"no {WEIGHTS_FILE}", "export the head with specjax.export (one safetensors file)")
    tensors = load_file(wpath)
    leaves, missing = [], []
    for e in weights.entries(DFLASH_WEIGHTS, cfg):
        if e.file_name not in tensors:
            missing.append(e.file_name)
            continue
        arr = np.asarray(tensors[e.file_name], np.float32)
        if arr.shape != e.file_shape:
            _fail(folder, f"{e.file_name} has shape {arr.shape}, expected {e.file_shape}",
                  "check that config.json belongs to these weights")
        leaves.append((e.path, np.ascontiguousarray(arr.T) if e.row.transpose else arr))
    if missing:
        _fail(folder, f"{WEIGHTS_FILE} lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}",
              "export the head with specjax.export")
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    if Vd == V:
        vocab = DraftVocab.identity(V)
    elif "d2t" in tensors:
        d2t = np.asarray(tensors["d2t"], np.int64)
        vocab = DraftVocab.from_ids(np.arange(Vd, dtype=np.int64) + d2t, V)
    else:
        _fail(folder, f"draft_vocab_size {Vd} < vocab_size {V} but {WEIGHTS_FILE} has no d2t",
              "export the head with its draft vocab (specjax.export writes d2t/t2d)")
    return DFlashHead(weights.nest(leaves), cfg, vocab)

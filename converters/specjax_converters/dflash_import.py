"""Read a DFlash head folder (what specjax_converters.dflash_export writes: config.json with
architectures ["DFlashDraftModel"] and a dflash_config block, model.safetensors) back into specjax's
DFlashConfig (a JetSpecConfig when the block attends causally: dflash_config.causal true), param tree
and draft vocab, and start a DFlash run from one (`draft.init_from`:
warm_start_dflash_params). The file layout is the table in specjax.drafts.dflash_weights; the keys
read from config.json are the ones dflash_export documents. The folder is read through
specjax_converters.head_files (checked safetensors headers; pickles refused, never unpickled).
Plain numpy + safetensors; no jax at import.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Mapping, NamedTuple

import numpy as np

from specjax.drafts import weights
from specjax.drafts.dflash_weights import DFLASH_WEIGHTS
from specjax_converters.dflash_export import CONFIG_FILE, WEIGHTS_FILE
from specjax_converters.dflash_validate import block_attention_causal, is_dflash_config, speculators_dflash_error
from specjax_converters.head_files import read_head_files
from specjax_converters.warm_start import params_like

__all__ = ["DFlashHead", "config_from_hf", "is_dflash_config", "is_dflash_folder", "read_dflash_head",
           "read_dflash_tensors", "warm_start_dflash_params"]

log = logging.getLogger("specjax")


class DFlashHead(NamedTuple):
    params: dict  # numpy leaves, the tree of specjax.drafts.dflash.init_draft_params
    config: object  # specjax.drafts.dflash.DFlashConfig, or its JetSpecConfig for a causal head
    vocab: object  # specjax.drafts.vocab.DraftVocab


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
    """The DFlashConfig of a DFlash config.json, a JetSpecConfig when its block attends causally
    (the inverse of dflash_export.dflash_hf_config)."""
    from specjax.drafts.dflash import DFlashConfig, JetSpecConfig
    from specjax.layers.rope import rope_spec_from_hf

    dc = dict(conf.get("dflash_config") or {})
    if "mask_token_id" not in dc and conf.get("mask_token_id") is not None:
        dc["mask_token_id"] = conf["mask_token_id"]  # vLLM's fallback, read the same way
    missing = [k for k in ("mask_token_id", "target_layer_ids") if k not in dc]
    if missing:
        _fail(folder, f"config.json's dflash_config lacks {missing}", "export the head with specjax.export")
    config_class = JetSpecConfig if block_attention_causal(conf) else DFlashConfig
    if "block_size" not in conf:
        _fail(folder, "config.json has no block_size (the trained block; vLLM does not need it, the decoder does)",
              "add block_size (the number of slots the head was trained with) to config.json")
    hidden = int(conf["hidden_size"])
    n_heads = int(conf["num_attention_heads"])
    cfg = config_class(
        hidden_size=hidden, num_layers=int(conf["num_hidden_layers"]), num_attention_heads=n_heads,
        num_key_value_heads=int(conf.get("num_key_value_heads") or n_heads),
        head_dim=int(conf.get("head_dim") or hidden // n_heads), intermediate_size=int(conf["intermediate_size"]),
        vocab_size=int(conf["vocab_size"]), draft_vocab_size=int(conf.get("draft_vocab_size") or conf["vocab_size"]),
        aux_layer_ids=tuple(int(i) for i in dc["target_layer_ids"]), mask_token_id=int(dc["mask_token_id"]),
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
    """params (fp32 numpy), DFlashConfig (JetSpecConfig for a causal head) and DraftVocab of a DFlash
    head folder."""
    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    conf, tensors, _, _ = read_head_files(folder)  # checked headers; a pickle-only folder is refused
    refused = speculators_dflash_error(folder, conf)
    if refused:
        raise ValueError(refused)
    if not is_dflash_config(conf):
        _fail(folder, f"config.json is not a DFlash head's (architectures {conf.get('architectures')!r}, no "
              "dflash_config)", "pass a DFlash export (specjax.export of a draft.type=dflash run)")
    cfg = config_from_hf(conf, folder)
    params, vocab = read_dflash_tensors(folder, cfg, tensors)
    return DFlashHead(params, cfg, vocab)


def read_dflash_tensors(folder: str, cfg, tensors) -> tuple[dict, object]:
    """(params as fp32 numpy, DraftVocab) of the DFLASH_WEIGHTS rows of `cfg` and the vocab maps in
    `tensors` (a head folder's HeadTensors); errors name `folder`."""
    from specjax.drafts.vocab import DraftVocab

    leaves, missing = [], []
    for e in weights.entries(DFLASH_WEIGHTS, cfg):
        if e.file_name not in tensors:
            missing.append(e.file_name)
            continue
        if tuple(tensors.shape(e.file_name)) != e.file_shape:
            _fail(folder, f"{e.file_name} has shape {tensors.shape(e.file_name)}, expected {e.file_shape}",
                  "check that config.json belongs to these weights")
        arr = np.asarray(tensors.array(e.file_name), np.float32)
        leaves.append((e.path, np.ascontiguousarray(arr.T) if e.row.transpose else arr))
    if missing:
        shared = " (vLLM shares the target's lm_head when it is absent; specjax reads the head's own)" \
            if missing == ["lm_head.weight"] else ""
        _fail(folder, f"{WEIGHTS_FILE} lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}{shared}",
              "export the head with specjax.export")
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    if Vd == V:
        vocab = DraftVocab.identity(V)
    elif "d2t" in tensors:
        if tuple(tensors.shape("d2t")) != (Vd,):  # checked on the header: nothing read yet
            _fail(folder, f"d2t has shape {tensors.shape('d2t')}, expected ({Vd},)",
                  "export the head with its draft vocab")
        d2t = np.asarray(tensors.array("d2t"), np.int64)
        try:
            vocab = DraftVocab.from_ids(np.arange(Vd, dtype=np.int64) + d2t, V)
        except ValueError as e:
            _fail(folder, f"d2t: {e}", "rebuild d2t from the sorted unique draft ids")
    else:
        _fail(folder, f"draft_vocab_size {Vd} < vocab_size {V} but {WEIGHTS_FILE} has no d2t",
              "export the head with its draft vocab (specjax.export writes d2t/t2d)")
    return weights.nest(leaves), vocab


# fields a warm start must share with the run (the param shapes, the taps fc reads, the mask token the
# head learned to read), and the run key that sets each
_FIT_FIELDS = {"hidden_size": None, "vocab_size": None, "num_layers": "draft.num_layers",
               "num_attention_heads": "draft.num_attention_heads", "num_key_value_heads": "draft.num_key_value_heads",
               "head_dim": "draft.head_dim", "intermediate_size": "draft.intermediate_size",
               "mask_token_id": "draft.mask_token_id"}


def warm_start_dflash_params(folder: str, draft_cfg, vocab, init_params: Mapping) -> dict:
    """Params for a DFlash run that starts from an exported DFlash head (`draft.init_from`).

    The head must have the run's shapes, taps and mask token; errors name the key to set. A
    different block_size, sample_from_anchor, RoPE, eps or attention inside the block (a JetSpec run
    may start from a DFlash head and the other way round) is logged and training continues with the
    run's. When the head's draft vocab differs from the run's, lm_head rows are matched by target
    token id (warm_start.match_lm_head_rows). Leaves come back as jax arrays with init_params'
    dtypes."""
    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    if os.path.isdir(folder) and os.path.isfile(os.path.join(folder, CONFIG_FILE)) and not is_dflash_folder(folder):
        raise ValueError(f"draft.init_from={folder}: not a DFlash head (config.json has neither architectures "
                         "[\"DFlashDraftModel\"] nor a dflash_config); a draft.type=dflash run starts from a DFlash "
                         "export. Fix: point draft.init_from at a DFlash export (specjax.export of a draft.type=dflash "
                         "run), or set draft.type=eagle3 to start from this EAGLE-3 head")
    try:
        head = read_dflash_head(folder)
    except ValueError as e:
        raise ValueError(f"draft.init_from: {e}") from None
    hc = head.config
    diff = [f for f in _FIT_FIELDS if getattr(hc, f) != getattr(draft_cfg, f)]
    if diff:
        lines = "; ".join(f"{f}: head {getattr(hc, f)} vs run {getattr(draft_cfg, f)}"
                          + (f" (set {_FIT_FIELDS[f]}={getattr(hc, f)})" if _FIT_FIELDS[f] else " (another target)")
                          for f in diff)
        raise ValueError(f"draft.init_from={folder}: the DFlash head does not fit this run's draft: {lines}. Fix: set "
                         "the keys named; a head for another target (hidden_size / vocab_size) cannot be "
                         "warm-started from")
    if tuple(hc.aux_layer_ids) != tuple(draft_cfg.aux_layer_ids):
        raise ValueError(f"draft.init_from={folder}: the head was trained on target layers "
                         f"{list(hc.aux_layer_ids)}, the run taps {list(draft_cfg.aux_layer_ids)}. Fix: set "
                         f"target.aux_layer_ids=[{','.join(map(str, hc.aux_layer_ids))}] (fc is tied to its taps)")
    for f in ("block_size", "sample_from_anchor", "rope", "rms_norm_eps", "causal"):
        if getattr(hc, f) != getattr(draft_cfg, f):
            log.warning("draft.init_from=%s: the head's %s (%s) differs from the run's (%s); training continues with "
                        "the run's", folder, f, getattr(hc, f), getattr(draft_cfg, f))
    out = params_like(folder, head.params, head.vocab, vocab, init_params)
    log.info("warm start: DFlash draft params loaded from %s", folder)
    return out

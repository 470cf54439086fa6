"""Export a specjax DFlash 2 draft as a speculators-layout DFlash2DraftModel folder, and read one back.

The layout and its rules are specjax_converters.dflash2_validate's (config.json as speculators'
DFlash2SpeculatorConfig writes it; model.safetensors named by DFLASH2_WEIGHTS, kernels as HF
[out, in]; specjax_manifest.json beside them). Every rule runs on the tensors and config before
anything is written and again on the written folder before it is published (atomically, as every
specjax export). speculators' `DFlash2DraftModel.from_pretrained` loads the folder; vLLM 0.32
converts its config (algos.update_dflash2) for its qwen3_dflash2 model, served with method
"dflash" by its V2 (GPU) model runner only.

Plain numpy + safetensors; no jax at import.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping, NamedTuple, Optional

import numpy as np

from specjax.drafts import weights
from specjax.drafts.dflash2_weights import DFLASH2_WEIGHTS
from specjax_converters.dflash2_validate import DFLASH2_LAYOUT, MODEL_TYPE, SpeculatorsLayout, check_speculators_head
from specjax_converters.head_files import (TOKEN_FIELDS, WEIGHTS_FILE, earlier_export, export_dtype, file_arrays,
                                           manifest_extra, numpy_dtype, read_head_files, write_head_folder)
from specjax_converters.head_formats import written_head_check
from specjax_converters.head_rules import ExportValidationError, errors
from specjax_converters.target_facts import rope_dict, target_rope_dicts, target_text_config

__all__ = ["DFlash2Head", "dflash2_hf_config", "dflash2_state_dict", "export_dflash2", "export_speculators_head",
           "read_dflash2_head", "read_speculators_head", "speculators_hf_config", "speculators_state_dict"]

FORMAT = "specjax-dflash2"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose DFlash2SpeculatorConfig this layout follows


class DFlash2Head(NamedTuple):
    params: dict  # numpy leaves, the tree of specjax.drafts.dflash2.init_draft_params
    config: object  # specjax.drafts.dflash2.DFlash2Config
    vocab: object  # specjax.drafts.vocab.DraftVocab (the identity: full vocab)


def _fail(field: str, problem: str, fix: str):
    raise ValueError(f"DFlash 2 export: {field}: {problem}. Fix: {fix}.")






def dflash2_state_dict(params: Mapping, cfg, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """File-named numpy tensors, one per DFLASH2_WEIGHTS row for `cfg` (kernels transposed)."""
    return speculators_state_dict(params, cfg, DFLASH2_WEIGHTS, None, dtype)


def speculators_state_dict(params: Mapping, cfg, table, vocab=None, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """File-named numpy tensors of `table`'s rows for `cfg` (kernels transposed to HF [out, in]), plus
    d2t (int64 offsets) / t2d (bool) from `vocab` when the draft vocab is smaller than the target's."""
    np_dtype = numpy_dtype(export_dtype(dtype, "DFlash 2 export"))
    out = file_arrays(weights.entries(table, cfg), params, np_dtype, "DFlash 2 export", "draft config")
    if int(cfg.draft_vocab_size) < int(cfg.vocab_size):
        if vocab is None:
            _fail("vocab", f"draft_vocab_size={cfg.draft_vocab_size} < vocab_size={cfg.vocab_size} but no vocab maps "
                  "were given", "pass the run's DraftVocab")
        out["d2t"] = np.asarray(vocab.d2t).astype(np.int64)
        out["t2d"] = np.asarray(vocab.t2d).astype(bool)
    return out


def dflash2_hf_config(cfg, target_hf_config: Mapping, dtype: str = "bfloat16",
                      verifier: Optional[str] = None) -> dict:
    """config.json in speculators' DFlash2SpeculatorConfig layout (see dflash2_validate)."""
    return speculators_hf_config(cfg, target_hf_config, DFLASH2_LAYOUT, dtype, verifier)


def speculators_hf_config(cfg, target_hf_config: Mapping, layout: SpeculatorsLayout, dtype: str = "bfloat16",
                          verifier: Optional[str] = None) -> dict:
    """config.json of `layout` (speculators' DFlash-variant config: the DFlash fields, then the
    layout's own fields from the draft config of the same names)."""
    cfg.validate()
    tc = target_text_config(target_hf_config)
    for key in ("hidden_size", "vocab_size"):
        if key in tc and int(tc[key]) != int(getattr(cfg, key)):
            _fail(key, f"the draft's {getattr(cfg, key)} differs from the target's {tc[key]}",
                  "build the draft config from this target")
    rope = cfg.rope.to_hf()
    if target_rope_dicts(tc) and rope_dict({"rope_parameters": rope}) not in target_rope_dicts(tc):
        _fail("rope", f"the draft was built with {rope}, the target says {rope_dict(tc)}", "use the target's RoPE")
    layer = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": int(cfg.vocab_size), "hidden_size": int(cfg.hidden_size),
        "intermediate_size": int(cfg.intermediate_size), "num_hidden_layers": int(cfg.num_layers),
        "num_attention_heads": int(cfg.num_attention_heads), "num_key_value_heads": int(cfg.num_key_value_heads),
        "head_dim": int(cfg.head_dim), "hidden_act": cfg.hidden_act, "rms_norm_eps": float(cfg.rms_norm_eps),
        "max_position_embeddings": int(tc.get("max_position_embeddings", cfg.max_position_embeddings)),
        "rope_parameters": rope, "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * int(cfg.num_layers),
    }
    layer.update({k: tc[k] for k in TOKEN_FIELDS if tc.get(k) is not None})
    verifier_arch = list(target_hf_config.get("architectures") or [])
    return {
        "architectures": [layout.architecture],
        "speculators_model_type": layout.model_type,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": layout.model_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(cfg.num_draft_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_arch},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": int(cfg.draft_vocab_size),
        "block_size": int(cfg.block_size),
        "target_hidden_size": int(cfg.hidden_size),
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in cfg.aux_layer_ids],
        "mask_token_id": int(cfg.mask_token_id),
        "sliding_window_non_causal": True,
        "sample_from_anchor": bool(cfg.sample_from_anchor),
        **{k: int(getattr(cfg, k)) for k in layout.own_fields},
        "dtype": export_dtype(dtype, "DFlash 2 export"),
    }


def _replaceable(path: str, model_type: str = MODEL_TYPE) -> bool:
    return earlier_export(path, lambda conf: conf.get("speculators_model_type") == model_type)


def _refuse(out_dir: str):
    _fail("out_dir", f"{out_dir} exists and is not an earlier export of the same method",
          "choose an empty or new folder (the export will not overwrite other files)")


def export_dflash2(params: Mapping, cfg, target_hf_config: Mapping, out_dir, *, dtype: str = "bfloat16",
                   extra_manifest: Optional[Mapping] = None, verifier: Optional[str] = None) -> str:
    """Validate, then write the folder atomically; returns its absolute path. `verifier` is
    speculators_config.verifier.name_or_path (the target's path or hub id; None when unknown)."""
    return export_speculators_head(params, cfg, target_hf_config, out_dir, DFLASH2_LAYOUT, dtype=dtype,
                                   extra_manifest=extra_manifest, verifier=verifier)


def export_speculators_head(params: Mapping, cfg, target_hf_config: Mapping, out_dir, layout: SpeculatorsLayout, *,
                            vocab=None, dtype: str = "bfloat16", extra_manifest: Optional[Mapping] = None,
                            verifier: Optional[str] = None) -> str:
    """export_dflash2 for any layout (`vocab`: the DraftVocab of a reduced draft vocab)."""
    dtype = export_dtype(dtype, "DFlash 2 export")
    extra = manifest_extra(extra_manifest, f"{layout.display} export")
    tensors = speculators_state_dict(params, cfg, layout.table, vocab, dtype)
    config = speculators_hf_config(cfg, target_hf_config, layout, dtype, verifier)
    ids = [int(i) for i in cfg.aux_layer_ids]
    findings = check_speculators_head(config, tensors, layout, target_config=target_hf_config, training_layer_ids=ids)
    if errors(findings):
        raise ExportValidationError(findings, f"{layout.display} export")
    return write_head_folder(
        out_dir, tensors, config, replaceable=lambda path: _replaceable(path, layout.model_type),
        refuse_existing=_refuse, check_written=written_head_check(target_hf_config, ids, f"{layout.display} export"),
        format=f"specjax-{layout.model_type}", variant=layout.model_type, dtype=dtype,
        draft_config=dataclasses.asdict(cfg), target_config=target_hf_config, warnings=findings, extra=extra)


def config_from_speculators(conf: Mapping, draft_config: Optional[Mapping] = None, layout: SpeculatorsLayout = None,
                            config_class=None):
    """The draft config (`config_class`, default DFlash2Config) of a speculators-layout config.json;
    `draft_config` (a specjax manifest's) supplies what the layout does not record (the target's depth)."""
    from specjax.layers.rope import rope_spec_from_hf

    if config_class is None:
        from specjax.drafts.dflash2 import DFlash2Config as config_class
    layout = layout or DFLASH2_LAYOUT
    tl = conf["transformer_layer_config"]
    saved = dict(draft_config or {})
    cfg = config_class(
        hidden_size=int(tl["hidden_size"]), num_layers=int(tl["num_hidden_layers"]),
        num_attention_heads=int(tl["num_attention_heads"]), num_key_value_heads=int(tl["num_key_value_heads"]),
        head_dim=int(tl["head_dim"]), intermediate_size=int(tl["intermediate_size"]),
        vocab_size=int(tl["vocab_size"]), draft_vocab_size=int(conf.get("draft_vocab_size") or tl["vocab_size"]),
        aux_layer_ids=tuple(int(i) - 1 for i in conf["aux_hidden_state_layer_ids"]),
        mask_token_id=int(conf["mask_token_id"]), block_size=int(conf["block_size"]),
        rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)), rope=rope_spec_from_hf(tl),
        max_position_embeddings=int(tl.get("max_position_embeddings", 2048)),
        num_target_layers=saved.get("num_target_layers"), sample_from_anchor=bool(conf.get("sample_from_anchor")),
        hidden_act=tl.get("hidden_act", "silu"), **{k: int(conf[k]) for k in layout.own_fields})
    cfg.validate()
    return cfg


def read_dflash2_head(folder: str) -> DFlash2Head:
    """params (fp32 numpy), DFlash2Config and the identity DraftVocab of a DFlash 2 head folder."""
    return read_speculators_head(folder, DFLASH2_LAYOUT)


def read_speculators_head(folder: str, layout: SpeculatorsLayout, config_class=None) -> DFlash2Head:
    """(params as fp32 numpy, draft config, DraftVocab) of a head folder of `layout`."""
    from specjax.drafts.vocab import DraftVocab

    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    conf, tensors, manifest, _ = read_head_files(folder)
    if conf.get("speculators_model_type") != layout.model_type:
        raise ValueError(f"{folder}: config.json is not a {layout.display} head's (speculators_model_type "
                         f"{conf.get('speculators_model_type')!r}). Fix: pass a {layout.display} export "
                         f"(specjax.export of a draft.type={layout.model_type} run)")
    findings = [f for f in check_speculators_head(conf, tensors, layout, check_finite=False) if f.level == "error"]
    if findings:
        raise ValueError(f"{folder}: " + "; ".join(str(f) for f in findings))
    try:
        cfg = config_from_speculators(conf, (manifest or {}).get("draft_config"), layout, config_class)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{folder}: config.json: {e}. Fix: export the head with specjax.export") from None
    leaves = []
    for e in weights.entries(layout.table, cfg):
        if e.file_name not in tensors:
            raise ValueError(f"{folder}: {WEIGHTS_FILE} lacks {e.file_name} (speculators and vLLM rebuild lm_head "
                             "from the target; specjax reads the head's own). Fix: export the head with specjax.export")
        arr = np.asarray(tensors.array(e.file_name), np.float32)
        leaves.append((e.path, np.ascontiguousarray(arr.T) if e.row.transpose else arr))
    if cfg.draft_vocab_size < cfg.vocab_size:
        d2t = np.asarray(tensors.array("d2t"), np.int64)
        vocab = DraftVocab.from_ids(np.arange(cfg.draft_vocab_size, dtype=np.int64) + d2t, cfg.vocab_size)
    else:
        vocab = DraftVocab.identity(cfg.vocab_size)
    return DFlash2Head(weights.nest(leaves), cfg, vocab)

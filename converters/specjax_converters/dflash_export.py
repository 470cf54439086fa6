"""Export a specjax DFlash block drafter as the folder vLLM loads with `"method": "dflash"`.

Layout: one folder with
  model.safetensors  every weight of specjax.drafts.dflash_weights.DFLASH_WEIGHTS under its file
                     name (kernels as HF [out, in] = kernel.T, norm scales as they are), in one float
                     dtype; plus d2t (int64 [Vd] offsets) and t2d (bool [V]) when the draft vocab is
                     smaller than the target's. No embed_tokens and no `model.` prefix: vLLM prefixes
                     the names itself and shares the target's embedding when the file has none.
  config.json        a Qwen3 config with architectures ["DFlashDraftModel"] (vLLM's registry entry for
                     its qwen3_dflash drafter) and a `dflash_config` block.
  specjax_manifest.json  the manifest every specjax export writes (head_files.write_manifest: sha256
                     of each file, variant "dflash", draft config, target config and its hash, plus
                     the caller's step / metrics / training config / target path); the draft config
                     of a causal head also records `causal: true`, which the folder validator checks

Every rule of specjax_converters.dflash_validate runs on the tensors and config before anything is
written, and again on the written folder before it is renamed into place.

What vLLM 0.32 reads from config.json (qwen3_dflash.py, config/speculative.py, v1/spec_decode):
  architectures                      ["DFlashDraftModel"]; names starting with "DFlash" are kept as they are
  model_type                         "qwen3": the keys below are parsed as a transformers Qwen3Config
  hidden_size, num_hidden_layers (the draft's layers), num_attention_heads, num_key_value_heads,
  head_dim, intermediate_size, hidden_act, rms_norm_eps, max_position_embeddings, attention_bias,
  rope_theta / rope_parameters       the decoder layers and their RoPE
  vocab_size                         the embedding size (the target's; must match to share it)
  draft_vocab_size                   lm_head rows; d2t is loaded when it differs from the target vocab
  target_hidden_size                 fc input = target_hidden_size * number of taps
  dflash_config.mask_token_id        the token embedded in the mask slots
  dflash_config.target_layer_ids     the taps, output-of-layer-k (vLLM adds 1 to get its aux layer ids)
  dflash_config.causal               the draft config's `causal`: false, bidirectional attention inside a
                                     block (DFlash); true, slot j sees slots 0..j (JetSpec)
  dflash_config.sample_from_anchor   whether slot 0 drafts too (false for DFlash)
  dflash_config.use_aux_hidden_state true: the context rows come from the target's taps through fc
`block_size`, `num_target_layers` and `layer_types` are not read by vLLM (it drafts
num_speculative_tokens slots; serve with block_size - 1 of them, the trained block); SpecForge's
DFlash model reads them. No top-level `eagle_aux_hidden_state_layer_ids` is written: vLLM would read
it in preference to dflash_config, and one source of the taps is enough.

The folder is written under a temporary name next to `out_dir` and renamed at the end, so a failed
export leaves no partial folder behind. Plain numpy + safetensors; no jax at import.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional

import numpy as np

from specjax.drafts import weights
from specjax.drafts.dflash_weights import DFLASH_VOCAB_TENSORS, DFLASH_WEIGHTS
from specjax_converters.dflash_validate import ARCHITECTURE, check_dflash_head
from specjax_converters.head_files import (TOKEN_FIELDS, earlier_export, export_dtype, file_arrays, flat_paths,
                                           manifest_extra, numpy_dtype, write_head_folder)
from specjax_converters.head_formats import written_head_check
from specjax_converters.head_rules import ExportValidationError, errors
from specjax_converters.target_facts import rope_dict, target_rope_dicts, target_text_config

__all__ = ["ARCHITECTURE", "CONFIG_FILE", "FORMAT", "VARIANT", "WEIGHTS_FILE", "dflash_hf_config", "dflash_state_dict",
           "export_dflash", "manifest_draft_config"]

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
FORMAT = "specjax-dflash"  # specjax_manifest.json's format
VARIANT = "dflash"  # and its variant


def _fail(field: str, problem: str, fix: str):
    raise ValueError(f"DFlash export: {field}: {problem}. Fix: {fix}.")








def dflash_state_dict(params: Mapping, cfg, vocab=None, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """File-named numpy tensors of a DFlash draft: one per DFLASH_WEIGHTS row for `cfg` (kernels
    transposed to HF [out, in], cast to `dtype`), plus d2t / t2d from `vocab` (a DraftVocab, or
    anything with those arrays) when cfg.draft_vocab_size < cfg.vocab_size. `vocab=None` means the
    full target vocab (then Vd must equal V)."""
    np_dtype = numpy_dtype(export_dtype(dtype, "DFlash export"))
    leaves = weights.entries(DFLASH_WEIGHTS, cfg)
    have, want = flat_paths(params), {e.path for e in leaves}
    if have != want:
        _fail("params", f"leaves {sorted('.'.join(p) for p in have - want)} are not in DFLASH_WEIGHTS and "
              f"{sorted('.'.join(p) for p in want - have)} are missing for this config (num_layers={cfg.num_layers})",
              "export the param tree specjax.drafts.dflash.init_draft_params builds for the same DFlashConfig")
    out = file_arrays(leaves, params, np_dtype, "DFlash export", "DFlashConfig")
    V, Vd = int(cfg.vocab_size), int(cfg.draft_vocab_size)
    if Vd == V:
        if vocab is not None and not np.array_equal(np.asarray(vocab.d2t), np.zeros(Vd, np.int64)):
            _fail("vocab", "a full-size draft vocab must be the identity map (d2t all 0)",
                  "pass vocab=None for a full-vocab draft")
        return out  # vLLM has no d2t parameter for a full-vocab draft
    if vocab is None:
        _fail("vocab", f"draft_vocab_size={Vd} < vocab_size={V} but no d2t/t2d were given",
              "pass the run's DraftVocab (specjax.drafts.vocab) so vLLM can map draft ids to target ids")
    d2t = np.asarray(vocab.d2t).astype(DFLASH_VOCAB_TENSORS["d2t"])
    t2d = np.asarray(vocab.t2d).astype(DFLASH_VOCAB_TENSORS["t2d"])
    if d2t.shape != (Vd,) or t2d.shape != (V,):
        _fail("vocab", f"d2t {d2t.shape} / t2d {t2d.shape}, expected ({Vd},) / ({V},)",
              "build the DraftVocab with the draft's draft_vocab_size over the target's vocab")
    if not np.array_equal(np.nonzero(t2d)[0], np.arange(Vd) + d2t):
        _fail("vocab", "t2d and d2t disagree (nonzero(t2d) != arange(Vd) + d2t)", "rebuild the DraftVocab")
    out["d2t"], out["t2d"] = d2t, t2d
    return out


def _check_against_target(cfg, tc: Mapping) -> None:
    if "vocab_size" in tc and int(tc["vocab_size"]) != int(cfg.vocab_size):
        _fail("vocab_size", f"the draft reads a {cfg.vocab_size}-row embedding but the target has {tc['vocab_size']}",
              "build the DFlashConfig from this target (specjax.drafts.dflash.config_from_target)")
    if "hidden_size" in tc and int(tc["hidden_size"]) != int(cfg.hidden_size):
        _fail("hidden_size", f"{cfg.hidden_size} differs from the target's {tc['hidden_size']}",
              "DFlash drafts use the target's hidden size; rebuild the config from the target")
    L = tc.get("num_hidden_layers")
    if L is not None and max(cfg.aux_layer_ids) >= int(L):
        _fail("aux_layer_ids", f"{list(cfg.aux_layer_ids)} reach past the target's {L} layers "
              "(output-of-layer-k, 0-based)", f"use ids in [0, {int(L) - 1}]")
    if not 0 <= int(cfg.mask_token_id) < int(tc.get("vocab_size", cfg.vocab_size)):
        _fail("mask_token_id", f"{cfg.mask_token_id} is outside the target vocab", "use a token id the target embeds")
    target_rope = rope_dict(tc)
    ours = rope_dict({"rope_parameters": cfg.rope.to_hf()})
    if target_rope is not None and ours not in target_rope_dicts(tc):  # one of the target's RoPEs (per layer type)
        _fail("rope", f"the draft was built with {ours} but the target config says {target_rope}",
              "use the target's RoPE (config_from_target copies it)")


def dflash_hf_config(cfg, target_hf_config: Mapping, dtype: str = "bfloat16") -> dict:
    """The draft's config.json (keys: see the module doc)."""
    cfg.validate()
    tc = target_text_config(target_hf_config)
    _check_against_target(cfg, tc)
    rope_parameters = cfg.rope.to_hf()
    legacy_scaling = None if rope_parameters["rope_type"] == "default" else {
        k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    n = int(cfg.num_layers)
    conf: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": n,
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_key_value_heads": int(cfg.num_key_value_heads),
        "head_dim": int(cfg.head_dim),
        "intermediate_size": int(cfg.intermediate_size),
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": float(cfg.rms_norm_eps),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": int(tc.get("max_position_embeddings", cfg.max_position_embeddings)),
        "rope_theta": rope_parameters["rope_theta"],
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope_parameters,
        "vocab_size": int(cfg.vocab_size),
        "draft_vocab_size": int(cfg.draft_vocab_size),
        "target_hidden_size": int(cfg.hidden_size),
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * n,
        "block_size": int(cfg.block_size),
        "num_target_layers": int(tc.get("num_hidden_layers", cfg.num_target_layers or 0)) or None,
        "dflash_config": {
            "mask_token_id": int(cfg.mask_token_id),
            "target_layer_ids": [int(i) for i in cfg.aux_layer_ids],
            "causal": bool(cfg.causal),
            "sample_from_anchor": bool(cfg.sample_from_anchor),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": export_dtype(dtype, "DFlash export"),
    }
    for key in TOKEN_FIELDS:
        if tc.get(key) is not None:
            conf[key] = tc[key]
    return conf


def manifest_draft_config(cfg):
    """The manifest's draft_config: the config's fields, plus `causal: true` for a causal head (a
    class attribute, which dataclasses.asdict leaves out); a bidirectional head's is the config itself."""
    if not cfg.causal:
        return cfg
    return {**dataclasses.asdict(cfg), "causal": True}


def _is_replaceable(path: str) -> bool:
    """An existing out_dir may be replaced only when empty or an earlier DFlash export (with or
    without the manifest: exports before it had none)."""
    return earlier_export(path, lambda conf: conf.get("architectures") == [ARCHITECTURE], manifest_optional=True)


def _refuse_existing(out_dir: str) -> None:
    _fail("out_dir", f"{out_dir} exists and is not an earlier DFlash export",
          "choose an empty or new folder (the export will not overwrite other files)")


def export_dflash(params: Mapping, cfg, target_hf_config: Mapping, out_dir: str | os.PathLike, *, vocab=None,
                  dtype: str = "bfloat16", extra_manifest: Optional[Mapping] = None, variant: str = VARIANT) -> str:
    """Validate, then write model.safetensors + config.json + specjax_manifest.json to `out_dir`
    (atomically: a temporary folder beside it, renamed at the end). Every rule of
    specjax_converters.dflash_validate runs on the tensors and config first and on the written files
    before the rename; an error raises ExportValidationError (a ValueError) and leaves no folder.
    `extra_manifest` adds keys to the manifest (step, metrics, ...; the writer's own are refused);
    `variant` is the manifest's name for the method ("jetspec" for a causal block). An
    existing out_dir is replaced only when it is empty or an earlier DFlash export. Returns the
    absolute out_dir."""
    dtype = export_dtype(dtype, "DFlash export")
    extra = manifest_extra(extra_manifest, "DFlash export")
    tensors = dflash_state_dict(params, cfg, vocab, dtype)
    config = dflash_hf_config(cfg, target_hf_config, dtype)
    ids = [int(i) for i in cfg.aux_layer_ids]
    findings = check_dflash_head(config, tensors, target_config=target_hf_config, training_layer_ids=ids,
                                 causal=cfg.causal)
    if errors(findings):
        raise ExportValidationError(findings, "DFlash export")
    return write_head_folder(
        out_dir, tensors, config, replaceable=_is_replaceable, refuse_existing=_refuse_existing,
        check_written=written_head_check(target_hf_config, ids, "DFlash export"), format=FORMAT, variant=variant,
        dtype=dtype, draft_config=manifest_draft_config(cfg), target_config=target_hf_config, warnings=findings,
        extra=extra)

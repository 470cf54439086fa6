"""Export a specjax EAGLE-1 head (draft.type eagle) as the folder vLLM loads with `"method": "eagle"`,
and read one back.

Layout: one folder with
  model.safetensors  every weight of specjax.drafts.eagle1_weights.EAGLE1_WEIGHTS under its file name
                     (fc.weight, layers.0.*; kernels as HF [out, in] = kernel.T, the norm scale as it
                     is), one float dtype. No embed_tokens, norm or lm_head, no `model.` prefix: vLLM
                     prefixes the names, shares the target's embedding and lm_head, and its EAGLE-1
                     class has no final norm.
  config.json        a LlamaConfig with architectures ["EagleLlamaForCausalLM"], num_hidden_layers 1
  specjax_manifest.json  the manifest every specjax export writes (variant "eagle", the draft config,
                     the target config and its hash)

What vLLM 0.32 reads from config.json (llama_eagle.py, llama.py's LlamaDecoderLayer,
transformers_utils/configs/eagle.py): architectures (a name starting with "Eagle" is kept as it is
under method "eagle"), model_type "llama" (parsed as a transformers LlamaConfig), hidden_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size, hidden_act,
rms_norm_eps, rope_parameters / rope_theta / rope_scaling, max_position_embeddings, attention_bias,
mlp_bias and vocab_size (the embedding it shares with the target).

Every rule of specjax_converters.eagle1_validate runs on the tensors and config before anything is
written, and on the written folder before it is renamed into place. No jax at import.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple, Optional

import numpy as np

from specjax.drafts import weights
from specjax.drafts.eagle1_weights import ARCHITECTURE, EAGLE1_WEIGHTS
from specjax_converters.eagle1_validate import check_eagle1_head, is_eagle1_config
from specjax_converters.head_files import (HeadTensors, TOKEN_FIELDS, earlier_export, export_dtype, file_arrays,
                                           flat_paths, manifest_extra, numpy_dtype, read_head_files, write_head_folder)
from specjax_converters.head_formats import written_head_check
from specjax_converters.head_rules import ExportValidationError, errors
from specjax_converters.target_facts import target_text_config

__all__ = ["FORMAT", "VARIANT", "Eagle1Head", "eagle1_hf_config", "eagle1_state_dict", "export_eagle1",
           "read_eagle1_head"]

FORMAT = "specjax-eagle1"  # specjax_manifest.json's format
VARIANT = "eagle"  # and its variant (vLLM's method name)


def _fail(field: str, problem: str, fix: str):
    raise ValueError(f"EAGLE-1 export: {field}: {problem}. Fix: {fix}.")








def eagle1_state_dict(params: Mapping, cfg, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """File-named numpy tensors of an EAGLE-1 draft: one per EAGLE1_WEIGHTS row (kernels transposed to
    HF [out, in]), cast to `dtype`."""
    np_dtype = numpy_dtype(export_dtype(dtype, "EAGLE-1 export"))
    leaves = weights.entries(EAGLE1_WEIGHTS, cfg)
    have, want = flat_paths(params), {e.path for e in leaves}
    if have != want:
        _fail("params", f"leaves {sorted('.'.join(p) for p in have - want)} are not in EAGLE1_WEIGHTS and "
              f"{sorted('.'.join(p) for p in want - have)} are missing",
              "export the param tree specjax.drafts.eagle1.init_draft_params builds for the same Eagle1Config")
    out = file_arrays(leaves, params, np_dtype, "EAGLE-1 export", "Eagle1Config")
    return out


def eagle1_hf_config(cfg, target_hf_config: Mapping, dtype: str = "bfloat16") -> dict:
    """The head's config.json (keys: see the module doc)."""
    cfg.validate()
    tc = target_text_config(target_hf_config)
    for key in ("hidden_size", "vocab_size"):
        if tc.get(key) is not None and int(tc[key]) != int(getattr(cfg, key)):
            _fail(key, f"the draft's {getattr(cfg, key)} differs from the target's {tc[key]}",
                  "build the Eagle1Config from this target (specjax.drafts.eagle1.config_from_target)")
    rope_parameters = cfg.rope.to_hf()
    legacy_scaling = None if rope_parameters["rope_type"] == "default" else {
        k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    conf: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": 1,
        "num_attention_heads": int(cfg.num_attention_heads),
        "num_key_value_heads": int(cfg.num_key_value_heads),
        "head_dim": int(cfg.head_dim),
        "intermediate_size": int(cfg.intermediate_size),
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": float(cfg.rms_norm_eps),
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": int(tc.get("max_position_embeddings", cfg.max_position_embeddings)),
        "rope_theta": rope_parameters["rope_theta"],
        "rope_scaling": legacy_scaling,
        "rope_parameters": rope_parameters,
        "vocab_size": int(cfg.vocab_size),
        "tie_word_embeddings": False,
        "torch_dtype": export_dtype(dtype, "EAGLE-1 export"),
    }
    for key in TOKEN_FIELDS:
        if tc.get(key) is not None:
            conf[key] = tc[key]
    return conf


def _is_replaceable(path: str) -> bool:
    """An existing out_dir may be replaced only when empty or an earlier EAGLE-1 export."""
    return earlier_export(path, is_eagle1_config)


def _refuse_existing(out_dir: str) -> None:
    _fail("out_dir", f"{out_dir} exists and is not an earlier EAGLE-1 export",
          "choose an empty or new folder (the export will not overwrite other files)")


def export_eagle1(params: Mapping, cfg, target_hf_config: Mapping, out_dir: str | os.PathLike, *,
                  dtype: str = "bfloat16", extra_manifest: Optional[Mapping] = None) -> str:
    """Validate, then write model.safetensors + config.json + specjax_manifest.json to `out_dir`
    atomically; an error raises ExportValidationError (a ValueError) and leaves no folder. Returns
    the absolute out_dir."""
    dtype = export_dtype(dtype, "EAGLE-1 export")
    extra = manifest_extra(extra_manifest, "EAGLE-1 export")
    tensors = eagle1_state_dict(params, cfg, dtype)
    config = eagle1_hf_config(cfg, target_hf_config, dtype)
    findings = check_eagle1_head(config, HeadTensors.from_arrays(tensors), target_config=target_hf_config)
    if errors(findings):
        raise ExportValidationError(findings, "EAGLE-1 export")
    return write_head_folder(
        out_dir, tensors, config, replaceable=_is_replaceable, refuse_existing=_refuse_existing,
        check_written=written_head_check(target_hf_config, (), "EAGLE-1 export"), format=FORMAT, variant=VARIANT,
        dtype=dtype, draft_config=cfg, target_config=target_hf_config, warnings=findings, extra=extra)


class Eagle1Head(NamedTuple):
    params: dict  # numpy fp32 leaves, the tree of specjax.drafts.eagle1.init_draft_params
    config: object  # specjax.drafts.eagle1.Eagle1Config
    vocab: object  # specjax.drafts.vocab.DraftVocab (the identity over the target vocab)


def read_eagle1_head(folder: str) -> Eagle1Head:
    """params (fp32 numpy), Eagle1Config and the identity DraftVocab of an EAGLE-1 head folder; a
    folder that fails the EAGLE-1 rules raises ValueError listing them."""
    from specjax.drafts.eagle1 import Eagle1Config
    from specjax.drafts.vocab import DraftVocab
    from specjax.layers.rope import rope_spec_from_hf

    folder = os.path.abspath(os.path.expanduser(os.fspath(folder)))
    conf, tensors, _, _ = read_head_files(folder)
    bad = errors(check_eagle1_head(conf, tensors, check_finite=False))
    if bad:
        raise ValueError(f"{folder} is not an EAGLE-1 head specjax can read:\n" + "\n".join(f"  {f}" for f in bad))
    hidden, n_heads = int(conf["hidden_size"]), int(conf["num_attention_heads"])
    cfg = Eagle1Config(
        hidden_size=hidden, intermediate_size=int(conf["intermediate_size"]), num_attention_heads=n_heads,
        num_key_value_heads=int(conf.get("num_key_value_heads") or n_heads),
        head_dim=int(conf.get("head_dim") or hidden // n_heads), vocab_size=int(conf["vocab_size"]),
        rms_norm_eps=float(conf.get("rms_norm_eps", 1e-6)), rope=rope_spec_from_hf(conf, longrope=True, yarn=True),
        max_position_embeddings=int(conf.get("max_position_embeddings", 2048)),
        hidden_act=str(conf.get("hidden_act", "silu")))
    leaves = []
    for e in weights.entries(EAGLE1_WEIGHTS, cfg):
        arr = np.asarray(tensors.array(e.file_name), np.float32)
        leaves.append((e.path, np.ascontiguousarray(arr.T) if e.row.transpose else arr))
    return Eagle1Head(weights.nest(leaves), cfg, DraftVocab.identity(cfg.vocab_size))

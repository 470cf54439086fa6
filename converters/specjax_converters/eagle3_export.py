"""Export a trained specjax EAGLE-3 draft as the checkpoint vLLM and SGLang load.

Layout (docs/eagle3-format.md, "Checkpoint layout"): one folder with
  model.safetensors     fc / midlayer.* / norm / lm_head weights (HF [out, in] = kernel.T), d2t int64
                        offsets [Vd], t2d bool [V]; no `model.` prefix and no embed_tokens (engines use
                        the target's embedding)
  config.json           a LlamaForCausalLMEagle3 config (draft.num_layers layers, untied head, the target's vocab,
                        RoPE and context, aux ids in both index conventions; EAGLE-3.1 flags and
                        looped-target depth fields when they apply)
  specjax_manifest.json sha256 of each file, variant, draft config, target config and its hash, plus
                        whatever the caller adds (step, metrics, training config, target path)

Every rule of specjax_converters.eagle3_validate runs before anything is written.

The folder is written under a temporary name next to `out_dir` and renamed at the end, so a failed
export leaves no partial folder behind.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional

import numpy as np

from specjax.drafts import weights
from specjax_converters.eagle3_validate import ARCHITECTURE, check_head
from specjax_converters.head_files import Finding, manifest_extra, target_config_sha256, write_head_folder
from specjax_converters.head_formats import written_head_check
from specjax_converters.head_rules import EMBED_KEY, ExportValidationError, errors
from specjax_converters.target_facts import target_text_config, target_virtual_depth

__all__ = [
    "CONFIG_FILE",
    "MANIFEST_FILE",
    "WEIGHTS_FILE",
    "eagle3_hf_config",
    "eagle3_state_dict",
    "export_eagle3",
    "infer_variant",
    "normalize_dtype",
    "target_config_sha256",
    "validate_export",
]

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "specjax_manifest.json"
FORMAT = "specjax-eagle3"

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
# Target config fields copied verbatim when present (special-token ids the engines may read).
_COPIED_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
VARIANTS = ("eagle3", "eagle3.1")
log = logging.getLogger("specjax")


def normalize_dtype(dtype: str) -> str:
    name = str(dtype).lower()
    if name not in _DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not supported; use one of bfloat16 (bf16) or float32 (fp32).")
    return _DTYPES[name]


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for name, value in tree.items():
        path = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, Mapping):
            out.update(_flatten(value, path))
        else:
            out[path] = value
    return out


def eagle3_state_dict(draft_params: Mapping, cfg, vocab, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """File-named numpy tensors, one per weight of the EAGLE-3 table (specjax.drafts.weights) for
    `cfg`: kernels transposed to HF [out, in], norm scales as they are, cast to `dtype`; plus d2t
    (int64; only for a reduced draft vocab) and t2d (bool) from `vocab`; a trained embedding
    (draft.train_embedding: param embed_tokens.embedding [V, H]) as embed_tokens.weight, which vLLM
    loads as the draft's own when it differs from the target's."""
    np_dtype = _np_dtype(normalize_dtype(dtype))
    leaves = weights.entries(weights.EAGLE3_WEIGHTS, cfg)
    own_embedding = getattr(cfg, "train_embedding", False)
    have = set(_flatten(draft_params)) - ({weights.EAGLE3_EMBED_PARAM} if own_embedding else set())
    want = {".".join(e.path) for e in leaves}
    if have != want:
        raise ValueError(f"draft params {sorted(have - want)} are not in the EAGLE-3 weight table and "
                         f"{sorted(want - have)} are missing for this draft config (fc_norm={getattr(cfg, 'fc_norm', False)}); "
                         "the export knows only the layout of specjax/drafts/weights.py.")
    out: dict[str, np.ndarray] = {}
    for e in leaves:
        # float32 first: jax bf16 arrays and numpy ml_dtypes both convert cleanly from there.
        arr = np.asarray(weights.leaf(draft_params, e.path), dtype=np.float32)
        if e.row.transpose:
            arr = arr.T
        out[e.file_name] = np.ascontiguousarray(arr.astype(np_dtype))
    if own_embedding:
        table = np.asarray(weights.leaf(draft_params, tuple(weights.EAGLE3_EMBED_PARAM.split("."))), dtype=np.float32)
        out[EMBED_KEY] = np.ascontiguousarray(table.astype(np_dtype))
    full_vocab = int(cfg.draft_vocab_size) == int(cfg.vocab_size)  # a DraftVocab's ids are sorted: the identity
    for name in weights.EAGLE3_VOCAB_TENSORS:
        # a full-vocab head ships no d2t: vLLM (0.32) creates draft_id_to_target_id only for a reduced
        # vocab and refuses a head that carries one ("There is no module or parameter named
        # 'draft_id_to_target_id'"); without it every engine maps draft id i to target id i
        if not (full_vocab and name == "d2t"):
            out[name] = np.asarray(getattr(vocab, name))
    return out


def _legacy_rope_scaling(rope_parameters: dict) -> Optional[dict]:
    if rope_parameters.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope_parameters.items() if k != "rope_theta"}


def infer_variant(cfg) -> str:
    """"eagle3.1" when the draft was trained with fc_norm or norm_output, else "eagle3"."""
    return "eagle3.1" if (getattr(cfg, "fc_norm", False) or getattr(cfg, "norm_output", False)) else "eagle3"


def normalize_variant(variant: Optional[str], cfg) -> str:
    trained = infer_variant(cfg)
    if variant is None:
        return trained
    v = str(variant).lower().replace("eagle-", "eagle")
    if v not in VARIANTS:
        raise ValueError(f"export variant {variant!r} is not supported; use one of {', '.join(VARIANTS)}.")
    if v != trained:
        flags = f"fc_norm={getattr(cfg, 'fc_norm', False)}, norm_output={getattr(cfg, 'norm_output', False)}"
        raise ValueError(
            f"EAGLE-3 export: variant: --variant {v} but the draft was trained as {trained} ({flags}); the "
            f"variant is fixed at training time. Fix: export with --variant {trained}"
            + (", or retrain with draft.fc_norm=true / draft.norm_output=true" if v == "eagle3.1" else "")
        )
    return v


def eagle3_hf_config(cfg, target_hf_config: Mapping, dtype: str = "bfloat16") -> dict:
    """The draft's config.json (docs/eagle3-format.md, "config.json keys")."""
    tc = target_text_config(target_hf_config)
    rope_parameters = cfg.rope.to_hf()
    out_ids = [int(i) for i in cfg.aux_layer_ids]
    conf = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": int(getattr(cfg, "num_layers", 1)),
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": int(tc["vocab_size"]),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "max_position_embeddings": int(tc.get("max_position_embeddings", cfg.max_position_embeddings)),
        # Both RoPE layouts: transformers 5 reads rope_parameters, older stacks rope_theta/rope_scaling.
        "rope_theta": rope_parameters["rope_theta"],
        "rope_scaling": _legacy_rope_scaling(rope_parameters),
        "rope_parameters": rope_parameters,
        # the legacy layout's partial rotary (rope_scaling is None for default RoPE); vLLM's Llama reads it here
        **({"partial_rotary_factor": rope_parameters["partial_rotary_factor"]}
           if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0 else {}),
        "tie_word_embeddings": False,  # SGLang would otherwise use embed_tokens as a full-vocab head
        "attention_bias": False,
        "mlp_bias": False,
        # SGLang reads the nested ids (output-of-layer-k), vLLM the top-level ones (input-to-layer-k).
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": out_ids, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in out_ids],
        # Engines feed the pre-norm hidden to the next draft step when these are false, which is how
        # the draft was trained (`norm_output` means something else in SpecForge: docs/eagle3-format.md,
        # "EAGLE-3.1 flags (fc_norm, norm_output)").
        "norm_before_residual": False,
        "norm_output": bool(getattr(cfg, "norm_output", False)),
        "torch_dtype": normalize_dtype(dtype),
    }
    if getattr(cfg, "parallel_drafting", False):
        # P-EAGLE: vLLM's parallel drafter reads the mask token from here (and mask_hidden from the weights)
        conf["mask_token_id"] = int(cfg.mask_token_id)
    if infer_variant(cfg) == "eagle3.1":
        conf["fc_norm"] = bool(cfg.fc_norm)  # only EAGLE-3.1 heads carry the key (and fc_norm.{i}.weight)
    loops = int(tc.get("num_loops") or 1)
    if loops > 1:
        # Looped target (Nanbeige card): the aux ids index the unrolled depth L*loops, and the draft's own
        # layer must sit after it. vLLM stamps `target_layer_count` and names the draft layer
        # layers.<count>; from the physical L it would collide with loop 2's layer L.
        conf["target_layer_count"] = target_virtual_depth(target_hf_config)
        conf["target_num_loops"] = loops
        conf["target_num_hidden_layers"] = int(tc["num_hidden_layers"])
        for key in ("loop_start", "loop_end"):
            if tc.get(key) is not None:
                conf[f"target_{key}"] = int(tc[key])
    for key in _COPIED_TOKEN_FIELDS:
        if tc.get(key) is not None:
            conf[key] = tc[key]
    return conf


def validate_export(tensors: Mapping[str, np.ndarray], config: Mapping, target_hf_config: Mapping,
                    training_aux_ids=None, variant: Optional[str] = None) -> list[Finding]:
    """Every contract rule (specjax_converters.eagle3_validate) on the in-memory head; raises
    ExportValidationError (a ValueError naming each field and its fix) on any error, else returns
    the warnings."""
    findings = check_head(config, tensors, target_config=target_hf_config, training_aux_ids=training_aux_ids,
                          variant=variant)
    if errors(findings):
        raise ExportValidationError(findings)
    return findings


def _is_replaceable(path: str) -> bool:
    """An existing out_dir may be replaced only if it is empty or an earlier export."""
    if not os.path.isdir(path):
        return False
    entries = os.listdir(path)
    return not entries or MANIFEST_FILE in entries


def _fail(field: str, problem: str, fix: str) -> None:
    raise ValueError(f"EAGLE-3 export: {field}: {problem}. Fix: {fix}")


def _refuse_existing(out_dir: str) -> None:
    _fail("out_dir", f"{out_dir} exists and is not an earlier specjax export",
          "choose an empty or new folder (the export will not overwrite other files)")


def export_eagle3(
    draft_params: Mapping,
    draft_cfg,
    vocab,
    target_hf_config: Mapping,
    out_dir: str | os.PathLike,
    dtype: str = "bfloat16",
    extra_manifest: Optional[Mapping] = None,
    variant: Optional[str] = None,
) -> str:
    """Validate, then write model.safetensors + config.json + specjax_manifest.json to `out_dir`.

    `vocab` needs `d2t` (int64 [Vd]) and `t2d` (bool [V]) (a DraftVocab). `variant` ("eagle3" |
    "eagle3.1", default: what the draft was trained as) must match the draft's fc_norm/norm_output.
    Every rule of specjax_converters.eagle3_validate runs on the tensors and config before anything
    touches the disk, and again on the written folder before it is renamed into place; any error
    raises ExportValidationError (a ValueError) and leaves no folder. An existing `out_dir` is
    replaced only when it is empty or holds an earlier export. Returns the absolute out_dir.
    """
    dtype = normalize_dtype(dtype)
    variant = normalize_variant(variant, draft_cfg)
    extra = manifest_extra(extra_manifest, "EAGLE-3 export")
    tensors = eagle3_state_dict(draft_params, draft_cfg, vocab, dtype)
    config = eagle3_hf_config(draft_cfg, target_hf_config, dtype)
    aux_ids = [int(i) for i in draft_cfg.aux_layer_ids]
    warnings = validate_export(tensors, config, target_hf_config, training_aux_ids=aux_ids, variant=variant)
    out_dir = write_head_folder(
        out_dir, tensors, config, replaceable=_is_replaceable, refuse_existing=_refuse_existing,
        check_written=written_head_check(target_hf_config, aux_ids, "EAGLE-3 export"), format=FORMAT,
        variant=variant, dtype=dtype, draft_config=draft_cfg, target_config=target_hf_config, warnings=warnings,
        extra=extra)
    if variant == "eagle3.1":
        log.warning("export: %s is an EAGLE-3.1 head (fc_norm=%s, norm_output=%s): it needs 2026+ engines "
                    "(vLLM/SGLang with fc_norm and norm_output support)", out_dir, draft_cfg.fc_norm,
                    draft_cfg.norm_output)
    return out_dir

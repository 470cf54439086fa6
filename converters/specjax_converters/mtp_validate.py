"""The rules of an MTP export (draft.type mtp; specjax.drafts.mtp_family): the folder vLLM 0.32's native
"mtp" method loads as its draft model.

A folder is this format when its config.json is the config of a target whose MTP layer specjax trains
(MTP_ARCHS). Rules: the config declares one MTP layer (num_nextn_predict_layers; Qwen3.5 also
mtp_num_hidden_layers, which vLLM reads for it); every tensor of the layer is there under the
checkpoint's own name (model.layers.{num_hidden_layers}.* / mtp.*) with the shape the config gives
(specjax.drafts.mtp.mtp_weights, the target's weight table); the weights are float and finite;
other tensors (a whole stitched target checkpoint) are a warning, since vLLM ignores them; with a
target config, hidden_size and vocab_size match it. No jax at import (the names come from
specjax.drafts.mtp when a folder is checked).
"""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from specjax_converters.head_files import Finding, HeadTensors
from specjax_converters.head_rules import HeadFormat
from specjax_converters.target_facts import target_text_config

MTP_ARCHS = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
             "Qwen3_5MoeForCausalLM")
FLOAT_DTYPES = ("F32", "BF16", "F16")


def is_mtp_config(config: Mapping) -> bool:
    archs = config.get("architectures") or [""]
    return isinstance(archs, list) and str(archs[0]) in MTP_ARCHS


def check_mtp_head(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping] = None,
                   check_finite: bool = True) -> list[Finding]:
    from specjax.drafts import mtp
    from specjax.targets.registry import get_target_class

    out: list[Finding] = []

    def bad(rule, field, problem, fix, level="error"):
        out.append(Finding(f"mtp.{rule}", field, problem, fix, level))

    try:
        cfg = mtp.MtpConfig(target=get_target_class(config).config_class.from_hf(dict(config)))
        cfg.validate()
    except ValueError as e:
        bad("config", "config.json", str(e), "export the layer with the target's own config.json")
        return out
    keys = ["num_nextn_predict_layers"] + (["mtp_num_hidden_layers"] if cfg.layout == mtp.QWEN3_NEXT
                                           and cfg.target.architecture.startswith("Qwen3_5") else [])
    for key in keys:
        if config.get(key) != 1:
            bad("layers", key, f"{config.get(key)!r}: vLLM builds this many MTP layers and the folder holds one",
                f"set {key} to 1")
    expected = {}
    for w in mtp.mtp_weights(cfg):
        shape = tuple(reversed(w.shape)) if w.transpose else tuple(w.shape)
        if w.expert_stacked:
            expected.update({w.file_name.replace("{e}", str(e)): shape[1:] if not w.transpose else
                             tuple(reversed(w.shape[1:])) for e in range(w.shape[0])})
        else:
            expected[w.file_name] = shape
    for name, shape in expected.items():
        if name not in tensors:
            bad("tensors.missing", name, "missing (vLLM's loader fails its MTP completeness check or leaves it unset)",
                "export every tensor of the layer")
        elif tuple(tensors.shape(name)) != shape:
            bad("tensors.shape", name, f"shape {tuple(tensors.shape(name))}, the config gives {shape}",
                "export the layer trained for this config")
        elif tensors.dtype(name) not in FLOAT_DTYPES:
            bad("tensors.dtype", name, f"dtype {tensors.dtype(name)}", "export in float32, bfloat16 or float16")
        elif check_finite and not tensors.all_finite(name):
            bad("tensors.finite", name, "holds NaN or Inf", "export an earlier checkpoint")
    extra = sorted(set(tensors.names) - set(expected))
    if extra:
        bad("tensors.extra", extra[0], f"{len(extra)} tensor(s) besides the MTP layer (vLLM's MTP loader skips them)",
            "nothing, for a stitched target checkpoint; else export the layer alone", level="warning")
    if target_config:
        tc = target_text_config(target_config)
        for key in ("hidden_size", "vocab_size"):
            if tc.get(key) is not None and int(tc[key]) != int(config.get(key, -1)):
                bad(f"target.{key}", key, f"{config.get(key)} != the target's {tc[key]}",
                    "serve it with the target it was trained on")
    return out


def check_folder_head(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping],
                      training_ids: Optional[Sequence[int]], manifest: Optional[Mapping],
                      check_finite: bool) -> list[Finding]:
    """`check_mtp_head` for the folder dispatch (the layer reads no taps: training_ids unused)."""
    return check_mtp_head(config, tensors, target_config=target_config, check_finite=check_finite)


HEAD_FORMAT = HeadFormat(name="mtp", recognises=is_mtp_config, layout=lambda config: "mtp",
                         check=check_folder_head)

"""The head formats specjax reads, and `validate_folder`, the one entry point that validates any head
folder with its format's rules.

`FORMATS` lists each format's `HeadFormat` (specjax_converters.head_rules), most specific first: a
DSpark drafter (dspark_validate: architectures ["Qwen3DSparkModel"]), a DFlash block drafter
(dflash_validate), a DFlash 2 and an XPress head (dflash2_validate / xpress_validate: speculators'
layouts), an XPress head in vLLM 0.34's own layout (xpress_validate: architectures
["Qwen3XPressModel"]), an EAGLE-1 head (eagle1_validate: architectures ["EagleLlamaForCausalLM"]), an MTP export
(mtp_validate: a target config.json whose MTP layer specjax trains) and EAGLE-3
(eagle3_validate: EAGLE-3 / EAGLE-3.1 / P-EAGLE,
the Llama-EAGLE3 and speculators layouts), which takes every folder no earlier format recognises.
`format_of(config)` is the format of a config.json; `written_head_check` is every exporter's check of
the folder it wrote. This module imports the validators; none
imports it, so there is no import circle. No jax at import.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional, Sequence

from specjax.hf_config_checks import check_config_fields, read_config_json
from specjax_converters import (dflash2_validate, dflash_validate, dspark_validate, eagle1_validate, eagle3_validate,
                                mtp_validate, xpress_validate)
from specjax_converters.head_files import CONFIG_FILE, MANIFEST_FILE, Finding, read_head_files
from specjax_converters.head_rules import ExportValidationError, HeadFormat, errors

__all__ = ["FORMATS", "errors", "format_of", "validate_folder", "written_head_check"]

FORMATS: tuple[HeadFormat, ...] = (dspark_validate.HEAD_FORMAT, dflash_validate.HEAD_FORMAT,
                                   dflash2_validate.HEAD_FORMAT, xpress_validate.HEAD_FORMAT,
                                   xpress_validate.VLLM034_HEAD_FORMAT, eagle1_validate.HEAD_FORMAT,
                                   mtp_validate.HEAD_FORMAT, eagle3_validate.HEAD_FORMAT)


def format_of(config: Mapping) -> HeadFormat:
    """The format of a head's config.json: the first of FORMATS that recognises it."""
    for fmt in FORMATS:
        if fmt.recognises(config):
            return fmt
    raise ValueError(f"no head format recognises this config.json (formats: {[f.name for f in FORMATS]})")


def _load_target_config(path: str) -> dict:
    path = os.path.expanduser(os.fspath(path))
    cpath = path if path.endswith(".json") else os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cpath):
        raise ValueError(f"target {path}: no {CONFIG_FILE} there; pass the target model's local folder.")
    config = read_config_json(cpath, "model config")
    check_config_fields(config, cpath)
    return config


def validate_folder(
    folder: str,
    *,
    target: Optional[str | Mapping] = None,
    training_aux_ids: Optional[Sequence[int]] = None,
    check_finite: bool = True,
) -> tuple[list[Finding], dict]:
    """(findings, info) for a head folder. The target config comes from `target` (a folder, a
    config.json path or a dict), else from a specjax manifest, else from a speculators config's local
    verifier path; `info` says which, plus the layout. Raises ValueError for folders that are not heads.

    The rules are those of the folder's format (`format_of`): a DFlash head (layout "dflash") gets
    dflash_validate's, any other folder eagle3_validate's; `training_aux_ids` are the taps the head
    was trained on (else the manifest draft_config's aux_layer_ids)."""
    config, tensors, manifest, findings = read_head_files(folder)
    for fmt in FORMATS:
        refused = fmt.refusal(os.path.abspath(os.path.expanduser(os.fspath(folder))), config)
        if refused:
            raise ValueError(refused)
    fmt = format_of(config)
    info: dict[str, Any] = {"layout": fmt.layout(config), "target_source": None}
    target_config = None
    if isinstance(target, Mapping):
        target_config, info["target_source"] = dict(target), "argument"
        check_config_fields(target_config, "target config (argument)")
    elif target:
        target_config, info["target_source"] = _load_target_config(target), os.path.abspath(os.fspath(target))
    elif manifest and isinstance(manifest.get("target_config"), Mapping):
        target_config, info["target_source"] = dict(manifest["target_config"]), MANIFEST_FILE
        check_config_fields(target_config, os.path.join(os.path.abspath(os.path.expanduser(os.fspath(folder))),
                                                        MANIFEST_FILE), "target_config.")
    else:
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        if verifier and os.path.isfile(os.path.join(os.fspath(verifier), CONFIG_FILE)):
            target_config, info["target_source"] = _load_target_config(verifier), verifier
    if training_aux_ids is None and manifest and isinstance(manifest.get("draft_config"), Mapping):
        saved = manifest["draft_config"]
        # DFlash manifests written before the taps had one name spell them target_layer_ids
        training_aux_ids = saved.get("aux_layer_ids", saved.get("target_layer_ids"))
    findings += fmt.check(config, tensors, target_config=target_config, training_ids=training_aux_ids,
                          manifest=manifest, check_finite=check_finite)
    if target_config is None:
        findings.append(Finding("target.unknown", "target", "no target config given, so the target rules "
                                "(hidden size, vocab, RoPE, context, KV heads, aux range / dflash_config.target_layer_ids) "
                                "were not run",
                                "pass --target <target folder>", "warning"))
    return findings, info


def written_head_check(target_hf_config: Mapping, training_ids: Sequence[int], what: str) -> Callable[[str], None]:
    """An exporter's check of the folder it wrote (head_files.write_head_folder's `check_written`): the
    folder read back (safetensors header, dtypes, manifest hashes) and validated before it is
    published; errors raise ExportValidationError naming `what` (written files)."""
    def check(folder: str) -> None:
        findings, _ = validate_folder(folder, target=target_hf_config, training_aux_ids=training_ids,
                                      check_finite=False)
        if errors(findings):
            raise ExportValidationError(findings, f"{what} (written files)")

    return check

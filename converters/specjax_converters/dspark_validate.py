"""Validate a DSpark head folder: the layout vLLM 0.32 loads as `Qwen3DSparkModel`
(model_executor/models/qwen3_dspark.py) with `"method": "dspark"`.

config.json: architectures ["Qwen3DSparkModel"] (vLLM's registry maps it to qwen3_dspark's
Qwen3DSparkForCausalLM; config/speculative.py picks method "dspark" for it), model_type "qwen3" (the
keys are parsed as a transformers Qwen3Config), the decoder keys of the DFlash backbone, and at the top
level the keys vLLM's DSpark path reads:
  mask_token_id            the token of the mask slots (v1/worker/gpu/spec_decode/utils.py
                           get_parallel_drafting_token_id; DFlashQwen3Model's fallback after dflash_config)
  target_layer_ids         the taps, output-of-layer-k; vLLM taps k+1 (eagle3_utils
                           get_eagle3_aux_layers_from_config: eagle_aux_hidden_state_layer_ids, then
                           dflash_config.target_layer_ids, then dspark_target_layer_ids, then these win)
  markov_rank              the Markov head's rank (Qwen3DSparkModel always builds the head)
  markov_head_type         speculators' "vanilla", "gated" (+ markov_head.gate_proj) or "rnn"
                           (+ markov_head.joint_proj); absent = vanilla. vLLM 0.32 builds only the
                           vanilla head (qwen3_dspark.py; config/speculative.py refuses the others for
                           Qwen3-Omni DSpark): a gated / rnn head is a warning (speculators loads it)
  block_size               vLLM's default num_speculative_tokens for dspark (config/speculative.py)
  sample_from_anchor       read by the DSpark speculator (absent = true): N query slots, slot 0 drafts
  enable_confidence_head, confidence_head_with_markov   the confidence head and its input width
  draft_vocab_size / vocab_size / target_hidden_size    as for DFlash
weights: DSPARK_WEIGHTS (specjax.drafts.dspark_weights): the DFlash backbone's names plus
markov_head.markov_w1/markov_w2 (+ gate_proj or joint_proj) and confidence_head.proj.weight/bias; d2t when the draft vocab is
smaller (vLLM refuses a reduced-vocab DSpark head without d2t or lm_head).

The backbone's rules are dflash_validate's, run on the DFlash view of the head (`backbone_view`: the
top-level mask token and taps as a dflash_config block, the backbone tensors) and reported under
DSpark's own field names; the rules here add the DSpark keys and the two heads. Each finding names
a rule id, the field, the problem and the fix. No jax at import.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from specjax.drafts import weights
from specjax.drafts.dspark_weights import DSPARK_HEADS, MARKOV_HEAD_TYPES
from specjax_converters import dflash_validate
from specjax_converters.head_files import Finding, HeadTensors
from specjax_converters.head_rules import HeadFormat, check_weight_dtypes

__all__ = ["ARCHITECTURE", "HEAD_FORMAT", "HEAD_PREFIXES", "VLLM_MARKOV_HEAD_TYPE", "backbone_view", "check_dspark_head",
           "dspark_shape", "is_dspark_config"]

ARCHITECTURE = "Qwen3DSparkModel"
VLLM_MARKOV_HEAD_TYPE = "vanilla"  # the one Markov head vLLM 0.32's Qwen3DSparkModel builds
HEAD_PREFIXES = ("markov_head.", "confidence_head.")
# backbone rules that do not apply to a DSpark head (vLLM's DFlash-only refusals)
_NOT_DSPARK = {"dflash.architectures", "dflash.sample_from_anchor", "dflash.config"}


def is_dspark_config(conf: Mapping) -> bool:
    """A DSpark head's config.json: architectures ["Qwen3DSparkModel"]."""
    return list(conf.get("architectures") or []) == [ARCHITECTURE]


def _pos_int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def dspark_shape(config: Mapping):
    """The weight table's view of a DSpark config.json (DFlash's decoder keys + the head keys)."""
    import types

    base = dflash_validate.dflash_shape(backbone_view(config))
    return types.SimpleNamespace(**vars(base), vocab_size=int(config["vocab_size"]),
                                 markov_rank=int(config["markov_rank"]),
                                 markov_gated=config.get("markov_head_type") == "gated",
                                 markov_rnn=config.get("markov_head_type") == "rnn",
                                 enable_confidence_head=bool(config.get("enable_confidence_head", False)),
                                 confidence_head_with_markov=bool(config.get("confidence_head_with_markov", False)))


def backbone_view(config: Mapping) -> dict:
    """The DFlash config.json of a DSpark head's backbone: its mask token and taps as a dflash_config
    block (what dflash_validate and dflash_export read)."""
    out = {k: v for k, v in config.items() if k not in ("mask_token_id", "target_layer_ids")}
    out["architectures"] = [dflash_validate.ARCHITECTURE]
    out["dflash_config"] = {"causal": False, "use_aux_hidden_state": config.get("use_aux_hidden_state", True),
                            "sample_from_anchor": bool(config.get("sample_from_anchor", True))}
    for key in ("mask_token_id", "target_layer_ids"):
        if key in config:
            out["dflash_config"][key] = config[key]
    return out


def _renamed(f: Finding) -> Finding:
    field = f.field.replace("dflash_config.", "")
    rule = f.rule.replace("dflash.", "dspark.", 1) if f.rule.startswith("dflash.") else f.rule
    return Finding(rule, field, f.problem, f.fix.replace("dflash_config", "config.json"), f.level)


def check_dspark_head(config: Mapping, tensors: HeadTensors | Mapping[str, Any], *,
                      target_config: Optional[Mapping] = None, training_layer_ids: Optional[Sequence[int]] = None,
                      check_finite: bool = True) -> list[Finding]:
    """All findings for one DSpark head (see the module doc)."""
    if not isinstance(tensors, HeadTensors):
        tensors = HeadTensors.from_arrays(tensors)
    out: list[Finding] = []

    def bad(rule, field, problem, fix, level="error"):
        out.append(Finding(rule, field, problem, fix, level))

    arch = config.get("architectures")
    if arch != [ARCHITECTURE]:
        bad("dspark.architectures", "architectures", f"{arch!r}, not [{ARCHITECTURE!r}] (the name vLLM maps to its "
            "qwen3_dspark drafter and to method 'dspark')", f'write "architectures": ["{ARCHITECTURE}"]')
    if "dflash_config" in config:
        bad("dspark.dflash_config", "dflash_config", "present: vLLM reads its mask_token_id and target_layer_ids "
            "before the top-level ones a DSpark head carries", "drop dflash_config (write the top-level keys only)")
    for key in ("eagle_aux_hidden_state_layer_ids", "dspark_target_layer_ids"):
        if key in config:
            bad("dspark.aux_override", key, "present: vLLM taps these in preference to target_layer_ids",
                f"drop {key} (target_layer_ids, output-of-layer-k, is enough)")
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in config:
            bad(f"dspark.{key}", key, "absent at the top level (vLLM's DSpark path reads it there)",
                f'write "{key}" (specjax.export does)')
    r = config.get("markov_rank")
    if _pos_int(r) is None:
        bad("dspark.markov_rank", "markov_rank", f"{r!r}: must be a positive integer (vLLM always builds the Markov "
            "head with this rank)", "write the rank the head was trained with (draft.markov_rank)")
    mtype = config.get("markov_head_type", VLLM_MARKOV_HEAD_TYPE)
    if mtype not in MARKOV_HEAD_TYPES:
        bad("dspark.markov_head_type", "markov_head_type", f"{mtype!r} is not one of speculators' Markov heads "
            f"({', '.join(MARKOV_HEAD_TYPES)})", "write the markov_head_type the head was trained with")
    elif mtype != VLLM_MARKOV_HEAD_TYPE:
        bad("dspark.markov_head_type", "markov_head_type", f"{mtype!r}: vLLM 0.32's Qwen3DSparkModel builds only the "
            "vanilla head (markov_w1, markov_w2), so it cannot load this head (speculators 0.9 can)",
            "train with draft.markov_head_type=vanilla to serve the head with vLLM", "warning")
    sfa = config.get("sample_from_anchor")
    if sfa is None:
        bad("dspark.sample_from_anchor", "sample_from_anchor", "absent: vLLM's DSpark speculator then drafts from the "
            "anchor (true), specjax's decoder reads the same default", 'write "sample_from_anchor" explicitly',
            "warning")
    elif not isinstance(sfa, bool):
        bad("dspark.sample_from_anchor", "sample_from_anchor", f"{sfa!r} is not a boolean", "write true or false")
    for key in ("enable_confidence_head", "confidence_head_with_markov"):
        if not isinstance(config.get(key, False), bool):
            bad("dspark.confidence_head", key, f"{config[key]!r} is not a boolean", "write true or false")
    conf_on = bool(config.get("enable_confidence_head", False))
    if config.get("confidence_head_with_markov") and not conf_on:
        bad("dspark.confidence_head", "confidence_head_with_markov", "true without enable_confidence_head",
            "write false (there is no confidence head)", "warning")
    # the taps, then DFlash's rules on the backbone's DFlash view
    heads = [k for k in tensors.names if k.startswith(HEAD_PREFIXES)]
    found = dflash_validate.check_block_backbone("dspark", config, backbone_view(config), tensors, HEAD_PREFIXES,
                                                 target_config=target_config, training_layer_ids=training_layer_ids,
                                                 check_finite=check_finite)
    out += [_renamed(f) for f in found if f.rule not in _NOT_DSPARK]
    if _pos_int(r) is None or any(_pos_int(config.get(k)) is None for k in ("hidden_size", "vocab_size")):
        return out
    try:
        expected = {e.file_name: e for e in weights.entries(DSPARK_HEADS, dspark_shape(config))}
    except (KeyError, TypeError, ValueError) as e:
        bad("config.required", "config", f"cannot derive the head shapes ({e!r})", "write the decoder shape keys")
        return out
    for k, e in expected.items():
        if k not in tensors:
            bad("keys.missing", k, "missing from the weights (vLLM would run the head uninitialised)",
                "export every tensor of the DSpark key set (specjax.drafts.dspark_weights)")
        elif tuple(tensors.shape(k)) != e.file_shape:
            bad("shapes", k, f"shape {tuple(tensors.shape(k))} but config.json implies {e.file_shape}",
                "export the config the weights were trained with (markov_rank, markov_head_type, vocab sizes, "
                "confidence_head_with_markov)")
    for k in heads:
        if k in expected:
            continue
        if k.startswith("confidence_head.") and not conf_on:
            bad("dspark.confidence_head", k, "present but enable_confidence_head is not true: vLLM drops it",
                'write "enable_confidence_head": true, or drop the tensor', "warning")
        else:
            bad("keys.unknown", k, f"not part of a {mtype!r} DSpark head's tensors (specjax.drafts.dspark_weights)",
                "remove it from the export, or write the markov_head_type it belongs to")
    check_weight_dtypes(config, tensors, [k for k in expected if k in tensors], bad, check_finite,
                        {k: e.file_shape for k, e in expected.items()})
    return out


def check_folder_head(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping],
                      training_ids: Optional[Sequence[int]], manifest: Optional[Mapping],
                      check_finite: bool) -> list[Finding]:
    return check_dspark_head(config, tensors, target_config=target_config, training_layer_ids=training_ids,
                             check_finite=check_finite)


# the folder dispatch's entry (specjax_converters.head_formats)
HEAD_FORMAT = HeadFormat(name="dspark", recognises=is_dspark_config, layout=lambda config: "dspark",
                         check=check_folder_head)

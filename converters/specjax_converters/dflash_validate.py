"""Validate a DFlash block-drafter head folder (docs/eagle3-format.md, "DFlash (block drafting)").

A DFlash head is the folder vLLM 0.32 serves with `"method": "dflash"`: config.json with
`architectures: ["DFlashDraftModel"]` (vLLM's registry maps that name to its qwen3_dflash drafter)
and a `dflash_config` block, plus model.safetensors named by the DFLASH_WEIGHTS table
(specjax.drafts.dflash_weights). The EAGLE-3 rules (specjax_converters.eagle3_validate) do not apply
to it: `HEAD_FORMAT` claims every folder whose config.json `is_dflash_config`, and the folder
dispatch (specjax_converters.head_formats.validate_folder) runs `check_dflash_head` on it. Each
finding names a rule id, the field, the problem and the fix, as for EAGLE-3 (`Finding`); errors make
the head unservable or silently wrong.

What vLLM 0.32 reads, and so what the rules check (qwen3_dflash.py, config/speculative.py,
transformers_utils/configs/eagle.py, v1/spec_decode, v1/worker/gpu/spec_decode):
  architectures        kept as they are only when the name starts with "DFlash"; DFlashDraftModel is
                       the qwen3_dflash drafter (another DFlash* name is another model)
  model_type "qwen3"   the draft's keys are parsed as a transformers Qwen3Config, whose defaults
                       (num_key_value_heads 32, head_dim 128) are not what a head's shapes imply: the
                       decoder shape keys must all be written
  dflash_config        mask_token_id (the token of the mask slots; a top-level mask_token_id is
                       the fallback), target_layer_ids (output-of-layer-k; vLLM taps k+1, and a
                       top-level eagle_aux_hidden_state_layer_ids takes precedence over them),
                       causal (true: causal attention inside a block, a JetSpec head; a top-level
                       is_causal wins over it), use_aux_hidden_state (false: no fc, raw hidden
                       states), use_swa, sample_from_anchor (vLLM 0.32's DFlash drafter refuses true)
  layer_types          "sliding_attention" entries make those layers causal and windowed
  weights              `model.` is prefixed by vLLM itself; d2t becomes draft_id_to_target_id, which
                       exists only when draft_vocab_size differs from the target's vocab; t2d is
                       skipped; a mask_hidden tensor fails an assertion; an absent lm_head means
                       the target's is shared (only right for a full-vocab draft)
`block_size` is not read by vLLM; specjax.eval, specjax.serve_cmd and dflash_import read it.

No jax at import: numpy, the weight table, head_files, head_rules and target_facts.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Optional, Sequence

from specjax.drafts import weights
from specjax.drafts.dflash_weights import DFLASH_VOCAB_TENSORS, DFLASH_WEIGHTS
from specjax_converters.head_files import Finding, HeadTensors
from specjax_converters.head_rules import (HeadFormat, check_embedding_copy, check_vocab_maps, check_weight_dtypes,
                                           same_value)
from specjax_converters.target_facts import rope_dict, target_rope_dicts, target_text_config, target_virtual_depth

__all__ = ["ARCHITECTURE", "HEAD_FORMAT", "MODEL_TYPE", "DFlashShape", "block_attention_causal", "check_block_backbone",
           "check_dflash_head",
           "dflash_shape", "expected_dflash_weights", "is_dflash_config", "manifest_causal", "speculators_dflash_error"]

ARCHITECTURE = "DFlashDraftModel"
MODEL_TYPE = "qwen3"
# decoder shape keys a DFlash config.json must write (the weights' shapes and vLLM's layers follow them)
_REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "vocab_size")
# what transformers' Qwen3Config (which parses the draft's config in vLLM) uses when a key is absent
_QWEN3_DEFAULTS = {"num_key_value_heads": 32, "head_dim": 128}
_SPECULATORS_DFLASH = ("dflash",)  # "dflash2" heads are read by dflash2_validate


def is_dflash_config(conf: Mapping) -> bool:
    """A DFlash head's config.json: architectures ["DFlashDraftModel"], or a dflash_config block."""
    return list(conf.get("architectures") or []) == [ARCHITECTURE] or "dflash_config" in conf


def block_attention_causal(conf: Mapping) -> bool:
    """Whether vLLM runs a DFlash head's block causally (slot j sees slots 0..j: a JetSpec head) or
    bidirectionally (a DFlash head): a top-level is_causal wins, then dflash_config.causal, absent =
    bidirectional (qwen3_dflash.py, _dflash_layer_causal; sliding layer_types, which it also makes
    causal, are refused by the dflash.layer_types rule)."""
    top = conf.get("is_causal")
    if top is not None:
        return bool(top)
    dc = conf.get("dflash_config")
    return bool(dc.get("causal")) if isinstance(dc, Mapping) else False


def manifest_causal(manifest: Optional[Mapping]) -> Optional[bool]:
    """The block attention a specjax export recorded in its manifest's draft_config (`causal` is
    written only for a causal head), None without a manifest."""
    if not manifest:
        return None
    dc = manifest.get("draft_config")
    return bool(dc.get("causal", False)) if isinstance(dc, Mapping) else False


@dataclasses.dataclass(frozen=True)
class DFlashShape:
    """The config fields DFLASH_WEIGHTS reads (a DFlashConfig has them all); built from a head's
    config.json by dflash_shape."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]


def _pos_int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def dflash_shape(config: Mapping) -> DFlashShape:
    """The weight table's view of a DFlash config.json (its required keys must be positive ints)."""
    dc = config.get("dflash_config") or {}
    return DFlashShape(
        hidden_size=int(config["hidden_size"]), num_layers=int(config["num_hidden_layers"]),
        num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=int(config["num_key_value_heads"]), head_dim=int(config["head_dim"]),
        intermediate_size=int(config["intermediate_size"]),
        draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
        aux_layer_ids=tuple(int(i) for i in (dc.get("target_layer_ids") or ())))


def expected_dflash_weights(config: Mapping) -> dict[str, weights.Entry]:
    """Tensor name -> table entry (param path, shapes) of every weight of a DFlash head with this
    config.json; d2t / t2d not included."""
    return {e.file_name: e for e in weights.entries(DFLASH_WEIGHTS, dflash_shape(config))}


def _layer_ids(value) -> Optional[list[int]]:
    if isinstance(value, (list, tuple)) and value and all(isinstance(i, int) and not isinstance(i, bool)
                                                          for i in value):
        return [int(i) for i in value]
    return None


def check_dflash_head(
    config: Mapping,
    tensors: HeadTensors | Mapping[str, Any],
    *,
    target_config: Optional[Mapping] = None,
    training_layer_ids: Optional[Sequence[int]] = None,
    check_finite: bool = True,
    causal: Optional[bool] = False,
) -> list[Finding]:
    """All findings for one DFlash head. `target_config` (the target's config.json dict) enables the
    rules against the target; `training_layer_ids` (a specjax manifest's draft_config) the rule that
    config.json's taps are the ones the head was trained on; `causal` the attention inside a block
    the head was trained with (False: bidirectional, DFlash; True: causal, JetSpec; None: unknown,
    config.json's is taken as it is)."""
    if not isinstance(tensors, HeadTensors):
        tensors = HeadTensors.from_arrays(tensors)
    out: list[Finding] = []

    def bad(rule, field, problem, fix, level="error"):
        out.append(Finding(rule, field, problem, fix, level))

    arch = config.get("architectures")
    if arch != [ARCHITECTURE]:
        bad("dflash.architectures", "architectures", f"{arch!r}, not [{ARCHITECTURE!r}] (the name vLLM maps to its "
            "qwen3_dflash drafter; another name loads another model or none)",
            f'write "architectures": ["{ARCHITECTURE}"]')
    if config.get("model_type") != MODEL_TYPE:
        bad("dflash.model_type", "model_type", f"{config.get('model_type')!r}, not {MODEL_TYPE!r} (vLLM parses the "
            "draft's keys as the config class of its model_type)", f'write "model_type": "{MODEL_TYPE}"')
    missing = False
    for key in _REQUIRED_FIELDS:
        if _pos_int(config.get(key)) is None:
            missing = True
            default = (f"; transformers' Qwen3Config would use {_QWEN3_DEFAULTS[key]}, not what the weights imply"
                       if key in _QWEN3_DEFAULTS and key not in config else "")
            bad("config.required", key, f"{config.get(key)!r}: must be a positive integer{default}",
                f'write "{key}" (the draft\'s own value; specjax.export writes every decoder shape key)')
    dc = config.get("dflash_config")
    if not isinstance(dc, Mapping):
        bad("dflash.config", "dflash_config", f"{dc!r}: absent or not an object (vLLM reads the mask token and the "
            "taps from it)", 'write "dflash_config": {"mask_token_id": ..., "target_layer_ids": [...], '
            '"causal": false, "use_aux_hidden_state": true}')
        dc = {}
    V = _pos_int(config.get("vocab_size"))
    ids = _check_dflash_fields(config, dc, V, training_layer_ids, causal, bad)
    if missing:
        return out  # the shape rules need the decoder keys
    _check_tensors(config, tensors, bad, check_finite)
    if target_config is not None:
        _check_target(config, ids, target_config, bad)
    return out


def check_block_backbone(family: str, config: Mapping, view: Mapping, tensors: HeadTensors, head_prefixes,
                         *, target_config: Optional[Mapping], training_layer_ids: Optional[Sequence[int]],
                         check_finite: bool) -> list[Finding]:
    """Findings for the DFlash backbone under a block head of another format (DSpark, vLLM 0.34's XPress):
    config.json's top-level `target_layer_ids` against the taps the head was trained on (rule
    `<family>.training`), then DFlash's own rules on `view` (the config as a DFlash head) and the
    tensors outside `head_prefixes` (the family's heads, which it checks itself)."""
    out: list[Finding] = []
    ids = config.get("target_layer_ids")
    if training_layer_ids is not None and isinstance(ids, list) and [int(i) for i in training_layer_ids] != ids:
        out.append(Finding(f"{family}.training", "target_layer_ids", f"{ids} differ from the taps the head was "
                           f"trained on ({list(training_layer_ids)}, specjax_manifest.json's draft_config)",
                           "export from the run's own draft config (re-export instead of editing config.json)",
                           "error"))
    heads = [k for k in tensors.names if k.startswith(tuple(head_prefixes))]
    backbone = HeadTensors({k: v for k, v in tensors.meta.items() if k not in heads}, tensors.array,
                           tensors.all_finite)
    return out + check_dflash_head(view, backbone, target_config=target_config, check_finite=check_finite,
                                   causal=False)


def _check_dflash_fields(config, dc, V, training_layer_ids, causal, bad) -> Optional[list[int]]:
    """The dflash_config block, block_size and the decoder fields vLLM builds the layers from;
    returns the taps when they are usable."""
    # the mask token (vLLM: dflash_config.mask_token_id, else the top-level one)
    mask = dc.get("mask_token_id", config.get("mask_token_id"))
    if mask is None:
        bad("dflash.mask_token_id", "dflash_config.mask_token_id", "absent: vLLM refuses the head (no token for the "
            "mask slots)", "write the token id the head was trained with in its mask slots (draft.mask_token_id)")
    elif not isinstance(mask, int) or isinstance(mask, bool) or V is None or not 0 <= mask < V:
        bad("dflash.mask_token_id", "dflash_config.mask_token_id", f"{mask!r} is not a token id in [0, vocab_size={V})",
            "write the id of the token the head embeds in its mask slots (a token of the target's vocab)")
    elif "mask_token_id" in dc and config.get("mask_token_id") not in (None, mask):
        bad("dflash.mask_token_id", "mask_token_id", f"top-level {config['mask_token_id']} != dflash_config's {mask} "
            "(vLLM reads dflash_config's; other readers may take the top-level one)",
            "drop the top-level mask_token_id or make it equal")
    # the taps
    raw = dc.get("target_layer_ids")
    ids = _layer_ids(raw)
    if ids is None:
        bad("dflash.target_layer_ids", "dflash_config.target_layer_ids", f"{raw!r}: absent, empty or not integers "
            "(vLLM then taps its default layers and sizes fc for them)",
            "write the output-of-layer-k ids the head was trained on (target.aux_layer_ids)")
    elif ids[0] < 0 or any(b <= a for a, b in zip(ids, ids[1:])):
        bad("dflash.target_layer_ids", "dflash_config.target_layer_ids", f"{ids} are not non-negative and strictly "
            "increasing (fc reads the taps concatenated in that order)",
            "list each tapped layer once, in increasing order")
        ids = None
    else:
        n_target = config.get("num_target_layers")
        if _pos_int(n_target) is not None and ids[-1] >= n_target:
            bad("dflash.target_layer_ids", "dflash_config.target_layer_ids", f"{ids} reach past num_target_layers="
                f"{n_target} (ids are output-of-layer-k, 0-based)", f"use ids in [0, {n_target - 1}]")
        top = config.get("eagle_aux_hidden_state_layer_ids")
        if top is not None and _layer_ids(top) != [i + 1 for i in ids]:
            bad("dflash.aux_override", "eagle_aux_hidden_state_layer_ids", f"{top!r} at the top level: vLLM taps these "
                f"in preference to dflash_config.target_layer_ids {ids} (which it reads as {[i + 1 for i in ids]})",
                "drop the top-level eagle_aux_hidden_state_layer_ids (dflash_config.target_layer_ids is enough)")
        if training_layer_ids is not None and [int(i) for i in training_layer_ids] != ids:
            bad("dflash.training", "dflash_config.target_layer_ids", f"{ids} differ from the taps the head was trained "
                f"on ({list(training_layer_ids)}, specjax_manifest.json's draft_config)",
                "export from the run's own draft config (re-export instead of editing config.json)")
    # attention inside a block: as trained (bidirectional, or causal for JetSpec), full attention, fc over the taps
    if causal is False and (config.get("is_causal") is True or dc.get("causal") is True):
        field = "is_causal" if config.get("is_causal") is True else "dflash_config.causal"
        bad("dflash.causal", field, "true: vLLM then runs each block causally, but DFlash heads are trained with "
            "bidirectional attention inside a block", f'write "{field.split(".")[-1]}": false')
    elif causal is True and not block_attention_causal(config):
        field = "is_causal" if config.get("is_causal") is False else "dflash_config.causal"
        bad("dflash.causal", field, f"{config.get('is_causal', dc.get('causal'))!r}: vLLM then runs each block "
            "bidirectionally, but this head (JetSpec) was trained with causal attention inside a block",
            f'write "{field.split(".")[-1]}": true')
    layer_types = config.get("layer_types")
    n_layers = _pos_int(config.get("num_hidden_layers"))
    if layer_types is not None and (not isinstance(layer_types, list) or (n_layers and len(layer_types) != n_layers)
                                    or any(t != "full_attention" for t in layer_types)):
        bad("dflash.layer_types", "layer_types", f"{layer_types!r}: vLLM makes a sliding_attention layer causal and "
            "windowed (and indexes the list per draft layer); specjax trains full bidirectional attention",
            f'write "layer_types": {json.dumps(["full_attention"] * (n_layers or 1))} (one per draft layer)')
    if dc.get("use_swa"):
        bad("dflash.layer_types", "dflash_config.use_swa", "true: vLLM then gives every layer a sliding window",
            'write "use_swa": false (or drop it)')
    if dc.get("use_aux_hidden_state", config.get("use_aux_hidden_state")) is False:
        bad("dflash.use_aux_hidden_state", "dflash_config.use_aux_hidden_state", "false: vLLM then skips fc and "
            "feeds the raw target state (fc.weight is dropped)", 'write "use_aux_hidden_state": true')
    if dc.get("sample_from_anchor"):
        bad("dflash.sample_from_anchor", "dflash_config.sample_from_anchor", "true (slot 0 drafts too): vLLM 0.32's "
            "DFlash drafter refuses it (its block is the bonus token + mask slots); specjax.eval decodes it",
            "serve it with specjax.eval, or train with draft.sample_from_anchor=false for vLLM", "warning")
    # block_size: specjax's decoder and serve_cmd read it (vLLM drafts num_speculative_tokens slots)
    bs = config.get("block_size")
    least = 1 if dc.get("sample_from_anchor") else 2
    if bs is None:
        bad("dflash.block_size", "block_size", "absent: specjax.eval, specjax.serve_cmd and warm starts read the "
            "trained block size from it", 'write "block_size": <slots per block the head was trained with>')
    elif _pos_int(bs) is None or bs < least:
        bad("dflash.block_size", "block_size", f"{bs!r}: a block needs the anchor plus at least one drafted slot "
            f"(>= {least})", "write the block size the head was trained with (draft.block_size, >= 2)")
    # decoder fields
    H, nH = _pos_int(config.get("hidden_size")), _pos_int(config.get("num_attention_heads"))
    tH = config.get("target_hidden_size")
    if tH is not None and H is not None and tH != H:
        bad("dflash.target_hidden_size", "target_hidden_size", f"{tH!r} != hidden_size {H}: a DFlash head has the "
            "target's width (fc input = taps x hidden_size)", f'write "target_hidden_size": {H}')
    nkv, hd = _pos_int(config.get("num_key_value_heads")), _pos_int(config.get("head_dim"))
    if nH and nkv and nH % nkv:
        bad("config.num_key_value_heads", "num_key_value_heads", f"{nkv} does not divide num_attention_heads={nH}",
            "use a KV head count that divides the query heads")
    if hd and hd % 2:
        bad("config.head_dim", "head_dim", f"{hd} is odd; RoPE rotates pairs of dimensions", "use an even head_dim")
    if config.get("hidden_act", "silu") != "silu":
        bad("config.hidden_act", "hidden_act", f"{config.get('hidden_act')!r}: the DFlash MLP is SiLU-gated",
            'write "hidden_act": "silu"')
    if config.get("attention_bias"):
        bad("config.bias", "attention_bias", "true: vLLM then builds q/k/v/o biases this head does not have",
            'write "attention_bias": false')
    Vd = config.get("draft_vocab_size")
    if Vd is not None and (_pos_int(Vd) is None or (V is not None and Vd > V)):
        bad("config.draft_vocab_size", "draft_vocab_size", f"{Vd!r} is not in [1, vocab_size={V}]",
            'write "draft_vocab_size": <rows of lm_head.weight>')
    has_new, has_old = isinstance(config.get("rope_parameters"), Mapping), "rope_theta" in config
    if not (has_new or has_old):
        bad("config.rope_layouts", "rope_parameters", "absent: transformers' Qwen3Config then uses theta 10000, "
            "whatever the head was trained with", "write rope_theta + rope_scaling and rope_parameters (the target's)",
            "warning")
    elif has_new and has_old and not same_value(
            rope_dict({"rope_parameters": config["rope_parameters"], "max_position_embeddings":
                       config.get("max_position_embeddings")}),
            rope_dict({"rope_theta": config["rope_theta"], "rope_scaling": config.get("rope_scaling"),
                       "max_position_embeddings": config.get("max_position_embeddings")})):
        bad("config.rope_layouts", "rope_scaling", f"rope_theta/rope_scaling ({config['rope_theta']}, "
            f"{config.get('rope_scaling')}) disagree with rope_parameters ({config['rope_parameters']}); readers pick "
            "different ones", "write both layouts from the same target RoPE")
    if "torch_dtype" not in config and "dtype" not in config:
        bad("config.torch_dtype", "torch_dtype", "absent", 'write "torch_dtype" (e.g. "bfloat16")', "warning")
    return ids


def _check_tensors(config, tensors: HeadTensors, bad, check_finite: bool):
    names = tensors.names
    prefixed = [k for k in names if k.startswith(("model.", "draft_model."))]
    if prefixed:
        bad("keys.prefix", prefixed[0].split(".")[0] + ".*", f"{len(prefixed)} key(s) carry a model./draft_model. "
            f"prefix, e.g. {prefixed[0]} (vLLM adds `model.` itself and finds no model.model.* parameter)",
            "save the head's own keys: fc.weight, hidden_norm.weight, layers.*, norm.weight, lm_head.weight")
    try:
        expected = expected_dflash_weights(config)
    except (KeyError, TypeError, ValueError) as e:
        bad("config.required", "config", f"cannot derive the tensor shapes ({e!r})", "write the decoder shape keys")
        return
    V = int(config["vocab_size"])
    Vd = int(config.get("draft_vocab_size") or V)
    for k in expected:
        if k in tensors:
            continue
        if k == "lm_head.weight" and Vd == V:
            bad("keys.lm_head_shared", k, "absent: vLLM then shares the target's lm_head (right for a full-vocab "
                "draft), but specjax.eval and draft.init_from read the head's own",
                "export the head with specjax.export (it writes lm_head.weight)", "warning")
            continue
        bad("keys.missing", k, "missing from the weights (vLLM would run it uninitialised)",
            "export every tensor of the DFlash key set (specjax.drafts.dflash_weights.DFLASH_WEIGHTS)")
    for k in names:
        if k in expected or k in DFLASH_VOCAB_TENSORS or k == "embed_tokens.weight" or k in prefixed:
            continue
        why = ("vLLM asserts that a DFlash head has no mask_hidden (the mask slots embed mask_token_id)"
               if "mask_hidden" in k else "not part of a DFlash head: vLLM refuses a tensor it cannot place")
        bad("keys.unknown", k, why, "remove it from the export (only the DFLASH_WEIGHTS key set, d2t and t2d)")
    check_embedding_copy(config, tensors, bad, shape_fix="drop embed_tokens (vLLM shares the target's)",
                         copy_problem="a copy of an embedding is shipped (vLLM keeps it when it differs from the "
                         "target's; specjax trains with the target's)",
                         copy_fix="drop embed_tokens.weight: vLLM then shares the target's embedding")
    for k, e in expected.items():
        if k in tensors and tuple(tensors.shape(k)) != e.file_shape:
            bad("shapes", k, f"shape {tuple(tensors.shape(k))} but config.json implies {e.file_shape}",
                "export the config the weights were trained with (hidden_size, heads, head_dim, intermediate_size, "
                "draft_vocab_size, num_hidden_layers, the number of target_layer_ids)")
    check_weight_dtypes(config, tensors, [k for k in expected if k in tensors], bad, check_finite,
                        {k: e.file_shape for k, e in expected.items()})
    # the vocab maps: vLLM has a draft_id_to_target_id parameter only when Vd differs from the vocab
    if Vd == V:
        if "d2t" in tensors:
            bad("vocab.d2t_unexpected", "d2t", "present in a full-vocab head: vLLM has no draft_id_to_target_id "
                "parameter then and refuses the tensor", "drop d2t (and t2d) from a head whose draft_vocab_size is "
                "its vocab_size")
    elif "d2t" not in tensors:
        bad("vocab.d2t_missing", "d2t", f"absent with draft_vocab_size {Vd} < vocab_size {V}: vLLM then maps draft id "
            "i to target id i (silently wrong tokens)", "ship d2t (int64 offsets, [draft_vocab_size])")
    else:
        check_vocab_maps(config, tensors, bad)  # dtype, shape, ids in range and ascending, t2d agreeing


def _check_target(config, ids, target_config, bad):
    tc = target_text_config(target_config)
    H, V = int(config["hidden_size"]), int(config["vocab_size"])
    if tc.get("hidden_size") is not None and H != int(tc["hidden_size"]):
        bad("target.hidden_size", "hidden_size", f"draft {H} != target {tc['hidden_size']}: the head embeds tokens "
            "with the target's table and reads its hidden states", "serve it with the target it was trained on")
    if tc.get("vocab_size") is not None and V != int(tc["vocab_size"]):
        bad("target.vocab_size", "vocab_size", f"draft {V} != target {tc['vocab_size']} (vLLM shares the target's "
            "embedding and scatters draft logits into its vocab)", "serve it with the target it was trained on")
    if ids is not None:
        try:
            depth = target_virtual_depth(target_config)
        except ValueError:
            depth = None
        out_of_range = [i for i in ids if depth is not None and not 0 <= i < depth]
        if out_of_range:
            bad("dflash.target_layer_ids", "dflash_config.target_layer_ids", f"output-of-layer ids {out_of_range} "
                f"outside the target's depth 0..{depth - 1} (vLLM fails on the fc input size)",
                f"use ids in [0, {depth}), the taps the head was trained on for this target")
    mine, theirs = rope_dict(config), rope_dict(tc)
    if theirs is None:
        theirs = {"rope_type": "default", "rope_theta": 10000.0}
    # a target with a RoPE per layer type (Gemma 3 / 4): the draft may copy any one of them
    if mine is not None and not any(same_value(mine, t) for t in target_rope_dicts(tc) or [theirs]):
        bad("target.rope", "rope_parameters", f"draft RoPE {mine} != target RoPE {theirs} (the block continues the "
            "target's positions)",
            "copy the target's rope_theta / rope_scaling / rope_parameters into the draft config")


def speculators_dflash_error(folder: str, config: Mapping) -> Optional[str]:
    """The error for a speculators-format DFlash head (speculators_model_type "dflash"), else None:
    vLLM converts those configs itself, specjax reads the DFlashDraftModel layout only."""
    kind = config.get("speculators_model_type")
    if kind not in _SPECULATORS_DFLASH:
        return None
    return (f"{folder} is a speculators-format DFlash head (speculators_model_type {kind!r}); specjax validates and "
            "imports the DFlashDraftModel layout (config.json with architectures [\"DFlashDraftModel\"] and "
            "dflash_config) only. Fix: serve it with vLLM as it is, or re-export it from specjax")


def check_folder_head(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping],
                      training_ids: Optional[Sequence[int]], manifest: Optional[Mapping],
                      check_finite: bool) -> list[Finding]:
    """`check_dflash_head` for a folder: the block attention the head was trained with is its
    manifest's (without one, config.json's is taken as it is)."""
    return check_dflash_head(config, tensors, target_config=target_config, training_layer_ids=training_ids,
                             check_finite=check_finite, causal=manifest_causal(manifest))


# the folder dispatch's entry (specjax_converters.head_formats)
HEAD_FORMAT = HeadFormat(name="dflash", recognises=is_dflash_config, layout=lambda config: "dflash",
                         check=check_folder_head,
                         refusal=speculators_dflash_error)

"""Validate a DFlash 2 head folder: the speculators 0.9 layout of a DFlash2DraftModel checkpoint.

Layout (what speculators' DFlash2SpeculatorConfig writes and `DFlash2DraftModel.from_pretrained`
reads; vLLM 0.32 converts the same config in transformers_utils/configs/speculators/algos.py,
update_dflash2, into its qwen3_dflash2 model with method "dflash"):
  config.json
    speculators_model_type "dflash2", architectures ["DFlash2DraftModel"]
    transformer_layer_config   a Qwen3 config of the draft layers (model_type qwen3; hidden_size,
                               num_hidden_layers = draft layers, heads, head_dim, intermediate_size,
                               vocab_size = the target's, rms_norm_eps, rope_parameters)
    draft_vocab_size           = transformer_layer_config.vocab_size (DFlash 2 needs the full vocab)
    block_size                 the trained block (anchor + drafted slots)
    aux_hidden_state_layer_ids the taps in speculators' convention: output-of-layer-k ids + 1
    mask_token_id, sample_from_anchor, sliding_window_non_causal
    conv_kernel_size, conv_group_size, selector_rank, selector_top_k
    speculators_config         algorithm "dflash2", proposal_methods[0].speculative_tokens (= the block's
                               drafted slots), verifier {name_or_path, architectures}
  model.safetensors            the DFLASH2_WEIGHTS table (specjax.drafts.dflash2_weights) under
                               speculators' names, no prefix; lm_head.weight (the target's rows, which
                               speculators drops on save and rebuilds from the verifier) is kept so the
                               head reads back alone; no embed_tokens, no d2t / t2d
Each rule's finding names its id, the field, the problem and the fix (`Finding`).
No jax at import.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Mapping, Optional, Sequence

from specjax.drafts import weights
from specjax.drafts.dflash2_weights import DFLASH2_WEIGHTS
from specjax_converters.head_files import Finding, HeadTensors
from specjax_converters.head_rules import (HeadFormat, check_embedding_copy, check_vocab_maps, check_weight_dtypes,
                                           same_value)
from specjax_converters.target_facts import rope_dict, target_rope_dicts, target_text_config, target_virtual_depth

__all__ = ["ARCHITECTURE", "DFLASH2_LAYOUT", "HEAD_FORMAT", "MODEL_TYPE", "SpeculatorsLayout", "check_dflash2_head",
           "check_speculators_head", "expected_weights", "is_dflash2_config", "layout_shape"]

ARCHITECTURE = "DFlash2DraftModel"
MODEL_TYPE = "dflash2"  # speculators_model_type
LAYER_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size")


@dataclasses.dataclass(frozen=True)
class SpeculatorsLayout:
    """One speculators DFlash-variant layout (DFlash 2 here; XPress in xpress_validate): its
    speculators_model_type and architecture, its own positive-int config fields (written as the
    weight table reads them), the weight table, its own field rules `check_fields(config, V, H, bad)`,
    and whether the draft vocab must be the full vocab."""
    model_type: str
    architecture: str
    display: str
    own_fields: tuple[str, ...]
    table: tuple
    check_fields: Callable[[Mapping, Optional[int], Optional[int], Callable], None]
    full_vocab: bool


def is_dflash2_config(conf: Mapping) -> bool:
    """A DFlash 2 head's config.json (speculators layout)."""
    return conf.get("speculators_model_type") == MODEL_TYPE or list(conf.get("architectures") or []) == [ARCHITECTURE]


def _pos_int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else None


def layout_shape(config: Mapping, layout: SpeculatorsLayout):
    """The weight table's view of a speculators-layout config.json (the attributes its rows read)."""
    tl = config["transformer_layer_config"]
    return types.SimpleNamespace(
        hidden_size=int(tl["hidden_size"]), num_layers=int(tl["num_hidden_layers"]),
        num_attention_heads=int(tl["num_attention_heads"]), num_key_value_heads=int(tl["num_key_value_heads"]),
        head_dim=int(tl["head_dim"]), intermediate_size=int(tl["intermediate_size"]),
        vocab_size=int(tl["vocab_size"]), draft_vocab_size=int(config.get("draft_vocab_size") or tl["vocab_size"]),
        aux_layer_ids=tuple(int(i) - 1 for i in config.get("aux_hidden_state_layer_ids") or ()),
        block_size=int(config["block_size"]), **{k: int(config[k]) for k in layout.own_fields})


def expected_weights(config: Mapping, layout: Optional[SpeculatorsLayout] = None) -> dict[str, weights.Entry]:
    layout = layout or DFLASH2_LAYOUT
    return {e.file_name: e for e in weights.entries(layout.table, layout_shape(config, layout))}


def check_dflash2_head(config: Mapping, tensors: HeadTensors | Mapping[str, Any], *,
                       target_config: Optional[Mapping] = None, training_layer_ids: Optional[Sequence[int]] = None,
                       check_finite: bool = True) -> list[Finding]:
    """All findings for one DFlash 2 head (check_speculators_head with DFLASH2_LAYOUT)."""
    return check_speculators_head(config, tensors, DFLASH2_LAYOUT, target_config=target_config,
                                  training_layer_ids=training_layer_ids, check_finite=check_finite)


def check_speculators_head(config: Mapping, tensors: HeadTensors | Mapping[str, Any], layout: SpeculatorsLayout, *,
                           target_config: Optional[Mapping] = None, training_layer_ids: Optional[Sequence[int]] = None,
                           check_finite: bool = True) -> list[Finding]:
    """All findings for one head of `layout`. `target_config` enables the rules against the target;
    `training_layer_ids` (output-of-layer-k, a specjax manifest's) the rule that the taps are the
    ones the head was trained on."""
    if not isinstance(tensors, HeadTensors):
        tensors = HeadTensors.from_arrays(tensors)
    out: list[Finding] = []
    mt = layout.model_type

    def bad(rule, field, problem, fix, level="error"):
        out.append(Finding(rule, field, problem, fix, level))

    if config.get("speculators_model_type") != mt:
        bad(f"{mt}.model_type", "speculators_model_type", f"{config.get('speculators_model_type')!r}, not "
            f"{mt!r} (speculators and vLLM pick the {layout.display} reader by it)",
            f'write "speculators_model_type": "{mt}"')
    if config.get("architectures") != [layout.architecture]:
        bad(f"{mt}.architectures", "architectures", f"{config.get('architectures')!r}, not [{layout.architecture!r}]",
            f'write "architectures": ["{layout.architecture}"]')
    tl = config.get("transformer_layer_config")
    if not isinstance(tl, Mapping):
        bad(f"{mt}.layer_config", "transformer_layer_config", f"{tl!r}: absent or not an object (the draft "
            "layers' Qwen3 config)", "write the draft's Qwen3 config there (specjax.export writes it)")
        return out
    shape_ok = True
    for key in LAYER_FIELDS:
        if _pos_int(tl.get(key)) is None:
            shape_ok = False
            bad("config.required", f"transformer_layer_config.{key}", f"{tl.get(key)!r}: must be a positive integer "
                "(transformers' Qwen3Config would fill in its own default)", f'write "{key}" (the draft\'s value)')
    if tl.get("model_type", "qwen3") != "qwen3":
        bad(f"{mt}.layer_config", "transformer_layer_config.model_type", f"{tl.get('model_type')!r}: the draft "
            "layers are Qwen3 layers (q_norm / k_norm)", 'write "model_type": "qwen3"')
    if tl.get("hidden_act", "silu") != "silu":
        bad("config.hidden_act", "transformer_layer_config.hidden_act", f"{tl.get('hidden_act')!r}: the MLP is "
            "SiLU-gated", 'write "hidden_act": "silu"')
    if tl.get("attention_bias"):
        bad("config.bias", "transformer_layer_config.attention_bias", "true: the readers then build q/k/v/o biases "
            "this head does not have", 'write "attention_bias": false')
    layer_types = tl.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad(f"{mt}.layer_types", "transformer_layer_config.layer_types", f"{layer_types!r}: sliding-window "
            "layers are not what specjax trained (full attention)", 'write "full_attention" for every layer')
    if rope_dict(tl) is None:
        bad("config.rope", "transformer_layer_config.rope_parameters", "absent: Qwen3Config then uses theta "
            "10000, whatever the head was trained with", "write the target's rope_parameters", "warning")
    V = _pos_int(tl.get("vocab_size"))
    H = _pos_int(tl.get("hidden_size"))
    for key in ("block_size", *layout.own_fields):
        if _pos_int(config.get(key)) is None and not (key == "num_jacobi_passes" and config.get(key) == 0):
            shape_ok = False
            bad(f"{mt}.fields", key, f"{config.get(key)!r}: must be a positive integer",
                f'write "{key}" (the value the head was trained with)')
    if shape_ok:
        _check_common_fields(config, V, H, layout, bad)
        layout.check_fields(config, V, H, bad)
    ids = _check_taps(config, training_layer_ids, mt, bad)
    _check_proposal(config, mt, bad)
    if not shape_ok:
        return out
    _check_tensors(config, tensors, layout, bad, check_finite)
    if target_config is not None:
        _check_target(config, ids, target_config, mt, bad)
    return out


def _check_common_fields(config, V, H, layout, bad):
    mt = layout.model_type
    Vd = config.get("draft_vocab_size")
    if layout.full_vocab and Vd != V:
        bad(f"{mt}.vocab", "draft_vocab_size", f"{Vd!r} != vocab_size {V}: speculators' {layout.architecture} "
            "refuses a reduced draft vocab (the selector's codebooks are indexed by target ids)",
            f'write "draft_vocab_size": {V} (train with draft.draft_vocab_size = the target vocab)')
    elif not (_pos_int(Vd) is not None and V is not None and Vd <= V):
        bad(f"{mt}.vocab", "draft_vocab_size", f"{Vd!r} is not in [1, vocab_size={V}]",
            'write "draft_vocab_size": <rows of lm_head.weight>')
    bs = config["block_size"]
    if bs < 2 - int(bool(config.get("sample_from_anchor"))):
        bad(f"{mt}.block_size", "block_size", f"{bs}: a block needs the anchor plus a drafted slot",
            "write the block size the head was trained with (>= 2)")
    mask = config.get("mask_token_id")
    if not (isinstance(mask, int) and not isinstance(mask, bool) and V is not None and 0 <= mask < V):
        bad(f"{mt}.mask_token_id", "mask_token_id", f"{mask!r} is not a token id in [0, {V})",
            "write the token the head embeds in its mask slots (draft.mask_token_id)")
    if config.get("sample_from_anchor"):
        bad(f"{mt}.sample_from_anchor", "sample_from_anchor", "true (slot 0 drafts too): vLLM's DFlash drafters "
            "build the block as the bonus token + mask slots", "serve it with specjax.eval, or train with "
            "draft.sample_from_anchor=false for vLLM", "warning")
    tH = config.get("target_hidden_size")
    if tH is not None and H is not None and tH != H:
        bad(f"{mt}.target_hidden_size", "target_hidden_size", f"{tH} != hidden_size {H}: the draft has the "
            "target's width", f'write "target_hidden_size": {H}')


def check_dflash2_fields(config, V, H, bad):
    """DFlash 2's own fields: the convolution and the selector."""
    bs, taps, group = config["block_size"], config["conv_kernel_size"], config["conv_group_size"]
    if taps > bs:
        bad("dflash2.conv", "conv_kernel_size", f"{taps} > block_size {bs} (speculators refuses it)",
            f"use conv_kernel_size <= {bs}")
    if H is not None and H % group:
        bad("dflash2.conv", "conv_group_size", f"{group} does not divide hidden_size {H}",
            "use a group size that divides the hidden size")
    if V is not None and config["selector_top_k"] > V:
        bad("dflash2.selector", "selector_top_k", f"{config['selector_top_k']} > vocab_size {V}",
            f"use selector_top_k <= {V}")


def _check_taps(config, training_layer_ids, mt, bad) -> Optional[list[int]]:
    raw = config.get("aux_hidden_state_layer_ids")
    ok = isinstance(raw, list) and raw and all(isinstance(i, int) and not isinstance(i, bool) for i in raw)
    if not ok or raw[0] < 1 or any(b <= a for a, b in zip(raw, raw[1:])):
        bad(f"{mt}.aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids", f"{raw!r}: must be strictly "
            "increasing ids >= 1 (speculators' convention: output-of-layer-k + 1)",
            "write [k + 1 for each tapped layer k] (target.aux_layer_ids + 1)")
        return None
    ids = [i - 1 for i in raw]
    if training_layer_ids is not None and [int(i) for i in training_layer_ids] != ids:
        bad(f"{mt}.training", "aux_hidden_state_layer_ids", f"{raw} (output-of-layer {ids}) differ from the taps "
            f"the head was trained on ({list(training_layer_ids)}, specjax_manifest.json's draft_config)",
            "export from the run's own draft config (re-export instead of editing config.json)")
    return ids


def _check_proposal(config, mt, bad):
    spec = config.get("speculators_config")
    try:
        method = spec["proposal_methods"][0]
        tokens = method["speculative_tokens"]
        _ = spec["verifier"]["name_or_path"]
    except (KeyError, IndexError, TypeError):
        bad(f"{mt}.speculators_config", "speculators_config", "absent or without proposal_methods[0]."
            "speculative_tokens and verifier.name_or_path (vLLM's speculators reader requires them)",
            f'write {{"algorithm": "{mt}", "proposal_methods": [{{"proposal_type": "greedy", "speculative_tokens": '
            'block_size - 1}], "default_proposal_method": "greedy", "verifier": {"name_or_path": ..., '
            '"architectures": [...]}}')
        return
    if spec.get("algorithm") != mt:
        bad(f"{mt}.speculators_config", "speculators_config.algorithm", f"{spec.get('algorithm')!r}, not "
            f"{mt!r}", f'write "algorithm": "{mt}"')
    bs = config.get("block_size")
    if _pos_int(bs) is not None:
        drafted = bs - (0 if config.get("sample_from_anchor") else 1)
        if tokens != drafted:
            bad(f"{mt}.speculative_tokens", "speculators_config.proposal_methods[0].speculative_tokens",
                f"{tokens!r}, but a block of {bs} drafts {drafted} (vLLM sizes the block and its convolution "
                "from it)", f'write "speculative_tokens": {drafted}')


def _check_tensors(config, tensors: HeadTensors, layout: SpeculatorsLayout, bad, check_finite: bool):
    expected = expected_weights(config, layout)
    prefixed = [k for k in tensors.names if k.startswith(("model.", "draft_model."))]
    if prefixed:
        bad("keys.prefix", prefixed[0], f"{len(prefixed)} key(s) carry a model./draft_model. prefix",
            "save the head's own keys (fc.weight, layers.*, ...)")
    for k in expected:
        if k not in tensors:
            if k == "lm_head.weight":
                bad("keys.lm_head_shared", k, "absent: speculators and vLLM rebuild it from the target's lm_head, "
                    "but specjax.eval and draft.init_from read the head's own", "export the head with specjax.export",
                    "warning")
                continue
            bad("keys.missing", k, "missing from the weights (the readers would run it uninitialised)",
                f"export every tensor of the {layout.display} weight table")
    tl = config["transformer_layer_config"]
    V, Vd = int(tl["vocab_size"]), int(config.get("draft_vocab_size") or tl["vocab_size"])
    maps = ("d2t", "t2d") if Vd < V else ()
    for k in tensors.names:
        if k in expected or k in maps or k == "embed_tokens.weight" or k in prefixed:
            continue
        why = (f"a full-vocab {layout.display} head has no vocab maps" if k in ("d2t", "t2d")
               else f"not part of a {layout.display} head (speculators' strict load refuses it)")
        bad("keys.unknown", k, why, "remove it from the export")
    if maps:
        check_vocab_maps({"vocab_size": V, "draft_vocab_size": Vd}, tensors, bad)
    check_embedding_copy(tl, tensors, bad, shape_fix="drop embed_tokens (the readers use the target's)",
                         copy_problem="a copy of the embedding is shipped (speculators replaces it with the "
                         "verifier's; specjax trains with the target's)", copy_fix="drop embed_tokens.weight")
    for k, e in expected.items():
        if k in tensors and tuple(tensors.shape(k)) != e.file_shape:
            bad("shapes", k, f"shape {tuple(tensors.shape(k))} but config.json implies {e.file_shape}",
                "export the config the weights were trained with")
    check_weight_dtypes(config, tensors, [k for k in expected if k in tensors], bad, check_finite,
                        {k: e.file_shape for k, e in expected.items()})


def _check_target(config, ids, target_config, mt, bad):
    tc = target_text_config(target_config)
    tl = config["transformer_layer_config"]
    for key in ("hidden_size", "vocab_size"):
        if tc.get(key) is not None and int(tl[key]) != int(tc[key]):
            bad(f"target.{key}", f"transformer_layer_config.{key}", f"draft {tl[key]} != target {tc[key]}",
                "serve it with the target it was trained on")
    if ids is not None:
        try:
            depth = target_virtual_depth(target_config)
        except ValueError:
            depth = None
        if depth is not None and ids[-1] >= depth:
            bad(f"{mt}.aux_hidden_state_layer_ids", "aux_hidden_state_layer_ids", f"output-of-layer ids {ids} "
                f"reach past the target's depth {depth}", f"use ids in [1, {depth}] (speculators' k + 1)")
    mine = rope_dict(tl)
    if mine is not None and not any(same_value(mine, t) for t in target_rope_dicts(tc)
                                    or [{"rope_type": "default", "rope_theta": 10000.0}]):
        bad("target.rope", "transformer_layer_config.rope_parameters", f"draft RoPE {mine} is not the target's",
            "copy the target's rope_parameters into the draft config")


DFLASH2_LAYOUT = SpeculatorsLayout(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, display="DFlash 2",
    own_fields=("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"), table=DFLASH2_WEIGHTS,
    check_fields=check_dflash2_fields, full_vocab=True)


def _check_folder(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping],
                  training_ids: Optional[Sequence[int]], manifest: Optional[Mapping], check_finite: bool):
    return check_dflash2_head(config, tensors, target_config=target_config, training_layer_ids=training_ids,
                              check_finite=check_finite)


# the folder dispatch's entry (specjax_converters.head_formats)
HEAD_FORMAT = HeadFormat(name="dflash2", recognises=is_dflash2_config, layout=lambda config: "dflash2",
                         check=_check_folder)

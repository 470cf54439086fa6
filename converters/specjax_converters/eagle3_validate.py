"""Validate an EAGLE-3 draft head against the serving format (docs/eagle3-format.md).

Every rule below is a failure that engines do not report: they load the head and it underperforms
(random weights for dropped keys, wrong aux taps, identity d2t, wrong RoPE, tied heads, ...).
`check_head` runs the rules on a config dict plus tensors (in memory, before an export writes
anything); through `HEAD_FORMAT`, specjax_converters.head_formats.validate_folder runs them on any
head folder, including other trainers' heads:

  * the Llama-EAGLE3 layout (SpecForge / official EAGLE / specjax: `midlayer.*`, `config.json` with
    `architectures: ["LlamaForCausalLMEagle3"]`), the layout vLLM, SGLang and tpu-inference load;
  * the speculators layout (`layers.0.*`, `speculators_model_type`, `speculators_config`), which only
    vLLM loads.

Each finding names a rule id, the field (config key or tensor name), the problem and the fix.
Errors make a head unservable or silently wrong; warnings are portability notes.

Reading a head folder is specjax_converters.head_files (read_head_files, HeadTensors, Finding);
facts about the target config are specjax_converters.target_facts; the rules every head format shares
are specjax_converters.head_rules. EAGLE-3 is the format of every folder no other format recognises
(head_formats lists it last).
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence

from specjax.aux_ids import default_aux_layer_ids
from specjax.drafts import weights
from specjax_converters.head_files import Finding, HeadTensors
from specjax_converters.head_rules import (ExportValidationError, HeadFormat, check_embedding_copy, check_vocab_maps,
                                           check_weight_dtypes, errors, same_value)
from specjax_converters.target_facts import (is_hybrid_target, rope_dict, target_rope_dicts, target_text_config,
                                             target_virtual_depth)

__all__ = [
    "ARCHITECTURE",
    "ExportValidationError",
    "check_head",
    "errors",
    "expected_weight_shapes",
    "expected_weights",
    "flatten_head_config",
    "head_shape",
    "key_layout",
    "HEAD_FORMAT",
    "LEGACY_AUX_NORMS",
]

ARCHITECTURE = "LlamaForCausalLMEagle3"
# d2t/t2d are the only non-weight tensors of a head (docs/eagle3-format.md, "d2t and t2d").
VOCAB_KEYS = tuple(weights.EAGLE3_VOCAB_TENSORS)


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------
def flatten_head_config(config: Mapping) -> tuple[str, dict]:
    """("llama" | "speculators", one flat dict with the Llama-EAGLE3 field names).

    A speculators config keeps the decoder fields in `transformer_layer_config` and the EAGLE fields
    at the top level (ids there are vLLM's input-of-layer convention); they are merged here so the
    same rules apply. The nested `eagle_config` ids (output convention) are derived as top - 1.
    """
    if "speculators_model_type" not in config:
        return "llama", dict(config)
    flat = dict(config.get("transformer_layer_config") or {})
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "norm_before_fc", "fc_norm",
                "norm_output", "eagle_aux_hidden_state_layer_ids", "mask_token_id"):
        if key in config:
            flat[key] = config[key]
    top = config.get("eagle_aux_hidden_state_layer_ids")
    if top:
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in top]}
    flat["_speculators"] = dict(config)
    return "speculators", flat


def key_layout(layout: str, names: Iterable[str]) -> str:
    """Which file layout a head's tensor names follow (weights.EAGLE3_FILE_LAYOUTS): "speculators"
    (`layers.0.*`) for speculators heads and for Llama-config heads with only `layers.0.*` keys,
    else "llama" (`midlayer.*`)."""
    mid = weights.EAGLE3_LAYER
    l0 = weights.EAGLE3_FILE_LAYOUTS["speculators"][mid]
    names = list(names)
    only_l0 = any(k.startswith(l0) for k in names) and not any(k.startswith(mid) for k in names)
    return "speculators" if layout == "speculators" or only_l0 else "llama"


def _num_aux(config: Mapping) -> int:
    if config.get("num_aux_hidden_states"):
        return int(config["num_aux_hidden_states"])
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
        config.get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def _head_dim(config: Mapping) -> int:
    if config.get("head_dim"):
        return int(config["head_dim"])
    return int(config["hidden_size"]) // int(config["num_attention_heads"])


def head_shape(config: Mapping) -> weights.Eagle3Shape:
    """What the EAGLE-3 weight table reads, from a (flat) head config, with the engines' defaults
    for absent keys (head_dim = H / nH, nKV = nH, tH = H, Vd = V, three aux states)."""
    H = int(config["hidden_size"])
    nH = int(config["num_attention_heads"])
    return weights.Eagle3Shape(
        hidden_size=H,
        target_hidden_size=int(config.get("target_hidden_size") or H),
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=nH,
        num_key_value_heads=int(config.get("num_key_value_heads") or nH),
        head_dim=_head_dim(config),
        num_aux=_num_aux(config),
        draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
        fc_norm=bool(config.get("fc_norm")),
        num_layers=_num_layers(config),
        parallel_drafting=config.get("mask_token_id") is not None,
    )


def _num_layers(config: Mapping) -> int:
    n = config.get("num_hidden_layers", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1


def expected_weights(config: Mapping, keys: str = "llama") -> dict[str, weights.Entry]:
    """Tensor name -> table entry (specjax path, shapes) of every weight an EAGLE-3 head
    with this (flat) config has, named as file layout `keys` writes them (see key_layout);
    fc_norm.{i} only with fc_norm, mask_hidden only with mask_token_id (P-EAGLE); d2t/t2d not included."""
    rename = weights.EAGLE3_FILE_LAYOUTS[keys]
    return {e.file_name: e for e in weights.entries(weights.EAGLE3_WEIGHTS, head_shape(config), rename)}


def expected_weight_shapes(config: Mapping, keys: str = "llama") -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in the file of every weight (the key set of docs/eagle3-format.md,
    "Checkpoint layout"; see expected_weights)."""
    return {name: e.file_shape for name, e in expected_weights(config, keys).items()}


# ---------------------------------------------------------------------------------------------
# the rules
# ---------------------------------------------------------------------------------------------
_REQUIRED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "rms_norm_eps")
LEGACY_AUX_NORMS = {"aux_norm_low.weight": "fc_norm.0.weight", "aux_norm_mid.weight": "fc_norm.1.weight",
                     "aux_norm_high.weight": "fc_norm.2.weight"}


def check_head(
    config: Mapping,
    tensors: HeadTensors | Mapping[str, Any],
    *,
    target_config: Optional[Mapping] = None,
    training_aux_ids: Optional[Sequence[int]] = None,
    variant: Optional[str] = None,
    check_finite: bool = True,
) -> list[Finding]:
    """All findings for one head. `target_config` (the target's config.json dict) enables the rules
    that compare with the target; `training_aux_ids` (output convention) the rule that the written
    ids are the ones the draft was trained with; `variant` ("eagle3" | "eagle3.1") what the export
    claims to be."""
    if not isinstance(tensors, HeadTensors):
        tensors = HeadTensors.from_arrays(tensors)
    out: list[Finding] = []

    def bad(rule, field, problem, fix, level="error"):
        out.append(Finding(rule, field, problem, fix, level))

    layout, cfg = flatten_head_config(config)
    missing = [k for k in _REQUIRED_FIELDS if k not in cfg]
    if missing:
        for k in missing:
            bad("config.required", k, "missing from config.json",
                "write the draft's Llama fields (hidden_size, intermediate_size, num_attention_heads, "
                "num_key_value_heads, head_dim, vocab_size, draft_vocab_size, rms_norm_eps)")
        return out  # the shape rules need these

    _check_layout_fields(layout, cfg, config, bad)
    _check_fields(cfg, bad, variant)
    _check_aux(cfg, layout, target_config, training_aux_ids, bad)
    _check_tensors(cfg, layout, tensors, bad, check_finite)
    if target_config is not None:
        _check_target(cfg, target_config, bad)
    return out


def _check_layout_fields(layout, cfg, config, bad):
    if layout == "speculators":
        spec = cfg["_speculators"]
        bad("layout.speculators", "speculators_model_type",
            "a speculators-format head: only vLLM loads it (SGLang and tpu-inference read the Llama-EAGLE3 layout)",
            "for SGLang/TPU serving convert it to the Llama-EAGLE3 layout (specjax: import it with "
            "specjax_converters.eagle3_import and export again)", "warning")
        if "norm_before_residual" not in spec:
            bad("config.norm_before_residual", "norm_before_residual",
                "absent: vLLM's speculators path assumes true, speculators 0.9 itself assumes false",
                "write norm_before_residual explicitly (false for heads trained like SpecForge/specjax)")
        if not ((spec.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path"):
            bad("config.speculators_config", "speculators_config.verifier.name_or_path",
                "missing: vLLM's speculators path needs the verifier", "set it to the target model id or path",
                "warning")
        return
    if "speculators_config" in config or "speculators_model_type" in config:
        bad("config.speculators_mix", "speculators_config",
            "a Llama-EAGLE3 config that also carries speculators fields (vLLM then takes the speculators path)",
            "remove speculators_config from a Llama-layout head (do not mix the paths: docs/eagle3-format.md, "
            "\"config.json keys\")")
    arch = config.get("architectures")
    if arch != [ARCHITECTURE]:
        bad("config.architectures", "architectures", f"{arch!r}, not [{ARCHITECTURE!r}] (SGLang's only "
            "EAGLE-3 entry class; vLLM maps it too)", f'write "architectures": ["{ARCHITECTURE}"]')
    if config.get("model_type") != "llama":
        bad("config.model_type", "model_type", f"{config.get('model_type')!r}, not 'llama'",
            'write "model_type": "llama" (the draft is a one-layer Llama whatever the target is)')


def _check_fields(cfg, bad, variant):
    n_layers = cfg.get("num_hidden_layers")
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
        bad("config.num_hidden_layers", "num_hidden_layers", f"{n_layers!r}: the number of draft decoder layers "
            "must be a positive integer", 'write "num_hidden_layers": 1 (or the head\'s layer count)')
    elif n_layers > 1:
        bad("config.num_hidden_layers", "num_hidden_layers", f"{n_layers}: a multi-layer head; vLLM loads it "
            "(layers.1.. as plain Llama layers) but SGLang and tpu-inference load exactly one layer",
            "serve it with vLLM, or train draft.num_layers=1 for SGLang", level="warning")
    if cfg.get("tie_word_embeddings") is True:
        bad("config.tie_word_embeddings", "tie_word_embeddings",
            "true: SGLang then uses embed_tokens (the full vocab) as the draft's lm_head",
            'write "tie_word_embeddings": false (the draft has its own draft-vocab lm_head)')
    elif "tie_word_embeddings" not in cfg:
        bad("config.tie_word_embeddings", "tie_word_embeddings", "absent (engines fall back to their default)",
            'write "tie_word_embeddings": false explicitly', "warning")
    H, nH = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if not cfg.get("head_dim"):
        level = "warning" if H % nH == 0 else "error"
        bad("config.head_dim", "head_dim", f"absent; engines then use hidden_size/num_attention_heads = {H // nH}",
            'write "head_dim" explicitly (required when heads*head_dim != hidden_size, e.g. Qwen3-30B-A3B)', level)
    if cfg.get("hidden_act", "silu") != "silu":
        bad("config.hidden_act", "hidden_act", f"{cfg.get('hidden_act')!r}: the EAGLE-3 draft MLP is SiLU-gated",
            'write "hidden_act": "silu"')
    for key in ("attention_bias", "mlp_bias", "bias"):
        if cfg.get(key):
            bad("config.bias", key, "true: SGLang builds the draft without biases and would drop them silently",
                f"train without biases and write \"{key}\": false")
    nkv = int(cfg.get("num_key_value_heads") or nH)
    if nkv <= 0 or nH % nkv:
        bad("config.num_key_value_heads", "num_key_value_heads",
            f"{nkv} does not divide num_attention_heads={nH}", "use a KV head count that divides the query heads")
    if cfg.get("norm_before_residual"):
        bad("config.norm_before_residual", "norm_before_residual",
            "true: SGLang has no such option and runs the head with the un-normed residual",
            "train with norm_before_residual=false (SpecForge/specjax semantics) for a head every engine runs")
    if cfg.get("norm_before_fc"):
        bad("config.norm_before_fc", "norm_before_fc",
            "true: only vLLM applies input_norm; SGLang drops input_norm.weight silently",
            "train without norm_before_fc (EAGLE-3.1's fc_norm is the portable form)")
    if cfg.get("draft_vocab_size") is None:
        bad("config.draft_vocab_size", "draft_vocab_size",
            "absent: vLLM then sizes lm_head as vocab_size and SGLang loads the target's head instead",
            'write "draft_vocab_size": <rows of lm_head.weight>')
    if "max_position_embeddings" not in cfg:
        bad("config.max_position_embeddings", "max_position_embeddings", "absent (engines default to 2048-8192, "
            "so long prompts break: sglang #6783)", "write the target's max_position_embeddings")
    if "torch_dtype" not in cfg and "dtype" not in cfg and "_speculators" not in cfg:
        bad("config.torch_dtype", "torch_dtype", "absent", 'write "torch_dtype" (e.g. "bfloat16")', "warning")
    if "_speculators" not in cfg:
        has_new = isinstance(cfg.get("rope_parameters"), Mapping)
        has_old = "rope_theta" in cfg
        if not (has_new and has_old):
            bad("config.rope_layouts", "rope_parameters" if not has_new else "rope_theta",
                "only one RoPE layout is written; transformers v4 stacks read rope_theta/rope_scaling, "
                "v5 stacks rope_parameters (vLLM PR #51092, speculators PR #574)",
                "write both rope_theta + rope_scaling and rope_parameters, copied from the target")
        elif not same_value(rope_dict({"rope_parameters": cfg["rope_parameters"],
                                        "max_position_embeddings": cfg.get("max_position_embeddings")}),
                             rope_dict({"rope_theta": cfg["rope_theta"], "rope_scaling": cfg.get("rope_scaling"),
                                        "partial_rotary_factor": cfg.get("partial_rotary_factor"),
                                        "max_position_embeddings": cfg.get("max_position_embeddings")})):
            bad("config.rope_layouts", "rope_scaling",
                f"rope_theta/rope_scaling ({cfg['rope_theta']}, {cfg.get('rope_scaling')}) disagree with "
                f"rope_parameters ({cfg['rope_parameters']}); engines pick different ones",
                "write both layouts from the same target RoPE")
    # EAGLE-3.1 flags
    fc_norm, norm_output = bool(cfg.get("fc_norm")), cfg.get("norm_output")
    is31 = fc_norm or bool(norm_output)
    if variant == "eagle3" and is31:
        bad("config.variant", "fc_norm" if fc_norm else "norm_output",
            "an EAGLE-3 export with EAGLE-3.1 flags set", "export with --variant eagle3.1, or train without them")
    if variant == "eagle3.1" and not is31:
        bad("config.variant", "fc_norm", "an EAGLE-3.1 export with neither fc_norm nor norm_output",
            "train with draft.fc_norm=true and/or draft.norm_output=true, or export as eagle3")
    if norm_output is None and "_speculators" not in cfg:
        bad("config.norm_output", "norm_output",
            "absent: engines default to false (pre-norm feedback) but SpecForge reads absent as true with "
            "another meaning (docs/eagle3-format.md, \"EAGLE-3.1 flags (fc_norm, norm_output)\")",
            'write "norm_output": false (or true for an EAGLE-3.1 head trained with post-norm feedback)', "warning")
    if is31:
        bad("config.eagle31", "fc_norm" if fc_norm else "norm_output",
            "EAGLE-3.1 head: needs 2026+ engines (vLLM and SGLang with fc_norm/norm_output); one published "
            "fc_norm head measured acceptance ~1.5 on SGLang vs 3.19 on vLLM (Nemotron card)",
            "serve on a 2026+ vLLM, and measure acceptance before relying on SGLang", "warning")
    # P-EAGLE (parallel drafting): the mask token, and mask_hidden among the tensors (head_shape)
    mask_id = cfg.get("mask_token_id")
    if mask_id is not None:
        V = cfg.get("vocab_size")
        if not isinstance(mask_id, int) or isinstance(mask_id, bool) or not (isinstance(V, int) and 0 <= mask_id < V):
            bad("config.mask_token_id", "mask_token_id", f"{mask_id!r} is not a token id in [0, vocab_size={V})",
                "write the id of the token the undrafted positions read (draft.mask_token_id)")
        elif norm_output:
            bad("config.mask_token_id", "norm_output", "a P-EAGLE head with norm_output: true (a sequential-step "
                "flag; a parallel head has no next step to feed)", 'write "norm_output": false')
        else:
            bad("config.parallel_drafting", "mask_token_id",
                "a P-EAGLE head: engines draft all tokens in one forward only when told (vLLM: speculative_config "
                "method eagle3 with parallel_drafting: true); served as a plain EAGLE-3 head it drafts badly. vLLM "
                "0.34 no longer serves it (parallel_drafting only with dflash / dspark: vllm/config/speculative.py)",
                "serve it on vLLM 0.32 with parallel_drafting: true (specjax.serve_cmd prints it)", "warning")


def _check_aux(cfg, layout, target_config, training_aux_ids, bad):
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    if cfg.get("eagle_config") and cfg["eagle_config"].get("use_aux_hidden_state") is False:
        bad("aux.use_aux_hidden_state", "eagle_config.use_aux_hidden_state",
            "false: vLLM then skips fc (an EAGLE-1 style head)", "write true (EAGLE-3 fuses three aux states)")
    if nested and not top:
        bad("aux.top_level_missing", "eagle_aux_hidden_state_layer_ids",
            "absent at the top level: vLLM reads only that key and silently taps its defaults "
            "(vLLM PR #50170: 1.2% vs 58.9% acceptance)",
            f"write the top-level key = nested ids + 1 = {[int(i) + 1 for i in nested]}")
    if top and not nested and layout == "llama":
        bad("aux.nested_missing", "eagle_config.eagle_aux_hidden_state_layer_ids",
            "absent: SGLang reads only the nested key and silently taps its defaults",
            f"write eagle_config.eagle_aux_hidden_state_layer_ids = top-level ids - 1 = {[int(i) - 1 for i in top]}")
    if not nested and not top:
        bad("aux.absent", "eagle_aux_hidden_state_layer_ids",
            "no aux layer ids: every engine taps its default layers", "write both keys (nested = output-of-layer "
            "ids, top level = those + 1) so non-default taps are not silently replaced", "warning")
    if nested and top and [int(i) + 1 for i in nested] != [int(i) for i in top]:
        bad("aux.convention", "eagle_aux_hidden_state_layer_ids",
            f"top-level {list(top)} != nested {list(nested)} + 1 (vLLM uses input-of-layer ids, SGLang "
            "output-of-layer ids: both must name the same layers)",
            f"write top-level = {[int(i) + 1 for i in nested]} (nested ids + 1)")
    # (the count of ids is checked through fc.weight's shape, which is [H, n_ids * target_hidden_size])
    ids = [int(i) for i in nested] if nested else ([int(i) - 1 for i in top] if top else None)
    if ids is not None:
        if len(set(ids)) != len(ids) or any(b <= a for a, b in zip(ids, ids[1:])):
            bad("aux.range", "eagle_aux_hidden_state_layer_ids", f"{ids} are not unique and increasing",
                "use three distinct increasing layer ids (low, mid, high)")
        if cfg.get("num_aux_hidden_states") and int(cfg["num_aux_hidden_states"]) != len(ids):
            bad("aux.count", "num_aux_hidden_states", f"{cfg['num_aux_hidden_states']} but {len(ids)} aux ids",
                "make num_aux_hidden_states equal the number of ids (or drop it)")
        if target_config is not None:
            depth = target_virtual_depth(target_config)
            out_of_range = [i for i in ids if not 0 <= i < depth]
            if out_of_range:
                bad("aux.range", "eagle_aux_hidden_state_layer_ids",
                    f"output-of-layer ids {out_of_range} outside the target's depth 0..{depth - 1}",
                    f"use ids in [0, {depth}) (output of decoder step k; looped targets count the unrolled depth)")
        if training_aux_ids is not None and [int(i) for i in training_aux_ids] != ids:
            bad("aux.training", "eagle_aux_hidden_state_layer_ids",
                f"config ids {ids} (output convention) differ from the ids the draft was trained with "
                f"{list(training_aux_ids)}", "export from the run's own draft config (its aux_layer_ids)")
    elif training_aux_ids is not None and target_config is not None:
        defaults = list(default_aux_layer_ids(target_virtual_depth(target_config), clamp=False))
        if [int(i) for i in training_aux_ids] != defaults:
            bad("aux.training", "eagle_aux_hidden_state_layer_ids",
                f"no ids written, so engines tap {defaults} but the draft was trained on {list(training_aux_ids)}",
                "write both aux id keys")


def _check_tensors(cfg, layout, tensors: HeadTensors, bad, check_finite: bool):
    names = tensors.names
    prefixed = [k for k in names if k.startswith(("model.", "draft_model."))]
    if prefixed:
        bad("keys.prefix", prefixed[0].split(".")[0] + ".*", f"{len(prefixed)} key(s) carry a model./draft_model. "
            f"prefix, e.g. {prefixed[0]} (vLLM adds `model.` itself and raises on model.model.*; SGLang drops "
            "unknown keys)",
            "save the head's own keys: fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d")
    keys = key_layout(layout, tensors.names)
    if layout == "llama" and keys == "speculators":
        bad("keys.layout", "layers.0.*", "decoder keys are layers.0.*: tpu-inference and pre-2026 SGLang map only "
            "midlayer.* (and SGLang drops what it cannot map)", "save the decoder layer as midlayer.*", "warning")
    try:
        shapes = expected_weight_shapes(cfg, keys)
    except (KeyError, TypeError, ValueError) as e:
        bad("config.required", "config", f"cannot derive the tensor shapes ({e!r})", "write the Llama fields")
        return
    allowed_extra = set(VOCAB_KEYS) | {"embed_tokens.weight"}
    missing = [k for k in shapes if k not in tensors]
    unknown = [k for k in names if k not in shapes and k not in allowed_extra and k not in prefixed]
    for k in missing:
        if k.startswith("fc_norm.") and any(n in tensors for n in LEGACY_AUX_NORMS):
            continue  # reported below as the legacy names
        bad("keys.missing", k, "missing from the weights (engines would run it randomly initialised)",
            "export every tensor of the head's key set (docs/eagle3-format.md, \"Checkpoint layout\")")
    for k in unknown:
        if k in LEGACY_AUX_NORMS:
            bad("keys.unknown", k, "legacy EAGLE-3.1 name: vLLM raises on it and old SGLang drops it",
                f"rename to {LEGACY_AUX_NORMS[k]} and set \"fc_norm\": true")
        elif k.startswith("fc_norm.") and not cfg.get("fc_norm"):
            bad("keys.unknown", k, "fc_norm weights but config fc_norm is not true (engines drop or reject them)",
                'write "fc_norm": true (EAGLE-3.1) or drop the fc_norm weights')
        else:
            bad("keys.unknown", k, "not part of the EAGLE-3 head: SGLang drops unknown keys silently and "
                "vLLM refuses to load them",
                "remove it from the export (only the key set of docs/eagle3-format.md, \"Checkpoint layout\")")
    check_embedding_copy(cfg, tensors, bad, shape_fix="drop embed_tokens (engines use the target's)",
                         copy_problem="a copy of the target embedding is shipped (vLLM keeps it when it differs "
                         "from the target's; SGLang replaces it)",
                         copy_fix="drop it if it copies the target's (engines then share that); keep a trained one "
                         "(draft.train_embedding) for vLLM")
    for k, shape in shapes.items():
        if k in tensors and tuple(tensors.shape(k)) != tuple(shape):
            bad("shapes", k, f"shape {tuple(tensors.shape(k))} but config.json implies {tuple(shape)}",
                "export the config the weights were trained with (hidden_size, heads, head_dim, "
                "intermediate_size, draft_vocab_size, target_hidden_size, aux count)")
    check_weight_dtypes(cfg, tensors, [k for k in shapes if k in tensors], bad, check_finite, shapes)
    check_vocab_maps(cfg, tensors, bad)


def _check_target(cfg, target_config, bad):
    tc = target_text_config(target_config)
    H = int(cfg["hidden_size"])
    tH_target = int(tc["hidden_size"])
    if H != tH_target:
        bad("target.hidden_size", "hidden_size", f"draft {H} != target embedding dim {tH_target}: engines feed "
            "the target's embedding into the draft", f"train the draft with hidden_size {tH_target}")
    tH = int(cfg.get("target_hidden_size") or H)
    if tH != tH_target:
        bad("target.target_hidden_size", "target_hidden_size", f"{tH} != target hidden size {tH_target} (the width "
            "of each aux state fed to fc)", f"write target_hidden_size {tH_target}")
    if int(cfg["vocab_size"]) != int(tc["vocab_size"]):
        bad("target.vocab_size", "vocab_size", f"draft {cfg['vocab_size']} != target config vocab_size "
            f"{tc['vocab_size']} (the size engines scatter draft logits into)",
            f"write vocab_size {tc['vocab_size']} and build t2d over that many ids")
    nkv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    t_nkv = tc.get("num_key_value_heads") or tc.get("num_attention_heads")
    if is_hybrid_target(target_config) and t_nkv is not None and nkv != int(t_nkv):
        bad("target.kv_heads", "num_key_value_heads",
            f"draft {nkv} != target {t_nkv} on a hybrid Mamba/attention target: vLLM cannot unify the KV-cache "
            "page size (unify_kv_cache_spec_page_size) and no runtime flag fixes it (Nemotron card)",
            f"train the draft with draft.num_key_value_heads={t_nkv}")
    mine, theirs = rope_dict(cfg), rope_dict(tc)
    if theirs is None:
        theirs = {"rope_type": "default", "rope_theta": 10000.0}
    # a target with a RoPE per layer type (Gemma 3 / 4): the draft may copy any one of them
    if mine is not None and not any(same_value(mine, t) for t in target_rope_dicts(tc) or [theirs]):
        bad("target.rope", "rope_parameters", f"draft RoPE {mine} != target RoPE {theirs}",
            "copy the target's rope_theta / rope_scaling / rope_parameters into the draft config")
    t_ctx = tc.get("max_position_embeddings")
    if t_ctx is not None and cfg.get("max_position_embeddings") is not None and \
            int(cfg["max_position_embeddings"]) < int(t_ctx):
        bad("target.max_position_embeddings", "max_position_embeddings",
            f"draft {cfg['max_position_embeddings']} < target {t_ctx}: SGLang caps the draft context there "
            "(sglang #6783)", f"write max_position_embeddings {t_ctx}")
    loops = int(tc.get("num_loops") or 1)
    if loops > 1:
        depth = target_virtual_depth(target_config)
        if cfg.get("target_layer_count") != depth:
            bad("target.looped", "target_layer_count",
                f"{cfg.get('target_layer_count')!r} on a looped target ({tc['num_hidden_layers']} layers, {loops} "
                f"loops): engines must place the draft layer after the virtual depth {depth} (Nanbeige card: "
                "vLLM names it at num_hidden_layers and collides with loop 2)",
                f'write "target_layer_count": {depth} and "target_num_loops": {loops}')


def check_folder_head(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping],
                      training_ids: Optional[Sequence[int]], manifest: Optional[Mapping],
                      check_finite: bool) -> list[Finding]:
    """`check_head` for a folder: the claimed variant is the manifest's."""
    variant = manifest.get("variant") if manifest else None
    return check_head(config, tensors, target_config=target_config, training_aux_ids=training_ids,
                      variant=variant, check_finite=check_finite)


# the folder dispatch's entry (specjax_converters.head_formats): every config no other format claims
HEAD_FORMAT = HeadFormat(name="eagle3", recognises=lambda config: True,
                         layout=lambda config: flatten_head_config(config)[0],
                         check=check_folder_head)

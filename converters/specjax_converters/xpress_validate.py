"""Validate an XPress head folder: the speculators 0.9 layout of an XPressDraftModel checkpoint.

The layout is speculators' DFlash-variant layout (specjax_converters.dflash2_validate, whose rules
run here through `check_speculators_head` with XPRESS_LAYOUT): config.json with
speculators_model_type "xpress", architectures ["XPressSpeculator"] (XPressSpeculatorConfig's
default), transformer_layer_config, draft_vocab_size, block_size, aux_hidden_state_layer_ids (taps
+ 1), mask_token_id, sample_from_anchor, speculators_config, and XPress's xpress_rank,
xpress_mlp_ratio, num_jacobi_passes; model.safetensors holds DFlash's weights plus refiner_head.*
(specjax.drafts.xpress_weights), and d2t / t2d when the draft vocab is smaller than the target's.
speculators' `XPressDraftModel.from_pretrained` reads it; vLLM 0.32 has no XPress model (no
speculators_model_type "xpress" in its speculators reader), and vLLM 0.34 refuses it too (its reader
has no "xpress" either: transformers_utils/configs/speculators/base.py:51-56).

vLLM 0.34's own XPress layout (VLLM034_HEAD_FORMAT, `check_xpress_vllm034_head`; what
specjax_converters.xpress_export writes for a head trained with draft.xpress_slot0_prev=anchor). The
vllm-0.34.0 FILE:LINE of each key (under the wheel's vllm/):
  architectures ["Qwen3XPressModel"]   model_executor/models/registry.py:716 (qwen3_xpress's
                               Qwen3XPressForCausalLM, whose XPressSpeculatorConfig has base method
                               "dflash": v1/worker/gpu/spec_decode/xpress/config.py:7,
                               dflash/config.py:15; EAGLEConfig renames it DFlashQwen3XPressModel,
                               registry.py:717, transformers_utils/configs/eagle.py:65-76)
  model_type "qwen3" + the decoder keys of DFlash's backbone (dflash_validate's rules, run on the
                               backbone view `vllm034_backbone_view`)
  mask_token_id                top level (v1/worker/gpu/spec_decode/utils.py:141-152: dflash_config's
                               first, so there is no dflash_config; models/qwen3_dflash.py:496-498)
  target_layer_ids             top level, output-of-layer-k; 0.34 taps k + 1
                               (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py:127-130, read after
                               eagle_aux_hidden_state_layer_ids, dflash_config and
                               dspark_target_layer_ids, :109-126, so none of those is written)
  xpress_block_size, xpress_rank, xpress_mlp_hidden, xpress_topc   models/qwen3_xpress.py:273-278
                               (defaults num_speculative_steps + 1, 256, 512, 512); xpress_topc 0 scores
                               every pass on the whole vocab (:40-46, 148-189), what specjax.eval does
  xpress_num_passes            v1/worker/gpu/spec_decode/xpress/speculator.py:38 (default 6)
  sample_from_anchor false     xpress/speculator.py:29-34 refuses true
  draft_vocab_size = vocab_size   models/qwen3_xpress.py:317-322 refuses a reduced draft vocab
model.safetensors: DFlash's backbone names (fc, hidden_norm, layers.*, norm, lm_head; 0.34 prefixes
`model.` itself) and the refiner as `xpress_head.*` (XPRESS_VLLM034_WEIGHTS, qwen3_xpress.py:242-252,
331-374); no d2t / t2d. 0.34's XPressSpeculator reads the anchor as slot 0's previous token
(xpress/speculator.py:87-90): such a head is trained with draft.xpress_slot0_prev=anchor, which this
layout implies (specjax_converters.xpress_export reads it back with that setting).
No jax at import.
"""
from __future__ import annotations

import types
from fractions import Fraction
from typing import Any, Mapping, Optional, Sequence

from specjax.drafts import weights
from specjax.drafts.xpress_weights import REFINER_WEIGHTS, VLLM034_REFINER_NAMES, XPRESS_WEIGHTS
from specjax_converters import dflash_validate
from specjax_converters.dflash2_validate import SpeculatorsLayout, check_speculators_head
from specjax_converters.head_files import Finding, HeadTensors
from specjax_converters.head_rules import HeadFormat, check_weight_dtypes

__all__ = ["ARCHITECTURE", "HEAD_FORMAT", "MODEL_TYPE", "VLLM034_ARCHITECTURE", "VLLM034_HEAD_FORMAT",
           "VLLM034_HEAD_PREFIX", "VLLM034_LAYOUT_NAME", "XPRESS_LAYOUT", "check_xpress_head",
           "check_xpress_vllm034_head", "names_xpress_head", "names_xpress_vllm034_head", "vllm034_backbone_view",
           "vllm034_refiner_entries"]

ARCHITECTURE = "XPressSpeculator"
MODEL_TYPE = "xpress"
VLLM034_ARCHITECTURE = "Qwen3XPressModel"  # vLLM 0.34's registry name (registry.py:716)
VLLM034_LAYOUT_NAME = "xpress_vllm034"
VLLM034_HEAD_PREFIX = "xpress_head."
# the keys vLLM 0.34 reads before the top-level taps / mask token (eagle3_utils.py:109-126, utils.py:148-149)
_VLLM034_OVERRIDES = ("dflash_config", "eagle_aux_hidden_state_layer_ids", "dspark_target_layer_ids")
# backbone findings that do not apply to the 0.34 layout (its own rules below say what it needs)
_NOT_VLLM034 = {"dflash.architectures", "dflash.config", "dflash.sample_from_anchor"}


def _no_more_rules(config, V, H, bad) -> None:
    """XPress's own fields need no rule beyond being positive (num_jacobi_passes may be 0)."""


XPRESS_LAYOUT = SpeculatorsLayout(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, display="XPress",
    own_fields=("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes"), table=XPRESS_WEIGHTS,
    check_fields=_no_more_rules, full_vocab=False)


def names_xpress_head(conf: Mapping) -> bool:
    """An XPress head's config.json (speculators layout)."""
    return conf.get("speculators_model_type") == MODEL_TYPE


def check_xpress_head(config: Mapping, tensors: HeadTensors | Mapping[str, Any], *,
                      target_config: Optional[Mapping] = None, training_layer_ids: Optional[Sequence[int]] = None,
                      check_finite: bool = True) -> list[Finding]:
    return check_speculators_head(config, tensors, XPRESS_LAYOUT, target_config=target_config,
                                  training_layer_ids=training_layer_ids, check_finite=check_finite)


def _check_folder(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping],
                  training_ids: Optional[Sequence[int]], manifest: Optional[Mapping], check_finite: bool):
    return check_xpress_head(config, tensors, target_config=target_config, training_layer_ids=training_ids,
                             check_finite=check_finite)


HEAD_FORMAT = HeadFormat(name="xpress", recognises=names_xpress_head, layout=lambda config: "xpress",
                         check=_check_folder)


# ---------------------------------------------------------------------------------------------
# vLLM 0.34's own layout (the module doc)
# ---------------------------------------------------------------------------------------------
def names_xpress_vllm034_head(conf: Mapping) -> bool:
    """A config.json of vLLM 0.34's XPress layout: architectures ["Qwen3XPressModel"]."""
    return list(conf.get("architectures") or []) == [VLLM034_ARCHITECTURE]


def _int(v) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def vllm034_backbone_view(config: Mapping) -> dict:
    """The DFlash config.json of a 0.34-layout XPress head's backbone (what dflash_validate and
    dflash_import read): the top-level mask token and taps as a dflash_config block, block_size from
    xpress_block_size."""
    out = {k: v for k, v in config.items() if k not in ("mask_token_id", "target_layer_ids", "block_size")}
    out["architectures"] = [dflash_validate.ARCHITECTURE]
    out["dflash_config"] = {"use_aux_hidden_state": config.get("use_aux_hidden_state", True),
                            "sample_from_anchor": bool(config.get("sample_from_anchor", False))}
    for key in ("mask_token_id", "target_layer_ids"):
        if key in config:
            out["dflash_config"][key] = config[key]
    if "xpress_block_size" in config:
        out["block_size"] = config["xpress_block_size"]
    return out


def vllm034_refiner_entries(config: Mapping) -> list[weights.Entry]:
    """The refiner's tensors (0.34's names, shapes) a 0.34-layout config.json implies; KeyError /
    TypeError / ValueError when its keys cannot size them."""
    r, m = int(config["xpress_rank"]), int(config["xpress_mlp_hidden"])
    shape = types.SimpleNamespace(hidden_size=int(config["hidden_size"]), vocab_size=int(config["vocab_size"]),
                                  draft_vocab_size=int(config.get("draft_vocab_size") or config["vocab_size"]),
                                  block_size=int(config["xpress_block_size"]), xpress_rank=r,
                                  xpress_mlp_ratio=Fraction(m, r))  # r * ratio = m exactly
    return [e._replace(file_name=VLLM034_REFINER_NAMES[e.file_name]) for e in weights.entries(REFINER_WEIGHTS, shape)]


def _renamed(f: Finding) -> Finding:
    field = f.field.replace("dflash_config.", "")
    field = "xpress_block_size" if field == "block_size" else field
    rule = f.rule.replace("dflash.", "xpress.", 1) if f.rule.startswith("dflash.") else f.rule
    return Finding(rule, field, f.problem, f.fix.replace("dflash_config", "config.json"), f.level)


def check_xpress_vllm034_head(config: Mapping, tensors: HeadTensors | Mapping[str, Any], *,
                              target_config: Optional[Mapping] = None,
                              training_layer_ids: Optional[Sequence[int]] = None,
                              check_finite: bool = True) -> list[Finding]:
    """All findings for one head of vLLM 0.34's XPress layout (the module doc)."""
    if not isinstance(tensors, HeadTensors):
        tensors = HeadTensors.from_arrays(tensors)
    out: list[Finding] = []

    def bad(rule, field, problem, fix, level="error"):
        out.append(Finding(rule, field, problem, fix, level))

    arch = config.get("architectures")
    if arch != [VLLM034_ARCHITECTURE]:
        bad("xpress.architectures", "architectures", f"{arch!r}, not [{VLLM034_ARCHITECTURE!r}] (the name vLLM 0.34 "
            "maps to its qwen3_xpress drafter)", f'write "architectures": ["{VLLM034_ARCHITECTURE}"]')
    for key in _VLLM034_OVERRIDES:
        if key in config:
            bad("xpress.overrides", key, "present: vLLM 0.34 reads the mask token / taps from it before the top-level "
                "mask_token_id and target_layer_ids", f"drop {key} (write the top-level keys only)")
    for key in ("mask_token_id", "target_layer_ids"):
        if key not in config:
            bad(f"xpress.{key}", key, "absent at the top level (vLLM 0.34 reads it there for Qwen3XPressModel)",
                f'write "{key}" (specjax.export does)')
    sizes_ok = True
    for key, default in (("xpress_block_size", "num_speculative_tokens + 1"), ("xpress_rank", 256),
                         ("xpress_mlp_hidden", 512)):
        v = _int(config.get(key))
        if v is None or v < (2 if key == "xpress_block_size" else 1):
            sizes_ok = False
            bad(f"xpress.{key}", key, f"{config.get(key)!r}: must be a positive integer"
                f"{' >= 2' if key == 'xpress_block_size' else ''} (absent, vLLM 0.34 uses {default}, not what the "
                "head was trained with)", f'write "{key}" (the value the head was trained with)')
    passes = config.get("xpress_num_passes")
    if passes is None:
        bad("xpress.xpress_num_passes", "xpress_num_passes", "absent: vLLM 0.34 runs 6 Jacobi passes",
            'write "xpress_num_passes" (draft.num_jacobi_passes)', "warning")
    elif _int(passes) is None or passes < 0:
        bad("xpress.xpress_num_passes", "xpress_num_passes", f"{passes!r}: must be an integer >= 0",
            'write "xpress_num_passes" (draft.num_jacobi_passes)')
    V, Vd = _int(config.get("vocab_size")), config.get("draft_vocab_size", config.get("vocab_size"))
    topc = config.get("xpress_topc")
    if topc is None or (_int(topc) is not None and topc > 0):
        bad("xpress.xpress_topc", "xpress_topc", f"{topc!r}: vLLM 0.34 then scores each Jacobi pass on the top "
            f"{512 if topc is None else topc} base candidates only, so its drafts can differ from specjax.eval's "
            "(whole-vocab scoring)", 'write "xpress_topc": 0', "warning")
    elif _int(topc) is None or (V is not None and topc > V):
        bad("xpress.xpress_topc", "xpress_topc", f"{topc!r}: must be an integer in [0, vocab_size]",
            'write "xpress_topc": 0')
    if config.get("sample_from_anchor"):
        bad("xpress.sample_from_anchor", "sample_from_anchor", "true: vLLM 0.34's XPress drafter refuses it (fill-in "
            "layout only)", "train with draft.sample_from_anchor=false")
    if V is not None and Vd != V:
        bad("xpress.vocab", "draft_vocab_size", f"{Vd!r} != vocab_size {V}: vLLM 0.34's XPress model needs the full "
            "draft vocab (qwen3_xpress.py raises NotImplementedError)",
            f'train with draft.draft_vocab_size={V} (the target vocab)')
    r, m = _int(config.get("xpress_rank")), _int(config.get("xpress_mlp_hidden"))
    if r and m and r > 0 and m % r:
        bad("xpress.xpress_mlp_hidden", "xpress_mlp_hidden", f"{m} is not a multiple of xpress_rank {r}: vLLM 0.34 "
            "loads it, but specjax's refiner MLP is xpress_rank x xpress_mlp_ratio wide, so specjax.eval cannot read "
            "it back", "use a multiple of xpress_rank", "warning")
    # 0.34's Triton latent kernel (v1/worker/gpu/spec_decode/xpress/kernels.py) spans r with tl.arange (:126),
    # which needs a power of two, and reads the MLP in unmasked 64-column tiles (:163-167, HT=64 at :225)
    if r and r > 0 and r & (r - 1):
        bad("xpress.kernel_shapes", "xpress_rank", f"{r} is not a power of two: vLLM 0.34's Triton refiner kernel "
            "spans it with tl.arange, which needs one", "train with draft.xpress_rank a power of two (e.g. 256)",
            "warning")
    if m and m > 0 and m % 64:
        bad("xpress.kernel_shapes", "xpress_mlp_hidden", f"{m} is not a multiple of 64: vLLM 0.34's Triton refiner "
            "kernel reads the MLP in unmasked 64-column tiles", "train with xpress_rank * xpress_mlp_ratio a multiple "
            "of 64 (the default 256 x 2 is)", "warning")
    # the taps, then DFlash's rules on the backbone's DFlash view, without the refiner's tensors
    refiner = [k for k in tensors.names if k.startswith(VLLM034_HEAD_PREFIX)]
    found = dflash_validate.check_block_backbone("xpress", config, vllm034_backbone_view(config), tensors,
                                                 (VLLM034_HEAD_PREFIX,), target_config=target_config,
                                                 training_layer_ids=training_layer_ids, check_finite=check_finite)
    out += [_renamed(f) for f in found if f.rule not in _NOT_VLLM034]
    if not sizes_ok:
        return out
    try:
        expected = {e.file_name: e for e in vllm034_refiner_entries(config)}
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        bad("config.required", "config", f"cannot derive the refiner's shapes ({e!r})", "write the decoder shape keys")
        return out
    for k, e in expected.items():
        if k not in tensors:
            bad("keys.missing", k, "missing from the weights (vLLM 0.34 would run the refiner uninitialised)",
                "export every tensor of the refiner (specjax.drafts.xpress_weights.XPRESS_VLLM034_WEIGHTS)")
        elif tuple(tensors.shape(k)) != e.file_shape:
            bad("shapes", k, f"shape {tuple(tensors.shape(k))} but config.json implies {e.file_shape}",
                "export the config the weights were trained with (xpress_rank, xpress_mlp_hidden, "
                "xpress_block_size)")
    for k in refiner:
        if k not in expected:
            bad("keys.unknown", k, "not a tensor of vLLM 0.34's XPress refiner (it would have no parameter for it)",
                "remove it from the export")
    check_weight_dtypes(config, tensors, [k for k in expected if k in tensors], bad, check_finite,
                        {k: e.file_shape for k, e in expected.items()})
    return out


def _check_vllm034_folder(config: Mapping, tensors: HeadTensors, *, target_config: Optional[Mapping],
                          training_ids: Optional[Sequence[int]], manifest: Optional[Mapping], check_finite: bool):
    return check_xpress_vllm034_head(config, tensors, target_config=target_config, training_layer_ids=training_ids,
                                     check_finite=check_finite)


VLLM034_HEAD_FORMAT = HeadFormat(name=VLLM034_LAYOUT_NAME, recognises=names_xpress_vllm034_head,
                                 layout=lambda config: VLLM034_LAYOUT_NAME, check=_check_vllm034_folder)

"""Validate an XPress head folder: the speculators 0.9 layout of an XPressDraftModel checkpoint.

The layout is speculators' DFlash-variant layout (specjax_converters.dflash2_validate, whose rules
run here through `check_speculators_head` with XPRESS_LAYOUT): config.json with
speculators_model_type "xpress", architectures ["XPressSpeculator"] (XPressSpeculatorConfig's
default), transformer_layer_config, draft_vocab_size, block_size, aux_hidden_state_layer_ids (taps
+ 1), mask_token_id, sample_from_anchor, speculators_config, and XPress's xpress_rank,
xpress_mlp_ratio, num_jacobi_passes; model.safetensors holds DFlash's weights plus refiner_head.*
(specjax.drafts.xpress_weights), and d2t / t2d when the draft vocab is smaller than the target's.
speculators' `XPressDraftModel.from_pretrained` reads it; vLLM 0.32 has no XPress model (no
speculators_model_type "xpress" in its speculators reader), so no engine serves it yet.
No jax at import.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from specjax.drafts.xpress_weights import XPRESS_WEIGHTS
from specjax_converters.dflash2_validate import SpeculatorsLayout, check_speculators_head
from specjax_converters.head_files import Finding, HeadTensors
from specjax_converters.head_rules import HeadFormat

__all__ = ["ARCHITECTURE", "HEAD_FORMAT", "MODEL_TYPE", "XPRESS_LAYOUT", "check_xpress_head", "names_xpress_head"]

ARCHITECTURE = "XPressSpeculator"
MODEL_TYPE = "xpress"


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

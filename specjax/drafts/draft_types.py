"""The one place that maps a draft config to the module that builds it.

A run's draft config is an `eagle3.Eagle3Config` (draft.type eagle3 and p_eagle: P-EAGLE is an
EAGLE-3 head with parallel_drafting) or a `dflash.DFlashConfig` (draft.type dflash). Set-up, the
train step, checkpoints (run_meta.json) and export call these functions instead of a draft module,
so each of them dispatches on the config's type in one way.

In run_meta.json the draft config is stored as the module's config_to_dict plus, beside it,
`draft_family` ("dflash"; absent in runs written before DFlash existed, which are EAGLE-3).
"""
from __future__ import annotations

from typing import Mapping, Optional, Union

import jax

from specjax.drafts import dflash, eagle3

DraftConfigType = Union[eagle3.Eagle3Config, dflash.DFlashConfig]
FAMILY_KEY = "draft_family"  # run_meta.json key beside draft_config
EAGLE3, DFLASH = "eagle3", "dflash"


def family(draft_cfg) -> str:
    """"dflash" for a DFlash block drafter, else "eagle3" (EAGLE-3, EAGLE-3.1 and P-EAGLE heads)."""
    return DFLASH if isinstance(draft_cfg, dflash.DFlashConfig) else EAGLE3


def is_dflash(draft_cfg) -> bool:
    return family(draft_cfg) == DFLASH


def init_draft_params(draft_cfg, key: jax.Array, *, std: float = 0.02, lm_head_rows=None) -> dict:
    """Random init of the draft's params; a DFlash head's lm_head starts as `lm_head_rows` (the
    target's rows of the draft vocab) when given, as both DFlash references start it."""
    if is_dflash(draft_cfg):
        return dflash.init_draft_params(draft_cfg, key, std=std, lm_head_rows=lm_head_rows)
    return eagle3.init_draft_params(draft_cfg, key, std=std)


def param_logical_axes(draft_cfg) -> dict:
    module = dflash if is_dflash(draft_cfg) else eagle3
    return module.param_logical_axes(draft_cfg)


def config_to_dict(draft_cfg) -> dict:
    module = dflash if is_dflash(draft_cfg) else eagle3
    return module.config_to_dict(draft_cfg)


def config_from_dict(d: Mapping, draft_family: Optional[str] = None):
    """The draft config saved by config_to_dict; `draft_family` is the run_meta.json FAMILY_KEY
    (None: eagle3)."""
    if draft_family in (None, EAGLE3):
        return eagle3.config_from_dict(dict(d))
    if draft_family == DFLASH:
        return dflash.config_from_dict(dict(d))
    raise ValueError(f"{FAMILY_KEY}={draft_family!r} is not a draft family this specjax knows "
                     f"({EAGLE3!r}, {DFLASH!r}); export the run with the specjax version that trained it.")

"""The draft families specjax ships, registered: import this module (not the family modules one by
one) to look families up with the functions re-exported from specjax.drafts.family. A family added
here (or registered by any imported module) is found by every lookup; nothing else changes.

Registration order is lookup order: EAGLE-3 first (the family of a run_meta.json without
`draft_family` and of any head folder no other family recognises), then P-EAGLE, then DFlash, then
JetSpec (DFlash with causal attention inside the block), then DSpark (DFlash's backbone with a Markov
head and a confidence head), then EAGLE-1 (draft.type eagle), then DFlash 2 (DFlash with dynamic
convolutions and a candidate selector), then XPress (DFlash with a causal refiner run for K Jacobi
passes), then MTP (the target's own multi-token-prediction layer).
"""
from __future__ import annotations

from specjax.drafts import eagle3_family  # registers first: see the module doc
from specjax.drafts import dflash_family  # noqa: I001
from specjax.drafts import jetspec_family
from specjax.drafts import dspark_family
from specjax.drafts import eagle1_family
from specjax.drafts import dflash2_family
from specjax.drafts import xpress_family
from specjax.drafts import mtp_family
from specjax.drafts.family import (FAMILIES, META_KEY, DraftFamily, ServePlan, draft_config_from_meta,
                                   family_for_folder, family_for_head, family_for_type, family_from_meta, family_of,
                                   foreign_draft_key_error, known_types, register, unregister)

BUILT_IN = (eagle3_family.EAGLE3, eagle3_family.P_EAGLE, dflash_family.DFLASH, jetspec_family.JETSPEC,
            dspark_family.DSPARK, eagle1_family.EAGLE1, dflash2_family.DFLASH2, xpress_family.XPRESS,
            mtp_family.MTP)

__all__ = ["BUILT_IN", "FAMILIES", "META_KEY", "DraftFamily", "ServePlan", "draft_config_from_meta",
           "family_for_folder", "family_for_head", "family_for_type", "family_from_meta", "family_of",
           "foreign_draft_key_error", "known_types", "register", "unregister"]

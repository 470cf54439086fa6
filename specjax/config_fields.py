"""Building blocks of the run configuration's sections, shared by `specjax.config` and the draft
families (specjax.drafts.family and each family module), which define the `draft` section's
per-type subclasses. Standard library only (no jax, no other specjax module), so any module can
import it without an import circle.

- `ConfigError`: a configuration problem whose message says what, where and how to fix it;
- `ranged(default, ge=..., ...)`: a dataclass field with a numeric range, checked by
  `CheckedSection.__post_init__` when the section is built;
- `DraftSection`: the keys every draft type has. `draft.type` selects a registered subclass
  (`specjax.drafts.family.register`) that adds that type's own keys.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional


class ConfigError(ValueError):
    """A configuration problem; the message says what, where, and how to fix it."""


def ranged(default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None, also: tuple = ()) -> Any:
    """A field whose numeric value must lie in a range (None = unset passes; `also`: extra allowed
    values outside it, e.g. -1 = "fill"). Checked when the section is built (`CheckedSection`)."""
    return field(default=default, metadata={"range": (ge, gt, le, lt, also)})


def range_text(ge, gt, le, lt) -> str:
    lo = f">= {ge}" if ge is not None else f"> {gt}" if gt is not None else ""
    hi = f"<= {le}" if le is not None else f"< {lt}" if lt is not None else ""
    return " and ".join(x for x in (lo, hi) if x)


class CheckedSection:
    """Range checks for the `ranged` fields of a section, run on construction, so a bad value fails
    when the config is loaded, with the key, the rule and the value, not at trace time or step 0."""

    SECTION = ""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            rule = f.metadata.get("range")
            value = getattr(self, f.name)
            if rule is None or value is None:
                continue
            ge, gt, le, lt, also = rule
            values = value if isinstance(value, tuple) else (value,)
            for v in values:
                ok = v in also or ((ge is None or v >= ge) and (gt is None or v > gt)
                                   and (le is None or v <= le) and (lt is None or v < lt))
                if not ok:
                    extra = f" (or {', '.join(map(repr, also))})" if also else ""
                    raise ConfigError(f"`{self.SECTION}.{f.name}` = {value!r} must be "
                                      f"{range_text(ge, gt, le, lt)}{extra}.")


@dataclass(frozen=True)
class DraftSection(CheckedSection):
    """The `draft` keys of every draft type. `type` picks the subclass its family registered
    (specjax.drafts.family), which adds the type's own keys; a key of another type is refused when
    the config loads."""
    SECTION: ClassVar[str] = "draft"
    # eagle3: K sequential draft steps (EAGLE-3/3.1); p_eagle: all K tokens from one parallel forward,
    # the undrafted positions reading mask_token_id's embedding and a learned mask_hidden (P-EAGLE);
    # dflash: a block drafter (specjax.drafts.dflash), block_size-1 tokens from one forward over
    # [anchor, mask, ..., mask] attending to the target's context states; jetspec: the same with
    # causal attention inside the block, trained by forward KL to the target
    type: str = "eagle3"
    draft_vocab_size: int = ranged(32000, ge=1)
    # None -> copied from the target (the draft's hidden size always equals the target's)
    intermediate_size: Optional[int] = ranged(None, ge=1)
    num_attention_heads: Optional[int] = ranged(None, ge=1)
    num_key_value_heads: Optional[int] = ranged(None, ge=1)
    head_dim: Optional[int] = ranged(None, ge=1)
    init_std: float = ranged(0.02, gt=0.0)
    # decoder layers of the head (the Nemotron card's 2-layer ablation); vLLM serves N > 1, SGLang one
    num_layers: int = ranged(1, ge=1)
    # warm start: a published head folder of the same draft type (EAGLE-3: SpecForge midlayer.* /
    # speculators layers.0.* / specjax export; DFlash: a specjax DFlash export)
    init_from: Optional[str] = None

"""Building blocks of the run configuration's sections, shared by `specjax.config` and the draft
families (specjax.drafts.family and each family module), which define the `draft` section's
per-type subclasses. Standard library only (no jax, no other specjax module), so any module can
import it without an import circle.

- `ConfigError`: a configuration problem whose message says what, where and how to fix it;
- `described(default, doc)` / `ranged(default, doc=..., ge=..., ...)`: a dataclass field with its
  one-line description (shown by `--help` and in docs/config.md) and, for `ranged`, a numeric range
  checked by `CheckedSection.__post_init__` when the section is built; `key_doc` / `doc_problems`
  read and check the descriptions;
- `DraftSection`: the keys every draft type has. `draft.type` selects a registered subclass
  (`specjax.drafts.family.register`) that adds that type's own keys.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional


class ConfigError(ValueError):
    """A configuration problem; the message says what, where, and how to fix it."""


# a key's description is one line of at most this many characters (what it does, its unit or choices);
# the longer why stays a comment beside the field
DOC_MAX_CHARS = 120


class FrozenMapping(dict):
    """A mapping a config section holds (a config is frozen and hashable: jitted code closes over it):
    read-only, hashed by its JSON form."""

    def __hash__(self):
        return hash(json.dumps(self, sort_keys=True, default=str))

    def _read_only(self, *args, **kwargs):
        raise TypeError("a config mapping is read-only; build a new config (dataclasses.replace) instead")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __reduce__(self):
        return (FrozenMapping, (dict(self),))


def described(default: Any, doc: str) -> Any:
    """A field with its one-line description (`doc`), shown by `--help` and in docs/config.md. A dict
    default becomes a FrozenMapping."""
    if isinstance(default, dict):
        return field(default=FrozenMapping(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


def ranged(default: Any, *, doc: str | None = None, ge: float | None = None, gt: float | None = None,
           le: float | None = None, lt: float | None = None, also: tuple = ()) -> Any:
    """A field whose numeric value must lie in a range (None = unset passes; `also`: extra allowed
    values outside it, e.g. -1 = "fill"). Checked when the section is built (`CheckedSection`).
    `doc`: its one-line description, as for `described` (a section's keys without one fail
    `doc_problems`, which the tests and `python -m specjax.config_doc --check` run)."""
    metadata: dict = {"range": (ge, gt, le, lt, also)}
    if doc is not None:
        metadata["doc"] = doc
    return field(default=default, metadata=metadata)


def key_doc(cls: type, name: str) -> Optional[str]:
    """The description of key `name` of section class `cls`: its field's, else, for a field a subclass
    redeclares only to change its default (each draft type's `type`), the nearest base class's."""
    for klass in cls.__mro__:
        fields = {f.name: f for f in dataclasses.fields(klass)} if dataclasses.is_dataclass(klass) else {}
        if name not in fields:
            break
        doc = fields[name].metadata.get("doc")
        if doc:
            return doc
    return None


def doc_problems(cls: type, section: str) -> list[str]:
    """What is wrong with the descriptions of `cls`'s keys (written `section.key`): a key without one,
    or one that is not a single line of at most DOC_MAX_CHARS characters; each message starts with the
    key in backticks. Empty when all are fine."""
    out = []
    for f in dataclasses.fields(cls):
        doc = key_doc(cls, f.name)
        where = f"`{section}.{f.name}` ({cls.__name__})"
        if doc is None or not doc.strip():
            out.append(f"{where} has no description: declare it with described(default, doc) or "
                       f"ranged(default, doc=..., ...) (specjax.config_fields).")
        elif "\n" in doc or len(doc) > DOC_MAX_CHARS:
            out.append(f"{where}: the description must be one line of at most {DOC_MAX_CHARS} characters "
                       f"(it has {len(doc)}); keep the longer explanation as a comment beside the field.")
    return out


def range_text(ge, gt, le, lt) -> str:
    lo = f">= {ge}" if ge is not None else f"> {gt}" if gt is not None else ""
    hi = f"<= {le}" if le is not None else f"< {lt}" if lt is not None else ""
    return " and ".join(x for x in (lo, hi) if x)


class CheckedSection:
    """Range checks for the `ranged` fields of a section, run on construction, so a bad value fails
    when the config is loaded, with the key, the rule and the value, not at trace time or step 0."""

    SECTION = ""
    DOC = ""  # one line on what the section configures (docs/config.md)

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
    DOC: ClassVar[str] = "The draft head to train: its type, shape and initialisation."
    # eagle3: K sequential draft steps (EAGLE-3/3.1); p_eagle: all K tokens from one parallel forward,
    # the undrafted positions reading mask_token_id's embedding and a learned mask_hidden (P-EAGLE);
    # dflash: a block drafter (specjax.drafts.dflash), block_size-1 tokens from one forward over
    # [anchor, mask, ..., mask] attending to the target's context states; jetspec: the same with
    # causal attention inside the block, trained by forward KL to the target
    type: str = described("eagle3", "Draft architecture; its own keys are listed under its type below "
                                    "(another type's key is refused)")
    # the draft vocab is a subset of the target's: the ids counted most often among the training data's
    # assistant (loss-masked) tokens, ties to the smaller id (specjax.drafts.vocab)
    draft_vocab_size: int = ranged(32000, ge=1, doc="Tokens the draft can predict: the most frequent assistant "
                                                    "tokens of the training data (at most the target's vocab)")
    # None -> copied from the target (the draft's hidden size always equals the target's)
    intermediate_size: Optional[int] = ranged(None, ge=1, doc="MLP width of the draft's layers; null: the "
                                                              "target's")
    num_attention_heads: Optional[int] = ranged(None, ge=1, doc="Attention heads of the draft's layers; null: "
                                                                "the target's")
    num_key_value_heads: Optional[int] = ranged(None, ge=1, doc="Key/value heads of the draft's layers; null: "
                                                                "the target's")
    head_dim: Optional[int] = ranged(None, ge=1, doc="Width of one attention head; null: the target's (EAGLE-3 "
                                                     "with num_attention_heads set: hidden size / heads)")
    init_std: float = ranged(0.02, gt=0.0, doc="Standard deviation of the normal random init of the draft's "
                                               "weight matrices")
    # decoder layers of the head (the Nemotron card's 2-layer ablation); vLLM serves N > 1, SGLang one
    num_layers: int = ranged(1, ge=1, doc="Decoder layers of the draft (SGLang serves 1-layer EAGLE-3 heads; "
                                          "DFlash/JetSpec read one target tap per layer)")
    # warm start: a published head folder of the same draft type (EAGLE-3: SpecForge midlayer.* /
    # speculators layers.0.* / specjax export; DFlash: a specjax DFlash export)
    init_from: Optional[str] = described(None, "Warm start from a head folder of the same draft type (EAGLE-3: "
                                               "SpecForge, speculators or specjax; others: specjax)")
    # several runs (other data, methods or seeds) then share one map, so their heads are comparable and
    # their exports interchangeable in the same serving config
    vocab_file: Optional[str] = described(None, "Draft vocabulary to use instead of counting this run's data: "
                                                "another run's draft_vocab.npz")

"""The draft vocabulary: which Vd of the target's V tokens the draft head can predict.

Encoding (what vLLM / SGLang read from the exported checkpoint):
  draft_ids int64 [Vd]  target ids in ascending order
  d2t       int64 [Vd]  offsets, target_id = i + d2t[i]
  t2d       bool  [V]   t2d[v] = v is in the draft vocab
Invariant: nonzero(t2d) == arange(Vd) + d2t. Ascending order matters: training gathers target
logits with the boolean mask t2d, which yields them in ascending id order.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

import numpy as np

__all__ = ["DraftVocab", "build_draft_vocab", "token_counts_from_examples"]


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.setflags(write=False)  # the dataclass is frozen; keep its arrays from being edited in place
    return a


@dataclasses.dataclass(frozen=True, eq=False)
class DraftVocab:
    draft_ids: np.ndarray  # int64 [Vd], ascending
    d2t: np.ndarray  # int64 [Vd]
    t2d: np.ndarray  # bool [V]

    def __post_init__(self):
        object.__setattr__(self, "draft_ids", _frozen(np.asarray(self.draft_ids, dtype=np.int64)))
        object.__setattr__(self, "d2t", _frozen(np.asarray(self.d2t, dtype=np.int64)))
        object.__setattr__(self, "t2d", _frozen(np.asarray(self.t2d, dtype=bool)))
        self.validate()

    @property
    def vocab_size(self) -> int:
        return int(self.t2d.shape[0])

    @property
    def draft_vocab_size(self) -> int:
        return int(self.draft_ids.shape[0])

    @classmethod
    def from_ids(cls, ids: Iterable[int], vocab_size: int) -> "DraftVocab":
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("draft ids must be a non-empty 1-D list of target token ids")
        if ids.min() < 0 or ids.max() >= vocab_size:
            bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
            raise ValueError(f"draft id {bad} is outside the target vocab [0, {vocab_size})")
        ids = np.sort(ids)
        if np.any(np.diff(ids) == 0):
            raise ValueError("draft ids contain duplicates")
        t2d = np.zeros(vocab_size, dtype=bool)
        t2d[ids] = True
        return cls(draft_ids=ids, d2t=ids - np.arange(ids.size, dtype=np.int64), t2d=t2d)

    @classmethod
    def identity(cls, vocab_size: int) -> "DraftVocab":
        """Vd == V: the draft predicts over the whole target vocab (d2t all zeros)."""
        return cls.from_ids(np.arange(vocab_size, dtype=np.int64), vocab_size)

    def validate(self) -> None:
        ids, d2t, t2d = self.draft_ids, self.d2t, self.t2d
        if ids.ndim != 1 or d2t.shape != ids.shape or t2d.ndim != 1:
            raise ValueError(
                f"bad DraftVocab shapes: draft_ids {ids.shape}, d2t {d2t.shape}, t2d {t2d.shape}"
            )
        V, Vd = t2d.shape[0], ids.shape[0]
        if Vd == 0 or Vd > V:
            raise ValueError(f"draft vocab size {Vd} must be in [1, {V}]")
        if ids.min() < 0 or ids.max() >= V:
            raise ValueError(f"draft ids must lie in [0, {V}), got range [{ids.min()}, {ids.max()}]")
        if np.any(np.diff(ids) <= 0):
            raise ValueError("draft ids must be unique and strictly ascending")
        if not np.array_equal(d2t, ids - np.arange(Vd)):
            raise ValueError("d2t must equal draft_ids - arange(Vd)")
        if not np.array_equal(np.flatnonzero(t2d), np.arange(Vd) + d2t):
            raise ValueError("t2d does not match d2t: nonzero(t2d) != arange(Vd) + d2t")

    def save(self, path: str | os.PathLike) -> None:
        # Write through a file handle so numpy does not append ".npz" to a path that lacks it.
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            np.savez(f, draft_ids=self.draft_ids, d2t=self.d2t, t2d=self.t2d)
        os.replace(tmp, path)  # atomic: a reader never sees a half-written vocab

    @classmethod
    def load(cls, path: str | os.PathLike) -> "DraftVocab":
        with np.load(os.fspath(path), allow_pickle=False) as z:
            missing = {"draft_ids", "d2t", "t2d"} - set(z.files)
            if missing:
                raise ValueError(f"{path} is not a DraftVocab file (missing {sorted(missing)})")
            return cls(draft_ids=z["draft_ids"], d2t=z["d2t"], t2d=z["t2d"])


def token_counts_from_examples(examples: Iterable, vocab_size: int) -> np.ndarray:
    """int64 [V] counts of the loss-masked (assistant) tokens, the ones the draft must predict."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ex in examples:
        ids = np.asarray(ex.input_ids)[np.asarray(ex.loss_mask) != 0].astype(np.int64)
        if ids.size == 0:
            continue
        hi, lo = int(ids.max()), int(ids.min())
        if hi >= vocab_size:
            raise ValueError(
                f"token id {hi} is >= the target vocab size {vocab_size}: the tokenizer is larger than "
                "the target vocab (use the target model's own tokenizer, or check config vocab_size)"
            )
        if lo < 0:
            raise ValueError(f"negative token id {lo} in the examples")
        counts += np.bincount(ids, minlength=vocab_size)
    return counts


def build_draft_vocab(counts: np.ndarray, draft_vocab_size: int) -> DraftVocab:
    """Top-``draft_vocab_size`` ids by count (ties: smaller id first). When fewer ids were seen,
    unseen ids 0, 1, 2, ... fill the rest (they have count 0, so the tie-break picks them)."""
    counts = np.asarray(counts)
    if counts.ndim != 1:
        raise ValueError(f"counts must be 1-D [V], got shape {counts.shape}")
    V = counts.shape[0]
    if draft_vocab_size <= 0:
        raise ValueError(f"draft_vocab_size must be positive, got {draft_vocab_size}")
    if draft_vocab_size > V:
        raise ValueError(
            f"draft_vocab_size {draft_vocab_size} is larger than the target vocab {V}; "
            f"set draft_vocab_size <= {V} (= {V} means the full target vocab)"
        )
    if np.any(counts < 0):
        raise ValueError("token counts must be non-negative")
    # lexsort: the last key is primary -> descending count, then ascending id.
    order = np.lexsort((np.arange(V), -counts.astype(np.int64)))
    return DraftVocab.from_ids(order[:draft_vocab_size], V)

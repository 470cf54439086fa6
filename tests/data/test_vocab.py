"""specjax.drafts.vocab: draft-vocab selection and the d2t / t2d encoding."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from _tok import build_tokenizer
from specjax.data import Example, tokenize_conversation
from specjax.drafts.vocab import DraftVocab, build_draft_vocab, token_counts_from_examples


def check_invariant(v: DraftVocab, V: int, Vd: int):
    assert v.draft_ids.dtype == np.int64 and v.d2t.dtype == np.int64 and v.t2d.dtype == np.bool_
    assert v.draft_ids.shape == (Vd,) and v.d2t.shape == (Vd,) and v.t2d.shape == (V,)
    np.testing.assert_array_equal(np.flatnonzero(v.t2d), np.arange(Vd) + v.d2t)
    np.testing.assert_array_equal(v.draft_ids, np.arange(Vd) + v.d2t)
    assert np.all(np.diff(v.draft_ids) > 0) and v.draft_ids.max() < V
    assert v.vocab_size == V and v.draft_vocab_size == Vd


def test_top_k_with_tie_break_by_smaller_id():
    counts = np.array([5, 3, 3, 0, 3, 9, 0, 1], dtype=np.int64)
    v = build_draft_vocab(counts, 3)
    # 9 (id 5), 5 (id 0), then a three-way tie at 3 -> the smallest id, 1.
    np.testing.assert_array_equal(v.draft_ids, [0, 1, 5])
    np.testing.assert_array_equal(v.d2t, [0, 0, 3])
    check_invariant(v, 8, 3)
    np.testing.assert_array_equal(build_draft_vocab(counts, 5).draft_ids, [0, 1, 2, 4, 5])


def test_fill_with_unseen_ids_from_zero():
    counts = np.zeros(10, dtype=np.int64)
    counts[7] = 4
    counts[3] = 1
    v = build_draft_vocab(counts, 4)
    np.testing.assert_array_equal(v.draft_ids, [0, 1, 3, 7])
    check_invariant(v, 10, 4)
    full = build_draft_vocab(counts, 10)
    np.testing.assert_array_equal(full.draft_ids, np.arange(10))
    np.testing.assert_array_equal(full.d2t, np.zeros(10))


def test_errors():
    with pytest.raises(ValueError, match="draft_vocab_size 11 is larger than the target vocab 10"):
        build_draft_vocab(np.zeros(10, np.int64), 11)
    with pytest.raises(ValueError):
        build_draft_vocab(np.zeros(10, np.int64), 0)
    ex = Example(np.array([1, 2, 12], np.int32), np.array([0, 1, 1], np.int32))
    with pytest.raises(ValueError, match=r"token id 12 .*tokenizer is larger than the target vocab"):
        token_counts_from_examples([ex], 10)
    # An out-of-range id outside the loss mask does not count, so it is not an error either.
    ok = Example(np.array([12, 2], np.int32), np.array([0, 1], np.int32))
    assert token_counts_from_examples([ok], 10)[2] == 1


def test_counts_only_loss_masked_tokens():
    exs = [
        Example(np.array([1, 2, 3, 3], np.int32), np.array([0, 1, 1, 1], np.int32)),
        Example(np.array([4, 3, 1], np.int32), np.array([1, 0, 0], np.int32)),
    ]
    counts = token_counts_from_examples(exs, 6)
    assert counts.dtype == np.int64
    np.testing.assert_array_equal(counts, [0, 0, 1, 2, 1, 0])


def test_validate_rejects_inconsistent_mappings():
    t2d = np.zeros(6, bool)
    t2d[[1, 4]] = True
    DraftVocab(draft_ids=np.array([1, 4]), d2t=np.array([1, 3]), t2d=t2d)  # consistent
    with pytest.raises(ValueError, match="t2d"):
        bad = t2d.copy()
        bad[2] = True
        DraftVocab(draft_ids=np.array([1, 4]), d2t=np.array([1, 3]), t2d=bad)
    with pytest.raises(ValueError, match="d2t"):
        DraftVocab(draft_ids=np.array([1, 4]), d2t=np.array([1, 4]), t2d=t2d)
    with pytest.raises(ValueError, match="ascending"):
        DraftVocab(draft_ids=np.array([4, 1]), d2t=np.array([4, 0]), t2d=t2d)
    with pytest.raises(ValueError, match="duplicates"):
        DraftVocab.from_ids([1, 1], 6)
    with pytest.raises(ValueError, match="outside the target vocab"):
        DraftVocab.from_ids([1, 6], 6)


def test_frozen():
    v = DraftVocab.identity(5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.d2t = np.zeros(5)
    with pytest.raises(ValueError):
        v.t2d[0] = False  # arrays are read-only


def test_identity_and_save_load(tmp_path):
    ident = DraftVocab.identity(7)
    check_invariant(ident, 7, 7)
    assert ident.t2d.all() and not ident.d2t.any()
    v = build_draft_vocab(np.array([0, 4, 0, 2, 2, 0, 1, 8, 0]), 4)
    for name in ("vocab.npz", "vocab_no_suffix"):
        path = tmp_path / "sub" / name
        v.save(path)
        assert path.exists()
        w = DraftVocab.load(path)
        for f in ("draft_ids", "d2t", "t2d"):
            np.testing.assert_array_equal(getattr(v, f), getattr(w, f))
            assert getattr(v, f).dtype == getattr(w, f).dtype
    bogus = tmp_path / "bogus.npz"
    np.savez(bogus, a=np.zeros(3))
    with pytest.raises(ValueError, match="not a DraftVocab"):
        DraftVocab.load(bogus)


def test_from_tokenized_conversations():
    tok = build_tokenizer()
    V = len(tok)
    msgs = [
        [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "I am fine, thank you."}],
        [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon a time."}],
    ]
    exs = [tokenize_conversation(tok, m, 64) for m in msgs]
    counts = token_counts_from_examples(exs, V)
    seen = np.flatnonzero(counts)
    v = build_draft_vocab(counts, 32)
    check_invariant(v, V, 32)
    assert v.t2d[seen].all()  # every assistant token fits the draft vocab
    assert v.t2d[tok.convert_tokens_to_ids("<|im_end|>")]  # the end-of-turn token is trained
    with pytest.raises(ValueError, match="tokenizer is larger"):
        token_counts_from_examples(exs, int(seen.max()))

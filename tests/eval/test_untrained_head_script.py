"""benchmarks/untrained_head.py --target: a random-init head for any target folder loads in the
decoder, and speculative output with it still equals greedy output (it accepts ~nothing)."""
import importlib.util
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("untrained_head", os.path.join(ROOT, "benchmarks", "untrained_head.py"))
uh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(uh)


def test_untrained_head_for_a_target(tiny_target, tmp_path, monkeypatch, capsys):
    from specjax.eval.spec_decode import SpecDecoder, load_draft
    from specjax.targets import load_target

    out = tmp_path / "head"
    monkeypatch.setattr(sys, "argv", ["untrained_head.py", "--target", tiny_target, "--draft-vocab-size", "100",
                                      "--out", str(out)])
    uh.main()
    draft = load_draft(str(out))
    target = load_target(tiny_target, dtype="float32")
    assert draft.config.draft_vocab_size == 100
    np.testing.assert_array_equal(draft.vocab.draft_ids, np.arange(100))
    dec = SpecDecoder(target, draft, num_spec_tokens=3)
    prompt = [1, 5, 9, 14, 3]
    assert dec.generate(prompt, max_new_tokens=8).tokens == dec.greedy(prompt, max_new_tokens=8).tokens
    # exactly one of --config / --target
    monkeypatch.setattr(sys, "argv", ["untrained_head.py", "--out", str(tmp_path / "x")])
    with pytest.raises(SystemExit):
        uh.main()
    assert "exactly one of --config" in capsys.readouterr().err

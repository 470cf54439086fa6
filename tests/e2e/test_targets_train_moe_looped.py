"""A few EAGLE-3 training steps + a validated export on the tiny looped targets (looped Llama with
virtual taps past the physical depth, HRM-Text). Setup and pass criteria: _target_training.py."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from _target_training import train_and_export  # noqa: E402


@pytest.mark.parametrize("kind", ["looped_llama", "hrm_text"])
def test_few_steps_learn_and_export(kind, tmp_path):
    train_and_export(kind, tmp_path)

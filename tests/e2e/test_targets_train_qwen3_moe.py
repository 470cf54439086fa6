"""A few EAGLE-3 training steps + a validated export on the tiny Qwen3-MoE target (mixed MoE and
dense layers). Setup and pass criteria: _target_training.py."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from _target_training import train_and_export  # noqa: E402


def test_few_steps_learn_and_export(tmp_path):
    train_and_export("qwen3_moe", tmp_path)

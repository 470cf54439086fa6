"""The bars of test_decoding_families.py (its docstring) for the families of its MORE_FAMILIES: Qwen3-Next,
Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet state windows), Mistral with a sliding window, Gemma 3,
gpt-oss, GLM-4.7-Flash and MiniMax-M2. The same tests, collected here over this file's own ``target`` fixture, so that
pytest-xdist (--dist loadfile) runs the two halves on two workers."""
from test_decoding_families import *  # noqa: F401,F403  (the tests and the fixtures they use)
from test_decoding_families import MORE_FAMILIES, family_fixture, is_slow_case  # noqa: F401 (conftest reads it)

target = family_fixture(MORE_FAMILIES)

"""benchmarks/lossless_families.py builds its targets with the suite's own builders, imported under the
suite's module names (a rename in the suite once broke the script's imports while every test passed)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import lossless_families  # noqa: E402


def test_builds_one_target_per_registered_architecture(tmp_path):
    from specjax.targets.registry import supported_architectures

    targets, fam = lossless_families._targets(str(tmp_path))
    from specjax.targets import multimodal

    # the multimodal checkpoints are their text families' targets (already built), read from other files
    assert set(targets) == set(supported_architectures()) - {layout.architecture for layout in multimodal.LAYOUTS}
    for arch, target in targets.items():
        assert target.config.architecture == arch
        target.require_decoding()
    assert fam.__name__ == "parity.test_decoding_families"

"""benchmarks/methods.py --variant: named variants of one config (issue 22's data-scaling curve runs
through the methods pipeline this way)."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("methods_bench", os.path.join(ROOT, "benchmarks", "methods.py"))
methods = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(methods)


def test_parse_variants():
    got = methods.parse_variants(["k1=data.max_rows=1000", "two=a.b=1;c.d=[x, y]", "all="])
    assert got == {"k1": ["data.max_rows=1000"], "two": ["a.b=1", "c.d=[x, y]"], "all": []}
    assert list(got) == ["k1", "two", "all"]  # trained in the order given
    for bad in (["noequals"], ["=data.x=1"], ["a=x.y=1", "a=x.y=2"], ["a=notdotted"]):
        with pytest.raises(SystemExit, match="--variant"):
            methods.parse_variants(bad)


def test_every_method_config_loads_with_its_draft_type():
    """Each METHODS entry resolves against the base recipe (a key of another draft.type would be refused
    when the config loads) and the block methods draft the chain's token count."""
    from specjax.config import load_config

    expected = {"eagle3": "eagle3", "eagle3.1": "eagle3", "p_eagle": "p_eagle", "dflash": "dflash",
                "jetspec": "jetspec", "dflash2": "dflash2", "dspark": "dspark", "xpress": "xpress", "eagle1": "eagle"}
    assert set(methods.METHODS) == set(expected)
    for name, overrides in methods.METHODS.items():
        cfg = load_config(os.path.join(ROOT, methods.BASE_CONFIG), overrides)
        assert cfg.draft.type == expected[name], name
        if name in ("dflash", "jetspec", "dflash2", "xpress"):  # slot 0 is the anchor: block_size - 1 drafts
            assert cfg.draft.block_size - 1 == methods.NUM_SPEC_TOKENS and not cfg.draft.sample_from_anchor, name
        if name == "dspark":  # its slot 0 drafts too
            assert cfg.draft.block_size == methods.NUM_SPEC_TOKENS and cfg.draft.sample_from_anchor


def test_export_params_reads_safetensors_headers(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"a": np.zeros((3, 4), np.float32), "b": np.zeros((5,), np.float16)}, str(tmp_path / "model.safetensors"))
    save_file({"c": np.zeros((2, 2, 2), np.float32)}, str(tmp_path / "extra.safetensors"))
    assert methods.export_params(str(tmp_path)) == 12 + 5 + 8

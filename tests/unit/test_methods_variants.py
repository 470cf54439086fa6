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

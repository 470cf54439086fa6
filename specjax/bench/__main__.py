"""`python -m specjax.bench ...`: see specjax.bench.cli."""
import sys

from specjax.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())

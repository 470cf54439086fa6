"""`python -m specjax.eval ...`: see specjax.eval.cli."""
import sys

from specjax.eval.cli import main

if __name__ == "__main__":
    sys.exit(main())

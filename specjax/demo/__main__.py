import sys

from specjax.demo.cli import main

sys.exit(main())

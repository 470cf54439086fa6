"""The one way benchmark scripts write their results file."""
from __future__ import annotations

import json


def write_results(result: dict, path: str | None) -> int:
    """Write `result` as indented JSON to `path` (nothing when None); the script's exit status (0)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return 0

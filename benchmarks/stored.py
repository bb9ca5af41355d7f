"""A standalone benchmark's result file (benchmarks/results/NAME.json, which README quotes): the
command that made it, its date, and its numbers."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def write_result(path: str | Path, script: str, **fields) -> None:
    """Write `fields` to `path` with this invocation's command (`python benchmarks/SCRIPT ARGS`)
    and today's date first."""
    command = f"python benchmarks/{script} " + " ".join(sys.argv[1:])
    Path(path).write_text(json.dumps({"command": command, "date": time.strftime("%Y-%m-%d"), **fields}, indent=2))

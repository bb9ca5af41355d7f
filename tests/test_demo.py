"""README's first command, as a user runs it: the demo job through the CLI."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from airay.events import read_jsonl

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]


def test_demo_job_recovers_from_worker_and_node_loss(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "airay.cli", "run", str(ROOT / "jobs" / "demo.yaml"),
                           "--run-dir", str(tmp_path / "demo")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "demo" / "result.json").read_text())
    assert result["status"] == "finished" and result["final_step"] == 130 and result["restarts"] == 2
    sizes = result["world_sizes"]
    assert sizes[0] == 4 and sizes[-1] == 4 and sizes.count(3) == 2
    types = [e["type"] for e in read_jsonl(tmp_path / "demo" / "events.jsonl")]
    assert types.count("worker_failed") == 1 and types.count("node_lost") == 1 and "node_added" in types
    # The console a person reads (issue 30): the story, in short lines; events.jsonl has the rest.
    lines = proc.stdout.splitlines()
    assert len(lines) <= 60, proc.stdout
    assert max(len(line) for line in lines) <= 200
    assert not re.search(r"\b[0-9a-f]{56}\b", proc.stdout + proc.stderr)  # no whole node id
    assert all(line.startswith("[airay] ") for line in lines), [x for x in lines if not x.startswith("[airay] ")]
    resizes = [line for line in lines if re.match(r"\[airay\] resize \d -> \d \((failure|grow)\) at step", line)]
    assert len(resizes) == 2 * 4  # as they happen, then in the summary
    assert lines[-1] == f"[airay] run directory {tmp_path / 'demo'}"
    assert any(line.startswith("[airay] finished at step 130: loss ") for line in lines)
    assert sum(line.startswith("[airay] step 12: rank 1 on node ") for line in lines) == 1
    assert "WARNING" not in proc.stdout + proc.stderr  # DeepSpeed's notices quieted where they are made
    for name in ("config.yaml", "events.jsonl", "metrics.jsonl", "result.json"):
        assert (tmp_path / "demo" / name).is_file()

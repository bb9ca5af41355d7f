"""Benchmarks run in reduced mode so they cannot rot; their numbers live in README/BENCHMARKS."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]


def test_suite_runner_writes_benchmarks_md_reduced(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--reduced", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    for heading in ("## Start-up", "## Recovery", "## Overhead", "## Controller decision path", "## Driver CPU per round",
                    "## Simulated goodput", "## Many jobs on one fleet, simulated",
                    "## Recovery: airay vs Ray Train", "## Checkpoint: memory, held time per save", "## Data path"):
        assert heading in text
    # Every table row carries a number, and each section names the command that produced it.
    assert text.count("`python benchmarks/") == 9 and "`airay simulate --gpus 1024" in text
    assert "| 256 |" in text and "| 1024 | " in text and "cold / warm **" in text
    # Warm recovery's parts are measured and add up to less than a cold start of the same checkpoint.
    cells = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    parts = {k: float(cells[k][1]) for k in ("detection_s", "drain_s", "reform_s", "reload_s", "recovery_s")}
    assert all(v > 0 for v in parts.values()), parts
    assert parts["detection_s"] <= parts["recovery_s"]
    cold = next(float(c[1]) for k, c in cells.items() if k.startswith("cold start"))
    assert parts["recovery_s"] < cold
    # Both sides of the Ray Train comparison trained the same samples to the same loss.
    row = {line.split(" | ")[1]: line.split(" | ") for line in text.splitlines() if line.startswith("| worker | ")}
    assert set(row) == {"airay", "Ray Train"}
    assert abs(float(row["airay"][7]) - float(row["Ray Train"][7])) < 1e-4
    # Checkpoint section: a row per size, every cell measured (at this 7 MiB size a save's fixed
    # costs dominate; the full sweep compares the held time with DeepSpeed's synchronous save).
    section, by_part = text.split("## Checkpoint:")[1].split("\n## ")[0].split("Held per save by part")
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    # The held time by part: the save call, the previous commit's wait, the next step's wait.
    parts_rows = [line.strip("| ").split(" | ") for line in by_part.splitlines() if line.startswith("| 3 |")]
    assert len(parts_rows) == 1 and float(parts_rows[0][2]) > 0 and all(float(c) >= 0 for c in parts_rows[0][3:])
    assert [(r[0], r[1]) for r in rows] == [("| 3", "64")]  # ZeRO-3, d_model 64
    for r in rows:
        # The worker-RSS-to-footprint cell may be "-": a run this short can save before its
        # workers are first sampled (benchmarks/checkpoint.py says so); every other cell is measured.
        assert r[5].strip() == "-" or float(r[5]) > 0, r
        assert all(float(c.strip(" |M")) > 0 for i, c in enumerate(r) if i >= 3 and i not in (5, 15)), r
        # The resharded run's losses are the fault-free run's; its reads cover what it needed.
        assert float(r[15]) < 1e-5 and float(r[14]) >= 1.0, r
    # Start-up: `airay run` to the first step, in parts that add up to the total.
    startup = next(line.split(" | ") for line in text.splitlines() if line.startswith("| airay | ")
                   and "driver" in line)
    parts = dict(p.rsplit(" ", 1) for p in startup[2].rstrip(" |").split(", "))
    assert set(parts) == {"driver", "cluster", "connect", "placement", "actor", "imports", "engine", "first step"}
    assert abs(sum(map(float, parts.values())) - float(startup[1])) < 0.2 and float(parts["engine"]) > 0
    # The data path delivered rows on both sides and its demo fit measured a data wait share.
    assert float(cells["plain DataLoader (baseline)"][1]) > 0 and float(cells["airay (Ray Data path)"][1]) > 0
    assert "`python benchmarks/data.py --reduced`" in text and "Data wait share of step time" in text

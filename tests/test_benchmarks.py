"""Benchmarks run in reduced mode so they cannot rot; their numbers live in README/BENCHMARKS."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]


def test_recovery_benchmark_reduced(tmp_path):
    out = tmp_path / "rec.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "recovery.py"), "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cold / warm recovery ratio" in proc.stdout
    numbers = json.loads(out.read_text())
    med = numbers["median"]
    assert 0 < med["detection_s"] <= med["recovery_s"] < numbers["cold_median_s"]
    assert med["reform_s"] > 0 and med["reload_s"] > 0


def test_suite_runner_writes_benchmarks_md_reduced(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--reduced", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = out.read_text()
    for heading in ("## Recovery", "## Overhead", "## Controller decision path", "## Simulated goodput",
                    "## Recovery and goodput: airay vs Ray Train"):
        assert heading in text
    # Every table row carries a number, and each section names the command that produced it.
    assert text.count("`python benchmarks/") == 4 and "`airay simulate --gpus 1024" in text
    assert "| 256 |" in text and "| 1024 | " in text and "cold / warm **" in text
    # Both sides of the Ray Train comparison trained the same samples to the same loss.
    row = {line.split(" | ")[1]: line.split(" | ") for line in text.splitlines() if line.startswith("| worker | ")}
    assert set(row) == {"airay", "Ray Train"}
    assert abs(float(row["airay"][7]) - float(row["Ray Train"][7])) < 1e-4

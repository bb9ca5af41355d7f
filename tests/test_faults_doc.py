"""docs/FAULTS.md is the matrix the fault test asserts, generated from a measured run."""

import re
from pathlib import Path

from airay.faults_doc import ELSEWHERE, MATRIX, render

DOC = Path(__file__).resolve().parent.parent / "docs" / "FAULTS.md"


def test_doc_rows_are_the_tested_matrix_with_its_outcomes():
    text = DOC.read_text()
    matrix, elsewhere = text.split("## Tested elsewhere")
    rows = [line for line in matrix.splitlines() if line.startswith("| `") or line.startswith("| two")]
    assert len(rows) == len(MATRIX)
    for row, (name, expected) in zip(rows, MATRIX.items()):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == expected.fault and cells[3] == expected.outcome, name
        assert re.fullmatch(r"\d+\.\d\d", cells[6]), (name, cells[6])  # a measured detect time
    assert "python -m airay.faults_doc" in text and "tests/test_fault_matrix.py" in text
    others = [line for line in elsewhere.splitlines() if line.startswith("| ") and not line.startswith("| fault")
              and not line.startswith("| ---")]
    assert [[c.strip() for c in row.strip("|").split("|")] for row in others] == \
        [[t.fault, t.detected, t.action, t.outcome, t.where] for t in ELSEWHERE.values()]


def test_render_refuses_incomplete_results():
    import pytest

    with pytest.raises(ValueError, match="results lack case"):
        render({"cases": {}, "max_steps": 20, "every_n_steps": 5, "hang_timeout_s": 4, "machine": "m",
                "command": "AIRAY_FAULT_RESULTS=r.json pytest", "date": "d"})

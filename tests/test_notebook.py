"""notebooks/quickstart.ipynb runs top to bottom (nbclient, a real kernel, a real local cluster)."""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # stored without outputs
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the notebook starts its own local cluster
    # The kernel imports this checkout's airay, also when it is not installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "finished at step 24" in text and "resize 3 -> 2 (failure)" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plot, inline
    assert "goodput" in text and (tmp_path / "runs" / "quickstart" / "result.json").is_file()
    # The Hugging Face part: trained through a kill, exported, loaded, generating.
    assert "llama finished at step 20" in text and "restarts 1" in text and "generated: 'def " in text
    assert (tmp_path / "runs" / "llama-hf" / "model.safetensors").is_file()

"""Every notebook runs from top to bottom, so none can rot."""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

from tests.flags import xla_flags
from tests.helpers import ROOT

NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))


def test_there_are_notebooks():
    assert any(path.endswith("quickstart.ipynb") for path in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", xla_flags(1))  # one CPU device, as on a laptop
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    outputs = [
        output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    ]
    assert not [output for output in outputs if output.output_type == "error"]
    assert any("image/png" in output.get("data", {}) for output in outputs)  # the plot

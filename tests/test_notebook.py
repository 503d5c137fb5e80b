"""examples/quickstart.ipynb runs top to bottom (so it cannot rot)."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_quickstart_notebook_executes():
  path = os.path.join(ROOT, "examples", "quickstart.ipynb")
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=500, kernel_name="python3",
                 resources={"metadata": {"path": ROOT}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  text = "".join(o.get("text", "") for o in outputs)
  assert "tok/s decode" in text and "llama" in text

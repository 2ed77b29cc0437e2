"""Every notebook runs top to bottom (GPU cells detect the device and skip without one)."""

import glob
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")

NB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(NB_DIR, "*.ipynb"))), ids=os.path.basename)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": NB_DIR}})
    client.execute()  # raises CellExecutionError on any failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors

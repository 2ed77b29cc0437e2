"""Every notebook runs top to bottom (GPU cells detect the device and skip without one).

With nbclient (CI) the notebooks run in a real Jupyter kernel; without it (the H200 image has
no Jupyter) their code cells run in order in one fresh Python process, IPython magics removed.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

NB_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NB_DIR, "*.ipynb")))


def _has_jupyter():
    try:
        import ipykernel  # noqa: F401
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401

        return True
    except ImportError:
        return False


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path):
    pytest.importorskip("matplotlib")
    if _has_jupyter():
        import nbclient
        import nbformat

        nb = nbformat.read(path, as_version=4)
        client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": NB_DIR}})
        client.execute()  # raises CellExecutionError on any failing cell
        return
    cells = [c for c in json.load(open(path))["cells"] if c["cell_type"] == "code"]
    code = "\n\n".join("\n".join(line for line in "".join(c["source"]).splitlines()
                                 if not line.lstrip().startswith("%")) for c in cells)
    r = subprocess.run([sys.executable, "-c", code], cwd=NB_DIR, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, MPLBACKEND="Agg"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]

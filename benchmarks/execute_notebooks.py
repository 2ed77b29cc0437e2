"""Execute every notebook in ``notebooks/`` top to bottom and save it with its outputs (plots
included), so that they show where the repository is browsed: ``python benchmarks/execute_notebooks.py``.

Needs the ``notebooks`` extra (nbformat, nbclient, ipykernel, matplotlib) and the package
installed. Cells that need a GPU detect the device and say so when there is none.
"""

import argparse
import glob
import os

import nbclient
import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("paths", nargs="*", help="notebooks (default: notebooks/*.ipynb)")
    a = ap.parse_args(argv)
    paths = a.paths or sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": os.path.dirname(path)}}).execute()
        nbformat.write(nb, path)
        print("executed", os.path.relpath(path, ROOT))


if __name__ == "__main__":
    main()

"""The README's examples run as written, and the benchmark tables of README.md and
BENCHMARKS.md are exactly what benchmarks/report.py generates from the committed JSON."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md")).read()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, re.S)


def _gpu():
    try:
        import cupy

        return cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def test_readme_has_examples():
    assert len(SNIPPETS) >= 5


@pytest.mark.parametrize("code", SNIPPETS, ids=[s.splitlines()[0][:40] for s in SNIPPETS])
def test_readme_example_runs(code, tmp_path):
    if "# needs a CUDA GPU" in code and not _gpu():
        pytest.skip("this example needs a CUDA GPU")
    for mod in re.findall(r"^import ([\w, .]+)", code, re.M)[0].split(","):
        pytest.importorskip(mod.split()[0].split(".")[0])
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 0, r.stderr[-3000:]


def test_benchmark_tables_are_generated_from_the_json():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "report.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_benchmark_help_and_no_gpu_message():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--help"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0 and "--no-peers" in r.stdout and "--plot" in r.stdout, r.stderr
    if not _gpu():
        r = subprocess.run([sys.executable, "-m", "cupy_rope", "bench"], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=ROOT))
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr

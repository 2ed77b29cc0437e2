"""The main job (`python -m cupy_rope`) on this machine: device detection, checks, bench table."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "cupy_rope", *args], capture_output=True, text=True, env=env,
                          timeout=900)


def test_main_job_quick(tmp_path):
    out = tmp_path / "main.json"
    r = _run("--quick", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "running on" in r.stdout and "check:" in r.stdout and "0 failed" in r.stdout
    assert "% copy" in r.stdout
    res = json.loads(out.read_text())
    assert res["failures"] == [] and res["checks"] > 50 and len(res["bench"]) == 4


def test_main_check_filters_and_help():
    r = _run("check", "--dtype", "bfloat16", "--layout", "thd")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 failed" in r.stdout
    h = _run("--help")
    assert h.returncode == 0 and "bench" in h.stdout and "--json" in h.stdout
    bad = _run("--dtype", "float64")
    assert bad.returncode != 0

import os
import sys
import tempfile
from pathlib import Path

# CuPy reads its cache directory once, at import: set it before anything imports cupy.
os.environ.setdefault("CUPY_CACHE_DIR", str(Path(tempfile.gettempdir()) / "cupy_rope_test_cache"))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402


def _gpu_available():
    try:
        import cupy

        return cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _gpu_available()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU (GPU tests run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

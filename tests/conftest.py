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


@pytest.fixture(params=["ffi", "callback"])
def xla_launch(request, monkeypatch):
    """Run a JAX GPU test once per XLA launch way (cupy_rope/_xla.py): the FFI handler and the
    buffer callback; the FFI handler must build wherever there is a C++ compiler."""
    import jax

    from cupy_rope import _cxx, _xla

    if request.param == "ffi" and _xla.ffi_library() is None:
        assert _cxx.compiler() is None, "the XLA launch handler did not build"
        pytest.skip("no C++ compiler: no FFI handler")
    monkeypatch.setattr(_xla, "FFI", request.param == "ffi")
    jax.clear_caches()
    yield request.param
    jax.clear_caches()

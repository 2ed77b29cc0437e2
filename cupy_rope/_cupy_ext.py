"""The CuPy launch path in C++ (``csrc/cupy_launch.cpp``): build, load, configure.

The public API's launch cache (:mod:`cupy_rope._launch`) serves a repeated call (same shapes,
strides, dtypes, devices, options, address alignment) by patching addresses into the launch its
first call prepared. For CuPy arrays that hit runs in C++: the call's key built from the arrays'
attributes, the cache dict looked up, the outputs allocated by CuPy, the prepared parameter blocks
patched and the kernel launched on CuPy's current stream, with no Python of cupy_rope's in
between. Misses (and anything the C++ side does not serve) take the Python path, which validates,
plans, launches, and keeps the launch under the key the C++ side returned, with its C++ entry.

Built once per source and compiler with the host C++ compiler and Python's headers (no CUDA
toolkit, no CUDA or CuPy headers) and cached (:mod:`cupy_rope._cxx`: ``CUPY_ROPE_HOST_CACHE``,
default ``~/.cache/cupy_rope``); the driver's launch entry points come from libcuda at run time.

``CUPY_ROPE_CUPY_EXT``: ``auto`` (default: built and used where a C++ compiler and Python's
headers are present, else the Python path; a failed build warns once), ``1`` (required: a
missing tool or a failed build raises), ``0`` (never: the Python path).
"""

from __future__ import annotations

import ctypes
import functools
import sysconfig
from pathlib import Path

from . import _cxx, _interop, _launch

SOURCE = Path(__file__).parent / "csrc" / "cupy_launch.cpp"
HEADERS = (SOURCE.parent / "cuda_launch.h", SOURCE.parent / "overlap.h", SOURCE.parent / "py_values.h")


def _python_include() -> Path:
    return Path(sysconfig.get_paths()["include"])


def missing_tools() -> str:
    """Why the library cannot be built here ('' when it can)."""
    if not _cxx.compiler():
        return "no C++ compiler on PATH (g++ or c++; or set CXX)"
    if not (_python_include() / "Python.h").is_file():
        return f"Python's headers are not installed (no Python.h in {_python_include()})"
    return ""


def build() -> Path:
    """Compile (or find in the cache) the library; returns its path."""
    why = missing_tools()
    if why:
        raise RuntimeError(f"cupy_rope: cannot build the CuPy launch path: {why}")
    flags = ["-std=c++17", "-O2", "-fPIC", "-shared", f"-I{SOURCE.parent}", f"-isystem{_python_include()}"]
    return _cxx.shared_library("cupy_launch", SOURCE.read_text(), [flags], files=HEADERS,
                               announce="cupy_rope: building the CuPy launch path (once; "
                                        "CUPY_ROPE_CUPY_EXT=0 skips it)")


def functions(path) -> tuple:
    """The library's ``(fast, entry, configure)`` (C++ functions; csrc/cupy_launch.cpp says what
    each takes)."""
    init = ctypes.PyDLL(str(path)).cupy_rope_cupy_launch
    init.restype, init.argtypes = ctypes.py_object, []
    return init()


def configure(configure_fn, alloc=None, stream=None, driver=(0, 0, 0)) -> None:
    """Point the library at CuPy: its ndarray type, allocator (default ``cupy.ndarray(shape,
    dtype)``, what ``cupy.empty`` calls: the current device's memory pool), current-stream query
    (default ``cupy.cuda.get_current_stream``), launch error (CuPy's driver error) and the
    driver's ``cuCtxGetCurrent``, ``cuLaunchKernel`` and ``cuLaunchKernelEx`` (addresses; 0:
    libcuda's). The CPU tests pass stand-ins."""
    import cupy

    configure_fn(cupy.ndarray, alloc or cupy.ndarray, stream or cupy.cuda.get_current_stream,
                 _launch.raise_driver_error, *driver)


def load():
    """``(fast, entry)`` of the library per ``CUPY_ROPE_CUPY_EXT``, configured for CuPy: ``fast``
    the C++ hit path, ``entry(prepared, outputs)`` a prepared launch's C++ entry; or None (the
    Python path)."""
    def load_configured():
        fast, entry_fn, configure_fn = functions(build())
        configure(configure_fn)
        return fast, functools.partial(entry, entry_fn)

    return _cxx.optional("CUPY_ROPE_CUPY_EXT", load_configured, "cupy_rope: the CuPy launch path",
                         "using the Python launch path", skip=missing_tools())


def entry(entry_fn, prepared, outputs):
    """The C++ entry (``entry_fn``: the library's) of a prepared launch
    (:class:`cupy_rope._launch.Prepared`) and its outputs as the launch cache keeps them
    ``(like, shape, transposed, same, align)``."""
    base = ctypes.addressof(prepared.buf)
    outs = tuple((like, _interop.alloc_shape(shape, tr), int(tr), align) for like, shape, tr, _same, align in outputs)
    return entry_fn(prepared.fptr, prepared.grid[0], prepared.grid[1], prepared.block, prepared.pdl,
                    bytes(prepared.buf), tuple((a - base) // 8 for a in prepared.argv),
                    tuple(tuple(s) for s in prepared.slots), outs, prepared.ctx or 0, prepared.device)

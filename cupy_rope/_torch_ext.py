"""The torch shim's C++ launch path (``csrc/torch_launch.cpp``): build, load, feed.

Built once per source, torch version and compiler with the host C++ compiler, torch's headers
and libraries (no CUDA toolkit, no CUDA headers, no build tool) and cached
(:mod:`cupy_rope._cxx`: ``CUPY_ROPE_HOST_CACHE``, default ``~/.cache/cupy_rope``). Once loaded,
the cupy_rope ops' CUDA kernels are C++: a call whose signature (shapes, strides, dtypes,
devices, options, address alignment; in place, the overlaps) was seen before launches from
C++; any other call runs the Python path (op ``cupy_rope::_py_<op>``), which validates, plans,
launches and hands its prepared launch to the C++ cache (:func:`mirror`).

``CUPY_ROPE_TORCH_EXT``: ``auto`` (default: built and used where torch sees a CUDA device and
the build tools are present; otherwise, or if the build fails, a warning and the Python path),
``1`` (required: a failed build raises), ``0`` (never: the Python path).
"""

from __future__ import annotations

import re
import sysconfig
import threading
from pathlib import Path

import torch

from . import _cxx, _launch

SOURCE = Path(__file__).parent / "csrc" / "torch_launch.cpp"
HEADERS = (SOURCE.parent / "cuda_launch.h", SOURCE.parent / "overlap.h", SOURCE.parent / "py_values.h")
_state = threading.local()  # .on: this thread resolves a miss of the C++ path
_LOADED: list = []


def missing_tools() -> str:
    """Why the library cannot be built here ('' when it can)."""
    return "" if _cxx.compiler() else "no C++ compiler on PATH (g++ or c++; or set CXX)"


def build() -> str:
    """Compile (or find in the cache, :mod:`cupy_rope._cxx`) and load the library; returns its
    path. One build per source, torch version and compiler, with torch's headers, against its
    libraries; with Python's headers where they are found (the fast entry, :data:`FAST`), else
    without. Loading registers the C++ CUDA kernels of the cupy_rope ops: only call it before
    the torch shim registers its Python ones (the shim does)."""
    from torch.utils import cpp_extension

    if missing_tools():
        raise RuntimeError(f"cupy_rope: cannot build the C++ launch path: {missing_tools()}")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    common = ["-O2", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{SOURCE.parent}",
              *[f"-isystem{p}" for p in cpp_extension.include_paths()]]
    python = ["-DCUPY_ROPE_PYTHON", f"-isystem{sysconfig.get_paths()['include']}"]
    ldflags = [*[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    # recent torch headers need C++20, older ones accept C++17; without Python's headers, no fast entry
    flag_sets = [[std, *common, *py] for py in (python, []) for std in ("-std=c++20", "-std=c++17")]
    path = _cxx.shared_library("torch_launch_" + re.sub(r"\W", "_", torch.__version__), SOURCE.read_text(),
                               flag_sets, files=HEADERS, ldflags=ldflags,
                               announce="cupy_rope.torch: building the C++ launch path (once per version, "
                                        "10-60 s; CUPY_ROPE_TORCH_EXT=0 skips it)")
    torch.ops.load_library(str(path))
    _load_fast(path)
    return str(path)


# The C++ fast entry, where the library was built with Python's headers: ``FAST(FAST_INDEX[op],
# *op arguments)`` serves a cached call of one of the ops ``FAST_INDEX`` names from Python
# without the dispatcher (outputs, True for in-place ops, None when not served).
FAST = None
FAST_INDEX: dict = {}


def _load_fast(path) -> None:
    global FAST
    import ctypes

    try:
        entry = ctypes.PyDLL(str(path)).cupy_rope_torch_fast
    except (OSError, AttributeError):
        return
    entry.restype, entry.argtypes = ctypes.py_object, []
    fn, names = entry()
    FAST_INDEX.update({name.split("::", 1)[1]: i for i, name in enumerate(names)})
    FAST = fn


def load() -> bool:
    """Load the C++ path according to ``CUPY_ROPE_TORCH_EXT``; True when it serves the ops."""
    if _cxx.optional("CUPY_ROPE_TORCH_EXT", build, "cupy_rope.torch: the C++ launch path", "using the Python "
                     "launch path", skip="" if torch.cuda.is_available() else "torch sees no CUDA device") is None:
        return False
    from . import _api

    _LOADED.append(True)
    _launch.MIRROR = mirror
    _launch.DEBUG_LISTENERS.append(lambda debug: torch.ops.cupy_rope._ext_set_enabled(not debug))
    _launch.NATIVE_HITS.append(lambda: info()["hits"])
    torch.ops.cupy_rope._ext_set_enabled(not _api.debug_enabled())
    return True


def loaded() -> bool:
    return bool(_LOADED)


def resolving(fn):
    """``fn`` run as the C++ path's miss handler: its launch is handed to the C++ cache."""
    def run(*args):
        _state.on = True
        try:
            return fn(*args)
        finally:
            _state.on = False
    run.__name__ = fn.__name__
    return run


def resolving_now() -> bool:
    """Whether this thread is resolving a miss of the C++ path (:func:`resolving`)."""
    return getattr(_state, "on", False)


def mirror(prepared, outputs) -> None:
    """Hand a prepared launch (:class:`cupy_rope._launch.Prepared`, its outputs as kept by the
    launch cache) to the C++ cache, when this thread resolves a miss of the C++ path."""
    if not resolving_now():
        return
    import ctypes

    base = ctypes.addressof(prepared.buf)
    outs = []
    for like, shape, transposed, _same, align in outputs:
        outs += [like, int(transposed), align, len(shape), *shape]
    torch.ops.cupy_rope._ext_put(prepared.fptr, prepared.grid[0], prepared.grid[1], prepared.block, prepared.pdl,
                                 list(prepared.buf), [(a - base) // 8 for a in prepared.argv],
                                 [len(s) for s in prepared.slots], [w for s in prepared.slots for w in s], outs)


def info() -> dict:
    """The C++ launch cache's counters (``hits``, ``misses``, ``size``); empty when not loaded."""
    if not _LOADED:
        return {}
    hits, misses, size = torch.ops.cupy_rope._ext_info()
    return dict(hits=hits, misses=misses, size=size)

"""Run the CUDA kernels on the CPU: a g++ build of the same ``kernels_cu`` source.

For machines without a GPU (CI): ``kernels_cu/host_shim.h`` turns each kernel entry point
into a host function that loops over the grid, so the kernels' index math, vector paths and
arithmetic run unchanged and can be compared with the NumPy reference. The launch plan and
its packed parameter struct are the ones the GPU path uses. Not used by the library itself.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from . import _kernels
from ._interop import info


def cuda_include_dirs() -> list[str]:
    """Directories with cuda_fp16.h, cuda_bf16.h and crt/host_defines.h."""
    cands = []
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            cands.append(Path(os.environ[env]) / "include")
    cands.append(Path("/usr/local/cuda/include"))
    try:
        import cuda.pathfinder as pf

        d = pf.find_nvidia_header_directory("cudart")
        if d:
            cands.append(Path(d))
    except Exception:  # pragma: no cover - optional
        pass
    for c in cands:
        if (c / "cuda_bf16.h").is_file() and (c / "crt" / "host_defines.h").is_file():
            return [str(c)]
    raise RuntimeError("cupy_rope host build: no CUDA headers (cuda_bf16.h, crt/host_defines.h) found; "
                       "set CUDA_PATH to a CUDA toolkit")


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """Build (once per source version) and load the host library with every kernel."""
    names = _kernels.all_kernels()
    src = ('#include "host_shim.h"\n' + _kernels.source_for(names))
    cache = Path(os.environ.get("CUPY_ROPE_HOST_CACHE", Path(tempfile.gettempdir()) / "cupy_rope_host"))
    cache.mkdir(parents=True, exist_ok=True)
    so = cache / f"rope_host_{_kernels.source_hash()}.so"
    if not so.exists():
        cxx = os.environ.get("CXX") or shutil.which("g++") or "c++"
        with tempfile.TemporaryDirectory() as tmp:
            cpp = Path(tmp) / "rope_host.cpp"
            cpp.write_text(src)
            out = Path(tmp) / so.name
            cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-attributes", *_kernels.defines(),
                   f"-I{_kernels.source_dir()}", *[f"-I{d}" for d in cuda_include_dirs()],
                   str(cpp), "-o", str(out)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"host build failed:\n{' '.join(cmd)}\n{r.stderr[-4000:]}")
            shutil.move(str(out), so)
    lib = ctypes.CDLL(str(so))
    for n in names:
        getattr(lib, n).argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_char_p]
    return lib


def launch(name: str, grid: int, block: int, params: bytes) -> None:
    getattr(library(), name)(grid, block, params)


def _np_info(a):
    return None if a is None else info(a, "numpy")


def run_rope(plan, x: np.ndarray, freqs: np.ndarray, cu=None, sp=None, out=None) -> np.ndarray:
    """Run the rope kernel for ``plan`` on NumPy arrays; returns ``out`` (new if None)."""
    y = np.empty(plan.shape, x.dtype) if out is None else out
    name, grid, block, params = plan.launch(_np_info(x), _np_info(y), _np_info(freqs),
                                            _np_info(cu), _np_info(sp), sm_count=4)
    if x.size:
        launch(name, grid, block, params)
    return y


def run_qkv(plan, arrays, q_freqs, k_freqs, cu=None, sp=None):
    """Forward: arrays = (qkv,) -> (q, k, v). Backward: arrays = (dq, dk, dv) -> dqkv."""
    if plan.backward:
        dq, dk, dv = arrays
        packed = np.empty(plan.packed_shape, dq.dtype)
        q, k, v = dq, dk, dv
    else:
        (packed,) = arrays
        q = np.empty(plan.q_shape, packed.dtype)
        k = np.empty(plan.kv_shape, packed.dtype)
        v = np.empty(plan.kv_shape, packed.dtype)
    name, grid, block, params = plan.launch(_np_info(packed), _np_info(q), _np_info(k), _np_info(v),
                                            _np_info(q_freqs), _np_info(k_freqs), _np_info(cu),
                                            _np_info(sp), sm_count=4)
    if packed.size:
        launch(name, grid, block, params)
    return packed if plan.backward else (q, k, v)

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
from pathlib import Path

import numpy as np

from .. import _cxx, _kernels
from .._interop import info


HEADERS = ("cuda_fp16.h", "cuda_bf16.h", "crt/host_defines.h", "nv/target")


def cuda_include_dirs() -> list[str]:
    """Directories with the CUDA headers the host build needs (cuda_fp16.h, cuda_bf16.h,
    crt/host_defines.h, nv/target): a toolkit (``CUDA_PATH``, ``CUDA_HOME``, /usr/local/cuda) or
    the wheels of the ``cuda13-ctk`` extra (nvidia-cuda-runtime, -crt, -cccl)."""
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
        dirs = [c] + [c / "cccl"] * (c / "cccl" / "nv" / "target").is_file()
        if all(any((d / h).is_file() for d in dirs) for h in HEADERS):
            return [str(d) for d in dirs]
    raise RuntimeError("cupy_rope host build: no CUDA headers (" + ", ".join(HEADERS) + ") found in "
                       + ", ".join(map(str, cands)) + "; install the `cuda13-ctk` extra "
                       "(cuda-toolkit[nvrtc,cudart,crt,cccl]) or set CUDA_PATH to a CUDA toolkit")


def _header_files(include_dirs, extra=()) -> list:
    """The CUDA headers a build includes from ``include_dirs`` (and ``extra`` files): their
    contents are part of the build key, so that another toolkit or an edited shim rebuilds."""
    return [Path(d) / n for d in include_dirs for n in HEADERS[:3] + ("cuda_fp16.hpp", "cuda_bf16.hpp")] + list(extra)


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """Build (once per version of every input) and load the host library with every kernel."""
    names = _kernels.all_kernels()
    src = ('#include "host_shim.h"\n' + _kernels.source_for(names))
    inc = cuda_include_dirs()
    flags = ["-std=c++17", "-O1", "-shared", "-fPIC", "-Wno-attributes", *_kernels.defines(),
             f"-I{_kernels.source_dir()}", *[f"-I{d}" for d in inc]]
    try:
        so = _cxx.shared_library("rope_host", src, [flags],
                                 files=_header_files(inc, [_kernels.source_dir() / "host_shim.h"]))
    except RuntimeError as e:
        raise RuntimeError(f"host build failed: {e}") from None
    lib = ctypes.CDLL(str(so))
    for n in names:
        getattr(lib, n).argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_char_p]
    return lib


def nvrtc_cubin(arch: str = "sm_90") -> bytes:
    """Every instantiation compiled by NVRTC (no GPU needed), cached like the host library.
    Raises ``RuntimeError`` with NVRTC's log when the source does not compile."""
    import cuda.pathfinder as pf
    from cupy.cuda import nvrtc

    names = _kernels.all_kernels()
    src = _kernels.source_for(names)
    inc = pf.find_nvidia_header_directory("cudart")
    opts = [f"-arch={arch}", "--std=c++17", f"-I{inc}", "-default-device", *_kernels.defines()]
    version = ".".join(map(str, nvrtc.getVersion()))
    path = _cxx.cache_dir() / f"rope_nvrtc_{_cxx.build_key((src, version, *opts), _header_files([inc]))}.cubin"
    if path.exists():
        return path.read_bytes()
    prog = nvrtc.createProgram(src, "cupy_rope.cu", [], [])
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception:
        raise RuntimeError(nvrtc.getProgramLog(prog)) from None
    cubin = nvrtc.getCUBIN(prog)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    tmp.replace(path)
    return cubin


def launch(name: str, grid: tuple, block: int, params: bytes) -> None:
    """Run kernel ``name`` over ``grid`` = (x, y) blocks of ``block`` threads on the CPU."""
    getattr(library(), name)(grid[0], grid[1], block, params)


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


def run_rope_qk(plans, q: np.ndarray, k: np.ndarray, freqs: np.ndarray, cu=None, sp=None, outs=None):
    """Run one rope launch for q and k (two grid rows) on NumPy arrays; returns ``outs``."""
    from .._worksplit import rope_launch

    outs = outs or tuple(np.empty(p.shape, a.dtype) for p, a in zip(plans, (q, k)))
    spec = rope_launch(plans, [(_np_info(q), _np_info(outs[0])), (_np_info(k), _np_info(outs[1]))],
                       _np_info(freqs), _np_info(cu), _np_info(sp), sm_count=4)
    if q.size or k.size:
        launch(*spec)
    return tuple(outs)


def run_rope_pos(plans, xs, table: np.ndarray, positions: np.ndarray, outs=None):
    """The positions API's launch (q, or q and k, each ``[tokens.., h, d]``) on NumPy arrays."""
    from .._worksplit import rope_launch

    outs = outs or tuple(np.empty(x.shape, x.dtype) for x in xs)
    spec = rope_launch(plans, [(_np_info(x), _np_info(y)) for x, y in zip(xs, outs)], _np_info(table),
                       None, None, sm_count=4, ids=_np_info(positions))
    if any(x.size for x in xs):
        launch(*spec)
    return tuple(outs)


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

"""Run the CUDA kernels on the CPU: a g++ build of the same ``kernels_cu`` source.

For machines without a GPU (CI): ``kernels_cu/host_shim.h`` turns each kernel entry point
into a host function that loops over the grid, so the kernels' index math, vector paths and
arithmetic run unchanged and can be compared with the NumPy reference. The launch plan and
its packed parameter struct are the ones the GPU path uses. The ``run_*`` helpers run the kernels
on copies of their arrays placed before an inaccessible page (``fenced``), so that a read or
write past an array's end stops the process. Not used by the library itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
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
        getattr(lib, n).argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_char_p]  # grid, block, params
    lib.cupy_rope_count.argtypes, lib.cupy_rope_count.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_longlong
    return lib


# The host build's counters (host_shim.h: cupy_rope_counts), by index.
_COUNTERS = {"unshared": 0, "fresh": 1, "misaligned": 2, "cache_vector": 3, "position_first": 4}


def _count(which: str, reset: bool = True) -> int:
    return library().cupy_rope_count(_COUNTERS[which], int(reset))


def unshared_count(reset: bool = True) -> int:
    """Threads of one-row launches since the last reset that shared their token's sincosf but
    could not use it (a pair of two angles in their unit: they computed their own)."""
    return _count("unshared", reset)


def fresh_count(reset: bool = True) -> int:
    """Rows since the last reset rotated with cos/sin computed for the row alone (``rotate_fresh``:
    a unit with a pair of two angles) rather than with the cos/sin its thread holds for the unit."""
    return _count("fresh", reset)


def cache_vector_count(reset: bool = True) -> int:
    """Units since the last reset whose cos/sin came from a cache in whole 16-byte loads (rows
    with contiguous, aligned columns) rather than one load per value."""
    return _count("cache_vector", reset)


def position_first_count(reset: bool = True) -> int:
    """Threads of one-row launches since the last reset that loaded their token's position before
    their rows' vectors (the one-row kernels with a cos/sin cache, ``rope1c``)."""
    return _count("position_first", reset)


def _nvrtc_options(arch: str, defines=()) -> list:
    import cuda.pathfinder as pf

    inc = pf.find_nvidia_header_directory("cudart")
    return [f"-arch={arch}", "--std=c++17", f"-I{inc}", "-default-device", *_kernels.defines(), *defines]


def nvrtc_compile(names, arch: str = "sm_90", defines=(), ptx: bool = False) -> bytes:
    """Kernels ``names`` compiled by NVRTC (no GPU needed) with extra ``defines``: the cubin, or
    with ``ptx`` the PTX text. Raises ``RuntimeError`` with NVRTC's log when they do not compile."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(_kernels.source_for(names), "cupy_rope.cu", [], [])
    try:
        nvrtc.compileProgram(prog, _nvrtc_options(arch, defines))
    except Exception:
        raise RuntimeError(nvrtc.getProgramLog(prog)) from None
    out = nvrtc.getPTX(prog) if ptx else nvrtc.getCUBIN(prog)
    return out if isinstance(out, bytes) else out.encode()


def nvrtc_cubin(arch: str = "sm_90") -> bytes:
    """Every instantiation compiled by NVRTC (:func:`nvrtc_compile`), cached like the host library."""
    import cuda.pathfinder as pf
    from cupy.cuda import nvrtc

    names = _kernels.all_kernels()
    opts = _nvrtc_options(arch)
    version = ".".join(map(str, nvrtc.getVersion()))
    key = _cxx.build_key((_kernels.source_for(names), version, *opts),
                         _header_files([pf.find_nvidia_header_directory("cudart")]))
    path = _cxx.cache_dir() / f"rope_nvrtc_{key}.cubin"
    if path.exists():
        return path.read_bytes()
    cubin = nvrtc_compile(names, arch)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    tmp.replace(path)
    return cubin


def launch(name: str, grid: tuple, block: int, params: bytes) -> None:
    """Run kernel ``name`` over ``grid`` = (x, 1) blocks of ``block`` threads on the CPU (the
    launch layer's grids have one row). Raises ``RuntimeError`` where a vector load or store met an
    address that is not a multiple of its size (on the GPU a misaligned address error; the CPU
    would carry on), ``ValueError`` for a grid of more rows."""
    if grid[1] != 1:
        raise ValueError(f"host build: {name}: grid {grid}, expected one row")
    _count("misaligned")
    getattr(library(), name)(grid[0], block, params)
    misaligned = _count("misaligned")
    if misaligned:
        raise RuntimeError(f"host build: {name} made {misaligned} vector accesses at misaligned addresses")


# ----------------------------------------------------------------------------- guarded memory
_PAGE = mmap.PAGESIZE
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE  # mprotect's flags (POSIX)


def _mprotect():
    try:
        f = ctypes.CDLL(None, use_errno=True).mprotect
    except (OSError, AttributeError):  # pragma: no cover - no mprotect (not a POSIX system)
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return f


_MPROTECT = _mprotect()


@contextlib.contextmanager
def fenced(arrays, writes=()):
    """The kernels' arrays moved next to an inaccessible page, so that a read or write past the
    end of an array's memory faults (the process stops) instead of passing unseen.

    ``arrays``: NumPy arrays or None. Arrays whose memory overlaps (a view and its base, q and k
    views of one projection, an in-place output) share one copy of their joint extent, placed so
    that it ends at most 15 bytes before the page (every address keeps its alignment modulo 16,
    which the launch plan's vector width depends on). Yields the arrays' copies, same order; on
    exit the extents holding an array whose index is in ``writes`` are copied back."""
    if _MPROTECT is None:  # pragma: no cover
        yield list(arrays)
        return
    spans = []
    for i, a in enumerate(arrays):
        if isinstance(a, np.ndarray) and a.size:
            lo, hi = np.lib.array_utils.byte_bounds(a)
            spans.append([lo, hi, [i]])
    spans.sort()
    regions = []
    for lo, hi, idx in spans:
        if regions and lo < regions[-1][1]:
            regions[-1][1] = max(regions[-1][1], hi)
            regions[-1][2] += idx
        else:
            regions.append([lo, hi, idx])
    out, maps = list(arrays), []
    try:
        for lo, hi, idx in regions:
            gap = -hi % 16
            data = -(-(hi - lo + gap) // _PAGE) * _PAGE
            mm = mmap.mmap(-1, data + _PAGE)
            buf = np.frombuffer(mm, np.uint8)
            base = buf.ctypes.data
            start = data - gap - (hi - lo)
            if _MPROTECT(base + data, _PAGE, _PROT_NONE) != 0:  # pragma: no cover
                raise OSError(ctypes.get_errno(), "mprotect")
            ctypes.memmove(base + start, lo, hi - lo)
            maps.append((mm, buf, base, lo, hi, start, idx))
            for i in idx:
                a = arrays[i]
                out[i] = np.ndarray(a.shape, a.dtype, buf, start + a.ctypes.data - lo, a.strides)
        yield out
        for _, _, base, lo, hi, start, idx in maps:
            if any(i in writes for i in idx):
                ctypes.memmove(lo, base + start, hi - lo)
    finally:
        for mm, buf, base, *_ in maps:
            _MPROTECT(base + len(buf) - _PAGE, _PAGE, _PROT_RW)


def _np_info(a):
    return None if a is None else info(a, "numpy")


def run_rope(plan, x: np.ndarray, freqs: np.ndarray, cu=None, sp=None, out=None, sm_count=4) -> np.ndarray:
    """Run the rope kernel for ``plan`` (work split for ``sm_count`` SMs) on NumPy arrays; returns
    ``out`` (new if None)."""
    y = np.empty(plan.shape, x.dtype) if out is None else out
    with fenced((x, y, freqs, cu, sp), writes=(1,)) as arrays:
        name, grid, block, params = plan.launch(*map(_np_info, arrays), sm_count=sm_count)
        if x.size:
            launch(name, grid, block, params)
    return y


def run_rope_qk(plans, q: np.ndarray, k: np.ndarray, freqs: np.ndarray, cu=None, sp=None, outs=None):
    """Run one rope launch for q and k (both in one grid) on NumPy arrays; returns ``outs``."""
    from .._worksplit import rope_launch

    outs = outs or tuple(np.empty(p.shape, a.dtype) for p, a in zip(plans, (q, k)))
    with fenced((q, outs[0], k, outs[1], freqs, cu, sp), writes=(1, 3)) as a:
        i = list(map(_np_info, a))
        spec = rope_launch(plans, [(i[0], i[1]), (i[2], i[3])], *i[4:], sm_count=4)
        if q.size or k.size:
            launch(*spec)
    return tuple(outs)


def run_rope_pos(plans, xs, table: np.ndarray, positions: np.ndarray, outs=None):
    """The positions API's launch (q, or q and k, each ``[tokens.., h, d]``) on NumPy arrays."""
    from .._worksplit import rope_launch

    outs = outs or tuple(np.empty(x.shape, x.dtype) for x in xs)
    n = len(xs)
    with fenced((*xs, *outs, table, positions), writes=range(n, 2 * n)) as a:
        i = list(map(_np_info, a))
        spec = rope_launch(plans, list(zip(i[:n], i[n:2 * n])), i[2 * n], None, None, sm_count=4, ids=i[2 * n + 1])
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
    with fenced((packed, q, k, v, q_freqs, k_freqs, cu, sp), writes=(0,) if plan.backward else (1, 2, 3)) as a:
        name, grid, block, params = plan.launch(*map(_np_info, a), sm_count=4)
        if packed.size:
            launch(name, grid, block, params)
    return packed if plan.backward else (q, k, v)

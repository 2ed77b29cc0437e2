"""Compile and launch: NVRTC through CuPy ``RawModule``, launches through ``cuLaunchKernel``.

Each kernel instantiation is compiled on first use (one small module per kernel, so the first
call compiles one kernel, not all of them) and cached per device by CuPy (memory and disk).
A launch passes the plan's packed parameter struct by address: no per-argument conversion,
no stream object, so the host cost stays a few microseconds.
"""

from __future__ import annotations

import ctypes
import threading

from . import _kernels

_lock = threading.Lock()
_functions: dict = {}  # (device, name) -> (module, function pointer, context)
_sm_count: dict = {}


def _options() -> tuple:
    return ("--std=c++17", f"-DCUPY_ROPE_SRC={_kernels.source_hash()}") + _kernels.defines()


def function(name: str, device: int):
    """(CUfunction pointer, context handle) of kernel ``name`` on ``device``, compiled on demand."""
    key = (device, name)
    hit = _functions.get(key)
    if hit is not None:
        return hit[1], hit[2]
    import cupy
    from cupy.cuda import driver

    with _lock, cupy.cuda.Device(device):
        hit = _functions.get(key)
        if hit is None:
            module = cupy.RawModule(code=_kernels.source_for([name]), options=_options())
            kernel = module.get_function(name)  # a RawKernel; .kernel is the loaded CUfunction
            hit = (module, getattr(kernel, "kernel", kernel).ptr, driver.ctxGetCurrent())
            _functions[key] = hit
    return hit[1], hit[2]


def sm_count(device: int) -> int:
    n = _sm_count.get(device)
    if n is None:
        import cupy

        n = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
        _sm_count[device] = n
    return n


def launch(name: str, grid: int, block: int, params: bytes, stream: int, device: int) -> None:
    """Launch ``name`` with one by-value parameter struct on ``stream`` (a raw handle)."""
    if grid <= 0:
        return
    if grid >= 2**31:
        raise ValueError(f"cupy_rope: problem too large for one launch ({grid} blocks)")
    from cupy.cuda import driver

    fptr, ctx = function(name, device)
    buf = ctypes.create_string_buffer(params, len(params))
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    if driver.ctxGetCurrent() == ctx:
        driver.launchKernel(fptr, grid, 1, 1, block, 1, 1, 0, stream, ctypes.addressof(argv), 0)
    else:
        import cupy

        with cupy.cuda.Device(device):
            driver.launchKernel(fptr, grid, 1, 1, block, 1, 1, 0, stream, ctypes.addressof(argv), 0)

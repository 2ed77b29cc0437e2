"""Compile and launch: NVRTC through CuPy ``RawModule``, launches through ``cuLaunchKernel``.

Each kernel instantiation is compiled on first use (one small module per kernel, so the first
call compiles one kernel, not all of them) and cached per device by CuPy (memory and disk).
A launch passes its packed parameter blocks by address (no per-argument conversion, no stream
object). :class:`Prepared` keeps a launch ready: the blocks live in a ctypes buffer and a
repeated call only writes its addresses into their slots and calls ``cuLaunchKernel``, through
CuPy's Cython binding of the driver (``cupy.cuda.driver.launchKernel``; the per-call benchmark
measures it against ``RawKernel.__call__``).
"""

from __future__ import annotations

import ctypes
import threading

from . import _kernels

_lock = threading.Lock()
_functions: dict = {}  # (device, name) -> (module, function pointer, context)
_sm_count: dict = {}
_driver = None


def _drv():
    global _driver
    if _driver is None:
        from cupy.cuda import driver

        _driver = driver
    return _driver


def _options() -> tuple:
    return ("--std=c++17", f"-DCUPY_ROPE_SRC={_kernels.source_hash()}") + _kernels.defines()


def function(name: str, device: int):
    """(CUfunction pointer, context handle) of kernel ``name`` on ``device``, compiled on demand."""
    key = (device, name)
    hit = _functions.get(key)
    if hit is not None:
        return hit[1], hit[2]
    import cupy

    with _lock, cupy.cuda.Device(device):
        hit = _functions.get(key)
        if hit is None:
            module = cupy.RawModule(code=_kernels.source_for([name]), options=_options())
            kernel = module.get_function(name)  # a RawKernel; .kernel is the loaded CUfunction
            hit = (module, getattr(kernel, "kernel", kernel).ptr, _drv().ctxGetCurrent())
            _functions[key] = hit
    return hit[1], hit[2]


def sm_count(device: int) -> int:
    n = _sm_count.get(device)
    if n is None:
        import cupy

        n = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
        _sm_count[device] = n
    return n


class Prepared:
    """A launch kept ready: ``prepared(stream, addresses)`` writes ``addresses`` (in the order of
    ``names``) into their parameter-block slots and launches on ``stream`` (a raw handle)."""

    __slots__ = ("fptr", "ctx", "grid", "block", "buf", "argv", "slots", "device", "lock")

    def __init__(self, spec, device: int, names):
        gx, gy = spec.grid
        if gx >= 2**31:
            raise ValueError(f"cupy_rope: problem too large for one launch ({gx} blocks)")
        _drv()
        self.fptr, self.ctx = function(spec.name, device)
        self.grid, self.block, self.device = (gx, gy), spec.block, device
        nwords = len(spec.params) // 8
        self.buf = (ctypes.c_int64 * nwords).from_buffer_copy(spec.params)
        nblocks = _kernels.param_blocks(spec.name)
        base, step = ctypes.addressof(self.buf), len(spec.params) // nblocks
        self.argv = (ctypes.c_void_p * nblocks)(*(base + i * step for i in range(nblocks)))
        self.slots = tuple(spec.slots.get(n, ()) for n in names)
        self.lock = threading.Lock()

    def __call__(self, stream: int, addresses) -> None:
        drv = _driver
        buf = self.buf
        gx, gy = self.grid
        if gx == 0:
            return
        with self.lock:  # the buffer is shared: patch and launch as one step (the driver copies it)
            for slots, p in zip(self.slots, addresses):
                for s in slots:
                    buf[s] = p
            if drv.ctxGetCurrent() == self.ctx:
                drv.launchKernel(self.fptr, gx, gy, 1, self.block, 1, 1, 0, stream,
                                 ctypes.addressof(self.argv), 0)
                return
        import cupy

        with cupy.cuda.Device(self.device), self.lock:
            drv.launchKernel(self.fptr, gx, gy, 1, self.block, 1, 1, 0, stream, ctypes.addressof(self.argv), 0)


def launch(spec, stream: int, device: int, names=()) -> Prepared | None:
    """Launch ``spec`` (a :class:`cupy_rope._abi.LaunchSpec`) on ``stream``; returns the
    :class:`Prepared` launch (addresses ``names``) for the launch cache, None for an empty grid."""
    if spec.grid[0] <= 0:
        return None
    prepared = Prepared(spec, device, names)
    prepared(stream, ())
    return prepared

"""Compile and launch: NVRTC through CuPy ``RawModule``, launches through ``cuLaunchKernelEx`` or
``cuLaunchKernel``, and the launch cache of the public API.

Each kernel instantiation is compiled on first use (one small module per kernel, so the first
call compiles one kernel, not all of them) and cached per device by CuPy (memory and disk).
A launch passes its packed parameter blocks by address (no per-argument conversion, no stream
object). :class:`Prepared` keeps a launch ready: the blocks live in a ctypes buffer and a
repeated call only writes its addresses into their slots and launches.

On devices of compute capability 9.0 and later the launch is a programmatic dependent launch
(``cuLaunchKernelEx`` with the programmatic stream serialization attribute, called through
ctypes): the kernel may be scheduled while the previous kernel on the stream finishes, and waits
for it (``griddepcontrol.wait``, which every cupy_rope kernel runs after its index arithmetic and
before its first global memory access); then it lets the next such launch start. A small
launch's latency then overlaps the previous kernel, in CUDA graphs too. ``CUPY_ROPE_PDL=0``
launches without the attribute (``cuLaunchKernel`` through CuPy's binding,
``cupy.cuda.driver.launchKernel``).
"""

from __future__ import annotations

import ctypes
import os
import threading

from . import _interop, _kernels
from ._plan import byte_extent

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


# CUlaunchConfig and CUlaunchAttribute (cuda.h, CUDA 12+; laid out by ctypes as by a C compiler).
class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_pdl: dict = {}  # device -> the driver's cuLaunchKernelEx (ctypes), or None: no programmatic launches


def _launch_ex():
    """libcuda's ``cuLaunchKernelEx`` through ctypes, or None where the driver has none."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int
    return fn


def pdl_launcher(device: int):
    """``cuLaunchKernelEx`` when launches on ``device`` are programmatic dependent launches
    (compute capability >= 9.0, a CUDA 12.3+ driver: programmatic launches in stream capture,
    ``CUPY_ROPE_PDL`` not ``0``); else None."""
    if device not in _pdl:
        fn = None
        switch = os.environ.get("CUPY_ROPE_PDL", "1").strip() or "1"
        if switch not in ("0", "1"):
            raise ValueError(f"cupy_rope: environment variable CUPY_ROPE_PDL: expected 0 or 1, got {switch!r}")
        if switch == "1":
            import cupy

            if (int(cupy.cuda.Device(device).compute_capability) >= 90
                    and cupy.cuda.runtime.driverGetVersion() >= 12030):
                fn = _launch_ex()
        _pdl[device] = fn
    return _pdl[device]


def sm_count(device: int) -> int:
    n = _sm_count.get(device)
    if n is None:
        import cupy

        n = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
        _sm_count[device] = n
    return n


def raise_driver_error(rc: int):
    """Raise CuPy's error for CUresult ``rc`` (a failed launch)."""
    from cupy.cuda import driver  # an attribute of cupy.cuda, not a module of its own

    raise driver.CUDADriverError(rc)


def check_grid(spec) -> tuple:
    """``spec``'s grid, which one launch must be able to run."""
    gx, gy = spec.grid
    if gx >= 2**31:
        raise ValueError(f"cupy_rope: problem too large for one launch ({gx} blocks)")
    return gx, gy


class Prepared:
    """A launch kept ready: ``prepared(stream, addresses)`` writes ``addresses`` (in the order of
    ``names``) into their parameter-block slots and launches on ``stream`` (a raw handle)."""

    __slots__ = ("fptr", "ctx", "grid", "block", "buf", "argv", "argv_addr", "slots", "device", "lock", "launch_ex",
                 "config", "config_addr", "attribute")

    def __init__(self, spec, device: int, names):
        gx, gy = check_grid(spec)
        _drv()
        self.fptr, self.ctx = function(spec.name, device)
        self.grid, self.block, self.device = (gx, gy), spec.block, device
        nwords = len(spec.params) // 8
        self.buf = (ctypes.c_int64 * nwords).from_buffer_copy(spec.params)
        nblocks = _kernels.param_blocks(spec.name)
        base, step = ctypes.addressof(self.buf), len(spec.params) // nblocks
        self.argv = (ctypes.c_void_p * nblocks)(*(base + i * step for i in range(nblocks)))
        self.argv_addr = ctypes.addressof(self.argv)
        self.slots = tuple(spec.slots.get(n, ()) for n in names)
        self.lock = threading.Lock()
        self.launch_ex = pdl_launcher(device)
        self.config = self.attribute = self.config_addr = None
        if self.launch_ex is not None:
            self.attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
            self.config = _LaunchConfig((gx, gy, 1), (spec.block, 1, 1), 0, None, ctypes.pointer(self.attribute), 1)
            self.config_addr = ctypes.addressof(self.config)

    @property
    def pdl(self) -> bool:
        """Whether this launch is a programmatic dependent launch."""
        return self.launch_ex is not None

    def _go(self, stream: int) -> None:
        if self.launch_ex is None:
            gx, gy = self.grid
            _driver.launchKernel(self.fptr, gx, gy, 1, self.block, 1, 1, 0, stream, self.argv_addr, 0)
            return
        self.config.stream = stream
        rc = self.launch_ex(self.config_addr, self.fptr, self.argv_addr, None)
        if rc:
            raise_driver_error(rc)

    def __call__(self, stream: int, addresses) -> None:
        buf = self.buf
        if self.grid[0] == 0:
            return
        with self.lock:  # the buffer is shared: patch and launch as one step (the driver copies it)
            for slots, p in zip(self.slots, addresses):
                for s in slots:
                    buf[s] = p
            if _driver.ctxGetCurrent() == self.ctx:
                self._go(stream)
                return
            import cupy

            with cupy.cuda.Device(self.device):  # another device is current: launch in this one's context
                self._go(stream)


def launch(spec, stream: int, device: int, names=()) -> Prepared | None:
    """Launch ``spec`` (a :class:`cupy_rope._abi.LaunchSpec`) on ``stream``; returns the
    :class:`Prepared` launch (addresses ``names``) for the launch cache, None for an empty grid."""
    if spec.grid[0] <= 0:
        return None
    prepared = Prepared(spec, device, names)
    prepared(stream, ())
    return prepared


# ----------------------------------------------------------------------------- launch cache
# The public API's launch cache. A repeated call with the same shapes, strides, dtypes, devices,
# options and address alignment reuses the launch its first call resolved (and validated): per
# call only the key is built, the outputs allocated (by the caller's framework) and the addresses
# written into the prepared parameter blocks (Prepared). Index contents are checked only in debug
# mode, which bypasses the cache. Keys of CuPy calls are built, and their hits served, by the C++
# CuPy path where it loads (cupy_rope._cupy_ext: bytes keys; the entry then also holds the
# prepared launch's C++ side); every other call by the Python code below (tuple keys).
_CACHE: dict = {}
_CACHE_MAX = 4096
_STATS = {"hits": 0, "misses": 0}
# Set by a framework shim with a launch cache of its own (the torch shim's C++ path):
# ``MIRROR(prepared, outputs)`` is told every new launch and every hit of a call on torch tensors
# (the only arrays that cache serves; it keeps what a miss of its own resolves); each of
# DEBUG_LISTENERS is told when debug mode changes (cached launches skip its checks).
MIRROR = None
DEBUG_LISTENERS: list = []
NATIVE_HITS: list = []  # functions returning a shim cache's hit count, for cache_info
# Set by a framework shim whose own launch path serves the public API's calls on its arrays (the
# torch shim's C++ path): ``NATIVE(op, lead, *op arguments)`` runs the call and returns its
# result, or None to leave it to the public API's own path.
NATIVE = None


def cache_info() -> dict:
    """Launch-cache counters: ``hits`` (calls that only patched addresses into a prepared launch,
    here or in a shim's own cache: ``native_hits``), ``misses`` (calls that were validated and
    planned in full), ``size`` (prepared launches kept here)."""
    native = sum(fn() for fn in NATIVE_HITS)
    return dict(hits=_STATS["hits"] + native, misses=_STATS["misses"], size=len(_CACHE), native_hits=native)


_KINDS: dict = {}  # array type -> "torch" / "cupy" / None (the exact types the cache serves)


def _kind_of_type(t):
    k = _KINDS.get(t, 0)
    if k == 0:
        mod, name = t.__module__, t.__name__
        k = ("torch" if mod == "torch" and name == "Tensor" else
             "cupy" if mod.startswith("cupy") and name == "ndarray" else None)
        _KINDS[t] = k
    return k


def cache_kind(a):
    """'torch' (a plain CUDA tensor), 'cupy' or None: the array kinds the launch cache serves."""
    k = _kind_of_type(type(a))
    if k == "torch" and not a.is_cuda:
        return None
    return k


def _descs_torch(arrays, descs, ptrs) -> bool:
    for a in arrays:
        if a is None:
            descs.append(None)
            ptrs.append(0)
            continue
        if _KINDS.get(type(a)) != "torch" or not a.is_cuda:
            return False
        p = a.data_ptr()
        descs.append((a.shape, a.stride(), a.dtype, a.get_device(), p & 15))
        ptrs.append(p)
    return True


def _descs_cupy(arrays, descs, ptrs) -> bool:
    for a in arrays:
        if a is None:
            descs.append(None)
            ptrs.append(0)
            continue
        if _KINDS.get(type(a)) != "cupy":
            return False
        m = a.data  # its memory pointer: address and device without a Device object
        p = m.ptr
        descs.append((a.shape, a.strides, a.dtype, m.device_id, p & 15))
        ptrs.append(p)
    return True


_DESCS = {"torch": _descs_torch, "cupy": _descs_cupy}


def _extent(kind, a):
    """Byte range [lo, hi) that ``a``'s elements span; None when it has none."""
    if 0 in a.shape:
        return None
    if kind == "torch":
        isz = a.element_size()
        return byte_extent(a.data_ptr(), a.shape, [s * isz for s in a.stride()], isz)
    return byte_extent(a.data.ptr, a.shape, a.strides, a.itemsize)


def _overlaps(r0, r1) -> bool:
    return r0 is not None and r1 is not None and r0[0] < r1[1] and r1[0] < r0[1]


def overlap_signature(kind, arrays, written: int) -> tuple:
    """What an in-place call's validation depends on beyond the descriptors: whether a written
    array (the first ``written`` of ``arrays``) spans bytes of a read-only one (the call is
    rejected then), and, when the spans of the first two written arrays meet, their relative
    address (whether they share an element depends on it; disjoint spans never do)."""
    ext = [None if a is None else _extent(kind, a) for a in arrays]
    ro = any(_overlaps(w, r) for w in ext[:written] for r in ext[written:])
    rel = None
    if written == 2 and _overlaps(ext[0], ext[1]):
        rel = ext[1][0] - ext[0][0]
    return ro, rel


def _types(opts: tuple) -> tuple:
    """The types of ``opts``, those inside tuples included (``(4.0, 1)`` is not ``(4, 1)``)."""
    return tuple(_types(o) if type(o) is tuple else type(o) for o in opts)


def cache_key(kind, head: tuple, opts: tuple, arrays, written: int = 0):
    """(key, addresses) of a call, or (None, None) when it cannot be cached (an array of another
    kind). Options are keyed with their types: only calls whose exact options a first call
    validated can hit; a key holding an unhashable option misses (:func:`cached_call`) and is not
    kept (:func:`cache_put`). ``written``: a call that writes its first
    ``written`` arrays in place also keys their :func:`overlap_signature`."""
    descs, ptrs = [], []
    if not _DESCS[kind](arrays, descs, ptrs):
        return None, None
    key = (head, opts, _types(opts), tuple(descs))
    if written:
        key += overlap_signature(kind, arrays, written)
    return key, ptrs


# The CuPy launch path in C++ (:mod:`cupy_rope._cupy_ext`): ``(fast, entry)`` once loaded, None
# when CuPy's hits take the Python path; False until the first CuPy call decides.
CUPY_EXT = False


def _load_cupy_ext():
    global CUPY_EXT
    if CUPY_EXT is False:
        from . import _cupy_ext

        CUPY_EXT = _cupy_ext.load()
    return CUPY_EXT


def lookup(kind, head: tuple, opts: tuple, arrays, written: int = 0):
    """A call's launch-cache lookup: ``(key, outputs)``. A hit allocates its outputs, patches
    the prepared launch with the arrays' addresses (then those of the first ``written`` arrays,
    which it writes in place, then the outputs') and launches it: ``(None, new outputs)``. Else
    ``(key, None)``: the caller's full path keeps its launch under ``key`` (:func:`cache_put`;
    None: the call is not cached). :func:`cache_key` says what a key holds; CuPy calls are keyed
    and served by the C++ path where it loads (bytes keys)."""
    if kind == "cupy":
        ext = CUPY_EXT if CUPY_EXT is not False else _load_cupy_ext()
        if ext is not None:
            key = ext[0](_CACHE, head, opts, arrays, written)
            if type(key) is list:
                _STATS["hits"] += 1
                return None, key
            if key is None or key not in _CACHE:
                _STATS["misses"] += key is not None
                return key, None
            # kept, but left to the Python path (another device is current, an output of another alignment)
            ptrs = cache_key(kind, (), (), arrays)[1]
            return key, cached_call(key, ptrs + ptrs[:written], arrays, kind)
    key, ptrs = cache_key(kind, head, opts, arrays, written)
    if key is None:
        return None, None
    return key, cached_call(key, ptrs + ptrs[:written], arrays, kind)


def cached_call(key, ptrs, arrays, kind):
    """Run the cached launch of ``key`` (if any): allocate its outputs, patch every address,
    launch on the caller's current stream. Returns the new outputs, or None on a miss."""
    try:
        entry = _CACHE.get(key)  # the key's one hash
    except TypeError:  # an unhashable option
        entry = None
    if entry is None:
        _STATS["misses"] += 1
        return None
    prepared, outputs = entry[:2]
    results = []
    for like, shape, transposed, same, align in outputs:
        y, p = _interop.empty_like(kind, arrays[like], shape, transposed, same)
        if p & 15 != align:  # alignment differs from the cached plan's: take the full path
            _STATS["misses"] += 1
            return None
        ptrs.append(p)
        results.append(y)
    prepared(_interop.current_stream(kind, prepared.device), ptrs)
    _STATS["hits"] += 1
    if MIRROR is not None and kind == "torch":  # the torch shim's C++ cache serves torch tensors only
        MIRROR(prepared, outputs)
    return results


def cache_put(key, prepared, outputs):
    """Remember a launch: ``outputs`` = [(index of the array to allocate like, shape, transposed,
    address % 16)] allocated per call. ``prepared`` takes its addresses in the order of the key's
    arrays, then those of the arrays it writes in place, then the outputs. The entry is
    ``(prepared, outputs, C++ entry)``; the last is the C++ CuPy path's, for its (bytes) keys."""
    if key is None or prepared is None:
        return
    try:
        hash(key)
    except TypeError:  # an unhashable option: not kept
        return
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    outs = [(i, tuple(shape), tr, not tr and _same_shape(key, i, shape), al) for i, shape, tr, al in outputs]
    _CACHE[key] = (prepared, outs, CUPY_EXT[1](prepared, outs) if type(key) is bytes else None)
    if MIRROR is not None:
        MIRROR(prepared, outs)


def _same_shape(key, i, shape) -> bool:
    """Whether output-like array ``i`` of a tuple key has the output's shape (torch allocates
    such outputs with ``empty_like``)."""
    d = key[-1][i] if type(key) is tuple else None
    return d is not None and tuple(d[0]) == tuple(shape)

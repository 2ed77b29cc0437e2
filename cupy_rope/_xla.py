"""The XLA launch: a cupy_rope kernel run by XLA on its own stream, into buffers XLA allocated.

Two ways; the first that is available serves every call:

* **FFI** (``csrc/xla_launch.cpp``): an XLA FFI custom call (target ``cupy_rope_launch``). The
  launch is planned when the call is traced, for 16-byte aligned buffers (XLA's; the handler
  rejects any other), and its parameter blocks, address slots and geometry become the call's
  attributes; at run time XLA calls the C++ handler, which writes the buffers' addresses into a
  copy of the blocks and launches the kernel (compiled and registered per device at trace time)
  on XLA's stream: no Python at all. Command-buffer compatible: XLA may record it into its CUDA
  graphs. Built once with the host C++ compiler against jaxlib's FFI headers (no CUDA headers)
  and cached (:mod:`cupy_rope._cxx`). ``CUPY_ROPE_XLA_FFI``: ``auto`` (default: where it builds;
  otherwise a warning and the callback), ``1`` (required: a failed build raises), ``0`` (never).
* **callback**: a ``jax.experimental.buffer_callback``. Where the installed JAX supports it, the
  callback is marked ``command_buffer_compatible``: when XLA records the program into a command
  buffer (a CUDA graph) the Python body runs at record time only, and replays launch the kernel
  with no Python at all. The body therefore does nothing but resolve addresses and enqueue the
  launch; the kernel is compiled at trace time (compiling or loading a module while XLA captures
  would not be allowed).
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import threading
from pathlib import Path

import numpy as np

from . import _cxx, _kernels, _launch

SOURCE = Path(__file__).parent / "csrc" / "xla_launch.cpp"
TARGET = "cupy_rope_launch"
FFI = True  # launch through the FFI handler where it is available (False: the callback)
COMMAND_BUFFERS = True  # mark callbacks command-buffer compatible where JAX supports it
_lock = threading.Lock()
_ffi: list = []  # [the loaded FFI library (ctypes) or None], once decided
_registered: set = set()  # (kernel, device) registered with the FFI library


def build_ffi() -> Path:
    """Compile (or find in the cache) the FFI handler library; returns its path."""
    import jax.ffi

    inc = Path(jax.ffi.include_dir())
    headers = (SOURCE.parent / "cuda_launch.h", *sorted((inc / "xla" / "ffi" / "api").glob("*.h")))
    return _cxx.shared_library("xla_launch", SOURCE.read_text(),
                               [["-std=c++17", "-O2", "-fPIC", "-shared", f"-isystem{inc}", f"-I{SOURCE.parent}"]],
                               files=headers, announce="cupy_rope.jax: building the XLA launch handler (once, "
                                                       "a few seconds; CUPY_ROPE_XLA_FFI=0 skips it)")


def _load_ffi():
    import jax.ffi

    lib = ctypes.CDLL(str(build_ffi()))
    lib.cupy_rope_xla_register.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p]
    lib.cupy_rope_xla_register.restype = None
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.cupy_rope_xla_launch), platform="CUDA")
    return lib


def ffi_library():
    """The FFI handler library (ctypes), its target registered with XLA; None where it is not
    used (``CUPY_ROPE_XLA_FFI``, or ``auto`` and the build failed: a warning)."""
    if not _ffi:
        with _lock:
            if not _ffi:
                _ffi.append(_cxx.optional("CUPY_ROPE_XLA_FFI", _load_ffi, "cupy_rope.jax: the XLA launch handler",
                                          "using buffer callbacks"))
    return _ffi[0]


def _cuda_ordinal(dev) -> int:
    hw = getattr(dev, "local_hardware_id", None)
    return dev.id if hw is None else hw


@functools.lru_cache(maxsize=None)
def _supports_command_buffers() -> bool:
    from jax.experimental.buffer_callback import buffer_callback

    return "command_buffer_compatible" in inspect.signature(buffer_callback).parameters


def _callback_kwargs() -> dict:
    return {"command_buffer_compatible": True} if COMMAND_BUFFERS and _supports_command_buffers() else {}


def precompile(spec_names) -> None:
    """Compile (or load from CuPy's cache) the kernels a traced call may launch, on every GPU
    JAX uses, before XLA runs it."""
    import jax

    for d in gpu_ordinals():
        _launch.sm_count(d)
        for name in spec_names:
            _launch.function(name, d)


def gpu_ordinals() -> tuple:
    """CUDA ordinals of the GPUs JAX uses in this process."""
    import jax

    return tuple(_cuda_ordinal(dev) for dev in jax.local_devices(backend="gpu"))


def _ptr(buf) -> int:
    return 0 if buf is None else buf.__cuda_array_interface__["data"][0]


def gpu_call(result_shapes, arrays: tuple, in_slots, out_slots, build, layouts=None):
    """Launch a kernel on XLA's stream, into the buffers XLA allocated: through the FFI handler
    (planned here, at trace time) or a buffer callback (planned at its first run).

    ``in_slots[i]`` / ``out_slots[j]``: the (address name, byte offset) pairs that input ``i``
    (``None`` entries of ``arrays`` give address 0) and output ``j`` provide. ``build(addr,
    device)`` returns the LaunchSpec for the addresses ``addr`` (a dict): for the FFI handler once,
    at 16-byte aligned planning addresses; for the callback once per address alignment and device,
    later calls only patch the addresses into the prepared launch.

    ``layouts``: None, or (memory orders of ``arrays``, of the results), each a major-to-minor
    dimension order or None (row-major). The FFI call declares them as its operands' and
    results' layouts and plans with ``build(addr, device, True)``, which must then give those
    arrays the orders' strides; the callback's buffers are row-major (``build(addr, device)``).
    """
    lib = ffi_library() if FFI else None
    if lib is not None:
        res = _ffi_call(lib, result_shapes, arrays, in_slots, out_slots, build, layouts)
        if res is not None:
            return res
    from jax.experimental.buffer_callback import buffer_callback

    present = tuple(a is not None for a in arrays)
    args = tuple(a for a in arrays if a is not None)
    names = tuple(n for slots in (*in_slots, *out_slots) for n, _ in slots)
    prepared: dict = {}

    def callback(ctx, out, *bufs):
        it = iter(bufs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        addr = {}
        for p, slots in zip(present, in_slots):
            base = _ptr(next(it)) if p else 0
            for n, off in slots:
                addr[n] = base + off if base else 0
        for o, slots in zip(outs, out_slots):
            base = _ptr(o)
            for n, off in slots:
                addr[n] = base + off
        device = int(outs[0].__dlpack_device__()[1])
        key = (device,) + tuple(addr[n] & 15 for n in names)
        launch = prepared.get(key)
        if launch is None:
            launch = prepared[key] = _launch.Prepared(build(addr, device), device, names)
        launch(int(ctx.stream), [addr[n] for n in names])

    fn = buffer_callback(callback, result_shapes, vmap_method="sequential", **_callback_kwargs())
    return fn(*args)


_FAKE_BASE = 1 << 40  # planning addresses: buffer i at (i + 1) << 40, far apart and 16-byte aligned


def _ffi_call(lib, result_shapes, arrays, in_slots, out_slots, build, layouts=None):
    """:func:`gpu_call` through the FFI handler (``lib``); None when the GPUs differ in what the plan
    depends on (SM count, programmatic launches): the callback path plans per device."""
    import jax

    devices = gpu_ordinals()
    if len({(_launch.sm_count(d), _launch.pdl_launcher(d) is not None) for d in devices}) != 1:
        return None
    args = tuple(a for a in arrays if a is not None)
    addr, spans, b = {}, [], 0
    for slots in [s for a, s in zip(arrays, in_slots) if a is not None] + list(out_slots):
        for n, off in slots:
            addr[n] = (b + 1) * _FAKE_BASE + off
            spans.append((b, n, off))
        b += 1
    for a, slots in zip(arrays, in_slots):
        if a is None:
            addr.update({n: 0 for n, _ in slots})
    spec = build(addr, devices[0], True) if layouts else build(addr, devices[0])
    _launch.check_grid(spec)
    words = np.frombuffer(spec.params, dtype="<i8").astype(np.int64)
    slot_list = []
    for b, n, off in spans:
        for w in spec.slots.get(n, ()):
            words[w] = off
            slot_list += [b, w]
    for d in devices:
        if (spec.name, d) not in _registered:
            lib.cupy_rope_xla_register(spec.name.encode(), d, _launch.function(spec.name, d)[0])
            _registered.add((spec.name, d))
    geometry = [*spec.grid, spec.block, _kernels.param_blocks(spec.name), int(_launch.pdl_launcher(devices[0]) is not None)]
    kw = {}
    if layouts:
        outs = layouts[1] if isinstance(result_shapes, (tuple, list)) else layouts[1][0]  # one result: its layout
        kw = {"input_layouts": [o for a, o in zip(arrays, layouts[0]) if a is not None], "output_layouts": outs}
    call = jax.ffi.ffi_call(TARGET, result_shapes, vmap_method="sequential", **kw)
    return call(*args, kernel=spec.name, params=words, slots=np.asarray(slot_list, np.int64),
                geometry=np.asarray(geometry, np.int64))

"""The XLA launch: a cupy_rope kernel run by XLA on its own stream, into buffers XLA allocated.

Each call is a ``jax.experimental.buffer_callback``. Where the installed JAX supports it, the
callback is marked ``command_buffer_compatible``: when XLA records the program into a command
buffer (a CUDA graph) the Python body runs at record time only, and replays launch the kernel
with no Python at all. The body therefore does nothing but resolve addresses and enqueue the
launch; the kernel is compiled at trace time (compiling or loading a module while XLA captures
would not be allowed).
"""

from __future__ import annotations

import functools
import inspect

from . import _launch


COMMAND_BUFFERS = True  # mark callbacks command-buffer compatible where JAX supports it


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

    for dev in jax.local_devices(backend="gpu"):
        _launch.sm_count(dev.id)
        for name in spec_names:
            _launch.function(name, dev.id)


def _ptr(buf) -> int:
    return 0 if buf is None else buf.__cuda_array_interface__["data"][0]


def gpu_call(result_shapes, arrays: tuple, in_slots, out_slots, build):
    """Launch a kernel in a buffer_callback on XLA's stream, into the buffers XLA allocated.

    ``in_slots[i]`` / ``out_slots[j]``: the (address name, byte offset) pairs that input ``i``
    (``None`` entries of ``arrays`` give address 0) and output ``j`` provide. ``build(addr,
    device)`` returns the LaunchSpec for the addresses ``addr`` (a dict); it runs once per
    address alignment and device, later calls only patch the addresses into the prepared launch.
    """
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

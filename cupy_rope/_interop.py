"""Array interop: recognise the caller's framework, describe arrays, allocate outputs there,
find the caller's current stream, and view CPU arrays as NumPy (all zero-copy).

Frameworks are imported lazily: NumPy is the only hard dependency.
"""

from __future__ import annotations

import sys

import numpy as np

from ._plan import ArrayInfo

_TORCH_DTYPES = {}


def _torch_dtypes():
    if not _TORCH_DTYPES:
        import torch

        _TORCH_DTYPES.update({torch.float32: "float32", torch.float16: "float16",
                              torch.bfloat16: "bfloat16", torch.int32: "int32", torch.int64: "int64"})
        _TORCH_DTYPES.update({v: k for k, v in list(_TORCH_DTYPES.items())})
    return _TORCH_DTYPES


def kind_of(a, name: str = "array") -> str:
    """'numpy', 'cupy', 'torch', 'jax' or 'dlpack' (any other ``__dlpack__`` object); a
    ``TypeError`` naming argument ``name`` for anything else (lists, scalars, None)."""
    if isinstance(a, np.ndarray):
        return "numpy"
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy" and type(a).__name__ == "ndarray":
        return "cupy"
    if mod == "torch" and "torch" in sys.modules and isinstance(a, sys.modules["torch"].Tensor):
        return "torch"
    if mod in ("jax", "jaxlib") and "jax" in sys.modules and isinstance(a, sys.modules["jax"].Array):
        return "jax"
    if hasattr(a, "__dlpack__") and not isinstance(a, type):
        return "dlpack"
    got = "None" if a is None else f"{type(a).__module__}.{type(a).__qualname__}".replace("builtins.", "")
    raise TypeError(f"cupy_rope: `{name}`: expected a NumPy, CuPy, torch or JAX array (or an object "
                    f"with __dlpack__), got {got}")


def _dtype_name(dt) -> str:
    name = np.dtype(dt).name if not hasattr(dt, "name") else dt.name
    return str(name)


def describe(name: str, a):
    """``(array, kind, ArrayInfo)`` of argument ``name`` (a generic ``__dlpack__`` object is
    viewed as CuPy or NumPy first); errors name the argument."""
    kind = kind_of(a, name)
    if kind == "dlpack":
        try:
            a, kind = from_dlpack(a)
        except Exception as e:
            raise TypeError(f"cupy_rope: `{name}`: expected an array importable through DLPack, got "
                            f"{type(a).__name__} ({type(e).__name__}: {e})") from None
    return a, kind, info(a, kind, name)


def info(a, kind: str | None = None, name: str = "array") -> ArrayInfo | None:
    """Describe ``a`` (no data access, no synchronisation). ``None`` stays ``None``."""
    if a is None:
        return None
    kind = kind or kind_of(a, name)
    if kind == "torch":
        dt = _torch_dtypes().get(a.dtype, str(a.dtype).replace("torch.", ""))
        dev = ("cuda", a.device.index) if a.device.type == "cuda" else (a.device.type, 0)
        ptr = a.data_ptr() if a.device.type != "meta" else 0
        return ArrayInfo(tuple(a.shape), tuple(a.stride()), dt, dev, ptr)
    if kind in ("cupy", "numpy"):
        isz = a.itemsize
        if any(s % isz for s in a.strides):
            raise ValueError(f"cupy_rope: `{name}`: expected strides that are multiples of the item size "
                             f"{isz}, got strides {a.strides} (bytes)")
        if kind == "cupy":
            return ArrayInfo(a.shape, tuple(s // isz for s in a.strides), _dtype_name(a.dtype),
                             ("cuda", a.device.id), a.data.ptr)
        return ArrayInfo(a.shape, tuple(s // isz for s in a.strides), _dtype_name(a.dtype), ("cpu", 0),
                         a.__array_interface__["data"][0])
    if kind == "jax":
        dev = next(iter(a.devices()))
        plat = "cuda" if dev.platform == "gpu" else dev.platform
        strides = _contiguous(a.shape)
        return ArrayInfo(tuple(a.shape), strides, _dtype_name(a.dtype), (plat, dev.id if plat == "cuda" else 0), 0)
    raise TypeError(f"cupy_rope: `{name}`: cannot describe {type(a).__name__}")


def check_writable(name: str, a, kind: str) -> None:
    """An output the caller passed must be writable in place (NumPy's read-only views are not;
    JAX arrays never reach here: the API rejects ``out`` for them first)."""
    if kind in ("numpy", "cupy") and not getattr(a.flags, "writeable", True):
        raise ValueError(f"cupy_rope: `{name}`: expected a writable array, got a read-only {kind} array")


def _contiguous(shape):
    from ._plan import output_strides

    return output_strides(tuple(shape))


def from_dlpack(a):
    """A generic ``__dlpack__`` object as CuPy (CUDA) or NumPy (CPU), zero-copy."""
    dev_type = a.__dlpack_device__()[0] if hasattr(a, "__dlpack_device__") else 1
    if dev_type in (2, 13):  # kDLCUDA, kDLCUDAManaged
        import cupy

        return cupy.from_dlpack(a), "cupy"
    return np.from_dlpack(a), "numpy"


# --------------------------------------------------------------------- CPU views
def to_numpy(a, kind: str):
    """A NumPy view of a CPU array (torch CPU, JAX CPU, NumPy); bf16 as ml_dtypes.bfloat16."""
    if a is None:
        return None
    if kind == "numpy":
        return a
    if kind == "torch":
        import torch

        t = a.detach()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if kind == "jax":
        return np.asarray(a)
    raise TypeError(f"cupy_rope: {kind} array is not on the CPU")


def from_numpy(y: np.ndarray, kind: str, like=None):
    """Return NumPy result ``y`` in the caller's framework."""
    if kind == "numpy":
        return y
    if kind == "torch":
        import torch

        y = np.ascontiguousarray(y)
        if y.dtype.name == "bfloat16":
            return torch.from_numpy(y.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(y)
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(y)
    return y


def static_table(t):
    """A torch table built once and kept (``rope_freqs`` / ``rope_cos_sin_cache`` with ``like``)
    marked as an input whose address stays the same across calls of a compiled function
    (``torch._dynamo.mark_static_address``, unguarded), as torch marks a module's buffers:
    CUDA-graph trees (``torch.compile(mode="reduce-overhead")``) then read it in place instead of
    copying it into the graph's own input buffer on every replay. A table at another address
    makes them record again; nothing else changes."""
    if t.is_cuda:
        import torch._dynamo

        torch._dynamo.mark_static_address(t, guard=False)
    return t


def write_into(out, kind: str, y: np.ndarray) -> None:
    """Copy a NumPy result into a caller-provided CPU output (any strides)."""
    if kind == "torch":
        out.copy_(from_numpy(y, "torch"))
    elif kind == "numpy":
        out[...] = y
    else:
        raise TypeError(f"cupy_rope: `out` of type {type(out).__name__} is not writable here")


# --------------------------------------------------------------------- GPU allocation, streams
def alloc_shape(shape, transposed: bool = False) -> tuple:
    """The shape an output is allocated with: ``shape``, or for ``transposed`` (an sbhd view over
    bshd-ordered memory) its first two dimensions swapped."""
    return (shape[1], shape[0], *shape[2:]) if transposed else tuple(shape)


def empty_like(kind: str, like, shape: tuple, transposed: bool = False, same: bool = False):
    """(new array, its address): ``like``'s dtype and device, allocated by the caller's framework
    (torch's caching allocator, CuPy's pool, NumPy); contiguous, or for ``transposed`` an sbhd
    view over bshd-ordered memory (``transpose_output_memory``). ``same``: ``shape`` is
    ``like``'s own (the cheapest allocation). torch ``meta`` tensors give meta tensors (address 0)."""
    if kind == "torch":
        import torch

        if same and not transposed:
            y = torch.empty_like(like, memory_format=torch.contiguous_format)
        else:
            y = torch.empty(alloc_shape(shape, transposed), dtype=like.dtype, device=like.device)
        p = y.data_ptr() if y.device.type != "meta" else 0
        return (y.permute(1, 0, 2, 3) if transposed else y), p
    alloc = alloc_shape(shape, transposed)
    if kind == "numpy":
        y = np.empty(alloc, dtype=like.dtype)
        return (y.transpose(1, 0, 2, 3) if transposed else y), y.__array_interface__["data"][0]
    if kind != "cupy":
        raise TypeError(f"cupy_rope: cannot allocate for {kind}")
    import cupy

    dev = like.data.device_id
    if cupy.cuda.runtime.getDevice() == dev:
        y = cupy.empty(alloc, dtype=like.dtype)
    else:
        with cupy.cuda.Device(dev):
            y = cupy.empty(alloc, dtype=like.dtype)
    return (y.transpose(1, 0, 2, 3) if transposed else y), y.data.ptr


_STREAM_FNS: dict = {}


def _stream_fn(kind: str):
    if kind == "torch":
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return raw or (lambda dev: torch.cuda.current_stream(dev).cuda_stream)  # the private API moved
    import cupy

    get = cupy.cuda.get_current_stream
    return lambda dev: get(dev).ptr


def current_stream(kind: str, device_index: int) -> int:
    """The caller's current stream handle on ``device_index`` (queried on every call: never cached,
    so launches follow ``torch.cuda.stream(...)``, CuPy's ``with stream:`` and graph capture)."""
    fn = _STREAM_FNS.get(kind)
    if fn is None:
        fn = _STREAM_FNS[kind] = _stream_fn(kind)
    return fn(device_index)

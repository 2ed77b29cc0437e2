"""TransformerEngine drop-in: the four RoPE functions of TE's PyTorch extension
(``transformer_engine_torch``), same names, same positional order, same results.

TE's own ``transformer_engine/pytorch/attention/rope.py`` works when this module stands in
for the extension (e.g. ``sys.modules["transformer_engine_torch"] = cupy_rope.te`` before TE's
Python package imports it, or by patching ``tex`` in that module). Beyond TE: any input
strides, thd for the QKV functions, ``start_positions`` honoured in the QKV backward, CPU
tensors (NumPy backend). Outputs are contiguous, as TE's are. Inside ``torch.compile`` the calls
go through the torch shim's ops (``cupy_rope.torch``: one graph node per call); eager calls
through the public API.

Example::

    from cupy_rope import te as tex
    y = tex.fused_rope_forward(t, freqs, None, "sbhd", False, None, 1, 0)
"""

from __future__ import annotations

import enum
import operator

from . import _api, _dropins, _interop


class NVTE_QKV_Format(enum.IntEnum):
    """TE's ``NVTE_QKV_Format`` (the values of ``transformer_engine_torch``)."""

    NVTE_SBHD = 0
    NVTE_BSHD = 1
    NVTE_THD = 2
    NVTE_BSHD_2SBHD = 3
    NVTE_SBHD_2BSHD = 4
    NVTE_THD_2BSHD = 5
    NVTE_THD_2SBHD = 6


NVTE_SBHD, NVTE_BSHD, NVTE_THD = (NVTE_QKV_Format.NVTE_SBHD, NVTE_QKV_Format.NVTE_BSHD,
                                  NVTE_QKV_Format.NVTE_THD)
_NAMES = {NVTE_SBHD: "sbhd", NVTE_BSHD: "bshd", NVTE_THD: "thd"}


def _layout(qkv_format) -> str:
    """A layout string from TE's enum (or anything with its name/value) or a string."""
    if isinstance(qkv_format, str):
        return qkv_format
    name = getattr(qkv_format, "name", None)
    if name in ("NVTE_SBHD", "NVTE_BSHD", "NVTE_THD"):
        return name[5:].lower()
    try:
        if isinstance(qkv_format, bool):
            raise TypeError
        return _NAMES[NVTE_QKV_Format(operator.index(qkv_format))]
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"cupy_rope.te: `qkv_format`: expected 'sbhd', 'bshd', 'thd' or "
                         f"NVTE_QKV_Format.NVTE_SBHD/BSHD/THD, got {qkv_format!r}") from None


# The library's argument names -> TE's, for errors.
_FWD_NAMES = {"x": "input", "layout": "qkv_format"}
_BWD_NAMES = {"grad": "output_grads", "layout": "qkv_format"}
_QKV_NAMES = {"qkv": "qkv_input", "split": "qkv_split_arg_list", "layout": "qkv_format"}
_QKV_BWD_NAMES = {"dq": "q_grad_out", "dk": "k_grad_out", "dv": "v_grad_out", "split": "qkv_split_arg_list",
                  "layout": "qkv_format"}


def _flag(name: str, v) -> bool:
    """A flag as TE's extension converts it (pybind11: None is false; a number, NumPy scalar or
    one-element tensor by its truth value; no strings, lists or other objects)."""
    if v is None:
        return False
    try:
        if getattr(type(v), "__bool__", None) is None:
            raise TypeError
        return bool(v)
    except (TypeError, ValueError, RuntimeError):  # e.g. an array of several elements
        raise TypeError(f"cupy_rope.te: `{name}`: expected a bool, got {type(v).__name__} {v!r}") from None


def _index(name: str, v) -> int:
    """An int as TE's extension converts it (pybind11: ints and objects with ``__index__``; no
    floats, no strings)."""
    try:
        return operator.index(v)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"cupy_rope.te: `{name}`: expected an int, got {type(v).__name__} {v!r}") from None


def _options(interleaved, cp_size, cp_rank) -> tuple:
    """``(interleaved, cp_size, cp_rank)`` converted as TE's extension converts them."""
    if type(interleaved) is bool and type(cp_size) is int and type(cp_rank) is int:  # the common case
        return interleaved, cp_size, cp_rank
    return _flag("interleaved", interleaved), _index("cp_size", cp_size), _index("cp_rank", cp_rank)


def _entry(a, name: str):
    """Where a call on ``a`` goes: the public API for arrays outside a trace (plain torch tensors
    included: its C++ route for CUDA tensors, no custom-op dispatch); the torch shim's ops
    while torch.compile traces or for tensor subclasses (fake and functional tensors), where
    the public API's Python cannot be traced. A non-array is a ``TypeError`` naming TE's
    argument ``name``."""
    if _interop.kind_of(a, name) == "torch" and (type(a).__name__ != "Tensor" or _compiling()):
        return _dropins._torch_shim()
    return _api


def _compiling() -> bool:
    import torch

    return torch.compiler.is_compiling()


def _split(v) -> tuple:
    try:
        return tuple(v)
    except TypeError:
        raise TypeError(f"cupy_rope.te: `qkv_split_arg_list`: expected a list of three ints, got "
                        f"{type(v).__name__} {v!r}") from None


def _call(fn_name: str, lead: str, names: dict, args: tuple, qkv_format, interleaved, cp_size, cp_rank, **kw):
    """``fn_name`` of :func:`_entry`'s module on ``args`` (those before the layout), TE's options
    converted, errors naming TE's arguments (``names``; ``lead``: TE's name of ``args[0]``)."""
    il, cs, cr = _options(interleaved, cp_size, cp_rank)
    try:
        fn = getattr(_entry(args[0], lead), fn_name)
        return fn(*args, _layout(qkv_format), interleaved=il, cp_size=cs, cp_rank=cr, **kw)
    except (TypeError, ValueError) as e:
        raise _dropins.renamed(e, names) from None


def fused_rope_forward(input, freqs, start_positions, qkv_format, interleaved, cu_seqlens, cp_size, cp_rank):
    """TE's ``fused_rope_forward``: see :func:`cupy_rope.apply_rope`."""
    return _call("apply_rope", "input", _FWD_NAMES, (input, freqs), qkv_format, interleaved, cp_size, cp_rank,
                 cu_seqlens=cu_seqlens, start_positions=start_positions)


def _is_format(v) -> bool:
    return isinstance(v, (str, enum.Enum)) or type(v).__name__ == "NVTE_QKV_Format"


def fused_rope_backward(output_grads, freqs, start_positions, qkv_format, interleaved, cu_seqlens, cp_size,
                        cp_rank=None):
    """TE's ``fused_rope_backward``: see :func:`cupy_rope.apply_rope_backward`.

    Also accepts the pre-2.x order without ``start_positions``
    ``(output_grads, freqs, qkv_format, interleaved, cu_seqlens, cp_size, cp_rank)``.
    """
    if cp_rank is None and _is_format(start_positions):
        start_positions, qkv_format, interleaved, cu_seqlens, cp_size, cp_rank = (
            None, start_positions, qkv_format, interleaved, cu_seqlens, cp_size)
    return _call("apply_rope_backward", "output_grads", _BWD_NAMES, (output_grads, freqs), qkv_format, interleaved,
                 cp_size, cp_rank, cu_seqlens=cu_seqlens, start_positions=start_positions)


def fused_qkv_rope_forward(qkv_input, q_freqs, k_freqs, start_positions, qkv_split_arg_list, qkv_format,
                           interleaved, cp_size, cp_rank, cu_seqlens=None):
    """TE's ``fused_qkv_rope_forward`` -> ``(q, k, v)``; ``cu_seqlens=`` adds thd (beyond TE)."""
    return _call("apply_qkv_rope", "qkv_input", _QKV_NAMES, (qkv_input, q_freqs, k_freqs, _split(qkv_split_arg_list)),
                 qkv_format, interleaved, cp_size, cp_rank, cu_seqlens=cu_seqlens, start_positions=start_positions)


def fused_qkv_rope_backward(q_grad_out, k_grad_out, v_grad_out, q_freqs, k_freqs, qkv_split_arg_list,
                            qkv_format, interleaved, cp_size, cp_rank, start_positions=None, cu_seqlens=None):
    """TE's ``fused_qkv_rope_backward`` -> packed gradient. Honours ``start_positions=``
    (TE's ignores it, giving wrong gradients with offsets)."""
    args = (q_grad_out, k_grad_out, v_grad_out, q_freqs, k_freqs, _split(qkv_split_arg_list))
    return _call("apply_qkv_rope_backward", "q_grad_out", _QKV_BWD_NAMES, args, qkv_format, interleaved, cp_size,
                 cp_rank, cu_seqlens=cu_seqlens, start_positions=start_positions)

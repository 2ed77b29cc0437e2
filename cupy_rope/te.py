"""TransformerEngine drop-in: the four RoPE functions of TE's PyTorch extension
(``transformer_engine_torch``), same names, same positional order, same results.

TE's own ``transformer_engine/pytorch/attention/rope.py`` works when this module stands in
for the extension (e.g. ``sys.modules["transformer_engine_torch"] = cupy_rope.te`` before TE's
Python package imports it, or by patching ``tex`` in that module). Beyond TE: any input
strides, thd for the QKV functions, ``start_positions`` honoured in the QKV backward, CPU
tensors (NumPy backend). Outputs are contiguous, as TE's are.

Example::

    from cupy_rope import te as tex
    y = tex.fused_rope_forward(t, freqs, None, "sbhd", False, None, 1, 0)
"""

from __future__ import annotations

import enum

from . import _api


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
        return _NAMES[NVTE_QKV_Format(int(qkv_format))]
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"cupy_rope.te: `qkv_format`: expected 'sbhd', 'bshd', 'thd' or "
                         f"NVTE_QKV_Format.NVTE_SBHD/BSHD/THD, got {qkv_format!r}") from None


def fused_rope_forward(input, freqs, start_positions, qkv_format, interleaved, cu_seqlens, cp_size, cp_rank):
    """TE's ``fused_rope_forward``: see :func:`cupy_rope.apply_rope`."""
    return _api.apply_rope(input, freqs, _layout(qkv_format), interleaved=bool(interleaved),
                           cu_seqlens=cu_seqlens, start_positions=start_positions, cp_size=int(cp_size),
                           cp_rank=int(cp_rank))


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
    return _api.apply_rope_backward(output_grads, freqs, _layout(qkv_format), interleaved=bool(interleaved),
                                    cu_seqlens=cu_seqlens, start_positions=start_positions,
                                    cp_size=int(cp_size), cp_rank=int(cp_rank))


def fused_qkv_rope_forward(qkv_input, q_freqs, k_freqs, start_positions, qkv_split_arg_list, qkv_format,
                           interleaved, cp_size, cp_rank, cu_seqlens=None):
    """TE's ``fused_qkv_rope_forward`` -> ``(q, k, v)``; ``cu_seqlens=`` adds thd (beyond TE)."""
    return _api.apply_qkv_rope(qkv_input, q_freqs, k_freqs, tuple(qkv_split_arg_list), _layout(qkv_format),
                               interleaved=bool(interleaved), cu_seqlens=cu_seqlens,
                               start_positions=start_positions, cp_size=int(cp_size), cp_rank=int(cp_rank))


def fused_qkv_rope_backward(q_grad_out, k_grad_out, v_grad_out, q_freqs, k_freqs, qkv_split_arg_list,
                            qkv_format, interleaved, cp_size, cp_rank, start_positions=None, cu_seqlens=None):
    """TE's ``fused_qkv_rope_backward`` -> packed gradient. Honours ``start_positions=``
    (TE's ignores it, giving wrong gradients with offsets)."""
    return _api.apply_qkv_rope_backward(q_grad_out, k_grad_out, v_grad_out, q_freqs, k_freqs,
                                        tuple(qkv_split_arg_list), _layout(qkv_format),
                                        interleaved=bool(interleaved), cu_seqlens=cu_seqlens,
                                        start_positions=start_positions, cp_size=int(cp_size),
                                        cp_rank=int(cp_rank))

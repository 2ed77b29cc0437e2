"""What the drop-ins share: errors that name the original API's arguments (all of them:
``cupy_rope.te``, ``cupy_rope.vllm``, ``cupy_rope.flashinfer``); for the serving drop-ins, the
positions API reached through the caller's framework (torch tensors through the torch ops, so
the drop-ins work under ``torch.compile`` and in CUDA graphs; CuPy/NumPy/JAX arrays through the
public API), and inverse-frequency tables kept per device."""

from __future__ import annotations

import threading

from . import _api, _freqs, _interop, _plan

_INV: dict = {}
_LOCK = threading.Lock()


def rope_pos(names: dict, positions, q, k, **kw):
    """:func:`cupy_rope.apply_rope_pos` in the caller's framework: ``(q_out, k_out)``. Errors name
    the drop-in's own arguments: ``names`` maps the library's names (``q``, ``k``, ``positions``)
    to the original API's (e.g. ``query``, ``key``, ``pos_ids``)."""
    try:
        if _interop.kind_of(q, names.get("q", "q")) == "torch":
            return _torch_shim().apply_rope_pos(positions, q, k, **kw)
        return _api.apply_rope_pos(positions, q, k, **kw)
    except (TypeError, ValueError) as e:
        raise renamed(e, names) from None


def _torch_shim():
    """``cupy_rope.torch``, imported on the first call on torch tensors (not per call)."""
    global _TORCH
    if _TORCH is None:
        from . import torch as crt

        _TORCH = crt
    return _TORCH


_TORCH = None


def renamed(e: Exception, names: dict) -> Exception:
    """``e`` (a ``TypeError``/``ValueError`` of the library) with the arguments it names in
    backticks renamed by ``names`` (the library's name -> the original API's); ``e`` itself
    when it names none of them."""
    msg = str(e)
    for ours, theirs in names.items():
        msg = msg.replace(f"`{ours}`", f"`{theirs}`")
    return e if msg == str(e) else type(e)(msg)


def inv_freq_like(like, rotary_dim: int, theta: float, scaling: dict | None):
    """Float64 inverse frequencies (:func:`cupy_rope.rope_inv_freq`) on ``like``'s device, in its
    framework; made once per (rotary_dim, theta, scaling, device) and kept (the first call of a
    CUDA-graph capture must come after a warm-up call, as for any allocation)."""
    kind = _interop.kind_of(like, "q")
    dev = str(like.device) if kind == "torch" else getattr(getattr(like, "device", None), "id", None)
    key = (kind, dev, rotary_dim, float(theta), tuple(sorted((scaling or {}).items())))
    hit = _INV.get(key)
    if hit is None:
        inv, _ = _freqs.rope_inv_freq(rotary_dim, theta, scaling)
        hit = _freqs.to_like(inv, like) if kind != "numpy" else inv
        with _LOCK:
            _INV[key] = hit
    return hit


def check_rotary_dim(rotary_dim, head_dim: int) -> int:
    """``rotary_dim`` (None: the head dim), even and at most the head dim."""
    if rotary_dim is None:
        return head_dim
    r = _plan.check_int("rotary_dim", rotary_dim, lo=2)
    if r % 2 or r > head_dim:
        raise ValueError(f"cupy_rope: `rotary_dim`: expected an even value <= the head dim {head_dim}, got {r}")
    return r

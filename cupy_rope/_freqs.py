"""The standard angle table (spec section 2): TransformerEngine's ``RotaryPositionEmbedding``."""

from __future__ import annotations

import numpy as np

from . import _interop, _plan


def rope_freqs(dim, max_seq_len, *, rotary_percent=1.0, base=10000.0, interleaved=False,
               seq_len_interpolation_factor=None, pretrained_max_position_embeddings=None, offset=0,
               like=None):
    """TransformerEngine's standard angle table (spec section 2), in float32 throughout.

    Returns ``[max_seq_len, 1, 1, d2]`` float32 with ``d2 = 2*ceil(dim'/2)``,
    ``dim' = int(dim * rotary_percent)`` (when ``rotary_percent < 1``), in the array library of
    ``like`` (NumPy when ``None``). With a torch tensor as ``like`` the table is built with TE's
    own torch operations on that tensor's device, so it is bit-identical to TE's table there;
    otherwise NumPy builds it with a correctly rounded float32 ``pow`` (a platform's ``powf``
    may differ in the last bit of a few ``inv_freq`` entries) and CuPy/JAX get a copy on
    ``like``'s device.

    Example:
        >>> import cupy_rope
        >>> cupy_rope.rope_freqs(128, 4096, base=500000.0).shape
        (4096, 1, 1, 128)
    """
    dim = _plan.check_int("dim", dim, lo=1)
    max_seq_len = _plan.check_int("max_seq_len", max_seq_len, lo=0)
    interleaved = _plan.check_bool("interleaved", interleaved)
    rp = float(rotary_percent)
    if not 0.0 < rp <= 1.0:
        raise ValueError(f"cupy_rope: `rotary_percent`: expected 0 < rotary_percent <= 1, got {rotary_percent}")
    dimp = int(dim * rp) if rp < 1.0 else dim
    if dimp < 1:
        raise ValueError(f"cupy_rope: `rotary_percent`: expected int(dim * rotary_percent) >= 1, got {dimp}")
    kind = _interop.kind_of(like) if like is not None else "numpy"
    if kind == "torch":  # TE's own ops on the tensor's device: bit-identical to TE's table there
        import torch

        xp, f32 = torch, torch.float32

        def arange(*a):
            return torch.arange(*a, dtype=f32, device=like.device)
    else:
        xp, f32 = np, np.float32

        def arange(*a):
            return np.arange(*a, dtype=f32)
    # spec section 2, in float32 throughout (Python scalars act in float32, as in TE)
    exps = arange(0, dimp, 2) / dimp
    if kind == "torch":
        inv_freq = 1.0 / (float(base) ** exps)
    else:  # powf correctly rounded (through float64), then the float32 reciprocal
        inv_freq = f32(1.0) / (np.float64(f32(base)) ** exps.astype(np.float64)).astype(f32)
    seq = arange(max_seq_len) + offset
    P, F = pretrained_max_position_embeddings, seq_len_interpolation_factor
    if P is not None and F is not None:
        scale = 1 / (max_seq_len / P) if max_seq_len > P * F else 1 / F
        seq = seq * (scale if kind == "torch" else f32(scale))
    f = xp.outer(seq, inv_freq)
    if interleaved:
        emb = xp.stack([f, f], -1).reshape(max_seq_len, -1)
    else:
        emb = xp.concatenate([f, f], -1)
    emb = emb.reshape(max_seq_len, 1, 1, emb.shape[-1])
    if kind == "torch":
        return emb.contiguous()
    emb = np.ascontiguousarray(emb)
    if kind == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.asarray(emb)
    if kind == "jax":
        import jax

        return jax.device_put(emb, next(iter(like.devices())))
    return emb

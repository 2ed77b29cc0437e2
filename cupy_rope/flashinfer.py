"""Drop-ins for FlashInfer's RoPE functions (``flashinfer.rope``): same names, signatures and
in-place / out-of-place semantics, for torch tensors (CUDA or CPU; eager, ``torch.compile``, CUDA
graphs), CuPy and NumPy arrays: ``apply_rope_with_cos_sin_cache[_inplace]``,
``apply_rope_pos_ids[_inplace]``, ``apply_llama31_rope_pos_ids[_inplace]`` and the ragged-batch
``apply_rope[_inplace]``, ``apply_llama31_rope[_inplace]`` (``indptr``/``offsets`` turned into
per-token positions with the arrays' own framework, a few small kernels before the rotation).

Angles: ``apply_rope_pos_ids`` and ``apply_llama31_rope_pos_ids`` compute ``position *
inv_freq`` and its cos/sin in float64 (exact at any position below 2^24; FlashInfer uses float32
angles and fast-math ``sincos``); the ``cos_sin_cache`` functions read the cache. Positions
outside a cache leave their token unrotated.

Example::

    import torch, cupy_rope.flashinfer as cfi
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(64, device="cuda", dtype=torch.int32)
    q_rope, k_rope = cfi.apply_llama31_rope_pos_ids(q, k, pos)
"""

from __future__ import annotations

from . import _dropins, _plan
from ._interop import info, kind_of

__all__ = ["apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace", "apply_rope_pos_ids",
           "apply_rope_pos_ids_inplace", "apply_llama31_rope_pos_ids", "apply_llama31_rope_pos_ids_inplace",
           "apply_rope", "apply_rope_inplace", "apply_llama31_rope", "apply_llama31_rope_inplace"]


def _cache_call(positions, query, key, head_size, cos_sin_cache, is_neox, inplace):
    return _dropins.rope_pos({"q": "query", "k": "key"}, positions, query, key, cos_sin_cache=cos_sin_cache,
                             head_size=_plan.check_int("head_size", head_size, lo=1),
                             interleaved=not _plan.check_bool("is_neox", is_neox), inplace=inplace)


def apply_rope_with_cos_sin_cache(positions, query, key, head_size: int, cos_sin_cache, is_neox: bool = True):
    """FlashInfer's ``apply_rope_with_cos_sin_cache``: ``(query_out, key_out)``, new tensors.

    ``positions`` ``[nnz]`` int32/int64; ``query`` ``[nnz, num_q_heads * head_size]`` (or with a
    head dimension), ``key`` likewise for its heads; ``cos_sin_cache`` ``[max_seq_len,
    rotary_dim]`` (cos first half, sin second), float32 (or the query's dtype); ``is_neox``:
    rotate-half pairs, else interleaved.

    Example:
        >>> import numpy as np, cupy_rope, cupy_rope.flashinfer as cfi
        >>> cache = cupy_rope.rope_cos_sin_cache(64, 16)
        >>> q, k = cfi.apply_rope_with_cos_sin_cache(np.arange(3), np.ones((3, 128), np.float32),
        ...                                          np.ones((3, 64), np.float32), 64, cache)
        >>> q.shape, k.shape
        ((3, 128), (3, 64))
    """
    return _cache_call(positions, query, key, head_size, cos_sin_cache, is_neox, False)


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size: int, cos_sin_cache,
                                          is_neox: bool = True) -> None:
    """FlashInfer's ``apply_rope_with_cos_sin_cache_inplace``: as
    :func:`apply_rope_with_cos_sin_cache`, into ``query`` and ``key``; returns None.

    Example:
        >>> import numpy as np, cupy_rope, cupy_rope.flashinfer as cfi
        >>> q = np.ones((2, 64), np.float32); k = np.ones((2, 64), np.float32)
        >>> cfi.apply_rope_with_cos_sin_cache_inplace(np.arange(2), q, k, 64, cupy_rope.rope_cos_sin_cache(64, 4))
        >>> bool(q[1, 0] != 1.0)
        True
    """
    _cache_call(positions, query, key, head_size, cos_sin_cache, is_neox, True)


def _pos_ids_call(q, k, pos_ids, rotary_dim, interleave, theta, scaling, inplace):
    kind_of(q, "q")
    if q.ndim != 3:
        raise ValueError(f"cupy_rope: `q`: expected [nnz, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    rd = _dropins.check_rotary_dim(rotary_dim, q.shape[-1])
    inv = _dropins.inv_freq_like(q, rd, _plan.check_number("rope_theta", theta, 1.0), scaling)
    return _dropins.rope_pos({"positions": "pos_ids"}, pos_ids, q, k, inv_freq=inv,
                             interleaved=_plan.check_bool("interleave", interleave), inplace=inplace)


def _ragged_positions(q, indptr, offsets):
    """FlashInfer's ragged batch as per-token positions: token t of segment i (``indptr[i] <= t <
    indptr[i + 1]``) is at ``offsets[i] + t - indptr[i]``; tokens in no segment get -1 (copied).
    Computed with the arrays' own framework on their device (no synchronisation)."""
    kind_of(q, "q")
    nnz = q.shape[0] if q.ndim else 0
    kinds = [kind_of(a, n) for a, n in ((indptr, "indptr"), (offsets, "offsets"))]
    for a, n, k in ((indptr, "indptr", kinds[0]), (offsets, "offsets", kinds[1])):
        i = info(a, k, n)
        _plan.check_index(n, i)
    nseq = indptr.shape[0] - 1
    if nseq < 0 or offsets.shape[0] < nseq:
        raise ValueError(f"cupy_rope: `offsets`: expected at least batch_size = len(indptr) - 1 = {nseq} entries "
                         f"(and `indptr` at least one), got shapes {tuple(offsets.shape)} and {tuple(indptr.shape)}")
    if kinds[0] == "torch":
        import torch

        ar = torch.arange(nnz, device=indptr.device, dtype=torch.int64)
        ip, off = indptr.to(torch.int64), offsets.to(torch.int64)
        if nseq == 0:
            return torch.full((nnz,), -1, dtype=torch.int64, device=indptr.device)
        seq = torch.searchsorted(ip[1:].contiguous(), ar, right=True)
        s_ = seq.clamp(max=nseq - 1)
        return torch.where(seq < nseq, off[s_] + ar - ip[s_], torch.full_like(ar, -1))
    if kinds[0] == "cupy":
        import cupy as xp
    else:
        import numpy as xp
    ar = xp.arange(nnz, dtype=xp.int64)
    if nseq == 0:
        return xp.full((nnz,), -1, dtype=xp.int64)
    ip, off = indptr.astype(xp.int64), offsets.astype(xp.int64)
    seq = xp.searchsorted(ip[1:], ar, side="right")
    s_ = xp.minimum(seq, nseq - 1)
    return xp.where(seq < nseq, off[s_] + ar - ip[s_], -1)


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave: bool = False, rope_scale: float = 1,
               rope_theta: float = 1e4):
    """FlashInfer's ``apply_rope`` (ragged batch): ``(q_rope, k_rope)``, new tensors.

    ``q`` ``[nnz, num_qo_heads, head_dim]``, ``k`` ``[nnz, num_kv_heads, head_dim]``; segment i
    holds tokens ``indptr[i] .. indptr[i+1]`` at positions ``offsets[i], offsets[i] + 1, ...``;
    other arguments as :func:`apply_rope_pos_ids`.

    Example:
        >>> import numpy as np, cupy_rope.flashinfer as cfi
        >>> q, k = cfi.apply_rope(np.ones((5, 2, 64), np.float32), np.ones((5, 1, 64), np.float32),
        ...                       np.array([0, 2, 5]), np.array([10, 0]))
        >>> q.shape
        (5, 2, 64)
    """
    return _pos_ids_call(q, k, _ragged_positions(q, indptr, offsets), rotary_dim, interleave, rope_theta,
                         _linear(rope_scale), False)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave: bool = False, rope_scale: float = 1,
                       rope_theta: float = 1e4) -> None:
    """FlashInfer's ``apply_rope_inplace``: as :func:`apply_rope`, into ``q`` and ``k``.

    Example:
        >>> import numpy as np, cupy_rope.flashinfer as cfi
        >>> q = np.ones((3, 1, 64), np.float32); k = np.ones((3, 1, 64), np.float32)
        >>> cfi.apply_rope_inplace(q, k, np.array([0, 3]), np.array([0])); bool(q[0, 0, 0] == 1.0)
        True
    """
    _pos_ids_call(q, k, _ragged_positions(q, indptr, offsets), rotary_dim, interleave, rope_theta,
                  _linear(rope_scale), True)


def _linear(rope_scale):
    f = _plan.check_number("rope_scale", rope_scale, 0.0)
    return None if f == 1.0 else {"rope_type": "linear", "factor": f}


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave: bool = False, rope_scale: float = 1,
                       rope_theta: float = 1e4):
    """FlashInfer's ``apply_rope_pos_ids``: ``(q_rope, k_rope)``, new tensors.

    ``q`` ``[nnz, num_qo_heads, head_dim]``, ``k`` ``[nnz, num_kv_heads, head_dim]``, ``pos_ids``
    ``[nnz]``; the first ``rotary_dim`` channels (default all) rotate with frequencies
    ``rope_theta ** (-2i / rotary_dim) / rope_scale``; ``interleave``: GPT-J pairs.

    Example:
        >>> import numpy as np, cupy_rope.flashinfer as cfi
        >>> q, k = cfi.apply_rope_pos_ids(np.ones((3, 4, 64), np.float32), np.ones((3, 1, 64), np.float32),
        ...                               np.arange(3))
        >>> q.shape
        (3, 4, 64)
    """
    return _pos_ids_call(q, k, pos_ids, rotary_dim, interleave, rope_theta, _linear(rope_scale), False)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave: bool = False, rope_scale: float = 1,
                               rope_theta: float = 1e4) -> None:
    """FlashInfer's ``apply_rope_pos_ids_inplace``: as :func:`apply_rope_pos_ids`, into ``q``
    and ``k``; returns None.

    Example:
        >>> import numpy as np, cupy_rope.flashinfer as cfi
        >>> q = np.ones((2, 1, 64), np.float32); k = np.ones((2, 1, 64), np.float32)
        >>> cfi.apply_rope_pos_ids_inplace(q, k, np.arange(2)); bool(q[1, 0, 0] != 1.0)
        True
    """
    _pos_ids_call(q, k, pos_ids, rotary_dim, interleave, rope_theta, _linear(rope_scale), True)


def _llama31(rope_scale, low_freq_factor, high_freq_factor, old_context_len):
    lo = _plan.check_number("low_freq_factor", low_freq_factor, 0.0)
    hi = _plan.check_number("high_freq_factor", high_freq_factor, lo)
    return {"rope_type": "llama3", "factor": _plan.check_number("rope_scale", rope_scale, 0.0),
            "low_freq_factor": lo, "high_freq_factor": hi,
            "original_max_position_embeddings": _plan.check_number("old_context_len", old_context_len, 0.0)}


def apply_llama31_rope(q, k, indptr, offsets, rotary_dim=None, interleave: bool = False, rope_scale: float = 8,
                       rope_theta: float = 5e5, low_freq_factor: float = 1, high_freq_factor: float = 4,
                       old_context_len: int = 8192):
    """FlashInfer's ``apply_llama31_rope`` (ragged batch, Llama 3.1 scaling): ``(q_rope, k_rope)``.

    Example:
        >>> import numpy as np, cupy_rope.flashinfer as cfi
        >>> q, k = cfi.apply_llama31_rope(np.ones((4, 2, 64), np.float32), np.ones((4, 1, 64), np.float32),
        ...                               np.array([0, 4]), np.array([100]))
        >>> k.shape
        (4, 1, 64)
    """
    return _pos_ids_call(q, k, _ragged_positions(q, indptr, offsets), rotary_dim, interleave, rope_theta,
                         _llama31(rope_scale, low_freq_factor, high_freq_factor, old_context_len), False)


def apply_llama31_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave: bool = False,
                               rope_scale: float = 8, rope_theta: float = 5e5, low_freq_factor: float = 1,
                               high_freq_factor: float = 4, old_context_len: int = 8192) -> None:
    """FlashInfer's ``apply_llama31_rope_inplace``: into ``q`` and ``k``; returns None.

    Example:
        >>> import numpy as np, cupy_rope.flashinfer as cfi
        >>> q = np.ones((2, 1, 64), np.float32); k = np.ones((2, 1, 64), np.float32)
        >>> cfi.apply_llama31_rope_inplace(q, k, np.array([0, 2]), np.array([5])); bool(q[0, 0, 0] != 1.0)
        True
    """
    _pos_ids_call(q, k, _ragged_positions(q, indptr, offsets), rotary_dim, interleave, rope_theta,
                  _llama31(rope_scale, low_freq_factor, high_freq_factor, old_context_len), True)


def apply_llama31_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave: bool = False, rope_scale: float = 8,
                               rope_theta: float = 5e5, low_freq_factor: float = 1, high_freq_factor: float = 4,
                               old_context_len: int = 8192):
    """FlashInfer's ``apply_llama31_rope_pos_ids``: Llama 3.1 frequency scaling
    (:func:`cupy_rope.rope_inv_freq` with ``rope_type="llama3"``); ``(q_rope, k_rope)``.

    Example:
        >>> import numpy as np, cupy_rope.flashinfer as cfi
        >>> q, k = cfi.apply_llama31_rope_pos_ids(np.ones((2, 4, 128), np.float32),
        ...                                       np.ones((2, 1, 128), np.float32), np.arange(2))
        >>> k.shape
        (2, 1, 128)
    """
    return _pos_ids_call(q, k, pos_ids, rotary_dim, interleave, rope_theta,
                         _llama31(rope_scale, low_freq_factor, high_freq_factor, old_context_len), False)


def apply_llama31_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave: bool = False,
                                       rope_scale: float = 8, rope_theta: float = 5e5, low_freq_factor: float = 1,
                                       high_freq_factor: float = 4, old_context_len: int = 8192) -> None:
    """FlashInfer's ``apply_llama31_rope_pos_ids_inplace``: into ``q`` and ``k``; returns None.

    Example:
        >>> import numpy as np, cupy_rope.flashinfer as cfi
        >>> q = np.ones((2, 1, 64), np.float32); k = np.ones((2, 1, 64), np.float32)
        >>> cfi.apply_llama31_rope_pos_ids_inplace(q, k, np.arange(2)); bool(k[1, 0, 0] != 1.0)
        True
    """
    _pos_ids_call(q, k, pos_ids, rotary_dim, interleave, rope_theta,
                  _llama31(rope_scale, low_freq_factor, high_freq_factor, old_context_len), True)

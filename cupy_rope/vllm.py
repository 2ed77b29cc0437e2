"""Drop-in for vLLM's RoPE custom op (``torch.ops._C.rotary_embedding``).

Example::

    import torch, cupy_rope, cupy_rope.vllm as crv
    cache = torch.from_numpy(cupy_rope.rope_cos_sin_cache(128, 8192)).cuda()   # [max_pos, rot]
    positions = torch.arange(64, device="cuda")
    query = torch.randn(64, 32 * 128, device="cuda", dtype=torch.bfloat16)
    key = torch.randn(64, 8 * 128, device="cuda", dtype=torch.bfloat16)
    crv.rotary_embedding(positions, query, key, 128, cache, True)   # in place
"""

from __future__ import annotations

from . import _dropins, _plan

__all__ = ["rotary_embedding"]


def rotary_embedding(positions, query, key, head_size: int, cos_sin_cache, is_neox: bool,
                     rope_dim_offset: int = 0, inverse: bool = False) -> None:
    """vLLM's ``rotary_embedding``: rotate ``query`` and ``key`` in place at ``positions``.

    Args:
        positions: int64/int32 ``[num_tokens]`` or ``[batch, seq_len]``.
        query: ``[tokens.., num_heads * head_size]`` or ``[tokens.., num_heads, head_size]``.
        key: the same for ``num_kv_heads``, or None (only ``query`` is rotated).
        head_size: the head dim.
        cos_sin_cache: ``[max_position, rot_dim]`` (cos in the first half, sin in the second),
            float32 or the query's dtype; ``rot_dim <= head_size`` (the rest passes through).
        is_neox: rotate-half (NeoX) pairs when True, interleaved (GPT-J) pairs when False.
        rope_dim_offset: first channel of the rotary slice (channels ``rope_dim_offset ..
            rope_dim_offset + rot_dim`` rotate; ``rot_dim + rope_dim_offset <= head_size``).
        inverse: rotate by minus the angle (undoes a rotation; the gradient).

    Returns None; ``query`` and ``key`` hold the results. Positions outside the cache leave their
    token unrotated (vLLM reads out of bounds there). torch tensors (CUDA or CPU), CuPy or NumPy.

    Example:
        >>> import numpy as np, cupy_rope, cupy_rope.vllm as crv
        >>> cache = cupy_rope.rope_cos_sin_cache(64, 32)
        >>> q = np.ones((3, 2 * 64), np.float32); k = np.ones((3, 64), np.float32)
        >>> crv.rotary_embedding(np.array([0, 1, 2]), q, k, 64, cache, True)
        >>> bool(q[0, 0] == 1.0), bool(q[1, 0] != 1.0)
        (True, True)
    """
    neox = _plan.check_bool("is_neox", is_neox)
    _dropins.rope_pos({"q": "query", "k": "key"}, positions, query, key, cos_sin_cache=cos_sin_cache,
                      head_size=_plan.check_int("head_size", head_size, lo=1), interleaved=not neox,
                      rope_dim_offset=rope_dim_offset, inverse=inverse, inplace=True)

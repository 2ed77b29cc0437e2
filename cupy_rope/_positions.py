"""Token positions (spec section 5): the one Python definition.

Written against an array module ``xp`` (NumPy, or ``jax.numpy`` for the jittable CPU path)
with no in-place updates. The CUDA definition is ``token_position`` in
``kernels_cu/rope_common.cuh``; the two must agree.
"""

from __future__ import annotations

import numpy as np

from ._plan import Positions


def cp_position(xp, j, L, cp_size: int, cp_rank: int):
    """Spec 5.1: local index ``j`` of a sequence of local length ``L`` -> global position."""
    if cp_size == 1:
        return j
    c = L // 2
    return xp.where(j < c, j + cp_rank * c, (2 * cp_size - 1 - cp_rank) * c + (j - c))


def token_positions(xp, pos: Positions, lead_shape: tuple, cu_seqlens=None, start_positions=None,
                    with_seq: bool = False, ids=None):
    """Positions of every token and whether the token belongs to a sequence.

    Returns ``(p, in_seq)`` of shape ``lead_shape`` ((s, b), (b, s) or (t,)), int64 / bool, and
    with ``with_seq`` also each token's sequence index (batch row or packed sequence).
    ``p`` is not yet checked against the table length (see :func:`table_mask`). With per-token
    positions (``pos.has_ids``) ``p`` is ``ids``.
    """
    i64 = np.int64 if xp is np else xp.asarray(0).dtype  # JAX: int64 only with x64 enabled
    if pos.has_ids:  # the positions API: each token's own position, any value
        p = xp.asarray(ids).astype(i64).reshape(lead_shape)
        return (p, xp.ones(lead_shape, bool)) + ((xp.zeros(lead_shape, i64),) if with_seq else ())
    if pos.layout == "thd":
        (t,) = lead_shape
        rows = xp.arange(t, dtype=i64)
        if pos.nseq == 0:
            none = (xp.zeros((t,), i64), xp.zeros((t,), bool))
            return none + (xp.zeros((t,), i64),) if with_seq else none
        cu = xp.asarray(cu_seqlens).astype(i64)
        starts = cu[:-1] // pos.cp_size
        ends = cu[1:] // pos.cp_size
        # Largest i with starts[i] <= t (the device's binary search, for sorted cu_seqlens).
        seq = xp.clip(xp.searchsorted(starts, rows, side="right") - 1, 0, pos.nseq - 1)
        start, end = starts[seq], ends[seq]
        in_seq = (rows >= start) & (rows < end)
        j, L = rows - start, end - start
    else:
        s, b = pos.seq_len, pos.nseq
        if pos.layout == "sbhd":
            j, seq = xp.arange(s, dtype=i64)[:, None], xp.arange(b, dtype=i64)[None, :]
        else:
            seq, j = xp.arange(b, dtype=i64)[:, None], xp.arange(s, dtype=i64)[None, :]
        j, seq = xp.broadcast_to(j, lead_shape), xp.broadcast_to(seq, lead_shape)
        L = s
        in_seq = xp.ones(lead_shape, bool)
    p = cp_position(xp, j, L, pos.cp_size, pos.cp_rank)
    if start_positions is not None:
        p = p + xp.asarray(start_positions).astype(i64)[seq]
    return (p, in_seq, seq) if with_seq else (p, in_seq)


def table_mask(xp, p, in_seq, rows: int):
    """Tokens that are rotated: in a sequence and 0 <= p < rows (spec 5.4)."""
    return in_seq & (p >= 0) & (p < rows)


def check_cu_seqlens(pos: Positions, t: int, cu_seqlens) -> None:
    """Spec 5.2: ``cu_seqlens`` (host NumPy values) starts at 0, does not decrease, ends within the
    ``t`` local rows, and (cp) has every length divisible by ``2 * cp_size``. Raises ``ValueError``
    naming the first offending entry. The NumPy backend always runs it (the values are on the host);
    on the GPU it is part of the debug check."""
    cu = np.asarray(cu_seqlens).astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cupy_rope: `cu_seqlens`: expected cu_seqlens[0] == 0, got {cu[0]}")
    bad = np.nonzero(np.diff(cu) < 0)[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError("cupy_rope: `cu_seqlens`: expected non-decreasing values, got "
                         f"cu_seqlens[{i}] = {cu[i]} > cu_seqlens[{i + 1}] = {cu[i + 1]}")
    if cu[-1] // pos.cp_size > t:
        raise ValueError(f"cupy_rope: `cu_seqlens`: expected cu_seqlens[-1] // cp_size <= t = {t} "
                         f"rows, got {cu[-1]} // {pos.cp_size} = {cu[-1] // pos.cp_size}")
    if pos.cp_size > 1:
        lens = np.diff(cu)
        bad = np.nonzero(lens % (2 * pos.cp_size))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"cupy_rope: `cu_seqlens`: expected every sequence length divisible by "
                             f"2 * cp_size = {2 * pos.cp_size}, got length {lens[i]} for sequence {i}")


def check_index_contents(pos: Positions, lead_shape: tuple, tables: dict, cu_seqlens=None,
                         start_positions=None) -> None:
    """The debug check of spec 5.4: index tensors (host NumPy arrays) against the tables
    (``{argument name: rows}``): valid ``cu_seqlens``, start positions >= 0, every token's
    position inside every table. Raises ``ValueError`` naming the argument and the first
    offending entry."""
    if pos.layout == "thd":
        check_cu_seqlens(pos, lead_shape[0], cu_seqlens)
    sp = None
    if start_positions is not None:
        sp = np.asarray(start_positions).astype(np.int64)[: pos.nseq]
        bad = np.nonzero(sp < 0)[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"cupy_rope: `start_positions`: expected values >= 0, got "
                             f"start_positions[{i}] = {sp[i]}")
    p, in_seq, seq = token_positions(np, pos, lead_shape, cu_seqlens, start_positions, with_seq=True)
    # a start position alone past the table also catches positions that wrapped around 2^63
    start = None if sp is None or not sp.size else sp[seq]
    for name, rows in tables.items():
        over = in_seq & ((p >= rows) | (p < 0))
        if start is not None:
            over |= in_seq & (start >= rows)
        if over.any():
            idx = tuple(int(i[0]) for i in np.nonzero(over))
            where = f"position {int(p[idx])}" if p[idx] >= 0 else "a position past 2^63"
            raise ValueError(f"cupy_rope: `{name}`: expected enough rows for the positions that "
                             f"`start_positions`/`cu_seqlens` give (token {idx} is at {where}), got "
                             f"{rows} rows")


def check_position_ids(ids, table_name: str, rows: int) -> None:
    """The positions API's debug check: every position (host NumPy values) inside the table."""
    p = np.asarray(ids).astype(np.int64)
    bad = np.nonzero((p < 0) | (p >= rows))
    if bad[0].size:
        idx = tuple(int(i[0]) for i in bad)
        raise ValueError(f"cupy_rope: `{table_name}`: expected a row for every position (0 <= position < "
                         f"{rows}), got position {int(p[idx])} at `positions`{list(idx)}")

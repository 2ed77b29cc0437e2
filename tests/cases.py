"""The spec's test matrix lives in cupy_rope.testing (shared with `python -m cupy_rope check`)."""
from cupy_rope.testing import (NP_DTYPES, Case, inputs, make_cu_seqlens, matrix,  # noqa: F401
                               rng_for, strided)


def use_lean(monkeypatch, on: bool = True) -> None:
    """The lean kernel (``ropel``) on every launch it can run (``on``: its head and sequence
    limits lifted, as the small test calls are below them), or on none."""
    from cupy_rope import _worksplit

    monkeypatch.setattr(_worksplit, "_LEAN", on)
    monkeypatch.setattr(_worksplit, "_LEAN_MIN_HEADS", 1)
    monkeypatch.setattr(_worksplit, "_LEAN_MAX_SEQS", 2**62)


def part_threads(block: int, params: bytes) -> int:
    """Threads of the larger part of a rope launch (its parameter blocks' ``blocks``, each tensor's
    share of the grid, times ``block``): what the one-row kernels' 32-bit thread index must hold."""
    import struct

    from cupy_rope import _abi

    vals = struct.unpack(f"<{len(params) // 8}q", params)
    n, i = len(_abi.ROPE_FIELDS), _abi.ROPE_FIELDS.index("blocks")
    return block * max(vals[i::n][:2])


def split_in_chunks(monkeypatch, chunks: int) -> None:
    """Make the work split give every token ``chunks`` chunks (at most its rows): threads that step
    over every ``chunks``-th row, between the split's two ends (one row per thread, one chunk)."""
    from cupy_rope import _worksplit

    split = _worksplit.split_work

    def fixed(n_tok, n_sets, rows, *args, **kw):
        n_rot, n_units, tail_w, c, threads = split(n_tok, n_sets, rows, *args, **kw)
        n = min(rows, chunks)
        return n_rot, n_units, tail_w, n, threads // c * n

    monkeypatch.setattr(_worksplit, "split_work", fixed)

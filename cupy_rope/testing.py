"""Independent float64 reference (tests and `python -m cupy_rope check`): shares no code with
the library's backends.

Positions are built by literally cutting each global sequence into 2*cp_size chunks and
concatenating the rank's two chunks (spec 5.1), not by the closed formula; the rotation is
written per pair in float64 from the spec's equations, one token at a time.
"""

import itertools
from dataclasses import dataclass

import numpy as np


def dual_chunk_positions(L_local, cp_size, cp_rank):
    """Global positions (0-based within the sequence) of the local rows of one sequence."""
    if cp_size == 1:
        return np.arange(L_local)
    Lg = L_local * cp_size
    chunks = np.array_split(np.arange(Lg), 2 * cp_size)
    return np.concatenate([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def token_table(layout, lead_shape, cu_seqlens=None, start_positions=None, cp_size=1, cp_rank=0):
    """Dict token index tuple -> position (tokens in no sequence are absent)."""
    out = {}
    sp = None if start_positions is None else np.asarray(start_positions).astype(np.int64)
    if layout == "thd":
        cu = np.asarray(cu_seqlens).astype(np.int64)
        for i in range(len(cu) - 1):
            a, b = cu[i] // cp_size, cu[i + 1] // cp_size
            local = dual_chunk_positions(b - a, cp_size, cp_rank) if b > a else []
            for j, g in enumerate(local):
                out[(a + j,)] = int(g) + (0 if sp is None else int(sp[i]))
        return out
    if layout == "sbhd":
        s, b = lead_shape
    else:
        b, s = lead_shape
    local = dual_chunk_positions(s, cp_size, cp_rank)
    for si in range(s):
        for bi in range(b):
            key = (si, bi) if layout == "sbhd" else (bi, si)
            out[key] = int(local[si]) + (0 if sp is None else int(sp[bi]))
    return out


def pairs(d2, interleaved):
    if interleaved:
        return [(2 * k, 2 * k + 1) for k in range(d2 // 2)]
    return [(i, i + d2 // 2) for i in range(d2 // 2)]


def rope_ref(x, freqs, layout="sbhd", interleaved=False, cu_seqlens=None, start_positions=None,
             cp_size=1, cp_rank=0, backward=False):
    """float64 result of spec section 3 (forward) or 4 (backward); x any dtype."""
    x64 = np.asarray(x).astype(np.float64)
    f = np.asarray(freqs, np.float32).reshape(freqs.shape[0], freqs.shape[-1]).astype(np.float64)
    S, d2 = f.shape
    y = x64.copy()
    lead = x64.shape[:-2]
    table = token_table(layout, lead, cu_seqlens, start_positions, cp_size, cp_rank)
    for tok, p in table.items():
        if not 0 <= p < S:
            continue
        th = f[p]
        xt = x64[tok]  # [h, d]
        yt = y[tok]
        for a, b in pairs(d2, interleaved):
            if backward:
                yt[:, a] = xt[:, a] * np.cos(th[a]) + xt[:, b] * np.sin(th[b])
                yt[:, b] = xt[:, b] * np.cos(th[b]) - xt[:, a] * np.sin(th[a])
            else:
                yt[:, a] = xt[:, a] * np.cos(th[a]) - xt[:, b] * np.sin(th[a])
                yt[:, b] = xt[:, b] * np.cos(th[b]) + xt[:, a] * np.sin(th[b])
    return y


def pair_cos_sin_ref(kind, table, p, d2, interleaved):
    """float64 (cos_first, sin_first, cos_second, sin_second) per pair ``pairs(d2, interleaved)``
    for a token at position ``p`` (inside the table), straight from the table's definition:
    ``"angles"``: cos/sin of each member's own float32 angle; ``"cos_sin"``: the cache's stored
    values (cos of pair i in column i, sin in column d2/2 + i); ``"inv_freq"``: cos/sin of the
    float64 angle p * inv_freq[i]."""
    out = []
    for i, (a, b) in enumerate(pairs(d2, interleaved)):
        if kind == "angles":
            row = np.asarray(table).reshape(np.asarray(table).shape[0], d2)[p].astype(np.float32).astype(np.float64)
            out.append((np.cos(row[a]), np.sin(row[a]), np.cos(row[b]), np.sin(row[b])))
        elif kind == "cos_sin":
            row = np.asarray(table)[p].astype(np.float64)
            out.append((row[i], row[d2 // 2 + i]) * 2)
        else:
            ang = float(p) * float(np.asarray(table)[i])
            out.append((np.cos(ang), np.sin(ang)) * 2)
    return out


def rope_pos_ref(x, positions, kind, table, rows, interleaved=False, offset=0, inverse=False):
    """float64 result of the positions API for ``x`` ``[tokens.., h, d]`` (any dtype): each token
    rotated by its own position (channels offset .. offset + d2), tokens at positions outside
    [0, rows) copied; ``inverse``: rotate by minus the angle."""
    x64 = np.asarray(x).astype(np.float64)
    y = x64.copy()
    pos = np.asarray(positions).astype(np.int64)
    tbl = np.asarray(table)
    d2 = 2 * tbl.shape[0] if kind == "inv_freq" else tbl.shape[-1]
    for tok in np.ndindex(pos.shape):
        p = int(pos[tok])
        if not 0 <= p < rows:
            continue
        xt, yt = x64[tok], y[tok]
        for (a, b), (ca, sa, cb, sb) in zip(pairs(d2, interleaved), pair_cos_sin_ref(kind, tbl, p, d2, interleaved)):
            fa, fb = offset + a, offset + b
            if inverse:
                yt[:, fa] = xt[:, fa] * ca + xt[:, fb] * sb
                yt[:, fb] = xt[:, fb] * cb - xt[:, fa] * sa
            else:
                yt[:, fa] = xt[:, fa] * ca - xt[:, fb] * sa
                yt[:, fb] = xt[:, fb] * cb + xt[:, fa] * sb
    return y


def term_scale(x, freqs_shape_d2):
    """Magnitude scale of the terms that make each output element (for tolerances)."""
    x64 = np.abs(np.asarray(x).astype(np.float64))
    d2 = freqs_shape_d2
    sc = x64.copy()
    if d2:
        m = x64[..., :d2].max(axis=-1, keepdims=True)
        sc[..., :d2] = x64[..., :d2] + m
    return sc


MANT = {"float32": 23, "float16": 10, "bfloat16": 7}


def assert_close_to_ref(y, ref, x, d2, dtype_name, what="", scale=None):
    """Each element within 1 ulp of the dtype of the reference plus float32 rounding noise.

    ``scale``: magnitude of the terms of each element (default: from ``x`` and ``d2``)."""
    y64 = np.asarray(y).astype(np.float64)
    assert y64.shape == ref.shape, (y64.shape, ref.shape)
    assert np.isfinite(y64).all(), f"{what}: non-finite output (unwritten element?)"
    mag = np.maximum(np.abs(ref), 2.0 ** -14)
    ulp = 2.0 ** (np.floor(np.log2(mag)) - MANT[dtype_name])
    tol = ulp + 16 * 2.0 ** -23 * (term_scale(x, d2) if scale is None else scale)
    err = np.abs(y64 - ref)
    bad = err > tol
    if bad.any():
        i = tuple(int(v[0]) for v in np.nonzero(bad))
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements off; first at {i}: "
                             f"got {y64[i]!r}, want {ref[i]!r} (tol {tol[i]:.3g})")


def qkv_split_ref(qkv, n, d):
    lead = qkv.shape[:-2]
    g = qkv.shape[-2]
    q = qkv[..., : n * d].reshape(lead + (g * n, d))
    k = qkv[..., n * d:(n + 1) * d]
    v = qkv[..., (n + 1) * d:]
    return q, k, v


# ----------------------------------------------------------------------------- the spec's test matrix


try:
    import ml_dtypes

    NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
except ImportError:  # pragma: no cover
    NP_DTYPES = {"float32": np.float32, "float16": np.float16}

LAYOUTS = ("sbhd", "bshd", "thd")
DTYPES = ("float32", "float16", "bfloat16")
CPS = ((1, 0), (2, 1), (4, 2), (4, 0))
SPS = (None, "int32", "int64")
STRIDES = ("contiguous", "permuted", "channel_stride", "zero_stride", "offset")
HEAD_DIMS = ((64, 64), (64, 32), (80, 80), (128, 64), (32, 16), (48, 8), (16, 0))


@dataclass
class Case:
    layout: str
    interleaved: bool
    dtype: str
    cp: tuple
    sp: object
    stride: str
    d: int
    d2: int
    seed: int

    def id(self):
        return (f"{self.layout}-{'il' if self.interleaved else 'nh'}-{self.dtype}-cp{self.cp[0]}r{self.cp[1]}"
                f"-sp{self.sp}-{self.stride}-d{self.d}x{self.d2}")


def matrix(limit=None):
    """Layouts x interleaved x dtypes x cp x start positions, cycling strides and head dims."""
    out = []
    for i, (layout, il, dt, cp, sp) in enumerate(itertools.product(LAYOUTS, (False, True), DTYPES, CPS, SPS)):
        d, d2 = HEAD_DIMS[i % len(HEAD_DIMS)]
        out.append(Case(layout, il, dt, cp, sp, STRIDES[i % len(STRIDES)], d, d2, seed=i))
    return out[:limit] if limit else out


def rng_for(case):
    return np.random.default_rng(1000 + case.seed)


def make_cu_seqlens(rng, cp_size, nseq=5, max_len=12, pad_rows=3):
    """Global cu_seqlens with an empty sequence; lengths divisible by 2*cp_size. Returns (cu, t)."""
    unit = 2 * cp_size
    lens = rng.integers(0, max_len // unit + 1, size=nseq) * unit
    lens[1] = 0  # an empty sequence
    lens[0] = max(lens[0], unit)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    t = int(cu[-1] // cp_size) + pad_rows  # trailing padding rows (copied through)
    return cu, t


def strided(base_shape, dtype, rng, mode):
    """An array of logical shape base_shape with the requested stride pattern (NumPy)."""
    npdt = NP_DTYPES[dtype]
    shape = tuple(base_shape)
    if mode == "contiguous":
        return rng.uniform(-2, 2, shape).astype(npdt)
    if mode == "permuted":  # swap the first two dims in memory
        if len(shape) == 4:
            a = rng.uniform(-2, 2, (shape[1], shape[0]) + shape[2:]).astype(npdt)
            return a.transpose(1, 0, 2, 3)
        a = rng.uniform(-2, 2, (shape[1], shape[0], shape[2])).astype(npdt)
        return a.transpose(1, 0, 2)
    if mode == "channel_stride":  # d stride = h (heads and channels swapped in memory)
        a = rng.uniform(-2, 2, shape[:-2] + (shape[-1], shape[-2])).astype(npdt)
        return np.swapaxes(a, -1, -2)
    if mode == "zero_stride":  # expanded, like the gradient of y.sum()
        a = rng.uniform(-2, 2, (1,) * (len(shape) - 2) + shape[-2:]).astype(npdt)
        return np.broadcast_to(a, shape)
    if mode == "offset":  # a view with a storage offset and padded rows
        a = rng.uniform(-2, 2, shape[:-1] + (shape[-1] + 8,)).astype(npdt)
        return a[..., 3: 3 + shape[-1]]
    raise ValueError(mode)


def inputs(case, heads=3, s=8, b=3):
    """(x, freqs, kwargs) for a case, NumPy arrays."""
    rng = rng_for(case)
    cp_size, cp_rank = case.cp
    kw = dict(layout=case.layout, interleaved=case.interleaved, cp_size=cp_size, cp_rank=cp_rank)
    if case.layout == "thd":
        cu, t = make_cu_seqlens(rng, cp_size)
        shape = (t, heads, case.d)
        kw["cu_seqlens"] = cu.astype(np.int32 if case.seed % 2 else np.int64)
        nseq = len(cu) - 1
        max_local = int(np.diff(cu).max()) // cp_size if nseq else 0
        rows_needed = max_local * cp_size
    else:
        s = s if cp_size == 1 else 2 * cp_size
        shape = (s, b, heads, case.d) if case.layout == "sbhd" else (b, s, heads, case.d)
        nseq = b
        rows_needed = s * cp_size
    if case.sp is not None:
        sp = rng.integers(0, 6, size=nseq + 1).astype(case.sp)
        kw["start_positions"] = sp
        rows_needed += 6
    S = rows_needed
    if case.sp is not None and (case.seed // 3) % 2 == 0:
        S -= 3  # start positions push some tokens past the table: copied through (spec 5.4)
    freqs = rng.uniform(-20, 20, (S, 1, 1, case.d2)).astype(np.float32)
    if case.seed % 4 == 1:  # a standard-looking table (pairs share angles)
        half = rng.uniform(-20, 20, (S, 1, 1, case.d2 // 2)).astype(np.float32)
        freqs = (np.repeat(half, 2, axis=-1) if case.interleaved else np.concatenate([half, half], -1))
    if case.seed % 5 == 2:
        freqs = freqs.reshape(S, case.d2)
    x = strided(shape, case.dtype, rng, case.stride)
    return x, freqs, kw


# ----------------------------------------------------------------------------- context-parallel sharding
def cp_chunk_index(length: int, cp_size: int, cp_rank: int):
    """Indices (into a global sequence of ``length``) of the rows rank ``cp_rank`` holds:
    chunk ``cp_rank`` then chunk ``2*cp_size-1-cp_rank`` of ``2*cp_size`` equal chunks."""
    if length % (2 * cp_size):
        raise ValueError(f"sequence length {length} is not divisible by 2 * cp_size = {2 * cp_size}")
    c = length // (2 * cp_size)
    a, b = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return np.concatenate([np.arange(a, a + c), np.arange(b, b + c)])


def cp_thd_index(cu_seqlens, cp_size: int, cp_rank: int):
    """Global row indices of rank ``cp_rank``'s packed (thd) shard, in local row order."""
    cu = np.asarray(cu_seqlens).astype(np.int64)
    return np.concatenate([cu[i] + cp_chunk_index(int(cu[i + 1] - cu[i]), cp_size, cp_rank)
                           for i in range(len(cu) - 1)] + [np.zeros(0, np.int64)])


def cp_shard_index(layout: str, global_len: int, cp_size: int, cp_rank: int, cu_seqlens=None):
    """Indices along the sequence (sbhd: axis 0, bshd: axis 1) or token (thd: axis 0) axis."""
    if layout == "thd":
        return cp_thd_index(cu_seqlens, cp_size, cp_rank)
    return cp_chunk_index(global_len, cp_size, cp_rank)

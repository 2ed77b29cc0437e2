"""The spec's test matrix (shared by the CPU and GPU tests): fresh random inputs each time."""

import itertools
from dataclasses import dataclass

import numpy as np

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
    if case.sp is not None and case.seed % 3 == 0:
        S -= 3  # start positions push some tokens past the table: copied through (spec 5.4)
    freqs = rng.uniform(-20, 20, (S, 1, 1, case.d2)).astype(np.float32)
    if case.seed % 4 == 1:  # a standard-looking table (pairs share angles)
        half = rng.uniform(-20, 20, (S, 1, 1, case.d2 // 2)).astype(np.float32)
        freqs = (np.repeat(half, 2, axis=-1) if case.interleaved else np.concatenate([half, half], -1))
    if case.seed % 5 == 2:
        freqs = freqs.reshape(S, case.d2)
    x = strided(shape, case.dtype, rng, case.stride)
    return x, freqs, kw

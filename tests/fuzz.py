"""Randomised fuzz of the seven entry points (issue: safe on every input).

Each case is drawn from one seed: an entry point (``apply_rope``, ``apply_rope_backward``,
``apply_rope_qk``, ``apply_rope_qk_backward``, ``apply_qkv_rope``, ``apply_qkv_rope_backward``;
q and k separate or views of one fused ``[.., 3, h, d]`` buffer, in place or not; and the
positions API ``apply_rope_pos``: per-token positions with garbage values, a cos/sin cache, angle
table or inverse frequencies, flattened heads, ``k=None``, a rotary slice at an offset, inverse,
in place), valid extremes (sizes 0 and 1, odd and large
head dims, h = 257, cp_size up to 8, thd with empty sequences and padding rows, int32/int64
indices, tables exactly as long as needed), every array argument laid out in memory at random
(permuted, sliced with steps out of a poisoned buffer, reversed, expanded with stride 0, offset),
index contents out of range or garbage, and with some probability one invalid argument. Checks:

* valid calls: results against the independent float64 reference, pass-through elements (tail
  channels, tokens outside every sequence or the table, ``v``) bit-exact, inputs untouched (their
  whole buffers, bitwise), memory of ``out``'s buffer outside the view untouched;
* invalid calls: ``ValueError``/``TypeError`` whose message names the argument (in backticks),
  nothing written, inputs untouched;
* index contents that are not a valid ``cu_seqlens`` (decreasing, past ``t``, lengths not
  divisible by ``2*cp_size``): the CPU backends raise naming ``cu_seqlens``; the GPU runs them
  (no check without debug mode) and must stay inside its arrays (compute-sanitizer memcheck).

With torch tensors, half of the seeds call the torch shim's function of the same name
(``cupy_rope.torch``: its own checks, its autograd kernels and, on CUDA, its C++ launch path)
instead of the public API (:func:`via`; the case description shows ``via``).

On the CUDA backends every call that ran runs a second time on fresh arrays of the same layout
and values: a launch-cache hit (the C++ CuPy path, the torch shim's C++ path), under the same
checks and, under compute-sanitizer, the same memory checking.

Backends: ``numpy`` and ``torch-cpu`` (the NumPy backend through the public API), ``host`` (the
real ``kernels_cu`` source built with g++, through the real launch plan; valid calls only),
``cupy`` and ``torch-cuda`` (the CUDA kernels). Replay one case::

    python tests/fuzz.py --backend numpy --seed 1234 -v
    python tests/fuzz.py --backend cupy --seeds 0:2000 --no-pool     # e.g. under compute-sanitizer
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cupy_rope  # noqa: E402
from cupy_rope.testing import (NP_DTYPES, assert_close_to_ref, qkv_split_ref, rope_pos_ref, rope_ref,  # noqa: E402
                               token_table)

BACKENDS = ("numpy", "torch-cpu", "host", "cupy", "torch-cuda", "jax")
CPU_BACKENDS = ("numpy", "torch-cpu")  # the NumPy backend: index contents are checked always
QK_NAMES = {"qk": ("q", "k"), "qk_bwd": ("dq", "dk")}  # the q+k entry points' array names
POS_TABLES = ("cos_sin_cache", "freqs", "inv_freq")  # the positions API's table keywords
INT_POISON = {"int32": 0x5A5A5A5A, "int64": 0x5A5A5A5A5A5A5A5A}


# ----------------------------------------------------------------------------- memory layouts
@dataclass
class Laid:
    """A logical array placed in a larger poisoned buffer: ``base`` (1-D NumPy) and the view
    (``offset``, ``shape``, ``strides`` in elements; strides may be negative or 0)."""

    base: np.ndarray
    offset: int
    shape: tuple
    strides: tuple
    mode: str

    def view(self, base=None):
        b = self.base if base is None else base
        isz = b.itemsize
        return np.lib.stride_tricks.as_strided(b[self.offset:], self.shape, tuple(s * isz for s in self.strides),
                                               writeable=True)

    def covered(self) -> np.ndarray:
        """Mask of the buffer's elements the view covers."""
        m = np.zeros(self.base.shape, bool)
        if 0 in self.shape:
            return m
        idx = np.full(self.shape, self.offset, np.int64)
        for ax, (n, s) in enumerate(zip(self.shape, self.strides)):
            sh = [1] * len(self.shape)
            sh[ax] = n
            idx = idx + (np.arange(n) * s).reshape(sh)
        m[idx.ravel()] = True
        return m


MODES = ("contiguous", "permuted", "stepped", "reversed", "expanded", "offset")


def lay_out(vals: np.ndarray, rng, mode: str, poison) -> Laid:
    """Place ``vals`` in memory in the given mode; ``expanded`` makes ``vals`` constant along an
    axis first (returned view is then stride 0 there, the logical values change accordingly)."""
    shape, nd = vals.shape, vals.ndim
    steps, order, neg, zero = [1] * nd, list(range(nd))[::-1], set(), set()
    front = 0
    if mode == "permuted" and nd > 1:
        order = list(rng.permutation(nd))
    elif mode == "stepped":
        steps = [int(rng.integers(1, 4)) for _ in range(nd)]
        front = int(rng.integers(0, 4))
    elif mode == "reversed" and nd:
        neg.add(int(rng.integers(0, nd)))
    elif mode == "expanded":
        cands = [a for a in range(nd) if shape[a] > 1]
        if cands:
            zero.add(int(rng.choice(cands)))
    elif mode == "offset":
        front = int(rng.integers(1, 8))
        steps[-1:] = [1]
    strides = [0] * nd
    acc = 1
    for ax in order:  # innermost first
        if ax in zero:
            continue
        strides[ax] = acc * steps[ax]
        acc = strides[ax] * max(shape[ax], 1) + (int(rng.integers(0, 3)) if mode == "offset" else 0)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides) if n > 0)
    offset = front + sum((shape[a] - 1) * strides[a] for a in neg if shape[a] > 0)
    for a in neg:
        strides[a] = -strides[a]
    base = np.full(front + span + int(rng.integers(0, 4)), poison, vals.dtype)
    laid = Laid(base, offset, shape, tuple(strides), mode)
    v = laid.view()
    if zero:
        a = next(iter(zero))
        vals = np.broadcast_to(np.take(vals, [0], axis=a), shape)
    if 0 not in shape:
        v[...] = vals
    return laid


def float_poison(dtype):
    return NP_DTYPES[dtype](np.nan)


# ----------------------------------------------------------------------------- backends
def _torch():
    import torch

    return torch


def backend_buffer(base: np.ndarray, backend: str):
    """A copy of the NumPy buffer ``base`` in the backend (NumPy/host: the buffer itself; JAX:
    the NumPy buffer, each array a dense JAX copy of its view, :func:`to_backend`)."""
    if backend in ("numpy", "host", "jax"):
        return base
    if backend.startswith("torch"):
        torch = _torch()
        if base.dtype.name == "bfloat16":
            t = torch.from_numpy(base.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(base.copy())
        return t.cuda() if backend == "torch-cuda" else t
    import cupy

    return cupy.asarray(base)


def to_backend(laid: Laid, buf, backend: str):
    """The view ``laid`` describes, over the backend buffer ``buf``."""
    if backend in ("numpy", "host"):
        return laid.view(buf)
    if backend == "jax":  # JAX arrays are dense and immutable: a copy of the view
        import jax.numpy as jnp

        return jnp.asarray(laid.view(buf))
    if backend.startswith("torch"):
        return _torch().as_strided(buf, laid.shape, laid.strides, laid.offset)
    import cupy

    isz = laid.base.itemsize
    return cupy.lib.stride_tricks.as_strided(buf[laid.offset:], laid.shape, tuple(s * isz for s in laid.strides))


def to_numpy(a):
    """Any backend's array (or buffer) as NumPy."""
    if a is None or isinstance(a, np.ndarray):
        return a
    mod = type(a).__module__.split(".")[0]
    if mod == "torch":
        torch = _torch()
        t = a.detach().cpu()
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if mod == "cupy":
        return a.get()
    return np.asarray(a)


def bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.size else a.reshape(-1).view(np.uint8)


# ----------------------------------------------------------------------------- cases
@dataclass
class Case:
    seed: int
    entry: str
    layout: str
    dtype: str
    interleaved: bool
    cp_size: int
    cp_rank: int
    kw: dict = field(default_factory=dict)  # scalar keywords passed through
    arrays: dict = field(default_factory=dict)  # name -> Laid (inputs, out)
    lists: dict = field(default_factory=dict)  # name -> non-array value (invalid calls)
    expect_error: str | None = None  # argument name the error must carry
    garbage_cu: bool = False  # cu_seqlens contents invalid (CPU backends: error)
    out_is_input: bool = False
    meta: dict = field(default_factory=dict)

    def describe(self):
        arr = {k: (v.mode, v.shape, v.strides, str(v.base.dtype)) for k, v in self.arrays.items()}
        return (f"seed={self.seed} entry={self.entry} layout={self.layout} dtype={self.dtype} "
                f"interleaved={self.interleaved} cp=({self.cp_size},{self.cp_rank}) kw={self.kw} "
                f"arrays={arr} lists={self.lists} expect_error={self.expect_error} garbage_cu={self.garbage_cu} "
                f"out_is_input={self.out_is_input} "
                f"meta={self.meta}")


HEAD_DIMS = (2, 4, 6, 8, 10, 14, 16, 18, 24, 32, 34, 40, 48, 62, 64, 66, 80, 96, 128, 130, 256)


def _pick_mode(rng, backend):
    m = str(rng.choice(MODES, p=[0.3, 0.15, 0.2, 0.1, 0.1, 0.15]))
    if m == "reversed" and backend.startswith("torch"):
        m = "stepped"  # torch has no negative strides
    return m


def _d_d2(rng):
    d = int(rng.choice(HEAD_DIMS))
    if rng.random() < 0.15:
        d += 1  # odd head dims
    r = rng.random()
    if r < 0.45:
        d2 = d - d % 2
    elif r < 0.55:
        d2 = 0
    else:
        d2 = 2 * int(rng.integers(0, d // 2 + 1))
    return d, d2


def _tokens(rng, layout, cp_size):
    """(lead shape, nseq, local length per seq, cu_seqlens (global) or None, rows needed)."""
    unit = 2 * cp_size
    if layout == "thd":
        nseq = int(rng.choice([0, 1, 2, 3, 5]))
        lens = rng.integers(0, 4, nseq) * unit
        if nseq and rng.random() < 0.3:
            lens[int(rng.integers(0, nseq))] = 0  # an empty sequence
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        pad = int(rng.integers(0, 4))
        t = int(cu[-1] // cp_size) + pad
        need = int(lens.max()) if nseq else 0
        return (t,), nseq, cu, need
    s = int(rng.choice([0, 1, 2, 3, 4, 6, 8])) if cp_size == 1 else 2 * int(rng.integers(0, 3))
    b = int(rng.choice([0, 1, 2, 3]))
    lead = (s, b) if layout == "sbhd" else (b, s)
    return lead, b, None, s * cp_size


def _table(rng, rows, d2, interleaved, backend, name, case):
    kind = rng.random()
    if kind < 0.4 and d2:  # standard-looking: both angles of every pair equal
        half = rng.uniform(-30, 30, (rows, d2 // 2)).astype(np.float32)
        vals = np.repeat(half, 2, axis=-1) if interleaved else np.concatenate([half, half], -1)
    else:
        scale = 3000.0 if rng.random() < 0.1 else 30.0  # large angles: accurate sincosf
        vals = rng.uniform(-scale, scale, (rows, d2)).astype(np.float32)
    if rng.random() < 0.5:
        vals = vals.reshape(rows, 1, 1, d2)
    mode = _pick_mode(rng, backend)
    if mode == "expanded":
        mode = "stepped"
    case.arrays[name] = lay_out(vals, rng, mode, np.float32(np.nan))


def _index(rng, vals, dtype, backend, name, case, two_d=False):
    vals = np.asarray(vals).astype(dtype)
    mode = _pick_mode(rng, backend)
    if mode == "expanded" and not (vals.size and (vals == vals[0]).all()):
        mode = "reversed" if not backend.startswith("torch") else "stepped"
    if two_d and vals.ndim == 1:  # an int64 column of a 2-D array
        wide = np.full((vals.shape[0], 3), INT_POISON[dtype], dtype)
        col = int(rng.integers(0, 3))
        wide[:, col] = vals
        laid = lay_out(wide, rng, "contiguous", INT_POISON[dtype])
        laid = Laid(laid.base, laid.offset + col, (vals.shape[0],), (laid.strides[0],), "column")
        case.arrays[name] = laid
        return
    case.arrays[name] = lay_out(vals, rng, mode, INT_POISON[dtype])


def draw(seed: int, backend: str) -> Case:
    rng = np.random.default_rng(seed)
    entry = str(rng.choice(["rope", "rope_bwd", "qk", "qk_bwd", "qkv", "qkv_bwd", "pos"]))
    if entry == "pos":
        return _draw_pos(seed, rng, backend)
    layout = str(rng.choice(["sbhd", "bshd", "thd"]))
    dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
    interleaved = bool(rng.random() < 0.5)
    cp_size = int(rng.choice([1, 1, 1, 2, 3, 4, 8]))
    cp_rank = int(rng.integers(0, cp_size))
    case = Case(seed, entry, layout, dtype, interleaved, cp_size, cp_rank)
    lead, nseq, cu, need = _tokens(rng, layout, cp_size)
    d, d2 = _d_d2(rng)
    qkv = entry.startswith("qkv")
    if qkv:
        g, n = int(rng.choice([0, 1, 1, 2, 3])), int(rng.choice([1, 2, 4]))
        h = None
        if d2 == 0 and rng.random() < 0.5:
            d2 = d - d % 2
    else:
        h = int(rng.choice([0, 1, 2, 3, 5, 8, 257], p=[0.05, 0.2, 0.2, 0.2, 0.15, 0.1, 0.1]))
        if h == 257:
            d = int(rng.choice([2, 4, 8, 9]))
            d2 = d - d % 2
    if h == 257 or (d >= 128 and rng.random() < 0.5):  # a big row: few tokens
        if layout != "thd":
            lead = tuple(min(v, 2) for v in lead)
            nseq = lead[1 if layout == "sbhd" else 0]
            need = lead[0 if layout == "sbhd" else 1] * cp_size
        elif lead[0] > 12:
            lead, nseq, cu, need = (3,), 1, np.array([0, 2 * cp_size], np.int64), 2
    case.meta.update(d=d, d2=d2, lead=lead, nseq=nseq)
    # start positions: none, small, or garbage (out of the table either way: copied)
    sp_vals = None
    if rng.random() < 0.5:
        sp_dtype = str(rng.choice(["int32", "int64"]))
        r = rng.random()
        if r < 0.7:
            sp_vals = rng.integers(0, 6, nseq + int(rng.integers(0, 3)))
        elif r < 0.85:
            sp_vals = rng.integers(-8, 8, nseq + 1)  # negative offsets: still positions
        else:
            hi = 2**31 - 1 if sp_dtype == "int32" else 2**63 - 1
            sp_vals = rng.integers(hi - 10, hi, nseq + 1, dtype=np.int64, endpoint=True)
        if sp_vals.size and rng.random() < 0.15:
            sp_vals = np.full_like(sp_vals, sp_vals[0])  # lets "expanded" (stride 0) happen
        _index(rng, sp_vals, sp_dtype, backend, "start_positions", case, two_d=rng.random() < 0.15)
        case.meta["sp"] = sp_vals.tolist()
    rows = need + (0 if sp_vals is None else max(0, int(np.clip(sp_vals, 0, 6).max(initial=0))))
    r = rng.random()
    if r < 0.3:
        rows = need  # exactly as long as the positions without offsets need
    elif r < 0.6:
        rows += int(rng.integers(0, 5))
    elif layout == "thd":
        rows = int(rng.integers(0, max(need, 1) + 1))  # thd: tokens past the table are copied
    if cu is not None:
        cu_dtype = str(rng.choice(["int32", "int64"]))
        cu_vals = cu.copy()
        if rng.random() < 0.12 and cu_vals.size >= 2:
            case.garbage_cu = True
            how = rng.integers(0, 4)
            if how == 0 and cu_vals.size >= 3:
                cu_vals[1], cu_vals[2] = cu_vals[2] + 5, cu_vals[1]
            elif how == 1:
                cu_vals[-1] = cu_vals[-1] + (lead[0] + 3) * cp_size
            elif how == 2 and cp_size > 1:
                cu_vals[-1] += 1
            else:
                cu_vals[0] = 7 if rng.random() < 0.5 else -(2**30)
        _index(rng, cu_vals, cu_dtype, backend, "cu_seqlens", case, two_d=rng.random() < 0.15)
        case.meta["cu"] = cu_vals.tolist()
    tables = ("q_freqs", "k_freqs") if qkv else ("freqs",)
    for name in tables:
        if name == "k_freqs" and rng.random() < 0.3:
            case.arrays["k_freqs"] = case.arrays["q_freqs"]  # the same table object
            continue
        _table(rng, rows + (int(rng.integers(0, 3)) if name == "k_freqs" else 0), d2, interleaved, backend, name, case)
    npdt = NP_DTYPES[dtype]
    poison = float_poison(dtype)

    def data(shape):
        return lay_out(rng.uniform(-2, 2, shape).astype(npdt), rng, _pick_mode(rng, backend), poison)

    if entry in QK_NAMES:
        qn, kn = QK_NAMES[entry]
        fused = rng.random() < 0.4
        if fused:  # views of one [.., 3, h, d] projection (k may have other heads only when separate)
            proj = data(lead + (3, h, d))
            step = proj.strides[len(lead)]
            drop = proj.strides[:len(lead)] + proj.strides[len(lead) + 1:]
            mode = "expanded" if proj.mode == "expanded" else "fused"
            case.arrays[qn] = Laid(proj.base, proj.offset, lead + (h, d), drop, mode)
            case.arrays[kn] = Laid(proj.base, proj.offset + step, lead + (h, d), drop, mode)
        else:
            hk = int(rng.choice([0, 1, 2, 3, 8]))
            dk = d if rng.random() < 0.7 else max(d2, int(rng.choice(HEAD_DIMS)))
            case.arrays[qn] = data(lead + (h, d))
            case.arrays[kn] = data(lead + (hk, dk))
        case.meta["fused"] = fused
        if rng.random() < 0.3 and "expanded" not in (case.arrays[qn].mode, case.arrays[kn].mode):
            case.kw["inplace"] = True
    elif entry.startswith("rope"):
        xname = "x" if entry == "rope" else "grad"
        case.arrays[xname] = data(lead + (h, d))
        r = rng.random()
        if r < 0.2:
            out_mode = _pick_mode(rng, backend)
            out_mode = "stepped" if out_mode == "expanded" else out_mode
            case.arrays["out"] = lay_out(np.zeros(lead + (h, d), npdt), rng, out_mode, poison)
            case.arrays["out"].base[:] = poison  # the view too: every element must be written
        elif r < 0.3 and case.arrays[xname].mode != "expanded":
            case.out_is_input = True
        elif r < 0.4 and layout == "sbhd":
            case.kw["transpose_output_memory"] = True
    elif entry == "qkv":
        case.arrays["qkv"] = data(lead + (g, (n + 2) * d))
    else:
        case.arrays["dq"] = data(lead + (g * n, d))
        case.arrays["dk"] = data(lead + (g, d))
        case.arrays["dv"] = data(lead + (g, d))
    if qkv:
        case.meta.update(g=g, n=n)
        if rng.random() < 0.5 or entry == "qkv_bwd":
            if entry == "qkv" or g == 0 or rng.random() < 0.5:
                case.kw["split"] = (n * d, d, d) if rng.random() < 0.7 else [n * d, d, d]
        else:
            if g and entry == "qkv":
                case.kw["num_q_heads"] = g * n
            else:
                case.kw["split"] = (n * d, d, d)
    if rng.random() < 0.3:
        _make_invalid(case, rng, backend)
    return case


def _draw_pos(seed: int, rng, backend: str) -> Case:
    """A positions-API case: positions [t] or [b, s] with any values (negative, past the table,
    near the integer limits), one table of three kinds, q flattened or not, k optional (its own
    heads and head dim, or a view of q's fused buffer), rotary slice at an offset."""
    dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
    case = Case(seed, "pos", "pos", dtype, bool(rng.random() < 0.5), 1, 0)
    lead = (int(rng.choice([0, 1, 2, 5, 9])),) if rng.random() < 0.6 else \
        (int(rng.choice([0, 1, 2, 3])), int(rng.choice([0, 1, 3, 4])))
    d, d2 = _d_d2(rng)
    off = 2 * int(rng.integers(0, (d - d2) // 2 + 1)) if d2 and rng.random() < 0.4 else 0
    h = int(rng.choice([0, 1, 2, 3, 5, 8]))
    kind = str(rng.choice(["cos_sin", "cos_sin_t", "freqs", "inv32", "inv64"]))
    rows = int(rng.integers(0, 12))
    n = int(np.prod(lead))
    pdt = str(rng.choice(["int32", "int64"]))
    r = rng.random()
    if r < 0.7:
        pvals = rng.integers(-3, rows + 4, n)
    else:
        hi = 2**31 - 1 if pdt == "int32" else 2**63 - 1
        pvals = np.where(rng.random(n) < 0.5, rng.integers(hi - 10, hi, n, endpoint=True, dtype=np.int64),
                         -rng.integers(hi - 10, hi, n, endpoint=True, dtype=np.int64))
    pvals = pvals.reshape(lead)
    if pvals.size and rng.random() < 0.15:
        pvals = np.full_like(pvals, pvals.flat[0])  # lets "expanded" (stride 0) happen
    _index(rng, pvals, pdt, backend, "positions", case, two_d=len(lead) == 1 and rng.random() < 0.15)
    tname = {"cos_sin": "cos_sin_cache", "cos_sin_t": "cos_sin_cache", "freqs": "freqs"}.get(kind, "inv_freq")
    if kind.startswith("cos_sin"):
        ang = rng.uniform(-30, 30, (rows, d2 // 2))
        tvals = np.concatenate([np.cos(ang), np.sin(ang)], -1).astype(np.float32 if kind == "cos_sin" else NP_DTYPES[dtype])
    elif kind == "freqs":
        tvals = rng.uniform(-30, 30, (rows, d2)).astype(np.float32)
        if rng.random() < 0.3:
            tvals = tvals.reshape(rows, 1, 1, d2)
    else:
        tvals = (10000.0 ** -(np.arange(0, d2, 2) / max(d2, 1)) * rng.uniform(0.5, 3)).astype(
            np.float32 if kind == "inv32" else np.float64)
    mode = _pick_mode(rng, backend)
    case.arrays[tname] = lay_out(tvals, rng, "stepped" if mode == "expanded" else mode,
                                 np.array(np.nan).astype(tvals.dtype))
    npdt, poison = NP_DTYPES[dtype], float_poison(dtype)

    def data(shape):
        return lay_out(rng.uniform(-2, 2, shape).astype(npdt), rng, _pick_mode(rng, backend), poison)

    flat = rng.random() < 0.4
    with_k = rng.random() < 0.75
    if with_k and rng.random() < 0.35:  # q and k: views of one fused [.., (h + 2h) * d] projection
        proj = data(lead + (3 * h * d,))
        sd = proj.strides[-1]
        mode = "expanded" if proj.mode == "expanded" else "fused"  # stride 0: not writable in place
        case.arrays["q"] = Laid(proj.base, proj.offset, lead + (h * d,), proj.strides, mode)
        case.arrays["k"] = Laid(proj.base, proj.offset + h * d * sd, lead + (h * d,), proj.strides, mode)
        flat = True
    else:
        case.arrays["q"] = data(lead + ((h * d,) if flat else (h, d)))
        if with_k:
            hk = int(rng.choice([0, 1, 2, 3]))
            dk = d if flat or rng.random() < 0.7 else max(d2 + off, int(rng.choice(HEAD_DIMS)))
            case.arrays["k"] = data(lead + ((hk * d,) if flat else (hk, dk)))
    if "k" not in case.arrays:
        case.lists["k"] = None
    ks = case.arrays.get("k")
    if flat or (rng.random() < 0.2 and (ks is None or ks.shape[-1] == d)):  # one head size for q and k
        case.kw["head_size"] = d
    case.kw.update(interleaved=case.interleaved, rope_dim_offset=off, inverse=bool(rng.random() < 0.5))
    if rng.random() < 0.3 and all(case.arrays[n].mode != "expanded" for n in ("q", "k") if n in case.arrays):
        case.kw["inplace"] = True
    case.meta.update(d=d, d2=d2, lead=lead, h=h, kind=kind, tname=tname, rows=rows, off=off, flat=flat)
    if rng.random() < 0.3:
        _make_invalid_pos(case, rng)
    return case


def _make_invalid_pos(case: Case, rng):
    """One invalid argument of a positions-API call."""
    A, kw, m = case.arrays, case.kw, case.meta
    what = str(rng.choice(["pos_dtype", "pos_ndim", "pos_tokens", "no_table", "two_tables", "table_dtype",
                           "table_shape", "offset_big", "offset_type", "q_dtype", "q_type", "k_dtype",
                           "head_size", "interleaved", "inverse", "inplace_type", "inplace_overlap"]))
    m["invalid"] = what
    npdt, t = NP_DTYPES[case.dtype], m["tname"]
    if what == "pos_dtype":
        A["positions"] = lay_out(np.zeros(m["lead"], np.float32), rng, "contiguous", 0)
        case.expect_error = "positions"
    elif what == "pos_ndim":
        A["positions"] = lay_out(np.zeros((1, 1, 1), np.int64), rng, "contiguous", 0)
        case.expect_error = "positions"
    elif what == "pos_tokens":
        A["positions"] = lay_out(np.zeros((m["lead"][0] + 1,) + m["lead"][1:], np.int64), rng, "contiguous", 0)
        case.expect_error = "q"
    elif what == "no_table":
        del A[t]
        case.expect_error = "cos_sin_cache"
    elif what == "two_tables":
        other = "freqs" if t != "freqs" else "cos_sin_cache"
        A[other] = lay_out(np.zeros((2, max(m["d2"], 2)), np.float32), rng, "contiguous", 0)
        case.expect_error = "cos_sin_cache"
    elif what == "table_dtype":
        A[t] = lay_out(np.zeros(A[t].shape, np.int32), rng, "contiguous", 0)
        case.expect_error = t
    elif what == "table_shape":
        shape = {"inv_freq": (2, 2), "cos_sin_cache": (3,), "freqs": (3, 2, 2)}[t]
        A[t] = lay_out(np.zeros(shape, np.float32), rng, "contiguous", 0)
        case.expect_error = t
    elif what in ("offset_big", "offset_type"):
        kw["rope_dim_offset"] = m["d"] - m["d2"] + 2 if what == "offset_big" else 1.5
        case.expect_error = t if what == "offset_big" else "rope_dim_offset"
    elif what == "q_dtype":
        A["q"] = lay_out(np.zeros(A["q"].shape, np.int16), rng, "contiguous", 0)
        case.expect_error = "q"
    elif what == "q_type":
        case.lists["q"] = [[1.0]]
        case.expect_error = "q"
    elif what == "k_dtype":
        other = np.float16 if case.dtype != "float16" else np.float32
        A["k"] = lay_out(np.zeros(A["q"].shape, other), rng, "contiguous", 0)
        case.lists.pop("k", None)
        case.expect_error = "k"
    elif what == "head_size":
        if m["flat"] or rng.random() < 0.5:
            kw["head_size"], case.expect_error = 0, "head_size"
        else:
            kw["head_size"], case.expect_error = m["d"] + 1, "q"  # q's head dimension is d
    elif what in ("interleaved", "inverse"):
        kw[what] = [1, None, "yes"][int(rng.integers(0, 3))]
        case.expect_error = what
    elif what == "inplace_type":
        kw["inplace"] = [1, "no", None][int(rng.integers(0, 3))]
        case.expect_error = "inplace"
    else:  # k is q itself, written in place
        q = A["q"]
        A["k"] = Laid(q.base, q.offset, q.shape, q.strides, "same")
        case.lists.pop("k", None)
        kw["inplace"] = True
        case.expect_error = "q" if q.mode == "expanded" else "k"
        if int(np.prod(q.shape)) == 0:
            case.expect_error = None  # nothing shared: no error
            kw["inplace"] = False


def _make_invalid(case: Case, rng, backend):
    """One invalid argument; ``case.expect_error`` = the name the error must carry."""
    A, kw = case.arrays, case.kw
    qkv = case.entry.startswith("qkv")
    inputs = [n for n in ("x", "grad", "q", "k", "qkv", "dq", "dk", "dv") if n in A]
    tables = ("q_freqs", "k_freqs") if qkv else ("freqs",)
    choices = ["input_type", "input_dtype", "input_ndim", "table_none", "table_type", "table_dtype",
               "table_shape", "layout", "layout_list", "interleaved", "cp_size", "cp_size_huge", "cp_list",
               "cp_rank", "cu_wrong", "sp_bad", "sp_list"]
    if case.layout != "thd" and case.meta["lead"][0 if case.layout == "sbhd" else 1] * case.cp_size > 0:
        choices.append("table_short")
    if case.entry in QK_NAMES:
        choices += ["k_dtype", "k_tokens", "inplace_type"] + (["inplace_overlap"] if 0 not in A[inputs[0]].shape else [])
    elif not qkv:
        choices += ["out_shape", "out_dtype", "out_overlap", "out_zero_stride"]
        if case.layout != "thd":
            choices.append("tom_bshd")
        if backend == "numpy":
            choices += ["out_readonly", "structured"]
    else:
        choices += ["split_float", "split_str", "split_sum"]
        if case.entry == "qkv":
            choices += ["split_both", "num_q_heads"]
        else:
            choices += ["grad_dtype", "grad_shape"]
    what = str(rng.choice(choices))
    case.meta["invalid"] = what
    name = str(rng.choice(inputs))
    tname = str(rng.choice(tables))
    if what in ("k_dtype", "k_tokens", "inplace_type", "inplace_overlap"):
        qn, kn = QK_NAMES[case.entry]
        q = A[qn]
        if what == "k_dtype":
            other = np.float16 if case.dtype != "float16" else np.float32
            A[kn] = lay_out(np.zeros(A[kn].shape, other), rng, "contiguous", 0)
        elif what == "k_tokens":
            A[kn] = lay_out(np.zeros(A[kn].shape[:-3] + (A[kn].shape[-3] + 1,) + A[kn].shape[-2:],
                                     NP_DTYPES[case.dtype]), rng, "contiguous", 0)
        elif what == "inplace_type":
            kw["inplace"] = [1, "yes", None][int(rng.integers(0, 3))]
            case.expect_error = "inplace"
            return
        else:  # k is q's memory: in-place writes would race
            A[kn] = Laid(q.base, q.offset, q.shape, q.strides, "same")
            kw["inplace"] = True
            if q.mode == "expanded" or "expanded" in (A[qn].mode,):
                case.expect_error = qn  # a stride-0 tensor cannot be written in place
                return
        case.expect_error = kn
        return
    if what == "input_type":
        case.lists[name] = [None, [1.0, 2.0], (1, 2), 3.0, "x"][int(rng.integers(0, 5))]
        case.expect_error = name
    elif what == "input_dtype":
        base = A[name]
        A[name] = lay_out(np.zeros(base.shape, rng.choice([np.int32, np.float64])), rng, "contiguous", 0)
        case.expect_error = name
    elif what == "input_ndim":
        base = A[name]
        A[name] = lay_out(np.zeros(base.shape + (1,), NP_DTYPES[case.dtype]), rng, "contiguous", 0)
        case.expect_error = name
    elif what == "table_none":
        case.lists[tname] = None
        case.expect_error = tname
    elif what == "table_type":
        case.lists[tname] = [[0.0, 1.0]]
        case.expect_error = tname
    elif what in ("table_dtype", "table_shape", "table_short"):
        d2 = case.meta["d2"]
        rows = A[tname].shape[0]
        if what == "table_dtype":
            vals = np.zeros((rows, d2), np.float64)
        elif what == "table_shape":
            vals = [np.zeros((rows, 1, d2), np.float32), np.zeros((rows, 1, 1, d2 + 1), np.float32),
                    np.zeros((rows, 1, 1, case.meta["d"] + 2), np.float32)][int(rng.integers(0, 3))]
        else:
            s = case.meta["lead"][0 if case.layout == "sbhd" else 1]
            vals = np.zeros((s * case.cp_size - 1, d2), np.float32)
        A[tname] = lay_out(vals, rng, "contiguous", 0)
        case.expect_error = tname
    elif what == "layout":
        kw["layout"] = "sbdh"
        case.expect_error = "layout"
    elif what == "layout_list":
        kw["layout"] = [case.layout]
        case.expect_error = "layout"
    elif what == "interleaved":
        kw["interleaved"] = [1, [True], None][int(rng.integers(0, 3))]
        case.expect_error = "interleaved"
    elif what == "cp_size":
        kw["cp_size"] = [0, -1, 2.0][int(rng.integers(0, 3))]
        case.expect_error = "cp_size"
    elif what == "cp_size_huge":
        kw["cp_size"] = 2**70
        case.expect_error = "cp_size"
    elif what == "cp_list":
        kw["cp_size"] = [case.cp_size]
        case.expect_error = "cp_size"
    elif what == "cp_rank":
        kw["cp_rank"] = [case.cp_size, -1][int(rng.integers(0, 2))]
        case.expect_error = "cp_rank"
    elif what == "cu_wrong":
        if case.layout == "thd":
            r = int(rng.integers(0, 3))
            if r == 0:
                case.lists["cu_seqlens"] = None
            elif r == 1:
                A["cu_seqlens"] = lay_out(np.zeros(3, np.float32), rng, "contiguous", 0)
            else:
                A["cu_seqlens"] = lay_out(np.zeros((2, 2), np.int32), rng, "contiguous", 0)
        else:
            A["cu_seqlens"] = lay_out(np.array([0, 1], np.int32), rng, "contiguous", 0)
        case.expect_error = "cu_seqlens"
    elif what == "sp_bad":
        r = int(rng.integers(0, 3))
        nseq = case.meta["nseq"]
        if r == 0 and nseq:
            A["start_positions"] = lay_out(np.zeros(nseq - 1, np.int32), rng, "contiguous", 0)
        elif r == 1:
            A["start_positions"] = lay_out(np.zeros(nseq + 1, np.float32), rng, "contiguous", 0)
        else:
            A["start_positions"] = lay_out(np.zeros((nseq + 1, 1), np.int64), rng, "contiguous", 0)
        case.expect_error = "start_positions"
    elif what == "sp_list":
        case.lists["start_positions"] = [0] * (case.meta["nseq"] + 1) if rng.random() < 0.5 else 1.5
        case.expect_error = "start_positions"
    elif what.startswith("out_") or what == "tom_bshd":
        x = A[inputs[0]]
        npdt = NP_DTYPES[case.dtype]
        case.out_is_input = False
        kw.pop("transpose_output_memory", None)
        if what == "out_shape":
            A["out"] = lay_out(np.zeros(x.shape[:-1] + (x.shape[-1] + 1,), npdt), rng, "contiguous", 0)
        elif what == "out_dtype":
            A["out"] = lay_out(np.zeros(x.shape, np.float64 if case.dtype != "float32" else np.float16), rng,
                               "contiguous", 0)
        elif what == "out_readonly":
            A["out"] = lay_out(np.zeros(x.shape, npdt), rng, "contiguous", 0)
            case.meta["readonly"] = True
        elif what == "out_overlap":
            if x.mode == "expanded" or 0 in x.shape or np.prod(x.shape) < 2:
                A["out"] = lay_out(np.zeros(x.shape, np.float64), rng, "contiguous", 0)
            else:  # the input's buffer, one element further on: overlaps without being the input
                A["out"] = Laid(x.base, x.offset + 1, x.shape, x.strides, "overlap")
                if min(x.strides) < 0 or x.offset + 1 + sum((n - 1) * s for n, s in zip(x.shape, x.strides)) >= x.base.size:
                    A["out"] = lay_out(np.zeros(x.shape, np.float64), rng, "contiguous", 0)
        elif what == "out_zero_stride":
            if np.prod(x.shape) < 2 or max(x.shape) < 2:
                A["out"] = lay_out(np.zeros(x.shape, np.float64), rng, "contiguous", 0)
            else:
                A["out"] = lay_out(np.zeros(x.shape, npdt), rng, "expanded", 0)
        else:
            kw["transpose_output_memory"] = True
            kw["layout"] = "bshd" if case.layout != "bshd" else "sbhd"
            if kw["layout"] == "sbhd":
                A["out"] = lay_out(np.zeros(x.shape, npdt), rng, "contiguous", 0)
            case.expect_error = "transpose_output_memory"
            return
        case.expect_error = "out"
    elif what == "structured" and 0 not in A[name].shape:
        x = A[name]
        rec = np.zeros(x.shape, dtype=[("a", NP_DTYPES[case.dtype]), ("b", np.int8)])
        case.lists[name] = rec["a"]
        case.expect_error = name
    elif what in ("split_float", "split_str", "split_sum", "split_both"):
        n, d = case.meta["n"], case.meta["d"]
        kw.pop("num_q_heads", None)
        kw["split"] = {"split_float": (float(n * d), float(d), float(d)), "split_str": "qkv",
                       "split_sum": (n * d, d + 1, d), "split_both": (n * d, d, d)}[what]
        if what == "split_both":
            kw["num_q_heads"] = max(case.meta["g"], 1) * n
        case.expect_error = "split"
    elif what == "num_q_heads":
        kw.pop("split", None)
        g, n, d = case.meta["g"], case.meta["n"], case.meta["d"]
        width = (n + 2) * d
        # a head count that is not a multiple of g, or whose heads per group do not split the width
        kw["num_q_heads"] = next(k for k in range(1, 10 * width) if k % g or width % (k // g + 2)) if g else 1
        case.expect_error = "num_q_heads" if g else "qkv"
    elif what == "grad_dtype":
        other = np.float16 if case.dtype != "float16" else np.float32
        A["dk"] = lay_out(np.zeros(A["dk"].shape, other), rng, "contiguous", 0)
        case.expect_error = "dk"
    elif what == "grad_shape":
        A["dv"] = lay_out(np.zeros(A["dv"].shape[:-1] + (A["dv"].shape[-1] + 2,), NP_DTYPES[case.dtype]), rng,
                          "contiguous", 0)
        case.expect_error = "dv"


# ----------------------------------------------------------------------------- running
def _call_kwargs(case: Case, native: dict):
    kw = dict(layout=case.layout, interleaved=case.interleaved, cp_size=case.cp_size, cp_rank=case.cp_rank)
    kw.update(case.kw)
    for name in ("cu_seqlens", "start_positions"):
        if name in native:
            kw[name] = native[name]
    if "out" in native:
        kw["out"] = native["out"]
    return kw


def _positional(case: Case, native: dict):
    if case.entry == "rope":
        return [native["x"], native["freqs"]]
    if case.entry == "rope_bwd":
        return [native["grad"], native["freqs"]]
    if case.entry in QK_NAMES:
        return [native[n] for n in QK_NAMES[case.entry]] + [native["freqs"]]
    if case.entry == "qkv":
        return [native["qkv"], native["q_freqs"], native["k_freqs"]]
    return [native["dq"], native["dk"], native["dv"], native["q_freqs"], native["k_freqs"]]


def _pos_call_args(case: Case, native: dict):
    tables = {n: native[n] for n in POS_TABLES if n in native}
    return (native["positions"], native["q"], native.get("k")), dict(case.kw, **tables)


def _has_out(case: Case) -> bool:
    """Whether the call passes ``out`` (an array, a non-array, or the input itself)."""
    return "out" in case.arrays or "out" in case.lists or case.out_is_input


def _mutating(case: Case) -> bool:
    """Whether the call writes into an array (what JAX's immutable arrays cannot take)."""
    return _has_out(case) or case.kw.get("inplace") is True or case.kw.get("transpose_output_memory") is True


def via(case: Case, backend: str) -> str:
    """What the call goes through: the public API (``"api"``), or, on half of the seeds, the
    framework shim's function of the same name: for torch tensors ``"torch"``
    (``cupy_rope.torch``: its own checks and autograd kernels, on CUDA its C++ launch path), for
    JAX arrays ``"jax"`` (``cupy_rope.jax``, which takes no ``out``, ``inplace`` or
    ``transpose_output_memory``; its ``apply_rope`` and ``apply_rope_qk`` get ``heads_major`` on
    half of those seeds). The torch shim's ``apply_rope_backward`` takes no ``out``."""
    shim = {"jax": "jax", "torch-cpu": "torch", "torch-cuda": "torch"}.get(backend)
    if shim == "jax" and (_has_out(case) or "inplace" in case.kw or "transpose_output_memory" in case.kw):
        shim = None
    if shim == "torch" and case.entry == "rope_bwd" and _has_out(case):
        shim = None
    return shim if shim and np.random.default_rng([case.seed, 7]).random() < 0.5 else "api"


_ENTRY_FNS = {"rope": "apply_rope", "rope_bwd": "apply_rope_backward", "qk": "apply_rope_qk",
              "qk_bwd": "apply_rope_qk_backward", "qkv": "apply_qkv_rope", "qkv_bwd": "apply_qkv_rope_backward",
              "pos": "apply_rope_pos"}


def call(case: Case, backend: str, native: dict):
    """Run the case's entry point on ``backend``'s arrays (through :func:`via`'s module)."""
    if case.meta.get("via") == "torch":
        import cupy_rope.torch as module
    elif case.meta.get("via") == "jax":
        import cupy_rope.jax as module
    else:
        module = cupy_rope
    fn = getattr(module, _ENTRY_FNS[case.entry])
    if case.entry == "pos":
        args, kw = _pos_call_args(case, native)
        return fn(*args, **kw)
    kw = _call_kwargs(case, native)
    if case.meta.get("via") == "jax" and case.entry in ("rope", "qk"):  # a memory order only: same values
        kw["heads_major"] = bool(np.random.default_rng([case.seed, 8]).random() < 0.5)
    pos = _positional(case, native)
    layout = kw.pop("layout", "sbhd")
    if case.entry.startswith("qkv"):
        split = kw.pop("split", None)
        kw.pop("out", None)
        return fn(*pos, split, layout, **kw)
    return fn(*pos, layout, **kw)


def _host_call(case: Case, native: dict):
    """The host build of the kernels through the real launch plan (valid calls only). One seed in
    four turns the one-row kernels off and lifts the lean kernel's head and sequence limits, so
    that the lean kernel runs every call it can (the fuzz's calls are small: the one-row kernels'
    otherwise); the others keep the library's split."""
    from cupy_rope import _worksplit

    names = ("_ONE_ROW", "_LEAN_MIN_HEADS", "_LEAN_MAX_SEQS")
    saved = [getattr(_worksplit, n) for n in names]
    if case.seed % 4 == 1:
        for n, v in zip(names, (False, 1, 2**62)):
            setattr(_worksplit, n, v)
    try:
        return _host_launch(case, native)
    finally:
        for n, v in zip(names, saved):
            setattr(_worksplit, n, v)


def _host_launch(case: Case, native: dict):
    from cupy_rope import _plan
    from cupy_rope._dev import hostkernels as _hostkernels
    from cupy_rope._interop import info

    if case.entry == "pos":
        (pos, q, k), kw = _pos_call_args(case, native)
        tables = {n: info(kw.get(n)) for n in POS_TABLES}
        inplace = kw.get("inplace", False)
        plans, views, tname = _plan.resolve_rope_pos(info(pos), info(q), info(k), tables, kw.get("head_size"),
                                                     kw["interleaved"], kw["rope_dim_offset"], kw["inverse"], inplace)
        xs = [np.lib.stride_tricks.as_strided(a, v.shape, tuple(st * a.itemsize for st in v.strides))
              for a, v in zip((q, k), views)]
        outs = tuple(xs) if inplace else tuple(np.full(v.shape, np.nan, a.dtype) for a, v in zip(xs, views))
        _hostkernels.run_rope_pos(plans, xs, kw[tname], pos, outs)
        res = [a if inplace else o.reshape(a.shape) for a, o in zip((q, k), outs)]
        return res[0], (res[1] if k is not None else None)
    kw = _call_kwargs(case, native)
    cu, sp = info(kw.get("cu_seqlens")), info(kw.get("start_positions"))
    if case.entry in QK_NAMES:
        names = QK_NAMES[case.entry]
        q, k = (native[n] for n in names)
        inplace = kw.get("inplace", False)
        plans = _plan.resolve_rope_pair(info(q), info(k), info(native["freqs"]), case.layout, case.interleaved,
                                        cu, sp, case.cp_size, case.cp_rank, inplace, case.entry == "qk_bwd", names)
        outs = (q, k) if inplace else tuple(np.full(a.shape, np.nan, a.dtype) for a in (q, k))
        return _hostkernels.run_rope_qk(plans, q, k, native["freqs"], kw.get("cu_seqlens"),
                                        kw.get("start_positions"), outs)
    if case.entry.startswith("rope"):
        xn = "x" if case.entry == "rope" else "grad"
        x = native[xn]
        tom = kw.get("transpose_output_memory", False)
        plan = _plan.resolve_rope(info(x), info(native["freqs"]), case.layout, case.interleaved, cu, sp,
                                  case.cp_size, case.cp_rank, info(kw.get("out")), case.entry == "rope_bwd", tom, xn)
        out = kw.get("out")
        if case.out_is_input:
            out = x
        elif out is None:
            if tom:
                s, b = x.shape[:2]
                out = np.full((b, s) + x.shape[2:], np.nan, x.dtype).transpose(1, 0, 2, 3)
            else:
                out = np.full(x.shape, np.nan, x.dtype)
        return _hostkernels.run_rope(plan, x, native["freqs"], kw.get("cu_seqlens"), kw.get("start_positions"), out=out)
    qf, kf = info(native["q_freqs"]), info(native["k_freqs"])
    if case.entry == "qkv":
        plan = _plan.resolve_qkv(info(native["qkv"]), qf, kf, kw.get("split"), case.layout, kw.get("num_q_heads"),
                                 case.interleaved, cu, sp, case.cp_size, case.cp_rank)
        arrays = (native["qkv"],)
    else:
        plan = _plan.resolve_qkv_backward(info(native["dq"]), info(native["dk"]), info(native["dv"]), qf, kf,
                                          kw.get("split"), case.layout, kw.get("num_q_heads"), case.interleaved,
                                          cu, sp, case.cp_size, case.cp_rank)
        arrays = (native["dq"], native["dk"], native["dv"])
    return _hostkernels.run_qkv(plan, arrays, native["q_freqs"], native["k_freqs"], kw.get("cu_seqlens"),
                                kw.get("start_positions"))


def _ref_kw(case: Case, vals: dict):
    return dict(layout=case.layout, interleaved=case.interleaved, cu_seqlens=vals.get("cu_seqlens"),
                start_positions=vals.get("start_positions"), cp_size=case.cp_size, cp_rank=case.cp_rank)


def _rotated_tokens(case: Case, lead, vals, rows) -> np.ndarray:
    """Tokens the reference rotates (in a sequence and inside the table)."""
    m = np.zeros(lead, bool)
    tab = token_table(case.layout, lead, vals.get("cu_seqlens"), vals.get("start_positions"),
                      case.cp_size, case.cp_rank)
    for tok, p in tab.items():
        if 0 <= p < rows:
            m[tok] = True
    return m


def _check_rope(y, x, freqs, case, vals, what):
    ref = rope_ref(x, freqs, backward=case.entry.endswith("bwd"), **_ref_kw(case, vals))
    d2 = freqs.shape[-1]
    assert_close_to_ref(y, ref, x, d2, case.dtype, what)
    # pass-through elements are the input's bits
    rot = _rotated_tokens(case, x.shape[:-2], vals, freqs.shape[0])
    yb, xb = np.asarray(y), np.asarray(x)
    same = ~rot
    if same.any():
        assert np.array_equal(bits(yb[same]), bits(xb[same])), f"{what}: copied tokens differ from the input"
    if d2 < x.shape[-1] and x.size:
        assert np.array_equal(bits(yb[..., d2:]), bits(xb[..., d2:])), f"{what}: tail channels differ"


def _check_pos(case: Case, result, vals: dict):
    m = case.meta
    assert isinstance(result, tuple) and len(result) == 2, type(result)
    table = vals[m["tname"]]
    kind = {"cos_sin_cache": "cos_sin", "freqs": "angles", "inv_freq": "inv_freq"}[m["tname"]]
    rows = 2**62 if kind == "inv_freq" else table.shape[0]
    d2, off = m["d2"], m["off"]
    for n, r in zip(("q", "k"), result):
        if n not in vals:
            assert r is None, "k_out must be None without k"
            continue
        y, x = to_numpy(r), vals[n]
        assert y.shape == x.shape and y.dtype == x.dtype, (n, y.shape, y.dtype)
        d = case.kw.get("head_size") or x.shape[-1]
        xv, yv = x.reshape(m["lead"] + (-1, d)) if x.size else x.reshape(m["lead"] + (0, d)), None
        yv = y.reshape(xv.shape)
        ref = rope_pos_ref(xv, vals["positions"], kind, table, rows, case.interleaved, off, case.kw["inverse"])
        scale = np.abs(xv.astype(np.float64))
        if d2 and xv.size:
            scale[..., off:off + d2] += scale[..., off:off + d2].max(axis=-1, keepdims=True)
        assert_close_to_ref(yv, ref, xv, d2, case.dtype, f"{n} " + case.describe(), scale=scale)
        p = vals["positions"].astype(np.int64)
        out = (p < 0) | (p >= rows)
        if out.any():
            assert np.array_equal(bits(yv[out]), bits(xv[out])), f"{n}: tokens outside the table differ"
        keep = np.r_[0:off, off + d2:d]
        if keep.size and xv.size:
            assert np.array_equal(bits(yv[..., keep]), bits(xv[..., keep])), f"{n}: pass-through channels differ"


def check_valid(case: Case, result, vals: dict, backend: str):
    """Results against the float64 reference (``vals``: the logical NumPy inputs)."""
    if case.entry == "pos":
        _check_pos(case, result, vals)
        return
    if case.entry in QK_NAMES:
        assert isinstance(result, tuple) and len(result) == 2, type(result)
        for n, r in zip(QK_NAMES[case.entry], result):
            y = to_numpy(r)
            assert y.shape == vals[n].shape and y.dtype == vals[n].dtype, (n, y.shape, y.dtype)
            _check_rope(y, vals[n], vals["freqs"], case, vals, f"{n} " + case.describe())
        return
    if case.entry.startswith("rope"):
        xn = "x" if case.entry == "rope" else "grad"
        y = to_numpy(result)
        assert y.shape == vals[xn].shape and y.dtype == vals[xn].dtype, (y.shape, y.dtype)
        _check_rope(y, vals[xn], vals["freqs"], case, vals, case.describe())
        if case.kw.get("transpose_output_memory") and y.size and backend != "host":
            s, b, h, d = y.shape
            st = tuple(result.stride()) if hasattr(result, "stride") and callable(result.stride) else \
                tuple(v // y.itemsize for v in result.strides)
            assert st == (h * d, s * h * d, d, 1) or 1 in (s, b), f"transpose_output_memory strides {st}"
        return
    n, d = case.meta["n"], case.meta["d"]
    if case.entry == "qkv":
        q, k, v = (to_numpy(t) for t in result)
        xq, xk, xv = qkv_split_ref(vals["qkv"], n, d)
        _check_rope(q, xq, vals["q_freqs"], case, vals, "q " + case.describe())
        _check_rope(k, xk, vals["k_freqs"], case, vals, "k " + case.describe())
        assert np.array_equal(bits(v), bits(np.ascontiguousarray(xv))), "v differs from the input"
        return
    dqkv = to_numpy(result)
    lead, g = vals["dq"].shape[:-2], vals["dk"].shape[-2]
    assert dqkv.shape == lead + (g, (n + 2) * d), dqkv.shape
    gq, gk, gv = qkv_split_ref(dqkv, n, d)
    _check_rope(gq, vals["dq"], vals["q_freqs"], case, vals, "dq " + case.describe())
    _check_rope(gk, vals["dk"], vals["k_freqs"], case, vals, "dk " + case.describe())
    assert np.array_equal(bits(gv), bits(np.ascontiguousarray(vals["dv"]))), "dv differs from the input"


def _jax_on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


def run_case(seed: int, backend: str, verbose: bool = False) -> str:
    """Draw and run one case; raises AssertionError on any violation. Returns a short outcome.
    On the CUDA backends a call that ran is run again on fresh arrays of the same layout and
    values: the launch cache's hit (CuPy's C++ path, the torch shim's C++ path) under the same
    checks. JAX cases run with 64-bit types on (``jax.enable_x64``), so that int64 index arrays
    stay int64 (JAX's default would narrow them to int32)."""
    if backend in ("cupy", "torch-cuda"):
        outcome = _run_case(seed, backend, verbose)
        if not outcome.startswith("error"):
            again = _run_case(seed, backend, False)
            assert again == outcome, f"seed {seed}: {outcome!r}, then {again!r} on fresh arrays"
        return outcome
    if backend != "jax":
        return _run_case(seed, backend, verbose)
    import jax

    with jax.enable_x64(True):
        return _run_case(seed, backend, verbose)


def _run_case(seed: int, backend: str, verbose: bool) -> str:
    case = draw(seed, backend)
    case.meta["via"] = via(case, backend)
    if verbose:
        print(case.describe())
    if backend == "host" and (case.expect_error or case.lists):
        return "skipped (invalid call: the host backend runs valid calls only)"
    if backend == "jax" and _mutating(case):
        return "skipped (JAX arrays are immutable: no out, inplace or transpose_output_memory)"
    laid = dict(case.arrays)
    native, bufs, by_base = {}, {}, {}
    for name, l in laid.items():
        if name == "k_freqs" and laid["k_freqs"] is laid.get("q_freqs"):
            native[name] = native["q_freqs"]
            continue
        if id(l.base) not in by_base:  # arrays over one NumPy buffer share one backend buffer
            by_base[id(l.base)] = bufs[name] = backend_buffer(l.base, backend)
        native[name] = to_backend(l, by_base[id(l.base)], backend)
    if case.meta.get("readonly"):
        native["out"].flags.writeable = False
    if case.out_is_input:
        native["out"] = native["x" if case.entry == "rope" else "grad"]
    native.update(case.lists)
    before = {k: to_numpy(b).copy() for k, b in bufs.items()}
    vals = {k: np.array(l.view(), copy=True, order="C") for k, l in laid.items()}  # before the call
    cpu_checked = backend in CPU_BACKENDS or (backend == "jax" and _jax_on_cpu())
    expect = case.expect_error or ("cu_seqlens" if case.garbage_cu and cpu_checked else None)
    try:
        result = _host_call(case, native) if backend == "host" else call(case, backend, native)
        if backend in ("cupy", "torch-cuda"):
            _sync(backend)
        if backend == "jax":  # JAX dispatches asynchronously: its errors surface here
            import jax

            jax.block_until_ready(result)
    except (ValueError, TypeError) as e:
        if expect is None:
            raise AssertionError(f"unexpected {type(e).__name__}: {e}\n{case.describe()}") from e
        msg = str(e)
        assert f"`{expect}`" in msg, f"error does not name `{expect}`: {type(e).__name__}: {msg}\n{case.describe()}"
        for k, b in bufs.items():  # nothing written: every buffer as it was
            assert np.array_equal(bits(to_numpy(b)), bits(before[k])), f"`{k}` written on error\n{case.describe()}"
        return f"error `{expect}`"
    except Exception as e:
        raise AssertionError(f"{type(e).__name__} (expected ValueError/TypeError): {e}\n{case.describe()}\n"
                             f"{traceback.format_exc()}") from e
    if expect is not None:
        raise AssertionError(f"no error, expected one naming `{expect}`\n{case.describe()}")
    # inputs untouched (their whole buffers); out's buffer outside the view untouched
    xn = "x" if case.entry == "rope" else "grad"
    written = {"out"} | ({xn} if case.out_is_input else set())
    if case.kw.get("inplace") is True:
        written |= set(QK_NAMES[case.entry]) if case.entry in QK_NAMES else {"q", "k"}
    covered = {}  # buffer name -> elements written (views sharing a buffer: their union)
    for n in written:
        if n in laid:
            owner = next(k for k in bufs if laid[k].base is laid[n].base)
            covered[owner] = covered.get(owner, False) | laid[n].covered()
    for k, b in bufs.items():
        now = to_numpy(b)
        if k in covered:  # only the output views' elements may change
            keep = ~covered[k]
            assert np.array_equal(bits(now[keep]), bits(before[k][keep])), \
                f"memory around `{k}` written\n{case.describe()}"
        else:
            assert np.array_equal(bits(now), bits(before[k])), f"input `{k}` was modified\n{case.describe()}"
    if "out" in native and backend != "host":
        assert result is native["out"], "with `out` the result is `out`"
    if case.kw.get("inplace") is True and backend != "host":
        names = QK_NAMES.get(case.entry, ("q", "k"))
        assert all(r is native.get(n) for r, n in zip(result, names)), "inplace returns q, k"
    if case.garbage_cu:
        return "ran (garbage cu_seqlens: memory checks only)"
    check_valid(case, result, vals, backend)
    return "ok"


def _sync(backend):
    if backend == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()
    else:
        _torch().cuda.synchronize()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=BACKENDS, default="numpy")
    ap.add_argument("--seed", type=int, help="one case (replay)")
    ap.add_argument("--seeds", default="0:500", help="a range START:STOP of seeds")
    ap.add_argument("--no-pool", action="store_true",
                    help="GPU: no memory pools (CuPy's allocator off, torch's caching allocator off, XLA's "
                         "platform allocator) so compute-sanitizer sees reads past small arrays")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.no_pool:
        os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"  # read when JAX starts its backend
        if a.backend == "cupy":
            import cupy

            cupy.cuda.set_allocator(None)
            cupy.cuda.set_pinned_memory_allocator(None)
    seeds = [a.seed] if a.seed is not None else range(*map(int, a.seeds.split(":")))
    failed, outcomes = [], {}
    for s in seeds:
        try:
            o = run_case(s, a.backend, a.verbose)
            outcomes[o.split(" (")[0]] = outcomes.get(o.split(" (")[0], 0) + 1
            if a.verbose:
                print(s, o)
        except AssertionError as e:
            failed.append(s)
            print(f"FAIL seed {s}: {e}", file=sys.stderr)
    print(f"fuzz {a.backend}: {len(seeds) - len(failed)} passed, {len(failed)} failed; outcomes {outcomes}")
    if failed:
        print("replay: python tests/fuzz.py --backend", a.backend, "--seed", failed[0], "-v")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Layout and argument resolution: validation and the launch plan (framework-neutral).

Everything here works on :class:`ArrayInfo` descriptors (shape, element strides, dtype,
device, address) and never touches array data, so every check is free of device
synchronisation. The result is a plan that both back ends consume: the CUDA launch (the work
split and parameter blocks: ``_worksplit``, ``_abi``) and the NumPy backend (the same numbers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


FLOAT_DTYPES = ("float32", "float16", "bfloat16")
INDEX_DTYPES = ("int32", "int64")
LAYOUTS = {"sbhd": 0, "bshd": 1, "thd": 2}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4, "int64": 8}


@dataclass(frozen=True)
class ArrayInfo:
    """What the planner needs to know about an array (no data)."""

    shape: tuple
    strides: tuple  # in elements
    dtype: str  # numpy-style name ("bfloat16" for bf16)
    device: tuple  # ("cpu", 0) or ("cuda", index)
    ptr: int = 0  # data address (0 on the NumPy backend)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def extent(self) -> tuple[int, int]:
        """Byte range [lo, hi) the array's elements occupy (empty arrays: empty range)."""
        isz = ITEMSIZE.get(self.dtype, 1)
        return byte_extent(self.ptr, self.shape, [s * isz for s in self.strides], isz)


def byte_extent(ptr: int, shape, byte_strides, itemsize: int) -> tuple[int, int]:
    """Byte range [lo, hi) that the elements of an array at ``ptr`` occupy (strides in bytes, any
    sign); an empty array: the empty range (ptr, ptr)."""
    if 0 in tuple(shape):
        return (ptr, ptr)
    lo = hi = 0
    for n, s in zip(shape, byte_strides):
        if s > 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return (ptr + lo, ptr + hi + itemsize)


def _fmt_dev(dev) -> str:
    return "cpu" if dev[0] == "cpu" else f"cuda:{dev[1]}"


def _err(arg: str, expected: str, got) -> ValueError:
    return ValueError(f"cupy_rope: `{arg}`: expected {expected}, got {got}")


def _terr(arg: str, expected: str, got) -> TypeError:
    return TypeError(f"cupy_rope: `{arg}`: expected {expected}, got {got}")


def check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise _err("layout", "one of 'sbhd', 'bshd', 'thd'", repr(layout))
    return layout


def check_int(name: str, v, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            import numpy as np

            if isinstance(v, np.integer):
                v = int(v)
            else:
                raise TypeError
        except TypeError:
            raise _terr(name, "a Python int", f"{type(v).__name__} {v!r}") from None
    if lo is not None and v < lo:
        raise _err(name, f"an int >= {lo}", v)
    if hi is not None and v >= hi:
        raise _err(name, f"an int < {hi}", v)
    return v


def check_number(name: str, v, lo: float) -> float:
    """A real number > ``lo`` (a Python or NumPy number, or anything with ``__float__`` that
    converts: a one-element tensor); bools are not numbers here."""
    if isinstance(v, (bool, str, bytes)) or not hasattr(v, "__float__"):
        raise _terr(name, "a number", f"{type(v).__name__} {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError, RuntimeError):  # e.g. an array of several elements
        raise _terr(name, "a number", f"{type(v).__name__} of shape {tuple(getattr(v, 'shape', ()))}") from None
    if not f > lo:
        raise _err(name, f"a number > {lo}", repr(v))
    return f


def check_arrays(kind, expected: str, optional=(), **named) -> None:
    """Each of ``named`` an instance of ``kind`` (a type or tuple of types), or None where its
    name is in ``optional``: a framework shim's arrays, checked before they reach an op or a
    trace, so that anything else is a ``TypeError`` naming the argument."""
    for name, v in named.items():
        if not isinstance(v, kind) and not (v is None and name in optional):
            raise _terr(name, expected, "None" if v is None else f"{type(v).__name__} {_short(v)}")


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def check_bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        try:
            import numpy as np

            if isinstance(v, np.bool_):
                return bool(v)
        except ImportError:  # pragma: no cover
            pass
        raise _terr(name, "a bool", f"{type(v).__name__} {v!r}")
    return v


def check_float_input(name: str, a: ArrayInfo) -> None:
    if a.dtype not in FLOAT_DTYPES:
        raise _terr(name, "dtype float32, float16 or bfloat16", a.dtype)


@dataclass(frozen=True)
class Table:
    """A resolved table: rows S, rotary width d2, element strides, and what it holds: ``kind``
    "angles" (float32 angles per channel, spec 2), "cos_sin" (a cos/sin cache ``[S, d2]``: cos of
    pair i in column i, sin in column d2/2 + i) or "inv_freq" (``[d2/2]`` inverse frequencies:
    any position; angles formed in float64); ``dtype`` its element type."""

    rows: int
    d2: int
    srow: int
    scol: int
    kind: str = "angles"
    dtype: str = "float32"


# Rows of an inverse-frequency "table": every position >= 0 has its angles.
INV_FREQ_ROWS = 2**62


def check_freqs(name: str, f: ArrayInfo, d: int) -> Table:
    """Spec 2 and 7: float32, [S, 1, 1, d2] or [S, d2], d2 even and <= d."""
    if f.dtype != "float32":
        raise _terr(name, "a float32 angle table", f"dtype {f.dtype}")
    if not (f.ndim == 2 or (f.ndim == 4 and f.shape[1] == 1 and f.shape[2] == 1)):
        raise _err(name, "shape [S, 1, 1, d2] or [S, d2]", f"shape {tuple(f.shape)}")
    d2 = f.shape[-1]
    if d2 % 2:
        raise _err(name, "an even rotary width d2 (last dimension)", f"d2 = {d2}")
    if d2 > d:
        raise _err(name, f"rotary width d2 <= head dim d = {d}", f"d2 = {d2}")
    return Table(rows=f.shape[0], d2=d2, srow=f.strides[0], scol=f.strides[-1])


def check_index(name: str, a: ArrayInfo | None) -> None:
    if a is None:
        return
    if a.ndim != 1:
        raise _err(name, "a 1-D tensor", f"shape {tuple(a.shape)}")
    if a.dtype not in INDEX_DTYPES:
        raise _terr(name, "dtype int32 or int64", a.dtype)


def check_same_device(ref_name: str, ref: ArrayInfo, others: dict) -> None:
    for name, a in others.items():
        if a is not None and tuple(a.device) != tuple(ref.device):
            raise _err(name, f"an array on the same device as `{ref_name}` ({_fmt_dev(ref.device)})",
                       f"an array on {_fmt_dev(a.device)}")


@dataclass(frozen=True)
class Positions:
    """Resolved position arguments (spec 5), shared by both back ends."""

    layout: str
    seq_len: int  # sbhd/bshd local s (thd: 0)
    nseq: int  # thd: sequences (sbhd/bshd: b)
    cp_size: int
    cp_rank: int
    has_cu: bool
    has_sp: bool
    cu_is64: bool
    sp_is64: bool
    has_ids: bool = False  # per-token positions (the positions API) instead of all the above
    ids_is64: bool = False


# Largest cp_size accepted (positions and the kernel's index math stay far from 64-bit overflow).
MAX_CP_SIZE = 2**31


def check_cp(cp_size, cp_rank) -> tuple[int, int]:
    """Context parallelism: ``1 <= cp_size < 2^31``, ``0 <= cp_rank < cp_size`` (Python ints)."""
    cp_size = check_int("cp_size", cp_size, lo=1, hi=MAX_CP_SIZE)
    cp_rank = check_int("cp_rank", cp_rank, lo=0)
    if cp_rank >= cp_size:
        raise _err("cp_rank", f"0 <= cp_rank < cp_size = {cp_size}", cp_rank)
    return cp_size, cp_rank


def check_options(layout, interleaved, cp_size, cp_rank) -> tuple:
    """The rope entry points' options, as the public API checks them: ``(layout, interleaved,
    cp_size, cp_rank)`` with NumPy ints and bools made Python's. For the framework shims, whose
    ops or traces take these values before the public API would see them."""
    return (check_layout(layout), check_bool("interleaved", interleaved)) + check_cp(cp_size, cp_rank)


def resolve_positions(layout: str, tokens_shape: tuple, tables: dict, cu_seqlens, start_positions,
                      cp_size, cp_rank, x_name: str = "x") -> Positions:
    """Spec 5 and 7 checks of the position arguments; ``tokens_shape`` = (s, b) or (t,);
    ``tables`` = {argument name: rows} of the angle tables the positions index."""
    cp_size, cp_rank = check_cp(cp_size, cp_rank)
    check_index("cu_seqlens", cu_seqlens)
    check_index("start_positions", start_positions)
    if layout == "thd":
        if cu_seqlens is None:
            raise _err("cu_seqlens", "a 1-D int32/int64 tensor for layout 'thd'", "None")
        if cu_seqlens.shape[0] < 1:
            raise _err("cu_seqlens", "at least one entry ([nseq + 1], starting with 0)",
                       f"shape {tuple(cu_seqlens.shape)}")
        nseq = cu_seqlens.shape[0] - 1
        seq_len = 0
    else:
        if cu_seqlens is not None:
            raise _err("cu_seqlens", f"None for layout {layout!r} (only 'thd' takes it)",
                       f"a tensor of shape {tuple(cu_seqlens.shape)}")
        s, b = tokens_shape
        nseq, seq_len = b, s
        if cp_size > 1 and s % 2:
            raise _err(x_name, f"an even local sequence length with cp_size = {cp_size} > 1",
                       f"s = {s}")
        for tname, rows in tables.items():
            if rows < s * cp_size:
                raise _err(tname, f"at least s * cp_size = {s} * {cp_size} = {s * cp_size} rows",
                           f"{rows} rows")
    if start_positions is not None and start_positions.shape[0] < nseq:
        what = "b" if layout != "thd" else "nseq = len(cu_seqlens) - 1"
        raise _err("start_positions", f"at least {what} = {nseq} entries",
                   f"shape {tuple(start_positions.shape)}")
    return Positions(layout=layout, seq_len=seq_len, nseq=nseq, cp_size=cp_size, cp_rank=cp_rank,
                     has_cu=cu_seqlens is not None, has_sp=start_positions is not None,
                     cu_is64=cu_seqlens is not None and cu_seqlens.dtype == "int64",
                     sp_is64=start_positions is not None and start_positions.dtype == "int64")


# ------------------------------------------------------------------------ token geometry
def split_tokens(layout: str, shape: tuple):
    """Token dims of an array of ``shape`` as (n_tok, n_inner, tokens_shape).

    sbhd: outer = s, inner = b; bshd: outer = b, inner = s; thd: outer = t, inner = 1.
    ``tokens_shape`` is (s, b) for sbhd/bshd and (t,) for thd.
    """
    if layout == "thd":
        return shape[0], 1, (shape[0],)
    n0, n1 = shape[0], shape[1]
    return n0 * n1, n1, ((n0, n1) if layout == "sbhd" else (n1, n0))


def token_strides(layout: str, a: ArrayInfo):
    """(outer, inner) element strides of ``a``'s token dims, size-1 dims zeroed."""
    st = norm_strides(a.shape, a.strides)
    return (st[0], 0) if layout == "thd" else (st[0], st[1])


def output_strides(shape: tuple) -> tuple:
    """Row-major (contiguous) element strides."""
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(st))


def compact_info(shape, dtype: str, device: tuple = ("cpu", 0), ptr: int = 0) -> ArrayInfo:
    """ArrayInfo of a compact array known by shape and dtype alone (a JAX array or tracer; a
    tensor whose shape a shim checks before its op runs, fake tensors included)."""
    shape = tuple(shape)
    return ArrayInfo(shape, output_strides(shape), dtype, device, ptr)


def norm_strides(shape, strides):
    """Strides of size-1 dims do not matter: zero them so they never block vectorisation."""
    return tuple(0 if n == 1 else s for n, s in zip(shape, strides))


# ------------------------------------------------------------------------ plans
@dataclass
class RopePlan:
    """A resolved single-tensor RoPE call."""

    layout: str
    interleaved: bool
    backward: bool
    dtype: str
    shape: tuple  # input (= output) shape
    d: int
    heads: int
    table: Table
    pos: Positions
    transpose_output: bool = False  # allocate bshd memory, return its sbhd view
    rot_off: int = 0  # first channel of the rotary slice (the positions API's rope_dim_offset)

    def launch(self, x: ArrayInfo, y: ArrayInfo, freqs: ArrayInfo, cu, sp, sm_count: int):
        """The :class:`cupy_rope._abi.LaunchSpec` of this call (x -> y)."""
        from ._worksplit import rope_launch

        return rope_launch([self], [(x, y)], freqs, cu, sp, sm_count)


def check_out(out: ArrayInfo | None, shape: tuple, dtype: str, ref: ArrayInfo, ref_name: str,
              inputs: dict, out_name: str = "out") -> None:
    """An explicit output: right shape/dtype/device, no self-overlap, no overlap with inputs
    other than being exactly the input (in place). ``out_name`` names it in errors (the input's
    own name when the call writes the input in place, e.g. ``inplace=True``)."""
    if out is None:
        return
    if tuple(out.shape) != tuple(shape):
        raise _err(out_name, f"shape {tuple(shape)}", f"shape {tuple(out.shape)}")
    if out.dtype != dtype:
        raise _terr(out_name, f"dtype {dtype}", out.dtype)
    check_same_device(ref_name, ref, {out_name: out})
    if out.size > 1 and any(s == 0 and n > 1 for n, s in zip(out.shape, out.strides)):
        raise _err(out_name, "a writable array without zero strides (elements must not overlap)",
                   f"strides {tuple(out.strides)}")
    if out.ptr == 0 or out.size == 0:
        return
    lo, hi = out.extent()
    for name, a in inputs.items():
        if a is None or a.ptr == 0 or a.size == 0:
            continue
        if a.ptr == out.ptr and tuple(a.strides) == tuple(out.strides) and name == ref_name:
            continue  # exactly the input: in-place is safe (each element read, then written, by one thread)
        alo, ahi = a.extent()
        if alo < hi and lo < ahi:
            raise _err(out_name, f"memory that does not overlap `{name}` (or exactly `{ref_name}` for in-place)",
                       "an overlapping array")


def resolve_rope(x: ArrayInfo, freqs: ArrayInfo, layout, interleaved, cu_seqlens, start_positions,
                 cp_size, cp_rank, out: ArrayInfo | None, backward: bool,
                 transpose_output_memory=False, x_name: str = "x") -> RopePlan:
    """Validate a single-tensor call (spec 7) and resolve it into a plan."""
    layout = check_layout(layout)
    interleaved = check_bool("interleaved", interleaved)
    transpose_output_memory = check_bool("transpose_output_memory", transpose_output_memory)
    check_float_input(x_name, x)
    want = 3 if layout == "thd" else 4
    if x.ndim != want:
        dims = "[t, h, d]" if layout == "thd" else f"[{', '.join(layout)}]"
        raise _err(x_name, f"a {want}-D tensor {dims} for layout {layout!r}", f"shape {tuple(x.shape)}")
    if transpose_output_memory:
        if layout != "sbhd":
            raise _err("transpose_output_memory", "True only with layout 'sbhd'", f"layout {layout!r}")
        if out is not None:
            raise _err("transpose_output_memory", "False when `out` is given", "True")
    check_same_device(x_name, x, {"freqs": freqs, "cu_seqlens": cu_seqlens,
                                  "start_positions": start_positions})
    d, heads = x.shape[-1], x.shape[-2]
    table = check_freqs("freqs", freqs, d)
    _, _, tokens_shape = split_tokens(layout, x.shape)
    pos = resolve_positions(layout, tokens_shape, {"freqs": table.rows}, cu_seqlens, start_positions,
                            cp_size, cp_rank, x_name)
    check_out(out, x.shape, x.dtype, x, x_name,
              {x_name: x, "freqs": freqs, "cu_seqlens": cu_seqlens, "start_positions": start_positions},
              out_name=x_name if out is x else "out")  # resolve_rope_pair passes the input itself
    return RopePlan(layout=layout, interleaved=interleaved, backward=backward, dtype=x.dtype,
                    shape=tuple(x.shape), d=d, heads=heads, table=table, pos=pos,
                    transpose_output=transpose_output_memory)


def _numpy_view(a: ArrayInfo):
    """A NumPy array header over ``a``'s address range (never read: for overlap arithmetic)."""
    import numpy as np

    isz = ITEMSIZE[a.dtype]

    class _Iface:
        __array_interface__ = {"shape": tuple(a.shape), "typestr": f"|V{isz}", "version": 3,
                               "strides": tuple(s * isz for s in a.strides), "data": (a.ptr, False)}

    return np.asarray(_Iface())


def shares_memory(a: ArrayInfo, b: ArrayInfo) -> bool:
    """Whether two arrays have an element in common (exact for strided views of one buffer, e.g.
    q and k sliced out of a fused projection; conservative when the exact answer is too costly)."""
    if a.size == 0 or b.size == 0 or a.ptr == 0 or b.ptr == 0:
        return False
    alo, ahi = a.extent()
    blo, bhi = b.extent()
    if ahi <= blo or bhi <= alo:
        return False
    import numpy as np

    try:
        return bool(np.shares_memory(_numpy_view(a), _numpy_view(b), max_work=10**6))
    except np.exceptions.TooHardError:  # pragma: no cover - pathological strides
        return True


def resolve_rope_pair(q: ArrayInfo, k: ArrayInfo, freqs: ArrayInfo, layout, interleaved, cu_seqlens,
                      start_positions, cp_size, cp_rank, inplace: bool, backward: bool,
                      names=("q", "k")) -> tuple[RopePlan, RopePlan]:
    """Validate a q-and-k call (one launch: same tokens, positions, table and dtype; head counts,
    head dims and strides may differ) and resolve it into one plan per tensor."""
    nq, nk = names
    pq = resolve_rope(q, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
                      q if inplace else None, backward, x_name=nq)
    check_same_device(nq, q, {nk: k})
    check_float_input(nk, k)
    if k.dtype != q.dtype:
        raise _terr(nk, f"the dtype of `{nq}` ({q.dtype})", k.dtype)
    if k.ndim != q.ndim or tuple(k.shape[:-2]) != tuple(q.shape[:-2]):
        raise _err(nk, f"the token dimensions of `{nq}` {tuple(q.shape[:-2])}, then heads and head dim",
                   f"shape {tuple(k.shape)}")
    pk = resolve_rope(k, freqs, layout, interleaved, cu_seqlens, start_positions, cp_size, cp_rank,
                      k if inplace else None, backward, x_name=nk)
    if inplace and shares_memory(q, k):
        raise _err(nk, f"memory that shares no element with `{nq}` (inplace=True writes both)",
                   "overlapping tensors")
    return pq, pk


@dataclass
class QkvPlan:
    """A resolved packed-QKV call (spec 6)."""

    layout: str
    interleaved: bool
    backward: bool
    dtype: str
    lead_shape: tuple  # token dims: (s, b) / (b, s) / (t,)
    groups: int
    n_q: int  # query heads per group
    d: int
    q_table: Table
    k_table: Table
    k_same_table: bool
    pos: Positions

    @property
    def packed_shape(self) -> tuple:
        return self.lead_shape + (self.groups, (self.n_q + 2) * self.d)

    @property
    def q_shape(self) -> tuple:
        return self.lead_shape + (self.groups * self.n_q, self.d)

    @property
    def kv_shape(self) -> tuple:
        return self.lead_shape + (self.groups, self.d)

    def launch(self, packed: ArrayInfo, q: ArrayInfo, k: ArrayInfo, v: ArrayInfo,
               q_freqs: ArrayInfo, k_freqs: ArrayInfo, cu, sp, sm_count: int):
        """The :class:`cupy_rope._abi.LaunchSpec` of this call."""
        from ._worksplit import qkv_launch

        return qkv_launch(self, packed, q, k, v, q_freqs, k_freqs, cu, sp, sm_count)


def check_split(split) -> tuple[int, int, int]:
    """``split``: a sequence of three positive ints ``(q_size, k_size, v_size)``."""
    import numpy as np

    try:
        ok = not isinstance(split, (str, bytes)) and len(split) == 3 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in split)
    except TypeError:  # no length (None, a number, a 0-d array)
        ok = False
    if not ok:
        raise _terr("split", "three ints (q_size, k_size, v_size)", repr(split))
    sizes = tuple(int(v) for v in split)
    if min(sizes) < 1:
        raise _err("split", "three sizes >= 1 (q_size, k_size, v_size)", repr(sizes))
    return sizes


def qkv_heads(split, num_q_heads, groups: int, width: int, arg: str) -> tuple[int, int]:
    """(query heads per group n, head dim d) from ``split`` or ``num_q_heads`` (spec 6)."""
    if (split is None) == (num_q_heads is None):
        raise _err("split", "exactly one of `split` and `num_q_heads`",
                   "both" if split is not None else "neither")
    if split is not None:
        sizes = check_split(split)
        q_size, k_size, v_size = sizes
        if q_size + k_size + v_size != width:
            raise _err("split", f"sizes adding up to the last dimension of `{arg}` ({width})",
                       f"{sizes} (sum {q_size + k_size + v_size})")
        d = k_size
        if v_size != d or q_size % d:
            raise _err("split", "q_size a multiple of the head dim d = k_size = v_size",
                       f"{sizes}")
        return q_size // d, d
    num_q_heads = check_int("num_q_heads", num_q_heads, lo=1)
    if groups == 0:
        raise _err(arg, "at least one KV group (dimension -2) when `num_q_heads` is given", "g = 0")
    if num_q_heads % groups:
        raise _err("num_q_heads", f"a multiple of the number of groups g = {groups}", num_q_heads)
    n = num_q_heads // groups
    if width % (n + 2):
        raise _err("num_q_heads", f"a value for which the last dimension of `{arg}` ({width}) splits into "
                   f"n + 2 = {n + 2} heads per group", num_q_heads)
    return n, width // (n + 2)


def check_qkv_ndim(shape, layout: str) -> None:
    """A packed projection's rank for ``layout`` (a checked layout)."""
    want = 3 if layout == "thd" else 4
    if len(shape) != want:
        dims = "[t, g, (n+2)*d]" if layout == "thd" else f"[{', '.join(layout[:2])}, g, (n+2)*d]"
        raise _err("qkv", f"a {want}-D tensor {dims} for layout {layout!r}", f"shape {tuple(shape)}")


def qkv_split(shape, split, num_q_heads, layout) -> tuple[int, int, int]:
    """``(q_size, k_size, v_size)`` of a packed projection of ``shape`` ``[.., g, (n + 2) * d]``
    from ``split`` or ``num_q_heads`` (the framework shims' static split), the layout and rank
    checked first, as :func:`resolve_qkv` does."""
    check_qkv_ndim(shape, check_layout(layout))
    n, d = qkv_heads(split, num_q_heads, shape[-2], shape[-1], "qkv")
    return (n * d, d, d)


def _qkv_common(layout, lead_shape, groups, n, d, ref: ArrayInfo, ref_name, q_freqs, k_freqs,
                interleaved, cu_seqlens, start_positions, cp_size, cp_rank, backward) -> QkvPlan:
    check_same_device(ref_name, ref, {"q_freqs": q_freqs, "k_freqs": k_freqs,
                                      "cu_seqlens": cu_seqlens, "start_positions": start_positions})
    qt = check_freqs("q_freqs", q_freqs, d)
    kt = check_freqs("k_freqs", k_freqs, d)
    if qt.d2 != kt.d2:
        raise _err("k_freqs", f"the rotary width of `q_freqs` (d2 = {qt.d2})", f"d2 = {kt.d2}")
    same = q_freqs.ptr == k_freqs.ptr and qt == kt and q_freqs.ptr != 0
    tokens_shape = split_tokens(layout, lead_shape + (0,))[2]
    pos = resolve_positions(layout, tokens_shape, {"q_freqs": qt.rows, "k_freqs": kt.rows}, cu_seqlens,
                            start_positions, cp_size, cp_rank, x_name=ref_name)
    return QkvPlan(layout=layout, interleaved=interleaved, backward=backward, dtype=ref.dtype,
                   lead_shape=tuple(lead_shape), groups=groups, n_q=n, d=d, q_table=qt,
                   k_table=kt, k_same_table=same, pos=pos)


def resolve_qkv(qkv: ArrayInfo, q_freqs, k_freqs, split, layout, num_q_heads, interleaved,
                cu_seqlens, start_positions, cp_size, cp_rank) -> QkvPlan:
    """Validate the packed-QKV forward (spec 6, 7)."""
    layout = check_layout(layout)
    interleaved = check_bool("interleaved", interleaved)
    check_float_input("qkv", qkv)
    check_qkv_ndim(qkv.shape, layout)
    groups, width = qkv.shape[-2], qkv.shape[-1]
    n, d = qkv_heads(split, num_q_heads, groups, width, "qkv")
    return _qkv_common(layout, tuple(qkv.shape[:-2]), groups, n, d, qkv, "qkv", q_freqs, k_freqs,
                       interleaved, cu_seqlens, start_positions, cp_size, cp_rank, backward=False)


def resolve_qkv_backward(dq: ArrayInfo, dk: ArrayInfo, dv: ArrayInfo, q_freqs, k_freqs, split,
                         layout, num_q_heads, interleaved, cu_seqlens, start_positions, cp_size,
                         cp_rank) -> QkvPlan:
    """Validate the packed-QKV backward: dq [.., g*n, d], dk/dv [.., g, d] -> dqkv."""
    layout = check_layout(layout)
    interleaved = check_bool("interleaved", interleaved)
    n, d = qkv_backward_heads(dq, dk, dv, split, layout, num_q_heads)
    return _qkv_common(layout, tuple(dq.shape[:-2]), dk.shape[-2], n, d, dq, "dq", q_freqs, k_freqs,
                       interleaved, cu_seqlens, start_positions, cp_size, cp_rank, backward=True)


def qkv_backward_heads(dq: ArrayInfo, dk: ArrayInfo, dv: ArrayInfo, split, layout: str,
                       num_q_heads) -> tuple[int, int]:
    """(query heads per group n, head dim d) of the packed-QKV backward's gradients, checked (their
    dtypes, ranks for ``layout``, devices, shapes; ``split``/``num_q_heads`` against them)."""
    want = 3 if layout == "thd" else 4
    for name, a in (("dq", dq), ("dk", dk), ("dv", dv)):
        check_float_input(name, a)
        if a.ndim != want:
            raise _err(name, f"a {want}-D tensor for layout {layout!r}", f"shape {tuple(a.shape)}")
    check_same_device("dq", dq, {"dk": dk, "dv": dv})
    for name, a in (("dk", dk), ("dv", dv)):
        if a.dtype != dq.dtype:
            raise _terr(name, f"the dtype of `dq` ({dq.dtype})", a.dtype)
        if tuple(a.shape[:-2]) != tuple(dq.shape[:-2]) or a.shape[-1] != dq.shape[-1]:
            raise _err(name, f"shape {tuple(dq.shape[:-2]) + ('g', dq.shape[-1])} matching `dq`",
                       f"shape {tuple(a.shape)}")
    if tuple(dv.shape) != tuple(dk.shape):
        raise _err("dv", f"the shape of `dk` {tuple(dk.shape)}", f"shape {tuple(dv.shape)}")
    groups, d = dk.shape[-2], dk.shape[-1]
    if groups == 0:  # no KV groups: only the split defines the packed width
        if dq.shape[-2]:
            raise _err("dq", "no heads when `dk` has no groups (g = 0)", f"{dq.shape[-2]} heads")
        if split is None:
            raise _err("split", "(q_size, k_size, v_size) when there are no KV groups (g = 0): the "
                       "gradients' shapes do not define the packed width", "None")
        n, d2 = qkv_heads(split, None, 0, sum(check_split(split)), "dqkv")
        if d2 != d:
            raise _err("split", f"k_size = v_size = the head dim of `dk` ({d})", repr(tuple(split)))
    else:
        if dq.shape[-2] % groups:
            raise _err("dq", f"a head count that is a multiple of the groups g = {groups}",
                       f"{dq.shape[-2]} heads")
        n = dq.shape[-2] // groups
        if split is not None or num_q_heads is not None:
            n2, d2 = qkv_heads(split, num_q_heads, groups, (n + 2) * d, "dqkv")
            if (n2, d2) != (n, d):
                raise _err("split" if split is not None else "num_q_heads",
                           f"a split matching the gradients (n = {n} query heads per group, d = {d})",
                           f"n = {n2}, d = {d2}")
    return n, d


# ------------------------------------------------------------------------ the positions API
def check_cos_sin_cache(name: str, c: ArrayInfo, x_dtype: str, d: int, rot_off: int) -> Table:
    """A cos/sin cache ``[max_pos, rotary_dim]`` (cos in the first half, sin in the second),
    float32 or the tensors' dtype."""
    if c.dtype not in ("float32", x_dtype):
        raise _terr(name, f"dtype float32 or the query's dtype {x_dtype}", c.dtype)
    if c.ndim != 2:
        raise _err(name, "shape [max_pos, rotary_dim]", f"shape {tuple(c.shape)}")
    return Table(rows=c.shape[0], d2=_rotary_dim(name, c.shape[1], d, rot_off), srow=c.strides[0],
                 scol=c.strides[1], kind="cos_sin", dtype=c.dtype)


def check_inv_freq(name: str, f: ArrayInfo, d: int, rot_off: int) -> Table:
    """Inverse frequencies ``[rotary_dim / 2]``, float32 or float64 (pair i of a token at position
    p turns by p * inv_freq[i], formed in float64)."""
    if f.dtype not in ("float32", "float64"):
        raise _terr(name, "dtype float32 or float64", f.dtype)
    if f.ndim != 1:
        raise _err(name, "shape [rotary_dim / 2]", f"shape {tuple(f.shape)}")
    return Table(rows=INV_FREQ_ROWS, d2=_rotary_dim(name, 2 * f.shape[0], d, rot_off), srow=0,
                 scol=f.strides[0], kind="inv_freq", dtype=f.dtype)


def _rotary_dim(name: str, d2: int, d: int, rot_off: int) -> int:
    if d2 % 2:
        raise _err(name, "an even rotary width (last dimension)", f"rotary_dim = {d2}")
    if rot_off + d2 > d:
        raise _err(name, f"rope_dim_offset + rotary_dim <= head_size = {d} (rope_dim_offset = {rot_off})",
                   f"rotary_dim = {d2}")
    return d2


TABLE_ARGS = ("cos_sin_cache", "freqs", "inv_freq")


def pick_table(tables: dict):
    """(name, array) of the one table given among ``cos_sin_cache``, ``freqs``, ``inv_freq``."""
    given = [(n, a) for n, a in tables.items() if a is not None]
    if len(given) != 1:
        raise _err("cos_sin_cache", "exactly one of `cos_sin_cache`, `freqs`, `inv_freq`",
                   ", ".join(f"`{n}`" for n, _ in given) if given else "none")
    return given[0]


def head_view(a: ArrayInfo, head_size, name: str, ntok: int) -> ArrayInfo:
    """``a`` as ``[tokens.., h, d]``: as is when it has a head dimension, else its last dimension
    ``h * head_size`` split (a view: no copy)."""
    if a.ndim == ntok + 2:
        if head_size is not None and a.shape[-1] != head_size:
            raise _err(name, f"head dimension head_size = {head_size}", f"shape {tuple(a.shape)}")
        return a
    if a.ndim != ntok + 1:
        raise _err(name, f"[tokens.., heads, head_size] or [tokens.., heads * head_size] with the token "
                   f"dimensions of `positions` ({ntok}-D)", f"shape {tuple(a.shape)}")
    if head_size is None:
        raise _err("head_size", f"the head size, to split the last dimension of `{name}` "
                   f"{tuple(a.shape)}", "None")
    width = a.shape[-1]
    if width % head_size:  # head_size >= 1 (checked by the caller)
        raise _err("head_size", f"a divisor of the last dimension of `{name}` ({width})", head_size)
    sd = a.strides[-1]
    return ArrayInfo(tuple(a.shape[:-1]) + (width // head_size, head_size),
                     tuple(a.strides[:-1]) + (head_size * sd, sd), a.dtype, a.device, a.ptr)


def resolve_ids(positions: ArrayInfo, name: str = "positions") -> Positions:
    """Per-token positions ``[t]`` or ``[b, s]``, int32/int64, any strides and values."""
    if positions.dtype not in INDEX_DTYPES:
        raise _terr(name, "dtype int32 or int64", positions.dtype)
    if positions.ndim not in (1, 2):
        raise _err(name, "shape [t] or [b, s]", f"shape {tuple(positions.shape)}")
    return Positions(layout="thd" if positions.ndim == 1 else "bshd", seq_len=0, nseq=0, cp_size=1,
                     cp_rank=0, has_cu=False, has_sp=False, cu_is64=False, sp_is64=False, has_ids=True,
                     ids_is64=positions.dtype == "int64")


def resolve_rope_pos(positions: ArrayInfo, q: ArrayInfo, k: ArrayInfo | None, tables: dict, head_size,
                     interleaved, rope_dim_offset, inverse, inplace, names=("query", "key")):
    """Validate a positions-API call and resolve it: ``(plans, views, table_name)``, one plan and
    one ``[tokens.., h, d]`` view per tensor (q, and k when given)."""
    interleaved = check_bool("is_neox" if names[0] == "query" else "interleaved", interleaved)
    inverse = check_bool("inverse", inverse)
    inplace = check_bool("inplace", inplace)
    rot_off = check_int("rope_dim_offset", rope_dim_offset, lo=0)
    if head_size is not None:
        head_size = check_int("head_size", head_size, lo=1)
    pos = resolve_ids(positions)
    ntok = positions.ndim
    tname, tinfo = pick_table(tables)
    plans, views = [], []
    for n, a in zip(names, (q, k)):
        if a is None:
            continue
        check_float_input(n, a)
        if a.dtype != q.dtype:
            raise _terr(n, f"the dtype of `{names[0]}` ({q.dtype})", a.dtype)
        v = head_view(a, head_size, n, ntok)
        if tuple(v.shape[:ntok]) != tuple(positions.shape):
            raise _err(n, f"token dimensions {tuple(positions.shape)} (the shape of `positions`)",
                       f"shape {tuple(a.shape)}")
        check_same_device(names[0], q, {n: a, "positions": positions, tname: tinfo})
        d = v.shape[-1]
        if tname == "cos_sin_cache":
            table = check_cos_sin_cache(tname, tinfo, q.dtype, d, rot_off)
        elif tname == "inv_freq":
            table = check_inv_freq(tname, tinfo, d, rot_off)
        else:
            table = check_freqs(tname, tinfo, d - rot_off)
        if inplace:
            check_out(v, v.shape, v.dtype, v, n, {n: v, "positions": positions, tname: tinfo}, out_name=n)
        plans.append(RopePlan(layout=pos.layout, interleaved=interleaved, backward=inverse, dtype=q.dtype,
                              shape=tuple(a.shape), d=d, heads=v.shape[-2], table=table, pos=pos,
                              rot_off=rot_off))
        views.append(v)
    if inplace and k is not None and shares_memory(views[0], views[1]):
        raise _err(names[1], f"memory that shares no element with `{names[0]}` (in place writes both)",
                   "overlapping tensors")
    return plans, views, tname

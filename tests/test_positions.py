"""The positions API (serving side): per-token positions, cos/sin caches, angle tables and
inverse frequencies, q and k in one launch, GQA, flattened heads, strided views, a rotary slice
at an offset, inverse, in place; every backend against the independent float64 reference
(cupy_rope.testing.rope_pos_ref). Replay a case: its id holds the seed."""

from decimal import Decimal, getcontext

import numpy as np
import pytest

import cupy_rope
import cupy_rope.flashinfer as cfi
import cupy_rope.vllm as crv
from cupy_rope import _interop, _kernels, _plan, _worksplit
from cupy_rope._dev import hostkernels
from cases import part_threads, split_in_chunks, use_lean
from reference import NP_DTYPES, assert_close_to_ref
from cupy_rope.testing import rope_pos_ref

KINDS = ("cos_sin", "cos_sin_t", "angles", "inv64", "inv32")
DTYPES = ("float32", "float16", "bfloat16")


class PosCase:
    """One randomized call, fully determined by ``seed``: options varied independently."""

    def __init__(self, seed: int):
        r = np.random.default_rng(seed)
        self.seed = seed
        self.dtype = DTYPES[seed % 3]
        self.kind = KINDS[(seed // 3) % len(KINDS)]
        self.interleaved = bool(r.integers(2))
        self.inverse = bool(r.integers(2))
        self.with_k = bool(r.integers(4))  # k = None one time in four
        # (d, d2, offset); (136, 64, 8): a tail unit's two vectors on both sides of the slice
        d, d2, off = [(64, 64, 0), (128, 64, 64), (96, 32, 16), (80, 80, 0), (64, 32, 0), (48, 16, 8),
                      (16, 2, 6), (136, 64, 8)][r.integers(8)]
        self.d, self.d2, self.off = d, d2, off
        self.tok = [(7,), (3, 5), (1,), (0,)][r.choice(4, p=[0.5, 0.35, 0.1, 0.05])]
        self.hq, self.hk = int(r.integers(1, 5)), int(r.integers(1, 3))
        self.style = ["heads", "flat", "fused", "chan"][r.integers(4)]
        self.rows = int(r.integers(1, 40))
        self.pos_dtype = ["int32", "int64"][r.integers(2)]
        self.pos_stride = int(r.integers(1, 3))
        # 2-D tables: dense, a view whose rows start one element past a 16-byte boundary (most
        # rows off the grid), or every other column of a wider array (caches: the kernels' whole
        # 16-byte loads only where a row's columns are contiguous and on the grid)
        self.table_view = ["dense", "offset", "strided"][r.choice(3, p=[0.5, 0.25, 0.25])]
        self.rng = r

    def __repr__(self):
        return (f"seed{self.seed}-{self.dtype}-{self.kind}-{'il' if self.interleaved else 'nx'}"
                f"{'-inv' if self.inverse else ''}-{self.style}-d{self.d}x{self.d2}@{self.off}-tok{self.tok}"
                f"{'' if self.table_view == 'dense' else '-table_' + self.table_view}")

    def arrays(self):
        """(positions, q, k, {table name: table}, head_size, table kind, rows) as NumPy arrays;
        q/k laid out per ``style``; positions from -2 to past the table."""
        r, npdt = self.rng, NP_DTYPES[self.dtype]
        n = int(np.prod(self.tok))
        pos = r.integers(-2, self.rows + 3, size=n * self.pos_stride).astype(self.pos_dtype)
        pos = pos[:: self.pos_stride].reshape(self.tok) if n else pos[:0].reshape(self.tok)
        hq, hk, d = self.hq, self.hk, self.d

        def rand(shape):
            return r.uniform(-2, 2, shape).astype(npdt)

        head_size = None
        if self.style == "heads":
            q, k = rand(self.tok + (hq, d)), rand(self.tok + (hk, d))
        elif self.style == "flat":
            q, k, head_size = rand(self.tok + (hq * d,)), rand(self.tok + (hk, d)), d
        elif self.style == "fused":  # q and k are views of one [tokens, (hq + 2hk) * d] projection
            qkv = rand(self.tok + ((hq + 2 * hk) * d,))
            q, k, head_size = qkv[..., : hq * d], qkv[..., hq * d: (hq + hk) * d], d
        else:  # channel stride h: heads and channels swapped in memory
            q = np.swapaxes(rand(self.tok + (d, hq)), -1, -2)
            k = np.swapaxes(rand(self.tok + (d, hk)), -1, -2)
        d2 = self.d2
        if self.kind in ("cos_sin", "cos_sin_t"):
            ang = r.uniform(-20, 20, (self.rows, d2 // 2))
            table = np.concatenate([np.cos(ang), np.sin(ang)], axis=1)
            table = table.astype(np.float32 if self.kind == "cos_sin" else npdt)
            name, kind, rows = "cos_sin_cache", "cos_sin", self.rows
        elif self.kind == "angles":
            table = r.uniform(-20, 20, (self.rows, d2)).astype(np.float32)
            name, kind, rows = "freqs", "angles", self.rows
        else:
            table = 10000.0 ** -(np.arange(0, d2, 2) / d2) * r.uniform(0.5, 2)
            table = table.astype(np.float64 if self.kind == "inv64" else np.float32)
            name, kind, rows = "inv_freq", "inv_freq", _plan.INV_FREQ_ROWS
        if table.ndim == 2 and self.table_view != "dense":
            wide = np.full((table.shape[0], 2 * table.shape[1] + 1), np.nan, table.dtype)
            view = wide[:, 1: 1 + table.shape[1]] if self.table_view == "offset" else wide[:, 1::2]
            view[...] = table
            table = view
        return pos, q, (k if self.with_k else None), {name: table}, head_size, kind, rows

    def check(self, pos, q, k, tables, kind, rows, qo, ko, head_size):
        """Outputs against the reference, for q and (when given) k."""
        table = next(iter(tables.values()))
        for name, x, y in (("q", q, qo), ("k", k, ko)):
            if x is None:
                assert y is None
                continue
            xv = np.asarray(x).reshape(self.tok + (self.hq if name == "q" else self.hk, self.d))
            ref = rope_pos_ref(xv, pos, kind, table, rows, self.interleaved, self.off, self.inverse)
            y = np.asarray(y)
            assert y.shape == np.asarray(x).shape, (name, y.shape)
            scale = np.abs(xv.astype(np.float64))
            rot = slice(self.off, self.off + self.d2)
            scale[..., rot] += scale[..., rot].max(axis=-1, keepdims=True) if self.d2 else 0
            assert_close_to_ref(y.reshape(xv.shape), ref, xv, self.d2, self.dtype, f"{self!r} {name}",
                                scale=scale)
            # tokens outside the table and channels outside the slice: bit-exact copies
            p = np.asarray(pos).astype(np.int64)
            out = (p < 0) | (p >= rows)
            yv = y.reshape(xv.shape)
            _same_bits(yv[out], xv[out])
            keep = np.r_[0:self.off, self.off + self.d2:self.d]
            _same_bits(yv[..., keep], xv[..., keep])


CASES = [PosCase(s) for s in range(150)]


def _call(pos, q, k, tables, head_size, case, inplace=False):
    return cupy_rope.apply_rope_pos(pos, q, k, **tables, head_size=head_size, interleaved=case.interleaved,
                                    rope_dim_offset=case.off, inverse=case.inverse, inplace=inplace)


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_numpy_backend(case):
    pos, q, k, tables, hs, kind, rows = case.arrays()
    q0, k0 = q.copy(), None if k is None else k.copy()
    qo, ko = _call(pos, q, k, tables, hs, case)
    case.check(pos, q, k, tables, kind, rows, qo, ko, hs)
    _same_bits(q, q0)  # inputs untouched
    if k is not None:
        _same_bits(k, k0)


def _same_bits(a, b):
    np.testing.assert_array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


@pytest.mark.parametrize("kernel", ["one_row", "one_row_streaming", "max_rows", "two_chunks", "two_rows", "lean"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_host_kernels(case, kernel, monkeypatch):
    """The CUDA source, run on the CPU by the host build, through the launch plan of the GPU path;
    outputs poisoned with NaN first (every element must be written). Each case on the one-row
    kernels (rope1 for angle tables, rope1c for cos/sin caches; inverse frequencies take the
    streaming kernel), on the streaming kernel given one row per thread, with all rows in one
    thread, with two chunks per token (threads stepping over every other head), on the two-row
    kernel (rope2c: cos/sin caches with 16-byte vectors; the others stream) and on the lean
    kernel (ropel: angle tables with contiguous columns, full rotary rows, 16-byte vectors)."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9 if kernel.startswith("one_row") else 1)
    monkeypatch.setattr(_worksplit, "_ODD_UNITS_FACTOR", 1)
    monkeypatch.setattr(_worksplit, "_ONE_ROW", kernel == "one_row")
    monkeypatch.setattr(_worksplit, "_TWO_ROWS", kernel == "two_rows")
    use_lean(monkeypatch, kernel == "lean")
    if kernel == "two_chunks":
        split_in_chunks(monkeypatch, 2)
    names, orig = [], hostkernels.launch
    monkeypatch.setattr(hostkernels, "launch", lambda name, *a: names.append(name) or orig(name, *a))
    pos, q, k, tables, hs, kind, rows = case.arrays()
    hostkernels.cache_vector_count(), hostkernels.position_first_count()  # reset
    outs = _run_host(case, pos, q, k, tables, hs)
    case.check(pos, q, k, tables, kind, rows, outs[0].reshape(q.shape),
               None if k is None else outs[1].reshape(k.shape), hs)
    streaming = ("rope_", "ropem_")  # ropem: rows with pass-through channels, 16-byte vectors
    want = {"angles": "rope1_", "cos_sin": "rope1c_"}.get(kind, streaming) if kernel == "one_row" else streaming
    vec16 = bool(names) and names[0].split("_")[2] == "v%d" % (16 // q.itemsize)
    if kernel == "two_rows" and kind == "cos_sin" and vec16:
        want = "rope2c_"
    if kernel == "lean" and kind == "angles" and vec16 and case.d2 == case.d and case.table_view != "strided":
        want = "ropel_"
    assert all(n.startswith(want) for n in names), (kind, names)
    # the one-row cache kernel, and only it, loads the token's position before the row's vectors
    assert (hostkernels.position_first_count() > 0) == any(n.startswith("rope1c_") for n in names), names
    # a cache's cos/sin runs in whole 16-byte loads: only with 16-byte element vectors and
    # contiguous columns; a dense cache whose half rows are whole vectors gives them to its
    # first unit at least, wherever a position falls in the table
    vectors = hostkernels.cache_vector_count()
    esz = 4 if case.kind == "cos_sin" or q.itemsize == 4 else 2
    p = np.asarray(pos).astype(np.int64)
    if kind != "cos_sin" or case.table_view == "strided" or not vec16:
        assert vectors == 0
    elif case.table_view == "dense" and case.d2 // 2 * esz % 16 == 0 and ((p >= 0) & (p < rows)).any():
        assert vectors > 0


@pytest.mark.parametrize("pos_dtype", [np.int32, np.int64])
def test_host_one_row_cache_kernel_negative_positions_past_2_31_rows(pos_dtype, monkeypatch):
    """The one-row cache kernel loads an int32 position raw (zero-extended) and widens it after
    the row's vectors: a negative position must still be outside the table, also one with more
    than 2^32 rows (a row-stride-0 view: one row of memory), where the raw value of -1 would be a
    row inside it. Host build against the NumPy backend; negative positions leave the token as it
    is, the others read the one row."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9)
    monkeypatch.setattr(_worksplit, "_ONE_ROW", True)
    rng = np.random.default_rng(11)
    d = 64
    row = cupy_rope.rope_cos_sin_cache(d, 8)[5:6]
    table = np.lib.stride_tricks.as_strided(row, (2**32 + 8, d), (0, row.strides[1]))
    pos = np.array([-1, 3, -5, 2**31 - 1, -(2**31), 2], pos_dtype)
    q = rng.standard_normal((6, 2, d)).astype(np.float32)
    infos = {n: None for n in _plan.TABLE_ARGS}
    infos["cos_sin_cache"] = _interop.info(table, "numpy")
    plans, _, _ = _plan.resolve_rope_pos(_interop.info(pos, "numpy"), _interop.info(q, "numpy"), None, infos,
                                         None, False, 0, False, False)
    names, orig = [], hostkernels.launch
    monkeypatch.setattr(hostkernels, "launch", lambda name, *a: names.append(name) or orig(name, *a))
    got = hostkernels.run_rope_pos(plans, [q], table, pos, (np.full(q.shape, np.nan, q.dtype),))[0]
    assert names and all(n.startswith("rope1c_") for n in names), names
    neg = pos < 0
    _same_bits(got[neg], q[neg])
    assert (got[~neg] != q[~neg]).any()
    _same_bits(got, cupy_rope.apply_rope_pos(pos, q, None, cos_sin_cache=table)[0])


def _run_host(case, pos, q, k, tables, hs):
    """The call's launch on the host build (q and k as ``[tokens.., h, d]`` views), outputs
    poisoned with NaN first (every element must be written)."""
    (tname, table), = tables.items()
    infos = {n: None for n in _plan.TABLE_ARGS}
    infos[tname] = _interop.info(table, "numpy")
    plans, views, _ = _plan.resolve_rope_pos(_interop.info(pos, "numpy"), _interop.info(q, "numpy"),
                                             _interop.info(k, "numpy") if k is not None else None, infos, hs,
                                             case.interleaved, case.off, case.inverse, False)
    xs = [a.reshape(v.shape) if a.ndim != len(v.shape) else a for a, v in zip((q, k), views)]
    return hostkernels.run_rope_pos(plans, xs, table, pos, tuple(np.full(x.shape, np.nan, x.dtype) for x in xs))


@pytest.mark.parametrize("case", [c for c in CASES if c.kind in ("angles", "cos_sin", "cos_sin_t")], ids=repr)
def test_one_row_kernels_are_bit_identical_to_streaming_kernel(case, monkeypatch):
    """The one-row kernels (angle tables, cos/sin caches) and the two-row kernel (cos/sin caches)
    are the streaming kernel's arithmetic in another order: on the host build (no FMA contraction)
    the same bits, with blocks of any size (``_ONE_ROW_BLOCK``)."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9)
    arrays = case.arrays()[:5]
    got = []
    for one_row, two_rows, block in ((True, False, 32), (True, False, 64), (True, False, _kernels.BLOCK),
                                     (False, True, 64), (False, False, 64)):
        monkeypatch.setattr(_worksplit, "_ONE_ROW", one_row)
        monkeypatch.setattr(_worksplit, "_TWO_ROWS", two_rows)
        monkeypatch.setattr(_worksplit, "_ONE_ROW_BLOCK", block)
        got.append(_run_host(case, *arrays))
    for outs in got[:-1]:
        for a, b in zip(outs, got[-1]):
            _same_bits(a, b)


def test_fast_divisor_matches_integer_division():
    """The one-row kernels' thread-index division (multiply-high, add, shift; ``fast_div`` in the
    CUDA source): exact for every dividend below 2^31 and divisor in [1, 2^31], checked at the
    edges and at random; other divisors are refused."""
    rng = np.random.default_rng(7)
    ds = list(range(1, 600)) + [2**k + e for k in range(1, 32) for e in (-1, 0, 1) if 2**k + e <= 2**31]
    ds += [int(d) for d in rng.integers(1, 2**31, 500)]
    for d in ds:
        magic = _worksplit.fast_divisor(d)
        m, sh = magic & 0xFFFFFFFF, magic >> 32
        assert m < 2**32 and sh <= 31
        ns = np.array([0, 1, d - 1, d, d + 1, 2 * d - 1, 2**31 - 1, 2**31 - 1 - (2**31 - 1) % d]
                      + [int(n) for n in rng.integers(0, 2**31, 64)], dtype=np.int64)
        ns = ns[(ns >= 0) & (ns < 2**31)]
        got = (((ns * m) >> 32) + ns) >> sh  # below 2^63: exact in int64
        np.testing.assert_array_equal(got, ns // d, err_msg=f"divisor {d}")
    for d in (0, -3, 2**31 + 1):
        with pytest.raises(ValueError, match="fast divisor out of range"):
            _worksplit.fast_divisor(d)


@pytest.mark.parametrize("margin", [0, -1], ids=["at_the_limit", "past_the_limit"])
def test_one_row_kernels_only_with_31_bit_thread_indices(margin, monkeypatch):
    """Launches whose thread indices reach ``_ONE_ROW_THREADS`` (2^31: the one-row kernels' 32-bit
    index arithmetic) run on the streaming kernel, with the same results; a launch exactly at
    the limit still runs the one-row kernel (limit lowered to each case's launch size). One vector
    width (``_ONE_ROW_ANGLE_VEC`` off): narrowed, a launch past the limit would take the wider one."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9)
    monkeypatch.setattr(_worksplit, "_ONE_ROW_ANGLE_VEC", 0)
    monkeypatch.setattr(_worksplit, "_TWO_ROWS", False)  # past the limit: the streaming kernel
    names, orig = [], hostkernels.launch
    monkeypatch.setattr(hostkernels, "launch", lambda name, *a: names.append((name, part_threads(*a[1:]))) or orig(name, *a))
    for case in [c for c in CASES if c.kind in ("angles", "cos_sin")][:6]:
        pos, q, k, tables, hs, kind, rows = case.arrays()
        monkeypatch.setattr(_worksplit, "_ONE_ROW_THREADS", 2**31)
        del names[:]
        _run_host(case, pos, q, k, tables, hs)
        (name, threads), = names  # blocks x threads per block
        assert name.startswith("rope1"), name
        monkeypatch.setattr(_worksplit, "_ONE_ROW_THREADS", threads + margin)
        del names[:]
        outs = _run_host(case, pos, q, k, tables, hs)
        case.check(pos, q, k, tables, kind, rows, outs[0].reshape(q.shape),
                   None if k is None else outs[1].reshape(k.shape), hs)
        (name, _), = names
        assert name.startswith("rope1" if margin == 0 else ("rope_", "ropem_")), (margin, name)


@pytest.mark.parametrize("margin", [0, -1], ids=["at_the_limit", "past_the_limit"])
def test_two_row_kernel_only_with_31_bit_thread_indices(margin, monkeypatch):
    """The two-row kernel (cos/sin caches, 16-byte vectors) shares the one-row kernels' 32-bit index
    arithmetic: a launch whose thread indices reach ``_ONE_ROW_THREADS`` (lowered to each case's
    launch size) runs the streaming kernel, with the same results; one exactly at the limit still
    runs the two-row kernel, in blocks of ``_kernels.BLOCK``."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 1)
    monkeypatch.setattr(_worksplit, "_TWO_ROWS", True)
    names, orig = [], hostkernels.launch
    monkeypatch.setattr(hostkernels, "launch", lambda name, *a: names.append((name, part_threads(*a[1:]), a[1]))
                        or orig(name, *a))
    seen = 0
    for case in [c for c in CASES if c.kind in ("cos_sin", "cos_sin_t")]:
        pos, q, k, tables, hs, kind, rows = case.arrays()
        monkeypatch.setattr(_worksplit, "_ONE_ROW_THREADS", 2**31)
        del names[:]
        _run_host(case, pos, q, k, tables, hs)
        if not names or not names[0][0].startswith("rope2c_"):
            continue  # no tokens, or narrower vectors: the streaming kernel
        (name, threads, block), = names
        seen += 1
        assert block == _kernels.BLOCK, (name, block)
        monkeypatch.setattr(_worksplit, "_ONE_ROW_THREADS", threads + margin)
        del names[:]
        outs = _run_host(case, pos, q, k, tables, hs)
        case.check(pos, q, k, tables, kind, rows, outs[0].reshape(q.shape),
                   None if k is None else outs[1].reshape(k.shape), hs)
        (name, _, _), = names
        assert name.startswith("rope2c_" if margin == 0 else ("rope_", "ropem_")), (margin, name)
        if seen == 6:
            break
    assert seen == 6, seen


@pytest.mark.parametrize("case", CASES[:60], ids=repr)
def test_in_place(case):
    pos, q, k, tables, hs, kind, rows = case.arrays()
    q0, k0 = q.copy(), None if k is None else k.copy()
    if case.style == "fused":  # views of one buffer: written where they are
        qw, kw = q, k
    else:
        qw, kw = _relaid(q), None if k is None else _relaid(k)
    qo, ko = _call(pos, qw, kw, tables, hs, case, inplace=True)
    assert qo is qw and ko is kw
    case.check(pos, q0, k0, tables, kind, rows, qw, kw, hs)


def _relaid(a):
    """A writable copy of ``a`` with its dimensions in the same memory order."""
    b = np.empty_like(a)  # order "K": keeps the order of a's strides
    b[...] = a
    return b


@pytest.mark.parametrize("case", CASES[:40], ids=repr)
def test_torch_cpu(case):
    torch = pytest.importorskip("torch")
    import cupy_rope.torch as crt

    pos, q, k, tables, hs, kind, rows = case.arrays()
    tt = {n: _interop.from_numpy(np.ascontiguousarray(t), "torch") for n, t in tables.items()}

    def tor(a):
        return None if a is None else _interop.from_numpy(np.ascontiguousarray(a), "torch")

    qo, ko = crt.apply_rope_pos(tor(pos), tor(q), tor(k), **tt, head_size=hs, interleaved=case.interleaved,
                                rope_dim_offset=case.off, inverse=case.inverse)
    conv = (lambda t: None if t is None else _interop.to_numpy(t, "torch"))
    case.check(pos, q, k, tables, kind, rows, conv(qo), conv(ko), hs)
    assert isinstance(qo, torch.Tensor) and (ko is None) == (k is None)


def test_torch_autograd_and_compile():
    torch = pytest.importorskip("torch")
    import cupy_rope.torch as crt

    g = torch.Generator().manual_seed(0)
    cache = torch.from_numpy(cupy_rope.rope_cos_sin_cache(64, 32))
    pos = torch.tensor([3, 0, 31, 40, -1])
    q = torch.randn(5, 4 * 64, generator=g, requires_grad=True)
    k = torch.randn(5, 2, 64, generator=g, requires_grad=True)
    qo, ko = crt.apply_rope_pos(pos, q, k, cos_sin_cache=cache, head_size=64)
    wq, wk = torch.randn(qo.shape, generator=g), torch.randn(ko.shape, generator=g)
    ((qo * wq).sum() + (ko * wk).sum()).backward()
    gq, gk = cupy_rope.apply_rope_pos(pos.numpy(), wq.numpy(), wk.numpy(), cos_sin_cache=cache.numpy(),
                                      head_size=64, inverse=True)
    np.testing.assert_array_equal(q.grad.numpy(), gq)
    np.testing.assert_array_equal(k.grad.numpy(), gk)
    # q alone; second-order: the gradient of the gradient is the forward
    q.grad = None
    (qa, kb) = crt.apply_rope_pos(pos, q, None, cos_sin_cache=cache, head_size=64)
    assert kb is None
    (ga,) = torch.autograd.grad((qa * wq).sum(), q, create_graph=True)
    (gga,) = torch.autograd.grad((ga * wq).sum(), q) if ga.requires_grad else (None,)
    assert gga is None or torch.count_nonzero(gga) == 0  # linear: the second derivative is zero
    torch.library.opcheck(torch.ops.cupy_rope.rope_pos.default,
                          (pos, q.detach(), k.detach(), cache, "cos_sin_cache", 64, False, 0, False))
    fn = torch.compile(lambda q, k: crt.apply_rope_pos(pos, q, k, cos_sin_cache=cache, head_size=64),
                       fullgraph=True, backend="aot_eager")
    cq, ck = fn(q.detach(), k.detach())
    torch.testing.assert_close(cq, qo.detach(), rtol=0, atol=0)
    torch.testing.assert_close(ck, ko.detach(), rtol=0, atol=0)
    # in place: not differentiable, bumps the version counter
    q2, k2 = q.detach().clone(), k.detach().clone()
    v = q2._version
    crt.apply_rope_pos(pos, q2, k2, cos_sin_cache=cache, head_size=64, inplace=True)
    assert q2._version > v
    torch.testing.assert_close(q2, qo.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="`inplace`"):
        crt.apply_rope_pos(pos, q, k, cos_sin_cache=cache, head_size=64, inplace=True)


def test_jax_cpu():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import cupy_rope.jax as crj

    case = PosCase(7)
    pos, q, k, tables, hs, kind, rows = case.arrays()
    jt = {n: jnp.asarray(t) for n, t in tables.items()}
    kw = dict(head_size=hs, interleaved=case.interleaved, rope_dim_offset=case.off, inverse=case.inverse)
    fn = jax.jit(lambda p, q, k: crj.apply_rope_pos(p, q, k, **jt, **kw))
    qo, ko = fn(jnp.asarray(pos), jnp.asarray(np.ascontiguousarray(q)), None if k is None else jnp.asarray(np.ascontiguousarray(k)))
    case.check(pos, q, k, tables, kind, rows, np.asarray(qo), None if k is None else np.asarray(ko), hs)
    # the gradient is the inverse rotation
    w = np.random.default_rng(1).uniform(-1, 1, q.shape).astype(q.dtype)
    gq = jax.grad(lambda x: (crj.apply_rope_pos(jnp.asarray(pos), x, None, **jt, **kw)[0].astype(jnp.float32)
                             * jnp.asarray(w).astype(jnp.float32)).sum())(jnp.asarray(np.ascontiguousarray(q)))
    kw_inv = dict(kw, inverse=not case.inverse)
    want_g = cupy_rope.apply_rope_pos(pos, w, None, **tables, **kw_inv)[0]
    np.testing.assert_allclose(np.asarray(gq).astype(np.float64), want_g.astype(np.float64), atol=1e-2)


def test_jax_arrays_are_never_written_in_place():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    cache = jnp.asarray(cupy_rope.rope_cos_sin_cache(64, 8))
    q = jnp.ones((2, 1, 64))
    with pytest.raises(ValueError, match="`inplace`"):
        cupy_rope.apply_rope_pos(jnp.arange(2), q, None, cos_sin_cache=cache, inplace=True)
    f = jnp.asarray(cupy_rope.rope_freqs(64, 8))
    with pytest.raises(ValueError, match="`inplace`"):
        cupy_rope.apply_rope_qk(q[:, None], q[:, None], f, inplace=True)


# ----------------------------------------------------------------------------- errors
def _base():
    r = np.random.default_rng(0)
    pos = np.arange(4)
    q = r.uniform(-1, 1, (4, 2, 64)).astype(np.float32)
    k = r.uniform(-1, 1, (4, 1, 64)).astype(np.float32)
    return pos, q, k, cupy_rope.rope_cos_sin_cache(64, 8)


@pytest.mark.parametrize("mutate, exc, name", [
    (lambda a: a.update(positions=a["positions"].astype(np.float32)), TypeError, "positions"),
    (lambda a: a.update(positions=np.zeros((2, 2, 1), np.int64)), ValueError, "positions"),
    (lambda a: a.update(positions=np.arange(5)), ValueError, "q"),
    (lambda a: a.update(cos_sin_cache=None), ValueError, "cos_sin_cache"),
    (lambda a: a.update(freqs=cupy_rope.rope_freqs(64, 8)), ValueError, "cos_sin_cache"),
    (lambda a: a.update(cos_sin_cache=a["cos_sin_cache"].astype(np.float64)), TypeError, "cos_sin_cache"),
    (lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][:, :63]), ValueError, "cos_sin_cache"),
    (lambda a: a.update(cos_sin_cache=a["cos_sin_cache"][:, None]), ValueError, "cos_sin_cache"),
    (lambda a: a.update(rope_dim_offset=2), ValueError, "cos_sin_cache"),
    (lambda a: a.update(rope_dim_offset=-1), ValueError, "rope_dim_offset"),
    (lambda a: a.update(rope_dim_offset=1.0), TypeError, "rope_dim_offset"),
    (lambda a: a.update(k=a["k"].astype(np.float16)), TypeError, "k"),
    (lambda a: a.update(k=a["k"][:3]), ValueError, "k"),
    (lambda a: a.update(q=a["q"].reshape(4, 128)), ValueError, "head_size"),
    (lambda a: a.update(q=a["q"].reshape(4, 128), head_size=48), ValueError, "head_size"),
    (lambda a: a.update(head_size=32), ValueError, "q"),
    (lambda a: a.update(q=a["q"].astype(np.int32)), TypeError, "q"),
    (lambda a: a.update(q=[1.0]), TypeError, "q"),
    (lambda a: a.update(interleaved=1), TypeError, "interleaved"),
    (lambda a: a.update(inverse="no"), TypeError, "inverse"),
    (lambda a: a.update(inplace=None), TypeError, "inplace"),
    (lambda a: a.update(inplace=True, k=a["q"][:, :1]), ValueError, "k"),
    (lambda a: a.update(inv_freq=np.ones((32, 1)), cos_sin_cache=None), ValueError, "inv_freq"),
    (lambda a: a.update(inv_freq=np.ones(32, np.int64), cos_sin_cache=None), TypeError, "inv_freq"),
])
def test_errors_name_the_argument(mutate, exc, name):
    pos, q, k, cache = _base()
    args = dict(positions=pos, q=q, k=k, cos_sin_cache=cache)
    mutate(args)
    snapshot = {n: np.array(v, copy=True) for n, v in args.items() if isinstance(v, np.ndarray)}
    with pytest.raises(exc, match=f"`{name}`"):
        cupy_rope.apply_rope_pos(**args)
    for n, v in snapshot.items():  # nothing written on error (in place included)
        np.testing.assert_array_equal(args[n], v)


def test_debug_mode_reports_positions_outside_the_table():
    """Positions outside the cache copy their token through; in debug mode they are an error
    naming the first one, for the first position past the table, one further and one before it
    (the table's last row is inside)."""
    _, q, k, cache = _base()
    rows = cache.shape[0]
    try:
        for bad in (rows, rows + 1, -1):
            pos = np.array([0, 1, bad, 2])
            cupy_rope.set_debug(False)
            cupy_rope.apply_rope_pos(pos, q, k, cos_sin_cache=cache)  # copied through, no error
            cupy_rope.set_debug(True)
            cupy_rope.apply_rope_pos(np.array([0, 1, rows - 1, 2]), q, k, cos_sin_cache=cache)
            with pytest.raises(ValueError, match=rf"`cos_sin_cache`.*position {bad} at `positions`\[2\]"):
                cupy_rope.apply_rope_pos(pos, q, k, cos_sin_cache=cache)
    finally:
        cupy_rope.set_debug(False)


# ----------------------------------------------------------------------------- drop-ins
def test_vllm_rotary_embedding():
    pos, q, k, cache = _base()
    qf, kf = q.reshape(4, 128).copy(), k.reshape(4, 64).copy()
    for neox in (True, False):
        q1, k1 = qf.copy(), kf.copy()
        assert crv.rotary_embedding(pos, q1, k1, 64, cache, neox) is None
        rq = rope_pos_ref(qf.reshape(4, 2, 64), pos, "cos_sin", cache, 8, interleaved=not neox)
        rk = rope_pos_ref(kf.reshape(4, 1, 64), pos, "cos_sin", cache, 8, interleaved=not neox)
        assert_close_to_ref(q1.reshape(4, 2, 64), rq, qf.reshape(4, 2, 64), 64, "float32")
        assert_close_to_ref(k1.reshape(4, 1, 64), rk, kf.reshape(4, 1, 64), 64, "float32")
    q1 = qf.copy()
    crv.rotary_embedding(pos, q1, None, 64, cache[:, :32], True)  # key None, rot_dim 32 of 64
    rq = rope_pos_ref(qf.reshape(4, 2, 64), pos, "cos_sin", cache[:, :32], 8)
    assert_close_to_ref(q1.reshape(4, 2, 64), rq, qf.reshape(4, 2, 64), 32, "float32")
    with pytest.raises(TypeError, match="`is_neox`"):
        crv.rotary_embedding(pos, q1, None, 64, cache, 1)
    # vLLM's later arguments: the rotary slice at an offset, the inverse rotation
    for neox, off, inv in ((True, 16, False), (False, 32, True), (True, 0, True)):
        q1, k1 = qf.copy(), kf.copy()
        crv.rotary_embedding(pos, q1, k1, 64, cache[:, :32], neox, off, inverse=inv)
        for x, y, h in ((qf, q1, 2), (kf, k1, 1)):
            ref = rope_pos_ref(x.reshape(4, h, 64), pos, "cos_sin", cache[:, :32], 8, interleaved=not neox,
                               offset=off, inverse=inv)
            assert_close_to_ref(y.reshape(4, h, 64), ref, x.reshape(4, h, 64), 32, "float32")
    with pytest.raises(ValueError, match=r"rope_dim_offset \+ rotary_dim <= head_size"):
        crv.rotary_embedding(pos, qf.copy(), None, 64, cache[:, :32], True, 48)
    with pytest.raises(TypeError, match="`inverse`"):
        crv.rotary_embedding(pos, qf.copy(), None, 64, cache, True, 0, "yes")


def test_flashinfer_drop_ins():
    pos, q, k, cache = _base()
    qf, kf = q.reshape(4, 128), k.reshape(4, 64)
    qo, ko = cfi.apply_rope_with_cos_sin_cache(pos, qf, kf, 64, cache, is_neox=False)
    rq = rope_pos_ref(q, pos, "cos_sin", cache, 8, interleaved=True)
    assert_close_to_ref(qo.reshape(q.shape), rq, q, 64, "float32")
    q1, k1 = qf.copy(), kf.copy()
    assert cfi.apply_rope_with_cos_sin_cache_inplace(pos, q1, k1, 64, cache, is_neox=False) is None
    np.testing.assert_array_equal(q1, qo)
    np.testing.assert_array_equal(k1, ko)
    # pos_ids: theta ** (-2i / rotary_dim) / rope_scale, first rotary_dim channels
    inv = 1e4 ** -(np.arange(0, 32, 2) / 32) / 2.0
    qo, ko = cfi.apply_rope_pos_ids(q, k, pos, rotary_dim=32, rope_scale=2.0)
    assert_close_to_ref(qo, rope_pos_ref(q, pos, "inv_freq", inv, 2**62), q, 32, "float32")
    q1, k1 = q.copy(), k.copy()
    cfi.apply_rope_pos_ids_inplace(q1, k1, pos, rotary_dim=32, rope_scale=2.0)
    np.testing.assert_array_equal(q1, qo)
    # Llama 3.1: FlashInfer's smooth-interpolation form, written out here
    rd, theta, factor, lo, hi, old = 64, 5e5, 8.0, 1.0, 4.0, 8192
    base_inv = theta ** -(np.arange(0, rd, 2) / rd)
    smooth_a = old / (2 * np.pi * hi - 2 * np.pi * lo)
    smooth_b = -1.0 / (hi / lo - 1.0)
    smooth = np.clip(base_inv * smooth_a + smooth_b, 0, 1)
    inv = (1 - smooth) * base_inv / factor + smooth * base_inv
    big = np.array([0, 1000, 100000, 7])
    qo, ko = cfi.apply_llama31_rope_pos_ids(q, k, big)
    assert_close_to_ref(qo, rope_pos_ref(q, big, "inv_freq", inv, 2**62), q, 64, "float32")
    q1, k1 = q.copy(), k.copy()
    cfi.apply_llama31_rope_pos_ids_inplace(q1, k1, big)
    np.testing.assert_array_equal(k1, ko)


@pytest.mark.parametrize("call, exc, name", [
    (lambda c, q, k: crv.rotary_embedding(np.arange(3), q.astype(np.int32), k, 64, c,
                                                                        True), TypeError, "query"),
    (lambda c, q, k: crv.rotary_embedding(np.arange(4), q, k, 64, c, True),
     ValueError, "query"),
    (lambda c, q, k: crv.rotary_embedding(np.arange(3), q, k, 64.0, c, True),
     TypeError, "head_size"),
    (lambda c, q, k: cfi.apply_rope_with_cos_sin_cache(
        np.arange(3), q, k[:, :32], 64, c), ValueError, "head_size"),
    (lambda c, q, k: cfi.apply_rope_pos_ids(
        q.reshape(3, 2, 64), k.reshape(3, 1, 64), np.arange(3.0)), TypeError, "pos_ids"),
    (lambda c, q, k: cfi.apply_rope_pos_ids(
        q.reshape(3, 2, 64), k.reshape(3, 1, 64), np.arange(3), rope_scale=0), ValueError, "rope_scale"),
    (lambda c, q, k: cfi.apply_rope_pos_ids(
        q.reshape(3, 2, 64), k.reshape(3, 1, 64), np.arange(3), rope_theta="x"), TypeError, "rope_theta"),
    (lambda c, q, k: cfi.apply_rope_pos_ids(
        q, k.reshape(3, 1, 64), np.arange(3)), ValueError, "q"),
    (lambda c, q, k: cfi.apply_rope_pos_ids(
        q.reshape(3, 2, 64), k.reshape(3, 1, 64), np.arange(3), rotary_dim=63), ValueError, "rotary_dim"),
    (lambda c, q, k: cfi.apply_llama31_rope_pos_ids(
        q.reshape(3, 2, 64), k.reshape(3, 1, 64), np.arange(3), high_freq_factor=0.5), ValueError,
     "high_freq_factor"),
])
def test_drop_in_errors_name_their_own_arguments(call, exc, name):
    c = cupy_rope.rope_cos_sin_cache(64, 8)
    q, k = np.ones((3, 128), np.float32), np.ones((3, 64), np.float32)
    q0 = q.copy()
    with pytest.raises(exc, match=f"`{name}`"):
        call(c, q, k)
    np.testing.assert_array_equal(q, q0)


def _ragged_ref_positions(indptr, offsets, nnz):
    p = np.full(nnz, -1, np.int64)
    for i in range(len(indptr) - 1):
        for t in range(indptr[i], indptr[i + 1]):
            p[t] = offsets[i] + t - indptr[i]
    return p


@pytest.mark.parametrize("fw", ["numpy", "torch"])
def test_flashinfer_ragged_batch(fw):
    """apply_rope / apply_llama31_rope (indptr, offsets) = the pos_ids functions at the ragged
    batch's positions; tokens past the last segment are left as they are."""
    r = np.random.default_rng(3)
    indptr, offsets = np.array([0, 3, 3, 7]), np.array([5, 100, 2000])
    q = r.uniform(-1, 1, (9, 4, 64)).astype(np.float32)
    k = r.uniform(-1, 1, (9, 2, 64)).astype(np.float32)
    pos = _ragged_ref_positions(indptr, offsets, 9)
    conv = (lambda a: a.copy()) if fw == "numpy" else (lambda a: pytest.importorskip("torch").from_numpy(a.copy()))
    back = (lambda a: a) if fw == "numpy" else (lambda a: a.numpy())
    for ragged, by_ids, kw in ((cfi.apply_rope, cfi.apply_rope_pos_ids, dict(rotary_dim=32, rope_theta=500.0)),
                               (cfi.apply_llama31_rope, cfi.apply_llama31_rope_pos_ids, dict(interleave=True))):
        qo, ko = ragged(conv(q), conv(k), conv(indptr), conv(offsets.astype(np.int32)), **kw)
        want_q, want_k = by_ids(q[:7], k[:7], pos[:7], **kw)
        np.testing.assert_array_equal(back(qo)[:7], want_q)
        np.testing.assert_array_equal(back(ko)[:7], want_k)
        np.testing.assert_array_equal(back(qo)[7:], q[7:])  # in no segment: copied
    q1, k1 = conv(q), conv(k)
    assert cfi.apply_rope_inplace(q1, k1, conv(indptr), conv(offsets), rotary_dim=32, rope_theta=500.0) is None
    np.testing.assert_array_equal(back(q1)[:7], cfi.apply_rope_pos_ids(q[:7], k[:7], pos[:7], rotary_dim=32,
                                                                       rope_theta=500.0)[0])
    q1, k1 = conv(q), conv(k)
    cfi.apply_llama31_rope_inplace(q1, k1, conv(indptr), conv(offsets))
    np.testing.assert_array_equal(back(k1)[:7], cfi.apply_llama31_rope_pos_ids(q[:7], k[:7], pos[:7])[1])
    with pytest.raises(ValueError, match="`offsets`"):
        cfi.apply_rope(conv(q), conv(k), conv(indptr), conv(offsets[:2]))
    with pytest.raises(TypeError, match="`indptr`"):
        cfi.apply_rope(conv(q), conv(k), conv(indptr.astype(np.float32)), conv(offsets))


def test_drop_ins_torch():
    torch = pytest.importorskip("torch")

    pos, q, k, cache = _base()
    tq, tk = torch.from_numpy(q.reshape(4, 128).copy()), torch.from_numpy(k.reshape(4, 64).copy())
    qo, ko = cfi.apply_rope_with_cos_sin_cache(torch.from_numpy(pos), tq, tk, 64, torch.from_numpy(cache))
    crv.rotary_embedding(torch.from_numpy(pos), tq, tk, 64, torch.from_numpy(cache), True)
    torch.testing.assert_close(tq, qo, rtol=0, atol=0)
    torch.testing.assert_close(tk, ko, rtol=0, atol=0)
    qo, ko = cfi.apply_rope_pos_ids(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(pos).int())
    want = cfi.apply_rope_pos_ids(q, k, pos)
    np.testing.assert_array_equal(qo.numpy(), want[0])


# ----------------------------------------------------------------------------- scaled tables
def _hf_default(dim, base):
    return np.array([1.0 / base ** (i / dim) for i in range(0, dim, 2)])


def test_rope_inv_freq_types_follow_the_published_formulas():
    dim, base = 64, 10000.0
    ref = _hf_default(dim, base)
    inv, att = cupy_rope.rope_inv_freq(dim, base)
    np.testing.assert_allclose(inv, ref, rtol=1e-15)
    assert att == 1.0
    inv, _ = cupy_rope.rope_inv_freq(dim, base, {"rope_type": "linear", "factor": 4.0})
    np.testing.assert_allclose(inv, ref / 4, rtol=1e-15)
    # dynamic NTK: base' = base * (factor * L / mpe - (factor - 1)) ** (dim / (dim - 2)), L >= mpe
    for L in (None, 1000, 8192):
        inv, _ = cupy_rope.rope_inv_freq(dim, base, {"type": "dynamic", "factor": 2.0},
                                         max_position_embeddings=2048, seq_len=L)
        eff = max(L or 0, 2048)
        b2 = base * ((2.0 * eff / 2048) - 1.0) ** (dim / (dim - 2))
        np.testing.assert_allclose(inv, _hf_default(dim, b2), rtol=1e-14)
    # Llama 3: per frequency, by wavelength
    sc = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    inv, _ = cupy_rope.rope_inv_freq(128, 500000.0, sc)
    for got, f in zip(inv, _hf_default(128, 500000.0)):
        wl = 2 * np.pi / f
        if wl < 8192 / 4.0:
            want = f
        elif wl > 8192 / 1.0:
            want = f / 8.0
        else:
            s = (8192 / wl - 1.0) / (4.0 - 1.0)
            want = (1 - s) * f / 8.0 + s * f
        assert got == pytest.approx(want, rel=1e-14)
    # a wavelength exactly at the low-frequency edge (8192 / low_freq_factor) is in the smooth band,
    # whose weight there is 0: the frequency divided by the factor (HF's inclusive band edges)
    fs = cupy_rope.rope_inv_freq(128, 500000.0)[0]  # the unscaled frequencies the scaling starts from
    wl = 2 * np.pi / fs
    edge = next(i for i, w in enumerate(wl) if w > 2048 and 8192 / (8192 / w) == w)
    lo = 8192 / wl[edge]
    inv, _ = cupy_rope.rope_inv_freq(128, 500000.0, dict(sc, low_freq_factor=lo))
    assert inv[edge] == pytest.approx(fs[edge] / 8.0, rel=1e-14)
    # YaRN: ramp between interpolation and extrapolation, attention factor 0.1 ln(s) + 1
    sc = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    inv, att = cupy_rope.rope_inv_freq(dim, base, sc, max_position_embeddings=16384)
    assert att == pytest.approx(0.1 * np.log(4.0) + 1.0, rel=1e-15)

    def cdim(rot):
        return dim * np.log(4096 / (rot * 2 * np.pi)) / (2 * np.log(base))

    lo, hi = max(np.floor(cdim(32)), 0), min(np.ceil(cdim(1)), dim - 1)
    for i, (got, f) in enumerate(zip(inv, _hf_default(dim, base))):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        want = (f / 4.0) * ramp + f * (1 - ramp)
        assert got == pytest.approx(want, rel=1e-14)
    inv2, att2 = cupy_rope.rope_inv_freq(dim, base, dict(sc, mscale=1.0, mscale_all_dim=0.5),
                                         max_position_embeddings=16384)
    assert att2 == pytest.approx((0.1 * np.log(4) + 1) / (0.05 * np.log(4) + 1), rel=1e-15)
    # LongRoPE: short factors up to the original length, long beyond; sqrt attention factor
    short, long_ = np.linspace(1, 2, dim // 2), np.linspace(1, 8, dim // 2)
    sc = {"rope_type": "longrope", "short_factor": list(short), "long_factor": list(long_),
          "original_max_position_embeddings": 4096}
    inv, att = cupy_rope.rope_inv_freq(dim, base, sc, max_position_embeddings=131072, seq_len=100)
    np.testing.assert_allclose(inv, _hf_default(dim, base) / short, rtol=1e-14)
    assert att == pytest.approx(np.sqrt(1 + np.log(32) / np.log(4096)), rel=1e-15)
    inv, _ = cupy_rope.rope_inv_freq(dim, base, sc, max_position_embeddings=131072, seq_len=5000)
    np.testing.assert_allclose(inv, _hf_default(dim, base) / long_, rtol=1e-14)


@pytest.mark.parametrize("bad, exc, name", [
    (dict(rotary_dim=63), ValueError, "rotary_dim"),
    (dict(base="x"), TypeError, "base"),
    (dict(rope_scaling={"rope_type": "nope"}), ValueError, "rope_scaling"),
    (dict(rope_scaling={"rope_type": "linear"}), ValueError, "rope_scaling"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), ValueError, "max_position_embeddings"),
    (dict(rope_scaling=[1]), TypeError, "rope_scaling"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.0}), ValueError, "rope_scaling"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": "1", "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}), ValueError, "rope_scaling"),
])
def test_rope_inv_freq_errors(bad, exc, name):
    kw = dict(rotary_dim=64, base=10000.0)
    kw.update(bad)
    with pytest.raises(exc, match=f"`{name}`"):
        cupy_rope.rope_inv_freq(**kw)


def test_cos_sin_cache_attention_factor_and_dtypes():
    sc = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    c = cupy_rope.rope_cos_sin_cache(64, 16, 10000.0, sc, max_position_embeddings=16384)
    inv, att = cupy_rope.rope_inv_freq(64, 10000.0, sc, max_position_embeddings=16384)
    ang = 5 * inv
    np.testing.assert_allclose(c[5], np.concatenate([np.cos(ang), np.sin(ang)]) * att, rtol=1e-7)
    for dt in DTYPES:
        c = cupy_rope.rope_cos_sin_cache(32, 8, dtype=dt)
        assert c.dtype == NP_DTYPES[dt] and c.shape == (8, 32)


# ----------------------------------------------------------------------------- long context
getcontext().prec = 60
_PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494459")


def _cos_sin_exact(angle: Decimal):
    """cos and sin of ``angle`` to ~50 digits: reduced modulo 2 pi, then Taylor series."""
    a = angle % (2 * _PI)
    c, s, term, n = Decimal(0), Decimal(0), Decimal(1), 0
    while True:  # term = a^n / n!
        if n % 4 == 0:
            c += term
        elif n % 4 == 1:
            s += term
        elif n % 4 == 2:
            c -= term
        else:
            s -= term
        n += 1
        term = term * a / n
        if abs(term) < Decimal(10) ** -55:
            return c, s


LONG_POSITIONS = [0, 1, 4095, 131071, 1_000_000, 4_000_000, 2**24 - 1]
LONG_DIM, LONG_BASE = 128, 500000.0


def _inv_freq_values(run, p):
    """cos/sin of every pair at position ``p`` as the inverse-frequency path computes them:
    head i of the input has a 1 in channel i, so output head i holds cos_i in channel i and
    sin_i in channel i + d/2. ``run(positions, x, inv)`` -> output."""
    d = LONG_DIM
    x = np.zeros((1, d // 2, d), np.float32)
    x[0, np.arange(d // 2), np.arange(d // 2)] = 1
    y = run(np.array([p]), x, cupy_rope.rope_inv_freq(d, LONG_BASE)[0])[0]
    i = np.arange(d // 2)
    return np.concatenate([y[i, i], y[i, i + d // 2]])


def check_exact_at_long_context(values_at):
    """At positions up to 2^24 - 1, ``values_at(p)`` (cos of every pair, then sin) are the
    correctly rounded float32 cos/sin of the true angle p * base^(-2i/d) (a 60-digit Decimal
    reference) in >= 99.9% of entries and within 1 ulp everywhere; a float32 angle is far off."""
    d, total, exact, worst_f32 = LONG_DIM, 0, 0, 0.0
    inv64, _ = cupy_rope.rope_inv_freq(d, LONG_BASE)
    for p in LONG_POSITIONS:
        row = np.asarray(values_at(p), np.float32)
        for i in range(d // 2):
            c, s = _cos_sin_exact(Decimal(p) * Decimal(LONG_BASE) ** (Decimal(-2 * i) / Decimal(d)))
            for val, ex in ((row[i], c), (row[d // 2 + i], s)):
                ulp = float(np.spacing(np.float32(abs(float(ex))))) if ex else 2.0 ** -149
                assert abs(float(val) - float(ex)) <= ulp, (p, i, val, ex)
                total += 1
                exact += bool(val == np.float32(float(ex)))
            f32_angle = np.float32(p) * np.float32(inv64[i])
            worst_f32 = max(worst_f32, abs(float(np.cos(np.float64(f32_angle))) - float(c)))
    assert exact >= 0.999 * total, (exact, total)
    assert worst_f32 > 1e-3  # what a float32 angle gets wrong there


def test_cos_sin_cache_is_exact_at_long_context():
    check_exact_at_long_context(lambda p: cupy_rope.rope_cos_sin_cache(LONG_DIM, 1, LONG_BASE, offset=p)[0])


def test_inv_freq_angles_are_exact_at_long_context():
    def numpy_run(pos, x, inv):
        return cupy_rope.apply_rope_pos(pos, x, None, inv_freq=inv)[0]

    def host_run(pos, x, inv):
        infos = {n: None for n in _plan.TABLE_ARGS}
        infos["inv_freq"] = _interop.info(inv, "numpy")
        plans, _, _ = _plan.resolve_rope_pos(_interop.info(pos, "numpy"), _interop.info(x, "numpy"), None, infos,
                                             None, False, 0, False, False)
        return hostkernels.run_rope_pos(plans, [x], inv, pos)[0]

    for run in (numpy_run, host_run):
        check_exact_at_long_context(lambda p: _inv_freq_values(run, p))


# ----------------------------------------------------------------------------- GPU
def _dev_arrays(fw, *arrays):
    from test_gpu import to_dev

    return [None if a is None else to_dev(np.asarray(a), fw) for a in arrays]


def _to_np(a):
    if a is None:
        return None
    if hasattr(a, "get"):
        return a.get()
    return _interop.to_numpy(a.cpu(), "torch")


@pytest.mark.gpu
@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("case", CASES[:80], ids=repr)
def test_gpu_matches_reference(case, fw):
    if fw == "torch":
        pytest.importorskip("torch")
    pos, q, k, tables, hs, kind, rows = case.arrays()
    (tname, table), = tables.items()
    dpos, dq, dk, dtab = _dev_arrays(fw, pos, q, k, table)
    for inplace in (False, True):
        qo, ko = cupy_rope.apply_rope_pos(dpos, dq, dk, **{tname: dtab}, head_size=hs, interleaved=case.interleaved,
                                          rope_dim_offset=case.off, inverse=case.inverse, inplace=inplace)
        case.check(pos, q, k, tables, kind, rows, _to_np(qo), _to_np(ko), hs)
        if case.style == "fused" and not inplace:
            break  # views of one buffer written in place would change the next round's input
        if inplace:
            break
        dpos, dq, dk, dtab = _dev_arrays(fw, pos, q, k, table)


@pytest.mark.gpu
def test_gpu_repeated_calls_hit_the_launch_cache_and_graphs():
    torch = pytest.importorskip("torch")
    import cupy_rope.torch as crt

    dev = "cuda"
    cache = torch.from_numpy(cupy_rope.rope_cos_sin_cache(128, 4096)).to(dev, torch.bfloat16)
    pos = torch.randint(0, 4096, (64,), device=dev)
    q = torch.randn(64, 32 * 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(64, 8 * 128, device=dev, dtype=torch.bfloat16)
    want = [a.clone() for a in (q, k)]
    crv.rotary_embedding(pos, *want, 128, cache, True)
    before = cupy_rope._api.cache_info()["hits"]
    for _ in range(3):
        q1, k1 = q.clone(), k.clone()
        crv.rotary_embedding(pos, q1, k1, 128, cache, True)
        torch.testing.assert_close(q1, want[0], rtol=0, atol=0)
    assert cupy_rope._api.cache_info()["hits"] >= before + 3
    # CUDA graph: capture an in-place decode step, replay with new positions and inputs
    sq, sk, sp = q.clone(), k.clone(), pos.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        crv.rotary_embedding(sp, sq, sk, 128, cache, True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        crv.rotary_embedding(sp, sq, sk, 128, cache, True)
    for _ in range(2):
        nq, nk = torch.randn_like(q), torch.randn_like(k)
        npos = torch.randint(0, 4096, (64,), device=dev)
        sq.copy_(nq), sk.copy_(nk), sp.copy_(npos)
        g.replay()
        rq, rk = crt.apply_rope_pos(npos, nq, nk, cos_sin_cache=cache, head_size=128)
        torch.cuda.synchronize()
        torch.testing.assert_close(sq, rq, rtol=0, atol=0)
        torch.testing.assert_close(sk, rk, rtol=0, atol=0)
    # torch.compile, reduce-overhead
    fn = torch.compile(lambda p, q, k: crt.apply_rope_pos(p, q, k, cos_sin_cache=cache, head_size=128),
                       mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        out = fn(pos, q, k)
    torch.testing.assert_close(out[0], crt.apply_rope_pos(pos, q, k, cos_sin_cache=cache, head_size=128)[0],
                               rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_inv_freq_angles_are_exact_at_long_context():
    import cupy

    def run(pos, x, inv):
        return cupy.asnumpy(cupy_rope.apply_rope_pos(cupy.asarray(pos), cupy.asarray(x), None,
                                                     inv_freq=cupy.asarray(inv))[0])

    check_exact_at_long_context(lambda p: _inv_freq_values(run, p))


@pytest.mark.gpu
def test_gpu_jax(xla_launch):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import cupy_rope.jax as crj

    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    case = PosCase(11)
    pos, q, k, tables, hs, kind, rows = case.arrays()
    jt = {n: jnp.asarray(t) for n, t in tables.items()}
    kw = dict(head_size=hs, interleaved=case.interleaved, rope_dim_offset=case.off, inverse=case.inverse)
    fn = jax.jit(lambda p, q, k: crj.apply_rope_pos(p, q, k, **jt, **kw))
    for _ in range(2):  # alternate inputs (command buffers replay with new addresses)
        q = np.random.default_rng(_).uniform(-2, 2, q.shape).astype(q.dtype)
        qo, ko = fn(jnp.asarray(pos), jnp.asarray(np.ascontiguousarray(q)),
                    None if k is None else jnp.asarray(np.ascontiguousarray(k)))
        case.check(pos, q, k, tables, kind, rows, np.asarray(qo), None if k is None else np.asarray(ko), hs)

"""The spec matrix on the CPU: the NumPy backend and the host build of the CUDA kernels,
both against the independent float64 reference, forward and backward."""

import itertools
import struct

import numpy as np
import pytest

import cupy_rope
from cupy_rope import _abi, _kernels, _plan, _worksplit
from cupy_rope._dev import hostkernels as _hostkernels
from cupy_rope._interop import info
from cases import NP_DTYPES, inputs, matrix, split_in_chunks, use_lean
from reference import assert_close_to_ref, pairs, rope_ref

CASES = matrix()


def _plan_for(x, freqs, kw, backward):
    return _plan.resolve_rope(info(x), info(freqs), kw["layout"], kw["interleaved"],
                              info(kw.get("cu_seqlens")), info(kw.get("start_positions")),
                              kw["cp_size"], kw["cp_rank"], None, backward)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_numpy_backend(case, backward):
    x, freqs, kw = inputs(case)
    fn = cupy_rope.apply_rope_backward if backward else cupy_rope.apply_rope
    y = fn(x, freqs, **kw)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.flags.c_contiguous
    ref = rope_ref(x, freqs, backward=backward, **kw)
    assert_close_to_ref(y, ref, x, freqs.shape[-1], case.dtype, case.id())


@pytest.fixture(params=["one_row", "one_row_streaming", "max_rows", "two_chunks", "lean"])
def kernel(request, monkeypatch):
    """Both ends of the work split: one row per thread (a large device; the one-row kernel, and
    the streaming kernel given one row per thread) and all rows of a token in one thread (a small
    device); and between them two chunks per token (threads stepping over every other head); and
    the lean kernel wherever it can run (up to CUPY_ROPE_LEAN_ROWS rows per thread; the others stream)."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9 if request.param.startswith("one_row") else 1)
    monkeypatch.setattr(_worksplit, "_ODD_UNITS_FACTOR", 1)
    monkeypatch.setattr(_worksplit, "_ONE_ROW", request.param == "one_row")
    use_lean(monkeypatch, request.param == "lean")
    if request.param == "two_chunks":
        split_in_chunks(monkeypatch, 2)
    return request.param


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_host_kernels(case, backward, kernel):
    """The real .cu source, compiled with g++, through the real launch plan."""
    x, freqs, kw = inputs(case)
    plan = _plan_for(x, freqs, kw, backward)
    out = np.full(x.shape, np.nan, dtype=x.dtype)  # poisoned
    y = _hostkernels.run_rope(plan, x, freqs, kw.get("cu_seqlens"), kw.get("start_positions"), out=out)
    ref = rope_ref(x, freqs, backward=backward, **kw)
    assert_close_to_ref(y, ref, x, freqs.shape[-1], case.dtype, case.id())


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_one_row_kernel_is_bit_identical_to_streaming_kernel(case, backward, monkeypatch):
    """The one-row kernel, the mixed streaming kernel (rows with a tail, 16-byte vectors) and the
    lean kernel (full rotary rows, 16-byte vectors) are the streaming kernel's arithmetic in
    another order: same bits."""
    x, freqs, kw = inputs(case)
    plan = _plan_for(x, freqs, kw, backward)
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9)
    got = {}
    runs = ((True, True, False, ("rope1",)), (False, True, False, ("rope", "ropem")),
            (False, False, False, ("rope",)), (False, False, True, ("rope", "ropel")))
    for one_row, mixed, lean, kinds in runs:
        monkeypatch.setattr(_worksplit, "_ONE_ROW", one_row)
        monkeypatch.setattr(_worksplit, "_MIXED", mixed)
        use_lean(monkeypatch, lean)
        spec = plan.launch(info(x), info(x), info(freqs), info(kw.get("cu_seqlens")),
                           info(kw.get("start_positions")), 4)
        name = spec.name
        assert name.split("_")[0] in kinds, name
        # one-row launches in their own blocks; the streaming kernels in the blocks their ring is sized for
        assert spec.block == (_worksplit._ONE_ROW_BLOCK if one_row else _kernels.BLOCK), (name, spec.block)
        vec16 = int(name.split("_")[2][1:]) * x.itemsize == 16
        fits = vec16 and plan.table.d2 == plan.d and plan.table.scol == 1  # the lean kernel's rows
        assert name.startswith("ropel_") == (lean and fits), name
        out = np.full(x.shape, np.nan, dtype=x.dtype)
        got[name] = _hostkernels.run_rope(plan, x, freqs, kw.get("cu_seqlens"), kw.get("start_positions"), out=out)
    for y in got.values():
        np.testing.assert_array_equal(y.view(np.uint8), got[name].view(np.uint8))


@pytest.mark.parametrize("vec_case", ["vector", "scalar"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_host_kernel_vector_widths(vec_case, dtype, kernel):
    """Aligned contiguous input takes the 16-byte path; an odd offset forces the scalar one."""
    from cases import NP_DTYPES

    rng = np.random.default_rng(7)
    d = 128
    base = rng.uniform(-2, 2, (16, 2, 5, d + 1)).astype(NP_DTYPES[dtype])
    x = np.ascontiguousarray(base[..., :d]) if vec_case == "vector" else base[..., 1:]
    freqs = rng.uniform(-5, 5, (16, 1, 1, 96)).astype(np.float32)
    for interleaved in (False, True):
        plan = _plan.resolve_rope(info(x), info(freqs), "sbhd", interleaved, None, None, 1, 0, None, False)
        out = np.full(x.shape, np.nan, dtype=x.dtype)
        name = plan.launch(info(x), info(out), info(freqs), None, None, 4).name
        assert ("_v1_" in name) == (vec_case == "scalar"), name
        y = _hostkernels.run_rope(plan, x, freqs, out=out)
        assert_close_to_ref(y, rope_ref(x, freqs, interleaved=interleaved), x, 96, dtype, name)


def test_one_row_angle_launch_width(monkeypatch):
    """Small one-row launches with an angle table take vectors of at most ``_ONE_ROW_ANGLE_VEC``
    elements (8 bytes of a 16-bit dtype) where the launch keeps one row per thread with them and
    has at most ``_NARROW_THREADS_PER_SM`` threads per SM (``_NARROW_SHARED_THREADS_PER_SM`` where
    the wide launch's threads share their sincosf: 32 heads, not 20), the widest valid vector
    where only that does, and the streaming kernel where neither does; other launches are not
    narrowed. Each launch's output is checked against the reference on the host build."""
    rng = np.random.default_rng(11)
    # a decode step: 64 sequences of one token, 32 heads: 16,384 threads with 16-byte vectors
    sp = rng.integers(0, 90, 64).astype(np.int32)
    # a standard table (equal angles per pair: cos/sin held per unit) and a random one (kFresh)
    tables = [cupy_rope.rope_freqs(128, 100), rng.uniform(-40, 40, (100, 1, 1, 128)).astype(np.float32)]
    limit = _worksplit._ONE_ROW_THREADS
    cases = [  # (dtype, heads, SMs, cap, one-row thread limit) -> kernel
        ("bfloat16", 20, 132, 4, limit, "rope1_bf16_v4_n_f"),  # 20,480 threads narrow, no sharing: 256 per SM
        ("float16", 20, 132, 4, limit, "rope1_f16_v4_n_f"),
        ("bfloat16", 20, 80, 4, limit, "rope1_bf16_v4_n_f"),  # exactly 256 per SM
        ("bfloat16", 20, 79, 4, limit, "rope1_bf16_v8_n_f"),
        ("bfloat16", 32, 132, 4, limit, "rope1_bf16_v8_n_f"),  # 32,768 narrow, the wide one shares: 128 per SM
        ("bfloat16", 32, 256, 4, limit, "rope1_bf16_v4_n_f"),  # exactly 128 per SM
        ("float16", 32, 256, 4, limit, "rope1_f16_v4_n_f"),
        ("bfloat16", 32, 255, 4, limit, "rope1_bf16_v8_n_f"),
        ("float32", 32, 132, 4, limit, "rope1_f32_v4_n_f"),  # 16 bytes: not narrowed
        ("bfloat16", 32, 132, 0, limit, "rope1_bf16_v8_n_f"),  # no cap
        ("bfloat16", 20, 132, 2, limit, "rope1_bf16_v8_n_f"),  # 2-element vectors: over 256 threads per SM
        ("bfloat16", 20, 160, 2, limit, "rope1_bf16_v2_n_f"),
        ("bfloat16", 32, 40, 4, limit, "rope1_bf16_v8_n_f"),  # one row per thread only with 16-byte vectors
        ("bfloat16", 32, 20, 4, limit, "rope_bf16_v8_n_f"),  # with neither: the streaming kernel
        ("bfloat16", 32, 256, 4, 2**15 - 1, "rope1_bf16_v8_n_f"),  # 32-bit indices only with 16-byte vectors
    ]
    names, orig = [], _hostkernels.launch
    monkeypatch.setattr(_hostkernels, "launch", lambda n, *a: names.append(n) or orig(n, *a))
    use_lean(monkeypatch, False)  # "the streaming kernel": not its lean form
    for (dtype, heads, sms, cap, lim, want), freqs in itertools.product(cases, tables):
        monkeypatch.setattr(_worksplit, "_ONE_ROW_ANGLE_VEC", cap)
        monkeypatch.setattr(_worksplit, "_ONE_ROW_THREADS", lim)
        x = rng.uniform(-2, 2, (64, 1, heads, 128)).astype(NP_DTYPES[dtype])
        plan = _plan.resolve_rope(info(x), info(freqs), "bshd", False, None, info(sp), 1, 0, None, False)
        out = np.full(x.shape, np.nan, dtype=x.dtype)
        spec = plan.launch(info(x), info(out), info(freqs), None, info(sp), sms)
        assert spec.name == want, (dtype, heads, sms, cap, lim, spec.name)
        one_row = want.startswith("rope1_")
        assert spec.block == (_worksplit._ONE_ROW_BLOCK if one_row else _kernels.BLOCK), spec.block
        vec = int(want.split("_")[2][1:])
        assert spec.grid[0] == _worksplit.blocks_for(64 * heads * 64 // vec, spec.block) or not one_row, spec.grid
        names.clear()
        y = _hostkernels.run_rope(plan, x, freqs, None, sp, out=out, sm_count=sms)
        assert names == [want], names
        ref = rope_ref(x, freqs, "bshd", start_positions=sp)
        assert_close_to_ref(y, ref, x, 128, dtype, want)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["nh", "il"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_one_row_shared_sincos(dtype, interleaved, backward, monkeypatch):
    """One-row launches with an angle table share each token's sincosf among its heads' threads
    (``RopeParams.share``: each thread computes one pair, reads its unit's from the block) where
    ``_worksplit.shares_sincos`` allows it. At every vector width, q and k in one launch (8 and 2
    heads: k shares only at widths dividing 2; 7 tokens, so the last block is not full), with a
    table where some rows have two angles per pair (all pairs; one pair) and some positions lie
    outside it, its columns strided: the result equals the unshared launch's bit for bit and the
    reference; a table with NaN and infinite angles: equal to the unshared launch. The host build
    counts the threads that could not use the shared cos/sin: exactly those of units with a pair
    of two angles; and the rows rotated with cos/sin of their own (``rotate_fresh``), shared or
    not: exactly those (a NaN angle included), every other unit with the cos/sin it holds."""
    rng = np.random.default_rng(21)
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9)  # one row per thread
    monkeypatch.setattr(_worksplit, "_NARROW_THREADS_PER_SM", 10**9)
    monkeypatch.setattr(_worksplit, "_NARROW_SHARED_THREADS_PER_SM", 10**9)
    monkeypatch.setattr(_worksplit, "_ONE_ROW", True)
    d, rows = 64, 40
    sp = rng.integers(0, rows + 8, 7).astype(np.int32)  # some tokens past the table: copied
    sp[:2] = (3, 5)  # the rows given two angles below
    clean = np.zeros((rows, 1, 1, 2 * d), np.float32)[..., ::2]  # a column stride of 2
    clean[...] = cupy_rope.rope_freqs(d, rows)
    clean[3] += rng.uniform(-1, 1, clean[3].shape).astype(np.float32)  # every pair: two angles
    clean[5, ..., 9] += 0.25  # one pair
    poisoned = clean.copy()
    poisoned[sp[2], ..., 3], poisoned[sp[3], ..., d - 1], poisoned[sp[4], ..., 0] = np.nan, np.inf, -np.inf
    sp[2:5] %= rows
    share_at = _abi.ROPE_FIELDS.index("share")
    for v in _kernels.vector_widths(dtype):
        monkeypatch.setattr(_worksplit, "_ONE_ROW_ANGLE_VEC", v)
        monkeypatch.setattr(_worksplit, "_SHARE_SINCOS", True)
        q = rng.uniform(-2, 2, (7, 1, 8, d)).astype(NP_DTYPES[dtype])
        k = rng.uniform(-2, 2, (7, 1, 2, d)).astype(NP_DTYPES[dtype])
        plans = _plan.resolve_rope_pair(info(q), info(k), info(clean), "bshd", interleaved, None, info(sp), 1, 0,
                                        False, backward)
        spec = _worksplit.rope_launch(plans, [(info(q), info(q)), (info(k), info(k))], info(clean), None,
                                      info(sp), 4)
        assert spec.name == _kernels.kernel_name("rope1", dtype, v, interleaved, backward), spec.name
        n = len(_abi.ROPE_FIELDS)
        shares = [struct.unpack_from("<q", spec.params, 8 * (i * n + share_at))[0] for i in (0, 1)]
        assert shares == [1, int(2 % v == 0)], (v, shares)
        for table in (clean, poisoned):
            plans = _plan.resolve_rope_pair(info(q), info(k), info(table), "bshd", interleaved, None, info(sp), 1, 0,
                                            False, backward)  # the table's own strides
            # threads that cannot use the shared cos/sin: units with a pair of two angles (or a
            # NaN cosine), of every sharing tensor's heads, at each token inside the table
            t = table.reshape(rows, d)[sp[sp < rows]]
            f, g = np.array(pairs(d, interleaved)).T
            bad = ~(t[:, f] == t[:, g]) | ~np.isfinite(t[:, f])
            unshared = int(bad.reshape(len(t), -1, v).any(-1).sum()) * (8 + 2 * shares[1])
            # rows rotated by rotate_fresh: units with a pair of two angles (NaN != NaN), all heads
            fresh = int((t[:, f] != t[:, g]).reshape(len(t), -1, v).any(-1).sum()) * (8 + 2)
            got = {}
            _hostkernels.unshared_count()
            _hostkernels.fresh_count()
            for share in (True, False):
                monkeypatch.setattr(_worksplit, "_SHARE_SINCOS", share)
                outs = tuple(np.full(a.shape, np.nan, a.dtype) for a in (q, k))
                got[share] = _hostkernels.run_rope_qk(plans, q, k, table, None, sp, outs)
                assert _hostkernels.unshared_count() == (unshared if share else 0), (v, share)
                assert _hostkernels.fresh_count() == fresh, (v, share)
            for a, b in zip(got[True], got[False]):
                np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32), err_msg=f"v{v}")
            if table is clean:
                for x, y in zip((q, k), got[True]):
                    ref = rope_ref(x, table, "bshd", interleaved, start_positions=sp, backward=backward)
                    assert_close_to_ref(y, ref, x, d, dtype, f"shared sincos v{v}")


def test_in_place_and_out():
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (8, 2, 4, 64)).astype(np.float32)
    f = cupy_rope.rope_freqs(64, 8)
    ref = rope_ref(x, f)
    out = np.empty((2, 8, 4, 64), np.float32).transpose(1, 0, 2, 3)  # sbhd view of bshd memory
    r = cupy_rope.apply_rope(x, f, out=out)
    assert r is out
    assert_close_to_ref(out, ref, x, 64, "float32")
    y = cupy_rope.apply_rope(x, f, transpose_output_memory=True)
    assert y.strides == out.strides
    assert_close_to_ref(y, ref, x, 64, "float32")
    x2 = x.copy()
    cupy_rope.apply_rope(x2, f, out=x2)
    assert_close_to_ref(x2, ref, x, 64, "float32")


@pytest.mark.parametrize("table", ["standard", "general"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_kernel_row_chunks(dtype, table, monkeypatch):
    """Many heads streamed by one thread (row counts 1 to 4 around the rows kept in flight, in
    registers or in the shared-memory ring, and far past them), with cos/sin held (a standard
    table: the angles of each pair equal) or computed per row (a general table); tail units of
    one and of two vectors."""
    from cases import NP_DTYPES

    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 1)
    use_lean(monkeypatch, False)  # the streaming kernel
    rng = np.random.default_rng(9)
    for shape, layout, d2 in (((5, 2, 301, 64), "sbhd", 48), ((37, 7, 64), "thd", 40),
                              ((3, 13, 2, 64), "bshd", 32), ((4, 2, 4, 64), "sbhd", 64),
                              ((6, 1, 1, 64), "sbhd", 64), ((2, 5, 3, 64), "bshd", 48)):
        x = rng.uniform(-2, 2, shape).astype(NP_DTYPES[dtype])
        f = rng.uniform(-9, 9, (40, 1, 1, d2)).astype(np.float32)
        if table == "standard":
            f = np.concatenate([f[..., : d2 // 2]] * 2, -1)
        kw = dict(layout=layout, interleaved=False, cp_size=1, cp_rank=0)
        if layout == "thd":
            kw["cu_seqlens"] = np.array([0, 7, 7, 30], np.int32)
        plan = _plan_for(x, f, kw, False)
        _, _, _, params = plan.launch(info(x), info(x), info(f), info(kw.get("cu_seqlens")), None, 4)
        vals = dict(zip(_abi.ROPE_FIELDS, struct.unpack(f"<{len(_abi.ROPE_FIELDS)}q",
                                                          params[:8 * len(_abi.ROPE_FIELDS)])))
        assert vals["n_chunks"] == 1, vals
        out = np.full(x.shape, np.nan, dtype=x.dtype)
        y = _hostkernels.run_rope(plan, x, f, kw.get("cu_seqlens"), out=out)
        assert_close_to_ref(y, rope_ref(x, f, **kw), x, d2, dtype, f"{layout} {shape}")


def test_work_split_ends():
    """The two ends the `kernel` fixture relies on: one row per thread when the device asks for
    many threads, all rows in one thread when it asks for few."""
    import itertools

    for rows, n_tok, sm in itertools.product((1, 3, 32), (1, 7, 4096), (4, 132)):
        _worksplit._THREADS_PER_SM, saved = 10**9, _worksplit._THREADS_PER_SM
        try:
            assert _worksplit.split_work(n_tok, 1, rows, 64, 64, 8, sm)[3] == rows
            _worksplit._THREADS_PER_SM = 1
            n_rot, n_units, _, chunks, threads = _worksplit.split_work(n_tok, 1, rows, 64, 64, 8, sm)
            assert chunks == max(1, min(rows, -(-sm // (n_tok * n_units)))) and threads == n_tok * n_units * chunks
        finally:
            _worksplit._THREADS_PER_SM = saved


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_odd_units_split(dtype, monkeypatch):
    """Rows of a unit count that is not a power of two (head size 80: 5 units of 16-byte vectors)
    take _ODD_UNITS_FACTOR times the threads, at least _ODD_UNITS_MIN_ROWS rows per thread kept;
    other unit counts and the QKV split keep the fewest chunks. The kernels run the raised split
    (chunks of unequal row counts) right."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 8)
    monkeypatch.setattr(_worksplit, "_ODD_UNITS_FACTOR", 4)
    monkeypatch.setattr(_worksplit, "_ODD_UNITS_MIN_ROWS", 4)
    use_lean(monkeypatch, False)  # the streaming kernel's split
    split = _worksplit.split_work
    assert split(6, 1, 22, 80, 80, 8, 4)[1:4:2] == (5, 2)  # QKV: no rule; ceil(4 * 8 / 30)
    assert split(6, 1, 22, 80, 80, 8, 4, True)[1:4:2] == (5, 5)  # 6 tokens x 5 units: ceil(128 / 30)
    assert split(6, 1, 16, 80, 80, 8, 4, True)[3] == 4  # at most rows // 4 chunks
    assert split(6, 1, 7, 80, 80, 8, 4, True)[3] == 2  # never fewer than without the rule
    assert split(6, 1, 22, 64, 64, 8, 4, True)[1:4:2] == (4, 2)  # 4 units: unchanged
    monkeypatch.setattr(_worksplit, "_ODD_UNITS_FACTOR", 1)
    assert split(6, 1, 22, 80, 80, 8, 4, True)[3] == 2  # a factor of 1: the fewest chunks
    monkeypatch.setattr(_worksplit, "_ODD_UNITS_FACTOR", 4)
    rng = np.random.default_rng(11)
    x = rng.uniform(-2, 2, (2, 3, 22, 80)).astype(NP_DTYPES[dtype])
    kw = dict(layout="sbhd", interleaved=False, cp_size=1, cp_rank=0)
    for f in (rng.uniform(-9, 9, (8, 1, 1, 80)).astype(np.float32), cupy_rope.rope_freqs(80, 8)):
        for backward in (False, True):
            plan = _plan_for(x, f, kw, backward)
            name, _, _, params = plan.launch(info(x), info(x), info(f), None, None, 4)
            vals = dict(zip(_abi.ROPE_FIELDS, struct.unpack(f"<{len(_abi.ROPE_FIELDS)}q",
                                                              params[:8 * len(_abi.ROPE_FIELDS)])))
            # bf16: 5 units, ceil(128 / 30) = 5 chunks (rows 5 or 4 each); float32: 10, ceil(128 / 60) = 3
            want = ("rope", 5, 5) if dtype == "bfloat16" else ("rope", 10, 3)
            assert (name.split("_")[0], vals["n_units"], vals["n_chunks"]) == want, vals
            out = np.full(x.shape, np.nan, dtype=x.dtype)
            y = _hostkernels.run_rope(plan, x, f, out=out)
            assert_close_to_ref(y, rope_ref(x, f, backward=backward, **kw), x, 80, dtype, f"odd units {dtype}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_lean_kernel_limits(dtype, monkeypatch):
    """Large launches with an angle table take the lean kernel (``ropel``) exactly where it can
    run and is faster: contiguous table columns, full rotary rows, at least ``_LEAN_MIN_HEADS``
    heads, at most ``_LEAN_MAX_SEQS`` sequences of ``cu_seqlens`` (or ``_LEAN_MAX_FAST_SEQS`` of
    ``_LEAN_MIN_SEQ_TOKENS`` tokens on average, where the search runs in 32 bits: contiguous int32
    ``cu_seqlens``, ``cp_size`` 1), every element offset of x and y below ``_OFFSET_LIMIT`` (its
    32-bit arithmetic); the streaming kernels take the rest. Each launch, on both sides of each
    limit, is checked against the reference on the host build."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 1)
    monkeypatch.setattr(_worksplit, "_LEAN", True)
    monkeypatch.setattr(_worksplit, "_LEAN_MIN_HEADS", 16)
    rng = np.random.default_rng(5)
    d = 64

    def launch(heads=16, d2=d, table="dense", cu=None, limit=2**31, seqs=64, il=False, fast_seqs=0, seq_tokens=1,
               cp=1):
        monkeypatch.setattr(_worksplit, "_OFFSET_LIMIT", limit)
        monkeypatch.setattr(_worksplit, "_LEAN_MAX_SEQS", seqs)
        monkeypatch.setattr(_worksplit, "_LEAN_MAX_FAST_SEQS", fast_seqs)
        monkeypatch.setattr(_worksplit, "_LEAN_MIN_SEQ_TOKENS", seq_tokens)
        layout = "thd" if cu is not None else "sbhd"
        x = rng.uniform(-2, 2, ((12,) if cu is not None else (6, 2)) + (heads, d)).astype(NP_DTYPES[dtype])
        wide = rng.uniform(-9, 9, (12, 1, 1, 2 * d2 + 4)).astype(np.float32)
        f = {"dense": wide[..., :d2], "strided": wide[..., : 2 * d2: 2]}[table]
        f = f if table == "strided" else np.ascontiguousarray(f)
        plan = _plan.resolve_rope(info(x), info(f), layout, il, info(cu), None, cp, cp - 1, None, False)
        out = np.full(x.shape, np.nan, x.dtype)
        name = plan.launch(info(x), info(out), info(f), info(cu), None, 4).name
        y = _hostkernels.run_rope(plan, x, f, cu, out=out)
        kw = dict(layout=layout, interleaved=il, cu_seqlens=cu, cp_size=cp, cp_rank=cp - 1)
        assert_close_to_ref(y, rope_ref(x, f, **kw), x, d2, dtype, name)
        return name.split("_")[0]

    size = 6 * 2 * 16 * d  # x's largest element offset: size - 1
    cu = np.array([0, 5, 9, 12], np.int32)
    assert launch() == launch(il=True) == "ropel"
    assert launch(heads=15) == "rope"  # too few heads
    assert launch(d2=32) == launch(d2=32, il=True) == "ropem"  # pass-through channels
    assert launch(table="strided") == "rope"  # table columns two floats apart
    assert launch(limit=size - 1) == "rope" and launch(limit=size) == "ropel"  # offsets in 31 bits
    assert launch(cu=cu, seqs=2) == "rope" and launch(cu=cu, seqs=3) == "ropel"  # sequences
    # more sequences where the kernels search cu_seqlens in 32 bits: 3 sequences of 12 tokens
    fast = dict(cu=cu, seqs=2, fast_seqs=3, seq_tokens=4)
    assert launch(**fast) == "ropel"
    assert launch(**{**fast, "fast_seqs": 2}) == "rope" and launch(**{**fast, "seq_tokens": 5}) == "rope"
    assert launch(**{**fast, "cu": cu.astype(np.int64)}) == "rope"  # the 64-bit search
    assert launch(**{**fast, "cu": np.repeat(cu, 2)[::2]}) == "rope"  # a strided cu_seqlens
    cu4 = np.array([0, 4, 8, 12], np.int32)  # context parallelism: lengths of 2 cp_size
    assert launch(**{**fast, "cu": cu4}) == "ropel" and launch(**{**fast, "cu": cu4, "cp": 2}) == "rope"
    # a tensor without heads (k of a q+k launch) never: the lean kernel has no thread without a row
    monkeypatch.setattr(_worksplit, "_LEAN_MIN_HEADS", 0)
    vals = {"f_kind": _abi.ANGLES, "f_scol": 1, "n_rot_units": 4, "n_units": 4, "pos.cu_seqlens": 0, "pos.nseq": 0}
    assert _worksplit.lean_fits({**vals, "n_heads": 1}, []) and not _worksplit.lean_fits({**vals, "n_heads": 0}, [])


@pytest.mark.parametrize("kv_heads", [8, 7, 4, 1])
def test_gqa_qk_launch_takes_lean_kernel_with_any_kv_heads(kv_heads, monkeypatch):
    """With the library's own limit (``_LEAN_MIN_HEADS``, 1), a large q+k launch of grouped-query
    attention (32 q heads, a k of 8 down to 1 heads: multi-query attention) runs both tensors on the
    lean kernel (a k of few heads no longer keeps the launch on the streaming kernel: 5-7% faster on
    an H100, benchmarks/NOTES.md, thirty-eighth session); against the reference on the host build."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 1)  # a large launch: no one-row kernel
    rng = np.random.default_rng(11)
    q = rng.uniform(-2, 2, (6, 2, 32, 64)).astype(NP_DTYPES["bfloat16"])
    k = rng.uniform(-2, 2, (6, 2, kv_heads, 64)).astype(NP_DTYPES["bfloat16"])
    f = np.ascontiguousarray(rng.uniform(-9, 9, (12, 1, 1, 64)).astype(np.float32))
    plans = _plan.resolve_rope_pair(info(q), info(k), info(f), "sbhd", False, None, None, 1, 0, False, False)
    outs = tuple(np.full(p.shape, np.nan, q.dtype) for p in plans)
    spec = _worksplit.rope_launch(plans, [(info(q), info(outs[0])), (info(k), info(outs[1]))], info(f), None, None,
                                  sm_count=4)
    assert spec.name.split("_")[0] == "ropel"
    yq, yk = _hostkernels.run_rope_qk(plans, q, k, f, outs=outs)
    kw = dict(layout="sbhd", interleaved=False, cu_seqlens=None, cp_size=1, cp_rank=0)
    assert_close_to_ref(yq, rope_ref(q, f, **kw), q, 64, "bfloat16", spec.name)
    assert_close_to_ref(yk, rope_ref(k, f, **kw), k, 64, "bfloat16", spec.name)


def test_lean_rows_come_from_the_kernel_define(monkeypatch):
    """The lean kernel's rows per thread have one definition, the source's CUPY_ROPE_LEAN_ROWS (or
    a build's -D override of it, as the benchmark harness's tuning sets): the launch layer splits
    the heads by it; the kernel built with the source's rotates every row (the host build is one
    per process, with the source's defines: overrides are checked in the split only)."""
    assert _kernels.define_value("CUPY_ROPE_LEAN_ROWS") == 4
    with pytest.raises(ValueError, match="no integer #define"):
        _kernels.define_value("CUPY_ROPE_NO_SUCH_DEFINE")
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 1)
    use_lean(monkeypatch)
    rng = np.random.default_rng(3)
    x = rng.uniform(-2, 2, (5, 2, 10, 64)).astype(np.float32)
    f = rng.uniform(-9, 9, (5, 1, 1, 64)).astype(np.float32)
    for rows, chunks in ((4, 3), (2, 5), (3, 4), (5, 2)):
        monkeypatch.setattr(_kernels, "DEFINES", () if rows == 4 else (f"-DCUPY_ROPE_LEAN_ROWS={rows}",))
        plan = _plan_for(x, f, dict(layout="sbhd", interleaved=False, cp_size=1, cp_rank=0), False)
        name, _, _, params = plan.launch(info(x), info(x), info(f), None, None, 4)
        vals = dict(zip(_abi.ROPE_FIELDS, struct.unpack(f"<{len(_abi.ROPE_FIELDS)}q",
                                                          params[:8 * len(_abi.ROPE_FIELDS)])))
        assert (name.split("_")[0], vals["n_chunks"]) == ("ropel", chunks), (rows, vals)
        if rows == 4:
            y = _hostkernels.run_rope(plan, x, f, out=np.full(x.shape, np.nan, x.dtype))
            assert_close_to_ref(y, rope_ref(x, f), x, 64, "float32", f"lean rows {rows}")


def test_host_build_runs_grids_of_one_row():
    """The launch layer's grids have one row (a two-tensor launch puts both tensors' blocks in it):
    the host build refuses any other before it runs a block."""
    with pytest.raises(ValueError, match="expected one row"):
        _hostkernels.launch("rope_f32_v1_n_f", (1, 2), 32, b"")


@pytest.mark.parametrize("kernel", ["one_row", "streaming", "lean"])
@pytest.mark.parametrize("misaligned", ["input", "output"])
def test_host_build_raises_on_misaligned_vectors(misaligned, kernel, monkeypatch):
    """The host build refuses a vector load or store at an address that is not a multiple of
    its size, as the GPU faults on one: a launch forced to 16-byte vectors (the plan would choose
    single elements) whose input, or output, has rows off the 16-byte grid raises, on the one-row
    kernel (loads by load_vec), on the streaming kernel (loads by asynchronous copies into its
    ring) and on the lean kernel (which takes 16-byte vectors only: the plan's own width runs on
    the streaming kernel); the same call with the plan's own width runs and is right."""
    rng = np.random.default_rng(3)
    wide = rng.uniform(-2, 2, (4, 2, 3, 129)).astype(np.float32)
    x = np.ascontiguousarray(wide[..., :128]) if misaligned == "output" else wide[..., 1:]
    freqs = rng.uniform(-5, 5, (4, 1, 1, 128)).astype(np.float32)
    plan = _plan.resolve_rope(info(x), info(freqs), "sbhd", False, None, None, 1, 0, None, False)

    def out():
        if misaligned == "output":
            return np.full((4, 2, 3, 129), np.nan, np.float32)[..., 1:]
        return np.full((4, 2, 3, 128), np.nan, np.float32)

    monkeypatch.setattr(_worksplit, "_ONE_ROW", kernel == "one_row")
    monkeypatch.setattr(_worksplit, "_LEAN", kernel == "lean")
    if kernel == "one_row":
        monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9)  # one row per thread
    names, orig = [], _hostkernels.launch
    monkeypatch.setattr(_hostkernels, "launch", lambda name, *a: names.append(name) or orig(name, *a))
    y = _hostkernels.run_rope(plan, x, freqs, out=out())
    assert_close_to_ref(y, rope_ref(x, freqs), x, 128, "float32", misaligned)
    monkeypatch.setattr(_worksplit, "pick_vec", lambda *a, **k: 4)
    with pytest.raises(RuntimeError, match="misaligned"):
        _hostkernels.run_rope(plan, x, freqs, out=out())
    expect = {"one_row": ["rope1"] * 2, "streaming": ["rope"] * 2, "lean": ["rope", "ropel"]}[kernel]
    assert [n.split("_")[0] for n in names] == expect, names


@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("one_row", [False, True], ids=["streaming", "one_row"])
def test_host_kernels_invalid_negative_cu_seqlens(cp_size, one_row, monkeypatch):
    """Invalid cu_seqlens (negative entries, past the rows: the GPU path checks contents only in
    debug mode) are divided by cp_size as Python's floor division does (spec 5.1;
    ``_positions.py``), also where the division leaves a remainder: the host build's positions
    are the NumPy backend's (which computes them with the Python definition), rows in no sequence
    copied. (Sorted entries: for unsorted ones the device's binary search and NumPy's
    searchsorted may pick different sequences.)"""
    from cupy_rope import _numpy_backend

    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9 if one_row else 1)
    monkeypatch.setattr(_worksplit, "_ONE_ROW", one_row)
    rng = np.random.default_rng(23)
    d, t = 32, 8
    x = rng.standard_normal((t, 2, d)).astype(np.float32)
    freqs = cupy_rope.rope_freqs(d, 64)
    for cu in ([-7, -3, 5, 9, 16], [-11, -5, -1, 7, 13], [-13, -8, -5, 17]):
        cu = np.array(cu, np.int64)
        kw = dict(layout="thd", interleaved=False, cu_seqlens=cu, cp_size=cp_size, cp_rank=cp_size - 1)
        plan = _plan_for(x, freqs, kw, False)
        got = _hostkernels.run_rope(plan, x, freqs, cu, None, out=np.full(x.shape, np.nan, np.float32))
        want = _numpy_backend.rope(np, plan, x, freqs, cu, None)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
        same = (want == x).all(axis=(1, 2))
        np.testing.assert_array_equal(got[same], x[same])
        assert (~same).any(), cu  # some rows rotated

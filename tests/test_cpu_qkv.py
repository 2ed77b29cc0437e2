"""Packed QKV (spec 6) on the CPU: NumPy backend and host-built kernels vs the reference."""

import itertools

import numpy as np
import pytest

import cupy_rope
from cupy_rope import _plan, _worksplit
from cupy_rope._dev import hostkernels as _hostkernels
from cupy_rope._interop import info
from cases import NP_DTYPES, make_cu_seqlens, split_in_chunks, strided
from reference import assert_close_to_ref, qkv_split_ref, rope_ref, term_scale

GRID = list(itertools.product(("sbhd", "bshd", "thd"), (1, 2, 8), (1, 4, 8), (64, 80, 128, 256)))


def qkv_case(i, layout, g, n, d):
    """Case ``i`` of the grid: every option drawn independently from the case's own generator
    (dtype, rotary width, interleaving, cp, start positions and their dtype, table kinds and
    shapes, whether k shares q's table or only its address, the input's stride pattern)."""
    rng = np.random.default_rng(500 + i)
    pick = lambda options: options[int(rng.integers(0, len(options)))]  # noqa: E731
    dtype = pick(("float32", "float16", "bfloat16"))
    d2 = pick((d, d // 2, d - 2 if d > 2 else d))
    il = bool(pick((False, True)))
    cp_size, cp_rank = pick(((1, 0), (2, 1), (2, 0), (4, 3), (4, 1)))
    kw = dict(layout=layout, interleaved=il, cp_size=cp_size, cp_rank=cp_rank)
    if layout == "thd":
        cu, t = make_cu_seqlens(rng, cp_size, nseq=3, max_len=8)
        lead = (t,)
        kw["cu_seqlens"] = cu.astype(pick((np.int32, np.int64)))
        nseq = 3
        rows = int(np.diff(cu).max())
    else:
        s = 2 * cp_size
        lead = (s, 2) if layout == "sbhd" else (2, s)
        nseq = 2
        rows = s * cp_size
    if pick((True, True, False)):
        kw["start_positions"] = rng.integers(0, 4, nseq).astype(pick((np.int32, np.int64)))
        rows += 4 - pick((0, 0, 2))  # sometimes too short: tokens past the table are copied

    def table(shape):
        if pick((True, False)):  # standard-looking: both angles of every pair equal
            half = rng.uniform(-10, 10, shape[:-1] + (d2 // 2,))
            t = np.repeat(half, 2, axis=-1) if il else np.concatenate([half, half], -1)
            return t.astype(np.float32)
        return rng.uniform(-10, 10, shape).astype(np.float32)

    qf = table((rows, 1, 1, d2) if pick((True, False)) else (rows, d2))
    k_kind = pick(("same", "own", "alias"))
    if k_kind == "same":
        kf = qf
    elif k_kind == "own":  # longer, or of q's very shape (another table that q's descriptor would match)
        kf = table(pick(((rows + 1, d2), (rows + 1, 1, 1, d2), qf.shape)))
    else:  # at q's very address, every other row of it: not q's table, though the address is
        base = table((2 * rows,) + qf.shape[1:])
        qf, kf = base[:rows], base[::2]
    mode = pick(("contiguous", "permuted", "offset", "channel_stride"))
    qkv = strided(lead + (g, (n + 2) * d), dtype, rng, mode)
    return dtype, qkv, qf, kf, kw


@pytest.fixture(params=["one_row", "max_rows", "two_chunks"])
def kernel(request, monkeypatch):
    """Both ends of the work split (see test_cpu_matrix.kernel), and two chunks per group: threads
    that step over every other row (query, key and value rows alike)."""
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9 if request.param == "one_row" else 1)
    if request.param == "two_chunks":
        split_in_chunks(monkeypatch, 2)
    return request.param


@pytest.mark.parametrize("i,layout,g,n,d", [(i,) + c for i, c in enumerate(GRID)])
def test_qkv(i, layout, g, n, d, kernel):
    dtype, qkv, qf, kf, kw = qkv_case(i, layout, g, n, d)
    split = (n * d, d, d)
    pos_kw = {k: v for k, v in kw.items()}
    qr = rope_ref(qkv_split_ref(qkv, n, d)[0], qf, **pos_kw)
    kr = rope_ref(qkv_split_ref(qkv, n, d)[1], kf, **pos_kw)
    vr = qkv_split_ref(qkv, n, d)[2].astype(np.float64)
    d2 = qf.shape[-1]
    # NumPy backend through the public API (split= and num_q_heads= forms)
    q, k, v = cupy_rope.apply_qkv_rope(qkv, qf, kf, split, **kw)
    q2, _, _ = cupy_rope.apply_qkv_rope(qkv, qf, kf, num_q_heads=g * n, **kw)
    for got, ref, x, what in ((q, qr, qkv_split_ref(qkv, n, d)[0], "q"), (q2, qr, qkv_split_ref(qkv, n, d)[0], "q2"),
                              (k, kr, qkv_split_ref(qkv, n, d)[1], "k")):
        assert_close_to_ref(got, ref, x, d2, dtype, f"numpy {what}")
    np.testing.assert_array_equal(np.asarray(v).astype(np.float64), vr)
    # host-built kernels
    plan = _plan.resolve_qkv(info(qkv), info(qf), info(kf), split, kw["layout"], None, kw["interleaved"],
                             info(kw.get("cu_seqlens")), info(kw.get("start_positions")),
                             kw["cp_size"], kw["cp_rank"])
    hq, hk, hv = _hostkernels.run_qkv(plan, (qkv,), qf, kf, kw.get("cu_seqlens"), kw.get("start_positions"))
    assert_close_to_ref(hq, qr, qkv_split_ref(qkv, n, d)[0], d2, dtype, "host q")
    assert_close_to_ref(hk, kr, qkv_split_ref(qkv, n, d)[1], d2, dtype, "host k")
    np.testing.assert_array_equal(hv.astype(np.float64), vr)

    # backward: strided / stride-0 gradients
    rng = np.random.default_rng(900 + i)
    lead = qkv.shape[:-2]
    modes = ("contiguous", "zero_stride", "channel_stride", "permuted", "offset")
    dq, dk, dv = (strided(lead + (h, d), dtype, rng, modes[int(rng.integers(0, 5))]) for h in (g * n, g, g))
    gq = rope_ref(dq, qf, backward=True, **pos_kw)
    gk = rope_ref(dk, kf, backward=True, **pos_kw)
    want = np.concatenate([gq.reshape(lead + (g, n * d)), gk, dv.astype(np.float64)], axis=-1)
    xin = None
    scale = np.concatenate([term_scale(dq, d2).reshape(lead + (g, n * d)), term_scale(dk, d2),
                            np.abs(np.asarray(dv).astype(np.float64))], axis=-1)
    dqkv = cupy_rope.apply_qkv_rope_backward(dq, dk, dv, qf, kf, split, **kw)
    assert dqkv.shape == qkv.shape and dqkv.flags.c_contiguous
    assert_close_to_ref(dqkv, want, xin, 0, dtype, "numpy dqkv", scale=scale)
    bplan = _plan.resolve_qkv_backward(info(dq), info(dk), info(dv), info(qf), info(kf), split, kw["layout"],
                                       None, kw["interleaved"], info(kw.get("cu_seqlens")),
                                       info(kw.get("start_positions")), kw["cp_size"], kw["cp_rank"])
    hd = _hostkernels.run_qkv(bplan, (dq, dk, dv), qf, kf, kw.get("cu_seqlens"), kw.get("start_positions"))
    assert_close_to_ref(hd, want, xin, 0, dtype, "host dqkv", scale=scale)

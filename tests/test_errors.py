"""Spec section 7: every misuse raises ValueError/TypeError naming the argument."""

import numpy as np
import pytest

import cupy_rope

F = cupy_rope.rope_freqs(64, 16)
X = np.random.default_rng(0).uniform(-1, 1, (16, 2, 4, 64)).astype(np.float32)
T = np.random.default_rng(1).uniform(-1, 1, (10, 4, 64)).astype(np.float32)
CU = np.array([0, 4, 10], np.int32)


@pytest.mark.parametrize("call,exc,words", [
    (lambda: cupy_rope.apply_rope(X, F, "sbdh"), ValueError, ["layout", "sbdh"]),
    (lambda: cupy_rope.apply_rope(X[0], F, "sbhd"), ValueError, ["`x`", "4-D", "(2, 4, 64)"]),
    (lambda: cupy_rope.apply_rope(T[None], F, "thd", cu_seqlens=CU), ValueError, ["`x`", "3-D"]),
    (lambda: cupy_rope.apply_rope(X, F.astype(np.float64)), TypeError, ["freqs", "float32", "float64"]),
    (lambda: cupy_rope.apply_rope(X, F.reshape(16, 1, 64, 1)), ValueError, ["freqs", "[S, 1, 1, d2]"]),
    (lambda: cupy_rope.apply_rope(X, np.zeros((16, 1, 1, 7), np.float32)), ValueError, ["freqs", "even", "7"]),
    (lambda: cupy_rope.apply_rope(X, np.zeros((16, 1, 1, 66), np.float32)), ValueError, ["freqs", "d2 <= ", "66"]),
    (lambda: cupy_rope.apply_rope(X, F[:8]), ValueError, ["freqs", "16", "8 rows"]),
    (lambda: cupy_rope.apply_rope(X, F, cp_size=2), ValueError, ["freqs", "32", "16 rows"]),
    (lambda: cupy_rope.apply_rope(T, F, "thd"), ValueError, ["cu_seqlens", "thd", "None"]),
    (lambda: cupy_rope.apply_rope(X, F, cu_seqlens=CU), ValueError, ["cu_seqlens", "sbhd"]),
    (lambda: cupy_rope.apply_rope(T, F, "thd", cu_seqlens=CU[None]), ValueError, ["cu_seqlens", "1-D"]),
    (lambda: cupy_rope.apply_rope(T, F, "thd", cu_seqlens=CU.astype(np.int16)), TypeError, ["cu_seqlens", "int16"]),
    (lambda: cupy_rope.apply_rope(T, F, "thd", cu_seqlens=CU.astype(np.float32)), TypeError, ["cu_seqlens", "float32"]),
    (lambda: cupy_rope.apply_rope(X, F, start_positions=np.zeros((2, 1), np.int32)), ValueError, ["start_positions", "1-D"]),
    (lambda: cupy_rope.apply_rope(X, F, start_positions=np.zeros(1, np.int32)), ValueError, ["start_positions", "2", "(1,)"]),
    (lambda: cupy_rope.apply_rope(T, F, "thd", cu_seqlens=CU, start_positions=np.zeros(1, np.int32)), ValueError, ["start_positions", "nseq"]),
    (lambda: cupy_rope.apply_rope(X, F, cp_size=0), ValueError, ["cp_size", ">= 1", "0"]),
    (lambda: cupy_rope.apply_rope(X, F, cp_size=2, cp_rank=2), ValueError, ["cp_rank", "2"]),
    (lambda: cupy_rope.apply_rope(X, F, cp_rank=-1), ValueError, ["cp_rank", "-1"]),
    (lambda: cupy_rope.apply_rope(X[:15], F, cp_size=3), ValueError, ["even", "15"]),
    (lambda: cupy_rope.apply_rope(X.astype(np.int32), F), TypeError, ["`x`", "float32", "int32"]),
    (lambda: cupy_rope.apply_rope_backward(X.astype(np.float64), F), TypeError, ["`grad`", "float64"]),
    (lambda: cupy_rope.apply_rope(X, F, interleaved=1), TypeError, ["interleaved", "bool"]),
    (lambda: cupy_rope.apply_rope(X, F, cp_size=2.0), TypeError, ["cp_size", "int"]),
    (lambda: cupy_rope.apply_rope(X, F, out=np.empty((16, 2, 4, 63), np.float32)), ValueError, ["out", "shape"]),
    (lambda: cupy_rope.apply_rope(X, F, out=np.empty(X.shape, np.float16)), TypeError, ["out", "float32"]),
    (lambda: cupy_rope.apply_rope(X, F, out=np.lib.stride_tricks.as_strided(np.empty((2, 4, 64), np.float32), X.shape, (0, 1024, 256, 4))), ValueError, ["out", "zero strides"]),
    (lambda: cupy_rope.apply_rope(X, F, out=np.broadcast_to(np.empty((1, 2, 4, 64), np.float32), X.shape)), ValueError, ["`out`", "read-only"]),
    (lambda: cupy_rope.apply_rope(X, F, "bshd", transpose_output_memory=True), ValueError, ["transpose_output_memory", "sbhd"]),
    (lambda: cupy_rope.apply_rope([1, 2], F), TypeError, ["list"]),
    (lambda: cupy_rope.apply_qkv_rope(np.zeros((4, 1, 2, 6 * 8), np.float32), F[..., :8], F[..., :8], split=(32, 8, 9)), ValueError, ["split", "48", "sum 49"]),
    (lambda: cupy_rope.apply_qkv_rope(np.zeros((4, 1, 2, 6 * 8), np.float32), F[..., :8], F[..., :8], split=(30, 9, 9)), ValueError, ["split", "multiple"]),
    (lambda: cupy_rope.apply_qkv_rope(np.zeros((4, 1, 2, 48), np.float32), F[..., :8], F[..., :8]), ValueError, ["split", "exactly one"]),
    (lambda: cupy_rope.apply_qkv_rope(np.zeros((4, 1, 2, 48), np.float32), F[..., :8], F[..., :8], split=(32, 8, 8), num_q_heads=8), ValueError, ["exactly one", "both"]),
    (lambda: cupy_rope.apply_qkv_rope(np.zeros((4, 1, 2, 48), np.float32), F[..., :8], F[..., :8], num_q_heads=3), ValueError, ["num_q_heads", "multiple", "3"]),
    (lambda: cupy_rope.apply_qkv_rope(np.zeros((4, 1, 2, 48), np.float32), F[..., :8], F[..., :6], num_q_heads=8), ValueError, ["k_freqs", "d2 = 8"]),
])
def test_error(call, exc, words):
    with pytest.raises(exc) as ei:
        call()
    msg = str(ei.value)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


def test_debug_switch_checks_index_contents():
    f = F[:8]
    cu_bad = np.array([0, 6, 4, 10], np.int32)
    t = np.random.default_rng(2).uniform(-1, 1, (10, 2, 64)).astype(np.float32)
    # without the switch, on the CPU: invalid cu_seqlens raise (the values are on the host),
    # positions past the table are copied through (spec 5.4)
    with pytest.raises(ValueError, match="non-decreasing"):
        cupy_rope.apply_rope(t, f, "thd", cu_seqlens=cu_bad)
    y = cupy_rope.apply_rope(t, f, "thd", cu_seqlens=np.array([0, 10], np.int32))
    np.testing.assert_array_equal(y[8:], t[8:])
    cupy_rope.set_debug(True)
    try:
        with pytest.raises(ValueError, match="non-decreasing"):
            cupy_rope.apply_rope(t, f, "thd", cu_seqlens=cu_bad)
        with pytest.raises(ValueError, match="freqs.*rows"):
            cupy_rope.apply_rope(t, f, "thd", cu_seqlens=np.array([0, 10], np.int32))
        with pytest.raises(ValueError, match="start_positions"):
            cupy_rope.apply_rope(X, F, start_positions=np.array([0, -3], np.int32))
        with pytest.raises(ValueError, match="freqs"):
            cupy_rope.apply_rope(X, F, start_positions=np.array([0, 1], np.int32))
        with pytest.raises(ValueError, match="divisible by 2 \\* cp_size = 4"):
            cupy_rope.apply_rope(t, cupy_rope.rope_freqs(64, 32), "thd", cu_seqlens=np.array([0, 6, 10], np.int32), cp_size=2)
        with pytest.raises(ValueError, match="cu_seqlens\\[0\\]"):
            cupy_rope.apply_rope(t, f, "thd", cu_seqlens=np.array([2, 6], np.int32))
        cupy_rope.apply_rope(t, cupy_rope.rope_freqs(64, 32), "thd", cu_seqlens=np.array([0, 4, 8], np.int32), cp_size=2)
        # a packed batch of no sequences passes the check, and every token is copied through
        for sp in (None, np.zeros(0, np.int32)):
            y = cupy_rope.apply_rope(t, f, "thd", cu_seqlens=np.array([0], np.int32), start_positions=sp)
            np.testing.assert_array_equal(y, t)
    finally:
        cupy_rope.set_debug(False)


def test_out_of_table_positions_copy_through():
    x = X[:4]
    sp = np.array([0, 100], np.int32)  # batch row 1 is past the table
    y = cupy_rope.apply_rope(x, F, start_positions=sp)
    np.testing.assert_array_equal(y[:, 1], x[:, 1])
    assert not np.array_equal(y[1:, 0], x[1:, 0])

"""Safety on every input (one test per defect found by the outside check): strided index
tensors, foreign devices, named errors for every argument, nothing written on error."""

import numpy as np
import pytest

import cupy_rope
from cupy_rope import _api, _launch, _plan
from cupy_rope._dev import hostkernels as _hostkernels
from cupy_rope._interop import info
from reference import assert_close_to_ref, rope_ref

RNG = np.random.default_rng(11)
F = cupy_rope.rope_freqs(32, 24)
X = RNG.uniform(-1, 1, (8, 3, 2, 32)).astype(np.float32)
T = RNG.uniform(-1, 1, (14, 2, 32)).astype(np.float32)
QKV = RNG.uniform(-1, 1, (4, 2, 2, 4 * 32)).astype(np.float32)


def _strided_views(vals, dtype):
    """The same index values as a reversed view, a stepped slice, a column of a 2-D array and
    (when all equal) a stride-0 expansion, each with garbage around it."""
    v = np.asarray(vals, dtype)
    rev = np.full(2 * v.size + 1, 2**30 + 7, dtype)
    rev[1: 1 + v.size] = v[::-1]
    stepped = np.full(3 * v.size + 2, -(2**30), dtype)
    stepped[2::3][: v.size] = v
    wide = np.full((v.size, 3), 2**29, dtype)
    wide[:, 1] = v
    out = {"reversed": rev[1: 1 + v.size][::-1], "stepped": stepped[2::3][: v.size], "column": wide[:, 1]}
    if (v == v[0]).all():
        out["expanded"] = np.broadcast_to(v[:1], v.shape)
    for k, a in out.items():
        assert np.array_equal(a, v), k
    return out


@pytest.mark.parametrize("dtype", ["int32", "int64"])
@pytest.mark.parametrize("backward", [False, True])
def test_strided_index_tensors_host_kernels(dtype, backward):
    """The kernels honour the strides of cu_seqlens and start_positions (GPU bug: read as
    contiguous, wrong results and reads past the allocation)."""
    cu = [0, 3, 3, 9, 12]
    sp = [2, 0, 5, 1]
    for mode, c in _strided_views(cu, dtype).items():
        for smode, s in list(_strided_views(sp, dtype).items()) + list(_strided_views([4] * 4, dtype).items()):
            plan = _plan.resolve_rope(info(T), info(F), "thd", False, info(c), info(s), 1, 0, None, backward)
            out = np.full(T.shape, np.nan, np.float32)
            y = _hostkernels.run_rope(plan, T, F, c, s, out=out)
            ref = rope_ref(T, F, "thd", cu_seqlens=np.asarray(c), start_positions=np.asarray(s), backward=backward)
            assert_close_to_ref(y, ref, T, 32, "float32", f"cu {mode}, sp {smode}")
    for smode, s in _strided_views([1, 4, 0], dtype).items():
        plan = _plan.resolve_rope(info(X), info(F), "sbhd", True, None, info(s), 2, 1, None, backward)
        y = _hostkernels.run_rope(plan, X, F, None, s, out=np.full(X.shape, np.nan, np.float32))
        ref = rope_ref(X, F, interleaved=True, start_positions=np.asarray(s), cp_size=2, cp_rank=1, backward=backward)
        assert_close_to_ref(y, ref, X, 32, "float32", f"sbhd sp {smode}")


def test_meta_tensors_give_meta_outputs():
    torch = pytest.importorskip("torch")
    x = torch.empty(8, 3, 2, 32, device="meta", dtype=torch.bfloat16)
    f = torch.empty(24, 1, 1, 32, device="meta")
    for fn in (cupy_rope.apply_rope, cupy_rope.apply_rope_backward):
        y = fn(x, f)
        assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype
    y = cupy_rope.apply_rope(x, f, transpose_output_memory=True)
    assert y.device.type == "meta" and y.shape == x.shape and y.stride() == (32 * 2, 8 * 32 * 2, 32, 1)
    qkv = torch.empty(4, 2, 2, 4 * 32, device="meta", dtype=torch.float16)
    q, k, v = cupy_rope.apply_qkv_rope(qkv, f, f, num_q_heads=4)
    assert all(t.device.type == "meta" for t in (q, k, v)) and q.shape == (4, 2, 4, 32) and k.shape == (4, 2, 2, 32)
    d = cupy_rope.apply_qkv_rope_backward(q, k, v, f, f)
    assert d.device.type == "meta" and d.shape == qkv.shape
    with pytest.raises(ValueError, match="`freqs`.*same device"):
        cupy_rope.apply_rope(x, torch.zeros(24, 1, 1, 32))


def test_foreign_device_named_error(monkeypatch):
    a = _api._Args(x=X, freqs=F)
    a.infos["x"] = _plan.ArrayInfo(X.shape, (0, 0, 0, 1), "float32", ("mps", 0), 0)
    with pytest.raises(ValueError, match="`x`: expected an array on the CPU or a CUDA device, got .*mps"):
        _api._device(a, "x")


@pytest.mark.parametrize("bad", [None, [1.0, 2.0], (1, 2), 3.0, "x"])
def test_non_arrays_name_the_argument(bad):
    calls = {
        "x": lambda: cupy_rope.apply_rope(bad, F),
        "grad": lambda: cupy_rope.apply_rope_backward(bad, F),
        "freqs": lambda: cupy_rope.apply_rope(X, bad),
        "qkv": lambda: cupy_rope.apply_qkv_rope(bad, F, F, num_q_heads=4),
        "q_freqs": lambda: cupy_rope.apply_qkv_rope(QKV, bad, F, num_q_heads=4),
        "k_freqs": lambda: cupy_rope.apply_qkv_rope(QKV, F, bad, num_q_heads=4),
        "dq": lambda: cupy_rope.apply_qkv_rope_backward(bad, X[:4, :2], X[:4, :2], F, F),
        "dk": lambda: cupy_rope.apply_qkv_rope_backward(X[:4], bad, X[:4, :2], F, F),
        "dv": lambda: cupy_rope.apply_qkv_rope_backward(X[:4], X[:4, :2], bad, F, F),
    }
    if bad is not None:
        calls.update({
            "out": lambda: cupy_rope.apply_rope(X, F, out=bad),
            "cu_seqlens": lambda: cupy_rope.apply_rope(T, F, "thd", cu_seqlens=bad),
            "start_positions": lambda: cupy_rope.apply_rope(X, F, start_positions=bad),
        })
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"`{name}`: expected a NumPy, CuPy, torch or JAX array"):
            call()


def test_qkv_table_errors_name_the_table():
    short = F[:3]
    with pytest.raises(ValueError, match="`q_freqs`: expected at least s \\* cp_size = 4"):
        cupy_rope.apply_qkv_rope(QKV, short, F, num_q_heads=4)
    with pytest.raises(ValueError, match="`k_freqs`: expected at least s \\* cp_size = 4"):
        cupy_rope.apply_qkv_rope(QKV, F, short, num_q_heads=4)
    cupy_rope.set_debug(True)
    try:
        with pytest.raises(ValueError, match="`k_freqs`: expected enough rows"):
            cupy_rope.apply_qkv_rope(QKV, F, F[:5], num_q_heads=4, start_positions=np.array([0, 3], np.int32))
    finally:
        cupy_rope.set_debug(False)


def test_structured_field_strides_name_the_argument():
    rec = np.zeros(X.shape, dtype=[("a", np.float16), ("b", np.int8)])
    with pytest.raises(ValueError, match="`x`: expected strides that are multiples of the item size 2"):
        cupy_rope.apply_rope(rec["a"], F)
    with pytest.raises(ValueError, match="`out`: expected strides"):
        cupy_rope.apply_rope(X.astype(np.float16), F, out=rec["a"])


@pytest.mark.parametrize("split,exc", [((64.0, 32.0, 32.0), TypeError), ("qkv", TypeError), ([64, 32], TypeError),
                                       ((64, 32, True), TypeError), ((0, 32, 32), ValueError)])
def test_split_must_be_three_ints(split, exc):
    with pytest.raises(exc, match="`split`"):
        cupy_rope.apply_qkv_rope(QKV, F, F, split)
    assert cupy_rope.apply_qkv_rope(QKV, F, F, [np.int64(64), 32, 32])[0].shape == (4, 2, 4, 32)


def test_zero_heads_and_zero_groups():
    y = cupy_rope.apply_rope(np.zeros((8, 3, 0, 32), np.float32), F)
    assert y.shape == (8, 3, 0, 32)
    empty = np.zeros((4, 2, 0, 4 * 32), np.float32)
    q, k, v = cupy_rope.apply_qkv_rope(empty, F, F, (64, 32, 32))
    assert q.shape == (4, 2, 0, 32) and k.shape == (4, 2, 0, 32)
    with pytest.raises(ValueError, match="`qkv`: expected at least one KV group"):
        cupy_rope.apply_qkv_rope(empty, F, F, num_q_heads=4)
    assert cupy_rope.apply_qkv_rope_backward(q, k, v, F, F, (64, 32, 32)).shape == empty.shape
    with pytest.raises(ValueError, match="`split`.*g = 0"):
        cupy_rope.apply_qkv_rope_backward(q, k, v, F, F)
    with pytest.raises(ValueError, match="`num_q_heads`"):
        cupy_rope.apply_qkv_rope(QKV, F, F, num_q_heads=3)


def test_options_validated_before_cache_keys():
    with pytest.raises(ValueError, match="`cp_size`: expected an int < 2147483648"):
        cupy_rope.apply_rope(T, F, "thd", cu_seqlens=np.array([0, 14]), cp_size=2**70)
    for kw, name in ((dict(interleaved=[True]), "interleaved"), (dict(cp_size=[1]), "cp_size"),
                     (dict(layout=["sbhd"]), "layout"), (dict(cp_rank=[0]), "cp_rank"),
                     (dict(transpose_output_memory=[1]), "transpose_output_memory")):
        with pytest.raises((TypeError, ValueError), match=f"`{name}`"):
            cupy_rope.apply_rope(X, F, **kw)
    key, ptrs = _launch.cache_key("cupy", ("rope",), ([1],), ())  # unhashable: a miss, never kept
    misses, size = _launch._STATS["misses"], len(_launch._CACHE)
    assert _launch.cached_call(key, ptrs, (), "cupy") is None and _launch._STATS["misses"] == misses + 1
    _launch.cache_put(key, object(), [])
    assert len(_launch._CACHE) == size
    # options are keyed with their types: interleaved=1 never hits the entry of interleaved=True
    assert _launch.cache_key("cupy", ("rope",), (True,), ())[0] != _launch.cache_key("cupy", ("rope",), (1,), ())[0]


def test_read_only_out_is_a_named_error_and_nothing_written():
    out = np.full(X.shape, 7.0, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="`out`: expected a writable array, got a read-only"):
        cupy_rope.apply_rope(X, F, out=out)
    assert (out == 7.0).all()


def test_torch_ops_reject_non_tensors_by_name():
    pytest.importorskip("torch")
    import torch

    import cupy_rope.torch as crt

    x, f = torch.from_numpy(X), torch.from_numpy(F)
    for call, name in ((lambda: crt.apply_rope(X, f), "x"), (lambda: crt.apply_rope(x, F), "freqs"),
                       (lambda: crt.apply_rope(x, f, start_positions=[0, 1, 2]), "start_positions"),
                       (lambda: crt.apply_rope_backward(None, f), "grad"),
                       (lambda: crt.apply_qkv_rope(torch.from_numpy(QKV), f, [1.0], num_q_heads=4), "k_freqs")):
        with pytest.raises(TypeError, match=f"`{name}`: expected a torch.Tensor"):
            call()


@pytest.mark.parametrize("backward", [False, True])
def test_numpy_thd_empty_table_and_tokens_past_it(backward):
    fn = cupy_rope.apply_rope_backward if backward else cupy_rope.apply_rope
    cu = np.array([0, 6, 14], np.int32)
    y = fn(T, np.zeros((0, 32), np.float32), "thd", cu_seqlens=cu)
    np.testing.assert_array_equal(y, T)
    f = F[:4]
    y = fn(T, f, "thd", cu_seqlens=cu, start_positions=np.array([0, 2], np.int64))
    assert_close_to_ref(y, rope_ref(T, f, "thd", cu_seqlens=cu, start_positions=np.array([0, 2]), backward=backward),
                        T, 32, "float32")
    np.testing.assert_array_equal(y[4:6], T[4:6])  # positions 4, 5 of sequence 0: past the table


def test_torch_cpu_transpose_output_memory_is_a_view():
    torch = pytest.importorskip("torch")
    y = cupy_rope.apply_rope(torch.from_numpy(X), torch.from_numpy(F), transpose_output_memory=True)
    s, b, h, d = X.shape
    assert y.shape == X.shape and y.stride() == (h * d, s * h * d, d, 1)
    assert_close_to_ref(y.numpy(), rope_ref(X, F), X, 32, "float32")


def test_debug_catches_start_positions_that_wrap():
    cupy_rope.set_debug(True)
    try:
        for sp in ([0, 2**63 - 2, 0], [2**63 - 1, 0, 0]):
            with pytest.raises(ValueError, match="`freqs`: expected enough rows"):
                cupy_rope.apply_rope(X, F, start_positions=np.array(sp, np.int64), cp_size=2, cp_rank=1)
    finally:
        cupy_rope.set_debug(False)
    # without debug the wrapped tokens are copied, like any position outside the table
    sp = np.array([0, 2**63 - 2, 0], np.int64)
    y = cupy_rope.apply_rope(X, F, start_positions=sp, cp_size=2, cp_rank=1)
    np.testing.assert_array_equal(y[:, 1], X[:, 1])


@pytest.mark.parametrize("cu,cp,words", [([0, 8, 6, 14], 1, "non-decreasing"), ([0, 6, 30], 1, "<= t = 14"),
                                         ([0, 6, 12], 2, "divisible by 2 \\* cp_size = 4"),
                                         ([3, 6, 12], 1, "cu_seqlens\\[0\\] == 0")])
@pytest.mark.parametrize("entry", ["rope", "rope_bwd", "qkv"])
def test_numpy_backend_always_checks_cu_seqlens(cu, cp, words, entry):
    cu = np.array(cu, np.int64)
    out = np.full(T.shape, 5.0, np.float32)
    with pytest.raises(ValueError, match=f"`cu_seqlens`: expected .*{words}"):
        if entry == "qkv":
            cupy_rope.apply_qkv_rope(np.zeros((14, 1, 96), np.float32), F, F, num_q_heads=1, layout="thd",
                                     cu_seqlens=cu, cp_size=cp)
        else:
            fn = cupy_rope.apply_rope if entry == "rope" else cupy_rope.apply_rope_backward
            fn(T, F, "thd", cu_seqlens=cu, cp_size=cp, out=out)
    assert (out == 5.0).all()


def test_host_build_key_covers_the_shim_and_flags(tmp_path):
    """A stale host library cannot be reused: the key changes with host_shim.h, the flags and the
    CUDA headers."""
    import os
    import shutil

    from cupy_rope import _cxx, _kernels

    def key(parts, include_dirs, shim):
        return _cxx.build_key(parts, _hostkernels._header_files(include_dirs, [shim]))

    inc = _hostkernels.cuda_include_dirs()
    shim = _kernels.source_dir() / "host_shim.h"
    k1 = key(("src", "-O1"), inc, shim)
    assert key(("src", "-O2"), inc, shim) != k1
    d = tmp_path / "kernels_cu"
    shutil.copytree(_kernels.source_dir(), d)
    (d / "host_shim.h").write_text((d / "host_shim.h").read_text().replace("std::sin(a)", "0.0f"))
    assert key(("src", "-O1"), inc, d / "host_shim.h") != k1
    hdr = tmp_path / "inc"
    (hdr / "crt").mkdir(parents=True)
    for name in ("cuda_fp16.h", "cuda_bf16.h", "crt/host_defines.h", "cuda_fp16.hpp", "cuda_bf16.hpp"):
        shutil.copy(os.path.join(inc[0], name), hdr / name)
    assert key(("src", "-O1"), [str(hdr)], shim) == k1  # same headers, same key
    (hdr / "cuda_bf16.h").write_text("// another toolkit\n")
    assert key(("src", "-O1"), [str(hdr)], shim) != k1


def test_out_overlapping_a_reversed_input_is_refused():
    """The overlap check measures negative strides correctly: an ``out`` over the lower half of a
    reversed input's memory is refused (a wrong extent would let the launch race with its input)."""
    base = np.zeros(2 * X.size, np.float32)
    x = base[X.size:].reshape(X.shape)[::-1]
    x[...] = X
    out = base[X.size // 2: X.size // 2 + X.size].reshape(X.shape)
    with pytest.raises(ValueError, match="`out`: expected memory that does not overlap `x`"):
        cupy_rope.apply_rope(x, F, out=out)
    np.testing.assert_array_equal(x, X)


def test_out_with_a_zero_stride_on_a_size_one_dimension_is_written():
    """A zero stride is refused in ``out`` only where elements would overlap: on a dimension of
    size one (any stride is valid there) the output is written and right."""
    x = X[:, :1]  # [8, 1, 2, 32]
    out = np.lib.stride_tricks.as_strided(np.full((8, 2, 32), np.nan, np.float32), x.shape, (256, 0, 128, 4))
    y = cupy_rope.apply_rope(x, F, out=out)
    assert y is out
    assert_close_to_ref(out, rope_ref(x, F), x, 32, "float32", "zero stride on a size-1 dimension")


def test_vector_width_needs_aligned_addresses():
    """A 16-byte vector needs a 16-byte aligned address: 4-byte alignment gives 2 bf16 (4 bytes)."""
    from cupy_rope import _worksplit

    assert _worksplit.pick_vec("bfloat16", [128], 128, [(4096, (0,), 1)]) == 8
    assert _worksplit.pick_vec("bfloat16", [128], 128, [(4096 + 4, (0,), 1)]) == 2
    assert _worksplit.pick_vec("bfloat16", [128], 128, [(4096 + 8, (0,), 1)]) == 4
    assert _worksplit.pick_vec("float32", [128], 128, [(4096 + 8, (0,), 1)]) == 2
    assert _worksplit.pick_vec("float32", [128], 128, [(4096, (6,), 1)]) == 2  # a row stride of 6


@pytest.mark.parametrize("max_bytes, want", [(0, (8, 4)), (16, (8, 4)), (8, (4, 2)), (4, (2, 1)), (2, (1, 1))])
def test_vector_width_honours_the_widest_vector_setting(max_bytes, want, monkeypatch):
    """``_MAX_VEC_BYTES`` (0: 16 bytes; the benchmark harness's tuning) caps the vector width in
    bytes: (bf16, float32) elements for an aligned, contiguous array."""
    from cupy_rope import _worksplit

    monkeypatch.setattr(_worksplit, "_MAX_VEC_BYTES", max_bytes)
    assert tuple(_worksplit.pick_vec(dt, [128], 128, [(4096, (0,), 1)]) for dt in ("bfloat16", "float32")) == want


def test_out_overlap_boundaries():
    """`out` right after (or before) the input in one buffer is accepted; one shared element is not."""
    buf = np.random.default_rng(0).uniform(-1, 1, 2 * X.size).astype(np.float32)
    x, after = buf[: X.size].reshape(X.shape), buf[X.size:].reshape(X.shape)
    ref = cupy_rope.apply_rope(x.copy(), F)
    np.testing.assert_array_equal(cupy_rope.apply_rope(x, F, out=after), ref)
    buf[: X.size] = buf[X.size:]
    np.testing.assert_array_equal(cupy_rope.apply_rope(after, F, out=x), cupy_rope.apply_rope(after.copy(), F))
    big = np.zeros(2 * X.size, np.float32)
    shared = big[X.size - 1: 2 * X.size - 1].reshape(X.shape)  # shares x's last element
    xi = big[: X.size].reshape(X.shape)
    for a, b in ((xi, shared), (shared, xi)):
        with pytest.raises(ValueError, match="`out`"):
            cupy_rope.apply_rope(a, F, out=b)


def test_host_runs_fault_past_an_arrays_end():
    """The host runs' guarded memory (hostkernels.fenced), which turns a kernel's read past the end
    of an array into a stopped process: the copies keep values, strides and 16-byte alignment,
    written arrays come back, reading an array's last element is fine, and 16 bytes past its end
    (any gap before the guard page is under 16 bytes) stops the process."""
    import signal
    import subprocess
    import sys

    code = """if True:
        import ctypes
        import numpy as np
        from cupy_rope._dev.hostkernels import fenced
        bounds = np.lib.array_utils.byte_bounds
        base = np.arange(40, dtype=np.float32).reshape(5, 8)
        x = base[:, 1:7]
        y = np.zeros((5, 6), np.float32)
        with fenced((x, y, None, x[1:]), writes=(1,)) as (fx, fy, none, fx1):
            assert none is None and fx.strides == x.strides and (fx == x).all()
            assert fx.ctypes.data % 16 == x.ctypes.data % 16 and fx1.ctypes.data == fx.ctypes.data + 32
            fy[...] = fx * 2
            ctypes.string_at(bounds(fx)[1] - 4, 4)
            assert (y == 0).all()
        assert (y == x * 2).all()
        print("ok", flush=True)
        with fenced((x,)) as (fx,):
            ctypes.string_at(bounds(fx)[1] + 16, 4)
        print("not stopped", flush=True)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.split() == ["ok"], (r.stdout, r.stderr)
    assert r.returncode in (-signal.SIGSEGV, -signal.SIGBUS), (r.returncode, r.stderr[-2000:])

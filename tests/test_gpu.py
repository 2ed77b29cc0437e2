"""GPU suite (H200): the spec matrix through CuPy and torch inputs, forward and backward,
outputs poisoned before each launch, plus >2^31 elements, streams and CUDA graphs."""

import numpy as np
import pytest

import cupy_rope
from cases import inputs, matrix, use_lean
from reference import assert_close_to_ref, qkv_split_ref, rope_ref, term_scale

pytestmark = pytest.mark.gpu
CASES = matrix()


def _cupy():
    import cupy

    return cupy


def to_dev(a, fw):
    """A device array with the logical values of NumPy ``a`` and exactly its stride pattern (stride
    0, permutations, padded rows, storage offsets and 16-byte misalignment included), built over a
    poisoned device buffer as the fuzz test does."""
    if a is None:
        return None
    from fuzz import Laid, backend_buffer, to_backend

    isz = a.itemsize
    st = tuple(s // isz for s in a.strides)
    assert min(st, default=0) >= 0, "negative strides: use the fuzz test"
    front = (a.ctypes.data % 16) // isz  # keep the alignment relative to 16 bytes
    span = 1 + sum((n - 1) * s for n, s in zip(a.shape, st)) if a.size else 1
    poison = np.iinfo(a.dtype).max if np.issubdtype(a.dtype, np.integer) else np.nan
    base = np.full(front + span, poison, a.dtype)
    laid = Laid(base, front, a.shape, st, "test")
    if a.size:
        laid.view()[...] = a
    backend = "cupy" if fw == "cupy" else "torch-cuda"
    d = to_backend(laid, backend_buffer(base, backend), backend)
    assert tuple(d.strides if fw == "cupy" else d.stride()) == (a.strides if fw == "cupy" else st)
    return d


def to_host(a, fw):
    if fw == "cupy":
        return _cupy().asnumpy(a)
    import torch

    a = a.detach().cpu()
    if a.dtype == torch.bfloat16:
        import ml_dtypes

        return a.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return a.contiguous().numpy()


def poison(shape, dtype, fw):
    """Fill then free a block of the output's size, so the allocator hands back NaN memory."""
    if fw == "cupy":
        cp = _cupy()
        t = cp.empty(shape, dtype)
        t.view(np.uint8).fill(0xFF)
        del t
    else:
        import torch

        t = torch.empty(shape, dtype={"float32": torch.float32, "float16": torch.float16,
                                      "bfloat16": torch.bfloat16}[np.dtype(dtype).name], device="cuda")
        t.view(torch.uint8).fill_(0xFF)
        del t


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_gpu_matrix(case, backward, fw):
    x, freqs, kw = inputs(case)
    dkw = {k: (to_dev(v, fw) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    fn = cupy_rope.apply_rope_backward if backward else cupy_rope.apply_rope
    xd, fd = to_dev(x, fw), to_dev(freqs, fw)
    poison(x.shape, x.dtype, fw)
    y = fn(xd, fd, **dkw)
    assert type(y) is type(xd)
    ref = rope_ref(x, freqs, backward=backward, **kw)
    assert_close_to_ref(to_host(y, fw), ref, x, freqs.shape[-1], case.dtype, case.id())
    # explicit poisoned output with a transposed stride pattern
    if case.layout != "thd":
        out = to_dev(np.full(x.shape, np.nan, x.dtype).transpose(1, 0, 2, 3).copy().transpose(1, 0, 2, 3), fw)
        r = fn(xd, fd, out=out, **dkw)
        assert r is out
        assert_close_to_ref(to_host(out, fw), ref, x, freqs.shape[-1], case.dtype, case.id() + " out=")


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_gpu_one_row_and_streaming_kernels_agree(case, backward, monkeypatch):
    """The matrix's (small) calls run the one-row kernel; with it turned off, the streaming kernel
    with one row per thread (the mixed one, ``ropem``, for rows with a tail and 16-byte vectors,
    and with that turned off too, ``rope``); then the lean kernel, ``ropel``, where it can run
    (its head and sequence limits lifted; else ``rope``). Each against the reference. They are the same
    arithmetic, but the compiler may contract a product and a sum into one FMA differently in the
    kernels: on the H200 some float32/float16 forward cases differ in the last bit (the host
    build, without FMA, gives the same bits: test_cpu_matrix), bfloat16 decode gives the same bits
    (decode_probe)."""
    from cupy_rope import _launch, _worksplit

    x, freqs, kw = inputs(case)
    dkw = {k: (to_dev(v, "cupy") if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    fn = cupy_rope.apply_rope_backward if backward else cupy_rope.apply_rope
    ref = rope_ref(x, freqs, backward=backward, **kw)
    names, orig = [], _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda spec, *a, **k: names.append(spec.name) or orig(spec, *a, **k))
    runs = ((True, True, False), (False, True, False), (False, False, False), (False, False, True))
    for one_row, mixed, lean in runs:
        monkeypatch.setattr(_worksplit, "_ONE_ROW", one_row)
        monkeypatch.setattr(_worksplit, "_MIXED", mixed)
        use_lean(monkeypatch, lean)
        monkeypatch.setattr(_launch, "_CACHE", {})
        y = to_host(fn(to_dev(x, "cupy"), to_dev(freqs, "cupy"), **dkw), "cupy")
        assert_close_to_ref(y, ref, x, freqs.shape[-1], case.dtype, f"{case.id()} {names[-1]}")
    kinds = [n.split("_")[0] for n in names]
    assert kinds[:3] in (["rope1", "rope", "rope"], ["rope1", "ropem", "rope"]) and kinds[3] in ("rope", "ropel"), names


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_odd_units_split(dtype, backward, monkeypatch):
    """Head size 80 (5 units of 16-byte vectors; float32 10) in a launch that the odd-unit rule
    splits into more chunks than the fewest (64 threads per SM asked of the device): the launch
    runs the rule's split (chunks of unequal row counts), results against the reference."""
    import struct

    from cupy_rope import _abi, _launch, _worksplit
    from cases import NP_DTYPES

    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 64)
    use_lean(monkeypatch, False)  # the streaming kernel's split
    monkeypatch.setattr(_launch, "_CACHE", {})
    specs, orig = [], _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda spec, *a, **k: specs.append(spec) or orig(spec, *a, **k))
    rng = np.random.default_rng(12)
    x = rng.uniform(-2, 2, (256, 2, 30, 80)).astype(NP_DTYPES[dtype])
    f = cupy_rope.rope_freqs(80, 256)
    fn = cupy_rope.apply_rope_backward if backward else cupy_rope.apply_rope
    y = to_host(fn(to_dev(x, "cupy"), to_dev(f, "cupy"), "sbhd"), "cupy")
    assert_close_to_ref(y, rope_ref(x, f, backward=backward), x, 80, dtype, f"odd units {dtype}")
    vec = 8 if dtype == "bfloat16" else 4
    sm = _launch.sm_count(0)
    want = _worksplit.split_work(512, 1, 30, 80, 80, vec, sm, odd_units=True)[3]
    if want == _worksplit.split_work(512, 1, 30, 80, 80, vec, sm)[3]:
        pytest.skip(f"the odd-unit rule does not change this split on {sm} SMs")
    vals = dict(zip(_abi.ROPE_FIELDS, struct.unpack(f"<{len(_abi.ROPE_FIELDS)}q",
                                                      specs[-1].params[:8 * len(_abi.ROPE_FIELDS)])))
    assert (specs[-1].name.split("_")[0], vals["n_units"], vals["n_chunks"]) == ("rope", 80 // 2 // vec, want)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["nh", "il"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpu_one_row_shared_sincos(dtype, interleaved, backward, monkeypatch):
    """A decode step (64 sequences, 32 q and 8 k heads, head size 128) with an angle table in
    one-row launches whose threads share each token's sincosf (``RopeParams.share``), at every
    vector width, with rows of two angles per pair and positions past the table: the result
    equals the unshared launch's bit for bit and the reference (the host-build test checks the
    same on the CPU; here the device's barrier and shared memory)."""
    import struct

    from cupy_rope import _abi, _kernels, _launch, _worksplit
    from cases import NP_DTYPES

    cp = _cupy()
    rng = np.random.default_rng(22)
    monkeypatch.setattr(_worksplit, "_THREADS_PER_SM", 10**9)  # one row per thread at every width
    monkeypatch.setattr(_worksplit, "_NARROW_THREADS_PER_SM", 10**9)
    monkeypatch.setattr(_worksplit, "_NARROW_SHARED_THREADS_PER_SM", 10**9)
    specs, orig = [], _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda spec, *a, **k: specs.append(spec) or orig(spec, *a, **k))
    rows = 300
    sp = rng.integers(0, rows + 20, 64).astype(np.int32)
    sp[:2] = (3, 5)
    f = cupy_rope.rope_freqs(128, rows)
    f[3] += rng.uniform(-1, 1, f[3].shape).astype(np.float32)  # two angles in every pair
    f[5, ..., 17] += 0.25  # in one pair
    fn = cupy_rope.apply_rope_qk_backward if backward else cupy_rope.apply_rope_qk
    for v in _kernels.vector_widths(dtype):
        monkeypatch.setattr(_worksplit, "_ONE_ROW_ANGLE_VEC", v)
        q = rng.uniform(-2, 2, (64, 1, 32, 128)).astype(NP_DTYPES[dtype])
        k = rng.uniform(-2, 2, (64, 1, 8, 128)).astype(NP_DTYPES[dtype])
        got = {}
        for share in (True, False):
            monkeypatch.setattr(_worksplit, "_SHARE_SINCOS", share)
            monkeypatch.setattr(_launch, "_CACHE", {})
            qd, kd = to_dev(q, "cupy"), to_dev(k, "cupy")
            got[share] = [to_host(a, "cupy") for a in fn(qd, kd, to_dev(f, "cupy"), "bshd", interleaved=interleaved,
                                                        start_positions=cp.asarray(sp))]
            spec = specs[-1]
            assert spec.name == _kernels.kernel_name("rope1", dtype, v, interleaved, backward), spec.name
            n, at = len(_abi.ROPE_FIELDS), _abi.ROPE_FIELDS.index("share")
            assert [struct.unpack_from("<q", spec.params, 8 * (i * n + at))[0] for i in (0, 1)] == [share] * 2
        for x, a, b in zip((q, k), got[True], got[False]):
            np.testing.assert_array_equal(a.astype(np.float32), b.astype(np.float32), err_msg=f"v{v}")
            ref = rope_ref(x, f, "bshd", interleaved, start_positions=sp, backward=backward)
            assert_close_to_ref(a, ref, x, 128, dtype, f"shared sincos v{v}")


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_gpu_qkv(fw):
    from test_cpu_qkv import GRID, qkv_case

    for i, (layout, g, n, d) in enumerate(GRID):
        dtype, qkv, qf, kf, kw = qkv_case(i, layout, g, n, d)
        dkw = {k: (to_dev(v, fw) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
        qd, qfd = to_dev(qkv, fw), to_dev(qf, fw)
        kfd = qfd if kf is qf else to_dev(kf, fw)
        poison(qkv.shape, qkv.dtype, fw)
        q, k, v = cupy_rope.apply_qkv_rope(qd, qfd, kfd, (n * d, d, d), **dkw)
        xq, xk, xv = qkv_split_ref(qkv, n, d)
        assert_close_to_ref(to_host(q, fw), rope_ref(xq, qf, **kw), xq, qf.shape[-1], dtype, f"q {i}")
        assert_close_to_ref(to_host(k, fw), rope_ref(xk, kf, **kw), xk, qf.shape[-1], dtype, f"k {i}")
        np.testing.assert_array_equal(to_host(v, fw).astype(np.float64), xv.astype(np.float64))
        lead = qkv.shape[:-2]
        rng = np.random.default_rng(i)
        from cases import strided

        modes = ("contiguous", "zero_stride", "channel_stride", "permuted", "offset")
        dq, dk, dv = (strided(lead + (h, d), dtype, rng, modes[int(rng.integers(0, 5))]) for h in (g * n, g, g))
        want = np.concatenate([rope_ref(dq, qf, backward=True, **kw).reshape(lead + (g, n * d)),
                               rope_ref(dk, kf, backward=True, **kw), dv.astype(np.float64)], -1)
        scale = np.concatenate([term_scale(dq, qf.shape[-1]).reshape(lead + (g, n * d)),
                                term_scale(dk, qf.shape[-1]), np.abs(dv.astype(np.float64))], -1)
        poison(qkv.shape, qkv.dtype, fw)
        got = cupy_rope.apply_qkv_rope_backward(to_dev(dq, fw), to_dev(dk, fw), to_dev(dv, fw), qfd, kfd,
                                                (n * d, d, d), **dkw)
        assert_close_to_ref(to_host(got, fw), want, None, 0, dtype, f"dqkv {i}", scale=scale)


def test_gpu_over_2_31_elements():
    import torch

    s, b, h, d = 8193, 4, 512, 128  # 2,147,745,792 elements > 2^31
    assert s * b * h * d > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.empty((s, b, h, d), dtype=torch.bfloat16, device="cuda")
    x.uniform_(-1, 1, generator=g)
    f = cupy_rope.rope_freqs(d, s, like=x)
    y = cupy_rope.apply_rope(x, f)
    torch.cuda.synchronize()
    for sl in (slice(0, 2), slice(s - 2, s)):
        xs = to_host(x[sl], "torch")
        want = rope_ref(xs, to_host(f[sl], "torch"))
        assert_close_to_ref(to_host(y[sl], "torch"), want, xs, d, "bfloat16", f"rows {sl}")
    del y
    gx = cupy_rope.apply_rope_backward(x[:, :, :1].expand(s, b, h, d), f)  # stride-0 heads, big
    xs = to_host(x[s - 1:, :, :1].expand(1, b, h, d), "torch")
    assert_close_to_ref(to_host(gx[s - 1:], "torch"), rope_ref(xs, to_host(f[s - 1:], "torch"), backward=True),
                        xs, d, "bfloat16", "bwd last row")


def test_gpu_torch_stream_and_graph():
    import torch

    x = torch.randn(64, 2, 8, 64, device="cuda", dtype=torch.float16)
    f = cupy_rope.rope_freqs(64, 64, like=x)
    ref = cupy_rope.apply_rope(x, f)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        x2 = x * 1.0
        y = cupy_rope.apply_rope(x2, f)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    # CUDA graph capture and replay with new data
    static_x = x.clone()
    cupy_rope.apply_rope(static_x, f)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = cupy_rope.apply_rope(static_x, f)
    for _ in range(3):
        new = torch.randn_like(x)
        static_x.copy_(new)
        graph.replay()
        torch.testing.assert_close(static_y, cupy_rope.apply_rope(new, f), rtol=0, atol=0)


def _chain(x, f, cache, pos, steps):
    """Each step reads the previous one's output: rope (the kernel for x's shape), a torch kernel,
    the positions API with a cos/sin cache (one-row kernels at small shapes; its inverse half the
    time), every fourth step the packed-QKV kernel."""
    import torch

    y = x
    for i in range(steps):
        y = cupy_rope.apply_rope(y, f, "bshd")
        y = y * 1.5 if i % 3 == 0 else y
        y = cupy_rope.apply_rope_pos(pos, y, None, cos_sin_cache=cache, inverse=bool(i % 2))[0]
        y = torch.flip(y, dims=(2,)) if i % 4 == 1 else y
        if i % 4 == 3:  # the packed-QKV kernel on the previous output (4 groups of 2 q, 1 k, 1 v head)
            g = y.shape[2] // 4
            q, k, v = cupy_rope.apply_qkv_rope(y.reshape(*y.shape[:2], g, 4 * y.shape[3]), f, f, layout="bshd",
                                               num_q_heads=2 * g)
            y = torch.cat([q, k, v], dim=2)
    return y


@pytest.mark.parametrize("shape", [(64, 1, 32, 128), (4, 512, 16, 64)], ids=["decode", "prefill"])
def test_gpu_programmatic_launches_wait_for_the_previous_kernel(shape):
    """On sm_90 and later every launch is a programmatic dependent launch (it may start while the
    previous kernel finishes; the kernel waits for it before reading): chains where each call
    reads the previous call's output, with torch kernels in between, give the sequential
    results, eagerly and replayed from a CUDA graph with new inputs."""
    import torch

    from cupy_rope import _launch

    import os

    want = torch.cuda.get_device_capability()[0] >= 9 and os.environ.get("CUPY_ROPE_PDL", "1").strip() != "0"
    assert (_launch.pdl_launcher(torch.cuda.current_device()) is not None) == want
    b, s, h, d = shape
    x = torch.randn(shape, device="cuda", dtype=torch.float32)
    f = cupy_rope.rope_freqs(d, s, like=x)
    cache = cupy_rope.rope_cos_sin_cache(d, 4096, like=x)
    pos = torch.randint(0, 4096, (b, s), device="cuda")
    steps = 12

    def ref(x):
        return _chain(x.cpu(), f.cpu(), cache.cpu(), pos.cpu(), steps)

    torch.testing.assert_close(_chain(x, f, cache, pos, steps).cpu(), ref(x), rtol=1e-4, atol=1e-4)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = _chain(static_x, f, cache, pos, steps)
    for _ in range(2):
        new = torch.randn_like(x)
        static_x.copy_(new)
        graph.replay()
        torch.testing.assert_close(static_y.cpu(), ref(new), rtol=1e-4, atol=1e-4)


def test_gpu_cupy_stream():
    cp = _cupy()
    x = cp.random.standard_normal((32, 2, 4, 64), dtype=cp.float32)
    f = cp.asarray(cupy_rope.rope_freqs(64, 32))
    ref = cupy_rope.apply_rope(x, f)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        y = cupy_rope.apply_rope(x, f)
    s.synchronize()
    assert cp.array_equal(y, ref)


def test_gpu_device_mismatch_error():
    import torch

    x = torch.randn(4, 1, 2, 64, device="cuda")
    with pytest.raises(ValueError, match="freqs.*same device"):
        cupy_rope.apply_rope(x, torch.from_numpy(cupy_rope.rope_freqs(64, 4)))


@pytest.mark.parametrize("fw", ["cupy", "torch"])
def test_gpu_launch_cache_reuses_plan_with_new_addresses(fw):
    """Second and later calls with the same geometry take the cached launch: results stay exact."""
    rng = np.random.default_rng(11)
    f = rng.uniform(-4, 4, (40, 1, 1, 64)).astype(np.float32)
    sp = np.array([1, 5, 2], np.int32)
    fd, spd = to_dev(f, fw), to_dev(sp, fw)
    for trial in range(3):
        x = rng.uniform(-1, 1, (3, 16, 4, 64)).astype(np.float32)
        xd = to_dev(x, fw)
        poison(x.shape, x.dtype, fw)
        for tom, layout in ((False, "bshd"),):
            y = cupy_rope.apply_rope(xd, fd, layout, start_positions=spd, interleaved=True)
            assert_close_to_ref(to_host(y, fw), rope_ref(x, f, layout, interleaved=True, start_positions=sp),
                                x, 64, "float32", f"trial {trial}")
        xs = rng.uniform(-1, 1, (16, 3, 4, 64)).astype(np.float32)
        xsd = to_dev(xs, fw)
        y = cupy_rope.apply_rope_backward(xsd, fd, "sbhd", transpose_output_memory=True)
        assert_close_to_ref(to_host(y, fw), rope_ref(xs, f, backward=True), xs, 64, "float32", f"tom {trial}")
    assert len(cupy_rope._launch._CACHE) > 0


@pytest.mark.parametrize("fw", ["cupy", "torch"])
@pytest.mark.parametrize("layout", ["sbhd", "thd"])
def test_gpu_qkv_launch_cache(fw, layout):
    rng = np.random.default_rng(12)
    n, g, d = 4, 2, 64
    f = rng.uniform(-4, 4, (32, 1, 1, 64)).astype(np.float32)
    kw = {"layout": layout}
    lead = (8, 2) if layout == "sbhd" else (13,)
    if layout == "thd":
        kw["cu_seqlens"] = np.array([0, 5, 11], np.int32)
    dkw = {k: (to_dev(v, fw) if isinstance(v, np.ndarray) else v) for k, v in kw.items()}
    fd = to_dev(f, fw)
    for trial in range(3):
        qkv = rng.uniform(-1, 1, lead + (g, (n + 2) * d)).astype(np.float32)
        poison(lead + (g * n, d), np.float32, fw)
        q, k, v = cupy_rope.apply_qkv_rope(to_dev(qkv, fw), fd, fd, num_q_heads=g * n, **dkw)
        xq, xk, xv = qkv_split_ref(qkv, n, d)
        assert_close_to_ref(to_host(q, fw), rope_ref(xq, f, **kw), xq, 64, "float32", f"q {trial}")
        assert_close_to_ref(to_host(k, fw), rope_ref(xk, f, **kw), xk, 64, "float32", f"k {trial}")
        np.testing.assert_array_equal(to_host(v, fw), xv)
        dq = rng.uniform(-1, 1, lead + (g * n, d)).astype(np.float32)
        dk = rng.uniform(-1, 1, lead + (g, d)).astype(np.float32)
        got = cupy_rope.apply_qkv_rope_backward(to_dev(dq, fw), to_dev(dk, fw), to_dev(xv, fw), fd, fd, **dkw)
        want = np.concatenate([rope_ref(dq, f, backward=True, **kw).reshape(lead + (g, n * d)),
                               rope_ref(dk, f, backward=True, **kw), xv.astype(np.float64)], -1)
        assert_close_to_ref(to_host(got, fw), want, None, 0, "float32", f"dqkv {trial}",
                            scale=np.abs(want) + 4)

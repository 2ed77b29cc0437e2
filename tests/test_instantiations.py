"""Every kernel instantiation the library can launch runs on the CPU (host build of the real
source, through the real launch plan) against the float64 reference: for each (kind, dtype,
vector width, interleaved, direction) a call that the planner maps to exactly that kernel, with
a tail of channels, poisoned strided output (rope) and a general table (pairs of two angles)."""

import zlib

import numpy as np
import pytest

import cupy_rope
from cupy_rope import _abi, _kernels, _plan, _worksplit
from cupy_rope._dev import hostkernels as _hostkernels
from cupy_rope._interop import info
from cases import use_lean
from cupy_rope.testing import NP_DTYPES, assert_close_to_ref, qkv_split_ref, rope_pos_ref, rope_ref

LAUNCHED = set()


@pytest.fixture(autouse=True)
def _record(monkeypatch):
    orig = _hostkernels.launch

    def launch(name, *a):
        LAUNCHED.add(name)
        return orig(name, *a)

    monkeypatch.setattr(_hostkernels, "launch", launch)


def _parse(name):
    kind, short, v, il, bw = name.split("_")
    dtype = {s: d for d, s in _kernels.SHORT.items()}[short]
    return kind, dtype, int(v[1:]), il == "i", bw == "b"


def _aligned(shape, dtype, rng):
    """Random values in a 16-byte aligned contiguous buffer."""
    a = rng.uniform(-2, 2, shape).astype(NP_DTYPES[dtype])
    buf = np.empty(a.nbytes + 16, np.uint8)
    off = -buf.ctypes.data % 16
    out = buf[off: off + a.nbytes].view(a.dtype).reshape(shape)
    out[...] = a
    return out


def _run(name, tail, fw, monkeypatch):
    """One call that the planner maps to kernel ``name``: on the CPU through the host build and the
    plan (``fw = "host"``), on the GPU through the public API with CuPy arrays (``"cupy"``). The
    call is small (one row per thread): the streaming kernels (``rope``, ``ropem``) are forced by
    turning the one-row kernels (``rope1``, ``rope1c``) off, ``rope`` rather than ``ropem`` (whose
    rows these are: they have a tail) by turning the mixed kernels off, and the launch cache is
    emptied so that the call is planned; ``rope1`` at width ``v`` by raising its width cap to it.
    ``rope1c`` and ``rope2c`` (cos/sin caches, one and two rows per thread) run through the
    positions API: with a float32 cache for ``tail`` 2, a cache in the tensors' dtype for ``tail``
    1; ``rope2c`` with the one-row kernels off and the two-row kernel on, 5 heads (threads of two
    rows and of one). ``ropel`` (the lean kernel: full rotary rows only) has no tail: 13 heads
    (threads of four rows and of three), a general table (pairs of two angles) for ``tail`` 2, a
    standard one (equal angles) for ``tail`` 1, and its head limit lowered."""
    from cupy_rope import _launch

    kind, dtype, v, il, bw = _parse(name)
    monkeypatch.setattr(_worksplit, "_ONE_ROW", kind in ("rope1", "rope1c"))
    monkeypatch.setattr(_worksplit, "_ONE_ROW_ANGLE_VEC", v)  # rope1 at every width it has
    monkeypatch.setattr(_worksplit, "_MIXED", kind == "ropem")
    monkeypatch.setattr(_worksplit, "_TWO_ROWS", kind == "rope2c")
    use_lean(monkeypatch, kind == "ropel")
    monkeypatch.setattr(_launch, "_CACHE", {})
    rng = np.random.default_rng(zlib.crc32(name.encode()) + tail)
    # rotary half-width h2 = v * odd: the widest valid vector is exactly v; a tail of channels
    # copied in units of two vectors (2v) or one (v: the one-vector tail unit)
    h2 = v * 3
    d2, d = 2 * h2, 2 * h2 + (0 if kind == "ropel" else tail) * v
    f = rng.uniform(-40, 40, (10, d2)).astype(np.float32)
    if kind == "ropel" and tail == 1:
        f = np.concatenate([f[:, :h2]] * 2, 1) if not il else np.repeat(f[:, :h2], 2, 1)
    sp = np.array([2, 0, 1], np.int32)
    kf = rng.uniform(-40, 40, (12, 1, 1, d2)).astype(np.float32)
    kw = dict(start_positions=sp, cp_size=2, cp_rank=1)
    if fw == "cupy":
        from test_gpu import to_dev, to_host

        dev = lambda a: to_dev(a, "cupy")  # noqa: E731
        host = lambda a: to_host(a, "cupy")  # noqa: E731
        dkw = dict(kw, start_positions=dev(sp))
    lead = (4, 3)
    if kind in ("rope1c", "rope2c"):
        x = _aligned((6, 5, d), dtype, rng)
        pos = np.array([3, 0, 9, -1, 7, 10], np.int64)  # -1 and 10: outside the cache, copied
        ang = rng.uniform(-40, 40, (10, h2))
        cache = np.concatenate([np.cos(ang), np.sin(ang)], 1).astype(np.float32 if tail == 2 else NP_DTYPES[dtype])
        if fw == "host":
            tables = {n: None for n in _plan.TABLE_ARGS}
            tables["cos_sin_cache"] = info(cache)
            plans, _, _ = _plan.resolve_rope_pos(info(pos), info(x), None, tables, None, il, 0, bw, False)
            names = []
            orig = _hostkernels.launch
            monkeypatch.setattr(_hostkernels, "launch", lambda n, *a: names.append(n) or orig(n, *a))
            (y,) = _hostkernels.run_rope_pos(plans, [x], cache, pos, (np.full(x.shape, np.nan, x.dtype),))
            assert names == [name], (names, name)
        else:
            y = host(cupy_rope.apply_rope_pos(dev(pos), dev(x), None, cos_sin_cache=dev(cache), interleaved=il,
                                              inverse=bw)[0])
        ref = rope_pos_ref(x, pos, "cos_sin", cache, 10, il, 0, bw)
        assert_close_to_ref(y, ref, x, d2, dtype, name)
        return
    if kind in ("rope", "ropem", "rope1", "ropel"):
        h = 13 if kind == "ropel" else 5
        x = _aligned(lead + (h, d), dtype, rng)
        out = _aligned((h,) + lead + (d,), dtype, rng)
        out[...] = np.nan  # strided output, poisoned
        out = out.transpose(1, 2, 0, 3)
        if fw == "host":
            plan = _plan.resolve_rope(info(x), info(f), "sbhd", il, None, info(sp), 2, 1, None, bw)
            assert plan.launch(info(x), info(out), info(f), None, info(sp), 4).name == name
            y = _hostkernels.run_rope(plan, x, f, None, sp, out=out)
        else:
            fn = cupy_rope.apply_rope_backward if bw else cupy_rope.apply_rope
            od = dev(out)
            assert fn(dev(x), dev(f), "sbhd", interleaved=il, out=od, **dkw) is od
            y = host(od)
        ref = rope_ref(x, f, "sbhd", il, backward=bw, **kw)
        assert_close_to_ref(y, ref, x, d2, dtype, name)
        return
    g, n = 2, 3
    if not bw:
        qkv = _aligned(lead + (g, (n + 2) * d), dtype, rng)
        if fw == "host":
            plan = _plan.resolve_qkv(info(qkv), info(f), info(kf), None, "sbhd", g * n, il, None, info(sp), 2, 1)
            q, k, vv = _hostkernels.run_qkv(plan, (qkv,), f, kf, None, sp)
        else:
            q, k, vv = (host(t) for t in cupy_rope.apply_qkv_rope(dev(qkv), dev(f), dev(kf), num_q_heads=g * n,
                                                                  interleaved=il, **dkw))
        xq, xk, xv = qkv_split_ref(qkv, n, d)
        assert_close_to_ref(q, rope_ref(xq, f, "sbhd", il, **kw), xq, d2, dtype, name + " q")
        assert_close_to_ref(k, rope_ref(xk, kf, "sbhd", il, **kw), xk, d2, dtype, name + " k")
        np.testing.assert_array_equal(vv, xv)
    else:
        dq, dk, dv = (_aligned(lead + (h, d), dtype, rng) for h in (g * n, g, g))
        if fw == "host":
            plan = _plan.resolve_qkv_backward(info(dq), info(dk), info(dv), info(f), info(kf), None, "sbhd", None,
                                              il, None, info(sp), 2, 1)
            got = _hostkernels.run_qkv(plan, (dq, dk, dv), f, kf, None, sp)
        else:
            got = host(cupy_rope.apply_qkv_rope_backward(dev(dq), dev(dk), dev(dv), dev(f), dev(kf),
                                                         interleaved=il, **dkw))
        gq, gk, gv = qkv_split_ref(got, n, d)
        assert_close_to_ref(gq, rope_ref(dq, f, "sbhd", il, backward=True, **kw), dq, d2, dtype, name + " dq")
        assert_close_to_ref(gk, rope_ref(dk, kf, "sbhd", il, backward=True, **kw), dk, d2, dtype, name + " dk")
        np.testing.assert_array_equal(gv, dv)


@pytest.mark.parametrize("tail", [2, 1], ids=["tail2v", "tail1v"])
@pytest.mark.parametrize("name", _kernels.all_kernels())
def test_instantiation_runs_and_is_right(name, tail, monkeypatch):
    _run(name, tail, "host", monkeypatch)
    assert name in LAUNCHED, (name, sorted(LAUNCHED))


def test_every_instantiation_was_launched():
    """Runs after the parametrised test above (file order): the CPU suite launched all of them."""
    missing = sorted(set(_kernels.all_kernels()) - LAUNCHED)
    assert not missing, f"never launched on the CPU: {missing}"


LAUNCHED_GPU = set()


@pytest.mark.gpu
@pytest.mark.parametrize("tail", [2, 1], ids=["tail2v", "tail1v"])
@pytest.mark.parametrize("name", _kernels.all_kernels())
def test_instantiation_on_gpu(name, tail, monkeypatch):
    """The same calls through the public API on CuPy arrays: the GPU launches this kernel."""
    from cupy_rope import _launch

    orig = _launch.launch

    def launch(spec, *a, **k):
        LAUNCHED_GPU.add(spec.name)
        return orig(spec, *a, **k)

    monkeypatch.setattr(_launch, "launch", launch)
    _run(name, tail, "cupy", monkeypatch)
    assert name in LAUNCHED_GPU, (name, sorted(LAUNCHED_GPU))


@pytest.mark.gpu
def test_every_instantiation_was_launched_on_gpu():
    missing = sorted(set(_kernels.all_kernels()) - LAUNCHED_GPU)
    assert not missing, f"never launched on the GPU: {missing}"


def test_parameter_blocks_come_from_the_cuda_structs(monkeypatch):
    """The launch ABI has one definition: the Python field order is read from the CUDA structs, and
    anything that is not a 64-bit field is refused."""
    assert _abi.ROPE_FIELDS[:3] == ("x", "y", "freqs") and _abi.ROPE_FIELDS[-1] == "pos.ps1"
    assert _abi.QKV_FIELDS[-16] == "k_same_table"
    assert _abi.ROPE_PTR_SLOTS["start_positions"] == _abi.ROPE_FIELDS.index("pos.start_positions")
    src = "struct Bad {\n  i64 a, b;  // fine\n  int c;\n};\n"
    monkeypatch.setattr(_kernels, "base_source", lambda: src)
    _kernels.struct_fields.cache_clear()
    try:
        with pytest.raises(ValueError, match="not a 64-bit i64"):
            _kernels.struct_fields("Bad")
    finally:
        _kernels.struct_fields.cache_clear()


def test_launch_alternatives():
    """A traced JAX call plans without the device's SM count and compiles every kernel the
    device's work split may pick: a rope launch's three kernels (five with 16-byte vectors: the
    mixed, the two-row and the lean kernel too; the one-row angle kernel at its own width), a QKV
    launch's one."""
    names = set(_kernels.all_kernels())
    for name in names:
        alts = _worksplit.launch_alternatives(name)
        assert name in alts and set(alts) <= names, (name, alts)
        kind, dtype, v, il, bw = _parse(name)
        assert _kernels.parse_name(name) == (kind, dtype, v, il, bw)
        sixteen = v * _kernels.CTYPES[dtype][1] == _kernels.MIXED_BYTES
        narrow = min(v, _worksplit._ONE_ROW_ANGLE_VEC)  # rope1 also at this width
        assert len(alts) == (1 if kind == "qkv" else 3 + 3 * sixteen + (narrow < v)), (name, alts)
        if kind != "qkv":
            assert _kernels.kernel_name("rope1", dtype, narrow, il, bw) in alts, (name, alts)
    for kind in _kernels.WIDE_KINDS:  # 3 dtypes x interleaved x direction
        assert sum(n.startswith(kind + "_") for n in names) == 12, kind
    with pytest.raises(ValueError, match="unknown kernel name"):
        _kernels.parse_name("rope_bf16_v3x_n_f")

"""The public API's launch cache on the CPU (its GPU use is covered by the GPU suite): keys carry
every descriptor and the options with their types, a hit allocates the outputs like the inputs and
hands the prepared launch every address in the launch's name order, an output whose alignment
differs from the cached plan's is a miss."""

import ctypes
import sys
import types

import numpy as np
import pytest

from cupy_rope import _api, _kernels, _launch

torch = pytest.importorskip("torch")


def test_optional_cpp_paths_follow_their_switch(monkeypatch):
    """An optional C++ path's switch: ``0`` never loads, ``auto`` skips silently where the path
    does not apply and warns (naming the path and the fallback) where loading fails, ``1``
    raises what loading raised; any other value is an error naming the variable."""
    import warnings

    from cupy_rope import _cupy_ext, _cxx

    def fails():
        raise RuntimeError("no compiler")

    for env, skip, load, want in (("0", "", lambda: 1 / 0, None), ("auto", "no GPU", lambda: 1 / 0, None),
                                  ("auto", "", lambda: "lib", "lib"), ("1", "no GPU", lambda: "lib", "lib")):
        monkeypatch.setenv("CUPY_ROPE_TEST_EXT", env)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _cxx.optional("CUPY_ROPE_TEST_EXT", load, "the test path", "falling back", skip=skip) == want
    monkeypatch.setenv("CUPY_ROPE_TEST_EXT", "auto")
    with pytest.warns(RuntimeWarning, match=r"the test path is unavailable \(RuntimeError: no compiler\); falling back"):
        assert _cxx.optional("CUPY_ROPE_TEST_EXT", fails, "the test path", "falling back") is None
    monkeypatch.setenv("CUPY_ROPE_TEST_EXT", "1")
    with pytest.raises(RuntimeError, match="no compiler"):
        _cxx.optional("CUPY_ROPE_TEST_EXT", fails, "the test path", "falling back")
    monkeypatch.setenv("CUPY_ROPE_TEST_EXT", "on")
    with pytest.raises(ValueError, match="CUPY_ROPE_TEST_EXT: expected auto, 0 or 1, got 'on'"):
        _cxx.optional("CUPY_ROPE_TEST_EXT", fails, "the test path", "falling back")
    # the CuPy path: off, tools missing (auto: the Python path; 1: an error saying what is missing)
    monkeypatch.setattr(_cupy_ext, "functions", lambda path: pytest.fail("loaded"))
    monkeypatch.setenv("CUPY_ROPE_CUPY_EXT", "0")
    assert _cupy_ext.load() is None
    monkeypatch.setattr(_cupy_ext, "missing_tools", lambda: "no Python.h")
    monkeypatch.setenv("CUPY_ROPE_CUPY_EXT", "auto")
    assert _cupy_ext.load() is None
    monkeypatch.setenv("CUPY_ROPE_CUPY_EXT", "1")
    with pytest.raises(RuntimeError, match="cannot build the CuPy launch path: no Python.h"):
        _cupy_ext.load()


def test_cupy_path_is_decided_on_the_first_cupy_lookup(monkeypatch):
    """The C++ CuPy path is loaded (or found unavailable) once, by the first lookup of a CuPy
    call; lookups of other kinds never load it."""
    from cupy_rope import _cupy_ext

    loads = []
    monkeypatch.setattr(_launch, "CUPY_EXT", False)
    monkeypatch.setattr(_cupy_ext, "load", lambda: loads.append(1))  # None: the Python path
    monkeypatch.setattr(_launch, "_CACHE", {})
    assert _launch.lookup("torch", ("rope",), (), (None,)) == ((("rope",), (), (), (None,)), None)
    assert loads == [] and _launch.CUPY_EXT is False
    for _ in range(3):
        assert _launch.lookup("cupy", ("rope",), (), (None,)) == ((("rope",), (), (), (None,)), None)
    assert loads == [1] and _launch.CUPY_EXT is None


class FakePrepared:
    device = 0

    def __init__(self):
        self.calls = []

    def __call__(self, stream, addresses):
        self.calls.append(list(addresses))


def _descs_cpu(arrays, descs, ptrs):
    """The torch descriptor of _launch, for CPU tensors (the real one serves CUDA tensors only)."""
    for a in arrays:
        if a is None:
            descs.append(None)
            ptrs.append(0)
            continue
        p = a.data_ptr()
        descs.append((a.shape, a.stride(), a.dtype, a.get_device(), p & 15))
        ptrs.append(p)
    return True


@pytest.fixture
def cpu_cache(monkeypatch):
    monkeypatch.setitem(_launch._DESCS, "torch", _descs_cpu)
    monkeypatch.setitem(_launch._interop._STREAM_FNS, "torch", lambda dev: 1234)
    monkeypatch.setattr(_launch, "_CACHE", {})
    return _launch


def test_key_carries_descriptors_and_typed_options(cpu_cache):
    x = torch.randn(4, 2, 3, 8)
    f = torch.randn(16, 8)
    k1, _ = cpu_cache.cache_key("torch", ("rope",), ("sbhd", False, 1, 0), (x, f, None))
    assert k1 == cpu_cache.cache_key("torch", ("rope",), ("sbhd", False, 1, 0), (x, f, None))[0]
    others = [cpu_cache.cache_key("torch", ("rope",), ("sbhd", 0, 1, 0), (x, f, None))[0],  # 0 is not False
              cpu_cache.cache_key("torch", ("rope",), ("sbhd", False, 1, 0), (x.transpose(0, 1), f, None))[0],
              cpu_cache.cache_key("torch", ("rope",), ("sbhd", False, 1, 0), (x.half(), f, None))[0],
              cpu_cache.cache_key("torch", ("rope",), ("sbhd", False, 1, 0), (x, f[:8], None))[0],
              cpu_cache.cache_key("torch", ("rope",), ("sbhd", False, 1, 0), (x, f, f[:, 0]))[0],
              cpu_cache.cache_key("torch", ("qk",), ("sbhd", False, 1, 0), (x, f, None))[0],
              cpu_cache.cache_key("torch", ("rope",), ("sbhd", False, 1, 0, (4, 1)), (x, f, None))[0],
              cpu_cache.cache_key("torch", ("rope",), ("sbhd", False, 1, 0, (4.0, 1)), (x, f, None))[0]]
    assert all(o != k1 for o in others) and len(set(others)) == len(others)


def test_in_place_keys_carry_what_the_overlap_checks_depend_on(cpu_cache):
    """An in-place call's validation depends on overlaps (q and k must share no element, no
    written array may span a read-only one): a hit must have the validated call's overlaps, and
    a new step's fresh buffers in the same layout must still hit."""
    opts = ("bshd", False, 1, 0, True)
    f = torch.randn(16, 8)

    def key(q, k, table=f):
        return cpu_cache.cache_key("torch", ("qk", False), opts, (q, k, table, None, None), written=2)[0]

    def fused():  # q and k interleaved in a fused projection [b, s, 3, h, d]: spans meet, no element shared
        qkv = torch.randn(2, 3, 3, 1, 8)
        return qkv[:, :, 0], qkv[:, :, 1]

    step1, step2 = key(*fused()), key(*fused())
    assert step1 == step2  # fresh buffers each step, the same layout: one key
    assert cpu_cache.overlap_signature("torch", fused() + (f,), 2) == (False, 8 * 4)
    sep = [key(torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8)) for _ in range(2)]
    assert sep[0] == sep[1] and sep[0] != step1  # separate allocations: disjoint, relative address not keyed
    buf = torch.randn(256)
    q = buf[:48].view(2, 3, 1, 8)
    assert key(q, buf[64:112].view(2, 3, 1, 8)) == sep[0]
    shifted = key(q, buf[16:64].view(2, 3, 1, 8))  # k overlaps q (same alignment, other relation)
    assert shifted not in (sep[0], step1)
    assert cpu_cache.overlap_signature("torch", (q, buf[16:64].view(2, 3, 1, 8), f), 2) == (False, 16 * 4)
    assert cpu_cache.overlap_signature("torch", (q, None, buf[48:176].view(16, 8)), 2)[0] is False  # right after q
    assert cpu_cache.overlap_signature("torch", (q, None, buf[40:168].view(16, 8)), 2)[0] is True  # q's last 8
    assert cpu_cache.overlap_signature("torch", (q, None, None, torch.zeros(0)), 2) == (False, None)


def test_hit_allocates_and_patches_in_name_order(cpu_cache):
    q, k = torch.randn(4, 2, 3, 8), torch.randn(4, 2, 1, 8)
    f = torch.randn(16, 8)
    arrays = (q, k, f, None, None)
    key, ptrs = cpu_cache.cache_key("torch", ("qk", False), ("sbhd", False, 1, 0, False), arrays)
    prep = FakePrepared()
    # the qk launch's names: x, x2, freqs, cu_seqlens, start_positions, y, y2
    cpu_cache.cache_put(key, prep, [(0, q.shape, False, 0), (1, k.shape, False, 0)])
    res = None
    for _ in range(4):  # torch's CPU allocator aligns to 64 bytes: every call hits
        key, ptrs = cpu_cache.cache_key("torch", ("qk", False), ("sbhd", False, 1, 0, False), arrays)
        res = cpu_cache.cached_call(key, ptrs, arrays, "torch")
        assert res is not None
    yq, yk = res
    assert yq.shape == q.shape and yk.shape == k.shape and yq.is_contiguous() and yk.dtype == k.dtype
    assert prep.calls[-1] == [q.data_ptr(), k.data_ptr(), f.data_ptr(), 0, 0, yq.data_ptr(), yk.data_ptr()]


def test_output_alignment_change_is_a_miss(cpu_cache):
    x = torch.randn(4, 2, 3, 8)
    f = torch.randn(16, 8)
    key, ptrs = cpu_cache.cache_key("torch", ("rope",), ("sbhd",), (x, f))
    prep = FakePrepared()
    cpu_cache.cache_put(key, prep, [(0, x.shape, False, 8)])  # cached plan saw an 8-byte offset
    before = dict(cpu_cache._STATS)
    assert cpu_cache.cached_call(key, ptrs, (x, f), "torch") is None
    assert not prep.calls and cpu_cache._STATS["hits"] == before["hits"]


def test_api_uses_the_cache_only_for_cuda_and_cupy_arrays():
    assert _launch.cache_kind(np.zeros(3)) is None
    assert _launch.cache_kind(torch.zeros(3)) is None  # CPU tensors: the NumPy backend
    assert set(_api.cache_info()) == {"hits", "misses", "size", "native_hits"}


class FakeDriver:
    """Stands in for CuPy's driver binding: the current context is the prepared one's; a launch
    records the parameter blocks it was handed (their address; with ``block_bytes``, the bytes
    of all of them at launch time)."""

    def __init__(self, block_bytes=None):
        self.launched, self.blocks, self.streams, self.configs, self.geometry = [], [], [], [], []
        self.block_bytes, self.rc = block_bytes, 0  # rc: the CUresult of launches

    def ctxGetCurrent(self):
        return 222

    def record(self, fptr, grid, block, stream, argv):
        first = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
        self.launched.append(first)
        self.streams.append(stream)
        self.geometry.append((fptr, grid, block))
        if self.block_bytes is not None:  # every block (the rope kernels' two sit one after the other)
            nbytes, nblocks = self.block_bytes(fptr)
            argvs = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))
            assert [argvs[i] - first for i in range(nblocks)] == [i * nbytes // nblocks for i in range(nblocks)]
            self.blocks.append(ctypes.string_at(first, nbytes))

    def launchKernel(self, fptr, gx, gy, gz, bx, by, bz, shm, stream, argv, extra):
        self.record(fptr, (gx, gy, gz), (bx, by, bz), stream, argv)
        if self.rc:  # CuPy's binding raises
            from cupy.cuda import driver

            raise driver.CUDADriverError(self.rc)

    def launch_ex(self, config, fptr, argv, extra):
        """cuLaunchKernelEx: also records the configuration (grid, block, shared bytes, attributes)."""
        cfg = _launch._LaunchConfig.from_address(config)
        self.configs.append((tuple(cfg.grid), tuple(cfg.block), cfg.shared_bytes,
                             [(cfg.attrs[i].id, cfg.attrs[i].value) for i in range(cfg.num_attrs)]))
        self.record(fptr, tuple(cfg.grid), tuple(cfg.block), cfg.stream, argv)
        return self.rc


def _arrays(rng, shapes):
    return [rng.uniform(-1, 1, s).astype(np.float32) for s in shapes]


class FakeLaunchEx:
    """Stands in for libcuda's cuLaunchKernelEx: records the launch configuration it was handed
    (grid, block, stream, attributes) and the first parameter block's address."""

    def __init__(self):
        self.launched, self.configs = [], []

    def __call__(self, config, fptr, argv, extra):
        cfg = _launch._LaunchConfig.from_address(config)
        attrs = [(cfg.attrs[i].id, cfg.attrs[i].value) for i in range(cfg.num_attrs)]
        self.configs.append((fptr, tuple(cfg.grid), tuple(cfg.block), cfg.shared_bytes, cfg.stream, attrs, extra))
        self.launched.append(ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0])
        return 0


@pytest.mark.parametrize("pdl", [False, True], ids=["cuLaunchKernel", "programmatic"])
@pytest.mark.parametrize("what", ["rope", "qk", "qkv_fwd", "qkv_bwd"])
def test_prepared_launch_patches_the_addresses_the_api_passes(monkeypatch, what, pdl):
    """The address names of each launch (cupy_rope._api) in the order the launch cache passes
    addresses: a launch prepared for one set of arrays, patched with another set's addresses,
    holds exactly the parameter blocks planned for the other set. With programmatic dependent
    launches (compute capability >= 9.0) the launch goes through cuLaunchKernelEx with the
    programmatic stream serialization attribute, the planned grid and block, on the given stream."""
    from cupy_rope import _plan, _worksplit
    from cupy_rope._interop import info

    monkeypatch.setattr(_launch, "function", lambda name, dev: (111, 222))
    driver, launch_ex = FakeDriver(), FakeLaunchEx()
    monkeypatch.setattr(_launch, "_driver", driver)
    monkeypatch.setattr(_launch, "pdl_launcher", lambda dev: launch_ex if pdl else None)
    rng = np.random.default_rng(0)
    sp = np.array([1, 0], np.int32)
    f = rng.uniform(-3, 3, (12, 32)).astype(np.float32)
    kf = rng.uniform(-3, 3, (12, 32)).astype(np.float32)

    def plan_and_order(f, kf, sp):  # (spec, addresses in the cache's order) for fresh arrays
        I = info  # noqa: E741
        if what == "rope":
            x, y = _arrays(rng, [(4, 2, 3, 32)] * 2)
            plan = _plan.resolve_rope(I(x), I(f), "sbhd", False, None, I(sp), 1, 0, None, False)
            return plan.launch(I(x), I(y), I(f), None, I(sp), 4), _api._ROPE_NAMES, [x, f, None, sp, y]
        if what == "qk":
            q, k, yq, yk = _arrays(rng, [(4, 2, 3, 32), (4, 2, 1, 32), (4, 2, 3, 32), (4, 2, 1, 32)])
            pq, pk = _plan.resolve_rope_pair(I(q), I(k), I(f), "sbhd", False, None, I(sp), 1, 0, False, False)
            spec = _worksplit.rope_launch([pq, pk], [(I(q), I(yq)), (I(k), I(yk))], I(f), None, I(sp), 4)
            return spec, _api._QK_NAMES, [q, k, f, None, sp, yq, yk]
        packed, q, k, v = _arrays(rng, [(4, 2, 2, 4 * 32), (4, 2, 4, 32), (4, 2, 2, 32), (4, 2, 2, 32)])
        if what == "qkv_fwd":
            plan = _plan.resolve_qkv(I(packed), I(f), I(kf), None, "sbhd", 4, False, None, I(sp), 1, 0)
            order = [packed, f, kf, None, sp, q, k, v]
            names = _api._QKV_FWD_NAMES
        else:
            plan = _plan.resolve_qkv_backward(I(q), I(k), I(v), I(f), I(kf), None, "sbhd", None, False, None,
                                              I(sp), 1, 0)
            order = [q, k, v, f, kf, None, sp, packed]
            names = _api._QKV_BWD_NAMES
        return plan.launch(I(packed), I(q), I(k), I(v), I(f), I(kf), None, I(sp), 4), names, order

    spec1, names, _ = plan_and_order(f, kf, sp)
    f2, kf2, sp2 = f.copy(), kf.copy(), sp.copy()
    spec2, _, order2 = plan_and_order(f2, kf2, sp2)
    assert spec1.params != spec2.params
    prepared = _launch.Prepared(spec1, 0, names)
    assert prepared.pdl is pdl
    prepared(0xABC0, [0 if a is None else a.__array_interface__["data"][0] for a in order2])
    assert bytes(prepared.buf) == spec2.params
    n = _kernels.param_blocks(spec1.name)  # the launch's argument array: one pointer per block
    assert [prepared.argv[i] for i in range(n)] == [ctypes.addressof(prepared.buf) + i * len(spec2.params) // n
                                                    for i in range(n)]
    used, unused = (launch_ex, driver) if pdl else (driver, launch_ex)
    assert used.launched == [ctypes.addressof(prepared.buf)] and unused.launched == []
    if pdl:
        gx, gy = spec2.grid
        assert launch_ex.configs == [(111, (gx, gy, 1), (spec2.block, 1, 1), 0, 0xABC0, [(6, 1)], None)]


def test_programmatic_launch_switch(monkeypatch):
    """``CUPY_ROPE_PDL=0`` launches without the programmatic attribute (decided without a device
    query); a value other than 0 or 1 is an error naming the variable."""
    monkeypatch.setattr(_launch, "_pdl", {})
    monkeypatch.setenv("CUPY_ROPE_PDL", "0")
    assert _launch.pdl_launcher(0) is None
    monkeypatch.setattr(_launch, "_pdl", {})
    monkeypatch.setenv("CUPY_ROPE_PDL", "off")
    with pytest.raises(ValueError, match="CUPY_ROPE_PDL: expected 0 or 1, got 'off'"):
        _launch.pdl_launcher(0)


class FakeCupyDevice:
    """CuPy arrays over fake device memory (no driver: nothing reads or writes it), a CuPy
    allocator handing out fresh 256-byte aligned addresses, and stand-ins for the device queries
    and the driver, so that the public API's whole CuPy path (miss: plan and prepare; hit: key,
    allocate, patch, launch) runs on the CPU. ``native``: the C++ CuPy path
    (``csrc/cupy_launch.cpp``, the ``cupy_ext`` fixture's functions) configured with the same
    stand-ins serves the hits; else the Python path does. Every launch's parameter blocks are
    recorded (``driver.blocks``) and each kernel has its own function address."""

    CTX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
    PLAIN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                             ctypes.c_void_p, ctypes.c_void_p)

    EX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)

    def __init__(self, monkeypatch, cupy, native=None, pdl=False):
        from cupy_rope import _abi

        self.cupy, self.next, self.fptrs, self.ctx, self.misalign = cupy, 0, {}, 222, 0
        self.alloc_fn = self.stream_fn = None  # the C++ path's allocator and stream query, once configured
        self.mem = cupy.cuda.UnownedMemory(1 << 40, 1 << 32, None, device_id=0)
        names = {}

        def function(name, dev):
            names[self.fptrs.setdefault(name, 1000 + len(self.fptrs))] = name
            return self.fptrs[name], 222

        def block_bytes(fptr):  # (bytes, blocks) of the kernel's parameter blocks
            n = _kernels.param_blocks(names[fptr])
            return 8 * n * len(_abi.ROPE_FIELDS if n == 2 else _abi.QKV_FIELDS), n

        self.driver = FakeDriver(block_bytes)
        self.driver.ctxGetCurrent = lambda: self.ctx
        monkeypatch.setattr(cupy, "empty", lambda shape, dtype=float, order="C": self.array(shape, dtype))
        monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
        monkeypatch.setitem(_launch._interop._STREAM_FNS, "cupy", lambda dev: 0xABC0)
        monkeypatch.setattr(_launch, "_CACHE", {})
        monkeypatch.setattr(_launch, "_drv", lambda: None)
        monkeypatch.setattr(_launch, "_driver", self.driver)
        monkeypatch.setattr(_launch, "function", function)
        monkeypatch.setattr(_launch, "sm_count", lambda dev: 132)
        monkeypatch.setattr(_launch, "pdl_launcher", lambda dev: self.driver.launch_ex if pdl else None)
        monkeypatch.setattr(_launch, "NATIVE", None)
        monkeypatch.setattr(_launch, "MIRROR", None)
        monkeypatch.setattr(_launch, "CUPY_EXT", None)
        if native is not None:
            self.serve_natively(monkeypatch, native)

    def serve_natively(self, monkeypatch, functions):
        """The C++ path's hits (``functions``: the library's fast, entry, configure) on this
        fake device: its allocator, stream, context and launches."""
        import functools

        from cupy_rope import _cupy_ext

        def ctx_get(out):
            out[0] = self.ctx
            return 0

        def stray_blocks(fptr, argv):
            """CUDA_ERROR_INVALID_VALUE (1) unless the C++ path hands the driver its kernel's
            parameter blocks and nothing after them (its argument array of four, the rest null):
            a callback's exception would not reach the test, the launch error does."""
            n = self.driver.block_bytes(fptr)[1]
            argvs = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))
            return int([argvs[i] for i in range(n, 4)] != [None] * (4 - n))

        def plain(fptr, gx, gy, gz, bx, by, bz, shm, stream, argv, extra):
            self.driver.record(fptr, (gx, gy, gz), (bx, by, bz), stream, argv)
            return self.driver.rc or stray_blocks(fptr, argv)

        def ex(config, fptr, argv, extra):
            return self.driver.launch_ex(config, fptr, argv, extra) or stray_blocks(fptr, argv)

        self.callbacks = (self.CTX(ctx_get), self.PLAIN(plain), self.EX(ex))
        fast, entry_fn, configure_fn = functions
        self.stream = types.SimpleNamespace(ptr=0xABC0)  # as cupy.cuda.get_current_stream's Stream
        # the functions the C++ path calls (kept here: tests count their references)
        self.alloc_fn = lambda shape, dtype: self.array(shape, dtype, self.misalign)
        self.stream_fn = lambda dev: self.current_stream(dev)
        _cupy_ext.configure(configure_fn, alloc=self.alloc_fn, stream=self.stream_fn,
                            driver=[ctypes.cast(c, ctypes.c_void_p).value for c in self.callbacks])
        monkeypatch.setattr(_launch, "CUPY_EXT", (fast, functools.partial(_cupy_ext.entry, entry_fn)))

    def current_stream(self, dev):
        return self.stream

    def array(self, shape, dtype, offset=0):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        start = self.next + offset
        self.next = (start + n + 255) // 256 * 256
        return self.cupy.ndarray(tuple(shape), dtype, self.cupy.cuda.MemoryPointer(self.mem, start))

    def words(self, prepared, names, name, block=-1):
        """The words of address ``name`` (in the prepared launch's slots) in launch ``block``'s
        parameter blocks (default: the last launch's)."""
        return [int.from_bytes(self.driver.blocks[block][8 * w:8 * w + 8], "little", signed=True)
                for w in prepared.slots[names.index(name)]]


@pytest.fixture
def cupy_ext():
    """The C++ CuPy path's functions (fast, entry, configure); built here, or skipped where it
    cannot be; pointed back at CuPy and libcuda afterwards."""
    from cupy_rope import _cupy_ext

    why = _cupy_ext.missing_tools()
    if why:
        pytest.skip(f"cannot build the CuPy launch path here: {why}")
    functions = _cupy_ext.functions(_cupy_ext.build())
    yield functions
    _cupy_ext.configure(functions[2])


@pytest.fixture(params=["python", "c++"])
def hit_path(request):
    """Which path serves CuPy's hits: None (the Python path) or the C++ path's functions."""
    return request.getfixturevalue("cupy_ext") if request.param == "c++" else None


def test_cupy_hit_path_on_fake_device_memory(monkeypatch, hit_path):
    """CuPy arrays through the public API on the CPU: the first call of a layout plans and
    launches (a miss), later calls with other arrays of the same layout hit and launch the
    prepared block with every address patched (inputs, tables, index arrays, the new output) on
    CuPy's current stream; the patched block equals the block a fresh plan of those arrays makes;
    another alignment or another option is a miss. Served by the Python path and by the C++ path."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, hit_path)
    before = dict(_launch._STATS)
    f = dev.array((64, 1, 1, 32), np.float32)
    sp = dev.array((4,), np.int32)
    xs = [dev.array((3, 4, 2, 32), np.float16) for _ in range(3)]
    ys = [cupy_rope.apply_rope(x, f, "sbhd", start_positions=sp) for x in xs]
    assert len(dev.driver.launched) == 3 and len(_launch._CACHE) == 1
    assert _launch._STATS["misses"] - before["misses"] == 1 and _launch._STATS["hits"] - before["hits"] == 2
    assert dev.driver.streams == [0xABC0] * 3
    (prepared, _, native), = _launch._CACHE.values()
    assert (native is None) == (hit_path is None)
    # the Python path patches the prepared block in place; the C++ path patches a copy per call
    assert bytes(prepared.buf) == dev.driver.blocks[0 if hit_path else -1]
    names = _api._ROPE_NAMES
    for i in range(3):
        assert dev.words(prepared, names, "x", i) == [xs[i].data.ptr]
        assert dev.words(prepared, names, "y", i) == [ys[i].data.ptr]
        assert dev.words(prepared, names, "freqs", i) == [f.data.ptr]
        assert dev.words(prepared, names, "start_positions", i) == [sp.data.ptr]
    assert all(type(y) is cupy.ndarray for y in ys)
    assert all(y.shape == xs[0].shape and y.dtype == np.float16 and y.flags.c_contiguous for y in ys)
    assert len({y.data.ptr for y in ys}) == 3
    # in place: the hit's patched block is the block a fresh plan of the same arrays makes
    x = dev.array((3, 4, 2, 32), np.float16)
    for a in (dev.array((3, 4, 2, 32), np.float16), x):
        assert cupy_rope.apply_rope(a, f, "sbhd", start_positions=sp, out=a) is a
    hit_block = dev.driver.blocks[-1]
    monkeypatch.setattr(_launch, "_CACHE", {})
    cupy_rope.apply_rope(x, f, "sbhd", start_positions=sp, out=x)
    assert dev.driver.blocks[-1] == hit_block
    # against a cached out-of-place launch of x, another alignment (a 2-byte offset: narrower
    # vectors) and another option are misses
    cupy_rope.apply_rope(x, f, "sbhd", start_positions=sp)
    misses = _launch._STATS["misses"]
    cupy_rope.apply_rope(dev.array((3, 4, 2, 32), np.float16), f, "sbhd", start_positions=sp)
    assert _launch._STATS["misses"] == misses
    cupy_rope.apply_rope(dev.array((3, 4, 2, 32), np.float16, offset=2), f, "sbhd", start_positions=sp)
    cupy_rope.apply_rope(x, f, "sbhd", start_positions=sp, interleaved=True)
    assert _launch._STATS["misses"] - misses == 2 and len(_launch._CACHE) == 4
    cupy_rope.apply_rope(dev.array((3, 4, 2, 32), np.float16, offset=8), f, "sbhd", start_positions=sp)
    assert _launch._STATS["misses"] - misses == 3  # an 8-byte offset: 8-byte vectors
    # which argument is absent is part of the key
    a, b = (_launch.cache_key("cupy", ("rope",), (), (x, f, c, s))[0] for c, s in ((None, sp), (sp, None)))
    assert a != b
    # with another device's context current, the launch runs inside that device's context (the
    # C++ path leaves such a call to the Python path)
    entered = []

    class Device:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            entered.append(self.i)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    dev.ctx = 999
    n, hits = len(dev.driver.launched), _launch._STATS["hits"]
    cupy_rope.apply_rope(x, f, "sbhd", start_positions=sp)
    assert entered == [0] and len(dev.driver.launched) == n + 1 and _launch._STATS["hits"] == hits + 1
    # no tokens, no heads: an empty output and no launch (a grid of no blocks is a driver error)
    for shape in ((0, 4, 2, 32), (3, 4, 0, 32)):
        n = len(dev.driver.launched)
        y = cupy_rope.apply_rope(dev.array(shape, np.float16), f, "sbhd", start_positions=sp)
        assert y.shape == shape and len(dev.driver.launched) == n


def test_cpp_keys_carry_descriptors_typed_options_and_overlaps(monkeypatch, cupy_ext):
    """The C++ path's keys (bytes) hold what the Python path's do: every array's shape, strides,
    dtype (byte order included), device and address % 16, which arguments are absent, the head
    and options with their types (0 is not False, "a" not ("a",)); for in-place calls whether a
    written array spans a read-only one and the written arrays' relative address where their
    spans meet. Fresh arrays in the same layout share a key; a call it cannot key (another array
    type, an option of another type) gives None; the arguments are checked."""
    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    fast = cupy_ext[0]

    def key(head=("rope", False), opts=("sbhd", False, 1, 0), arrays=None, written=0):
        return fast({}, head, opts, arrays, written)

    def x(dtype=np.float16, offset=0, shape=(4, 2, 3, 8)):
        return dev.array(shape, dtype, offset)

    f = dev.array((16, 8), np.float32)
    k1 = key(arrays=(x(), f, None))
    assert type(k1) is bytes and k1 == key(arrays=(x(), f, None))
    big = dev.array((4, 2, 3, 16), np.float16)
    others = [key(opts=("sbhd", 0, 1, 0), arrays=(x(), f, None)),  # 0 is not False
              key(opts=("sbhd", None, 1, 0), arrays=(x(), f, None)),  # nor None, nor 2 (ints are typed too)
              key(opts=("sbhd", 2, 1, 0), arrays=(x(), f, None)),
              key(opts=("sbhd", False, 1, 0, None), arrays=(x(), f, None)),
              key(opts=(("sbhd",), False, 1, 0), arrays=(x(), f, None)),
              key(opts=("sbhd\0", False, 1, 0), arrays=(x(), f, None)),  # strings carry their lengths
              key(opts=("sbhd/long-one", False, 1, 0), arrays=(x(), f, None)),  # and every character
              key(opts=("sbhd/long-two", False, 1, 0), arrays=(x(), f, None)),
              key(opts=("bshd", False, 1, 0), arrays=(x(), f, None)),
              key(opts=("sbhd", False, 2, 0), arrays=(x(), f, None)),
              key(head=("rope", True), arrays=(x(), f, None)),
              key(head=("qk", False), arrays=(x(), f, None)),
              key(arrays=(x().transpose(1, 0, 2, 3), f, None)),
              key(arrays=(big[..., :8], f, None)),  # the same shape, other strides
              key(arrays=(x(np.float32), f, None)),
              key(arrays=(x(">f2"), f, None)),
              key(arrays=(x(offset=2), f, None)),
              key(arrays=(x(shape=(4, 2, 3, 16))[..., ::2], f, None)),
              key(arrays=(x(), f[:8], None)),
              key(arrays=(x(), f, f[:, 0])),
              key(arrays=(x(), None, f)),
              key(arrays=(x(), f, None, None))]
    assert all(type(o) is bytes and o != k1 for o in others) and len(set(others)) == len(others)
    other_dev = cupy.ndarray((4, 2, 3, 8), np.float16, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(1 << 20, 1 << 20, None, device_id=1), 0))
    assert key(arrays=(other_dev, f, None)) != key(arrays=(x(), f, None))
    # calls it cannot key
    assert key(arrays=(x(), np.zeros((16, 8), np.float32), None)) is None
    assert key(opts=("sbhd", np.bool_(False), 1, 0), arrays=(x(), f, None)) is None
    assert key(opts=("sbhd", False, 1.0, 0), arrays=(x(), f, None)) is None
    assert key(opts=("sbhd", False, 2**63, 0), arrays=(x(), f, None)) is None
    # in place: overlaps
    qkv_opts = ("bshd", False, 1, 0, True)

    def inplace(q, k, table=f):
        return key(("qk", False), qkv_opts, (q, k, table, None, None), written=2)

    def fused():
        qkv = dev.array((2, 3, 3, 1, 8), np.float32)
        return qkv[:, :, 0], qkv[:, :, 1]

    step = inplace(*fused())
    assert step == inplace(*fused())
    sep = inplace(x(np.float32, shape=(2, 3, 1, 8)), x(np.float32, shape=(2, 3, 1, 8)))
    assert sep != step and sep == inplace(x(np.float32, shape=(2, 3, 1, 8)), x(np.float32, shape=(2, 3, 1, 8)))
    buf = dev.array((256,), np.float32)
    q = buf[:48].reshape(2, 3, 1, 8)
    assert inplace(q, buf[64:112].reshape(2, 3, 1, 8)) == sep
    shifted = inplace(q, buf[16:64].reshape(2, 3, 1, 8))
    assert shifted not in (sep, step)
    assert inplace(q, buf[192:240].reshape(2, 3, 1, 8), buf[48:176].reshape(16, 8)) == sep  # right after q
    assert inplace(q, buf[192:240].reshape(2, 3, 1, 8), buf[40:168].reshape(16, 8)) != sep  # over q's last 8
    assert inplace(q, buf[192:240].reshape(2, 3, 1, 8), buf[112:240].reshape(16, 8)) != sep  # over k
    assert inplace(q, buf[16:64].reshape(2, 3, 1, 8)) != inplace(q, buf[8:56].reshape(2, 3, 1, 8))  # relative address
    one = key(arrays=(buf[:96].reshape(2, 3, 2, 8), buf[96:224].reshape(16, 8), None), written=1)
    assert one != key(arrays=(buf[:96].reshape(2, 3, 2, 8), buf[88:216].reshape(16, 8), None), written=1)
    # a read-only array over a written one's last element, or over a reversed one; empty arrays span nothing
    big = dev.array((1024,), np.float32)
    q, far = big[:48].reshape(2, 3, 1, 8), big[512:560].reshape(2, 3, 1, 8)
    assert inplace(q, far, big[47:175].reshape(16, 8)) != inplace(q, far, big[195:323].reshape(16, 8))
    rev = big[:48][::-1].reshape(2, 3, 1, 8)
    assert inplace(rev, far, big[40:168].reshape(16, 8)) != inplace(rev, far, big[200:328].reshape(16, 8))
    assert inplace(q, far, big[:8].reshape(2, 4)[:, :0]) == inplace(q, far, big[800:808].reshape(2, 4)[:, :0])
    # tuples carry their lengths
    assert key(opts=("sbhd", (4, 1), 1), arrays=(x(), f)) != key(opts=("sbhd", (4,), 1, 1), arrays=(x(), f))
    # and nest at most four deep (the options tuple the first): deeper is not keyed, however deep
    assert type(key(opts=("sbhd", (((1,),),)), arrays=(x(), f))) is bytes
    assert key(opts=("sbhd", ((((1,),),),)), arrays=(x(), f)) is None
    deep = 1
    for _ in range(200_000):
        deep = (deep,)
    assert key(head=deep, arrays=(x(), f)) is None
    # the arguments
    for args in (({}, ("rope",), (), [x()], 0), ([], ("rope",), (), (x(),), 0), ({}, ("rope",), (), (x(),)),
                 ({}, ("rope",), (), (x(),), 0.0)):
        with pytest.raises(TypeError, match="expected"):
            fast(*args)
    with pytest.raises(ValueError, match="written"):
        fast({}, ("rope",), (), (x(), x(), x()), 3)
    with pytest.raises(ValueError, match="written"):
        fast({}, ("rope",), (), (x(),), 2)


@pytest.mark.parametrize("seed", range(4))
def test_cpp_overlap_words_follow_the_python_definition(monkeypatch, cupy_ext, seed):
    """The C++ key's overlap words (csrc/overlap.h: whether a written array spans bytes of a
    read-only one; whether the two written arrays' spans meet, and their relative address) are
    :func:`cupy_rope._launch.overlap_signature`'s, for random views of one buffer: strided,
    reversed, transposed, broadcast and empty views at random offsets, including a view that starts
    inside another's span, and the same view twice; one or two written arrays among two to four."""
    from cupy_rope import _launch

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    fast = cupy_ext[0]
    buf = dev.array((4096,), np.float32)
    rng = np.random.default_rng(seed)

    def view():
        rows, cols = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        start = int(rng.integers(0, 64))  # views often meet
        v = buf[start:start + rows * cols].reshape(rows, cols)
        pick = int(rng.integers(0, 6))
        return [v, v[::-1], v[:, ::2], v.T, v[:, :0], cupy.broadcast_to(v[:1], (3, cols))][pick]

    seen = set()
    for _ in range(300):
        arrays = [view() for _ in range(int(rng.integers(2, 5)))]
        if rng.random() < 0.2:
            arrays[1] = arrays[0]  # the same view twice (relative address 0)
        if len(arrays) > 2 and rng.random() < 0.3:
            arrays[-1] = None
        written = int(rng.integers(1, 3))
        words = np.frombuffer(fast({}, ("t",), (), tuple(arrays), written), "<i8")[-3:]
        ro, rel = _launch.overlap_signature("cupy", arrays, written)
        assert (bool(words[0]), bool(words[1]), int(words[2])) == (ro, rel is not None, rel or 0), (arrays, written)
        seen |= {("ro", ro), ("rel", None if rel is None else rel == 0)}
    assert seen == {("ro", True), ("ro", False), ("rel", None), ("rel", True), ("rel", False)}  # every case drawn


class FakeDriverError(RuntimeError):
    def __init__(self, rc):
        super().__init__(f"CUresult {rc}")


def test_cpp_path_leaves_other_alignments_to_the_python_path(monkeypatch, cupy_ext):
    """An output the allocator places at another alignment than the prepared launch's is left to
    the Python path (which plans for it: a miss, no launch from the C++ path)."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    f = dev.array((16, 1, 1, 32), np.float32)
    x = dev.array((5, 2, 3, 32), np.float16)
    cupy_rope.apply_rope(x, f)
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=float, order="C": dev.array(shape, dtype, 2))
    dev.misalign = 2
    stats, n = dict(_launch._STATS), len(dev.driver.blocks)
    y = cupy_rope.apply_rope(x, f)
    assert y.data.ptr % 16 == 2 and len(dev.driver.blocks) == n + 1
    assert _launch._STATS["misses"] == stats["misses"] + 1 and _launch._STATS["hits"] == stats["hits"]
    assert cupy_rope.apply_rope(x, f).data.ptr % 16 == 2 and _launch._STATS["hits"] == stats["hits"] + 1


class KeptCall:
    """A rope call's arrays on the fake device and its C++ key, for tests that hand the C++
    path's ``fast`` kept values of their own: ``entry(...)`` makes a C++ entry (kernel 1000, one
    block of two words, one output like array ``like``), ``left(kept)`` asserts that the call is
    left to the Python path (its key comes back, nothing allocated or launched)."""

    def __init__(self, dev, cupy_ext):
        self.dev, (self.fast, self.entry_fn) = dev, cupy_ext[:2]
        self.arrays = (dev.array((4, 2, 3, 8), np.float16), dev.array((16, 8), np.float32), None)
        self.key = self.call({})
        assert type(self.key) is bytes

    def call(self, cache):
        return self.fast(cache, ("rope",), (), self.arrays, 0)

    def entry(self, like=0, params=bytes(16), slots=((1,),)):
        return self.entry_fn(1000, 1, 1, 128, False, params, (0,), slots, ((like, (4, 2, 3, 8), 0, 0),), 222, 0)

    def left(self, kept):
        allocated, launched = self.dev.next, len(self.dev.driver.launched)
        assert self.call({self.key: kept}) == self.key
        assert self.dev.next == allocated and len(self.dev.driver.launched) == launched


def test_cpp_path_leaves_outputs_like_a_missing_array(monkeypatch, cupy_ext):
    """A kept entry whose output is allocated like an array the call does not hold (an absent
    one, or an index at or past the call's arrays) is left to the Python path (the call's key
    comes back): nothing allocated, nothing launched."""
    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    c = KeptCall(dev, cupy_ext)
    for like in (2, 3, 4):
        c.left((None, None, c.entry(like)))
    # the same entry with an output like the first array: a hit (the test's entry is sound)
    dev.driver.block_bytes = lambda fptr: (16, 1)  # its one parameter block of two words
    launched = len(dev.driver.launched)
    out = c.call({c.key: (None, None, c.entry())})
    assert type(out) is list and out[0].shape == (4, 2, 3, 8) and len(dev.driver.launched) == launched + 1
    first = c.arrays[0].data.ptr.to_bytes(8, "little")
    assert dev.driver.blocks[-1][8:] == first  # word 1: the first address
    # an entry with fewer slot lists than the call's addresses patches those it has, and no more
    for slots in ((), ((1,),)):
        assert type(c.call({c.key: (None, None, c.entry(params=bytes(range(16)), slots=slots))})) is list
        assert dev.driver.blocks[-1] == bytes(range(8)) + (first if slots else bytes(range(8, 16)))


def test_cpp_entries_take_at_most_four_parameter_blocks(monkeypatch, cupy_ext):
    """A C++ entry holds up to four parameter blocks (the launch's argument array has four): a
    hit with four passes each block's address, in order, with the call's address patched in; an
    entry of five is refused when it is made."""
    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    c = KeptCall(dev, cupy_ext)
    params = bytes(range(64))  # four blocks of two words
    outs = ((0, (4, 2, 3, 8), 0, 0),)
    e = c.entry_fn(1000, 1, 1, 128, False, params, (0, 2, 4, 6), ((1,),), outs, 222, 0)
    dev.driver.block_bytes = lambda fptr: (64, 4)
    assert type(c.call({c.key: (None, None, e)})) is list
    assert dev.driver.blocks[-1] == params[:8] + c.arrays[0].data.ptr.to_bytes(8, "little") + params[16:]
    with pytest.raises(ValueError, match="malformed launch"):
        c.entry_fn(1000, 1, 1, 128, False, bytes(80), (0, 2, 4, 6, 8), ((1,),), outs, 222, 0)


def test_cpp_path_leaves_entries_without_a_cpp_entry(monkeypatch, cupy_ext):
    """A kept value under the call's key that holds no C++ entry (too short a tuple, None, an
    object that is not the library's capsule, a capsule of another name) is left to the Python
    path (the call's key comes back): nothing allocated, nothing launched."""
    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    c = KeptCall(dev, cupy_ext)
    capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
        ("PyCapsule_New", ctypes.pythonapi))
    for kept in ((None, None), (None, None, None), (None, None, object()), [None, None, None],
                 (None, None, capsule(id(dev), b"not.cupy_rope", None))):
        c.left(kept)


def test_cpp_path_needs_a_stream_handle(monkeypatch, cupy_ext):
    """A current stream without a handle (``.ptr``) is an error, not a launch on stream 0."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    f = dev.array((16, 1, 1, 32), np.float32)
    x = dev.array((5, 2, 3, 32), np.float16)
    cupy_rope.apply_rope(x, f)
    n = len(dev.driver.blocks)
    dev.stream = object()
    with pytest.raises(RuntimeError, match="the current stream has no handle"):
        cupy_rope.apply_rope(x, f)
    assert len(dev.driver.blocks) == n


@pytest.mark.parametrize("pdl", [False, True], ids=["cuLaunchKernel", "programmatic"])
def test_failed_launches_raise_cupys_driver_error(monkeypatch, hit_path, pdl):
    """A launch the driver refuses raises CuPy's driver error with the CUresult, on a miss and on
    a hit (the Python path and the C++ path, plain and programmatic launches)."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, hit_path, pdl)
    monkeypatch.setattr(cupy.cuda.driver, "CUDADriverError", FakeDriverError)  # CuPy's needs libcuda
    f = dev.array((16, 1, 1, 32), np.float32)
    x = dev.array((5, 2, 3, 32), np.float16)
    cupy_rope.apply_rope(x, f)
    dev.driver.rc = 700
    hits = _launch._STATS["hits"]
    with pytest.raises(FakeDriverError, match="CUresult 700"):
        cupy_rope.apply_rope(x, f)
    assert _launch._STATS["hits"] == hits
    monkeypatch.setattr(_launch, "_CACHE", {})
    with pytest.raises(FakeDriverError, match="CUresult 700"):
        cupy_rope.apply_rope(x, f)
    assert len(dev.driver.blocks) == 3


def test_cpp_path_raises_where_the_error_function_returns(monkeypatch, cupy_ext):
    """A launch-error function that returns instead of raising: a refused launch on a C++ hit
    raises RuntimeError with the CUresult itself, and the path keeps no reference to what the
    function returned."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    returned, seen = object(), []

    def returns(rc):
        seen.append(rc)
        return returned

    monkeypatch.setattr(_launch, "raise_driver_error", returns)  # what configure hands the C++ path
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    f = dev.array((16, 1, 1, 32), np.float32)
    x = dev.array((5, 2, 3, 32), np.float16)
    cupy_rope.apply_rope(x, f)  # a miss: the Python path keeps the launch
    dev.driver.rc = 700
    hits, refs = _launch._STATS["hits"], sys.getrefcount(returned)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="kernel launch failed with CUresult 700"):
            cupy_rope.apply_rope(x, f)
    assert seen == [700] * 3 and sys.getrefcount(returned) == refs and _launch._STATS["hits"] == hits


def test_cpp_path_raises_where_an_output_cannot_be_made(monkeypatch, cupy_ext):
    """A C++ hit whose allocator raises or returns an object without an address (no ``data``, or
    a ``data`` without an integer ``ptr``), whose transposed output's ``transpose`` raises, or whose
    current-stream query raises, raises that error and launches nothing, keeping no reference to
    what the allocator returned; once all work again, the same calls hit."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    f = dev.array((16, 1, 1, 32), np.float32)
    x = dev.array((5, 2, 3, 32), np.float16)
    calls = (lambda: cupy_rope.apply_rope(x, f), lambda: cupy_rope.apply_rope(x, f, transpose_output_memory=True))
    for call in calls:
        call()  # a miss: the Python path keeps the launch
    hits, n = _launch._STATS["hits"], len(dev.driver.blocks)
    array = dev.array

    def pool_empty(shape, dtype, offset=0):
        raise MemoryError("fake pool empty")

    class NoTranspose(cupy.ndarray):
        def transpose(self, *axes):
            raise RuntimeError("fake transpose refused")

    def no_transpose(shape, dtype, offset=0):
        y = array(shape, dtype, offset)
        return NoTranspose(y.shape, y.dtype, y.data)

    class Nowhere:  # no integer .data.ptr
        data = types.SimpleNamespace(ptr="fake address")

    class Dataless:  # no .data
        pass

    def no_stream(device):
        raise RuntimeError("fake stream query failed")

    nowhere, dataless, stream_query = Nowhere(), Dataless(), dev.current_stream
    for attr, value, call, error, match in (
            ("array", pool_empty, calls[0], MemoryError, "fake"), ("array", pool_empty, calls[1], MemoryError, "fake"),
            ("array", no_transpose, calls[1], RuntimeError, "fake"),
            ("array", lambda *a: nowhere, calls[0], RuntimeError, "without an address"),
            ("array", lambda *a: nowhere, calls[1], RuntimeError, "without an address"),
            ("array", lambda *a: dataless, calls[0], AttributeError, "data"),
            ("current_stream", no_stream, calls[0], RuntimeError, "fake stream")):
        monkeypatch.setattr(dev, attr, value)
        refs = sys.getrefcount(nowhere), sys.getrefcount(dataless)
        with pytest.raises(error, match=match):
            call()
        assert len(dev.driver.blocks) == n and _launch._STATS["hits"] == hits
        assert (sys.getrefcount(nowhere), sys.getrefcount(dataless)) == refs
        monkeypatch.setattr(dev, "array", array)
        monkeypatch.setattr(dev, "current_stream", stream_query)
    for call in calls:
        call()
    assert len(dev.driver.blocks) == n + 2 and _launch._STATS["hits"] == hits + 2


# A well-formed argument list of the C++ entry function (kernel 1, grid 2 x 1, blocks of 128, no
# PDL, one block of two words, address 0 in word 1, one output like array 0 of shape (2, 3)).
ENTRY_ARGS = (1, 2, 1, 128, False, bytes(16), (0,), ((1,),), ((0, (2, 3), 0, 0),), 0, 0)


def test_cpp_functions_check_their_arguments(cupy_ext):
    """The C++ path's configure and entry refuse arguments of the wrong kind (nothing changes)."""
    cupy = pytest.importorskip("cupy")
    fast, entry_fn, configure_fn = cupy_ext
    ok = (cupy.ndarray, cupy.ndarray, cupy.cuda.get_current_stream, _launch.raise_driver_error, 0, 0, 0)
    for i, bad in ((0, "ndarray"), (1, None), (2, 3), (3, "raise")):
        with pytest.raises(TypeError, match="configure: expected"):
            configure_fn(*ok[:i], bad, *ok[i + 1:])
    configure_fn(*ok)
    assert type(entry_fn(*ENTRY_ARGS)).__name__ == "PyCapsule"
    for i, bad, exc in ((5, bytes(12), ValueError), (6, (0, 5), ValueError), (6, [0], TypeError),
                        (7, ((2,),), ValueError), (7, ((1.0,),), TypeError), (8, ((0, [2, 3], 0, 0),), ValueError),
                        (8, ((-1, (2, 3), 0, 0),), ValueError), (5, "x", TypeError)):
        with pytest.raises(exc):
            entry_fn(*ENTRY_ARGS[:i], bad, *ENTRY_ARGS[i + 1:])


def test_cpp_configure_releases_what_it_replaces(cupy_ext):
    """configure holds one reference to each object it is given (the array type, the allocator,
    the stream query, the error function) and releases them when configured again."""
    cupy = pytest.importorskip("cupy")
    configure_fn = cupy_ext[2]
    held = [type("FakeArray", (), {})] + [lambda *a: None for _ in range(3)]  # objects of this test's own
    before = [sys.getrefcount(o) for o in held]
    configure_fn(*held, 0, 0, 0)
    assert [sys.getrefcount(o) for o in held] == [b + 1 for b in before]
    configure_fn(cupy.ndarray, cupy.ndarray, cupy.cuda.get_current_stream, _launch.raise_driver_error, 0, 0, 0)
    assert [sys.getrefcount(o) for o in held] == before


def test_cpp_entries_release_what_they_hold(cupy_ext):
    """An entry capsule holds one reference to each output's shape and releases it when it is
    dropped (its destructor deletes the entry); an entry refused after taking its first output
    releases that output's shape too."""
    entry_fn = cupy_ext[1]
    shape = tuple(range(2, 5))  # an object of this test's own
    before = sys.getrefcount(shape)
    cap = entry_fn(*ENTRY_ARGS[:8], ((0, shape, 0, 0),), *ENTRY_ARGS[9:])
    assert sys.getrefcount(shape) == before + 1
    del cap
    assert sys.getrefcount(shape) == before
    with pytest.raises(ValueError, match="malformed"):  # the second output has three fields
        entry_fn(*ENTRY_ARGS[:8], ((0, shape, 0, 0), (0, shape, 0)), *ENTRY_ARGS[9:])
    assert sys.getrefcount(shape) == before


@pytest.mark.parametrize("entry", ["qk", "pos"])
def test_in_place_calls_with_a_numpy_bool_are_validated_every_time(monkeypatch, hit_path, entry):
    """``inplace`` given as a NumPy bool (accepted as a bool) is not cached: whether an in-place
    call's q and k may overlap is keyed only for ``inplace`` a bool itself, so a later call whose
    q and k share elements is refused, not served from a cached launch."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, hit_path)
    f = dev.array((16, 32), np.float32)
    pos = dev.array((5,), np.int64)

    def call(q, k):
        if entry == "qk":
            return cupy_rope.apply_rope_qk(q, k, f, "bshd", inplace=np.bool_(True))
        return cupy_rope.apply_rope_pos(pos, q, k, freqs=f, inplace=np.bool_(True))

    shape = (1, 5, 2, 32) if entry == "qk" else (5, 2, 32)
    for _ in range(2):
        call(dev.array(shape, np.float16), dev.array(shape, np.float16))
    same = dev.array(shape, np.float16)
    with pytest.raises(ValueError, match="`k`"):
        call(same, same)


def test_options_are_keyed_in_their_places(monkeypatch, hit_path):
    """Each option is keyed where it stands, None included: after a packed-QKV call given
    ``num_q_heads=8`` is cached, a call that gives 8 as ``split`` instead (refused: a split is
    three ints) is validated, not served from the first call's launch."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, hit_path)
    f = dev.array((16, 32), np.float32)
    start = _launch._STATS["hits"]
    for _ in range(2):  # a miss, then a hit
        cupy_rope.apply_qkv_rope(dev.array((5, 2, 2, 6 * 32), np.float16), f, f, num_q_heads=8)
    hits, n = _launch._STATS["hits"], len(dev.driver.blocks)
    assert hits == start + 1
    with pytest.raises(TypeError, match="`split`: expected three ints"):
        cupy_rope.apply_qkv_rope(dev.array((5, 2, 2, 6 * 32), np.float16), f, f, split=8)
    assert len(dev.driver.blocks) == n and _launch._STATS["hits"] == hits


def _views(dev, shape, dtype, perm=None):
    """A fresh fake CuPy array of ``shape``; ``perm``: laid out in that axis order in memory."""
    if perm is None:
        return dev.array(shape, dtype)
    return dev.array(tuple(shape[p] for p in perm), dtype).transpose(np.argsort(perm))


# Calls of every public entry point and layout the launch cache serves: (name, call(dev) -> the
# call's result). Each call makes its own fresh arrays.
def _fused_qk(dev, dt):
    qkv = dev.array((2, 5, 3, 4, 32), dt)  # [b, s, 3, h, d]: q and k are views of one buffer
    return qkv[:, :, 0], qkv[:, :, 1]


HIT_CASES = {
    "rope sbhd offsets": lambda dev, c: c.apply_rope(
        dev.array((5, 2, 3, 32), np.float16), dev.array((16, 1, 1, 32), np.float32),
        start_positions=dev.array((2,), np.int64)),
    "rope bshd strided, backward": lambda dev, c: c.apply_rope_backward(
        _views(dev, (2, 5, 3, 32), np.float32, (1, 0, 2, 3)), dev.array((8, 16), np.float32), "bshd"),
    "rope thd cp": lambda dev, c: c.apply_rope(
        dev.array((12, 2, 64), np.float16), dev.array((16, 1, 1, 32), np.float32), "thd",
        cu_seqlens=dev.array((3,), np.int32), cp_size=2, cp_rank=1),
    "rope transposed output": lambda dev, c: c.apply_rope(
        dev.array((5, 2, 3, 32), np.float32), dev.array((16, 32), np.float32), transpose_output_memory=True),
    "rope in place": lambda dev, c: (lambda x: c.apply_rope(x, dev.array((16, 32), np.float32), "bshd", out=x,
                                                           interleaved=True))(dev.array((2, 5, 3, 32), np.float16)),
    "qk": lambda dev, c: c.apply_rope_qk(dev.array((5, 2, 4, 32), np.float16), dev.array((5, 2, 1, 32), np.float16),
                                         dev.array((16, 32), np.float32), start_positions=dev.array((2,), np.int32)),
    "qk fused views in place, backward": lambda dev, c: c.apply_rope_qk_backward(
        *_fused_qk(dev, np.float16), dev.array((16, 32), np.float32), "bshd", inplace=True),
    "pos cos/sin cache": lambda dev, c: c.apply_rope_pos(
        dev.array((6,), np.int64), dev.array((6, 4 * 64), np.float16), dev.array((6, 64), np.float16),
        cos_sin_cache=dev.array((32, 64), np.float32), head_size=64),
    "pos angles, k None, 2-D positions": lambda dev, c: c.apply_rope_pos(
        dev.array((2, 3), np.int32), dev.array((2, 3, 4, 32), np.float32), freqs=dev.array((32, 16), np.float32),
        rope_dim_offset=8, interleaved=True),
    "pos inv_freq in place, inverse": lambda dev, c: c.apply_rope_pos(
        dev.array((2, 5), np.int64), *_fused_qk(dev, np.float16), inv_freq=dev.array((16,), np.float32),
        inplace=True, inverse=True),
    "qkv": lambda dev, c: c.apply_qkv_rope(dev.array((5, 2, 2, 6 * 32), np.float16), dev.array((16, 32), np.float32),
                                           dev.array((16, 32), np.float32), num_q_heads=8),
    "qkv backward": lambda dev, c: c.apply_qkv_rope_backward(
        dev.array((5, 2, 8, 32), np.float16), dev.array((5, 2, 2, 32), np.float16),
        dev.array((5, 2, 2, 32), np.float16), dev.array((16, 32), np.float32), dev.array((16, 32), np.float32),
        split=[4 * 32, 32, 32]),
}


def _outputs(res):
    res = res if isinstance(res, tuple) else (res,)
    return [None if y is None else (y.shape, y.strides, y.dtype, y.data.ptr) for y in res]


@pytest.mark.parametrize("pdl", [False, True], ids=["cuLaunchKernel", "programmatic"])
@pytest.mark.parametrize("case", list(HIT_CASES))
def test_every_entry_point_hits_with_the_block_a_fresh_plan_makes(monkeypatch, hit_path, case, pdl):
    """Each entry point and layout the launch cache serves, on fake CuPy memory: a second call
    with fresh arrays of the same layout is a hit, and the parameter blocks it launches are the
    blocks a fresh plan of those arrays (the cache emptied, the allocator replayed) launches, its
    outputs the same arrays, its launch the same (grid, block, stream; with programmatic
    dependent launches through cuLaunchKernelEx with the programmatic attribute). Served by the
    Python path and by the C++ path."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, hit_path, pdl)
    call = HIT_CASES[case]
    call(dev, cupy_rope)
    hits, mark = _launch._STATS["hits"], dev.next
    hit = _outputs(call(dev, cupy_rope))
    assert _launch._STATS["hits"] == hits + 1 and len(dev.driver.blocks) == 2
    monkeypatch.setattr(_launch, "_CACHE", {})
    dev.next = mark
    fresh = _outputs(call(dev, cupy_rope))
    assert _launch._STATS["hits"] == hits + 1 and len(dev.driver.blocks) == 3
    assert dev.driver.blocks[1] == dev.driver.blocks[2] and dev.driver.blocks[1] != dev.driver.blocks[0]
    assert hit == fresh and dev.driver.streams == [0xABC0] * 3 and len(set(dev.driver.geometry)) == 1
    assert len(dev.driver.configs) == (3 if pdl else 0) and len(set(map(str, dev.driver.configs))) <= 1
    assert all(c[2:] == (0, [(6, 1)]) for c in dev.driver.configs)


def test_cpp_hits_leak_nothing(monkeypatch, cupy_ext):
    """Hits of every entry point through the C++ path leave no Python object behind (traced
    memory flat over a thousand rounds) and no reference to the shared objects or the cached
    entries, nor do calls it leaves to the Python path (another device's context current)."""
    import gc
    import tracemalloc

    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    monkeypatch.setattr(dev.driver, "record", lambda *args: None)
    calls = list(HIT_CASES.values())

    def rounds(n):
        for _ in range(n):
            for call in calls:
                call(dev, cupy_rope)

    # shared objects: dtypes, the stream, the functions the C++ path is configured with
    shared = [np.dtype(t) for t in (np.float16, np.float32, np.int32, np.int64)] + [dev.stream, dev.alloc_fn,
                                                                                    dev.stream_fn, _launch.raise_driver_error]
    class Device:  # the Python path's launch in another device's context
        def __init__(self, i):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    for ctx in (222, 999):  # the C++ path's hits; calls it leaves to the Python path
        dev.ctx = ctx
        rounds(20)
        hits = _launch._STATS["hits"]
        gc.collect()
        entries = [e[2] for e in _launch._CACHE.values() if e[2] is not None]  # the C++ entries (capsules)
        refs = [sys.getrefcount(t) for t in shared + entries]
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            rounds(1000)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert _launch._STATS["hits"] == hits + 1000 * len(calls)
        assert grown < 16 * 1024, f"{grown} bytes more after {1000 * len(calls)} hits (context {ctx})"
        assert [sys.getrefcount(t) for t in shared + entries] == refs
    # the C++ path keeps a reference to each dtype object it has keyed (its address stays its
    # own); arrays of ever new dtype objects: those references are a bounded cache
    fast = cupy_ext[0]
    probe = np.dtype(np.float32, metadata={"probe": 1})
    before = sys.getrefcount(probe)
    fast({}, ("rope",), (), (dev.array((4,), probe),), 0)
    gc.collect()
    assert sys.getrefcount(probe) == before + 1
    tracemalloc.start()
    try:
        for i in range(3000):
            fast({}, ("rope",), (), (dev.array((4,), np.dtype(np.float32, metadata={"i": i})),), 0)
            if i == 999:
                gc.collect()
                before = tracemalloc.get_traced_memory()[0]
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes more after 2000 dtypes"


def test_cpp_hits_from_several_threads(monkeypatch, cupy_ext):
    """Hits of every entry point from four threads at once (the C++ path runs Python, the
    allocator and the stream query, in the middle of a hit; another thread may then run, and
    empty the cache): every call returns its outputs, none raises."""
    import threading

    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, cupy_ext)
    monkeypatch.setattr(dev.driver, "record", lambda *args: None)
    monkeypatch.setattr(_launch, "_CACHE_MAX", 5)  # emptied now and then while other threads hit
    errors, done = [], []

    def work():
        try:
            for _ in range(100):
                for call in HIT_CASES.values():
                    res = call(dev, cupy_rope)
                    assert all(y is not None for y in (res if isinstance(res, tuple) else (res,))[:1])
            done.append(1)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside hits, at the Python they call
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors and len(done) == 4, errors[:3]


def _fuzz_arrays(case, dev):
    """A fuzz case's arrays (:mod:`fuzz`) on fake CuPy memory: each NumPy buffer of the case one
    fresh fake allocation, each array the case's view over it (any strides, offsets)."""
    import cupy

    native, bufs = {}, {}
    for name, laid in case.arrays.items():
        if name == "k_freqs" and laid is case.arrays.get("q_freqs"):
            native[name] = native["q_freqs"]
            continue
        if id(laid.base) not in bufs:
            bufs[id(laid.base)] = dev.array(laid.base.shape, laid.base.dtype)
        isz = laid.base.itemsize
        native[name] = cupy.lib.stride_tricks.as_strided(bufs[id(laid.base)][laid.offset:], laid.shape,
                                                         tuple(s * isz for s in laid.strides))
    if case.out_is_input:
        native["out"] = native["x" if case.entry == "rope" else "grad"]
    return native


@pytest.mark.parametrize("seeds", [(0, 1000), (400000, 401000)], ids=lambda s: f"{s[0]}:{s[1]}")
def test_fuzz_cases_hit_with_the_block_a_fresh_plan_makes(monkeypatch, hit_path, seeds):
    """The fuzz's valid cases (every entry point; strided, reversed, broadcast, offset arrays;
    in place and ``out``) on fake CuPy memory, each called three times: once, again with fresh
    arrays of the same layout (a hit where the call is cached), and once more with the cache
    emptied and the allocator replayed (a fresh plan of the same arrays): the second and third
    calls launch the same parameter blocks and return arrays of the same shapes, strides,
    dtypes and addresses. Served by the Python path and by the C++ path."""
    import fuzz

    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy, hit_path)
    ran = hit = 0
    for seed in range(*seeds):
        case = fuzz.draw(seed, "cupy")
        if case.expect_error:
            continue
        case.meta["via"] = "api"
        monkeypatch.setattr(_launch, "_CACHE", {})
        fuzz.call(case, "cupy", _fuzz_arrays(case, dev))
        n, hits, mark = len(dev.driver.blocks), _launch._STATS["hits"], dev.next
        second = _outputs(fuzz.call(case, "cupy", _fuzz_arrays(case, dev)))
        launched = dev.driver.blocks[n:]
        hit += _launch._STATS["hits"] - hits
        monkeypatch.setattr(_launch, "_CACHE", {})
        dev.next = mark
        third = _outputs(fuzz.call(case, "cupy", _fuzz_arrays(case, dev)))
        assert dev.driver.blocks[n + len(launched):] == launched and second == third, case.describe()
        ran += bool(launched)
    assert ran > 100 and hit > 50, (ran, hit)


def test_cache_is_bounded(monkeypatch):
    """A full launch cache is emptied before the next entry is kept."""
    monkeypatch.setattr(_launch, "_CACHE", {})
    monkeypatch.setattr(_launch, "_CACHE_MAX", 2)
    for i in range(5):
        _launch.cache_put(("k", i), FakePrepared(), [])
        assert 1 <= len(_launch._CACHE) <= 2 and ("k", i) in _launch._CACHE


@pytest.mark.parametrize("capability, driver, pdl", [("90", 12030, True), ("100", 13000, True),
                                                     ("89", 13000, False), ("90", 12020, False)])
def test_programmatic_launches_from_sm_90_and_cuda_12_3(capability, driver, pdl, monkeypatch):
    """Launches are programmatic dependent launches on devices of compute capability 9.0 and
    later with a CUDA 12.3 or later driver (programmatic launches in stream capture), else plain;
    the device and driver queried through CuPy (stand-ins here: no device needed)."""
    import cupy

    class Device:
        def __init__(self, device):
            self.compute_capability = capability

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy.cuda.runtime, "driverGetVersion", lambda: driver)
    monkeypatch.setattr(_launch, "_launch_ex", lambda: "cuLaunchKernelEx")
    monkeypatch.setattr(_launch, "_pdl", {})
    monkeypatch.delenv("CUPY_ROPE_PDL", raising=False)
    assert _launch.pdl_launcher(0) == ("cuLaunchKernelEx" if pdl else None)


def test_grid_limit_is_the_last_block_index_below_2_31():
    """One launch runs at most 2^31 - 1 blocks along x (the driver's limit): that many pass, one
    more is a ValueError saying the problem is too large."""
    from types import SimpleNamespace

    assert _launch.check_grid(SimpleNamespace(grid=(2**31 - 1, 2))) == (2**31 - 1, 2)
    with pytest.raises(ValueError, match=r"problem too large for one launch \(2147483648 blocks\)"):
        _launch.check_grid(SimpleNamespace(grid=(2**31, 1)))


class GpuDevice:
    """Real CuPy arrays with the FakeCupyDevice's ``array`` signature: random values from a
    seeded generator (index arrays: sorted small non-negative ints), so that a seed replays the
    same inputs."""

    def __init__(self, cupy, seed):
        self.cupy, self.rng = cupy, np.random.default_rng(seed)

    def array(self, shape, dtype, offset=0):
        assert offset == 0
        dt = np.dtype(dtype)
        if dt.kind == "i":
            a = np.sort(self.rng.integers(0, 12, shape), axis=-1).astype(dt)
        else:
            a = self.rng.uniform(-2, 2, shape).astype(dt)
        return self.cupy.asarray(a)


def _host(res):
    res = res if isinstance(res, tuple) else (res,)
    return [None if y is None else (y.shape, y.strides, y.dtype, y.get().tobytes()) for y in res]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(HIT_CASES))
def test_gpu_cupy_hits_from_the_cpp_path_match_the_python_path(monkeypatch, case):
    """On the GPU: the C++ CuPy path loads wherever it can be built and serves the hits; each
    entry point's hit gives results bit-identical to the Python path's on the same inputs."""
    import cupy
    import cupy_rope
    from cupy_rope import _cupy_ext

    monkeypatch.setattr(_launch, "_CACHE", {})
    call = HIT_CASES[case]
    call(GpuDevice(cupy, 0), cupy_rope)
    if _cupy_ext.missing_tools():
        assert _launch.CUPY_EXT is None
        pytest.skip(f"no C++ CuPy path here: {_cupy_ext.missing_tools()}")
    assert _launch.CUPY_EXT is not None and all(e[2] is not None for e in _launch._CACHE.values())
    hits = _launch._STATS["hits"]
    native = _host(call(GpuDevice(cupy, 1), cupy_rope))
    assert _launch._STATS["hits"] == hits + 1
    monkeypatch.setattr(_launch, "CUPY_EXT", None)
    monkeypatch.setattr(_launch, "_CACHE", {})
    call(GpuDevice(cupy, 0), cupy_rope)
    python = _host(call(GpuDevice(cupy, 1), cupy_rope))
    assert _launch._STATS["hits"] == hits + 2
    assert native == python


@pytest.mark.gpu
def test_gpu_cupy_hits_follow_the_current_stream_and_graph_capture():
    """A hit launches on CuPy's current stream: inside ``with stream`` and captured into a CUDA
    graph, whose replays rotate the new contents of the same arrays."""
    import cupy
    import cupy_rope
    from reference import assert_close_to_ref, rope_ref

    rng = np.random.default_rng(5)
    f = rng.uniform(-4, 4, (32, 1, 1, 64)).astype(np.float32)
    fd = cupy.asarray(f)
    x = cupy.asarray(rng.uniform(-1, 1, (16, 2, 4, 64)).astype(np.float32))
    for _ in range(2):  # a miss, then a hit; in place and out of place
        cupy_rope.apply_rope(x, fd, out=x)
        cupy_rope.apply_rope(x, fd)
    cupy.cuda.Device().synchronize()
    hits = _launch._STATS["hits"]
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        cupy_rope.apply_rope(x, fd, out=x)  # in place: no allocation while capturing
        g = s.end_capture()
    assert _launch._STATS["hits"] == hits + 1
    for _ in range(2):
        x0 = rng.uniform(-1, 1, x.shape).astype(np.float32)
        x.set(x0, stream=s)
        g.launch(s)
        s.synchronize()
        assert_close_to_ref(x.get(), rope_ref(x0, f), x0, 64, "float32")
    with s:
        x0 = rng.uniform(-1, 1, x.shape).astype(np.float32)
        x.set(x0, stream=s)
        y = cupy_rope.apply_rope(x, fd)
        s.synchronize()
    assert _launch._STATS["hits"] == hits + 2
    assert_close_to_ref(y.get(), rope_ref(x0, f), x0, 64, "float32")

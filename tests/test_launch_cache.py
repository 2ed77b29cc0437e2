"""The public API's launch cache on the CPU (its GPU use is covered by the GPU suite): keys carry
every descriptor and the options with their types, a hit allocates the outputs like the inputs and
hands the prepared launch every address in the launch's name order, an output whose alignment
differs from the cached plan's is a miss."""

import ctypes

import numpy as np
import pytest

from cupy_rope import _api, _kernels, _launch

torch = pytest.importorskip("torch")


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
              cpu_cache.cache_key("torch", ("qk",), ("sbhd", False, 1, 0), (x, f, None))[0]]
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
    records the parameter blocks it was handed."""

    def __init__(self):
        self.launched = []

    def ctxGetCurrent(self):
        return 222

    def launchKernel(self, fptr, gx, gy, gz, bx, by, bz, shm, stream, argv, extra):
        import ctypes

        ptrs = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))
        self.launched.append(ptrs[0])


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
    allocate, patch, launch) runs on the CPU."""

    def __init__(self, monkeypatch, cupy):
        self.cupy, self.next = cupy, 0
        self.mem = cupy.cuda.UnownedMemory(1 << 40, 1 << 32, None, device_id=0)
        self.driver = FakeDriver()
        monkeypatch.setattr(cupy, "empty", lambda shape, dtype=float, order="C": self.array(shape, dtype))
        monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
        monkeypatch.setitem(_launch._interop._STREAM_FNS, "cupy", lambda dev: 0xABC0)
        monkeypatch.setattr(_launch, "_CACHE", {})
        monkeypatch.setattr(_launch, "_drv", lambda: None)
        monkeypatch.setattr(_launch, "_driver", self.driver)
        monkeypatch.setattr(_launch, "function", lambda name, dev: (111, 222))
        monkeypatch.setattr(_launch, "sm_count", lambda dev: 132)
        monkeypatch.setattr(_launch, "pdl_launcher", lambda dev: None)
        monkeypatch.setattr(_launch, "NATIVE", None)
        monkeypatch.setattr(_launch, "MIRROR", None)

    def array(self, shape, dtype, offset=0):
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        start = self.next + offset
        self.next = (start + n + 255) // 256 * 256
        return self.cupy.ndarray(tuple(shape), dtype, self.cupy.cuda.MemoryPointer(self.mem, start))

    def words(self, prepared, names, name):
        """The parameter-block words of address ``name`` in the prepared launch."""
        return [prepared.buf[w] for w in prepared.slots[names.index(name)]]


def test_cupy_hit_path_on_fake_device_memory(monkeypatch):
    """CuPy arrays through the public API on the CPU: the first call of a layout plans and
    launches (a miss), later calls with other arrays of the same layout hit and launch the
    prepared block with every address patched (inputs, tables, index arrays, the new output);
    the patched block equals the block a fresh plan of those arrays makes; another alignment
    or another option is a miss."""
    import cupy_rope

    cupy = pytest.importorskip("cupy")
    dev = FakeCupyDevice(monkeypatch, cupy)
    before = dict(_launch._STATS)
    f = dev.array((64, 1, 1, 32), np.float32)
    sp = dev.array((4,), np.int32)
    xs = [dev.array((3, 4, 2, 32), np.float16) for _ in range(3)]
    ys = [cupy_rope.apply_rope(x, f, "sbhd", start_positions=sp) for x in xs]
    assert len(dev.driver.launched) == 3 and len(_launch._CACHE) == 1
    assert _launch._STATS["misses"] - before["misses"] == 1 and _launch._STATS["hits"] - before["hits"] == 2
    (prepared, _), = _launch._CACHE.values()
    names = _api._ROPE_NAMES
    assert dev.words(prepared, names, "x") == [xs[-1].data.ptr]
    assert dev.words(prepared, names, "y") == [ys[-1].data.ptr]
    assert dev.words(prepared, names, "freqs") == [f.data.ptr]
    assert dev.words(prepared, names, "start_positions") == [sp.data.ptr]
    assert all(y.shape == xs[0].shape and y.dtype == np.float16 and y.flags.c_contiguous for y in ys)
    assert len({y.data.ptr for y in ys}) == 3
    # in place: the hit's patched block is the block a fresh plan of the same arrays makes
    x = dev.array((3, 4, 2, 32), np.float16)
    for a in (dev.array((3, 4, 2, 32), np.float16), x):
        assert cupy_rope.apply_rope(a, f, "sbhd", start_positions=sp, out=a) is a
    hit_block = bytes(next(p for k, (p, _) in _launch._CACHE.items() if k[0][2] is False).buf)
    monkeypatch.setattr(_launch, "_CACHE", {})
    cupy_rope.apply_rope(x, f, "sbhd", start_positions=sp, out=x)
    (fresh, _), = _launch._CACHE.values()
    assert bytes(fresh.buf) == hit_block
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
    # with another device's context current, the launch runs inside that device's context
    entered = []

    class Device:
        def __init__(self, i):
            self.i = i

        def __enter__(self):
            entered.append(self.i)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(dev.driver, "ctxGetCurrent", lambda: 999)
    n = len(dev.driver.launched)
    cupy_rope.apply_rope(x, f, "sbhd", start_positions=sp)
    assert entered == [0] and len(dev.driver.launched) == n + 1


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

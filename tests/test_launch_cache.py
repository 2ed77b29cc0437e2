"""The public API's launch cache on the CPU (its GPU use is covered by the GPU suite): keys carry
every descriptor and the options with their types, a hit allocates the outputs like the inputs and
hands the prepared launch every address in the launch's name order, an output whose alignment
differs from the cached plan's is a miss."""

import numpy as np
import pytest

from cupy_rope import _api, _launch

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


def test_hit_allocates_and_patches_in_name_order(cpu_cache):
    q, k = torch.randn(4, 2, 3, 8), torch.randn(4, 2, 1, 8)
    f = torch.randn(16, 8)
    arrays = (q, k, f, None, None)
    key, ptrs = cpu_cache.cache_key("torch", ("qk", False), ("sbhd", False, 1, 0, False), arrays)
    prep = FakePrepared()
    # the qk launch's names: x, x2, freqs, cu_seqlens, start_positions, y, y2
    cpu_cache.cache_put(key, prep, [(0, q.shape, False, 0), (1, k.shape, False, 0)], tuple(range(7)))
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
    cpu_cache.cache_put(key, prep, [(0, x.shape, False, 8)], (0, 1, 2))  # cached plan saw an 8-byte offset
    before = dict(cpu_cache._STATS)
    assert cpu_cache.cached_call(key, ptrs, (x, f), "torch") is None
    assert not prep.calls and cpu_cache._STATS["hits"] == before["hits"]


def test_api_uses_the_cache_only_for_cuda_and_cupy_arrays():
    assert _launch.cache_kind(np.zeros(3)) is None
    assert _launch.cache_kind(torch.zeros(3)) is None  # CPU tensors: the NumPy backend
    assert set(_api.cache_info()) == {"hits", "misses", "size"}

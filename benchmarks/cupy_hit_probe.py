"""The CuPy launch-cache hit's own host cost, on the CPU (a development probe, not a benchmark of
record): the public API's call on CuPy arrays over fake device memory (the tests'
``FakeCupyDevice``), its hit served by the Python path and by the C++ path
(``csrc/cupy_launch.cpp``), with the driver's entry points replaced by C functions that do
nothing (built here) and a fake allocator, whose own cost is measured and reported apart.

    python benchmarks/cupy_hit_probe.py [--json J] [--calls N] [--rounds R]

On a GPU host the cost of a real call adds CuPy's allocation and the driver's launch
(``benchmarks/model.py --percall``: "cupy: cupy_rope.apply_rope").

    python benchmarks/cupy_hit_probe.py --gpu [--json J]

On a GPU: the decode call on real CuPy arrays, its C++ hit with parts of it replaced by stand-ins
(the allocation by a preallocated array, the stream query by a constant, the launch by a C
function that does nothing), the C++ function called directly (no public API layers), and
CuPy's allocation and stream query alone: where a real call's host time goes.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import sys
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import numpy as np  # noqa: E402

STUB_DRIVER = """
extern "C" { void* stub_ctx = reinterpret_cast<void*>(222); }
extern "C" int stub_ctx_get(void** c) { *c = stub_ctx; return 0; }
extern "C" int stub_launch(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                           void**) { return 0; }
"""


class _Patch:
    """monkeypatch's setattr/setitem, kept (the probe's process ends with it)."""

    def setattr(self, obj, name, value):
        setattr(obj, name, value)

    def setitem(self, d, key, value):
        d[key] = value


def _calls(cupy_rope, dev):
    f = dev.array((4096, 1, 1, 128), np.float32)
    sp = dev.array((64,), np.int32)
    x = dev.array((1, 64, 32, 128), np.float16)
    pos = dev.array((64,), np.int64)
    q, k = dev.array((64, 32 * 128), np.float16), dev.array((64, 8 * 128), np.float16)
    cache = dev.array((4096, 128), np.float32)
    return {
        "apply_rope, decode [1, 64, 32, 128], offsets": lambda: cupy_rope.apply_rope(x, f, start_positions=sp),
        "apply_rope_pos, 64 tokens 32q+8kv in place, cos/sin cache": lambda: cupy_rope.apply_rope_pos(
            pos, q, k, cos_sin_cache=cache, head_size=128, inplace=True),
    }


def _gpu_parts(a, median_us):
    """--gpu: the decode call's host µs on a GPU, whole and with its parts replaced."""
    import cupy

    import cupy_rope
    from cupy_rope import _cupy_ext, _cxx, _launch

    rng = np.random.default_rng(0)
    f = cupy.asarray(cupy_rope.rope_freqs(128, 4096))
    sp = cupy.asarray(rng.integers(0, 4095, 64).astype(np.int32))
    x = cupy.asarray(rng.uniform(-1, 1, (1, 64, 32, 128))).astype(cupy.float16)
    fixed = cupy.empty_like(x)
    stream = cupy.cuda.get_current_stream()
    stub = ctypes.CDLL(str(_cxx.shared_library("stub_driver", STUB_DRIVER, [["-O2", "-fPIC", "-shared"]])))
    stub_driver = [ctypes.cast(fn, ctypes.c_void_p).value for fn in (stub.stub_ctx_get, stub.stub_launch)] + [0]
    fast, entry_fn, configure_fn = _cupy_ext.functions(_cupy_ext.build())
    _launch.CUPY_EXT = (fast, functools.partial(_cupy_ext.entry, entry_fn))

    def call():
        return cupy_rope.apply_rope(x, f, start_positions=sp)

    def timed(fn):
        us = median_us(fn)
        stream.synchronize()
        return us

    head, opts = ("rope", False, True), ("sbhd", False, 1, 0, False)
    variants = {
        "whole call (C++ hit path)": {},
        "allocation replaced": dict(alloc=lambda shape, dtype: fixed),
        "stream query replaced": dict(stream=lambda d: stream),
        "allocation and stream query replaced": dict(alloc=lambda shape, dtype: fixed, stream=lambda d: stream),
    }
    rows = []
    for name, kw in variants.items():
        _cupy_ext.configure(configure_fn, **kw)
        _launch._CACHE.clear()
        call()
        call()
        rows.append(dict(part=name, us=timed(call)))
    _cupy_ext.configure(configure_fn)
    _launch._CACHE.clear()
    call()
    assert type(fast(_launch._CACHE, head, opts, (x, f, None, sp), 0)) is list  # a hit
    rows.append(dict(part="C++ fast function called directly", us=timed(
        lambda: fast(_launch._CACHE, head, opts, (x, f, None, sp), 0))))
    ctypes.c_void_p.in_dll(stub, "stub_ctx").value = cupy.cuda.driver.ctxGetCurrent()  # the entries' context
    _cupy_ext.configure(configure_fn, driver=stub_driver)
    _launch._CACHE.clear()
    call()
    rows.append(dict(part="launch replaced (ctx query and launch do nothing)", us=timed(call)))
    _cupy_ext.configure(configure_fn)
    rows.append(dict(part="cupy.ndarray(shape, dtype) alone", us=timed(lambda: cupy.ndarray(x.shape, x.dtype))))
    rows.append(dict(part="cupy.cuda.get_current_stream() alone", us=timed(cupy.cuda.get_current_stream)))
    for r in rows:
        print(f"{r['part']}: {r['us']:.2f} us")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(host=platform.processor() or platform.machine(), python=platform.python_version(),
                           calls=a.calls, rounds=a.rounds, rows=rows), fh, indent=1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gpu", action="store_true", help="real CuPy arrays on a GPU: the call's parts")
    a = ap.parse_args(argv)
    if a.gpu:
        return _gpu_parts(a, lambda fn: float(np.median(
            [timeit.timeit(fn, number=a.calls) / a.calls * 1e6 for _ in range(a.rounds)])))

    import cupy
    from test_launch_cache import FakeCupyDevice

    import cupy_rope
    from cupy_rope import _cupy_ext, _cxx, _launch

    dev = FakeCupyDevice(_Patch(), cupy)
    dev.driver.block_bytes = None  # record nothing
    dev.driver.launchKernel = lambda *args: None
    stub = ctypes.CDLL(str(_cxx.shared_library("stub_driver", STUB_DRIVER, [["-O2", "-fPIC", "-shared"]])))
    fast, entry_fn, configure_fn = _cupy_ext.functions(_cupy_ext.build())
    _cupy_ext.configure(configure_fn, alloc=lambda shape, dtype: dev.array(shape, dtype), stream=lambda d: 0xABC0,
                        driver=[ctypes.cast(fn, ctypes.c_void_p).value for fn in (stub.stub_ctx_get, stub.stub_launch)]
                        + [0])
    paths = {"python": None, "c++": (fast, functools.partial(_cupy_ext.entry, entry_fn))}

    def median_us(fn):
        return float(np.median([timeit.timeit(fn, number=a.calls) / a.calls * 1e6 for _ in range(a.rounds)]))

    alloc_us = median_us(lambda: dev.array((1, 64, 32, 128), np.float16))
    rows = []
    for name, call in _calls(cupy_rope, dev).items():
        per = {}
        for path, ext in paths.items():
            _launch.CUPY_EXT = ext
            call()
            call()
            per[path] = median_us(call)
        outputs = 0 if "in place" in name else 1
        rows.append(dict(call=name, python_us=per["python"], cpp_us=per["c++"], fake_allocations=outputs,
                         python_own_us=per["python"] - outputs * alloc_us, cpp_own_us=per["c++"] - outputs * alloc_us))
        print(f"{name}: Python path {per['python']:.2f} us, C++ path {per['c++']:.2f} us per call "
              f"({outputs} fake allocation(s) of {alloc_us:.2f} us each included)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(host=platform.processor() or platform.machine(), python=platform.python_version(),
                           fake_allocation_us=alloc_us, calls=a.calls, rounds=a.rounds, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()

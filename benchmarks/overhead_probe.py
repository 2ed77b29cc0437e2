"""Where the host time of a call goes (a development probe, not a benchmark of record).

    python benchmarks/overhead_probe.py [micro,dispatch,cpp,cprofile,model]
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import cupy_rope  # noqa: E402
import cupy_rope.torch as crt  # noqa: E402
from cupy_rope import _interop, _launch  # noqa: E402


def us(fn, calls=300, rounds=7):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t) / calls * 1e6)
    return float(np.median(res))


s, b, h, d = 1, 64, 32, 128
f = cupy_rope.rope_freqs(d, 4096, like=torch.empty(0, device="cuda"))
sp = torch.randint(0, 4000, (b,), device="cuda", dtype=torch.int32)
x = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(s, b, 8, d, device="cuda", dtype=torch.bfloat16)
what = sys.argv[1].split(",") if len(sys.argv) > 1 else ["micro", "dispatch", "cpp", "cprofile", "model"]


def row(name, v):
    print(f"{name:60s} {v:8.2f} us", flush=True)


if "micro" in what:
    print("== micro")
    row("empty", us(lambda: None))
    row("torch.empty_like(x, contiguous)", us(lambda: torch.empty_like(x, memory_format=torch.contiguous_format)))
    row("torch.empty(shape, dtype, device)", us(lambda: torch.empty((1, 64, 32, 128), dtype=x.dtype, device=x.device)))
    row("_cuda_getCurrentRawStream", us(lambda: torch._C._cuda_getCurrentRawStream(0)))
    row("x.data_ptr()", us(lambda: x.data_ptr()))
    row("(x.shape, x.stride(), x.dtype, x.get_device())", us(lambda: (x.shape, x.stride(), x.dtype, x.get_device())))
    row("cache_key(torch, 4 arrays)", us(lambda: _launch.cache_key("torch", ("rope", False, True),
                                                                     ("sbhd", False, 1, 0, False), (x, f, None, sp))))
    from cupy.cuda import driver
    row("driver.ctxGetCurrent()", us(lambda: driver.ctxGetCurrent()))
    row("torch.compiler.is_compiling()", us(lambda: torch.compiler.is_compiling()))
    row("_plain_cuda(x)", us(lambda: crt._plain_cuda(x)))
    row("torch.is_grad_enabled()+requires_grad", us(lambda: crt._needs_grad(x, k)))
    row("cupy_rope.apply_rope (plain)", us(lambda: cupy_rope.apply_rope(x, f, start_positions=sp)))
    row("_api._rope direct", us(lambda: cupy_rope._api._rope(x, f, "sbhd", False, None, sp, 1, 0, None, False, False, "x")))
    row("crt.apply_rope", us(lambda: crt.apply_rope(x, f, start_positions=sp)))
    row("crt.apply_rope_qk", us(lambda: crt.apply_rope_qk(x, k, f, start_positions=sp)))
    row("torch.ops.cupy_rope._rope_qk_impl", us(lambda: torch.ops.cupy_rope._rope_qk_impl.default(
        x, k, f, "sbhd", False, None, sp, 1, 0, False)))
    key, ptrs = _launch.cache_key("torch", ("rope", False, True), ("sbhd", False, 1, 0, False), (x, f, None, sp))
    cupy_rope.apply_rope(x, f, start_positions=sp)
    prepared = None
    for kk, (p, outs) in _launch._CACHE.items():
        if kk[0][0] == "rope":
            prepared = p
    y = torch.empty_like(x)
    addrs = [x.data_ptr(), f.data_ptr(), 0, sp.data_ptr(), y.data_ptr()]
    row("Prepared.__call__ (patch + launch)", us(lambda: prepared(torch._C._cuda_getCurrentRawStream(0), addrs)))
    row("driver.launchKernel only", us(lambda: driver.launchKernel(prepared.fptr, prepared.grid[0], 1, 1, prepared.block, 1, 1, 0,
                                                               0, __import__("ctypes").addressof(prepared.argv), 0)))
    row("torch formula (4 ops)", us(lambda: x * x + torch.cat([-x[..., 64:], x[..., :64]], -1) * x))
    row("torch x.mul(2) (one kernel)", us(lambda: x.mul(2)))

    from cupy_rope import _torch_ext
    print("C++ launch path loaded:", _torch_ext.loaded(), _torch_ext.info())

if "dispatch" in what:
    print("== dispatch")
    lib = torch.library.Library("probe", "DEF")
    lib.define("full(Tensor x, Tensor freqs, str layout, bool interleaved, Tensor? cu, Tensor? sp, int a, int b, bool c, bool d) -> Tensor")
    lib.define("simple(Tensor x) -> Tensor")
    lib.define("two(Tensor x, Tensor y) -> (Tensor, Tensor)")
    lib.impl("full", lambda x, *a: x, "CUDA")
    lib.impl("simple", lambda x: x, "CUDA")
    lib.impl("two", lambda x, y: (x, y), "CUDA")
    full, simple, two = torch.ops.probe.full.default, torch.ops.probe.simple.default, torch.ops.probe.two.default
    row("python op, our schema, noop", us(lambda: full(x, f, "sbhd", False, None, sp, 1, 0, False, False)))
    row("python op, (Tensor)->Tensor, noop", us(lambda: simple(x)))
    row("python op, 2 in 2 out, noop", us(lambda: two(x, k)))
    row("python op via torch.ops.probe.simple (no .default)", us(lambda: torch.ops.probe.simple(x)))
    row("python op full, under no_grad", us(lambda: torch.no_grad()(lambda: full(x, f, "sbhd", False, None, sp, 1, 0, False, False))()))
    row("aten::alias (C++ op noop)", us(lambda: torch.ops.aten.alias.default(x)))

if "cpp" in what:
    print("== cpp extension")
    import shutil
    import torch.utils.cpp_extension as ce
    print("ninja", shutil.which("ninja"), "g++", shutil.which("g++"), "CUDA_HOME", ce.CUDA_HOME)
    import glob
    print("nvidia include dirs", glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "include"))[:8])
    print("cuda_runtime_api.h", glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**", "cuda_runtime_api.h"), recursive=True)[:3])
    src = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor cpp_noop(const at::Tensor& x) { return x; }
at::Tensor cpp_empty(const at::Tensor& x) { return at::empty_like(x, at::MemoryFormat::Contiguous); }
TORCH_LIBRARY(probecpp, m) { m.def("noop(Tensor x) -> Tensor"); m.def("empty(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(probecpp, CUDA, m) { m.impl("noop", cpp_noop); m.impl("empty", cpp_empty); }
"""
    t = time.time()
    try:
        ce.load_inline("probecpp", cpp_sources=[src], is_python_module=False, verbose=False,
                       build_directory=None, extra_cflags=["-O2"])
        print(f"load_inline compiled in {time.time() - t:.1f} s")
        row("C++ op noop", us(lambda: torch.ops.probecpp.noop.default(x)))
        row("C++ op empty_like", us(lambda: torch.ops.probecpp.empty.default(x)))
    except Exception as e:
        print("load_inline failed", type(e).__name__, str(e)[-2000:])
    src2 = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
int64_t cs(const at::Tensor& x) { return (int64_t)c10::cuda::getCurrentCUDAStream(x.get_device()).stream(); }
TORCH_LIBRARY(probecuda, m) { m.def("cs(Tensor x) -> int"); }
TORCH_LIBRARY_IMPL(probecuda, CUDA, m) { m.impl("cs", cs); }
"""
    t = time.time()
    try:
        ce.load_inline("probecuda", cpp_sources=[src2], is_python_module=False, verbose=False, with_cuda=True,
                       extra_cflags=["-O2"])
        print(f"load_inline with c10/cuda compiled in {time.time() - t:.1f} s")
        row("C++ op current stream", us(lambda: torch.ops.probecuda.cs.default(x)))
    except Exception as e:
        print("load_inline (cuda headers) failed", type(e).__name__, str(e)[-1500:])

if "cprofile" in what:
    print("== cprofile")
    import cProfile
    import pstats
    for name, fn in (("crt.apply_rope_qk", lambda: crt.apply_rope_qk(x, k, f, start_positions=sp)),
                     ("_rope_qk_impl op", lambda: torch.ops.cupy_rope._rope_qk_impl.default(x, k, f, "sbhd", False, None, sp, 1, 0, False))):
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3000):
            fn()
        pr.disable()
        print("----", name)
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)

if "model" in what:
    print("== model profiles")
    import torch._logging
    torch._logging.set_logs(perf_hints=True, cudagraphs=True)
    from torch.profiler import ProfilerActivity, profile
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import model as M
    for mode in os.environ.get("PROBE_MODES", "compile,reduce-overhead").split(","):
        for kind in os.environ.get("PROBE_KINDS", "infer,train").split(","):
            for variant in ("formula", "cupy_rope"):
                step, sync = M._torch_step(M.CONFIGS["prefill"], variant, mode, kind)
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(20):
                    step()
                torch.cuda.synchronize()
                ms = (time.perf_counter() - t) / 20 * 1e3
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step()
                    torch.cuda.synchronize()
                print(f"---- {mode} {kind} {variant}: {ms:.3f} ms/step")
                ka = prof.key_averages()
                print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=70))
                print(ka.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=70))

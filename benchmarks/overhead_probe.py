"""Where the host time of a call goes (a development probe, not a benchmark of record).

    python benchmarks/overhead_probe.py [micro,dispatch,cprofile,model,split,impl]

micro: the pieces of an eager call at the decode shape; dispatch: a dispatcher trip into a Python
kernel by schema; cprofile: the eager hot paths; model: torch.profiler tables of the model
benchmark's compiled steps (PROBE_MODES, PROBE_KINDS, PROBE_CONFIGS), with the CUDA-graph-tree log;
split: the model's steps timed as host enqueue and whole step, with more variants: cupy_rope's
op called directly, an opaque no-op custom op and (infer) q and k rotated in place (same
environment variables, PROBE_ROUNDS, and PROBE_CPROFILE=1 for cProfile tables; not in the default
list); impl: the autograd-free op's call as Inductor makes it, against torch.empty_like (not in
the default list).
"""
from __future__ import annotations

import itertools
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
what = sys.argv[1].split(",") if len(sys.argv) > 1 else ["micro", "dispatch", "cprofile", "model"]


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
    for kk, (p, *_) in _launch._CACHE.items():
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
    for cfg, mode, kind in itertools.product(os.environ.get("PROBE_CONFIGS", "prefill").split(","),
                                             os.environ.get("PROBE_MODES", "compile,reduce-overhead").split(","),
                                             os.environ.get("PROBE_KINDS", "infer,train").split(",")):
        for variant in ("formula", "cupy_rope"):
            step, sync = M._torch_step(M.CONFIGS[cfg], variant, mode, kind)
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
            print(f"---- {cfg} {mode} {kind} {variant}: {ms:.3f} ms/step")
            ka = prof.key_averages()
            print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=70))
            print(ka.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=70))

if "split" in what:
    # The compiled steps split into host enqueue time (the step returns) and the whole step (then
    # synchronised), per variant, their rounds interleaved.
    print("== split (ms per step: enqueue, step+sync, 10 back-to-back)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import model as M

    def _outputs(q, k):
        return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)

    @torch.library.custom_op("probe::noop_qk", mutates_args=())
    def _noop_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _outputs(q, k)

    _noop_qk.register_fake(_outputs)

    _IMPL = torch.ops.cupy_rope._rope_qk_impl.default
    # the op called directly (no cupy_rope Python traced), and an opaque no-op op (any custom op's cost)
    M.PROBE_ROPES.update(op_direct=lambda f, sp: lambda q, k: _IMPL(q, k, f, "bshd", False, None, sp, 1, 0, False),
                         noop=lambda f, sp: lambda q, k: _noop_qk(q, k))
    # q and k rotated in place in the projection (inference only: in place is not differentiable;
    # Inductor re-inplaces the op on the projection's buffer: no outputs to allocate)
    M.PROBE_ROPES["inplace"] = lambda f, sp: lambda q, k: crt.apply_rope_qk(q, k, f, "bshd", start_positions=sp,
                                                                            inplace=True)
    for cfg, mode, kind in itertools.product(os.environ.get("PROBE_CONFIGS", "decode").split(","),
                                             os.environ.get("PROBE_MODES", "compile").split(","),
                                             os.environ.get("PROBE_KINDS", "infer").split(",")):
        torch._dynamo.reset()
        steps = {}
        for variant in (*M.VARIANTS["torch"], *(v for v in M.PROBE_ROPES if kind == "infer" or v != "inplace")):
            steps[variant], _ = M._torch_step(M.CONFIGS[cfg], variant, mode, kind, reset=False)
            for _ in range(5):
                steps[variant]()
        torch.cuda.synchronize()
        res = {v: ([], [], []) for v in steps}
        if os.environ.get("PROBE_NO_GC"):
            import gc

            gc.collect()
            gc.disable()
        for r in range(int(os.environ.get("PROBE_ROUNDS", "15"))):
            for v in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
                t0 = time.perf_counter()
                steps[v]()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                for _ in range(10):
                    steps[v]()
                torch.cuda.synchronize()
                t3 = time.perf_counter()
                for lst, val in zip(res[v], (t1 - t0, t2 - t0, (t3 - t2) / 10)):
                    lst.append(val * 1e3)
        for v, (enq, one, ten) in res.items():
            print(f"{cfg} {mode} {kind} {v:10s} enqueue {np.median(enq):.3f}  step+sync {np.median(one):.3f}  "
                  f"back-to-back {np.median(ten):.3f}", flush=True)
        if os.environ.get("PROBE_CPROFILE"):  # the Python functions of 20 steps of each variant
            import cProfile
            import pstats

            for v, fn in steps.items():
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(20):
                    fn()
                pr.disable()
                torch.cuda.synchronize()
                print(f"---- cProfile {cfg} {mode} {kind} {v}: 20 steps")
                pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(25)

if "impl" in what:
    # The autograd-free op called as Inductor's output code calls it (q and k views of one qkv
    # projection, no grad; the library registers a fallthrough at its autograd keys: the
    # seventeenth session measured torch's autograd fallback there at 11.64 against 11.01 us).
    print("== impl (us per call of torch.ops.cupy_rope._rope_qk_impl.default, decode views)")
    qkv = torch.randn(b, 1, 3, h, d, device="cuda", dtype=torch.bfloat16)
    qv, kv = qkv[:, :, 0], qkv[:, :, 1]
    impl = torch.ops.cupy_rope._rope_qk_impl.default
    with torch.no_grad():
        def call():
            return impl(qv, kv, f, "bshd", False, None, sp, 1, 0, False)
        ref = lambda: torch.empty_like(qv)  # noqa: E731 (the host's speed)
        row("_rope_qk_impl", float(np.median([us(call, calls=2000) for _ in range(3)])))
        row("torch.empty_like", us(ref, calls=2000))

"""Decode-shape probe: where the rope kernel's device time goes on a tiny launch.

Times, in CUDA-graph replay (``graph_time``), the library's decode launch (bshd [64, 1, 32, 128]
bf16, per-sequence start positions: the one-row kernel), the streaming kernel on the same call,
minimal hand-written kernels doing the same arithmetic (``dec_*``: a floor for this data flow;
``dec_fast`` uses the inexact ``__sincosf``), the positions API on the same rows with a bf16 cos/sin
cache (the one-row cache kernel) against a minimal cache kernel (``dec_cache``), the one-row cache
kernel compiled with other entry points (with and without programmatic dependent launch: the
kernel waits for the previous grid, ``griddepcontrol``, and is launched by ``cuLaunchKernelEx``
with the programmatic stream serialization attribute) on x alone and on the serving row's q + k in
place, minimal and empty kernels with and without it, and a copy of the same bytes; each with the
L2 warm
(the launch repeated) and cold (a 256 MB write before each launch, as a model's weight-streaming
GEMM leaves it: the kernel's code and table come from memory). Development tool:
``python benchmarks/decode_probe.py [--json F]``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_MIN_SRC = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned pk(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return (unsigned)__bfloat16_as_ushort(h.x) | ((unsigned)__bfloat16_as_ushort(h.y) << 16);
}
// bshd [B, 1, H, 128] bf16; one thread: 8 pairs (channels u*8.. and 64 + u*8..) of one row.
template <int XFIRST, int FAST, int LOOP = 0>
__device__ __forceinline__ void body(const unsigned short* x, unsigned short* y, const float* freqs,
                                     const int* sp, int B, int H) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int u = i & 7, h = (i >> 3) % H, b = (i >> 3) / H;
  if (b >= B) return;
  const long long off = (long long)b * H * 128 + h * 128 + u * 8;
  uint4 a0, a1;
  if (XFIRST) { a0 = *(const uint4*)(x + off); a1 = *(const uint4*)(x + off + 64); }
  const long long pos = sp[b];
  const float4 f0 = *(const float4*)(freqs + pos * 128 + u * 8);
  const float4 f1 = *(const float4*)(freqs + pos * 128 + u * 8 + 4);
  const float ang[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
  float c[8], s[8];
  if (LOOP) {
    float ts[8], tc[8];
#pragma unroll 1
    for (int m = 0; m < 8; ++m) sincosf(ang[m], &ts[m], &tc[m]);
#pragma unroll
    for (int m = 0; m < 8; ++m) s[m] = ts[m], c[m] = tc[m];
  } else
#pragma unroll
  for (int m = 0; m < 8; ++m) { if (FAST) __sincosf(ang[m], &s[m], &c[m]); else sincosf(ang[m], &s[m], &c[m]); }
  if (!XFIRST) { a0 = *(const uint4*)(x + off); a1 = *(const uint4*)(x + off + 64); }
  unsigned w0[4] = {a0.x, a0.y, a0.z, a0.w}, w1[4] = {a1.x, a1.y, a1.z, a1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float p0 = lo(w0[j]), p1 = hi(w0[j]), q0 = lo(w1[j]), q1 = hi(w1[j]);
    const int m0 = 2 * j, m1 = 2 * j + 1;
    float r0 = p0 * c[m0] - q0 * s[m0], r1 = p1 * c[m1] - q1 * s[m1];
    float t0 = q0 * c[m0] + p0 * s[m0], t1 = q1 * c[m1] + p1 * s[m1];
    w0[j] = pk(r0, r1); w1[j] = pk(t0, t1);
  }
  *(uint4*)(y + off) = make_uint4(w0[0], w0[1], w0[2], w0[3]);
  *(uint4*)(y + off + 64) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
}
// The same rotation with cos/sin read from a bf16 cache [rows, 128] (cos in columns 0..63, sin
// in 64..127) at the sequence's position: no sincosf (the positions API's cache path).
__device__ __forceinline__ void body_cache(const unsigned short* x, unsigned short* y, const unsigned short* cs,
                                           const int* sp, int B, int H) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const int u = i & 7, h = (i >> 3) % H, b = (i >> 3) / H;
  if (b >= B) return;
  const long long off = (long long)b * H * 128 + h * 128 + u * 8;
  const uint4 a0 = *(const uint4*)(x + off), a1 = *(const uint4*)(x + off + 64);
  const long long row = (long long)sp[b] * 128 + u * 8;
  const uint4 cq = *(const uint4*)(cs + row), sq = *(const uint4*)(cs + row + 64);
  const unsigned cw[4] = {cq.x, cq.y, cq.z, cq.w}, sw[4] = {sq.x, sq.y, sq.z, sq.w};
  unsigned w0[4] = {a0.x, a0.y, a0.z, a0.w}, w1[4] = {a1.x, a1.y, a1.z, a1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float c0 = lo(cw[j]), c1 = hi(cw[j]), s0 = lo(sw[j]), s1 = hi(sw[j]);
    const float p0 = lo(w0[j]), p1 = hi(w0[j]), q0 = lo(w1[j]), q1 = hi(w1[j]);
    w0[j] = pk(p0 * c0 - q0 * s0, p1 * c1 - q1 * s1);
    w1[j] = pk(q0 * c0 + p0 * s0, q1 * c1 + p1 * s1);
  }
  *(uint4*)(y + off) = make_uint4(w0[0], w0[1], w0[2], w0[3]);
  *(uint4*)(y + off + 64) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
}
#define DEC_KERNEL(NAME, TABLE, BODY)                                                                  \
  extern "C" __global__ void __launch_bounds__(256) NAME(const unsigned short* x, unsigned short* y, \
                                                         const TABLE* t, const int* sp, int B, int H) { \
    BODY(x, y, t, sp, B, H);                                                                        \
  }
DEC_KERNEL(dec_cache, unsigned short, body_cache)
// Programmatic dependent launch: wait for the previous grid (a no-op when launched without the
// attribute), then let the next one launch at once.
__device__ __forceinline__ void pdl_enter() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
}
__device__ __forceinline__ void body_cache_pdl(const unsigned short* x, unsigned short* y, const unsigned short* cs,
                                               const int* sp, int B, int H) {
  pdl_enter();
  body_cache(x, y, cs, sp, B, H);
}
__device__ __forceinline__ void body_empty(const unsigned short*, unsigned short*, const unsigned short*,
                                           const int*, int, int) {}
__device__ __forceinline__ void body_empty_pdl(const unsigned short*, unsigned short*, const unsigned short*,
                                               const int*, int, int) { pdl_enter(); }
DEC_KERNEL(dec_cache_pdl, unsigned short, body_cache_pdl)
DEC_KERNEL(dec_empty, unsigned short, body_empty)
DEC_KERNEL(dec_empty_pdl, unsigned short, body_empty_pdl)
DEC_KERNEL(dec_min, float, (body<0, 0>))
DEC_KERNEL(dec_xfirst, float, (body<1, 0>))
DEC_KERNEL(dec_loop, float, (body<1, 0, 1>))
DEC_KERNEL(dec_fast, float, (body<1, 1>))
"""


def launcher_ex(fptr, grid, block, args, pdl, argv=None):
    """A ``cuLaunchKernelEx`` launch of ``fptr`` with ctypes ``args`` (or the prepared kernel
    parameter array ``argv``), with the programmatic stream serialization attribute when ``pdl``
    (the launch layer's structs and driver entry, ``cupy_rope._launch``): ``launch(stream)``."""
    from cupy_rope import _launch

    gx, gy = grid if isinstance(grid, tuple) else (grid, 1)
    fn = _launch._launch_ex()
    attr = _launch._LaunchAttribute(id=_launch._PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    cfg = _launch._LaunchConfig((gx, gy, 1), (block, 1, 1), 0, None, ctypes.pointer(attr), 1 if pdl else 0)
    if argv is None:
        argv = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))

    def launch(stream, cfg=cfg, argv=argv, keep=(attr, args)):
        cfg.stream = stream
        rc = fn(ctypes.addressof(cfg), fptr, ctypes.addressof(argv), None)
        if rc:
            raise RuntimeError(f"cuLaunchKernelEx: CUresult {rc}")
    return launch


# Variants of the library's kernels, compiled from its source with other entry-point macros (the
# source's CUPY_ROPE_ENTRY / CUPY_ROPE_ENTRY_PAIR are defined only when not defined before it).
_PDL_ENTER = "cupy_rope::await_previous_grid();"  # the library's wait + trigger, here at entry
_ENTRY = r"""
#define CUPY_ROPE_ENTRY(NAME, PARAMS, BODY, MIN_BLOCKS) \
  extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(const PARAMS p) { %(pre)s BODY(p, blockIdx.x); }
#define CUPY_ROPE_ENTRY_PAIR(NAME, PARAMS, BODY, MIN_BLOCKS) \
  extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(const PARAMS p0, const PARAMS p1) { \
    %(pre)s %(body)s }
"""
_PAIR = "unsigned blk; if (cupy_rope::first_part(p0.blocks, blockIdx.x, blk)) { BODY(p0, blk); } else { BODY(p1, blk); }"
_VARIANTS = {  # label: entry-point parts; launched with the PDL attribute when the label says so
    "launched without PDL": dict(pre="", body=_PAIR),
    "PDL (the library's)": dict(pre="", body=_PAIR),  # the body waits after its index arithmetic
    "PDL, waiting at entry": dict(pre=_PDL_ENTER, body=_PAIR),
    "PDL, waiting at entry, no early trigger": dict(pre='asm volatile("griddepcontrol.wait;" ::: "memory");',
                                                    body=_PAIR),
}


def variant_launchers(prep, name):
    """(label, launch(stream)) of each entry-point variant of kernel ``name``, with the prepared
    launch's parameter blocks; the PDL variants launched with the attribute."""
    import cupy

    from cupy_rope import _kernels, _launch

    out = []
    for label, parts in _VARIANTS.items():
        src = _ENTRY % parts + _kernels.source_for([name])
        k = cupy.RawModule(code=src, options=_launch._options()).get_function(name)
        fptr = getattr(k, "kernel", k).ptr
        pdl = "PDL" in label and "without" not in label
        out.append((label, launcher_ex(fptr, prep.grid, prep.block, None, pdl, argv=prep.argv), k))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import cupy
    import numpy as np
    import torch

    import cupy_rope
    from cupy_rope import _launch, _worksplit
    from cupy_rope._dev.benchmark import copy_time, graph_time

    dev = "cuda"
    B, H, D, n, n_cold = 64, 32, 128, 400, 60
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.empty(B, 1, H, D, dtype=torch.bfloat16, device=dev).uniform_(-1, 1, generator=g)
    sp = torch.randint(0, 4000, (B,), dtype=torch.int32, device=dev, generator=g)
    f = cupy_rope.rope_freqs(D, 4096, like=torch.empty(0, device=dev))
    ref = cupy_rope.apply_rope(x, f, "bshd", start_positions=sp)
    flush_buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # > L2

    def flush():
        flush_buf.zero_()

    t_flush = graph_time([flush] * n_cold)
    out = {"shape": [B, 1, H, D], "flush_us": t_flush, "times": {}}

    def record(label, fn, **extra):
        fns = [step for _ in range(n_cold) for step in (flush, fn)]
        r = dict(extra, us=graph_time([fn] * n), cold_us=graph_time(fns) * 2 - t_flush)
        out["times"][label] = r
        print(label, r, flush=True)

    # the positions API on the same rows with a bf16 cos/sin cache (the serving path): rope1c
    cache = cupy_rope.rope_cos_sin_cache(D, 4096, dtype="bfloat16", like=torch.empty(0, device=dev))
    pos = sp.long()[:, None]  # [B, 1]: the token of each sequence
    _worksplit._ONE_ROW = False
    ref_cache = cupy_rope.apply_rope_pos(pos, x, None, cos_sin_cache=cache)[0]  # the streaming kernel
    cases = (("library (one-row kernel)", True, lambda: cupy_rope.apply_rope(x, f, "bshd", start_positions=sp), ref),
             ("streaming kernel", False, lambda: cupy_rope.apply_rope(x, f, "bshd", start_positions=sp), ref),
             ("library, cos/sin cache (one-row kernel)", True,
              lambda: cupy_rope.apply_rope_pos(pos, x, None, cos_sin_cache=cache)[0], ref_cache))
    for label, one_row, call, want in cases:
        _worksplit._ONE_ROW = one_row
        _launch._CACHE.clear()
        y = call()  # planned afresh
        prep = list(_launch._CACHE.values())[-1][0]  # its prepared launch, writing y
        name = next(k for (_, k), v in _launch._functions.items() if v[1] == prep.fptr)

        def run(prep=prep):
            prep(torch.cuda.current_stream().cuda_stream, ())

        record(label, run, kernel=name, grid=list(prep.grid), exact=bool(torch.equal(want, y)))
    _worksplit._ONE_ROW = True

    # entry-point variants of the one-row cache kernel: x alone and the serving row's q + k in place
    qk = torch.empty(B, 1, H + 8, D, dtype=torch.bfloat16, device=dev).uniform_(-1, 1, generator=g)
    q0, k0 = qk[:, :, :H].clone(), qk[:, :, H:].clone()
    qk_calls = (("x", lambda: cupy_rope.apply_rope_pos(pos, x, None, cos_sin_cache=cache)[0], None),
                ("q+k in place", lambda: cupy_rope.apply_rope_pos(pos, qk[:, :, :H], qk[:, :, H:], cos_sin_cache=cache,
                                                                  inplace=True), qk))
    for what, call, buf in qk_calls:
        _launch._CACHE.clear()
        res = call()
        got = res if buf is None else buf  # what the prepared launch writes
        want = got.clone()
        prep = list(_launch._CACHE.values())[-1][0]
        name = next(k for (_, k), v in _launch._functions.items() if v[1] == prep.fptr)
        for label, go, _k in variant_launchers(prep, name):
            if buf is not None:
                qk[:, :, :H], qk[:, :, H:] = q0, k0
            else:
                got.zero_()
            go(torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()

            def run(go=go):
                go(torch.cuda.current_stream().cuda_stream)
            record(f"rope1c {what}: {label}", run, kernel=name, grid=list(prep.grid),
                   exact=bool(torch.equal(want, got)))

    mod = cupy.RawModule(code=_MIN_SRC, options=("--std=c++17",))
    ys = torch.empty_like(x)
    for kname, table, want in (("dec_min", f, ref), ("dec_xfirst", f, ref), ("dec_loop", f, ref), ("dec_fast", f, ref),
                               ("dec_cache", cache, ref_cache)):
        k = mod.get_function(kname)

        def run(k=k, table=table):
            st = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            k((B * H * 8 // 256,), (256,), (x.data_ptr(), ys.data_ptr(), table.data_ptr(), sp.data_ptr(),
                                             np.int32(B), np.int32(H)), stream=st)
        run()
        torch.cuda.synchronize()
        record(kname, run, max_err_vs_library=float((ys.float() - want.float()).abs().max()))
    # programmatic dependent launch (cuLaunchKernelEx): the same cache kernel and an empty kernel,
    # each with and without the attribute (the kernel waits for the previous grid first)
    for kname, want in (("dec_cache", ref_cache), ("dec_cache_pdl", ref_cache), ("dec_empty", None),
                        ("dec_empty_pdl", None)):
        k = mod.get_function(kname)
        kargs = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(ys.data_ptr()), ctypes.c_void_p(cache.data_ptr()),
                ctypes.c_void_p(sp.data_ptr()), ctypes.c_int(B), ctypes.c_int(H)]
        for pdl in (False, True):
            go = launcher_ex(getattr(k, "kernel", k).ptr, B * H * 8 // 256, 256, kargs, pdl)

            def run(go=go):
                go(torch.cuda.current_stream().cuda_stream)
            ys.zero_()
            run()
            torch.cuda.synchronize()
            extra = {} if want is None else dict(max_err_vs_library=float((ys.float() - want.float()).abs().max()))
            record(f"{kname} (cuLaunchKernelEx{', PDL' if pdl else ''})", run, **extra)
    nbytes = 2 * x.numel() * 2 + B * D * 4
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    record("copy (cudaMemcpy)", lambda: dst.copy_(src), best_copy_us=copy_time(nbytes, 1, [0] * n)[0])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Copy kernels with the rope kernels' access patterns, timed against each other (H200 probe).

Question: does the order in which the streaming rope kernel visits memory (every resident thread
on its own token, stepping through that token's heads, so the resident grid touches a slice of
every token at once) cost DRAM efficiency against a copy whose resident threads sweep a compact
window? Each kernel copies the same bytes of a ``[tokens, heads, d]`` bf16 tensor with 16-byte
vectors, two per thread and row (the rope unit: vectors u and u + d/16), and the result is
checked. Prints device us per kernel (CUDA events over a CUDA-graph of ``--reps`` launches).

``--rope`` (d a multiple of 16): also rotations in the same tensors written lean, in the peers' shape (one or
R rows of a token per thread, cos/sin computed per thread, shared in a block or a warp, or read
from a float32 cos/sin table made by a separate kernel), and cupy_rope's own call on them (as the
library's split picks; ``--tune`` as ``benchmarks/run.py`` takes it), each checked against a
float32 rotation. Results and what they say: ``benchmarks/NOTES.md`` (sixteenth session).

Added in the twenty-fifth session, for the question whether an angle table turned into a cos/sin
table once per call beats ``sincosf`` per thread (issue 14's lead):
- ``rowsR_sincos, both angles``: R rows per thread that also load each pair's second angle and
  compare it (a second ``sincosf`` where it differs), one pair at a time in the packed words: the
  library's lean kernel's work for any table, against ``rowsR_sincos``'s standard-table shortcut.
- ``rowsR_csW``: R rows per thread reading a cos/sin table of W values per pair (W = 1: one
  (cos, sin) per pair, enough for standard tables; W = 2: (cos, sin) of both angles, any table),
  timed with the table made once outside the timing, after a prologue kernel that makes it
  (``csW + rowsR_csW``), and as a programmatic dependent launch after the prologue (``(PDL)``:
  the prologue lets the main kernel start at once, and the main kernel loads its rows before it
  waits for the table).

Added in the twenty-sixth session: ``rowsR_sincos, angles first`` (and ``both angles, angles
first``): the same with the unit's angles loaded in 16-byte vectors before any ``sincosf``. The
loop's per-pair loads wait for the previous pair's ``sincosf`` (the compiler does not hoist a load
above its slow path's branches: one round trip to the table per pair, where these take one).
On an H100 neither this nor the cos/sin-table variants beat ``rowsR_sincos`` (NOTES.md,
twenty-sixth session). A variant whose check fails is reported and not timed; the others still run.

    python benchmarks/access_probe.py [--tokens 8192 --heads 32 --d 128] [--json F]
    python benchmarks/access_probe.py --rope [--tokens 16384 --heads 8 --positions 8192 --pdiv 1]
"""

from __future__ import annotations

import argparse
import json
import sys

SRC = r"""
extern "C" __global__ void lin(const uint4* __restrict__ x, uint4* __restrict__ y, long long rows, int hu) {
  // one unit of one row per thread, units fastest: a compact window
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  long long r = i / hu; int u = (int)(i % hu);
  if (r >= rows) return;
  const uint4* p = x + r * 2 * hu + u; uint4* q = y + r * 2 * hu + u;
  uint4 a = p[0], b = p[hu];
  q[0] = a; q[hu] = b;
}
// The streaming kernel's order: thread (token, chunk c, unit u) copies heads c, c + C, ...
// DEPTH rows in flight (loads first, then stores).
template <int DEPTH>
__device__ void stream_impl(const uint4* __restrict__ x, uint4* __restrict__ y, long long tok, int heads,
                            int C, int hu, int contig) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  int u = (int)(i % hu); long long rest = i / hu; int c = (int)(rest % C); long long t = rest / C;
  if (t >= tok) return;
  const int per = (heads + C - 1) / C;
  int cnt = contig ? min(per, heads - c * per) : (heads - c + C - 1) / C;
  int h0 = contig ? c * per : c, hs = contig ? 1 : C;
  const long long rs = 2 * hu;
  const uint4* p = x + (t * heads + h0) * rs + u; uint4* q = y + (t * heads + h0) * rs + u;
  for (int k = 0; k < cnt; k += DEPTH) {
    uint4 a[DEPTH], b[DEPTH];
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) if (k + j < cnt) { a[j] = p[(long long)(k + j) * hs * rs]; b[j] = p[(long long)(k + j) * hs * rs + hu]; }
#pragma unroll
    for (int j = 0; j < DEPTH; ++j) if (k + j < cnt) { q[(long long)(k + j) * hs * rs] = a[j]; q[(long long)(k + j) * hs * rs + hu] = b[j]; }
  }
}
extern "C" __global__ void stream4(const uint4* x, uint4* y, long long tok, int heads, int C, int hu, int contig) {
  stream_impl<4>(x, y, tok, heads, C, hu, contig);
}
// Grid-stride over (row, unit) with the same threads as the streaming launch: the resident grid
// sweeps a compact window.
extern "C" __global__ void gstride4(const uint4* __restrict__ x, uint4* __restrict__ y, long long n, int hu) {
  long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x, step = (long long)gridDim.x * blockDim.x;
  for (long long i = i0; i < n; i += 4 * step) {
    uint4 a[4], b[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) { long long g = i + j * step; if (g < n) { long long r = g / hu; int u = (int)(g % hu);
      a[j] = x[r * 2 * hu + u]; b[j] = x[r * 2 * hu + u + hu]; } }
#pragma unroll
    for (int j = 0; j < 4; ++j) { long long g = i + j * step; if (g < n) { long long r = g / hu; int u = (int)(g % hu);
      y[r * 2 * hu + u] = a[j]; y[r * 2 * hu + u + hu] = b[j]; } }
  }
}
// Tokens in a persistent loop: a block of (heads x units) threads takes token b, b + G, ... and
// each thread its (head, unit) of it; the resident grid sweeps a compact window of tokens.
extern "C" __global__ void tokloop(const uint4* __restrict__ x, uint4* __restrict__ y, long long tok, int heads, int hu) {
  int per = heads * hu;  // threads per token
  int tpb = blockDim.x / per;  // tokens per block step
  int lt = threadIdx.x / per, w = threadIdx.x % per; int h = w / hu, u = w % hu;
  if (lt >= tpb) return;
  const long long rs = 2 * hu;
  for (long long t0 = (long long)blockIdx.x * tpb; t0 < tok; t0 += 2LL * gridDim.x * tpb) {
    long long t1 = t0 + (long long)gridDim.x * tpb;
    uint4 a0, b0, a1, b1; bool l0 = t0 + lt < tok, l1 = t1 + lt < tok;
    if (l0) { const uint4* p = x + ((t0 + lt) * heads + h) * rs + u; a0 = p[0]; b0 = p[hu]; }
    if (l1) { const uint4* p = x + ((t1 + lt) * heads + h) * rs + u; a1 = p[0]; b1 = p[hu]; }
    if (l0) { uint4* q = y + ((t0 + lt) * heads + h) * rs + u; q[0] = a0; q[hu] = b0; }
    if (l1) { uint4* q = y + ((t1 + lt) * heads + h) * rs + u; q[0] = a1; q[hu] = b1; }
  }
}

#include <cuda_bf16.h>
// ---- rope variants (bf16, neox, head size PD, a multiple of 16: PD / 16 units of 8 pairs;
// pos = (t / pdiv) % S)
#ifndef PD
#define PD 128
#endif
constexpr int kHalf = PD / 2;     // pairs per row
constexpr int kUnits = PD / 16;   // units per row: 16-byte vectors u (first members) and u + kUnits
constexpr int kRowVec = PD / 8;   // 16-byte vectors per row
// thread index -> (row or token part, unit): shifts where kUnits is a power of two
__device__ __forceinline__ int unit_of(long long i) { return (int)(kUnits == 8 ? (i & 7) : i % kUnits); }
__device__ __forceinline__ long long past_unit(long long i) { return kUnits == 8 ? (i >> 3) : i / kUnits; }
// pair e: first member (in a) rotated by (c[e], s[e]), second (in b) by (cg[e], sg[e])
__device__ __forceinline__ void rot8(uint4& a, uint4& b, const float* c, const float* s, const float* cg, const float* sg) {
  unsigned* pa = reinterpret_cast<unsigned*>(&a); unsigned* pb = reinterpret_cast<unsigned*>(&b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float x0 = __uint_as_float(pa[i] << 16), x1 = __uint_as_float(pa[i] & 0xffff0000u);
    float y0 = __uint_as_float(pb[i] << 16), y1 = __uint_as_float(pb[i] & 0xffff0000u);
    float o0 = x0 * c[2*i] - y0 * s[2*i], o1 = x1 * c[2*i+1] - y1 * s[2*i+1];
    float q0 = y0 * cg[2*i] + x0 * sg[2*i], q1 = y1 * cg[2*i+1] + x1 * sg[2*i+1];
    __nv_bfloat162 ho = __floats2bfloat162_rn(o0, o1), hq = __floats2bfloat162_rn(q0, q1);
    pa[i] = *reinterpret_cast<unsigned*>(&ho); pb[i] = *reinterpret_cast<unsigned*>(&hq);
  }
}
// element e of a unit (a: first members, b: second members), rotated in the packed words
__device__ __forceinline__ void rot1(uint4& a, uint4& b, int e, float cf, float sf, float cg, float sg) {
  unsigned& wa = reinterpret_cast<unsigned*>(&a)[e / 2];
  unsigned& wb = reinterpret_cast<unsigned*>(&b)[e / 2];
  const int sh = e % 2 ? 0 : 16;
  const unsigned keep = e % 2 ? 0x0000ffffu : 0xffff0000u;
  const float x0 = __uint_as_float((wa << sh) & 0xffff0000u), y0 = __uint_as_float((wb << sh) & 0xffff0000u);
  const unsigned o = __bfloat16_as_ushort(__float2bfloat16_rn(x0 * cf - y0 * sf));
  const unsigned q = __bfloat16_as_ushort(__float2bfloat16_rn(y0 * cg + x0 * sg));
  wa = (wa & keep) | (o << (16 - sh));
  wb = (wb & keep) | (q << (16 - sh));
}
extern "C" __global__ void cs_table(const float* __restrict__ f, float2* __restrict__ cs, int S) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= S * kHalf) return;
  float s, c; sincosf(f[(i / kHalf) * PD + i % kHalf], &s, &c); cs[i] = make_float2(c, s);
}
// MODE 0: 8 sincosf per thread; 1: cos/sin table; 2: block-shared sincosf (threads w < kHalf of
// each token compute pair w; a block holds whole tokens); 3: warp-shared (PD = 128 only: a warp's
// 4 rows are one token, 2 sincosf per lane)
template <int MODE>
__device__ void lin_rope(const uint4* __restrict__ x, uint4* __restrict__ y, const float* __restrict__ f,
                         const float2* __restrict__ cs, long long tok, int H, int pdiv, int S) {
  __shared__ float2 sh[512];
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  int u = unit_of(i); long long r = past_unit(i); long long t = r / H;
  bool live = t < tok;
  uint4 a, b;
  const long long off = r * kRowVec + u;
  if (live) { a = x[off]; b = x[off + kUnits]; }
  int pos = (int)((t / pdiv) % S);
  float c[8], s[8];
  if (MODE == 0) {
    if (!live) return;
#pragma unroll
    for (int e = 0; e < 8; ++e) sincosf(f[pos * PD + u * 8 + e], &s[e], &c[e]);
  } else if (MODE == 1) {
    if (!live) return;
    const float4* p = reinterpret_cast<const float4*>(cs + pos * kHalf + u * 8);
#pragma unroll
    for (int e = 0; e < 4; ++e) { float4 v = p[e]; c[2*e] = v.x; s[2*e] = v.y; c[2*e+1] = v.z; s[2*e+1] = v.w; }
  } else if (MODE == 2) {
    int w = threadIdx.x % (H * kUnits), base = threadIdx.x - w;
    if (w < kHalf && live) { float sv, cv; sincosf(f[pos * PD + w], &sv, &cv); sh[base + w] = make_float2(cv, sv); }
    __syncthreads();
    if (!live) return;
#pragma unroll
    for (int e = 0; e < 8; ++e) { float2 v = sh[base + u * 8 + e]; c[e] = v.x; s[e] = v.y; }
  } else {
    int lane = threadIdx.x & 31, wb = threadIdx.x - lane;
    if (live) {
      float sv, cv;
      sincosf(f[pos * PD + lane], &sv, &cv); sh[wb * 2 + lane] = make_float2(cv, sv);
      sincosf(f[pos * PD + lane + 32], &sv, &cv); sh[wb * 2 + lane + 32] = make_float2(cv, sv);
    }
    __syncwarp();
    if (!live) return;
#pragma unroll
    for (int e = 0; e < 8; ++e) { float2 v = sh[wb * 2 + u * 8 + e]; c[e] = v.x; s[e] = v.y; }
  }
  rot8(a, b, c, s, c, s);
  y[off] = a; y[off + kUnits] = b;
}
extern "C" __global__ void lin_sincos(const uint4* x, uint4* y, const float* f, const float2* cs, long long tok, int H, int pdiv, int S) { lin_rope<0>(x, y, f, cs, tok, H, pdiv, S); }
extern "C" __global__ void lin_cs(const uint4* x, uint4* y, const float* f, const float2* cs, long long tok, int H, int pdiv, int S) { lin_rope<1>(x, y, f, cs, tok, H, pdiv, S); }
extern "C" __global__ void lin_share(const uint4* x, uint4* y, const float* f, const float2* cs, long long tok, int H, int pdiv, int S) { lin_rope<2>(x, y, f, cs, tok, H, pdiv, S); }
extern "C" __global__ void lin_warp(const uint4* x, uint4* y, const float* f, const float2* cs, long long tok, int H, int pdiv, int S) { lin_rope<3>(x, y, f, cs, tok, H, pdiv, S); }

// R rows per thread: heads c, c + H/R, ... of one token (lanes: unit fastest, then c), all loads
// up front, the unit's 8 sincosf once for the R rows. BOTH: each pair's second angle loaded too
// and compared (its own sincosf where it differs), as the library's kernels do for any table.
struct RowsOf {
  long long t, base, step;  // token; vector index of the first row's unit; rows' step (vectors)
  int u;                    // unit
};
// The thread's R rows (heads c, c + H/R, ... of one token; lanes: unit fastest, then c), loaded
// up front into a, b; false past the last token.
template <int R>
__device__ __forceinline__ bool load_rows(const uint4* __restrict__ x, long long tok, int H, uint4* a, uint4* b,
                                          RowsOf& r) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int C = H / R;
  r.u = unit_of(i); long long rest = past_unit(i); int c = (int)(rest % C); r.t = rest / C;
  if (r.t >= tok) return false;
  r.base = (r.t * H + c) * kRowVec + r.u, r.step = (long long)C * kRowVec;
#pragma unroll
  for (int j = 0; j < R; ++j) { a[j] = x[r.base + j * r.step]; b[j] = x[r.base + j * r.step + kUnits]; }
  return true;
}
// PRE: the unit's angles (first members; BOTH: second members too) loaded in 16-byte vectors before
// any sincosf, one round trip to the table where the loop's loads take one per pair (the compiler
// does not hoist a load above the previous pair's sincosf, whose slow path branches).
template <int R, bool BOTH = false, bool PRE = false>
__device__ void rows_rope(const uint4* __restrict__ x, uint4* __restrict__ y, const float* __restrict__ f,
                          long long tok, int H, int pdiv, int S) {
  uint4 a[R], b[R];
  RowsOf r;
  if (!load_rows<R>(x, tok, H, a, b, r)) return;
  int pos = (int)((r.t / pdiv) % S);
  float fa[8], ga[8];
  if (PRE) {
    const float4* q = reinterpret_cast<const float4*>(f + pos * PD + r.u * 8);
    const float4* qg = reinterpret_cast<const float4*>(f + pos * PD + kHalf + r.u * 8);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float4 v = q[k];
      fa[4*k] = v.x; fa[4*k+1] = v.y; fa[4*k+2] = v.z; fa[4*k+3] = v.w;
      if (BOTH) { const float4 w = qg[k]; ga[4*k] = w.x; ga[4*k+1] = w.y; ga[4*k+2] = w.z; ga[4*k+3] = w.w; }
    }
  }
  if (BOTH) {  // one pair at a time in every row (the library's lean kernel's order and registers)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float af = PRE ? fa[e] : f[pos * PD + r.u * 8 + e], ag = PRE ? ga[e] : f[pos * PD + kHalf + r.u * 8 + e];
      float sf, cf, sg, cg;
      sincosf(af, &sf, &cf);
      sg = sf, cg = cf;
      if (ag != af) sincosf(ag, &sg, &cg);
#pragma unroll
      for (int j = 0; j < R; ++j) rot1(a[j], b[j], e, cf, sf, cg, sg);
    }
  } else {
    float cc[8], ss[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) sincosf(PRE ? fa[e] : f[pos * PD + r.u * 8 + e], &ss[e], &cc[e]);
#pragma unroll
    for (int j = 0; j < R; ++j) { rot8(a[j], b[j], cc, ss, cc, ss); y[r.base + j * r.step] = a[j]; y[r.base + j * r.step + kUnits] = b[j]; }
    return;
  }
#pragma unroll
  for (int j = 0; j < R; ++j) { y[r.base + j * r.step] = a[j]; y[r.base + j * r.step + kUnits] = b[j]; }
}

// ---- a cos/sin table made by a prologue kernel per call (W = 1: one (cos, sin) per pair, for
// standard tables; W = 2: (cos f, sin f, cos g, sin g) per pair, any table), read by R rows per
// thread. PDL: the prologue lets the main kernel start at once; the main kernel loads its rows,
// then waits for the prologue's table (griddepcontrol).
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
template <int W, bool PDL>
__device__ void cs_impl(const float* __restrict__ f, float* __restrict__ cs, int S) {
  if (PDL) pdl_trigger();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= S * kHalf) return;
  const float* row = f + (i / kHalf) * PD + i % kHalf;
  float s, c; sincosf(row[0], &s, &c);
  if (W == 1) { reinterpret_cast<float2*>(cs)[i] = make_float2(c, s); return; }
  float s2, c2; sincosf(row[kHalf], &s2, &c2);
  reinterpret_cast<float4*>(cs)[i] = make_float4(c, s, c2, s2);
}
extern "C" __global__ void cs1(const float* f, float* cs, int S) { cs_impl<1, false>(f, cs, S); }
extern "C" __global__ void cs2(const float* f, float* cs, int S) { cs_impl<2, false>(f, cs, S); }
extern "C" __global__ void cs1_pdl(const float* f, float* cs, int S) { cs_impl<1, true>(f, cs, S); }
extern "C" __global__ void cs2_pdl(const float* f, float* cs, int S) { cs_impl<2, true>(f, cs, S); }
template <int R, int W, bool PDL>
__device__ void rows_cs(const uint4* __restrict__ x, uint4* __restrict__ y, const float* __restrict__ cs,
                        long long tok, int H, int pdiv, int S) {
  uint4 a[R], b[R];
  RowsOf r;
  if (!load_rows<R>(x, tok, H, a, b, r)) return;
  if (PDL) pdl_wait();
  int pos = (int)((r.t / pdiv) % S);
  float cc[8], ss[8], cg[8], sg[8];
  const float4* p = reinterpret_cast<const float4*>(cs) + ((long long)pos * kHalf + r.u * 8) * W / 2;
  if (W == 1) {
#pragma unroll
    for (int e = 0; e < 4; ++e) { float4 v = p[e]; cc[2*e] = cg[2*e] = v.x; ss[2*e] = sg[2*e] = v.y; cc[2*e+1] = cg[2*e+1] = v.z; ss[2*e+1] = sg[2*e+1] = v.w; }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) { float4 v = p[e]; cc[e] = v.x; ss[e] = v.y; cg[e] = v.z; sg[e] = v.w; }
  }
#pragma unroll
  for (int j = 0; j < R; ++j) { rot8(a[j], b[j], cc, ss, cg, sg); y[r.base + j * r.step] = a[j]; y[r.base + j * r.step + kUnits] = b[j]; }
}
#define ROWS_CS(R, W) \
  extern "C" __global__ void rows##R##_cs##W(const uint4* x, uint4* y, const float* cs, long long tok, int H, int pdiv, int S) { rows_cs<R, W, false>(x, y, cs, tok, H, pdiv, S); } \
  extern "C" __global__ void rows##R##_cs##W##_pdl(const uint4* x, uint4* y, const float* cs, long long tok, int H, int pdiv, int S) { rows_cs<R, W, true>(x, y, cs, tok, H, pdiv, S); }
ROWS_CS(1, 1) ROWS_CS(2, 1) ROWS_CS(4, 1) ROWS_CS(1, 2) ROWS_CS(2, 2) ROWS_CS(4, 2)
extern "C" __global__ void rows2(const uint4* x, uint4* y, const float* f, long long tok, int H, int pdiv, int S) { rows_rope<2>(x, y, f, tok, H, pdiv, S); }
extern "C" __global__ void rows4(const uint4* x, uint4* y, const float* f, long long tok, int H, int pdiv, int S) { rows_rope<4>(x, y, f, tok, H, pdiv, S); }
extern "C" __global__ void rows8(const uint4* x, uint4* y, const float* f, long long tok, int H, int pdiv, int S) { rows_rope<8>(x, y, f, tok, H, pdiv, S); }
extern "C" __global__ void rows2_both(const uint4* x, uint4* y, const float* f, long long tok, int H, int pdiv, int S) { rows_rope<2, true>(x, y, f, tok, H, pdiv, S); }
extern "C" __global__ void rows4_both(const uint4* x, uint4* y, const float* f, long long tok, int H, int pdiv, int S) { rows_rope<4, true>(x, y, f, tok, H, pdiv, S); }
extern "C" __global__ void rows2_pre(const uint4* x, uint4* y, const float* f, long long tok, int H, int pdiv, int S) { rows_rope<2, false, true>(x, y, f, tok, H, pdiv, S); }
extern "C" __global__ void rows4_pre(const uint4* x, uint4* y, const float* f, long long tok, int H, int pdiv, int S) { rows_rope<4, false, true>(x, y, f, tok, H, pdiv, S); }
extern "C" __global__ void rows2_both_pre(const uint4* x, uint4* y, const float* f, long long tok, int H, int pdiv, int S) { rows_rope<2, true, true>(x, y, f, tok, H, pdiv, S); }
extern "C" __global__ void rows4_both_pre(const uint4* x, uint4* y, const float* f, long long tok, int H, int pdiv, int S) { rows_rope<4, true, true>(x, y, f, tok, H, pdiv, S); }
"""


def _pdl_launcher(cp):
    """launch(kernel, grid, block, args) as a programmatic dependent launch on the current stream
    (cuLaunchKernelEx through the launch layer's ctypes structures), or None without a driver that
    has it. Arguments: CuPy arrays and NumPy scalars, as ``RawKernel`` takes them."""
    import ctypes

    from cupy_rope import _launch

    fn = _launch._launch_ex()
    if fn is None or int(cp.cuda.Device().compute_capability) < 90:
        return None

    def launch(kernel, grid, block, args):
        vals = [ctypes.c_void_p(a.data.ptr) if hasattr(a, "data") and hasattr(a.data, "ptr")
                else (ctypes.c_int64 if a.dtype.itemsize == 8 else ctypes.c_int32)(int(a)) for a in args]
        argv = (ctypes.c_void_p * len(vals))(*(ctypes.addressof(v) for v in vals))
        attr = _launch._LaunchAttribute(id=_launch._PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        cfg = _launch._LaunchConfig((grid[0], 1, 1), (block[0], 1, 1), 0, cp.cuda.get_current_stream().ptr,
                                    ctypes.pointer(attr), 1)
        rc = fn(ctypes.addressof(cfg), getattr(kernel, "kernel", kernel).ptr, ctypes.addressof(argv), None)
        if rc:
            _launch.raise_driver_error(rc)
    return launch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rope", action="store_true", help="also rope variants (d a multiple of 16)")
    ap.add_argument("--positions", type=int, default=4096, help="angle table rows S")
    ap.add_argument("--pdiv", type=int, default=2, help="position of token t: (t // pdiv) %% S (sbhd: b; bshd: 1)")
    ap.add_argument("--tune", default="", help="the library's tuning, as benchmarks/run.py --tune takes it")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.rope and (a.d % 16 or a.d <= 0):
        ap.error(f"--rope: the rope kernels take a positive multiple of 16 for d, got --d {a.d}")
    if a.tune:
        from cupy_rope._dev.benchmark import apply_tuning

        apply_tuning(a.tune, ap)
    import cupy as cp

    mod = cp.RawModule(code=SRC, options=("-std=c++17", f"-DPD={a.d}"), name_expressions=None)
    tok, heads, d = a.tokens, a.heads, a.d
    hu = d // 16  # 16-byte vectors (bf16) per half row
    x = cp.random.randint(0, 2**16, size=(tok, heads, d), dtype=cp.uint16)
    y = cp.empty_like(x)
    rows = tok * heads
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    nbytes = 2 * x.nbytes
    i64, i32 = cp.int64, cp.int32

    def chunks(tps):
        return max(1, min(heads, -(-sms * tps // (tok * hu))))

    variants = {
        "memcpy": lambda: cp.cuda.runtime.memcpyAsync(y.data.ptr, x.data.ptr, x.nbytes, 3, cp.cuda.get_current_stream().ptr),
        "lin (one unit per thread)": lambda: mod.get_function("lin")(((rows * hu + 255) // 256,), (256,), (x, y, i64(rows), i32(hu))),
    }
    for tps in (512, 1024):
        C = chunks(tps)
        n = tok * C * hu
        for contig in (0, 1):
            variants[f"stream4 {tps}/SM C={C} {'contiguous heads' if contig else 'heads c, c+C'}"] = (
                lambda n=n, C=C, contig=contig: mod.get_function("stream4")(
                    ((n + 255) // 256,), (256,), (x, y, i64(tok), i32(heads), i32(C), i32(hu), i32(contig))))
        variants[f"gstride4 {tps}/SM"] = (lambda tps=tps: mod.get_function("gstride4")(
            (sms * tps // 256,), (256,), (x, y, i64(rows * hu), i32(hu))))
        variants[f"tokloop {tps}/SM"] = (lambda tps=tps: mod.get_function("tokloop")(
            (sms * tps // 256,), (256,), (x, y, i64(tok), i32(heads), i32(hu))))

    check = set()  # rotations, checked against the float32 reference; the rest copies
    if a.rope:
        import torch

        import cupy_rope
        import cupy_rope.torch as crt

        S = a.positions
        pdiv = a.pdiv
        f = cp.asarray(cupy_rope.rope_freqs(d, S, like=cp.empty(0, cp.float32))).reshape(S, d)
        cs = cp.empty((S, d // 2, 2), cp.float32)
        tokens = cp.arange(tok)
        pos = (tokens // pdiv) % S
        xf = (x.astype(cp.uint32) << 16).view(cp.float32).reshape(tok, heads, d)
        ang = f[pos][:, None, :]
        x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
        c, sn = cp.cos(ang[..., : d // 2]), cp.sin(ang[..., : d // 2])
        ref = cp.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], -1)
        npairs = S * (d // 2)
        cs_fn = lambda: mod.get_function("cs_table")(((npairs + 255) // 256,), (256,), (f, cs, i32(S)))
        variants["cs_table (prologue alone)"] = cs_fn
        nblk = (rows * hu + 255) // 256
        lin = ["lin_sincos", "lin_cs"]
        lin += ["lin_share"] * (256 % (heads * hu) == 0)  # a block of whole tokens
        lin += ["lin_warp"] * (d == 128)  # a warp's four rows: one token's 64 pairs
        for name in lin:
            variants[name] = (lambda name=name: mod.get_function(name)(
                (nblk,), (256,), (x, y, f, cs, i64(tok), i32(heads), i32(pdiv), i32(S))))
            check.add(name)
        for R in (2, 4, 8):
            if heads % R == 0:
                variants[f"rows{R}_sincos"] = (lambda R=R: mod.get_function(f"rows{R}")(
                    ((rows * hu // R + 255) // 256,), (256,), (x, y, f, i64(tok), i32(heads), i32(pdiv), i32(S))))
                check.add(f"rows{R}_sincos")
                if R in (2, 4):  # both angles of each pair loaded and compared; the angles loaded first
                    for suffix, label in (("_both", ", both angles"), ("_pre", ", angles first"),
                                          ("_both_pre", ", both angles, angles first")):
                        variants[f"rows{R}_sincos{label}"] = (lambda R=R, suffix=suffix: mod.get_function(f"rows{R}{suffix}")(
                            ((rows * hu // R + 255) // 256,), (256,), (x, y, f, i64(tok), i32(heads), i32(pdiv), i32(S))))
                        check.add(f"rows{R}_sincos{label}")
        variants["cs_table + lin_cs"] = lambda: (cs_fn(), variants["lin_cs"]())
        check.add("cs_table + lin_cs")
        # cos/sin tables made per call (W values per pair), then R rows per thread reading them:
        # the table alone (made once, outside the timing), prologue + main, prologue + main as a
        # programmatic dependent launch
        csw = {W: cp.empty((S, d // 2, 2 * W), cp.float32) for W in (1, 2)}
        for W in (1, 2):
            mod.get_function(f"cs{W}")(((npairs + 255) // 256,), (256,), (f, csw[W], i32(S)))
        pdl = _pdl_launcher(cp)
        for W in (1, 2):
            pro = (((npairs + 255) // 256,), (256,), (f, csw[W], i32(S)))
            variants[f"cs{W} prologue alone"] = (lambda W=W, pro=pro: mod.get_function(f"cs{W}")(*pro))
            for R in (1, 2, 4):
                if heads % R:
                    continue
                main = (((rows * hu // R + 255) // 256,), (256,), (x, y, csw[W], i64(tok), i32(heads), i32(pdiv), i32(S)))
                k = f"rows{R}_cs{W}"
                variants[f"{k} (table made once)"] = (lambda k=k, main=main: mod.get_function(k)(*main))
                variants[f"cs{W} + {k}"] = (lambda W=W, k=k, pro=pro, main=main: (
                    mod.get_function(f"cs{W}")(*pro), mod.get_function(k)(*main)))
                if pdl is not None:
                    variants[f"cs{W}_pdl + {k}_pdl (PDL)"] = (lambda W=W, k=k, pro=pro, main=main: (
                        mod.get_function(f"cs{W}_pdl")(*pro), pdl(mod.get_function(k + "_pdl"), *main)))
                check.update(n for n in variants if k in n)
        xt = torch.from_dlpack(x).view(torch.bfloat16)
        yt = torch.from_dlpack(y).view(torch.bfloat16)
        ft = torch.from_dlpack(f).view(S, 1, 1, d)
        if pdiv > 1:  # sbhd: [S, b, h, d]
            xt4, yt4, layout = xt.view(tok // pdiv, pdiv, heads, d), yt.view(tok // pdiv, pdiv, heads, d), "sbhd"
        else:  # bshd: [b, S, h, d]
            xt4, yt4, layout = xt.view(tok // S, S, heads, d), yt.view(tok // S, S, heads, d), "bshd"
        ts = None  # torch's view of the capture stream, set below

        def lib():
            with torch.cuda.stream(ts):
                cupy_rope.apply_rope(xt4, ft, layout, out=yt4)
        variants["cupy_rope (library)"] = lib
        check.add("cupy_rope (library)")

    stream = cp.cuda.Stream(non_blocking=True)
    out = {}
    graphs = {}
    wrong = {}  # variant -> what its check found
    with stream:
        if a.rope:
            ts = torch.cuda.ExternalStream(stream.ptr)
        for name, fn in variants.items():
            y.fill(0)
            fn()
            stream.synchronize()
            if name in check:
                got = (y.astype(cp.uint32) << 16).view(cp.float32).reshape(tok, heads, d)
                err = float(cp.abs(got - ref).max() / cp.abs(ref).max())
                if err > 2 ** -7:
                    wrong[name] = f"wrong rotation, max rel err {err}"
            elif not name.startswith("cs") and not bool((y == x).all()):
                wrong[name] = "wrong copy"
            if name in wrong:  # reported, not timed: the other variants still run
                print(f"{name}: {wrong[name]}", file=sys.stderr)
                continue
            stream.begin_capture()
            for _ in range(a.reps):
                fn()
            graphs[name] = stream.end_capture()
        for r in range(a.rounds):
            for name, g in graphs.items():
                g.launch(stream)
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(stream)
                g.launch(stream)
                e1.record(stream)
                e1.synchronize()
                out.setdefault(name, []).append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / a.reps)
    base = min(out["memcpy"])
    res = []
    for name, v in out.items():
        us = min(v)
        res.append({"kernel": name, "us": us, "us_all": v, "tb_s": nbytes / us / 1e6, "vs_memcpy": base / us})
        print(f"{name:48s} {us:8.2f} us  {nbytes / us / 1e6:5.2f} TB/s  {100 * base / us:5.1f}% of memcpy")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": [tok, heads, d], "reps": a.reps, "rounds": a.rounds, "rows": res, "wrong": wrong}, f,
                      indent=1)
    if wrong:
        raise SystemExit(f"{len(wrong)} variant(s) gave wrong results: {', '.join(wrong)}")


if __name__ == "__main__":
    main()

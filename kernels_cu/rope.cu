// cupy_rope: RoPE forward/backward over sbhd, bshd and thd (spec sections 1-5).
//
// Thread mapping: one thread per (token, head group, unit). A unit is 2V channels of a
// rotary pair set (or V tail channels); the thread computes the unit's cos/sin once and
// applies them to the heads hg, hg + G, hg + 2G, ... of its token, kRowsInFlight rows of
// loads in flight at a time. Each element is read once and written once.
#include "rope_common.cuh"

namespace cupy_rope {

// Field order = cupy_rope/_plan.py ROPE_FIELDS (all 64-bit).
struct RopeParams {
  i64 x, y, freqs;               // addresses
  i64 n_tok, n_inner;            // tokens; token -> (outer, inner) = divmod(token, n_inner)
  i64 xs0, xs1, xsh, xsd;        // input strides in elements: outer, inner, head, channel
  i64 ys0, ys1, ysh, ysd;        // output strides
  i64 n_heads, d2;               // heads, rotary width
  i64 n_hgroups, n_units, n_rot_units;
  i64 f_rows, f_srow, f_scol;    // angle table rows and strides (elements)
  PosArgs pos;
};

template <typename T, int V, bool INTERLEAVED, bool BACKWARD>
__device__ __forceinline__ void rope_body(const RopeParams& p) {
  const i64 item = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  i64 tok, rest, hg, u, outer, inner;
  divmod(item, p.n_hgroups * p.n_units, tok, rest);
  if (tok >= p.n_tok) return;
  divmod(rest, p.n_units, hg, u);
  divmod(tok, p.n_inner, outer, inner);

  const T* __restrict__ x = reinterpret_cast<const T*>(p.x);
  T* __restrict__ y = reinterpret_cast<T*>(p.y);
  const i64 G = p.n_hgroups;
  const i64 nrows = (p.n_heads - hg + G - 1) / G;
  const i64 xb = outer * p.xs0 + inner * p.xs1 + hg * p.xsh, xstep = G * p.xsh;
  const i64 yb = outer * p.ys0 + inner * p.ys1 + hg * p.ysh, ystep = G * p.ysh;
  auto in_off = [=](i64 k) { return xb + k * xstep; };
  auto out_off = [=](i64 k) { return yb + k * ystep; };

  if (u >= p.n_rot_units) {  // pass-through tail: V channels
    const i64 cb = p.d2 + (u - p.n_rot_units) * V;
    process_rows<T, V, INTERLEAVED, BACKWARD, false, false>(x, y, nrows, in_off, out_off, p.xsd,
                                                            p.ysd, cb, cb, nullptr, nullptr);
    return;
  }
  i64 cb0, cb1;
  unit_bases<INTERLEAVED>(u, p.d2 / 2, V, cb0, cb1);
  i64 pos = 0;
  const bool valid = token_position(p.pos, outer, inner, pos);
  if (!in_table(valid, pos, p.f_rows)) {
    process_rows<T, V, INTERLEAVED, BACKWARD, false, true>(x, y, nrows, in_off, out_off, p.xsd,
                                                           p.ysd, cb0, cb1, nullptr, nullptr);
    return;
  }
  float c[2 * V], s[2 * V];
  unit_sincos<INTERLEAVED, V>(reinterpret_cast<const float*>(p.freqs), p.f_srow, p.f_scol, pos,
                              cb0, cb1, c, s);
  process_rows<T, V, INTERLEAVED, BACKWARD, true, true>(x, y, nrows, in_off, out_off, p.xsd, p.ysd,
                                                        cb0, cb1, c, s);
}

}  // namespace cupy_rope

// One extern "C" entry point per instantiation, named NAME = rope_<dtype>_v<V>_<n|i>_<f|b>.
// The launch layer appends the CUPY_ROPE_KERNEL(...) lines it needs (cupy_rope/_kernels.py).
#define CUPY_ROPE_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_ENTRY(NAME, cupy_rope::RopeParams, (cupy_rope::rope_body<T, V, INTERLEAVED, BACKWARD>))

// ---------------------------------------------------------------------------------------------
// Tiled variant (opt-in, CUPY_ROPE_KERNEL=tiled; measured slower than the row kernel, see
// benchmarks/NOTES.md): one block per tile of TT consecutive tokens. Every thread first
// issues the loads of its first kTileItems (head, unit) items, then the block computes each
// token's position once and each (token, channel) cos/sin once into shared memory (sincos
// overlaps the loads in flight), then every thread rotates and stores its items. Few registers
// per thread, many loads in flight per SM, no per-thread recomputation of cos/sin.
#ifndef CUPY_ROPE_TILE_ITEMS
#define CUPY_ROPE_TILE_ITEMS 2  // = cupy_rope/_plan.py TILE_ITEMS
#endif
#ifndef CUPY_ROPE_TILE_MIN_BLOCKS
#define CUPY_ROPE_TILE_MIN_BLOCKS 4  // 64 registers: 1024 threads per SM, no spills (ptxas -v)
#endif
#ifndef CUPY_ROPE_SMEM_ANGLES
#define CUPY_ROPE_SMEM_ANGLES 2048
#endif
namespace cupy_rope {

constexpr int kTileItems = CUPY_ROPE_TILE_ITEMS;
constexpr int kSmemAngles = CUPY_ROPE_SMEM_ANGLES;  // = cupy_rope/_plan.py SMEM_ANGLES
constexpr int kMaxTileTokens = 64;                    // = cupy_rope/_plan.py MAX_TILE_TOKENS

struct TileShared {
  float c[kSmemAngles];
  float s[kSmemAngles];
  i64 pos[kMaxTileTokens];  // table row of each token of the tile, -1: copied through
};

template <typename T, int V> struct TileState {
  Vec<T, V> a[kTileItems], b[kTileItems];
};

template <typename T, int V, bool INTERLEAVED, bool BACKWARD> struct RopeTiled {
  typedef RopeParams Params;
  typedef TileState<T, V> State;
  typedef TileShared Shared;

  // item i of the tile -> token of the tile tt, head h, unit u; false past the tile's items
  static __device__ __forceinline__ bool item(const Params& p, i64 i, i64& tt, i64& tok, i64& h,
                                              i64& u) {
    const i64 ipt = p.n_heads * p.n_units;
    if (i >= p.n_hgroups * ipt) return false;  // n_hgroups holds TT for the tiled kernel
    i64 r;
    divmod(i, ipt, tt, r);
    divmod(r, p.n_units, h, u);
    tok = (i64)blockIdx.x * p.n_hgroups + tt;
    return tok < p.n_tok;
  }

  static __device__ __forceinline__ void offsets(const Params& p, i64 tok, i64 h, i64& xo, i64& yo) {
    i64 outer, inner;
    divmod(tok, p.n_inner, outer, inner);
    xo = outer * p.xs0 + inner * p.xs1 + h * p.xsh;
    yo = outer * p.ys0 + inner * p.ys1 + h * p.ysh;
  }

  static __device__ __forceinline__ void channels(const Params& p, i64 u, i64& cb0, i64& cb1) {
    if (u >= p.n_rot_units) {
      cb0 = cb1 = p.d2 + (u - p.n_rot_units) * V;
    } else {
      unit_bases<INTERLEAVED>(u, p.d2 / 2, V, cb0, cb1);
    }
  }

  static __device__ __forceinline__ void load(const Params& p, i64 tok, i64 h, i64 u, Vec<T, V>& a,
                                              Vec<T, V>& b) {
    const T* __restrict__ x = reinterpret_cast<const T*>(p.x);
    i64 xo, yo, cb0, cb1;
    offsets(p, tok, h, xo, yo);
    channels(p, u, cb0, cb1);
    a = load_vec<T, V>(x, xo + cb0 * p.xsd);
    if (u < p.n_rot_units) b = load_vec<T, V>(x, xo + cb1 * p.xsd);
  }

  // Phase 1: issue the loads of the first kTileItems items; positions of the tile's tokens.
  static __device__ __forceinline__ void phase1(const Params& p, State& st, Shared& sh) {
#pragma unroll
    for (int k = 0; k < kTileItems; ++k) {
      i64 tt, tok, h, u;
      if (item(p, threadIdx.x + (i64)k * blockDim.x, tt, tok, h, u)) load(p, tok, h, u, st.a[k], st.b[k]);
    }
    for (i64 tt = threadIdx.x; tt < p.n_hgroups; tt += blockDim.x) {
      const i64 tok = (i64)blockIdx.x * p.n_hgroups + tt;
      i64 pos = -1;
      if (tok < p.n_tok) {
        i64 outer, inner, q = 0;
        divmod(tok, p.n_inner, outer, inner);
        const bool valid = token_position(p.pos, outer, inner, q);
        pos = in_table(valid, q, p.f_rows) ? q : -1;
      }
      sh.pos[tt] = pos;
    }
  }

  // Phase 2: cos/sin of every (token, rotary channel) of the tile, once.
  static __device__ __forceinline__ void phase2(const Params& p, State&, Shared& sh) {
    const float* __restrict__ f = reinterpret_cast<const float*>(p.freqs);
    const i64 n = p.n_hgroups * p.d2;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
      i64 tt, col;
      divmod(j, p.d2, tt, col);
      const i64 pos = sh.pos[tt];
      if (pos >= 0) sincosf(f[pos * p.f_srow + col * p.f_scol], &sh.s[j], &sh.c[j]);
    }
  }

  static __device__ __forceinline__ void finish(const Params& p, const Shared& sh, i64 tt, i64 tok, i64 h,
                                                i64 u, const Vec<T, V>& a, const Vec<T, V>& b) {
    T* __restrict__ y = reinterpret_cast<T*>(p.y);
    i64 xo, yo, cb0, cb1;
    offsets(p, tok, h, xo, yo);
    channels(p, u, cb0, cb1);
    if (u >= p.n_rot_units) {
      store_vec<T, V>(y, yo + cb0 * p.ysd, a);
      return;
    }
    if (sh.pos[tt] < 0) {
      store_vec<T, V>(y, yo + cb0 * p.ysd, a);
      store_vec<T, V>(y, yo + cb1 * p.ysd, b);
      return;
    }
    float c[2 * V], s[2 * V], r[2 * V];
    const float* sc = sh.c + tt * p.d2;
    const float* ss = sh.s + tt * p.d2;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      c[e] = sc[cb0 + e];
      s[e] = ss[cb0 + e];
      c[V + e] = sc[cb1 + e];
      s[V + e] = ss[cb1 + e];
    }
    rotate_unit<T, V, INTERLEAVED, BACKWARD>(a, b, c, s, r);
    store_floats<T, V>(y, yo + cb0 * p.ysd, r);
    store_floats<T, V>(y, yo + cb1 * p.ysd, r + V);
  }

  // Phase 3: rotate and store (items past kTileItems per thread are loaded here).
  static __device__ __forceinline__ void phase3(const Params& p, State& st, Shared& sh) {
#pragma unroll
    for (int k = 0; k < kTileItems; ++k) {
      i64 tt, tok, h, u;
      if (item(p, threadIdx.x + (i64)k * blockDim.x, tt, tok, h, u)) finish(p, sh, tt, tok, h, u, st.a[k], st.b[k]);
    }
    for (i64 i = threadIdx.x + (i64)kTileItems * blockDim.x;; i += blockDim.x) {
      i64 tt, tok, h, u;
      const i64 ipt = p.n_heads * p.n_units;
      if (i >= p.n_hgroups * ipt) break;
      if (!item(p, i, tt, tok, h, u)) continue;
      Vec<T, V> a, b;
      load(p, tok, h, u, a, b);
      finish(p, sh, tt, tok, h, u, a, b);
    }
  }
};

// Three phases separated by block barriers (the host build runs each phase for every thread of
// the block before the next: the same ordering guarantee).
#ifndef CUPY_ROPE_HOST  // the host build runs the phases itself (host_shim.h)
template <class K>
__device__ __forceinline__ void run_tiled(const typename K::Params& p) {
  __shared__ typename K::Shared sh;
  typename K::State st;
  K::phase1(p, st, sh);
  __syncthreads();
  K::phase2(p, st, sh);
  __syncthreads();
  K::phase3(p, st, sh);
}
#endif

}  // namespace cupy_rope

#define CUPY_ROPE_STRIP(...) __VA_ARGS__
#ifndef CUPY_ROPE_TILED_ENTRY
#define CUPY_ROPE_TILED_ENTRY(NAME, K, PARAMS)                                                  \
  extern "C" __global__ void __launch_bounds__(CUPY_ROPE_BLOCK, CUPY_ROPE_TILE_MIN_BLOCKS)        \
      NAME(const PARAMS p) {                                                                     \
    cupy_rope::run_tiled<CUPY_ROPE_STRIP K>(p);                                                  \
  }
#endif
// Entry points ropet_<dtype>_v<V>_<n|i>_<f|b> (cupy_rope/_kernels.py).
#define CUPY_ROPET_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_TILED_ENTRY(NAME, (cupy_rope::RopeTiled<T, V, INTERLEAVED, BACKWARD>), cupy_rope::RopeParams)

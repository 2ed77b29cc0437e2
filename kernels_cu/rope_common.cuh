// cupy_rope: pieces shared by every RoPE kernel.
//
// Semantics: ../shared/ROPE_SPEC.md (sections 3-6). Framework-free: only CUDA headers.
// The same source is compiled three ways:
//   * NVRTC through CuPy (the GPU path),
//   * NVRTC alone for sm_90 (CI compiles every instantiation without a GPU),
//   * g++ with kernels_cu/host_shim.h (CI runs the kernels on the CPU).
// Every launch takes one parameter struct of 64-bit fields, packed by the Python
// launch layer in the order of the struct's fields, which cupy_rope reads from this source
// (cupy_rope/_kernels.py struct_fields).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;

namespace cupy_rope {

// ---------------------------------------------------------------- element vectors
// V consecutive elements held as raw 32-bit words (16 bytes at most, so that an aligned access
// is one LDG.128/STG.128); a 16-bit scalar uses the low half of w[0]. Kept as words so that
// loads, conversions and stores need no per-element register moves.
template <typename T, int V> struct Vec {
  static constexpr int kBytes = sizeof(T) * V;
  static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;
  unsigned int w[kWords];
};

// A 16-byte vector from the four words of a 16-byte load.
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> vec_of(const uint4& q) {
  static_assert(Vec<T, V>::kBytes == 16, "a 16-byte vector");
  Vec<T, V> r;
  r.w[0] = q.x, r.w[1] = q.y, r.w[2] = q.z, r.w[3] = q.w;
  return r;
}

// Whether a vector access at p of n bytes is aligned: always on the device (the launch layer
// guarantees it); the host build checks, counts a misaligned one and skips it (host_shim.h).
#ifndef CUPY_ROPE_ALIGNED
#define CUPY_ROPE_ALIGNED(p, n) true
#endif

// Load/store V elements at p. V > 1 is only chosen by the host when the channel stride is 1
// and every row address is aligned to the vector size; V == 1 honours any stride.
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* __restrict__ p) {
  if (!CUPY_ROPE_ALIGNED(p, (Vec<T, V>::kBytes))) return Vec<T, V>{};
  Vec<T, V> r;
  if constexpr (Vec<T, V>::kBytes == 16) {
    r = vec_of<T, V>(*reinterpret_cast<const uint4*>(p));
  } else if constexpr (Vec<T, V>::kBytes == 8) {
    const uint2 q = *reinterpret_cast<const uint2*>(p);
    r.w[0] = q.x, r.w[1] = q.y;
  } else if constexpr (Vec<T, V>::kBytes == 4) {
    r.w[0] = *reinterpret_cast<const unsigned int*>(p);
  } else {
    r.w[0] = *reinterpret_cast<const unsigned short*>(p);
  }
  return r;
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const Vec<T, V>& r) {
  if (!CUPY_ROPE_ALIGNED(p, (Vec<T, V>::kBytes))) return;
  if constexpr (Vec<T, V>::kBytes == 16) {
#if defined(__CUDA_ARCH__)  // one 16-byte store (the compiler otherwise sometimes splits it)
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(r.w[0]), "r"(r.w[1]),
                 "r"(r.w[2]), "r"(r.w[3])
                 : "memory");
#else
    *reinterpret_cast<uint4*>(p) = make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]);
#endif
  } else if constexpr (Vec<T, V>::kBytes == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(r.w[0], r.w[1]);
  } else if constexpr (Vec<T, V>::kBytes == 4) {
    *reinterpret_cast<unsigned int*>(p) = r.w[0];
  } else {
    *reinterpret_cast<unsigned short*>(p) = (unsigned short)r.w[0];
  }
}

// 16-bit values <-> floats. A word holds elements (2i, 2i + 1) in its low and high halves; two
// floats round to one word in one instruction (round to nearest even, as one at a time).
template <typename T> struct Half16;
template <> struct Half16<__nv_bfloat16> {
  static __device__ __forceinline__ float lo(unsigned int w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
  static __device__ __forceinline__ unsigned int pack(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return (unsigned int)__bfloat16_as_ushort(h.x) | ((unsigned int)__bfloat16_as_ushort(h.y) << 16);
  }
  static __device__ __forceinline__ unsigned int one(float a) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(a));
  }
};
template <> struct Half16<__half> {
  static __device__ __forceinline__ float lo(unsigned int w) {
    return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
  }
  static __device__ __forceinline__ float hi(unsigned int w) {
    return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
  }
  static __device__ __forceinline__ unsigned int pack(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return (unsigned int)__half_as_ushort(h.x) | ((unsigned int)__half_as_ushort(h.y) << 16);
  }
  static __device__ __forceinline__ unsigned int one(float a) { return __half_as_ushort(__float2half_rn(a)); }
};

// V elements <-> V floats.
template <typename T, int V>
__device__ __forceinline__ void to_floats(const Vec<T, V>& v, float* x) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int e = 0; e < V; ++e) x[e] = __uint_as_float(v.w[e]);
  } else if constexpr (V == 1) {
    x[0] = Half16<T>::lo(v.w[0]);
  } else {
#pragma unroll
    for (int i = 0; i < V / 2; ++i) {
      x[2 * i] = Half16<T>::lo(v.w[i]);
      x[2 * i + 1] = Half16<T>::hi(v.w[i]);
    }
  }
}

template <typename T, int V>
__device__ __forceinline__ void from_floats(const float* y, Vec<T, V>& v) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int e = 0; e < V; ++e) v.w[e] = __float_as_uint(y[e]);
  } else if constexpr (V == 1) {
    v.w[0] = Half16<T>::one(y[0]);
  } else {
#pragma unroll
    for (int i = 0; i < V / 2; ++i) v.w[i] = Half16<T>::pack(y[2 * i], y[2 * i + 1]);
  }
}

// Element e of a unit held as two vectors (e < V in a, else in b), as a float (set_unit_pair
// writes a pair of them back).
template <typename T, int V>
__device__ __forceinline__ float unit_elem(const Vec<T, V>& a, const Vec<T, V>& b, int e) {
  const Vec<T, V>& v = e < V ? a : b;
  const int i = e % V;
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(v.w[i]);
  } else {
    return i & 1 ? Half16<T>::hi(v.w[i / 2]) : Half16<T>::lo(v.w[i / 2]);
  }
}

// The bits of element e of a 16-bit type (h below 2^16) written into a unit.
template <typename T, int V>
__device__ __forceinline__ void set_unit_bits(Vec<T, V>& a, Vec<T, V>& b, int e, unsigned int h) {
  Vec<T, V>& v = e < V ? a : b;
  const int i = e % V;
  unsigned int& w = v.w[i / 2];
  w = i & 1 ? (w & 0xffffu) | (h << 16) : (w & 0xffff0000u) | h;
}

// Elements f and g of a unit written from xf and xg, each rounded to nearest even (from_floats's
// bits): a 16-bit type's two in one conversion of the pair (Half16::pack).
template <typename T, int V>
__device__ __forceinline__ void set_unit_pair(Vec<T, V>& a, Vec<T, V>& b, int f, int g, float xf, float xg) {
  if constexpr (sizeof(T) == 4) {
    (f < V ? a : b).w[f % V] = __float_as_uint(xf);
    (g < V ? a : b).w[g % V] = __float_as_uint(xg);
  } else {
    const unsigned int h = Half16<T>::pack(xf, xg);
    set_unit_bits<T, V>(a, b, f, h & 0xffffu);
    set_unit_bits<T, V>(a, b, g, h >> 16);
  }
}

// Integer index tensors (cu_seqlens, start_positions) are int32 or int64, with any element
// stride (negative and 0 included): entry i is at addr + i * stride elements.
__device__ __forceinline__ i64 load_index(i64 addr, i64 is64, i64 stride, i64 i) {
  return is64 ? reinterpret_cast<const long long*>(addr)[i * stride]
              : (i64)reinterpret_cast<const int*>(addr)[i * stride];
}

// Entry i of a contiguous index array without widening (load_index's entry for stride 1): an
// int32 entry zero-extended, so that no instruction reads the loaded value before the caller
// widens it (widen_position). A kernel that loads a position first and its row's vectors after
// it thus issues the vector loads without waiting for the position.
__device__ __forceinline__ i64 load_index_raw(i64 addr, i64 is64, i64 i) {
  return is64 ? reinterpret_cast<const long long*>(addr)[i]
              : (i64)(unsigned)reinterpret_cast<const int*>(addr)[i];
}

// Python's floor division (cu_seqlens // cp_size), also for (invalid) negative values.
__device__ __forceinline__ i64 floor_div(i64 a, i64 b) {
  if (b == 1) return a;
  i64 q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

// ---------------------------------------------------------------- positions
// Spec section 5: everything that decides the position of a token. This is the only
// device-side definition; the Python one is cupy_rope/_positions.py.
struct PosArgs {
  i64 layout;          // 0 sbhd, 1 bshd, 2 thd
  i64 seq_len;         // sbhd/bshd: local sequence length s
  i64 nseq;            // thd: number of sequences (len(cu_seqlens) - 1)
  i64 cu_seqlens;      // thd: address of cu_seqlens[0]
  i64 cu_is64;
  i64 cu_stride;       // element stride of cu_seqlens
  i64 start_positions; // address of start_positions[0]; 0 when absent
  i64 sp_is64;
  i64 sp_stride;       // element stride of start_positions
  i64 cp_size, cp_rank;
  i64 positions;       // per-token positions (the positions API): address of positions[0], 0 when absent
  i64 ps_is64;
  i64 ps0, ps1;        // element strides of positions along the outer and inner token dims
};

// Context-parallel dual-chunk mapping, spec 5.1: local index j of a sequence of local
// length L on rank r -> position inside the global sequence.
__device__ __forceinline__ i64 cp_position(i64 j, i64 L, i64 cp_size, i64 cp_rank) {
  if (cp_size == 1) return j;
  const i64 c = L / 2;
  return j < c ? j + cp_rank * c : (2 * cp_size - 1 - cp_rank) * c + (j - c);
}

// Position of token (outer, inner) before the table-range check; false when the token
// belongs to no sequence (thd rows past the last sequence, or invalid cu_seqlens).
// sbhd: outer = s index, inner = b index; bshd: outer = b, inner = s; thd: outer = t.
// With per-token positions (the positions API) the token's entry is its position, any value.
// RAW: a per-token position is left as load_index_raw loads it (widen_position widens it).
template <bool RAW = false>
__device__ __forceinline__ bool token_position(const PosArgs& a, i64 outer, i64 inner, i64& pos) {
  if (a.positions) {
    const i64 i = outer * a.ps0 + inner * a.ps1;
    pos = RAW ? load_index_raw(a.positions, a.ps_is64, i) : load_index(a.positions, a.ps_is64, 1, i);
    return true;
  }
  i64 seq, j, L;
  if (a.layout == 2) {
    const i64 t = outer;
    if (a.nseq <= 0) return false;
    // Largest i in [0, nseq) with cu_seqlens[i] // cp <= t. Always in bounds and at most
    // ceil(log2(nseq)) steps, whatever the contents (checked afterwards).
    i64 lo = 0, hi = a.nseq;
    if (!a.cu_is64 && a.cu_stride == 1 && a.cp_size == 1 && a.nseq <= 0x7fffffff) {
      // The common case (contiguous int32 cu_seqlens, no context parallelism): the same search
      // in 32-bit steps of one load and a compare, which leaves the loop below nothing to do.
      // The lean kernel's threads each search (rope_lean_body): on the H200 this made its
      // launches of 1024 sequences 4% faster (benchmarks/NOTES.md, thirty-sixth session).
      const int* const cu = reinterpret_cast<const int*>(a.cu_seqlens);
      int l = 0, h = (int)a.nseq;
      while (h - l > 1) {
        const int mid = (int)(((unsigned)l + (unsigned)h) >> 1);  // no signed overflow
        if (cu[mid] <= t) l = mid;
        else h = mid;
      }
      lo = l, hi = l + 1;
    }
    while (hi - lo > 1) {
      const i64 mid = (lo + hi) >> 1;
      if (floor_div(load_index(a.cu_seqlens, a.cu_is64, a.cu_stride, mid), a.cp_size) <= t) lo = mid;
      else hi = mid;
    }
    const i64 start = floor_div(load_index(a.cu_seqlens, a.cu_is64, a.cu_stride, lo), a.cp_size);
    const i64 end = floor_div(load_index(a.cu_seqlens, a.cu_is64, a.cu_stride, lo + 1), a.cp_size);
    if (t < start || t >= end) return false;
    seq = lo;
    j = t - start;
    L = end - start;
  } else {
    seq = a.layout == 0 ? inner : outer;
    j = a.layout == 0 ? outer : inner;
    L = a.seq_len;
  }
  pos = cp_position(j, L, a.cp_size, a.cp_rank);
  // Added modulo 2^64 (defined wrap-around): a start position near 2^63 gives a negative
  // position, outside the table, and the token is copied (spec 5.4), as in the Python backends.
  if (a.start_positions)
    pos = (i64)((unsigned long long)pos + (unsigned long long)load_index(a.start_positions, a.sp_is64, a.sp_stride, seq));
  return true;
}

// The position token_position<true> gave, widened: a per-token int32 entry sign-extended.
__device__ __forceinline__ i64 widen_position(const PosArgs& a, i64 pos) {
  return a.positions && !a.ps_is64 ? (i64)(int)pos : pos;
}

// Rows of the angle table that a position may read (spec 5.4: others are copied through).
__device__ __forceinline__ bool in_table(bool valid, i64 pos, i64 rows) {
  return valid && pos >= 0 && pos < rows;
}

// n / d for n < 2^31 and a launch-constant divisor 1 <= d <= 2^31 given as `magic` = m | s << 32
// (s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1: cupy_rope/_worksplit.py fast_divisor):
// one multiply-high, an add and a shift.
__device__ __forceinline__ unsigned fast_div(unsigned n, i64 magic) {
  return (__umulhi(n, (unsigned)magic) + n) >> (unsigned)(magic >> 32);
}

// Programmatic dependent launch (sm_90 and later; the launch layer launches with the programmatic
// stream serialization attribute there, cupy_rope/_launch.py): the kernel may be scheduled while
// the previous kernel on the stream finishes. Every kernel body calls this after the index
// arithmetic on its parameters and before its first global memory access: it waits for the
// previous kernel to complete and its memory to be visible, then lets the next programmatic launch
// be scheduled (which waits likewise for this one). Launched without the attribute: no-ops.
__device__ __forceinline__ void await_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Threads of a block that exchange values through shared memory (exchange_slots: the one-row
// kernels' shared cos/sin, rope.cu) meet here once, after writing and before reading; every thread
// of the block reaches the call (none has returned before it). Returns whether the code after the
// exchange runs: on the device always, after a barrier when `sync` (uniform over the block). The
// host build runs each block of these kernels twice and returns false in the first run (host_shim.h).
#ifndef CUPY_ROPE_EXCHANGE
__device__ __forceinline__ bool exchange_barrier(bool sync) {
  if (sync) __syncthreads();
  return true;
}
#endif

// A thread that could not use the shared cos/sin (rope.cu): counted by the host build for its tests.
#ifndef CUPY_ROPE_COUNT_UNSHARED
#define CUPY_ROPE_COUNT_UNSHARED()
#endif
// A row rotated by rotate_fresh: counted by the host build for its tests.
#ifndef CUPY_ROPE_COUNT_FRESH
#define CUPY_ROPE_COUNT_FRESH()
#endif
// A unit's cos/sin loaded from a cache as whole vectors: counted by the host build for its tests.
#ifndef CUPY_ROPE_COUNT_CACHE_VEC
#define CUPY_ROPE_COUNT_CACHE_VEC()
#endif
// A thread that loaded its token's position before its rows' vectors (rope.cu, rope_one_body):
// counted by the host build for its tests.
#ifndef CUPY_ROPE_COUNT_POSITION_FIRST
#define CUPY_ROPE_COUNT_POSITION_FIRST()
#endif

// Quotient and remainder; 32-bit division when both fit (64-bit division is slow).
__device__ __forceinline__ void divmod(i64 a, i64 b, i64& q, i64& r) {
  if (((unsigned long long)(a | b) >> 32) == 0) {
    const unsigned int qa = (unsigned int)a / (unsigned int)b;
    q = qa;
    r = a - q * b;
  } else {
    q = a / b;
    r = a - q * b;
  }
}

// ---------------------------------------------------------------- one unit of work
// A rotary "unit" is 2V channels of one row: vectors at channels base0 and base1.
//   non-interleaved: base0 = u*V, base1 = h2 + u*V; pair m = (m, V + m)
//   interleaved:     base0 = 2uV, base1 = 2uV + V; pair m = (2m, 2m + 1) of the 2V channels
// Element e of the unit (0 <= e < 2V) is channel base0 + e (e < V) or base1 + e - V.
template <bool INTERLEAVED>
__device__ __forceinline__ void unit_bases(i64 u, i64 h2, int V, i64& base0, i64& base1) {
  if (INTERLEAVED) {
    base0 = 2 * u * V;
    base1 = base0 + V;
  } else {
    base0 = u * V;
    base1 = h2 + u * V;
  }
}

template <bool INTERLEAVED, int V>
__device__ __forceinline__ void pair_index(int m, int& f, int& s) {
  f = INTERLEAVED ? 2 * m : m;
  s = INTERLEAVED ? 2 * m + 1 : V + m;
}

// Channel of element e of a unit whose vectors start at channels c0 and c1.
template <int V>
__device__ __forceinline__ i64 unit_channel(int e, i64 c0, i64 c1) {
  return e < V ? c0 + e : c1 + e - V;
}

// Spec sections 3 and 4 on one unit in registers: x[0..2V) (element e = channel base0 + e for
// e < V, base1 + e - V otherwise), pair m = (f, g) = pair_index(m), its cos/sin cf[m], sf[m]
// (first member's angle) and cg[m], sg[m] (second member's angle). In place.
//   forward:  y_f = x_f cos_f - x_g sin_f ;  y_g = x_g cos_g + x_f sin_g
//   backward: d_f = g_f cos_f + g_g sin_g ;  d_g = g_g cos_g - g_f sin_f
template <bool BACKWARD>
__device__ __forceinline__ void rotate_pair(float& xf, float& xg, float cf, float sf, float cg, float sg) {
  const float f = xf, g = xg;
  if (BACKWARD) {
    xf = f * cf + g * sg;
    xg = g * cg + (-f) * sf;
  } else {
    xf = f * cf + (-g) * sf;
    xg = g * cg + f * sg;
  }
}

template <int V, bool INTERLEAVED, bool BACKWARD>
__device__ __forceinline__ void rotate_unit(float* x, const float* cf, const float* sf, const float* cg,
                                            const float* sg) {
#pragma unroll
  for (int m = 0; m < V; ++m) {
    int f, g;
    pair_index<INTERLEAVED, V>(m, f, g);
    rotate_pair<BACKWARD>(x[f], x[g], cf[m], sf[m], cg[m], sg[m]);
  }
}

// The unit's 2V angles from table row `trow` (channels c0.., c1.., column stride scol): first
// members af[m], second members ag[m]. True when every pair's two angles are equal (any
// standard table), so that one cos/sin per pair serves both members.
template <bool INTERLEAVED, int V>
__device__ __forceinline__ bool unit_angles(const float* __restrict__ trow, i64 c0, i64 c1, i64 scol,
                                            float* af, float* ag) {
  bool eq = true;
#pragma unroll
  for (int m = 0; m < V; ++m) {
    int f, g;
    pair_index<INTERLEAVED, V>(m, f, g);
    af[m] = trow[unit_channel<V>(f, c0, c1) * scol];
    ag[m] = trow[unit_channel<V>(g, c0, c1) * scol];
    eq = eq && af[m] == ag[m];
  }
  return eq;
}

// What a thread does to a row of its unit: rotate with the cos/sin it holds (one per pair, every
// pair of the unit having equal angles: any standard table), rotate with cos/sin computed for
// the row (tables whose pairs have two different angles; a second table), or copy.
enum RowMode { kHeld = 0, kCopy = 1, kFresh = 2 };

// One output row: where its two vectors go, and how it is computed (trow/scol: its table row
// for kFresh).
template <typename T> struct OutRow {
  T* p0;
  T* p1;
  int mode;
  const float* trow;
  i64 scol;
};

// kFresh: cos/sin of the unit's 2V angles for this row alone, one pair at a time (a loop that is
// not unrolled, over a copy of the unit in local memory), so that this rare path needs few
// registers and does not lower the streaming loop's occupancy.
template <int V, bool INTERLEAVED, bool BACKWARD>
__device__ __forceinline__ void rotate_fresh(float* x, const float* __restrict__ trow, i64 c0, i64 c1, i64 scol) {
  CUPY_ROPE_COUNT_FRESH();
  float xs[2 * V];
#pragma unroll
  for (int e = 0; e < 2 * V; ++e) xs[e] = x[e];
#pragma unroll 1
  for (int m = 0; m < V; ++m) {
    int f, g;
    pair_index<INTERLEAVED, V>(m, f, g);
    const float af = trow[unit_channel<V>(f, c0, c1) * scol];
    const float ag = trow[unit_channel<V>(g, c0, c1) * scol];
    float sf, cf, sg, cg;
    sincosf(af, &sf, &cf);
    sincosf(ag, &sg, &cg);
    rotate_pair<BACKWARD>(xs[f], xs[g], cf, sf, cg, sg);
  }
#pragma unroll
  for (int e = 0; e < 2 * V; ++e) x[e] = xs[e];
}

// The cos/sin a thread holds for its unit: computed once (one sincosf per pair) when every pair
// of the unit has equal angles in table row `trow`; returns the mode of rows using this table
// row (kCopy when trow is nullptr: position outside the table).
template <bool INTERLEAVED, int V>
__device__ __forceinline__ int held_sincos(const float* __restrict__ trow, i64 c0, i64 c1, i64 scol,
                                           float* cm, float* sm) {
  if (trow == nullptr) return kCopy;
  float af[V], ag[V];
  if (!unit_angles<INTERLEAVED, V>(trow, c0, c1, scol, af, ag)) return kFresh;
#pragma unroll
  for (int m = 0; m < V; ++m) sincosf(af[m], &sm[m], &cm[m]);
  return kHeld;
}

// What the rope kernels' table holds (RopeParams::f_kind; the QKV kernels take angle tables only).
//   kAngles:   float32 angles [rows, d2], one per channel (spec 2)
//   kCosSin32: float32 cos/sin cache [rows, d2]: cos of pair i in column i, sin in column d2/2 + i
//   kCosSinT:  the same cache in the tensor's own dtype
//   kInvF64 / kInvF32: inverse frequencies [d2/2] (float64 / float32): pair i of a token at
//              position pos turns by the angle pos * inv[i], formed and evaluated in float64
enum TableKind { kAngles = 0, kCosSin32 = 1, kCosSinT = 2, kInvF64 = 3, kInvF32 = 4 };

template <typename T>
__device__ __forceinline__ float table_value(i64 kind, i64 addr, i64 i) {
  if constexpr (sizeof(T) == 4) {
    return reinterpret_cast<const float*>(addr)[i];
  } else {
    if (kind == kCosSin32) return reinterpret_cast<const float*>(addr)[i];
    return Half16<T>::lo(reinterpret_cast<const unsigned short*>(addr)[i]);
  }
}

// Whole 16-byte loads of a cache's cos/sin runs where they are contiguous and aligned (below);
// 0: one load per value everywhere (a tuning define, benchmarks/NOTES.md).
#ifndef CUPY_ROPE_CACHE_VEC
#define CUPY_ROPE_CACHE_VEC 1
#endif

// The cos/sin of pairs i0 .. i0 + V - 1 from a cos/sin cache (kinds 1-2), row at element `row`:
// cos of pair i in column i, sin in column h2 + i (column stride scol). With 16-byte element
// vectors, where the columns are contiguous (scol 1) and both runs start on 16 bytes (the rows of
// a cache from rope_cos_sin_cache), the runs come in whole 16-byte loads: one each from a cache in
// the tensors' 16-bit dtype, two from a float32 cache; otherwise one load per value.
template <typename T, int V>
__device__ __forceinline__ void cache_sincos(i64 kind, i64 addr, i64 row, i64 scol, i64 h2, i64 i0,
                                             float* cm, float* sm) {
  if constexpr (CUPY_ROPE_CACHE_VEC && Vec<T, V>::kBytes == 16) {
    const bool f32 = sizeof(T) == 4 || kind == kCosSin32;
    const i64 esz = f32 ? 4 : 2, ca = addr + (row + i0) * esz, sa = addr + (row + h2 + i0) * esz;
    if (scol == 1 && ((ca | sa) & 15) == 0) {
      CUPY_ROPE_COUNT_CACHE_VEC();
      if (f32) {
#pragma unroll
        for (int q = 0; q < V / 4; ++q) {
          to_floats<float, 4>(load_vec<float, 4>(reinterpret_cast<const float*>(ca) + 4 * q), cm + 4 * q);
          to_floats<float, 4>(load_vec<float, 4>(reinterpret_cast<const float*>(sa) + 4 * q), sm + 4 * q);
        }
      } else {
        to_floats<T, V>(load_vec<T, V>(reinterpret_cast<const T*>(ca)), cm);
        to_floats<T, V>(load_vec<T, V>(reinterpret_cast<const T*>(sa)), sm);
      }
      return;
    }
  }
#pragma unroll
  for (int m = 0; m < V; ++m) {
    cm[m] = table_value<T>(kind, addr, row + (i0 + m) * scol);
    sm[m] = table_value<T>(kind, addr, row + (h2 + i0 + m) * scol);
  }
}

// The cos/sin a thread holds for its unit (first channel c0 of the rotary slice: its first pair
// is i0 = c0, interleaved c0 / 2) from a cos/sin cache row or inverse frequencies (kinds 1-4), for
// a token at position `pos` inside the table. Row stride srow, column stride scol, h2 = d2 / 2.
template <typename T, bool INTERLEAVED, int V>
__device__ __forceinline__ void table_sincos(i64 kind, i64 addr, i64 pos, i64 srow, i64 scol, i64 h2, i64 c0,
                                             float* cm, float* sm) {
  const i64 i0 = INTERLEAVED ? c0 / 2 : c0;
  if (kind == kInvF64 || kind == kInvF32) {
#pragma unroll
    for (int m = 0; m < V; ++m) {
      const i64 j = (i0 + m) * scol;
      const double f = kind == kInvF64 ? reinterpret_cast<const double*>(addr)[j]
                                       : (double)reinterpret_cast<const float*>(addr)[j];
      double s, c;
      sincos((double)pos * f, &s, &c);
      sm[m] = (float)s;
      cm[m] = (float)c;
    }
  } else {
    cache_sincos<T, V>(kind, addr, pos * srow, scol, h2, i0, cm, sm);
  }
}

// Rows a thread keeps loading ahead of the row it processes in registers (Rows::kDepth; vectors
// under 16 bytes, or CUPY_ROPE_ASYNC 0; measured on the H200, benchmarks/NOTES.md): rope kernels
// 2, QKV kernels 1 (more registers there).
#ifndef CUPY_ROPE_DEPTH
#define CUPY_ROPE_DEPTH 2
#endif
#ifndef CUPY_QKV_DEPTH
#define CUPY_QKV_DEPTH 1
#endif
constexpr int kAnyMode = -1;

// Rows in flight through shared memory (CUPY_ROPE_ASYNC = 1, the default): the rows' 16-byte
// vectors are fetched by asynchronous copies (cp.async, sm_80 and later) into a ring of slots
// private to each thread, CUPY_ROPE_ASYNC_DEPTH rows ahead of the row being rotated, so that the
// loads in flight hold no registers (measured against the register loop and other depths on the
// H200: benchmarks/NOTES.md). Each thread reads back only its own slots (no barrier). The host
// build copies at once (host_shim.h: CUPY_ROPE_SHARED, a thread's ring in host memory).
// Threads per block: cupy_rope passes the launch layer's (_kernels.BLOCK, in every build); the
// default serves compiles of the source outside it.
#ifndef CUPY_ROPE_BLOCK
#define CUPY_ROPE_BLOCK 256
#endif
#ifndef CUPY_ROPE_ASYNC
#define CUPY_ROPE_ASYNC 1
#endif
#ifndef CUPY_ROPE_ASYNC_DEPTH
#define CUPY_ROPE_ASYNC_DEPTH 2
#endif
// The mixed kernels' depth (ropem_; stream_unit's MIXED): one row in flight. With 80 registers
// (CUPY_ROPEM_MIN_BLOCKS) it ran partial-rotary launches 4-22% faster (H100; row 5 7% on the H200)
// than two rows with 64 (benchmarks/NOTES.md, thirty-sixth and thirty-seventh sessions).
#ifndef CUPY_ROPEM_ASYNC_DEPTH
#define CUPY_ROPEM_ASYNC_DEPTH 1
#endif
#ifndef CUPY_ROPE_SHARED
#define CUPY_ROPE_SHARED __shared__
#endif
#if CUPY_ROPE_ASYNC
// Slot (j, vector w) of thread t: word (2 j + w) * blockDim.x + t of ring_slots (consecutive
// threads, consecutive 16-byte words: conflict-free); slots for the deeper of the two depths.
constexpr int kRingSlots =
    (CUPY_ROPE_ASYNC_DEPTH > CUPY_ROPEM_ASYNC_DEPTH ? CUPY_ROPE_ASYNC_DEPTH : CUPY_ROPEM_ASYNC_DEPTH) + 1;
CUPY_ROPE_SHARED uint4 ring_slots[CUPY_ROPE_BLOCK * 2 * kRingSlots];
#endif

// One (cos, sin) per thread of a block (at most CUPY_ROPE_BLOCK threads), written and read around
// exchange_barrier.
CUPY_ROPE_SHARED float2 exchange_slots[CUPY_ROPE_BLOCK];

// A ring word's address: a 32-bit shared-memory address on the device, a pointer in the host build.
#if defined(__CUDA_ARCH__)
typedef unsigned RingAddr;
constexpr unsigned kRingWord = 16;
__device__ __forceinline__ RingAddr ring_addr(uint4* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void async_copy16(RingAddr dst, const void* src) {
#if __CUDA_ARCH__ >= 800
  // .ca (through L1), not .cg: a unit's two vectors often share a 32-byte sector (interleaved
  // pairs, pass-through channels, rows of 80 channels), and the second copy then hits L1;
  // with .cg such shapes lost 7-16 points of the copy's speed (benchmarks/NOTES.md).
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#else  // no asynchronous copies: a load and a store (same results, nothing in flight)
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
#endif
}
__device__ __forceinline__ uint4 ring_read(RingAddr a) {
  uint4 r;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(a) : "memory");
  return r;
}
#else
typedef uint4* RingAddr;
constexpr unsigned kRingWord = 1;
inline RingAddr ring_addr(uint4* p) { return p; }
inline void async_copy16(RingAddr dst, const void* src) {
  if (CUPY_ROPE_ALIGNED(src, 16)) *dst = *reinterpret_cast<const uint4*>(src);
}
inline uint4 ring_read(RingAddr a) { return *a; }
#endif
__device__ __forceinline__ void async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Wait until at most N committed groups of this thread are pending.
template <int N> __device__ __forceinline__ void async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// A loop's MODE (besides a RowMode every row of the loop has): kAnyMode, each row's own
// (OutRow::mode); kHeldOrCopy, the thread's rows are all kHeld or all kCopy (OutRow::mode), and
// whether the unit has a second vector is known at run time (the mixed kernels, stream_unit).
constexpr int kHeldOrCopy = -2;

// The rotation of one row in registers (the loops' step): a, b rotated in place by the mode
// (`mode`, the row's, where MODE is kAnyMode or kHeldOrCopy).
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, bool PAIR, int MODE>
__device__ __forceinline__ void rotate_row(int mode, Vec<T, V>& a, Vec<T, V>& b, const float* cm, const float* sm,
                                           const OutRow<T>& o, i64 c0, i64 c1) {
  const int m = MODE < 0 ? mode : MODE;
  if (PAIR && m != kCopy) {
    float v[2 * V];
    to_floats<T, V>(a, v);
    to_floats<T, V>(b, v + V);
    if (MODE == kHeldOrCopy || m == kHeld) {
      rotate_unit<V, INTERLEAVED, BACKWARD>(v, cm, sm, cm, sm);
    } else {
      rotate_fresh<V, INTERLEAVED, BACKWARD>(v, o.trow, c0, c1, o.scol);
    }
    from_floats<T, V>(v, a);
    from_floats<T, V>(v + V, b);
  }
}

#if CUPY_ROPE_ASYNC
// A thread's ring: DEPTH + 1 slots of two 16-byte vectors (DEPTH rows in flight). Rows are issued
// into the slots in order (fill) and read back in order (s).
template <int DEPTH> struct Ring {
  RingAddr base;
  unsigned nb;  // from a slot's first vector to its second
  int fill, s;  // slot of the next row to issue, of the next row to read
  static constexpr int D = DEPTH, S = D + 1;
  static_assert(D >= 1 && S <= kRingSlots, "a ring's depth: 1 to the slots of ring_slots less one");
  __device__ __forceinline__ void step(int& i) { i = i == S - 1 ? 0 : i + 1; }
  template <typename T, class Rows> __device__ __forceinline__ void issue(Rows& rows, bool pair) {
    const T *p0, *p1;
    rows.in(p0, p1);
    const RingAddr at = base + 2 * fill * nb;
    async_copy16(at, p0);
    if (pair) async_copy16(at + nb, p1);
    step(fill);
  }
};

template <int DEPTH> __device__ __forceinline__ Ring<DEPTH> ring_open() {
  return Ring<DEPTH>{ring_addr(ring_slots + threadIdx.x), blockDim.x * kRingWord, 0, 0};
}

// Rows 0 .. D - 1 issued (one commit group each, empty past cnt).
template <typename T, class R, class Rows>
__device__ __forceinline__ void ring_prime(R& r, int cnt, Rows& rows, bool pair) {
#pragma unroll
  for (int j = 0; j < R::D; ++j) {
    if (j < cnt) r.template issue<T>(rows, pair);
    async_commit();
  }
}

// stream_rows over a primed ring: row k + D is issued, then row k is read back, rotated and stored.
// MODE kHeldOrCopy: `pair` says whether the unit has a second vector (otherwise PAIR does).
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, bool PAIR, int MODE, class R, class Rows>
__device__ __forceinline__ void ring_stream(R& r, int cnt, Rows& rows, const float* cm, const float* sm, i64 c0,
                                            i64 c1, bool pair = true) {
  static_assert(Vec<T, V>::kBytes == 16, "the ring holds 16-byte vectors");
  const bool two = MODE == kHeldOrCopy ? pair : PAIR;
  for (int k = 0; k < cnt; ++k) {
    if (k + R::D < cnt) r.template issue<T>(rows, two);  // row k + D, into the slot of row k - 1, read back
    async_commit();
    async_wait<R::D>();  // row k's group is complete
    const RingAddr at = r.base + 2 * r.s * r.nb;
    r.step(r.s);
    Vec<T, V> a = vec_of<T, V>(ring_read(at)), b;
    if (two) b = vec_of<T, V>(ring_read(at + r.nb));
    const OutRow<T> o = rows.out(k);
    rotate_row<T, V, INTERLEAVED, BACKWARD, PAIR, MODE>(o.mode, a, b, cm, sm, o, c0, c1);
    store_vec<T, V>(o.p0, a);
    if (two) store_vec<T, V>(o.p1, b);
  }
}

// ring_stream of kFresh rows for the mixed kernels, out of line (as fresh_rows): inlined next to
// the kHeldOrCopy loop, its local copy of the unit (rotate_fresh) sent that loop's rotated values
// through local memory too (measured: half the copy's speed, benchmarks/NOTES.md).
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, class R, class Rows>
__device__ __noinline__ void ring_fresh(R r, int cnt, Rows rows, i64 c0, i64 c1) {
  ring_stream<T, V, INTERLEAVED, BACKWARD, true, kFresh>(r, cnt, rows, nullptr, nullptr, c0, c1);
}
#endif

// One thread's work: rows k = 0 .. cnt-1 (cnt >= 1) of one unit (c0, c1: its channels). `rows`
// gives the next row's input vectors (rows.in(p0, p1): rows in increasing order) and row k's
// OutRow (rows.out(k)), called for k in increasing order. Row k + Rows::kDepth is loaded (into registers) before row k is processed
// and stored, so that every thread always has loads in flight. PAIR: two vectors per unit
// (otherwise one: a tail unit, copied). MODE: every row's mode when known here (a loop per mode
// keeps each lean), or kAnyMode (each row's own). cm/sm: the held cos/sin. Every element is read
// once and written once. (ring_stream is the same loop over the shared-memory ring.)
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, bool PAIR, int MODE, class Rows>
__device__ __forceinline__ void stream_rows(int cnt, Rows& rows, const float* cm, const float* sm, i64 c0,
                                            i64 c1) {
  constexpr int kDepth = Rows::kDepth;
  constexpr int S = kDepth + 1;
  Vec<T, V> a[S], b[S];
  auto load = [&](Vec<T, V>& va, Vec<T, V>& vb) {  // the next row
    const T *p0, *p1;
    rows.in(p0, p1);
    va = load_vec<T, V>(p0);
    if (PAIR) vb = load_vec<T, V>(p1);
  };
#pragma unroll
  for (int j = 0; j < kDepth; ++j) {
    if (j < cnt) load(a[j], b[j]);
  }
  for (int k0 = 0;; k0 += S) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const int k = k0 + s;
      if (k >= cnt) return;
      if (k + kDepth < cnt) load(a[(s + kDepth) % S], b[(s + kDepth) % S]);  // row k + kDepth
      const OutRow<T> o = rows.out(k);
      rotate_row<T, V, INTERLEAVED, BACKWARD, PAIR, MODE>(o.mode, a[s], b[s], cm, sm, o, c0, c1);
      store_vec<T, V>(o.p0, a[s]);
      if (PAIR) store_vec<T, V>(o.p1, b[s]);
    }
  }
}

// All rows of a unit in kFresh mode (uniform rows), one at a time. Out of line and called where
// little else is live, so that the registers of this rare path do not count against the
// streaming loop's occupancy.
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, class Rows>
__device__ __noinline__ void fresh_rows(int cnt, Rows rows, i64 c0, i64 c1) {
  for (int k = 0; k < cnt; ++k) {
    const T *p0, *p1;
    rows.in(p0, p1);
    Vec<T, V> a = load_vec<T, V>(p0), b = load_vec<T, V>(p1);
    const OutRow<T> o = rows.out(k);
    float v[2 * V];
    to_floats<T, V>(a, v);
    to_floats<T, V>(b, v + V);
    rotate_fresh<V, INTERLEAVED, BACKWARD>(v, o.trow, c0, c1, o.scol);
    from_floats<T, V>(v, a);
    from_floats<T, V>(v + V, b);
    store_vec<T, V>(o.p0, a);
    store_vec<T, V>(o.p1, b);
  }
}

// The streaming loop a unit's rows take, as a tag Loop<PAIR, MODE> passed to `run`: a tail unit
// of one vector (copied), rows of mixed modes (!Rows::kUniform), or one loop per mode when every
// row has the thread's mode (rows.mode, set by init).
template <bool PAIR, int MODE> struct Loop {
  static constexpr bool kPair = PAIR;
  static constexpr int kMode = MODE;
};
template <class Rows, class Run>
__device__ __forceinline__ void for_mode(bool pair, const Rows& rows, Run run) {
  if (!pair) {
    run(Loop<false, kCopy>{});
  } else if constexpr (!Rows::kUniform) {
    run(Loop<true, kAnyMode>{});
  } else if (rows.mode == kHeld) {
    run(Loop<true, kHeld>{});
  } else if (rows.mode == kFresh) {
    run(Loop<true, kFresh>{});
  } else {
    run(Loop<true, kCopy>{});
  }
}

// A unit's rows: `init(cm, sm)` computes the position, the angles and the held cos/sin and sets
// the rows' modes; then the loop for_mode picks: ring_stream (16-byte vectors with
// CUPY_ROPE_ASYNC, the first rows issued before init), else stream_rows (fresh_rows for kFresh).
// MIXED (the mixed kernels, ropem_: 16-byte vectors of uniform rows, for launches whose rows
// hold rotated and copied units, i.e. a rotary slice narrower than the head): one ring loop for
// kHeld and kCopy units alike, so that the lanes of a warp, which hold both, stream together
// (per-mode loops run one after the other); kFresh rows out of line (ring_fresh). Measured in
// benchmarks/NOTES.md; the other kernels keep the per-mode loops (faster where units agree).
// Outside the ring (other vector sizes, CUPY_ROPE_ASYNC 0) MIXED changes nothing.
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, bool MIXED = false, class Rows, class Init>
__device__ __forceinline__ void stream_unit(bool pair, int cnt, Rows& rows, Init init, i64 c0, i64 c1) {
  if (cnt <= 0) return;
  float cm[V], sm[V];
#if CUPY_ROPE_ASYNC
  if constexpr (Vec<T, V>::kBytes == 16) {
    // The first rows' copies fly while init computes the position and cos/sin (they hold no
    // registers); the rare kFresh rows stream here too (rotate_fresh per row).
    auto ring = ring_open<MIXED ? CUPY_ROPEM_ASYNC_DEPTH : CUPY_ROPE_ASYNC_DEPTH>();
    ring_prime<T>(ring, cnt, rows, pair);
    init(cm, sm);
    if constexpr (MIXED) {
      if (pair && rows.mode == kFresh) {
        ring_fresh<T, V, INTERLEAVED, BACKWARD>(ring, cnt, rows, c0, c1);
      } else {
        ring_stream<T, V, INTERLEAVED, BACKWARD, true, kHeldOrCopy>(ring, cnt, rows, cm, sm, c0, c1, pair);
      }
      return;
    }
    for_mode(pair, rows, [&](auto loop) {
      using L = decltype(loop);
      ring_stream<T, V, INTERLEAVED, BACKWARD, L::kPair, L::kMode>(ring, cnt, rows, cm, sm, c0, c1);
    });
    return;
  }
#endif
  init(cm, sm);
  for_mode(pair, rows, [&](auto loop) {
    using L = decltype(loop);
    if constexpr (L::kMode == kFresh) {
      fresh_rows<T, V, INTERLEAVED, BACKWARD>(cnt, rows, c0, c1);
    } else {
      stream_rows<T, V, INTERLEAVED, BACKWARD, L::kPair, L::kMode>(cnt, rows, cm, sm, c0, c1);
    }
  });
}

// Channels of unit u of a row: rotary units (u < n_rot) hold V pairs (unit_bases); tail units
// (channels d2..d, copied) hold tail_w (1 or 2) vectors. Returns whether the unit is rotary.
template <bool INTERLEAVED>
__device__ __forceinline__ bool unit_channels(i64 u, i64 n_rot, i64 d2, i64 tail_w, int V, i64& cb0,
                                              i64& cb1, bool& pair) {
  if (u < n_rot) {
    unit_bases<INTERLEAVED>(u, d2 / 2, V, cb0, cb1);
    pair = true;
    return true;
  }
  cb0 = d2 + (u - n_rot) * tail_w * V;
  cb1 = cb0 + V;
  pair = tail_w == 2;
  return false;
}

// Channel of the row holding slice channel v (unit_channels' numbering: the rotary slice is
// 0..d2, the pass-through channels d2..d), when the rotary slice starts at channel `off` of the
// row: rotary v -> off + v; the pass-through channels fill 0..off, then off + d2..d.
__device__ __forceinline__ i64 row_channel(i64 v, i64 d2, i64 off) {
  return v < d2 ? v + off : (v - d2 < off ? v - d2 : v);
}

// Whether block `b` of a two-tensor launch works on the first tensor (the grid's first `blocks0`
// blocks) or the second (the rest); `blk`: the block's index in its tensor's part.
__device__ __forceinline__ bool first_part(i64 blocks0, unsigned b, unsigned& blk) {
  const bool first = b < (unsigned long long)blocks0;
  blk = first ? b : b - (unsigned)blocks0;
  return first;
}

}  // namespace cupy_rope

// Kernel entry points: one extern "C" function per instantiation (names in cupy_rope/_kernels.py).
// The host build (host_shim.h) defines CUPY_ROPE_ENTRY itself.
// Resident blocks per SM the compiler must allow (caps registers per thread: 4 -> 64, 3 -> 80).
#ifndef CUPY_ROPE_MIN_BLOCKS
#define CUPY_ROPE_MIN_BLOCKS 4
#endif
// The mixed kernels' (ropem_): 80 registers; at 64 their 16-bit builds spilled 120-176 bytes, at 80
// 0-32 (benchmarks/NOTES.md, as above).
#ifndef CUPY_ROPEM_MIN_BLOCKS
#define CUPY_ROPEM_MIN_BLOCKS 3
#endif
#ifndef CUPY_QKV_MIN_BLOCKS
#define CUPY_QKV_MIN_BLOCKS 3
#endif
#ifndef CUPY_ROPE_ENTRY
#define CUPY_ROPE_ENTRY(NAME, PARAMS, BODY, MIN_BLOCKS)                                        \
  extern "C" __global__ void __launch_bounds__(CUPY_ROPE_BLOCK, MIN_BLOCKS) NAME(const PARAMS p) { \
    BODY(p, blockIdx.x);                                                                         \
  }
// Two parameter blocks (two tensors, e.g. q and k, in one launch; first_part): a launch of one
// tensor has p0.blocks = its grid and never reads p1.
#define CUPY_ROPE_ENTRY_PAIR(NAME, PARAMS, BODY, MIN_BLOCKS)                                   \
  extern "C" __global__ void __launch_bounds__(CUPY_ROPE_BLOCK, MIN_BLOCKS)                      \
      NAME(const PARAMS p0, const PARAMS p1) {                                                   \
    unsigned blk;                                                                                \
    if (cupy_rope::first_part(p0.blocks, blockIdx.x, blk)) {                                     \
      BODY(p0, blk);                                                                             \
    } else {                                                                                     \
      BODY(p1, blk);                                                                             \
    }                                                                                            \
  }
// The same for bodies with an exchange (exchange_barrier; the host build runs them in two phases).
#define CUPY_ROPE_ENTRY_PAIR_EXCHANGE CUPY_ROPE_ENTRY_PAIR
#endif

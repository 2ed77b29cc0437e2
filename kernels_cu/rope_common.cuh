// cupy_rope: pieces shared by every RoPE kernel.
//
// Semantics: ../shared/ROPE_SPEC.md (sections 3-6). Framework-free: only CUDA headers.
// The same source is compiled three ways:
//   * NVRTC through CuPy (the GPU path),
//   * NVRTC alone for sm_90 (CI compiles every instantiation without a GPU),
//   * g++ with kernels_cu/host_shim.h (CI runs the kernels on the CPU).
// Every launch takes one parameter struct of 64-bit fields, packed by the Python
// launch layer (cupy_rope/_launch.py, field order in cupy_rope/_plan.py).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;

namespace cupy_rope {

// ---------------------------------------------------------------- dtype helpers
template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// V consecutive elements; 16 bytes at most, so that an aligned access is one LDG.128/STG.128.
template <typename T, int V> struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// The machine word of a vector, so that loads and stores are single vector instructions
// (a struct of bf16 elements is otherwise stored element by element).
template <int BYTES> struct RawWord;
template <> struct RawWord<2> { typedef unsigned short type; };
template <> struct RawWord<4> { typedef unsigned int type; };
template <> struct RawWord<8> { typedef uint2 type; };
template <> struct RawWord<16> { typedef uint4 type; };

template <typename T, int V> union VecWord {
  Vec<T, V> vec;
  typename RawWord<sizeof(T) * V>::type word;
};

// Load/store V elements starting at element offset `off`. V > 1 is only chosen by the host
// when the channel stride is 1 and the address is aligned to the vector size; V == 1
// honours any stride (the caller multiplies the channel index by it).
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* __restrict__ base, i64 off) {
  typedef typename RawWord<sizeof(T) * V>::type W;
  VecWord<T, V> u;
  u.word = *reinterpret_cast<const W*>(base + off);
  return u.vec;
}


// Round V floats to T and store them with one vector instruction: pairs of 16-bit values
// are packed into 32-bit words first (a union of bf16 elements is otherwise split into
// 16-bit stores by the compiler).
__device__ __forceinline__ unsigned int bits_of(float a) { return __float_as_uint(a); }
template <typename T> __device__ __forceinline__ unsigned int bits16(float a) { return __float_as_uint(a); }
template <> __device__ __forceinline__ unsigned int bits16<__half>(float a) {
  return __half_as_ushort(__float2half_rn(a));
}
template <> __device__ __forceinline__ unsigned int bits16<__nv_bfloat16>(float a) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(a));
}

// One 16-byte store (the compiler otherwise sometimes splits a uint4 built from registers).
__device__ __forceinline__ void store_words16(void* p, unsigned int a, unsigned int b, unsigned int c,
                                              unsigned int d) {
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
#else
  *reinterpret_cast<uint4*>(p) = make_uint4(a, b, c, d);
#endif
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* __restrict__ base, i64 off, const Vec<T, V>& r) {
  typedef typename RawWord<sizeof(T) * V>::type W;
  VecWord<T, V> u;
  u.vec = r;
  if (sizeof(W) == 16) {
    const uint4& q = reinterpret_cast<const uint4&>(u.word);
    store_words16(base + off, q.x, q.y, q.z, q.w);
  } else {
    *reinterpret_cast<W*>(base + off) = u.word;
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_floats(T* __restrict__ base, i64 off, const float* y) {
  constexpr int BYTES = sizeof(T) * V;
  constexpr int WORDS = BYTES >= 4 ? BYTES / 4 : 1;
  unsigned int w[WORDS];
  if (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) w[i] = bits_of(y[i]);
  } else if (V >= 2) {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) w[i] = bits16<T>(y[2 * i]) | (bits16<T>(y[2 * i + 1]) << 16);
  } else {
    w[0] = bits16<T>(y[0]);
  }
  if (BYTES == 16) {
    store_words16(base + off, w[0], w[WORDS > 1 ? 1 : 0], w[WORDS > 2 ? 2 : 0], w[WORDS > 3 ? 3 : 0]);
  } else if (BYTES == 8) {
    *reinterpret_cast<uint2*>(base + off) = make_uint2(w[0], w[WORDS > 1 ? 1 : 0]);
  } else if (BYTES == 4) {
    *reinterpret_cast<unsigned int*>(base + off) = w[0];
  } else {
    *reinterpret_cast<unsigned short*>(base + off) = (unsigned short)w[0];
  }
}

// Integer index tensors (cu_seqlens, start_positions) are int32 or int64.
__device__ __forceinline__ i64 load_index(i64 addr, i64 is64, i64 i) {
  return is64 ? reinterpret_cast<const long long*>(addr)[i]
              : (i64)reinterpret_cast<const int*>(addr)[i];
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
  i64 cu_seqlens;      // thd: address of cu_seqlens
  i64 cu_is64;
  i64 start_positions; // 0 when absent
  i64 sp_is64;
  i64 cp_size, cp_rank;
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
// A later per-token position-id input plugs in here.
__device__ __forceinline__ bool token_position(const PosArgs& a, i64 outer, i64 inner, i64& pos) {
  i64 seq, j, L;
  if (a.layout == 2) {
    const i64 t = outer;
    if (a.nseq <= 0) return false;
    // Largest i in [0, nseq) with cu_seqlens[i] // cp <= t. Always in bounds and at most
    // ceil(log2(nseq)) steps, whatever the contents (checked afterwards).
    i64 lo = 0, hi = a.nseq;
    while (hi - lo > 1) {
      const i64 mid = (lo + hi) >> 1;
      if (floor_div(load_index(a.cu_seqlens, a.cu_is64, mid), a.cp_size) <= t) lo = mid;
      else hi = mid;
    }
    const i64 start = floor_div(load_index(a.cu_seqlens, a.cu_is64, lo), a.cp_size);
    const i64 end = floor_div(load_index(a.cu_seqlens, a.cu_is64, lo + 1), a.cp_size);
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
  if (a.start_positions) pos += load_index(a.start_positions, a.sp_is64, seq);
  return true;
}

// Rows of the angle table that a position may read (spec 5.4: others are copied through).
__device__ __forceinline__ bool in_table(bool valid, i64 pos, i64 rows) {
  return valid && pos >= 0 && pos < rows;
}

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

// cos/sin of the unit's 2V angles of table row `pos`. Accurate sincosf (no fast math).
// When the two angles of a pair are equal (any standard table) sincos runs once.
template <bool INTERLEAVED, int V>
__device__ __forceinline__ void unit_sincos(const float* __restrict__ freqs, i64 srow, i64 scol,
                                            i64 pos, i64 base0, i64 base1, float* c,
                                            float* s) {
  const float* row = freqs + pos * srow;
  float ang[2 * V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    ang[e] = row[(base0 + e) * scol];
    ang[V + e] = row[(base1 + e) * scol];
  }
#pragma unroll
  for (int m = 0; m < V; ++m) {
    int f, g;
    pair_index<INTERLEAVED, V>(m, f, g);
    sincosf(ang[f], &s[f], &c[f]);
    if (ang[g] == ang[f]) {
      s[g] = s[f];
      c[g] = c[f];
    } else {
      sincosf(ang[g], &s[g], &c[g]);
    }
  }
}

// Spec sections 3 and 4 on one unit held in registers (x0 = channels base0.., x1 = base1..),
// results as floats y[0..2V) (y[e] for element e of the unit).
//   forward:  y_f = x_f cos_f - x_s sin_f ;  y_s = x_s cos_s + x_f sin_s
//   backward: d_f = g_f cos_f + g_s sin_s ;  d_s = g_s cos_s - g_f sin_f
template <typename T, int V, bool INTERLEAVED, bool BACKWARD>
__device__ __forceinline__ void rotate_unit(const Vec<T, V>& x0, const Vec<T, V>& x1,
                                            const float* c, const float* s, float* y) {
  float x[2 * V];
#pragma unroll
  for (int e = 0; e < V; ++e) {
    x[e] = to_f32<T>(x0.v[e]);
    x[V + e] = to_f32<T>(x1.v[e]);
  }
#pragma unroll
  for (int m = 0; m < V; ++m) {
    int f, g;
    pair_index<INTERLEAVED, V>(m, f, g);
    if (BACKWARD) {
      y[f] = x[f] * c[f] + x[g] * s[g];
      y[g] = x[g] * c[g] + (-x[f]) * s[f];
    } else {
      y[f] = x[f] * c[f] + (-x[g]) * s[f];
      y[g] = x[g] * c[g] + x[f] * s[g];
    }
  }
}

// How many rows (heads) one thread keeps in flight before computing (more rows: more bytes in
// flight per thread, more registers).
#ifndef CUPY_ROPE_ROWS_IN_FLIGHT
#define CUPY_ROPE_ROWS_IN_FLIGHT 2
#endif
constexpr int kRowsInFlight = CUPY_ROPE_ROWS_IN_FLIGHT;

// One thread's work on one row-set: rows r = r0 + k*rstep (k < count), each row's unit
// at in_off(r) / out_off(r) (given by the caller as row offsets + channel offsets).
// ROT: rotate with the given cos/sin; otherwise copy. Shared by every kernel.
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, bool ROT, bool PAIR, class InOff,
          class OutOff>
__device__ __forceinline__ void process_rows(const T* __restrict__ x, T* __restrict__ y,
                                             i64 nrows, InOff in_off, OutOff out_off,
                                             i64 xsd, i64 ysd, i64 cb0, i64 cb1,
                                             const float* c, const float* s) {
  // PAIR: two vectors per row (a rotary unit); otherwise one vector (a tail unit).
  for (i64 k0 = 0; k0 < nrows; k0 += kRowsInFlight) {
    Vec<T, V> a[kRowsInFlight], b[kRowsInFlight];
#pragma unroll
    for (int k = 0; k < kRowsInFlight; ++k) {
      if (k0 + k < nrows) {
        const i64 o = in_off(k0 + k);
        a[k] = load_vec<T, V>(x, o + cb0 * xsd);
        if (PAIR) b[k] = load_vec<T, V>(x, o + cb1 * xsd);
      }
    }
#pragma unroll
    for (int k = 0; k < kRowsInFlight; ++k) {
      if (k0 + k < nrows) {
        const i64 o = out_off(k0 + k);
        if (PAIR && ROT) {
          float r[2 * V];
          rotate_unit<T, V, INTERLEAVED, BACKWARD>(a[k], b[k], c, s, r);
          store_floats<T, V>(y, o + cb0 * ysd, r);
          store_floats<T, V>(y, o + cb1 * ysd, r + V);
        } else {
          store_vec<T, V>(y, o + cb0 * ysd, a[k]);
          if (PAIR) store_vec<T, V>(y, o + cb1 * ysd, b[k]);
        }
      }
    }
  }
}

}  // namespace cupy_rope

// Kernel entry points: one extern "C" function per instantiation (names in cupy_rope/_kernels.py).
// The host build (host_shim.h) defines CUPY_ROPE_ENTRY itself.
#ifndef CUPY_ROPE_BLOCK
#define CUPY_ROPE_BLOCK 256
#endif
#ifndef CUPY_ROPE_MIN_BLOCKS
#define CUPY_ROPE_MIN_BLOCKS 2
#endif
#ifndef CUPY_ROPE_ENTRY
#define CUPY_ROPE_ENTRY(NAME, PARAMS, BODY)                                                    \
  extern "C" __global__ void __launch_bounds__(CUPY_ROPE_BLOCK, CUPY_ROPE_MIN_BLOCKS)            \
      NAME(const PARAMS p) {                                                                     \
    BODY(p);                                                                                     \
  }
#endif

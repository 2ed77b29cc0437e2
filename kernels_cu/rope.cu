// cupy_rope: RoPE forward/backward over sbhd, bshd and thd (spec sections 1-5).
//
// Thread mapping: one thread per (token, head chunk, unit). A unit is 2V channels of a rotary
// pair set (or 1-2 vectors of tail channels); chunk c of C holds the heads c, c + C, c + 2C, ...
// so that the lanes of a warp touch neighbouring heads at each step. The thread computes the
// token's position and the unit's cos/sin once, then streams its rows (stream_unit: the next
// rows' loads are in flight while the current one is rotated and stored; 16-byte vectors fly
// through the thread's shared-memory ring, their first rows while the cos/sin are computed).
// Each element is read once and written once.
#include "rope_common.cuh"

namespace cupy_rope {

// The launch ABI: cupy_rope reads these fields, in order, from this struct (_kernels.struct_fields);
// every field is a 64-bit i64, PosArgs last.
struct RopeParams {
  i64 x, y, freqs;               // addresses
  i64 n_tok, n_inner;            // tokens; token -> (outer, inner) = divmod(token, n_inner)
  i64 xs0, xs1, xsh, xsd;        // input strides in elements: outer, inner, head, channel
  i64 ys0, ys1, ysh, ysd;        // output strides
  i64 n_heads, d2;               // heads, rotary width
  i64 n_chunks, n_units, n_rot_units, tail_w;
  i64 f_rows, f_srow, f_scol;    // table rows and strides (elements)
  i64 f_kind;                    // what the table holds (TableKind)
  i64 rot_off;                   // first channel of the rotary slice
  // One-row kernels: n_chunks * n_units, n_units and n_inner as fast divisors (fast_div)
  i64 dv_item, dv_unit, dv_inner;
  // One-row kernels with an angle table: 1 when the threads of a block share the sincosf of their
  // token's pairs (each thread computes one pair; rope_one_body), else 0
  i64 share;
  // Blocks of the grid this tensor's threads take: a launch of two tensors runs the first one in
  // the grid's first `blocks` blocks, the second one in the rest (first_part)
  i64 blocks;
  PosArgs pos;
};

// The rows of one rope thread: heads c, c + C, ... of one token, at a fixed head step.
template <typename T> struct HeadRows {
  static constexpr bool kUniform = true;  // every row has the thread's mode
  static constexpr int kDepth = CUPY_ROPE_DEPTH;
  const T* x;  // input, first vector of the next row to load
  T* y;        // output, first vector of the next row to store
  i64 xstep, ystep, xd, yd;
  int mode;
  const float* trow;
  i64 scol;
  __device__ __forceinline__ void in(const T*& p0, const T*& p1) {
    p0 = x;
    p1 = x + xd;
    x += xstep;
  }
  __device__ __forceinline__ OutRow<T> out(int) {
    const OutRow<T> o{y, y + yd, mode, trow, scol};
    y += ystep;
    return o;
  }
};

// MIXED: the mixed kernels (ropem_; stream_unit).
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, bool MIXED = false>
__device__ __forceinline__ void rope_body(const RopeParams& p, unsigned blk) {
  const i64 item = (i64)blk * blockDim.x + threadIdx.x;
  i64 tok, rest, c, u, outer, inner;
  divmod(item, p.n_chunks * p.n_units, tok, rest);
  if (tok >= p.n_tok) return;
  divmod(rest, p.n_units, c, u);
  divmod(tok, p.n_inner, outer, inner);
  await_previous_grid();

  const i64 C = p.n_chunks;
  const int cnt = (int)((p.n_heads - c + C - 1) / C);
  i64 cb0, cb1;
  bool pair;
  const bool rot = unit_channels<INTERLEAVED>(u, p.n_rot_units, p.d2, p.tail_w, V, cb0, cb1, pair);
  const i64 r0 = row_channel(cb0, p.d2, p.rot_off), dr = row_channel(cb1, p.d2, p.rot_off) - r0;
  HeadRows<T> rows{reinterpret_cast<const T*>(p.x) + outer * p.xs0 + inner * p.xs1 + c * p.xsh + r0 * p.xsd,
                   reinterpret_cast<T*>(p.y) + outer * p.ys0 + inner * p.ys1 + c * p.ysh + r0 * p.ysd,
                   C * p.xsh, C * p.ysh, dr * p.xsd, dr * p.ysd, kCopy, nullptr, p.f_scol};
  // Position, angles, cos/sin (before the rows stream).
  auto init = [&](float* cm, float* sm) {
    if (!rot) return;
    i64 pos = 0;
    const bool valid = token_position(p.pos, outer, inner, pos);
    if (!in_table(valid, pos, p.f_rows)) return;  // copied (rows.mode stays kCopy)
    if (p.f_kind == kAngles) {
      rows.trow = reinterpret_cast<const float*>(p.freqs) + pos * p.f_srow;
      rows.mode = held_sincos<INTERLEAVED, V>(rows.trow, cb0, cb1, p.f_scol, cm, sm);
    } else {
      table_sincos<T, INTERLEAVED, V>(p.f_kind, p.freqs, pos, p.f_srow, p.f_scol, p.d2 / 2, cb0, cm, sm);
      rows.mode = kHeld;
    }
  };
  stream_unit<T, V, INTERLEAVED, BACKWARD, MIXED>(pair, cnt, rows, init, cb0, cb1);
}

// f(j) for the rows j < cnt of a thread that holds at most R.
template <int R, class F>
__device__ __forceinline__ void for_rows(int cnt, F f) {
#pragma unroll
  for (int j = 0; j < R; ++j) {
    if (R == 1 || j < cnt) f(j);
  }
}

// One row per thread: the launches whose work split gives every thread a single row (C = n_heads:
// decode steps and other small calls; the launch layer picks this kernel then). rope_body's
// arithmetic for cnt = 1, in the order that suits a lone row: the row's vectors and the token's
// position are loaded before the table, so that their loads overlap (the position first where a
// cos/sin cache's loads wait on it, below), and there is no streaming loop, so that the code a
// launch fetches into a cold instruction cache stays small (benchmarks/NOTES.md).
// CACHE false: angle tables (f_kind kAngles; rope1_ kernels); true: cos/sin caches (kinds
// kCosSin32, kCosSinT; rope1c_ kernels). The launch layer keeps inverse frequencies on the
// streaming kernel.
//
// R > 1 (rope2c_ kernels: cos/sin caches, large launches): the thread takes the rows c, c + C, ...
// (at most R, C = n_chunks >= n_heads / R) of its token, every row's vectors loaded up front, the
// unit's cos/sin read once for them. Against the streaming kernel, whose threads step through
// many rows each, the resident threads then cover few tokens whole rather than a slice of every
// token at once, which DRAM serves faster; with an angle table the sincosf this amortises over
// only R rows cost more than that gains (benchmarks/NOTES.md).
//
// Shared sincosf (angle tables, p.share, R = 1): the V heads c0 .. c0 + V - 1 (c0 a multiple of V) of a
// token need the same cos/sin for each of their n_units units, V * n_units = d2 / 2 pairs, one per
// thread: thread (c, u) computes pair c % V of unit u and writes it to the block's exchange slot
// (group start) + u * V + c % V, then reads its unit's V pairs from slots (group start) + u * V ..
// The launch layer sets p.share only where every unit is rotated, the chunk and head counts are
// multiples of V and the block size a multiple of d2 / 2, so that each group of d2 / 2 threads
// lies in one token and one block. A pair whose two angles differ is written as a NaN cosine;
// a thread that reads one (or a NaN from a NaN or infinite angle) computes its unit itself, as
// without sharing.
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, bool CACHE, int R = 1>
__device__ __forceinline__ void rope_one_body(const RopeParams& p, unsigned blk) {
  // rope_body's (tok, c, u, outer, inner) in 32 bits by multiply and shift (the launch layer runs
  // these kernels only when every thread index is below 2^31): no division before the first load.
  const unsigned item = blk * blockDim.x + threadIdx.x;
  const unsigned tok32 = fast_div(item, p.dv_item);
  const unsigned rest = item - tok32 * (unsigned)(p.n_chunks * p.n_units);
  const unsigned c32 = fast_div(rest, p.dv_unit), outer32 = fast_div(tok32, p.dv_inner);
  const i64 c = c32, u = rest - c32 * (unsigned)p.n_units, outer = outer32,
            inner = tok32 - outer32 * (unsigned)p.n_inner;
  // c >= n_heads: a tensor without heads (the other of the launch has some)
  const bool live = tok32 < p.n_tok && c < p.n_heads;
  const bool share = R == 1 && !CACHE && p.share;
  if (!live && !share) return;  // sharing threads all reach the exchange
  i64 cb0, cb1;
  bool pair;
  const bool rot = unit_channels<INTERLEAVED>(u, p.n_rot_units, p.d2, p.tail_w, V, cb0, cb1, pair);
  const i64 r0 = row_channel(cb0, p.d2, p.rot_off), dr = row_channel(cb1, p.d2, p.rot_off) - r0;
  const T* x = reinterpret_cast<const T*>(p.x) + outer * p.xs0 + inner * p.xs1 + c * p.xsh + r0 * p.xsd;
  T* y = reinterpret_cast<T*>(p.y) + outer * p.ys0 + inner * p.ys1 + c * p.ysh + r0 * p.ysd;
  // the thread's rows: c, c + C, ..., cnt of them
  int cnt = 1;
#pragma unroll
  for (int j = 1; j < R; ++j) cnt += c + j * p.n_chunks < p.n_heads;
  const i64 xstep = p.n_chunks * p.xsh, ystep = p.n_chunks * p.ysh;
  await_previous_grid();
  // The token's position: loaded before the row's vectors by the one-row cache kernels (whose
  // cache loads wait for it), after the rows' vectors by the others. Measured both ways on the
  // H200 (benchmarks/NOTES.md): the cache decode row 1.42-1.46 µs first against 1.52-1.56 after;
  // the angle table's decode and the two-row cache kernel's prefill were slower with it first.
  // Loaded first, it is widened only after the vector loads are issued: an int32 position's sign
  // extension right after its load held them back (int32 decode row 1.52-1.56 µs, 1.43-1.48 now).
  constexpr bool kPositionFirst = CACHE && R == 1;
  i64 pos = 0;
  bool valid = false;
  auto position = [&] { valid = live && rot && token_position<kPositionFirst>(p.pos, outer, inner, pos); };
  if constexpr (kPositionFirst) {
    CUPY_ROPE_COUNT_POSITION_FIRST();
    position();
  }
  Vec<T, V> a[R], b[R];
  if (live) {
    for_rows<R>(cnt, [&](int j) {
      a[j] = load_vec<T, V>(x + j * xstep);
      if (pair) b[j] = load_vec<T, V>(x + j * xstep + dr * p.xsd);
    });
  }
  if constexpr (kPositionFirst) {
    pos = widen_position(p.pos, pos);  // after the vector loads: they do not wait for the position
  } else {
    position();
  }
  const bool rotated = in_table(valid, pos, p.f_rows);
  const float* trow = reinterpret_cast<const float*>(p.freqs) + pos * p.f_srow;
  const int m = (int)(c % V);  // this thread's pair of its unit in the exchange
  float2* const slots = exchange_slots + (threadIdx.x - (m * p.n_units + u)) + u * V;
  if (share && rotated) {
    int f, g;
    pair_index<INTERLEAVED, V>(m, f, g);
    const float af = trow[unit_channel<V>(f, cb0, cb1) * p.f_scol];
    const bool one_angle = af == trow[unit_channel<V>(g, cb0, cb1) * p.f_scol];
    float s = 0.f, co = 0.f;
    sincosf(af, &s, &co);
    slots[m] = make_float2(one_angle ? co : __uint_as_float(0x7fffffffu), s);  // NaN: two angles
  }
  if (!exchange_barrier(share) || !live) return;
  if (rotated) {
    float cm[V], sm[V];
    bool held = true;
    if constexpr (CACHE) {
      const i64 i0 = INTERLEAVED ? cb0 / 2 : cb0;  // first pair of the unit
      cache_sincos<T, V>(p.f_kind, p.freqs, pos * p.f_srow, p.f_scol, p.d2 / 2, i0, cm, sm);
    } else {
      held = share;
      if (share) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float2 cs = slots[i];
          cm[i] = cs.x;
          sm[i] = cs.y;
          held = held && cs.x == cs.x;  // not NaN
        }
        if (!held) CUPY_ROPE_COUNT_UNSHARED();
      }
      held = held || held_sincos<INTERLEAVED, V>(trow, cb0, cb1, p.f_scol, cm, sm) == kHeld;
    }
    for_rows<R>(cnt, [&](int j) {
      float v[2 * V];
      to_floats<T, V>(a[j], v);
      to_floats<T, V>(b[j], v + V);
      if (held) {
        rotate_unit<V, INTERLEAVED, BACKWARD>(v, cm, sm, cm, sm);
      } else {
        rotate_fresh<V, INTERLEAVED, BACKWARD>(v, trow, cb0, cb1, p.f_scol);
      }
      from_floats<T, V>(v, a[j]);
      from_floats<T, V>(v + V, b[j]);
    });
  }
  for_rows<R>(cnt, [&](int j) {
    store_vec<T, V>(y + j * ystep, a[j]);
    if (pair) store_vec<T, V>(y + j * ystep + dr * p.ysd, b[j]);
  });
}

// Rows per thread of the lean kernels (rope_lean_body): the launch layer reads this define (or a
// build's override of it) and gives a thread at most this many (cupy_rope/_worksplit.py).
#ifndef CUPY_ROPE_LEAN_ROWS
#define CUPY_ROPE_LEAN_ROWS 4
#endif
// Resident blocks per SM the lean kernels' register budget must allow (CUPY_ROPE_MIN_BLOCKS).
#ifndef CUPY_ROPE_LEAN_MIN_BLOCKS
#define CUPY_ROPE_LEAN_MIN_BLOCKS 4
#endif

// Lean rows (ropel_ kernels): the streaming kernel's launches in the common case, written for few
// instructions and registers per row. The launch layer takes them for an angle table with
// contiguous columns, every unit of a row rotated, 16-byte vectors, and every thread index and
// every element offset of x and y below 2^31 (the arithmetic here is 32-bit). A thread takes up
// to R rows of its token (heads c, c + C, ..., C = n_chunks), loads them up front, then computes
// its token's position and, one pair at a time, the pair's cos/sin and its rotation in every row
// (rope_one_body's order without its general addressing, sharing, caches or unit of floats):
// resident threads cover few tokens whole, the order a copy runs fastest in (benchmarks/NOTES.md).
// Every pair is rotated in all R rows, a thread's rows past its count as zeros that are never
// stored, and each row's pair is converted in one instruction (set_unit_pair): a branch per pair
// and row cost 1-2% on an H100 (benchmarks/NOTES.md, twenty-eighth session).
// The same bits as the other kernels: each pair is rotate_pair of the sincosf of its angles.
template <typename T, int V, bool INTERLEAVED, bool BACKWARD, int R>
__device__ __forceinline__ void rope_lean_body(const RopeParams& p, unsigned blk) {
  const unsigned item = blk * blockDim.x + threadIdx.x;
  const unsigned tok = fast_div(item, p.dv_item);
  const unsigned rest = item - tok * (unsigned)(p.n_chunks * p.n_units);
  const unsigned c = fast_div(rest, p.dv_unit), u = rest - c * (unsigned)p.n_units;
  const unsigned outer = fast_div(tok, p.dv_inner), inner = tok - outer * (unsigned)p.n_inner;
  if (tok >= p.n_tok) return;
  // the unit's vectors at channels cb0 and cb0 + dc (unit_bases)
  const int cb0 = (int)u * (INTERLEAVED ? 2 * V : V), dc = INTERLEAVED ? V : (int)p.d2 / 2;
  const int C = (int)p.n_chunks;
  const int xo = (int)outer * (int)p.xs0 + (int)inner * (int)p.xs1 + (int)c * (int)p.xsh + cb0;
  const int yo = (int)outer * (int)p.ys0 + (int)inner * (int)p.ys1 + (int)c * (int)p.ysh + cb0;
  const int xstep = C * (int)p.xsh, ystep = C * (int)p.ysh;
  int cnt = 1;
#pragma unroll
  for (int j = 1; j < R; ++j) cnt += (int)c + j * C < (int)p.n_heads;
  const T* x = reinterpret_cast<const T*>(p.x) + xo;
  T* y = reinterpret_cast<T*>(p.y) + yo;
  await_previous_grid();
  Vec<T, V> a[R], b[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    a[j] = b[j] = Vec<T, V>{};
    if (j < cnt) {
      a[j] = load_vec<T, V>(x + j * xstep);
      b[j] = load_vec<T, V>(x + j * xstep + dc);
    }
  }
  i64 pos = 0;
  const bool valid = token_position(p.pos, outer, inner, pos);  // sets pos: before in_table reads it
  if (in_table(valid, pos, p.f_rows)) {
    const float* trow = reinterpret_cast<const float*>(p.freqs) + pos * p.f_srow;
    // One pair at a time, in the rows' packed words (no unit of floats, no cos/sin array held):
    // the registers that buy this kernel its occupancy. The second member's cos/sin is the first's
    // where the pair's two angles are equal (any standard table), else its own.
#pragma unroll
    for (int m = 0; m < V; ++m) {
      int f, g;
      pair_index<INTERLEAVED, V>(m, f, g);
      const float af = trow[unit_channel<V>(f, cb0, cb0 + dc)], ag = trow[unit_channel<V>(g, cb0, cb0 + dc)];
      float sf, cf, sg, cg;
      sincosf(af, &sf, &cf);
      sg = sf, cg = cf;
      if (ag != af) sincosf(ag, &sg, &cg);
#pragma unroll
      for (int j = 0; j < R; ++j) {
        float xf = unit_elem<T, V>(a[j], b[j], f), xg = unit_elem<T, V>(a[j], b[j], g);
        rotate_pair<BACKWARD>(xf, xg, cf, sf, cg, sg);
        set_unit_pair<T, V>(a[j], b[j], f, g, xf, xg);
      }
    }
  }
  for_rows<R>(cnt, [&](int j) {
    store_vec<T, V>(y + j * ystep, a[j]);
    store_vec<T, V>(y + j * ystep + dc, b[j]);
  });
}

}  // namespace cupy_rope

// One extern "C" entry point per instantiation, named NAME = rope_<dtype>_v<V>_<n|i>_<f|b> (the
// streaming kernel), ropem_... (the streaming kernel for rows of rotated and copied units,
// 16-byte vectors only), rope1_... (one row per thread, angle tables), rope1c_... (one row per
// thread, cos/sin caches), rope2c_... (two rows per thread, cos/sin caches, 16-byte vectors) or
// ropel_... (a few rows per thread, angle tables, 16-byte vectors), taking two parameter blocks
// (the first tensor, e.g. q, in the grid's first p0.blocks blocks, the second, e.g. k, in the rest).
// The launch layer appends the CUPY_ROPE_KERNEL(...) / CUPY_ROPEM_KERNEL(...) / ... lines it
// needs (cupy_rope/_kernels.py).
#define CUPY_ROPE_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_ENTRY_PAIR(NAME, cupy_rope::RopeParams, (cupy_rope::rope_body<T, V, INTERLEAVED, BACKWARD>), CUPY_ROPE_MIN_BLOCKS)
#define CUPY_ROPEM_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_ENTRY_PAIR(NAME, cupy_rope::RopeParams, (cupy_rope::rope_body<T, V, INTERLEAVED, BACKWARD, true>), CUPY_ROPEM_MIN_BLOCKS)
#define CUPY_ROPE1_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_ENTRY_PAIR_EXCHANGE(NAME, cupy_rope::RopeParams, (cupy_rope::rope_one_body<T, V, INTERLEAVED, BACKWARD, false>), CUPY_ROPE_MIN_BLOCKS)
#define CUPY_ROPE1C_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_ENTRY_PAIR(NAME, cupy_rope::RopeParams, (cupy_rope::rope_one_body<T, V, INTERLEAVED, BACKWARD, true>), CUPY_ROPE_MIN_BLOCKS)
#define CUPY_ROPE2C_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_ENTRY_PAIR(NAME, cupy_rope::RopeParams, (cupy_rope::rope_one_body<T, V, INTERLEAVED, BACKWARD, true, 2>), CUPY_ROPE_MIN_BLOCKS)
#define CUPY_ROPEL_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_ENTRY_PAIR(NAME, cupy_rope::RopeParams, (cupy_rope::rope_lean_body<T, V, INTERLEAVED, BACKWARD, CUPY_ROPE_LEAN_ROWS>), CUPY_ROPE_LEAN_MIN_BLOCKS)

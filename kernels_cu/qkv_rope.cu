// cupy_rope: packed QKV RoPE (spec section 6), forward and backward, sbhd/bshd/thd.
//
// The packed tensor is [tokens, g, (n + 2) * d]: in each group's row, n query heads, one key
// head, one value head, d channels each. Forward reads the packed tensor once and writes
// q [tokens, g*n, d], k [tokens, g, d], v [tokens, g, d]; backward reads dq, dk, dv once and
// writes the packed gradient. One thread per (token, group, chunk, unit): chunk c of C holds the
// group's rows r = c, c + C, ... of its n + 2 rows (r < n: query head r, rotated with the q table;
// r == n: the key head, k table; r == n + 1: the value head, copied), streamed by stream_unit with
// the q table's cos/sin held (also for the key row when k_freqs is q_freqs).
#include "rope_common.cuh"

namespace cupy_rope {

// The launch ABI: cupy_rope reads these fields, in order, from this struct (_kernels.struct_fields);
// every field is a 64-bit i64, PosArgs last.
struct QkvParams {
  i64 packed, q, k, v;            // addresses (packed: input fwd / output bwd)
  i64 q_freqs, k_freqs;
  i64 n_tok, n_inner;
  i64 ps0, ps1, psg, psd;         // packed strides: outer, inner, group, channel
  i64 qs0, qs1, qsh, qsd;         // q (head = group * n + r)
  i64 ks0, ks1, ksh, ksd;         // k (head = group)
  i64 vs0, vs1, vsh, vsd;         // v (head = group)
  i64 n_groups, n_q, d, d2;
  i64 n_chunks, n_units, n_rot_units, tail_w;
  i64 qf_rows, qf_srow, qf_scol;
  i64 kf_rows, kf_srow, kf_scol;
  i64 k_same_table;               // 1: k_freqs is q_freqs (same address, rows and strides)
  PosArgs pos;
};

// The rows of one QKV thread: rows r = c, c + C, ... of one group of one token. In the packed
// tensor they are a fixed step apart; in q / k / v, row r < n is query head r, row n the key
// head, row n + 1 the value head. Forward reads packed and writes q/k/v; backward the reverse.
template <typename T, bool BACKWARD> struct GroupRows {
  static constexpr bool kUniform = false;  // query, key and value rows differ
  static constexpr int kDepth = CUPY_QKV_DEPTH;
  T* pk;  // packed tensor: first vector of the next packed row (read forward, written backward)
  i64 pstep, pd;
  i64 c, C, n;
  T *q, *k, *v;  // first vector of query head 0 of the group, of the key head, of the value head
  i64 qsh, qd, kd, vd;
  int q_mode, k_mode;
  const float *qrow, *krow;
  i64 qscol, kscol;
  // Backward loads: the next row from a running row index and query-row pointer (in() is called
  // once per row, in increasing order), not recomputed from kk as out() does for the stores: 1-2%
  // of the packed backward's time on the H200 (benchmarks/NOTES.md). Set by qkv_body.
  i64 rin = 0;
  const T* qin = nullptr;
  __device__ __forceinline__ OutRow<T> sep(int kk) const {
    const i64 r = c + kk * C;
    if (r < n) return OutRow<T>{q + r * qsh, q + r * qsh + qd, q_mode, qrow, qscol};
    if (r == n) return OutRow<T>{k, k + kd, k_mode, krow, kscol};
    return OutRow<T>{v, v + vd, kCopy, nullptr, 0};
  }
  __device__ __forceinline__ void in(const T*& p0, const T*& p1) {
    if (BACKWARD) {
      if (rin < n) {
        p0 = qin;
        p1 = qin + qd;
        qin += C * qsh;
      } else if (rin == n) {
        p0 = k;
        p1 = k + kd;
      } else {
        p0 = v;
        p1 = v + vd;
      }
      rin += C;
    } else {
      p0 = pk;
      p1 = pk + pd;
      pk += pstep;
    }
  }
  __device__ __forceinline__ OutRow<T> out(int kk) {
    OutRow<T> o = sep(kk);
    if (BACKWARD) {
      o.p0 = pk;
      o.p1 = pk + pd;
      pk += pstep;
    }
    return o;
  }
};

template <typename T, int V, bool INTERLEAVED, bool BACKWARD>
__device__ __forceinline__ void qkv_body(const QkvParams& p, unsigned blk) {
  const i64 item = (i64)blk * blockDim.x + threadIdx.x;
  i64 tok, rest, grp, r2, c, u, outer, inner;
  divmod(item, p.n_groups * p.n_chunks * p.n_units, tok, rest);
  if (tok >= p.n_tok) return;
  divmod(rest, p.n_chunks * p.n_units, grp, r2);
  divmod(r2, p.n_units, c, u);
  divmod(tok, p.n_inner, outer, inner);
  await_previous_grid();

  const i64 n = p.n_q, C = p.n_chunks;
  const int cnt = (int)((n + 2 - c + C - 1) / C);
  i64 cb0, cb1;
  bool pair;
  const bool rot = unit_channels<INTERLEAVED>(u, p.n_rot_units, p.d2, p.tail_w, V, cb0, cb1, pair);
  const i64 dc = cb1 - cb0;
  GroupRows<T, BACKWARD> rows{
      reinterpret_cast<T*>(p.packed) + outer * p.ps0 + inner * p.ps1 + grp * p.psg + c * p.d * p.psd + cb0 * p.psd,
      C * p.d * p.psd, dc * p.psd, c, C, n,
      reinterpret_cast<T*>(p.q) + outer * p.qs0 + inner * p.qs1 + grp * n * p.qsh + cb0 * p.qsd,
      reinterpret_cast<T*>(p.k) + outer * p.ks0 + inner * p.ks1 + grp * p.ksh + cb0 * p.ksd,
      reinterpret_cast<T*>(p.v) + outer * p.vs0 + inner * p.vs1 + grp * p.vsh + cb0 * p.vsd,
      p.qsh, dc * p.qsd, dc * p.ksd, dc * p.vsd, kCopy, kCopy, nullptr, nullptr, p.qf_scol, p.kf_scol};
  rows.rin = c;
  rows.qin = rows.q + c * p.qsh;
  // Position, angles, cos/sin of the q table (held for the query rows, and for the key row
  // when k_freqs is q_freqs), before the rows stream.
  auto init = [&](float* cm, float* sm) {
    if (!rot) return;
    i64 pos = 0;
    const bool valid = token_position(p.pos, outer, inner, pos);
    if (in_table(valid, pos, p.qf_rows)) rows.qrow = reinterpret_cast<const float*>(p.q_freqs) + pos * p.qf_srow;
    if (in_table(valid, pos, p.kf_rows)) rows.krow = reinterpret_cast<const float*>(p.k_freqs) + pos * p.kf_srow;
    rows.q_mode = held_sincos<INTERLEAVED, V>(rows.qrow, cb0, cb1, p.qf_scol, cm, sm);
    rows.k_mode = rows.krow == nullptr ? kCopy : (p.k_same_table ? rows.q_mode : kFresh);
  };
  stream_unit<T, V, INTERLEAVED, BACKWARD>(pair, cnt, rows, init, cb0, cb1);
}

}  // namespace cupy_rope

// Entry points: qkv_<dtype>_v<V>_<n|i>_<f|b> (cupy_rope/_kernels.py).
#define CUPY_QKV_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_ENTRY(NAME, cupy_rope::QkvParams, (cupy_rope::qkv_body<T, V, INTERLEAVED, BACKWARD>), CUPY_QKV_MIN_BLOCKS)

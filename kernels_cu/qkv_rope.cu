// cupy_rope: packed QKV RoPE (spec section 6), forward and backward, sbhd/bshd/thd.
//
// The packed tensor is [tokens, g, (n + 2) * d]: in each group's row, n query heads, one key
// head, one value head, d channels each. Forward reads the packed tensor once and writes
// q [tokens, g*n, d], k [tokens, g, d], v [tokens, g, d]; backward reads dq, dk, dv once and
// writes the packed gradient. One thread per (token, group, row subset, unit): the unit's
// cos/sin are computed once per table and reused for the rows r = hs, hs + HS, ... of the
// group (r < n: query head r; r == n: key; r == n + 1: value, copied).
#include "rope_common.cuh"

namespace cupy_rope {

// Field order = cupy_rope/_plan.py QKV_FIELDS (all 64-bit).
struct QkvParams {
  i64 packed, q, k, v;            // addresses (packed: input fwd / output bwd)
  i64 q_freqs, k_freqs;
  i64 n_tok, n_inner;
  i64 ps0, ps1, psg, psd;         // packed strides: outer, inner, group, channel
  i64 qs0, qs1, qsh, qsd;         // q (head = group * n + r)
  i64 ks0, ks1, ksh, ksd;         // k (head = group)
  i64 vs0, vs1, vsh, vsd;         // v (head = group)
  i64 n_groups, n_q, d, d2;
  i64 n_hsub, n_units, n_rot_units;
  i64 qf_rows, qf_srow, qf_scol;
  i64 kf_rows, kf_srow, kf_scol;
  i64 k_same_table;               // 1: k_freqs is q_freqs (same address, rows and strides)
  PosArgs pos;
};

template <typename T, int V, bool INTERLEAVED, bool BACKWARD>
__device__ __forceinline__ void qkv_body(const QkvParams& p) {
  const i64 item = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  i64 tok, rest, grp, r2, hs, u, outer, inner;
  divmod(item, p.n_groups * p.n_hsub * p.n_units, tok, rest);
  if (tok >= p.n_tok) return;
  divmod(rest, p.n_hsub * p.n_units, grp, r2);
  divmod(r2, p.n_units, hs, u);
  divmod(tok, p.n_inner, outer, inner);

  const i64 HS = p.n_hsub, n = p.n_q;
  // Packed row r of this group, and the same row in q / k / v.
  const i64 pb = outer * p.ps0 + inner * p.ps1 + grp * p.psg + hs * p.d * p.psd;
  const i64 pstep = HS * p.d * p.psd;
  const i64 qb = outer * p.qs0 + inner * p.qs1 + (grp * n + hs) * p.qsh, qstep = HS * p.qsh;
  const i64 kb = outer * p.ks0 + inner * p.ks1 + grp * p.ksh;
  const i64 vb = outer * p.vs0 + inner * p.vs1 + grp * p.vsh;
  const i64 nq_rows = hs < n ? (n - hs + HS - 1) / HS : 0;
  const bool has_k = hs <= n && (n - hs) % HS == 0;
  const bool has_v = hs <= n + 1 && (n + 1 - hs) % HS == 0;
  // Row offsets: k-th q row, the k row and the v row of the packed tensor.
  auto p_q = [=](i64 k) { return pb + k * pstep; };
  auto p_k = [=](i64) { return pb + ((n - hs) / HS) * pstep; };
  auto p_v = [=](i64) { return pb + ((n + 1 - hs) / HS) * pstep; };
  auto o_q = [=](i64 k) { return qb + k * qstep; };
  auto o_k = [=](i64) { return kb; };
  auto o_v = [=](i64) { return vb; };

  const T* packed_in = reinterpret_cast<const T*>(p.packed);
  T* packed_out = reinterpret_cast<T*>(p.packed);
  const T* q_in = reinterpret_cast<const T*>(p.q);
  const T* k_in = reinterpret_cast<const T*>(p.k);
  const T* v_in = reinterpret_cast<const T*>(p.v);
  T* q_out = reinterpret_cast<T*>(p.q);
  T* k_out = reinterpret_cast<T*>(p.k);
  T* v_out = reinterpret_cast<T*>(p.v);

  // One call per row kind; forward packed -> q/k/v, backward q/k/v -> packed.
#define CUPY_ROPE_QKV_ROWS(ROT, PAIR, NROWS, POFF, OOFF, OPTR, OSD, CB0, CB1, C, S)            \
  if (BACKWARD)                                                                                \
    process_rows<T, V, INTERLEAVED, BACKWARD, ROT, PAIR>(OPTR##_in, packed_out, NROWS, OOFF,   \
                                                         POFF, OSD, p.psd, CB0, CB1, C, S);    \
  else                                                                                         \
    process_rows<T, V, INTERLEAVED, BACKWARD, ROT, PAIR>(packed_in, OPTR##_out, NROWS, POFF,   \
                                                         OOFF, p.psd, OSD, CB0, CB1, C, S);

  if (u >= p.n_rot_units) {  // tail channels: copies for every row
    const i64 cb = p.d2 + (u - p.n_rot_units) * V;
    CUPY_ROPE_QKV_ROWS(false, false, nq_rows, p_q, o_q, q, p.qsd, cb, cb, nullptr, nullptr)
    if (has_k) { CUPY_ROPE_QKV_ROWS(false, false, 1, p_k, o_k, k, p.ksd, cb, cb, nullptr, nullptr) }
    if (has_v) { CUPY_ROPE_QKV_ROWS(false, false, 1, p_v, o_v, v, p.vsd, cb, cb, nullptr, nullptr) }
    return;
  }
  i64 cb0, cb1;
  unit_bases<INTERLEAVED>(u, p.d2 / 2, V, cb0, cb1);
  if (has_v) { CUPY_ROPE_QKV_ROWS(false, true, 1, p_v, o_v, v, p.vsd, cb0, cb1, nullptr, nullptr) }
  i64 pos = 0;
  const bool valid = token_position(p.pos, outer, inner, pos);
  const bool q_ok = in_table(valid, pos, p.qf_rows), k_ok = in_table(valid, pos, p.kf_rows);
  float cq[2 * V], sq[2 * V];
  if (q_ok && (nq_rows > 0 || (has_k && p.k_same_table))) {
    unit_sincos<INTERLEAVED, V>(reinterpret_cast<const float*>(p.q_freqs), p.qf_srow, p.qf_scol,
                                pos, cb0, cb1, cq, sq);
  }
  if (nq_rows > 0) {
    if (q_ok) { CUPY_ROPE_QKV_ROWS(true, true, nq_rows, p_q, o_q, q, p.qsd, cb0, cb1, cq, sq) }
    else { CUPY_ROPE_QKV_ROWS(false, true, nq_rows, p_q, o_q, q, p.qsd, cb0, cb1, nullptr, nullptr) }
  }
  if (has_k) {
    if (!k_ok) {
      CUPY_ROPE_QKV_ROWS(false, true, 1, p_k, o_k, k, p.ksd, cb0, cb1, nullptr, nullptr)
    } else if (p.k_same_table) {
      CUPY_ROPE_QKV_ROWS(true, true, 1, p_k, o_k, k, p.ksd, cb0, cb1, cq, sq)
    } else {
      float ck[2 * V], sk[2 * V];
      unit_sincos<INTERLEAVED, V>(reinterpret_cast<const float*>(p.k_freqs), p.kf_srow,
                                  p.kf_scol, pos, cb0, cb1, ck, sk);
      CUPY_ROPE_QKV_ROWS(true, true, 1, p_k, o_k, k, p.ksd, cb0, cb1, ck, sk)
    }
  }
#undef CUPY_ROPE_QKV_ROWS
}

}  // namespace cupy_rope

// Entry points: qkv_<dtype>_v<V>_<n|i>_<f|b> (cupy_rope/_kernels.py).
#define CUPY_QKV_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_ENTRY(NAME, cupy_rope::QkvParams, (cupy_rope::qkv_body<T, V, INTERLEAVED, BACKWARD>))

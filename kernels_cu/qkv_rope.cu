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

// ---------------------------------------------------------------------------------------------
// Tiled variant (opt-in, CUPY_ROPE_KERNEL=tiled; see RopeTiled in rope.cu): one block per tile of TT tokens, items
// (group, row, unit) loaded first, positions and cos/sin of the tile (q table, and k table when
// it differs) once per block in shared memory, then rotate/copy and store.
namespace cupy_rope {

template <typename T, int V, bool INTERLEAVED, bool BACKWARD> struct QkvTiled {
  typedef QkvParams Params;
  typedef TileState<T, V> State;
  typedef TileShared Shared;

  static __device__ __forceinline__ i64 rows(const Params& p) { return p.n_q + 2; }

  static __device__ __forceinline__ bool item(const Params& p, i64 i, i64& tt, i64& tok, i64& grp, i64& r,
                                              i64& u) {
    const i64 ipt = p.n_groups * rows(p) * p.n_units;
    if (i >= p.n_hsub * ipt) return false;  // n_hsub holds TT for the tiled kernel
    i64 rest, gr;
    divmod(i, ipt, tt, rest);
    divmod(rest, p.n_units, gr, u);
    divmod(gr, rows(p), grp, r);
    tok = (i64)blockIdx.x * p.n_hsub + tt;
    return tok < p.n_tok;
  }

  // offsets (elements) of row (grp, r) of token tok: in the packed tensor, and in q/k/v
  // (which one: r < n q, r == n k, r == n + 1 v), with that array's channel stride
  static __device__ __forceinline__ void offsets(const Params& p, i64 tok, i64 grp, i64 r, i64& po,
                                                 i64& so, i64& ssd, int& which) {
    i64 outer, inner;
    divmod(tok, p.n_inner, outer, inner);
    po = outer * p.ps0 + inner * p.ps1 + grp * p.psg + r * p.d * p.psd;
    if (r < p.n_q) {
      which = 0;
      so = outer * p.qs0 + inner * p.qs1 + (grp * p.n_q + r) * p.qsh;
      ssd = p.qsd;
    } else if (r == p.n_q) {
      which = 1;
      so = outer * p.ks0 + inner * p.ks1 + grp * p.ksh;
      ssd = p.ksd;
    } else {
      which = 2;
      so = outer * p.vs0 + inner * p.vs1 + grp * p.vsh;
      ssd = p.vsd;
    }
  }

  static __device__ __forceinline__ i64 sep_addr(const Params& p, int which) {
    return which == 0 ? p.q : (which == 1 ? p.k : p.v);
  }

  static __device__ __forceinline__ void channels(const Params& p, i64 u, i64& cb0, i64& cb1) {
    if (u >= p.n_rot_units) {
      cb0 = cb1 = p.d2 + (u - p.n_rot_units) * V;
    } else {
      unit_bases<INTERLEAVED>(u, p.d2 / 2, V, cb0, cb1);
    }
  }

  static __device__ __forceinline__ void load(const Params& p, i64 tok, i64 grp, i64 r, i64 u, Vec<T, V>& a,
                                              Vec<T, V>& b) {
    i64 po, so, ssd, cb0, cb1;
    int which;
    offsets(p, tok, grp, r, po, so, ssd, which);
    channels(p, u, cb0, cb1);
    const T* src = reinterpret_cast<const T*>(BACKWARD ? sep_addr(p, which) : p.packed);
    const i64 o = BACKWARD ? so : po, sd = BACKWARD ? ssd : p.psd;
    a = load_vec<T, V>(src, o + cb0 * sd);
    if (u < p.n_rot_units) b = load_vec<T, V>(src, o + cb1 * sd);
  }

  static __device__ __forceinline__ void phase1(const Params& p, State& st, Shared& sh) {
#pragma unroll
    for (int k = 0; k < kTileItems; ++k) {
      i64 tt, tok, grp, r, u;
      if (item(p, threadIdx.x + (i64)k * blockDim.x, tt, tok, grp, r, u)) load(p, tok, grp, r, u, st.a[k], st.b[k]);
    }
    for (i64 tt = threadIdx.x; tt < p.n_hsub; tt += blockDim.x) {
      const i64 tok = (i64)blockIdx.x * p.n_hsub + tt;
      i64 pos = -1;
      if (tok < p.n_tok) {
        i64 outer, inner, q = 0;
        divmod(tok, p.n_inner, outer, inner);
        if (token_position(p.pos, outer, inner, q) && q >= 0) pos = q;
      }
      sh.pos[tt] = pos;
    }
  }

  // cos/sin of the tile: q table at [0, TT*d2), k table (when different) at [TT*d2, 2*TT*d2)
  static __device__ __forceinline__ void phase2(const Params& p, State&, Shared& sh) {
    const i64 n = p.n_hsub * p.d2;
    const i64 total = p.k_same_table ? n : 2 * n;
    for (i64 j = threadIdx.x; j < total; j += blockDim.x) {
      const bool kt = j >= n;
      i64 tt, col;
      divmod(kt ? j - n : j, p.d2, tt, col);
      const i64 pos = sh.pos[tt];
      const i64 rows_t = kt ? p.kf_rows : p.qf_rows;
      if (pos >= 0 && pos < rows_t) {
        const float* f = reinterpret_cast<const float*>(kt ? p.k_freqs : p.q_freqs);
        const i64 srow = kt ? p.kf_srow : p.qf_srow, scol = kt ? p.kf_scol : p.qf_scol;
        sincosf(f[pos * srow + col * scol], &sh.s[j], &sh.c[j]);
      }
    }
  }

  static __device__ __forceinline__ void finish(const Params& p, const Shared& sh, i64 tt, i64 tok, i64 grp,
                                                i64 r, i64 u, const Vec<T, V>& a, const Vec<T, V>& b) {
    i64 po, so, ssd, cb0, cb1;
    int which;
    offsets(p, tok, grp, r, po, so, ssd, which);
    channels(p, u, cb0, cb1);
    T* dst = reinterpret_cast<T*>(BACKWARD ? p.packed : sep_addr(p, which));
    const i64 o = BACKWARD ? po : so, sd = BACKWARD ? p.psd : ssd;
    if (u >= p.n_rot_units) {
      store_vec<T, V>(dst, o + cb0 * sd, a);
      return;
    }
    const i64 pos = sh.pos[tt];
    const bool ok = which == 0 ? (pos >= 0 && pos < p.qf_rows) : (which == 1 ? (pos >= 0 && pos < p.kf_rows) : false);
    if (!ok) {
      store_vec<T, V>(dst, o + cb0 * sd, a);
      store_vec<T, V>(dst, o + cb1 * sd, b);
      return;
    }
    const i64 base = tt * p.d2 + ((which == 1 && !p.k_same_table) ? p.n_hsub * p.d2 : 0);
    float c[2 * V], s[2 * V], res[2 * V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      c[e] = sh.c[base + cb0 + e];
      s[e] = sh.s[base + cb0 + e];
      c[V + e] = sh.c[base + cb1 + e];
      s[V + e] = sh.s[base + cb1 + e];
    }
    rotate_unit<T, V, INTERLEAVED, BACKWARD>(a, b, c, s, res);
    store_floats<T, V>(dst, o + cb0 * sd, res);
    store_floats<T, V>(dst, o + cb1 * sd, res + V);
  }

  static __device__ __forceinline__ void phase3(const Params& p, State& st, Shared& sh) {
#pragma unroll
    for (int k = 0; k < kTileItems; ++k) {
      i64 tt, tok, grp, r, u;
      if (item(p, threadIdx.x + (i64)k * blockDim.x, tt, tok, grp, r, u))
        finish(p, sh, tt, tok, grp, r, u, st.a[k], st.b[k]);
    }
    const i64 items = p.n_hsub * p.n_groups * rows(p) * p.n_units;
    for (i64 i = threadIdx.x + (i64)kTileItems * blockDim.x; i < items; i += blockDim.x) {
      i64 tt, tok, grp, r, u;
      if (!item(p, i, tt, tok, grp, r, u)) continue;
      Vec<T, V> a, b;
      load(p, tok, grp, r, u, a, b);
      finish(p, sh, tt, tok, grp, r, u, a, b);
    }
  }
};

}  // namespace cupy_rope

// Entry points qkvt_<dtype>_v<V>_<n|i>_<f|b> (cupy_rope/_kernels.py).
#define CUPY_QKVT_KERNEL(NAME, T, V, INTERLEAVED, BACKWARD) \
  CUPY_ROPE_TILED_ENTRY(NAME, (cupy_rope::QkvTiled<T, V, INTERLEAVED, BACKWARD>), cupy_rope::QkvParams)

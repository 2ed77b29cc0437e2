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

// The overlap signature of an in-place call's launch-cache key (_launch.overlap_signature), shared
// by the torch and CuPy C++ paths: what the call's validation depends on beyond the descriptors.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace cupy_rope {

// An array's bytes [lo, hi) (lo == hi: no elements).
struct ByteRange {
  int64_t lo = 0, hi = 0;
};

// The bytes of an array at address `ptr`, `itemsize` bytes per element, whose dimension i
// (i < nd) has size(i) elements step(i) bytes apart.
template <class Size, class Step>
ByteRange byte_range(int64_t ptr, int64_t nd, int64_t itemsize, Size size, Step step) {
  int64_t lo = 0, hi = 0;
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t n = size(i);
    if (n == 0) return {ptr, ptr};
    const int64_t span = (n - 1) * step(i);
    (span > 0 ? hi : lo) += span;
  }
  return {ptr + lo, ptr + hi + itemsize};
}

inline bool meet(const ByteRange& a, const ByteRange& b) {
  return a.lo < a.hi && b.lo < b.hi && a.lo < b.hi && b.lo < a.hi;
}

// Appends to `key` whether a written array (the first `written` of `arrays`, whose bytes are
// bytes(arrays[i])) spans bytes of a read-only one (the call is refused then), and, when the spans
// of two written arrays meet, their relative address (whether they share an element depends on
// it; disjoint spans never do). `written` is 0, 1 or 2, at most the arrays' count (the CuPy entry
// refuses others; the torch ops write q and k): at most two written arrays are held, whatever a
// caller passes. Each array's bytes are computed once.
template <class Key, class Arrays, class Bytes>
void push_overlaps(Key& key, const Arrays& arrays, size_t written, Bytes bytes) {
  const size_t n = arrays.size(), nw = std::min({written, n, size_t{2}});  // the written arrays held
  ByteRange w[2];
  for (size_t i = 0; i < nw; ++i) w[i] = bytes(arrays[i]);
  bool ro = false;
  for (size_t r = written; r < n && !ro; ++r) {
    const ByteRange b = bytes(arrays[r]);
    for (size_t i = 0; i < nw; ++i) ro = ro || meet(w[i], b);
  }
  key.push_back(ro);
  const bool both = nw == 2 && meet(w[0], w[1]);  // two written arrays held: written == 2
  key.push_back(both);
  key.push_back(both ? w[1].lo - w[0].lo : 0);
}

}  // namespace cupy_rope

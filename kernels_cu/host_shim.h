// cupy_rope: host (CPU) build of the kernel source, for tests on machines without a GPU.
//
// Included before the kernel sources and compiled with g++ (cupy_rope/_hostkernels.py).
// Each kernel entry point becomes an extern "C" function NAME(grid, block, params) that runs
// every (block, thread) of the launch in order. The kernels use no warp intrinsics; shared memory
// holds slots private to each thread (the asynchronous row ring, copied at once here) and, in the
// kernels with an exchange (rope_common.cuh exchange_barrier), values one thread writes and others
// read after the block's one barrier: their host entry runs each block's threads twice, up to the
// barrier (phase 0: every thread writes its values and returns there), then through it (phase 1:
// the writes repeat with the same values, the reads see every thread's), so that a sequential run
// computes what the GPU computes.
#pragma once
#include <cmath>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define CUPY_ROPE_SHARED static thread_local

// Counted here so that the tests see each path taken where it should be (on the device the
// counts are not kept): [0] threads of a one-row launch whose shared cos/sin they could not use
// (a pair of two angles in their unit; rope.cu), [1] rows rotated with cos/sin computed for the
// row alone (rotate_fresh: a unit with a pair of two angles) rather than held for the unit,
// [2] vector loads and stores at an address that is not a multiple of their size (the GPU
// faults on them; here they are skipped, as the CPU's aligned 16-byte moves would fault the
// process, and the host launcher raises on any), [3] units whose cos/sin came from a cache in
// whole 16-byte loads (cache_sincos), [4] threads of one-row launches that loaded their token's
// position before their rows' vectors (rope.cu).
static long long cupy_rope_counts[5] = {0, 0, 0, 0, 0};
#define CUPY_ROPE_COUNT_UNSHARED() (++cupy_rope_counts[0])
#define CUPY_ROPE_COUNT_FRESH() (++cupy_rope_counts[1])
#define CUPY_ROPE_COUNT_CACHE_VEC() (++cupy_rope_counts[3])
#define CUPY_ROPE_COUNT_POSITION_FIRST() (++cupy_rope_counts[4])
#define CUPY_ROPE_ALIGNED(p, n) (reinterpret_cast<unsigned long long>(p) % (n) == 0 || (++cupy_rope_counts[2], false))
extern "C" long long cupy_rope_count(int which, int reset) {
  const long long n = cupy_rope_counts[which];
  if (reset) cupy_rope_counts[which] = 0;
  return n;
}

// The block barrier of the kernels with an exchange: the code after it runs in phase 1 only.
static thread_local int cupy_rope_host_phase = 1;
#define CUPY_ROPE_EXCHANGE
static inline bool exchange_barrier(bool) { return cupy_rope_host_phase == 1; }

#ifndef __noinline__
#define __noinline__ __attribute__((noinline))
#endif

struct cupy_rope_dim3 {
  unsigned int x, y, z;
};
static thread_local cupy_rope_dim3 threadIdx, blockIdx, blockDim, gridDim;

static inline void sincosf_host(float a, float* s, float* c) {
  *s = std::sin(a);
  *c = std::cos(a);
}
#define sincosf sincosf_host
static inline void sincos_host(double a, double* s, double* c) {
  *s = std::sin(a);
  *c = std::cos(a);
}
#define sincos sincos_host

#include <cstring>
static inline unsigned int __float_as_uint(float a) {
  unsigned int u;
  std::memcpy(&u, &a, sizeof u);
  return u;
}
static inline float __uint_as_float(unsigned int u) {
  float a;
  std::memcpy(&a, &u, sizeof a);
  return a;
}

static inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return (unsigned int)(((unsigned long long)a * b) >> 32);
}

// NAME(grid, block, params): a grid of one row (every launch's); params holds one parameter block
// for every block (the single entry) or two (the pair entry: one per part of the grid,
// first_part); PICK: block b's, setting blk, its index in its part. PHASES: 2 for the kernels with
// an exchange.
#define CUPY_ROPE_HOST_ENTRY(NAME, PARAMS, BODY, PICK, PHASES)                                  \
  extern "C" void NAME(unsigned int grid, unsigned int block, const void* params) {          \
    gridDim = {grid, 1, 1};                                                                    \
    blockDim = {block, 1, 1};                                                                  \
    const PARAMS* ps = static_cast<const PARAMS*>(params);                                     \
    for (unsigned int b = 0; b < grid; ++b) {                                                  \
      blockIdx = {b, 0, 0};                                                                    \
      unsigned blk = b;                                                                        \
      const PARAMS& p = PICK;                                                                  \
      for (int phase = 2 - (PHASES); phase < 2; ++phase) {                                     \
        cupy_rope_host_phase = phase;                                                          \
        for (unsigned int t = 0; t < block; ++t) {                                             \
          threadIdx = {t, 0, 0};                                                               \
          BODY(p, blk);                                                                        \
        }                                                                                      \
      }                                                                                        \
    }                                                                                          \
  }
#define CUPY_ROPE_HOST_PAIR (cupy_rope::first_part(ps[0].blocks, b, blk) ? ps[0] : ps[1])
#define CUPY_ROPE_ENTRY(NAME, PARAMS, BODY, MIN_BLOCKS) CUPY_ROPE_HOST_ENTRY(NAME, PARAMS, BODY, ps[0], 1)
#define CUPY_ROPE_ENTRY_PAIR(NAME, PARAMS, BODY, MIN_BLOCKS) CUPY_ROPE_HOST_ENTRY(NAME, PARAMS, BODY, CUPY_ROPE_HOST_PAIR, 1)
#define CUPY_ROPE_ENTRY_PAIR_EXCHANGE(NAME, PARAMS, BODY, MIN_BLOCKS) CUPY_ROPE_HOST_ENTRY(NAME, PARAMS, BODY, CUPY_ROPE_HOST_PAIR, 2)

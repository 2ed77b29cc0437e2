// The kernel launch of cupy_rope's C++ launch paths (the torch ops' csrc/torch_launch.cpp, the
// XLA handler csrc/xla_launch.cpp, the CuPy launch-cache hits' csrc/cupy_launch.cpp), without CUDA
// headers: cuLaunchKernel and cuLaunchKernelEx are looked up in libcuda when first needed, their
// structs declared as cuda.h lays them out. The Python launch layer (cupy_rope/_launch.py)
// declares the same structs for ctypes.
#pragma once

#include <dlfcn.h>

namespace cupy_rope {

// CUlaunchAttribute and CUlaunchConfig (cuda.h, CUDA 12+).
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    int value;
    char raw[64];
  };
};
struct LaunchConfig {
  unsigned grid[3], block[3], shared_bytes;
  void* stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
static_assert(sizeof(LaunchAttribute) == 72 && sizeof(LaunchConfig) == 56, "cuda.h launch structs");
constexpr int kProgrammaticStreamSerialization = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
constexpr int kLibcudaMissing = -1;                   // returned when libcuda lacks the entry point

using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
using LaunchExFn = int (*)(const LaunchConfig*, void*, void**, void**);

inline void* libcuda_symbol(const char* name) {
  static void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  return h == nullptr ? nullptr : dlsym(h, name);
}

// Launch kernel `fn` on a (gx, gy) grid of `block`-thread blocks on `stream` with the parameter
// blocks `argv`, through the driver entry points `plain` (cuLaunchKernel) and `ex`
// (cuLaunchKernelEx); `pdl`: as a programmatic dependent launch (`ex` with the programmatic stream
// serialization attribute). Returns the CUresult (kLibcudaMissing: the entry point is null).
inline int launch_with(LaunchFn plain, LaunchExFn ex, void* fn, unsigned gx, unsigned gy, unsigned block,
                       void* stream, void** argv, bool pdl) {
  if (pdl) {
    if (ex == nullptr) return kLibcudaMissing;
    LaunchAttribute attr{};
    attr.id = kProgrammaticStreamSerialization;
    attr.value = 1;
    const LaunchConfig cfg{{gx, gy, 1}, {block, 1, 1}, 0, stream, &attr, 1};
    return ex(&cfg, fn, argv, nullptr);
  }
  if (plain == nullptr) return kLibcudaMissing;
  return plain(fn, gx, gy, 1, block, 1, 1, 0, stream, argv, nullptr);
}

// launch_with libcuda's entry points (looked up on first use).
inline int launch(void* fn, unsigned gx, unsigned gy, unsigned block, void* stream, void** argv, bool pdl) {
  static const auto ex = reinterpret_cast<LaunchExFn>(libcuda_symbol("cuLaunchKernelEx"));
  static const auto plain = reinterpret_cast<LaunchFn>(libcuda_symbol("cuLaunchKernel"));
  return launch_with(plain, ex, fn, gx, gy, block, stream, argv, pdl);
}

}  // namespace cupy_rope

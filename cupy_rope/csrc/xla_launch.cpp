// cupy_rope's XLA launch in C++: an XLA FFI handler (custom call target "cupy_rope_launch") that
// launches a cupy_rope kernel on XLA's stream, into the buffers XLA allocated, with no Python at
// run time. Marked command-buffer compatible: XLA may record it into its CUDA graphs.
//
// Everything a launch needs is in the call's attributes, fixed when the call was traced
// (cupy_rope/_xla.py): the kernel's name, its packed parameter blocks (address words hold the
// byte offset into their buffer), the address slots (buffer, word) and the geometry. The kernel
// itself is compiled by the Python launch layer, which registers its CUfunction per device
// (cupy_rope_xla_register) before XLA runs the call; a kernel not registered on the call's device
// is an error, not a launch.
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "cuda_launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr size_t kMaxWords = 256;  // parameter words of one launch (the kernels take <= 2 x 42)

std::mutex mu;
std::unordered_map<std::string, void*> functions;  // "<kernel>@<device>" -> CUfunction

std::string function_key(std::string_view kernel, int64_t device) {
  std::string key(kernel);
  key += '@';
  key += std::to_string(device);
  return key;
}

void* lookup(std::string_view kernel, int64_t device) {
  std::lock_guard<std::mutex> g(mu);
  auto it = functions.find(function_key(kernel, device));
  return it == functions.end() ? nullptr : it->second;
}

// geometry = [gx, gy, block, parameter blocks, programmatic (0/1)];
// slots = [buffer, word, ...]: buffer b < #args is argument b, else result b - #args.
ffi::Error launch_call(void* stream, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,
                       std::string_view kernel, ffi::Span<const int64_t> params, ffi::Span<const int64_t> slots,
                       ffi::Span<const int64_t> geometry) {
  if (geometry.size() != 5 || slots.size() % 2 != 0 || params.size() > kMaxWords || geometry[3] < 1 ||
      geometry[3] > 4 || params.size() % geometry[3] != 0)
    return ffi::Error::InvalidArgument("cupy_rope: malformed launch attributes");
  if (geometry[0] == 0) return ffi::Error::Success();  // empty grid: nothing to do
  void* fn = lookup(kernel, device);
  if (fn == nullptr)
    return ffi::Error::Internal("cupy_rope: kernel " + std::string(kernel) + " is not loaded on device " +
                                std::to_string(device) + " (it is compiled when the call is traced)");
  int64_t words[kMaxWords];
  for (size_t i = 0; i < params.size(); ++i) words[i] = params[i];
  const size_t nargs = args.size();
  for (size_t i = 0; i < slots.size(); i += 2) {
    const int64_t b = slots[i], w = slots[i + 1];
    if (b < 0 || static_cast<size_t>(b) >= nargs + rets.size() || w < 0 || static_cast<size_t>(w) >= params.size())
      return ffi::Error::InvalidArgument("cupy_rope: launch slot out of range");
    void* base;
    if (static_cast<size_t>(b) < nargs) {
      auto buf = args.get<ffi::AnyBuffer>(b);
      if (!buf.has_value()) return buf.error();
      base = buf->untyped_data();
    } else {
      auto buf = rets.get<ffi::AnyBuffer>(b - nargs);
      if (!buf.has_value()) return buf.error();
      base = (*buf)->untyped_data();
    }
    const auto addr = reinterpret_cast<intptr_t>(base);
    if (addr % 16 != 0)  // the launch was planned for 16-byte aligned buffers
      return ffi::Error::InvalidArgument("cupy_rope: XLA buffer " + std::to_string(b) + " at address " +
                                         std::to_string(addr) + " is not 16-byte aligned");
    words[w] += addr;  // the word holds the byte offset into the buffer
  }
  void* argv[4];
  const size_t step = params.size() / geometry[3];
  for (int64_t i = 0; i < geometry[3]; ++i) argv[i] = words + i * step;
  const int rc = cupy_rope::launch(fn, static_cast<unsigned>(geometry[0]), static_cast<unsigned>(geometry[1]),
                                   static_cast<unsigned>(geometry[2]), stream, argv, geometry[4] != 0);
  if (rc != 0)
    return ffi::Error::Internal("cupy_rope: kernel launch failed with CUresult " + std::to_string(rc) +
                                (rc == cupy_rope::kLibcudaMissing ? " (libcuda.so.1 or its launch entry point "
                                                                    "not found)" : ""));
  return ffi::Error::Success();
}

}  // namespace

// Register kernel `name`'s CUfunction `fn` on CUDA device `device` (called by cupy_rope/_xla.py).
extern "C" void cupy_rope_xla_register(const char* name, int device, void* fn) {
  std::lock_guard<std::mutex> g(mu);
  functions[function_key(name, device)] = fn;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(cupy_rope_xla_launch, launch_call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("kernel")
                                  .Attr<ffi::Span<const int64_t>>("params")
                                  .Attr<ffi::Span<const int64_t>>("slots")
                                  .Attr<ffi::Span<const int64_t>>("geometry"),
                              {ffi::Traits::kCmdBufferCompatible});

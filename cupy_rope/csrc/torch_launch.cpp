// cupy_rope's torch launch path in C++ (the torch shim's CUDA kernels of the cupy_rope ops).
//
// One boxed dispatcher kernel serves every op (rope, rope_qk, rope_qk_, rope_pos, rope_pos_ and
// the autograd-free _rope_impl / _rope_qk_impl / _rope_pos_impl). Per call it builds the call's
// signature (each tensor's sizes, strides, dtype, device and address mod 16; every other
// argument's value; for in-place ops the overlap signature) and looks up the launch the Python
// path prepared for that signature. On a hit: outputs from torch's caching allocator, the addresses written into a copy of the
// prepared parameter blocks, cuLaunchKernel (cuLaunchKernelEx with the programmatic stream
// serialization attribute where the Python path's launch is a programmatic dependent launch,
// cupy_rope/_launch.py) on torch's current stream. Nothing else: no
// validation (the Python path validated this exact signature), no Python, no synchronisation.
// On a miss (or in debug mode) it runs the Python op ``cupy_rope::_py_<op>`` on the same stack:
// validation, plan, compile and launch in Python, which hands its prepared launch back through
// ``cupy_rope::_ext_put`` for the next call with this signature.
//
// No CUDA headers: the launch is cuda_launch.h's (libcuda looked up when first needed), torch's
// current stream comes from c10's device-generic stream interface.
#ifdef CUPY_ROPE_PYTHON
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include "py_values.h"
#endif
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "cuda_launch.h"
#include "overlap.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// The op families (ops of one family share a schema, a Python op and an address order).
enum Family { ROPE, QK, QK_INPLACE, POS, POS_INPLACE };

struct Out {
  int64_t like;
  bool transposed;
  int64_t align;
  std::vector<int64_t> shape;
};

struct Entry {
  void* fn;
  unsigned gx, gy, block;
  bool pdl;                                  // a programmatic dependent launch (cuLaunchKernelEx)
  std::vector<int64_t> params;               // the packed parameter blocks, 64-bit words
  std::vector<int64_t> blocks;               // word offset of each parameter block
  std::vector<std::vector<int64_t>> slots;   // per address (in launch order): its words
  std::vector<Out> outs;
};

using Key = std::vector<int64_t>;
struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t v : k) {
      h ^= static_cast<uint64_t>(v);
      h *= 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

std::mutex mu;
std::unordered_map<Key, std::shared_ptr<const Entry>, KeyHash> cache;
bool enabled = true;
std::atomic<int64_t> hits{0}, misses{0};
constexpr size_t kMaxEntries = 4096;
thread_local const Key* pending = nullptr;  // the signature a miss is resolving on this thread

void push_string(Key& key, c10::string_view s) {
  key.push_back(static_cast<int64_t>(s.size()));
  for (char c : s) key.push_back(c);
}

void push_tensor(Key& key, const at::Tensor& t) {
  key.push_back(t.dim());
  for (int64_t s : t.sizes()) key.push_back(s);
  for (int64_t s : t.strides()) key.push_back(s);
  key.push_back(static_cast<int64_t>(t.scalar_type()));
  key.push_back(t.device().index());
  key.push_back(reinterpret_cast<intptr_t>(t.data_ptr()) & 15);
}

// The signature of a call: the op, then every argument (tensors described, None marked).
bool make_key(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, Key& key) {
  key.push_back(reinterpret_cast<intptr_t>(&op.schema()));
  for (const auto& a : args) {
    if (a.isTensor()) {
      const auto& t = a.toTensor();
      if (!t.is_cuda()) return false;
      key.push_back(1);
      push_tensor(key, t);
    } else if (a.isNone()) {
      key.push_back(2);
    } else if (a.isBool()) {
      key.push_back(3);
      key.push_back(a.toBool());
    } else if (a.isInt()) {
      key.push_back(4);
      key.push_back(a.toInt());
    } else if (a.isString()) {
      key.push_back(5);
      push_string(key, a.toStringView());
    } else {
      return false;
    }
  }
  return true;
}

Family family_of(const std::string& name) {
  if (name == "cupy_rope::rope" || name == "cupy_rope::_rope_impl") return ROPE;
  if (name == "cupy_rope::rope_qk" || name == "cupy_rope::_rope_qk_impl") return QK;
  if (name == "cupy_rope::rope_qk_") return QK_INPLACE;
  if (name == "cupy_rope::rope_pos" || name == "cupy_rope::_rope_pos_impl") return POS;
  return POS_INPLACE;
}

const char* py_op_of(Family f) {
  switch (f) {
    case ROPE: return "cupy_rope::_py_rope";
    case QK: return "cupy_rope::_py_rope_qk";
    case QK_INPLACE: return "cupy_rope::_py_rope_qk_";
    case POS: return "cupy_rope::_py_rope_pos";
    default: return "cupy_rope::_py_rope_pos_";
  }
}

// The arrays whose addresses the launch takes, in the Python path's order (None: address 0).
std::vector<const at::Tensor*> launch_arrays(Family f, c10::ArrayRef<c10::IValue> a) {
  auto t = [&](size_t i) -> const at::Tensor* { return a[i].isTensor() ? &a[i].toTensor() : nullptr; };
  switch (f) {
    case ROPE: return {t(0), t(1), t(4), t(5)};               // x, freqs, cu_seqlens, start_positions
    case QK: case QK_INPLACE: return {t(0), t(1), t(2), t(5), t(6)};  // q, k, freqs, cu, sp
    default: return {t(1), t(2), t(3), t(0)};                // q, k, table, positions
  }
}

// The Python op of family f (looked up once; C++ initialises function-local statics thread-safely).
const c10::OperatorHandle& py_op(Family f) {
  auto find = [](Family g) { return c10::Dispatcher::singleton().findSchemaOrThrow(py_op_of(g), ""); };
  static const c10::OperatorHandle ops[5] = {find(ROPE), find(QK), find(QK_INPLACE), find(POS), find(POS_INPLACE)};
  return ops[f];
}

void run_python(Family f, const Key* key, torch::jit::Stack* stack) {
  const Key* prev = pending;
  pending = key;
  try {
    py_op(f).callBoxed(stack);
  } catch (...) {
    pending = prev;
    throw;
  }
  pending = prev;
}

// The bytes of t's elements (none for no tensor).
cupy_rope::ByteRange bytes_of(const at::Tensor* t) {
  if (t == nullptr) return {};
  return cupy_rope::byte_range(reinterpret_cast<intptr_t>(t->data_ptr()), t->dim(),
                               static_cast<int64_t>(t->element_size()), [t](int64_t i) { return t->size(i); },
                               [t](int64_t i) { return t->stride(i) * static_cast<int64_t>(t->element_size()); });
}

// A hit: allocate the outputs (into `outs`), patch, launch. False (nothing launched) when an
// output's address alignment differs from the prepared launch's.
bool run_cached(const Entry& e, Family f, const std::vector<const at::Tensor*>& arrays, std::vector<at::Tensor>& outs) {
  const at::Tensor& lead = *arrays[0];
  outs.reserve(e.outs.size());
  std::vector<int64_t> addr;
  addr.reserve(arrays.size() + 2);
  for (const at::Tensor* a : arrays) addr.push_back(a ? reinterpret_cast<intptr_t>(a->data_ptr()) : 0);
  if (f == QK_INPLACE || f == POS_INPLACE) {
    addr.push_back(addr[0]);
    addr.push_back(addr[1]);
  }
  for (const Out& o : e.outs) {
    const at::Tensor& like = *arrays[o.like];
    at::Tensor y;
    if (o.transposed) {
      std::vector<int64_t> alloc(o.shape);
      std::swap(alloc[0], alloc[1]);
      y = at::empty(alloc, like.options()).permute({1, 0, 2, 3});
    } else {
      y = at::empty(o.shape, like.options());
    }
    int64_t p = reinterpret_cast<intptr_t>(y.data_ptr());
    if ((p & 15) != o.align) return false;
    addr.push_back(p);
    outs.push_back(std::move(y));
  }
  std::vector<int64_t> params(e.params);
  for (size_t i = 0; i < e.slots.size() && i < addr.size(); ++i)
    for (int64_t w : e.slots[i]) params[w] = addr[i];
  void* argv[4];
  for (size_t i = 0; i < e.blocks.size(); ++i) argv[i] = params.data() + e.blocks[i];
  c10::DeviceGuard guard(lead.device());
  void* stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(lead.device()).native_handle();
  const int rc = cupy_rope::launch(e.fn, e.gx, e.gy, e.block, stream, argv, e.pdl);
  TORCH_CHECK(rc == 0, "cupy_rope: kernel launch failed with CUresult ", rc,
              rc == cupy_rope::kLibcudaMissing ? " (libcuda.so.1 or its launch entry point not found)" : "");
  return true;
}

// The op's returns on the stack in place of its `nargs` arguments.
void push_outputs(Family f, std::vector<at::Tensor>& outs, torch::jit::Stack* stack, size_t nargs) {
  torch::jit::drop(*stack, nargs);
  switch (f) {
    case ROPE: torch::jit::push(*stack, std::move(outs[0])); break;
    case QK: torch::jit::push(*stack, std::move(outs[0]), std::move(outs[1])); break;
    case POS: {
      c10::List<at::Tensor> l;
      for (auto& y : outs) l.push_back(std::move(y));
      torch::jit::push(*stack, std::move(l));
      break;
    }
    default: break;
  }
}

// The cached launch of a call (op and arguments): its family, signature and arrays, and the
// prepared launch (null on a miss or when the call cannot be keyed).
struct Lookup {
  Family f;
  Key key;
  bool keyed;
  std::vector<const at::Tensor*> arrays;
  std::shared_ptr<const Entry> entry;
};

Lookup lookup(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  Lookup l{family_of(op.schema().name()), {}, false, {}, nullptr};
  l.key.reserve(64);
  l.arrays = launch_arrays(l.f, args);
  l.keyed = make_key(op, args, l.key);
  if (l.keyed && (l.f == QK_INPLACE || l.f == POS_INPLACE)) cupy_rope::push_overlaps(l.key, l.arrays, 2, bytes_of);
  if (l.keyed) {
    std::lock_guard<std::mutex> g(mu);
    if (enabled) {
      auto it = cache.find(l.key);
      if (it != cache.end()) l.entry = it->second;
    }
  }
  return l;
}

void kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  Lookup l = lookup(op, torch::jit::last(*stack, nargs));
  std::vector<at::Tensor> outs;
  if (l.entry && run_cached(*l.entry, l.f, l.arrays, outs)) {
    ++hits;
    push_outputs(l.f, outs, stack, nargs);
    return;
  }
  ++misses;
  run_python(l.f, l.keyed ? &l.key : nullptr, stack);
}

// The autograd kernel of the out-of-place ops (rope, rope_qk, rope_pos) for CUDA and CPU tensors.
// A call that needs no gradient (no differentiable input -- x; q and k -- requires grad with grad
// mode on or carries a tangent) goes straight to the op's kernel below autograd, with no Python;
// one that does runs the torch shim's Python autograd kernel (op cupy_rope::_ag_<op>, the op's
// schema), which records the autograd node. The shim registers the same Python kernel for the
// other autograd keys.
const c10::OperatorHandle& ag_op(Family f) {
  auto find = [](const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); };
  static const c10::OperatorHandle rope = find("cupy_rope::_ag_rope"), qk = find("cupy_rope::_ag_rope_qk"),
                                   pos = find("cupy_rope::_ag_rope_pos");
  return f == ROPE ? rope : f == QK ? qk : pos;
}

// A differentiable input requires grad (grad mode on) or carries a forward-mode tangent (level 0,
// the level torch's own autograd kernels check).
bool needs_grad(Family f, c10::ArrayRef<c10::IValue> a) {
  const bool grad_mode = c10::GradMode::is_enabled();
  auto rg = [&](size_t i) {
    if (!a[i].isTensor()) return false;
    const at::Tensor& t = a[i].toTensor();
    return (grad_mode && t.requires_grad()) || t._fw_grad(0).defined();
  };
  switch (f) {
    case ROPE: return rg(0);             // x
    case QK: return rg(0) || rg(1);      // q, k
    default: return rg(1) || rg(2);      // positions, q, k
  }
}

void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const Family f = family_of(op.schema().name());
  if (needs_grad(f, torch::jit::last(*stack, op.schema().arguments().size()))) {
    ag_op(f).callBoxed(stack);
    return;
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

// Called by the Python path (while it resolves a miss of this thread) with its prepared launch.
void ext_put(int64_t fn, int64_t gx, int64_t gy, int64_t block, bool pdl, c10::ArrayRef<int64_t> params,
             c10::ArrayRef<int64_t> blocks, c10::ArrayRef<int64_t> slot_counts,
             c10::ArrayRef<int64_t> slot_words, c10::ArrayRef<int64_t> outs) {
  if (pending == nullptr) return;
  TORCH_CHECK(blocks.size() <= 4, "cupy_rope: at most 4 parameter blocks");
  auto e = std::make_shared<Entry>();
  e->fn = reinterpret_cast<void*>(static_cast<intptr_t>(fn));
  e->gx = static_cast<unsigned>(gx);
  e->gy = static_cast<unsigned>(gy);
  e->block = static_cast<unsigned>(block);
  e->pdl = pdl;
  e->params.assign(params.begin(), params.end());
  e->blocks.assign(blocks.begin(), blocks.end());
  size_t w = 0;
  for (int64_t n : slot_counts) {
    e->slots.emplace_back(slot_words.begin() + w, slot_words.begin() + w + n);
    w += n;
  }
  for (size_t i = 0; i < outs.size();) {  // like, transposed, align, ndim, dims...
    Out o{outs[i], outs[i + 1] != 0, outs[i + 2], {}};
    int64_t nd = outs[i + 3];
    o.shape.assign(outs.begin() + i + 4, outs.begin() + i + 4 + nd);
    e->outs.push_back(std::move(o));
    i += 4 + nd;
  }
  std::lock_guard<std::mutex> g(mu);
  if (!enabled) return;
  if (cache.size() >= kMaxEntries) cache.clear();
  cache[*pending] = std::move(e);
}

// enabled = false (debug mode): every call takes the Python path; the cache is dropped.
void ext_set_enabled(bool on) {
  std::lock_guard<std::mutex> g(mu);
  enabled = on;
  cache.clear();
}

std::vector<int64_t> ext_info() {
  std::lock_guard<std::mutex> g(mu);
  return {hits.load(), misses.load(), static_cast<int64_t>(cache.size())};
}

}  // namespace


#ifdef CUPY_ROPE_PYTHON
// The fast entry (built where Python's headers are found): a Python function that serves a
// cached call of one of kFastOps straight from Python, without the dispatcher's argument boxing:
// fast(op index, *op arguments) -> the op's outputs (a tensor, a tuple of two, a list), True
// (in-place ops: done) or None (not served: a miss, or an argument it does not take; the caller
// then calls the op). The caller keeps the dispatcher's other duties: only plain CUDA tensors,
// no autograd, no dispatch modes, not while compiling; in-place callers bump version counters.
namespace {

const char* const kFastOps[] = {"cupy_rope::_rope_impl", "cupy_rope::_rope_qk_impl", "cupy_rope::rope_qk_",
                                "cupy_rope::_rope_pos_impl", "cupy_rope::rope_pos_"};
constexpr size_t kNumFastOps = sizeof(kFastOps) / sizeof(kFastOps[0]);

const c10::OperatorHandle& fast_op(size_t i) {
  static const std::vector<c10::OperatorHandle> ops = [] {
    std::vector<c10::OperatorHandle> v;
    for (const char* name : kFastOps) v.push_back(c10::Dispatcher::singleton().findSchemaOrThrow(name, ""));
    return v;
  }();
  return ops[i];
}

// A Python argument as the IValue the dispatcher would make of it; false for any other kind of
// argument (the call is then left to the dispatcher, which validates it).
bool to_ivalue(PyObject* o, c10::IValue& v) {
  if (o == Py_None) {
    v = c10::IValue();
  } else if (THPVariable_CheckExact(o)) {
    v = THPVariable_Unpack(o);
  } else if (PyBool_Check(o)) {
    v = o == Py_True;
  } else if (PyLong_CheckExact(o)) {
    int64_t x = 0;
    if (!cupy_rope::py_int64(o, x)) return false;
    v = x;
  } else if (PyUnicode_CheckExact(o)) {
    Py_ssize_t n = 0;
    const char* c = nullptr;
    if (!cupy_rope::py_utf8(o, c, n)) return false;
    v = std::string(c, static_cast<size_t>(n));
  } else {
    return false;
  }
  return true;
}

PyObject* fast_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || !PyLong_CheckExact(args[0])) {
    PyErr_SetString(PyExc_TypeError, "cupy_rope fast entry: expected (op index, *arguments)");
    return nullptr;
  }
  const size_t index = PyLong_AsSize_t(args[0]);
  if (PyErr_Occurred() || index >= kNumFastOps) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "cupy_rope fast entry: op index out of range");
    return nullptr;
  }
  try {
    const c10::OperatorHandle& op = fast_op(index);
    const size_t n = op.schema().arguments().size();
    if (static_cast<size_t>(nargs - 1) != n) Py_RETURN_NONE;
    std::vector<c10::IValue> stack(n);
    for (size_t j = 0; j < n; ++j)
      if (!to_ivalue(args[j + 1], stack[j])) Py_RETURN_NONE;
    Lookup l = lookup(op, stack);
    std::vector<at::Tensor> outs;
    if (!l.entry || !run_cached(*l.entry, l.f, l.arrays, outs)) Py_RETURN_NONE;
    ++hits;
    switch (l.f) {
      case ROPE: return THPVariable_Wrap(std::move(outs[0]));
      case QK: return Py_BuildValue("(NN)", THPVariable_Wrap(std::move(outs[0])), THPVariable_Wrap(std::move(outs[1])));
      case POS: {
        PyObject* list = PyList_New(static_cast<Py_ssize_t>(outs.size()));
        if (list == nullptr) return nullptr;
        for (size_t k = 0; k < outs.size(); ++k)
          PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), THPVariable_Wrap(std::move(outs[k])));
        return list;
      }
      default: Py_RETURN_TRUE;
    }
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef kFastDef = {"fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_call)),
                        METH_FASTCALL, "cupy_rope's fast entry into the C++ launch cache"};

}  // namespace

// (the fast entry, the names of the ops it serves by index) for cupy_rope/_torch_ext.py.
extern "C" __attribute__((visibility("default"))) PyObject* cupy_rope_torch_fast() {
  PyObject* fn = PyCFunction_New(&kFastDef, nullptr);
  PyObject* names = PyTuple_New(static_cast<Py_ssize_t>(kNumFastOps));
  if (fn == nullptr || names == nullptr) {
    Py_XDECREF(fn);
    Py_XDECREF(names);
    return nullptr;
  }
  for (size_t i = 0; i < kNumFastOps; ++i) PyTuple_SET_ITEM(names, static_cast<Py_ssize_t>(i), PyUnicode_FromString(kFastOps[i]));
  return Py_BuildValue("(NN)", fn, names);
}
#endif

TORCH_LIBRARY_FRAGMENT(cupy_rope, m) {
  m.def("_ext_put(int fn, int gx, int gy, int block, bool pdl, int[] params, int[] blocks, int[] slot_counts, "
        "int[] slot_words, int[] outs) -> ()", &ext_put);
  m.def("_ext_set_enabled(bool on) -> ()", &ext_set_enabled);
  m.def("_ext_info() -> int[]", &ext_info);
}

TORCH_LIBRARY_IMPL(cupy_rope, CUDA, m) {
  for (const char* name : {"rope", "_rope_impl", "rope_qk", "_rope_qk_impl", "rope_qk_", "rope_pos",
                           "_rope_pos_impl", "rope_pos_"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&kernel>());
}

TORCH_LIBRARY_IMPL(cupy_rope, AutogradCUDA, m) {
  for (const char* name : {"rope", "rope_qk", "rope_pos"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
}

TORCH_LIBRARY_IMPL(cupy_rope, AutogradCPU, m) {
  for (const char* name : {"rope", "rope_qk", "rope_pos"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
}

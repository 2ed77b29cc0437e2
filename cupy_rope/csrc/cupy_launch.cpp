// cupy_rope's CuPy launch path in C++: the public API's launch-cache hits on CuPy arrays.
//
// The public API keeps one launch cache (cupy_rope/_launch.py: a dict from a call's signature to
// its prepared launch). For calls on CuPy arrays this library builds the signature -- the call's
// constant head and options (None, bool, int, str and tuples of them, each tagged with its type),
// each array's shape, strides, dtype, device and address mod 16 (None marked), and for calls that
// write arrays in place their overlap signature (_launch.overlap_signature) -- as a bytes key and
// looks it up in that dict. A hit is served here: the outputs allocated by CuPy's allocator (the
// configured `alloc`), the addresses written into a copy of the prepared parameter blocks, the
// kernel launched on CuPy's current stream (cuLaunchKernel, or cuLaunchKernelEx as a programmatic
// dependent launch where the Python path's launch is one). Nothing else: no validation (the
// Python path validated this exact signature when it prepared the launch), no synchronisation.
// Anything else -- a miss, a signature it cannot key, another device's context current, an
// output address of another alignment -- is left to the Python path, which validates, plans,
// launches and keeps the launch (with this library's entry, `entry`) under the returned key.
//
// Built with Python's headers only (no CUDA headers, no CuPy headers); the driver's entry points
// come from libcuda (cuda_launch.h) unless `configure` names others (the CPU tests' stand-ins).
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "cuda_launch.h"
#include "overlap.h"
#include "py_values.h"

namespace {

using Key = std::vector<int64_t>;
using CtxGetFn = int (*)(void**);
constexpr const char* kCapsule = "cupy_rope.cupy_launch.Entry";
constexpr int kMaxDepth = 4;  // nesting of tuples in a key

// Type tags of a key's items.
enum Tag : int64_t { ARRAY = 1, NONE = 2, BOOL = 3, INT = 4, STR = 5, TUPLE = 6 };

struct Out {
  Py_ssize_t like;       // the array whose dtype it takes
  PyObject* alloc;       // the shape to allocate (a tuple; bshd order for a transposed output)
  bool transposed;       // returned as an sbhd view over the bshd allocation
  int64_t align;         // address % 16 the prepared launch was planned for
};

struct Entry {
  void* fn = nullptr;
  unsigned gx = 0, gy = 0, block = 0;
  bool pdl = false;
  void* ctx = nullptr;                       // the device's context the function belongs to
  Py_ssize_t device = 0;
  std::vector<int64_t> params;               // the packed parameter blocks, 64-bit words
  std::vector<int64_t> blocks;               // word offset of each parameter block
  std::vector<std::vector<int64_t>> slots;   // per address (in launch order): its words
  std::vector<Out> outs;
  Entry() = default;
  Entry(const Entry&) = delete;  // owns references: one Entry, released once (its capsule's destructor)
  Entry& operator=(const Entry&) = delete;
  ~Entry() {
    for (Out& o : outs) Py_XDECREF(o.alloc);
  }
};

struct Config {
  PyObject* ndarray = nullptr;   // cupy.ndarray (exact type)
  PyObject* alloc = nullptr;     // alloc(shape, dtype) -> a new array
  PyObject* stream = nullptr;    // stream(device) -> the current stream's handle, or an object with .ptr
  PyObject* on_error = nullptr;  // on_error(CUresult) raises
  cupy_rope::LaunchFn plain = nullptr;
  cupy_rope::LaunchExFn ex = nullptr;
  CtxGetFn ctx_get = nullptr;
};
Config cfg;

PyObject *s_shape, *s_strides, *s_dtype, *s_data, *s_ptr, *s_device_id, *s_num, *s_itemsize, *s_byteorder,
    *s_transpose, *transpose_args;
// dtype object (a strong reference: its address stays its own) -> (num << 32) | (itemsize << 8) | byteorder
std::unordered_map<PyObject*, int64_t>* dtype_codes;
constexpr size_t kMaxDtypes = 256;

using cupy_rope::py_int64;

// attribute `name` of `o` as an int64 (false: absent or not an int in range)
bool attr_i64(PyObject* o, PyObject* name, int64_t& v) {
  PyObject* a = PyObject_GetAttr(o, name);
  if (a == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool ok = py_int64(a, v);
  Py_DECREF(a);
  return ok;
}

// A tuple of ints (a shape or strides) appended to `out`.
bool push_ints(PyObject* t, std::vector<int64_t>& out) {
  if (t == nullptr || !PyTuple_Check(t)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); ++i) {
    int64_t v;
    if (!py_int64(PyTuple_GET_ITEM(t, i), v)) return false;
    out.push_back(v);
  }
  return true;
}

// A constant of the call (head, options): None, bool, int, str, tuples of them; false for anything
// else (the call is then not cached).
bool push_value(PyObject* o, Key& key, int depth) {
  if (o == Py_None) {
    key.push_back(NONE);
  } else if (PyBool_Check(o)) {
    key.push_back(BOOL);
    key.push_back(o == Py_True);
  } else if (PyLong_CheckExact(o)) {
    int64_t v;
    if (!py_int64(o, v)) return false;
    key.push_back(INT);
    key.push_back(v);
  } else if (PyUnicode_CheckExact(o)) {
    Py_ssize_t n = 0;
    const char* c = nullptr;
    if (!cupy_rope::py_utf8(o, c, n)) return false;
    key.push_back(STR);
    key.push_back(n);
    for (Py_ssize_t i = 0; i < n; i += 8) {
      int64_t w = 0;
      std::memcpy(&w, c + i, static_cast<size_t>(n - i < 8 ? n - i : 8));
      key.push_back(w);
    }
  } else if (PyTuple_CheckExact(o) && depth < kMaxDepth) {
    key.push_back(TUPLE);
    key.push_back(PyTuple_GET_SIZE(o));
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(o); ++i)
      if (!push_value(PyTuple_GET_ITEM(o, i), key, depth + 1)) return false;
  } else {
    return false;
  }
  return true;
}

// The code of a dtype object (false: not a dtype this path keys).
bool dtype_code(PyObject* dt, int64_t& code) {
  auto it = dtype_codes->find(dt);
  if (it != dtype_codes->end()) {
    code = it->second;
    return true;
  }
  int64_t num, itemsize;
  PyObject* order = PyObject_GetAttr(dt, s_byteorder);
  if (order == nullptr) PyErr_Clear();
  const bool ok = order != nullptr && PyUnicode_Check(order) && PyUnicode_GET_LENGTH(order) == 1 &&
                  attr_i64(dt, s_num, num) && attr_i64(dt, s_itemsize, itemsize) && num >= 0 && num < (1 << 30) &&
                  itemsize > 0 && itemsize < (1 << 23);
  const int64_t bo = ok ? static_cast<int64_t>(PyUnicode_READ_CHAR(order, 0)) & 0xFF : 0;
  Py_XDECREF(order);
  if (!ok) return false;
  code = (num << 32) | (itemsize << 8) | bo;
  if (dtype_codes->size() >= kMaxDtypes) {
    for (auto& kv : *dtype_codes) Py_DECREF(kv.first);
    dtype_codes->clear();
  }
  Py_INCREF(dt);
  (*dtype_codes)[dt] = code;
  return true;
}

// An array's address, byte range [lo, hi) (lo == hi: no elements) and dtype (borrowed: the array,
// which the call's arguments hold, keeps it).
struct Span {
  int64_t ptr = 0;
  cupy_rope::ByteRange bytes;
  PyObject* dtype = nullptr;
};

// A CuPy array described into the key: shape, strides, dtype, device, address % 16.
bool push_array(PyObject* a, Key& key, Span& span) {
  PyObject* shape = PyObject_GetAttr(a, s_shape);
  PyObject* strides = shape ? PyObject_GetAttr(a, s_strides) : nullptr;
  PyObject* dt = strides ? PyObject_GetAttr(a, s_dtype) : nullptr;
  PyObject* data = dt ? PyObject_GetAttr(a, s_data) : nullptr;
  bool ok = data != nullptr;
  if (!ok) PyErr_Clear();
  int64_t code = 0, ptr = 0, device = 0;
  const size_t at = key.size();
  ok = ok && PyTuple_Check(shape) && PyTuple_Check(strides) && PyTuple_GET_SIZE(shape) == PyTuple_GET_SIZE(strides);
  if (ok) {
    key.push_back(ARRAY);
    key.push_back(PyTuple_GET_SIZE(shape));
    ok = push_ints(shape, key) && push_ints(strides, key) && dtype_code(dt, code) && attr_i64(data, s_ptr, ptr) &&
         attr_i64(data, s_device_id, device);
  }
  if (ok) {
    key.push_back(code);
    key.push_back(device);
    key.push_back(ptr & 15);
    const int64_t nd = static_cast<int64_t>(key[at + 1]), isz = (code >> 8) & 0xFFFFFF;
    span.ptr = ptr;
    span.dtype = dt;
    span.bytes = cupy_rope::byte_range(ptr, nd, isz, [&](int64_t d) { return key[at + 2 + d]; },
                                       [&](int64_t d) { return key[at + 2 + nd + d]; });
  }
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  Py_XDECREF(dt);
  Py_XDECREF(data);
  return ok;
}

// An address attribute: data.ptr of a CuPy array.
bool address_of(PyObject* a, int64_t& p) {
  PyObject* data = PyObject_GetAttr(a, s_data);
  if (data == nullptr) return false;
  const bool ok = attr_i64(data, s_ptr, p);
  Py_DECREF(data);
  if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "cupy_rope: an output without an address");
  return ok;
}

enum Served { HIT, LEFT, FAILED };  // launched / left to the Python path / an exception is set

// A hit: allocate the outputs (appended to `result`), patch, launch. The configured callables
// are passed in (held by the caller: Python they run may reconfigure).
Served run(const Entry& e, const std::vector<Span>& spans, std::vector<int64_t>& addr, PyObject* result,
           PyObject* alloc, PyObject* stream_fn, PyObject* on_error) {
  void* ctx = nullptr;
  if (cfg.ctx_get == nullptr || cfg.ctx_get(&ctx) != 0 || ctx != e.ctx) return LEFT;
  for (const Out& o : e.outs) {
    // (the key fixes the arrays' count and which of them are None)
    if (o.like >= static_cast<Py_ssize_t>(spans.size()) || spans[static_cast<size_t>(o.like)].dtype == nullptr)
      return LEFT;
    PyObject* y = PyObject_CallFunctionObjArgs(alloc, o.alloc, spans[static_cast<size_t>(o.like)].dtype, nullptr);
    if (y == nullptr) return FAILED;
    int64_t p = 0;
    if (!address_of(y, p)) {
      Py_DECREF(y);
      return FAILED;
    }
    if (o.transposed) {
      PyObject* t = PyObject_GetAttr(y, s_transpose);
      PyObject* v = t ? PyObject_Call(t, transpose_args, nullptr) : nullptr;
      Py_XDECREF(t);
      Py_DECREF(y);
      if (v == nullptr) return FAILED;
      y = v;
    }
    const int appended = PyList_Append(result, y);
    Py_DECREF(y);
    if (appended != 0) return FAILED;
    if ((p & 15) != o.align) return LEFT;
    addr.push_back(p);
  }
  PyObject* s = PyObject_CallFunction(stream_fn, "n", e.device);
  if (s == nullptr) return FAILED;
  int64_t stream = 0;
  bool ok = PyLong_Check(s) ? py_int64(s, stream) : attr_i64(s, s_ptr, stream);
  Py_DECREF(s);
  if (!ok) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "cupy_rope: the current stream has no handle");
    return FAILED;
  }
  std::vector<int64_t> params(e.params);
  for (size_t i = 0; i < e.slots.size() && i < addr.size(); ++i)
    for (int64_t w : e.slots[i]) params[static_cast<size_t>(w)] = addr[i];
  void* argv[4] = {nullptr, nullptr, nullptr, nullptr};
  for (size_t i = 0; i < e.blocks.size() && i < 4; ++i) argv[i] = params.data() + e.blocks[i];
  const int rc = cupy_rope::launch_with(cfg.plain, cfg.ex, e.fn, e.gx, e.gy, e.block,
                                        reinterpret_cast<void*>(static_cast<intptr_t>(stream)), argv, e.pdl);
  if (rc != 0) {
    PyObject* r = PyObject_CallFunction(on_error, "i", rc);
    if (r != nullptr) {
      Py_DECREF(r);
      PyErr_Format(PyExc_RuntimeError, "cupy_rope: kernel launch failed with CUresult %d", rc);
    }
    return FAILED;
  }
  return HIT;
}

// fast(cache, head, opts, arrays, written): a list of the new outputs (a hit, launched), the call's
// key (bytes: not served here; the caller's full path keeps its launch under it), or None (a
// call this path cannot key: not cached).
PyObject* fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyDict_Check(args[0]) || !PyTuple_Check(args[3]) || !PyLong_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError, "cupy_rope fast: expected (cache, head, opts, arrays, written)");
    return nullptr;
  }
  if (cfg.ndarray == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "cupy_rope fast: not configured");
    return nullptr;
  }
  PyObject* arrays = args[3];
  const Py_ssize_t n = PyTuple_GET_SIZE(arrays);
  const Py_ssize_t written = PyLong_AsSsize_t(args[4]);
  if (written < 0 || written > 2 || written > n) {
    PyErr_Clear();
    PyErr_SetString(PyExc_ValueError, "cupy_rope fast: written must be 0, 1 or 2, at most the arrays' count");
    return nullptr;
  }
  Key key;
  key.reserve(128);
  if (!push_value(args[1], key, 0) || !push_value(args[2], key, 0)) Py_RETURN_NONE;
  std::vector<Span> spans(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(arrays, i);
    if (a == Py_None) {
      key.push_back(NONE);
    } else if (reinterpret_cast<PyObject*>(Py_TYPE(a)) != cfg.ndarray || !push_array(a, key, spans[i])) {
      Py_RETURN_NONE;
    }
  }
  if (written > 0)
    cupy_rope::push_overlaps(key, spans, static_cast<size_t>(written), [](const Span& s) { return s.bytes; });
  PyObject* kb = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(key.data()),
                                           static_cast<Py_ssize_t>(key.size() * sizeof(int64_t)));
  if (kb == nullptr) return nullptr;
  PyObject* hit = PyDict_GetItemWithError(args[0], kb);  // borrowed: (prepared, outputs, entry)
  if (hit == nullptr) return PyErr_Occurred() ? (Py_DECREF(kb), nullptr) : kb;
  PyObject* cap = PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) >= 3 ? PyTuple_GET_ITEM(hit, 2) : nullptr;
  if (cap == nullptr || !PyCapsule_IsValid(cap, kCapsule)) return kb;
  Py_INCREF(cap);  // kept while the hit runs (an allocation may run Python that drops the entry)
  const Entry& e = *static_cast<const Entry*>(PyCapsule_GetPointer(cap, kCapsule));
  std::vector<int64_t> addr;
  addr.reserve(static_cast<size_t>(n + written) + e.outs.size());
  for (Py_ssize_t i = 0; i < n; ++i) addr.push_back(spans[static_cast<size_t>(i)].ptr);
  for (Py_ssize_t i = 0; i < written; ++i) addr.push_back(addr[static_cast<size_t>(i)]);
  PyObject* result = PyList_New(0);
  PyObject *alloc = cfg.alloc, *stream_fn = cfg.stream, *on_error = cfg.on_error;
  Py_INCREF(alloc);
  Py_INCREF(stream_fn);
  Py_INCREF(on_error);
  const Served s = result == nullptr ? FAILED
                   : e.gx == 0       ? LEFT
                                     : run(e, spans, addr, result, alloc, stream_fn, on_error);
  Py_DECREF(alloc);
  Py_DECREF(stream_fn);
  Py_DECREF(on_error);
  Py_DECREF(cap);
  if (s == HIT) {
    Py_DECREF(kb);
    return result;
  }
  Py_XDECREF(result);
  if (s == FAILED) {
    Py_DECREF(kb);
    return nullptr;
  }
  return kb;
}

void drop_entry(PyObject* cap) {
  delete static_cast<Entry*>(PyCapsule_GetPointer(cap, kCapsule));
}

bool ints_of(PyObject* seq, std::vector<int64_t>& out, const char* what) {
  if (PyTuple_Check(seq) && push_ints(seq, out)) return true;
  PyErr_Format(PyExc_TypeError, "cupy_rope entry: %s must be a tuple of ints", what);
  return false;
}

// entry(fn, gx, gy, block, pdl, params, blocks, slots, outs, ctx, device): the C++ side of a
// prepared launch (a capsule), kept in the launch cache's entry. params: the parameter blocks
// (bytes); blocks: word offset of each; slots: per address, the words it is written to; outs: per
// output (index of the array it takes its dtype from, the shape to allocate, transposed, address % 16).
PyObject* entry(PyObject*, PyObject* args) {
  unsigned long long fn = 0, ctx = 0;
  unsigned gx = 0, gy = 0, block = 0;
  int pdl = 0;
  Py_ssize_t device = 0;
  PyObject *params, *blocks, *slots, *outs;
  if (!PyArg_ParseTuple(args, "KIIIpSOOOKn", &fn, &gx, &gy, &block, &pdl, &params, &blocks, &slots, &outs, &ctx,
                        &device))
    return nullptr;
  auto* e = new Entry();
  e->fn = reinterpret_cast<void*>(static_cast<uintptr_t>(fn));
  e->ctx = reinterpret_cast<void*>(static_cast<uintptr_t>(ctx));
  e->gx = gx;
  e->gy = gy;
  e->block = block;
  e->pdl = pdl != 0;
  e->device = device;
  const Py_ssize_t nbytes = PyBytes_GET_SIZE(params);
  e->params.resize(static_cast<size_t>(nbytes) / 8);
  std::memcpy(e->params.data(), PyBytes_AS_STRING(params), e->params.size() * 8);
  bool ok = nbytes % 8 == 0 && ints_of(blocks, e->blocks, "blocks") && PyTuple_Check(slots) && PyTuple_Check(outs) &&
            e->blocks.size() <= 4;
  for (int64_t b : e->blocks) ok = ok && b >= 0 && static_cast<size_t>(b) < e->params.size();
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(slots); ++i) {
    e->slots.emplace_back();
    ok = ints_of(PyTuple_GET_ITEM(slots, i), e->slots.back(), "a slot list");
    for (int64_t w : e->slots.back()) ok = ok && w >= 0 && static_cast<size_t>(w) < e->params.size();
  }
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(outs); ++i) {
    PyObject* o = PyTuple_GET_ITEM(outs, i);
    Out out{0, nullptr, false, 0};
    int64_t like = -1, tr = 0;
    ok = PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 4 && py_int64(PyTuple_GET_ITEM(o, 0), like) &&
         PyTuple_Check(PyTuple_GET_ITEM(o, 1)) && py_int64(PyTuple_GET_ITEM(o, 2), tr) &&
         py_int64(PyTuple_GET_ITEM(o, 3), out.align) && like >= 0;
    if (ok) {
      out.like = static_cast<Py_ssize_t>(like);
      out.transposed = tr != 0;
      out.alloc = PyTuple_GET_ITEM(o, 1);
      Py_INCREF(out.alloc);
      e->outs.push_back(out);
    }
  }
  if (!ok) {
    delete e;
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "cupy_rope entry: malformed launch");
    return nullptr;
  }
  PyObject* cap = PyCapsule_New(e, kCapsule, drop_entry);
  if (cap == nullptr) delete e;
  return cap;
}

template <typename F>
F symbol_or(unsigned long long addr, const char* name) {
  return addr != 0 ? reinterpret_cast<F>(static_cast<uintptr_t>(addr))
                   : reinterpret_cast<F>(cupy_rope::libcuda_symbol(name));
}

// configure(ndarray, alloc, stream, on_error, ctx_get, launch, launch_ex): the array type served,
// the allocator, the current-stream query, the error raiser, and the driver's cuCtxGetCurrent,
// cuLaunchKernel and cuLaunchKernelEx (addresses; 0: libcuda's).
PyObject* configure(PyObject*, PyObject* args) {
  PyObject *ndarray, *alloc, *stream, *on_error;
  unsigned long long ctx_get = 0, plain = 0, ex = 0;
  if (!PyArg_ParseTuple(args, "OOOOKKK", &ndarray, &alloc, &stream, &on_error, &ctx_get, &plain, &ex)) return nullptr;
  if (!PyType_Check(ndarray) || !PyCallable_Check(alloc) || !PyCallable_Check(stream) || !PyCallable_Check(on_error)) {
    PyErr_SetString(PyExc_TypeError, "cupy_rope configure: expected (type, callable, callable, callable, int, int, int)");
    return nullptr;
  }
  for (PyObject* o : {ndarray, alloc, stream, on_error}) Py_INCREF(o);
  Py_XDECREF(cfg.ndarray);
  Py_XDECREF(cfg.alloc);
  Py_XDECREF(cfg.stream);
  Py_XDECREF(cfg.on_error);
  cfg.ndarray = ndarray;
  cfg.alloc = alloc;
  cfg.stream = stream;
  cfg.on_error = on_error;
  cfg.ctx_get = symbol_or<CtxGetFn>(ctx_get, "cuCtxGetCurrent");
  cfg.plain = symbol_or<cupy_rope::LaunchFn>(plain, "cuLaunchKernel");
  cfg.ex = symbol_or<cupy_rope::LaunchExFn>(ex, "cuLaunchKernelEx");
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"fast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast)), METH_FASTCALL,
     "a launch-cache hit on CuPy arrays, served in C++"},
    {"entry", &entry, METH_VARARGS, "the C++ side of a prepared launch"},
    {"configure", &configure, METH_VARARGS, "the array type, allocator, stream query and driver entry points"},
};

bool init() {
  if (dtype_codes != nullptr) return true;
  const char* names[] = {"shape", "strides", "dtype", "data", "ptr", "device_id", "num", "itemsize", "byteorder",
                         "transpose"};
  PyObject** slots[] = {&s_shape, &s_strides, &s_dtype, &s_data, &s_ptr, &s_device_id, &s_num, &s_itemsize,
                        &s_byteorder, &s_transpose};
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); ++i)
    if ((*slots[i] = PyUnicode_InternFromString(names[i])) == nullptr) return false;
  transpose_args = Py_BuildValue("(iiii)", 1, 0, 2, 3);
  if (transpose_args == nullptr) return false;
  dtype_codes = new std::unordered_map<PyObject*, int64_t>();  // kept for the process's lifetime
  return true;
}

}  // namespace

// (fast, entry, configure) for cupy_rope/_cupy_ext.py.
extern "C" __attribute__((visibility("default"))) PyObject* cupy_rope_cupy_launch() {
  if (!init()) return nullptr;
  PyObject* t = PyTuple_New(3);
  if (t == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < 3; ++i) {
    PyObject* f = PyCFunction_New(&kMethods[i], nullptr);
    if (f == nullptr) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, i, f);
  }
  return t;
}

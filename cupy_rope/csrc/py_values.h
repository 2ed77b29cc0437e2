// Python values as the C++ launch paths read them (csrc/torch_launch.cpp's fast entry,
// csrc/cupy_launch.cpp): an int as int64 (false: not an int, or out of range), a str as UTF-8
// (false: not encodable). Neither leaves a Python error set when it returns false.
#pragma once

#include <Python.h>

#include <cstdint>

namespace cupy_rope {

inline bool py_int64(PyObject* o, int64_t& v) {
  if (!PyLong_Check(o)) return false;
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || (x == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  v = static_cast<int64_t>(x);
  return true;
}

inline bool py_utf8(PyObject* o, const char*& c, Py_ssize_t& n) {
  c = PyUnicode_AsUTF8AndSize(o, &n);
  if (c == nullptr) PyErr_Clear();
  return c != nullptr;
}

}  // namespace cupy_rope

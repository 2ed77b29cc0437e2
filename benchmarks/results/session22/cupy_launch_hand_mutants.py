# Hand-made mutants of cupy_rope/csrc/cupy_launch.cpp (twenty-second session), each run against
# tests/test_launch_cache.py: python benchmarks/results/session22/cupy_launch_hand_mutants.py
import subprocess, sys, pathlib
ROOT = pathlib.Path(__file__).resolve().parents[3]
src = ROOT / "cupy_rope" / "csrc" / "cupy_launch.cpp"
orig = src.read_text()
M = [
 ("for (Py_ssize_t i = 0; i < written; ++i) addr.push_back(addr[static_cast<size_t>(i)]);", ""),
 ("ok = push_ints(shape, key) && push_ints(strides, key) &&", "ok = push_ints(shape, key) &&"),
 ("    key.push_back(ptr & 15);\n", ""),
 ("    key.push_back(device);\n", ""),
 ("code = (num << 32) | (itemsize << 8) | bo;", "code = (num << 32) | (itemsize << 8);"),
 ("ro = ro || meet(spans[w], spans[r]);", "ro = false;"),
 ("key.push_back(both ? spans[1].lo - spans[0].lo : 0);", "key.push_back(0);"),
 ("    if ((p & 15) != o.align) return LEFT;\n", ""),
 ("    if (o.transposed) {", "    if (false) {"),
 ("for (int64_t w : e.slots[i]) params[static_cast<size_t>(w)] = addr[i];", ""),
 ("enum Tag : int64_t { ARRAY = 1, NONE = 2, BOOL = 3, INT = 4,", "enum Tag : int64_t { ARRAY = 1, NONE = 2, BOOL = 4, INT = 4,"),
 ("cfg.ctx_get(&ctx) != 0 || ctx != e.ctx) return LEFT;", "cfg.ctx_get(&ctx) != 0) return LEFT;"),
 ("e->pdl = pdl != 0;", "e->pdl = false;"),
 ("span.hi = empty ? ptr : ptr + hi + isz;", "span.hi = empty ? ptr : ptr + hi;"),
 ("      key.push_back(w);\n    }", "    }"),
 ("      key.push_back(NONE);\n    } else if (reinterpret_cast", "    } else if (reinterpret_cast"),
 ("key.push_back(TUPLE);\n    key.push_back(PyTuple_GET_SIZE(o));", "key.push_back(TUPLE);"),
 ("    key.push_back(BOOL);\n    key.push_back(o == Py_True);", "    key.push_back(BOOL);"),
 ("(s > 0 ? hi : lo) += (n - 1) * s;", "hi += (n - 1) * s;"),
 ("const bool both = written == 2 &&", "const bool both = written >= 1 &&"),
 ("empty = empty || n == 0;", ""),
 ("for (size_t r = written; r < spans.size(); ++r)", "for (size_t r = written + 1; r < spans.size(); ++r)"),
 ("int64_t stream = 0;\n  bool ok = PyLong_Check(s) ? py_int64(s, stream) : attr_i64(s, s_ptr, stream);", "int64_t stream = 0;\n  bool ok = true;"),
 ("e.gx, e.gy, e.block,", "e.gx, 1, e.block,"),
 ("for (size_t i = 0; i < e.blocks.size() && i < 4; ++i) argv[i] = params.data() + e.blocks[i];", "for (size_t i = 0; i < e.blocks.size() && i < 4; ++i) argv[i] = params.data();"),
 ("PyObject_CallFunctionObjArgs(alloc, o.alloc, spans[static_cast<size_t>(o.like)].dtype, nullptr);", "PyObject_CallFunctionObjArgs(alloc, o.alloc, spans[0].dtype, nullptr);"),
]
res = []
for i, (a, b) in enumerate(M):
    assert orig.count(a) == 1, (i, a)
    src.write_text(orig.replace(a, b))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/test_launch_cache.py"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600, env={**__import__("os").environ, "CUPY_ROPE_HOST_CACHE": "/tmp/cupy_launch_mutants"})
        killed = r.returncode != 0
    finally:
        src.write_text(orig)
    res.append(killed)
    print(i, "KILLED" if killed else "SURVIVED", a[:70].replace("\n", " "), flush=True)
print(sum(res), "/", len(res))

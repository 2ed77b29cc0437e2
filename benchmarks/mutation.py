"""Mutation run: plant single-operator bugs in ``kernels_cu/`` and in the launch-plan, positions,
XLA-launch, table and shim code and the CuPy launch path (``cupy_rope/_plan.py``,
``cupy_rope/_positions.py``, ``cupy_rope/_xla.py``, ``cupy_rope/torch.py``,
``cupy_rope/csrc/cupy_launch.cpp``, ``cupy_rope/csrc/overlap.h``, ...: ``FILES``) and check that the CPU suite (NumPy backend,
host build of the kernels, the launch paths on fake device memory) catches each one that still
builds.

    python benchmarks/mutation.py --count 40 --jobs 2 --json mutation.json
    python benchmarks/mutation.py --changed-since REV --count 30    # only lines added since REV

Each mutant changes one token on one line of the kernel source (an arithmetic or comparison
operator, a logical operator, a small integer constant, or a whole statement removed), chosen
with a fixed seed among the lines of the device code. A mutant is *killed* when the test subset
fails, *unbuilt* when the host build fails (the compiler caught it), *survived* otherwise; a
survivor is either a gap in the tests or an equivalent mutant (same behaviour), to be read.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ("kernels_cu/rope_common.cuh", "kernels_cu/rope.cu", "kernels_cu/qkv_rope.cu", "cupy_rope/_plan.py",
         "cupy_rope/_worksplit.py", "cupy_rope/_abi.py", "cupy_rope/_positions.py", "cupy_rope/_numpy_backend.py",
         "cupy_rope/_xla.py", "cupy_rope/_launch.py", "cupy_rope/_freqs.py", "cupy_rope/torch.py", "cupy_rope/te.py",
         "cupy_rope/_jax_ops.py", "cupy_rope/_dropins.py", "cupy_rope/csrc/cupy_launch.cpp",
         "cupy_rope/csrc/overlap.h")
TESTS = ["tests/test_launch_cache.py", "tests/test_instantiations.py", "tests/test_cpu_qkv.py", "tests/test_fuzz.py::test_fuzz_numpy",
         "tests/test_fuzz.py::test_fuzz_torch_cpu", "tests/test_fuzz.py::test_fuzz_host_kernels", "tests/test_positions.py",
         "tests/test_cpu_matrix.py::test_host_kernels", "tests/test_cpu_matrix.py::test_host_kernel_row_chunks", "tests/test_cpu_matrix.py::test_numpy_backend",
         "tests/test_cpu_matrix.py::test_one_row_kernel_is_bit_identical_to_streaming_kernel",
         "tests/test_cpu_matrix.py::test_work_split_ends", "tests/test_cpu_matrix.py::test_one_row_angle_launch_width",
         "tests/test_cpu_matrix.py::test_odd_units_split", "tests/test_cpu_matrix.py::test_one_row_shared_sincos",
         "tests/test_cpu_matrix.py::test_lean_kernel_limits", "tests/test_cpu_matrix.py::test_lean_rows_come_from_the_kernel_define",
         "tests/test_cpu_matrix.py::test_gqa_qk_launch_takes_lean_kernel_from_eight_heads",
         "tests/test_cpu_matrix.py::test_host_kernels_invalid_negative_cu_seqlens",
         "tests/test_cpu_matrix.py::test_host_build_raises_on_misaligned_vectors",
         "tests/test_safety.py", "tests/test_errors.py", "tests/test_arguments.py", "tests/test_shims_cpu.py",
         "tests/test_jax_cpu.py", "tests/test_xla_ffi.py", "tests/test_torch_ext.py"]
SWAPS = [(" + ", " - "), (" - ", " + "), (" * ", " / "), (" < ", " <= "), (" <= ", " < "), (" > ", " >= "),
         (" >= ", " > "), (" == ", " != "), (" != ", " == "), (" && ", " || "), (" || ", " && "),
         ("+= ", "-= "), ("(1)", "(0)"), (" 1;", " 0;"), (" 2 ", " 1 "), ("++k", "k++")]


def candidates():
    """(file, line number, original, mutated, description) for every possible mutant."""
    out = []
    for f in FILES:
        lines = (ROOT / f).read_text().splitlines()
        py = f.endswith(".py")
        in_doc = False
        for i, line in enumerate(lines):
            if py:  # code only: no docstrings, comments, strings or imports
                if line.count('"""') % 2:
                    in_doc = not in_doc
                    continue
                code = line.split("#")[0]
                if in_doc or '"' in code or "'" in code or code.lstrip().startswith(("import", "from", "def ", "@")):
                    continue
            else:
                code = line.split("//")[0]
            s = code.strip()
            if not s or s.startswith(("#", "template", "struct", "typedef", "namespace", "static constexpr")):
                continue
            for a, b in SWAPS:
                for m in re.finditer(re.escape(a), code):
                    out.append((f, i, line, line[:m.start()] + b + line[m.end():], f"{a.strip()} -> {b.strip()}"))
            if not py and s.endswith(";") and not s.startswith(("return", "const", "float", "i64", "int", "bool", "Vec",
                                                     "unsigned", "typedef", "constexpr")) and "(" in s:
                out.append((f, i, line, "", "statement removed"))
    return out


def added_lines(rev: str) -> dict:
    """{file: set of 0-based line numbers} added or changed since git revision ``rev``."""
    out: dict = {}
    diff = subprocess.run(["git", "diff", "-U0", rev, "--", *FILES], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    f = None
    for line in diff.splitlines():
        if line.startswith("+++ "):
            f = line[6:] if line.startswith("+++ b/") else None
        m = re.match(r"@@ -\S+ \+(\d+)(?:,(\d+))? @@", line)
        if m and f:
            start, n = int(m.group(1)), int(m.group(2) or 1)
            out.setdefault(f, set()).update(range(start - 1, start - 1 + n))
    return out


def run_mutant(m, timeout):
    f, i, orig, new, what = m
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "repo"  # a copy of the package, kernels and tests, one line changed
        for d in ("cupy_rope", "kernels_cu", "tests", "notebooks"):
            shutil.copytree(ROOT / d, root / d, ignore=shutil.ignore_patterns("__pycache__"))
        lines = (root / f).read_text().splitlines()
        lines[i] = new
        (root / f).write_text("\n".join(lines) + "\n")
        env = dict(os.environ, CUPY_ROPE_KERNELS_DIR=str(root / "kernels_cu"),
                   CUPY_ROPE_HOST_CACHE=str(Path(tmp) / "cache"), PYTHONPATH=str(root))
        lib = ("from cupy_rope import _cupy_ext; _cupy_ext.build()" if f.startswith("cupy_rope/csrc/") else
               "from cupy_rope._dev import hostkernels; hostkernels.library()")
        build = subprocess.run([sys.executable, "-c", lib], env=env, capture_output=True, text=True, cwd=root)
        if build.returncode:
            return dict(file=f, line=i + 1, what=what, result="unbuilt")
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS], env=env,
                               capture_output=True, text=True, cwd=root, timeout=timeout)
            result = "killed" if r.returncode else "survived"
        except subprocess.TimeoutExpired:
            result = "killed (timeout)"
    return dict(file=f, line=i + 1, what=what, original=orig.strip(), mutant=new.strip(), result=result)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=40, help="mutants to run (default 40)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per mutant's tests")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--changed-since", metavar="REV", help="only mutants of lines added or changed since REV")
    a = ap.parse_args(argv)
    cands = candidates()
    if a.changed_since:
        added = added_lines(a.changed_since)
        cands = [c for c in cands if c[1] in added.get(c[0], ())]
    picked = random.Random(a.seed).sample(cands, min(a.count, len(cands)))
    results = []
    with cf.ThreadPoolExecutor(a.jobs) as ex:
        for r in ex.map(lambda m: run_mutant(m, a.timeout), picked):
            results.append(r)
            print(f"{r['result']:16s} {r['file']}:{r['line']} {r['what']}", flush=True)
    built = [r for r in results if r["result"] != "unbuilt"]
    killed = [r for r in built if r["result"].startswith("killed")]
    print(f"mutation: {len(results)} mutants of {len(cands)} candidates, {len(results) - len(built)} did not build, "
          f"{len(killed)} of {len(built)} built killed, {len(built) - len(killed)} survived")
    for r in built:
        if r["result"] == "survived":
            print(f"  SURVIVED {r['file']}:{r['line']}: {r['original']}  ->  {r['mutant'] or '(removed)'}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(candidates=len(cands), results=results), indent=1))
    return 0 if len(killed) == len(built) else 1


if __name__ == "__main__":
    sys.exit(main())

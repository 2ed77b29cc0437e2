"""The CUDA source and its kernel instantiations (framework-free, no device needed).

The source lives in ``kernels_cu/`` (shipped inside the package as ``cupy_rope/kernels_cu``
when installed). :func:`source_for` returns one self-contained string (local ``#include``
lines inlined, so CuPy's compile cache key covers every line) plus the entry-point lines for
the requested kernels. Every consumer (GPU launch, NVRTC compile check, host build) uses it.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import re
from pathlib import Path

# Kernel kinds: the source file that defines them and their entry-point macro.
# rope: the streaming rope kernel; ropem: the same for rows of rotated and copied units (a rotary
# slice narrower than the head), 16-byte vectors only (MIXED_BYTES); rope1 / rope1c: the same
# rotation, one row per thread (small launches) with an angle table / a cos/sin cache; rope2c:
# the same with a cos/sin cache and two rows per thread (large launches), 16-byte vectors only;
# ropel: the lean kernel (large launches with an angle table in the common case: a few rows per
# thread, 32-bit offsets), 16-byte vectors only.
KINDS = {"rope": "CUPY_ROPE_KERNEL", "ropem": "CUPY_ROPEM_KERNEL", "rope1": "CUPY_ROPE1_KERNEL",
         "rope1c": "CUPY_ROPE1C_KERNEL", "rope2c": "CUPY_ROPE2C_KERNEL", "ropel": "CUPY_ROPEL_KERNEL",
         "qkv": "CUPY_QKV_KERNEL"}
# the kernels of a rope launch (RopeParams, two blocks)
ROPE_KINDS = ("rope", "ropem", "rope1", "rope1c", "rope2c", "ropel")
# The kinds instantiated for MIXED_BYTES-byte vectors only: ropem (its loop streams the shared-memory
# ring), rope2c and ropel (large launches, which take 16-byte vectors wherever the arrays allow them).
MIXED_BYTES = 16
WIDE_KINDS = ("ropem", "rope2c", "ropel")
SOURCES = ("rope_common.cuh", "rope.cu", "qkv_rope.cu")
# dtype name -> (C type, element size in bytes)
CTYPES = {"float32": ("float", 4), "float16": ("__half", 2), "bfloat16": ("__nv_bfloat16", 2)}
SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
BLOCK = 256  # threads per block; every build of the source gets it as CUPY_ROPE_BLOCK (defines())


def param_blocks(name: str) -> int:
    """Parameter blocks kernel ``name`` takes by value: the rope kernels two (one per tensor,
    each on its part of the grid: ``CUPY_ROPE_ENTRY_PAIR``), the QKV kernels one."""
    return 2 if name.split("_", 1)[0] in ROPE_KINDS else 1


def vector_widths(dtype: str) -> tuple[int, ...]:
    """Elements per vector access for ``dtype``: powers of two up to 16 bytes."""
    size = CTYPES[dtype][1]
    return tuple(v for v in (1, 2, 4, 8) if v * size <= 16)


def kernel_name(kind: str, dtype: str, vec: int, interleaved: bool, backward: bool) -> str:
    """Entry-point name, e.g. ``rope_bf16_v8_n_f`` (non-interleaved, forward)."""
    return f"{kind}_{SHORT[dtype]}_v{vec}_{'i' if interleaved else 'n'}_{'b' if backward else 'f'}"


def all_kernels() -> list[str]:
    """Every instantiation the library can launch."""
    return [
        kernel_name(kind, dt, v, il, bw)
        for kind, dt in itertools.product(KINDS, CTYPES)
        for v, il, bw in itertools.product(vector_widths(dt), (False, True), (False, True))
        if kind not in WIDE_KINDS or v * CTYPES[dt][1] == MIXED_BYTES
    ]


ALL = frozenset(all_kernels())
_NAME = re.compile(r"^(" + "|".join(KINDS) + r")_(f32|f16|bf16)_v(\d+)_([ni])_([fb])$")


def parse_name(name: str) -> tuple[str, str, int, bool, bool]:
    """(kind, dtype, vec, interleaved, backward) of a ``kernel_name``; ValueError if it is not one."""
    m = _NAME.match(name)
    if not m:
        raise ValueError(f"unknown kernel name {name!r}")
    kind, short, vec, il, bw = m.groups()
    return kind, {v: k for k, v in SHORT.items()}[short], int(vec), il == "i", bw == "b"


def entry_line(name: str) -> str:
    """The macro line that instantiates kernel ``name``."""
    kind, dtype, vec, il, bw = parse_name(name)
    return (f"{KINDS[kind]}({name}, {CTYPES[dtype][0]}, {vec}, {'true' if il else 'false'}, "
            f"{'true' if bw else 'false'})")


def source_dir() -> Path:
    """Directory holding the ``.cu``/``.cuh`` files (installed package or source tree;
    ``CUPY_ROPE_KERNELS_DIR`` points elsewhere, for development tools such as the mutation run)."""
    if os.environ.get("CUPY_ROPE_KERNELS_DIR"):
        return Path(os.environ["CUPY_ROPE_KERNELS_DIR"])
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels_cu", here.parent / "kernels_cu"):
        if (cand / SOURCES[0]).is_file():
            return cand
    raise FileNotFoundError(
        f"cupy_rope: CUDA sources not found in {here / 'kernels_cu'} or {here.parent / 'kernels_cu'}; "
        "reinstall the package (the .cu files ship as package data)")


@functools.lru_cache(maxsize=None)
def base_source() -> str:
    """All kernel sources concatenated, local includes inlined once."""
    d = source_dir()
    seen: set[str] = set()
    out: list[str] = []

    def add(fname: str) -> None:
        if fname in seen:
            return
        seen.add(fname)
        for line in (d / fname).read_text().splitlines():
            m = re.match(r'\s*#include\s+"([^"]+)"', line)
            if m:
                add(m.group(1))
            elif line.strip() != "#pragma once":
                out.append(line)

    for f in SOURCES:
        add(f)
    return "\n".join(out) + "\n"


def source_for(names) -> str:
    """Self-contained source defining the kernels ``names``."""
    return base_source() + "\n".join(entry_line(n) for n in names) + "\n"


@functools.lru_cache(maxsize=None)
def struct_fields(name: str) -> tuple[str, ...]:
    """Field names, in order, of the kernel parameter struct ``name`` in the CUDA source: the one
    definition of the launch ABI (every field is a 64-bit ``i64``; a struct may end with a nested
    ``PosArgs pos;``, whose fields follow, prefixed ``pos.``). The launch layer packs in this order."""
    src = re.sub(r"//[^\n]*", "", base_source())
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", src, re.S)
    if not m:
        raise ValueError(f"cupy_rope: no struct {name!r} in the kernel source")
    fields: list[str] = []
    decls = [d.strip() for d in m.group(1).split(";") if d.strip()]
    for i, decl in enumerate(decls):
        ctype, names = decl.split(None, 1)
        names = [n.strip() for n in names.split(",")]
        if ctype == "i64":
            fields += names
        elif ctype == "PosArgs" and i == len(decls) - 1 and len(names) == 1:
            fields += [f"{names[0]}.{f}" for f in struct_fields("PosArgs")]
        else:
            raise ValueError(f"cupy_rope: struct {name}: field {decl!r} is not a 64-bit i64 (the launch ABI)")
    return tuple(fields)


# Extra compiler options for every build of the source (NVRTC and the host build): tuning defines
# set by the benchmark harness in its own process only (benchmarks/run.py --tune DEFINES=...).
DEFINES: tuple[str, ...] = ()


def defines() -> tuple[str, ...]:
    """Compiler defines of every build of the source: the block size the launch layer launches
    with (``CUPY_ROPE_BLOCK``, which sizes the kernels' launch bounds and shared-memory ring), then
    the tuning defines in effect (none in the library's own build)."""
    return (f"-DCUPY_ROPE_BLOCK={BLOCK}",) + tuple(DEFINES)


def define_value(name: str) -> int:
    """The integer a build of the source gives macro ``name``: a tuning define's (``DEFINES``,
    ``-DNAME=V``) where one sets it, else the source's own ``#define NAME V``."""
    return _define_value(name, DEFINES)


@functools.lru_cache(maxsize=None)
def _define_value(name: str, extra: tuple) -> int:
    for d in reversed(extra):
        if d.startswith(f"-D{name}="):
            return int(d.split("=", 1)[1])
    m = re.search(rf"^\s*#define\s+{name}\s+(-?\d+)\s*$", base_source(), re.M)
    if not m:
        raise ValueError(f"cupy_rope: no integer #define {name} in the kernel source")
    return int(m.group(1))


def source_hash() -> str:
    """Identifies the source and its defines (compile caches key on it)."""
    return hashlib.sha1((base_source() + " ".join(defines())).encode()).hexdigest()[:16]

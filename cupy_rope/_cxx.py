"""Shared libraries built with the host C++ compiler, cached by the hash of everything they
depend on (the torch shim's C++ launch path; the development host build of the kernels).

``CXX`` names the compiler (default ``g++``, else ``c++``); ``CUPY_ROPE_HOST_CACHE`` the cache
directory (default ``$XDG_CACHE_HOME/cupy_rope``, i.e. ``~/.cache/cupy_rope``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path


def compiler() -> str | None:
    """The C++ compiler's command, or None when there is none on ``PATH``."""
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx if shutil.which(cxx) else None
    return shutil.which("g++") or shutil.which("c++")


def mode(env: str) -> str:
    """An optional C++ path's switch, environment variable ``env``: ``auto`` (default: built and
    used where it can be, else a warning and the Python path), ``1`` (required: a failed build
    raises) or ``0`` (never)."""
    m = os.environ.get(env, "auto").strip().lower() or "auto"
    if m not in ("auto", "0", "1"):
        raise ValueError(f"cupy_rope: environment variable {env}: expected auto, 0 or 1, got {m!r}")
    return m


def optional(env: str, load, what: str, instead: str, skip: str = ""):
    """An optional C++ path per its switch ``env`` (:func:`mode`): ``load()``'s result, or None
    where the path is not used: the switch is ``0``; it is ``auto`` and ``skip`` says why the path
    does not apply here (silently); it is ``auto`` and ``load`` raised (a warning naming ``what``
    and the fallback, ``instead``). With ``1``, whatever ``load`` raises is raised."""
    m = mode(env)
    if m == "0" or (m == "auto" and skip):
        return None
    try:
        return load()
    except Exception as e:
        if m == "1":
            raise
        warnings.warn(f"{what} is unavailable ({type(e).__name__}: {e}); {instead}", RuntimeWarning, stacklevel=3)
        return None


def cache_dir() -> Path:
    """Where built libraries are kept (created on first use)."""
    env = os.environ.get("CUPY_ROPE_HOST_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cupy_rope"
    base.mkdir(parents=True, exist_ok=True)
    return base


def build_key(parts, files=()) -> str:
    """Hash of ``parts`` (source text, compiler, its version, flags) and the contents of
    ``files`` (headers the source includes)."""
    h = hashlib.sha1()
    for p in parts:
        h.update(str(p).encode() + b"\0")
    for f in map(Path, files):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:20]


def shared_library(prefix: str, source: str, flag_sets, files=(), ldflags=(), cxx: str | None = None,
                   announce: str | None = None) -> Path:
    """Compile ``source`` (C++ text) into ``<cache>/<prefix>_<key>.so`` unless it is there; the
    first of ``flag_sets`` (alternative flag lists, e.g. language standards) that compiles wins;
    ``announce`` is printed to stderr when a build starts. The library is written under a
    temporary name and renamed: concurrent builds are safe. Raises ``RuntimeError`` with the
    compiler's output when no flag set compiles."""
    cxx = cxx or compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler on PATH (g++ or c++; or set CXX)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = build_key((source, cxx, version, *[" ".join(f) for f in flag_sets], *ldflags), files)
    so = cache_dir() / f"{prefix}_{key}.so"
    if so.exists():
        return so
    if announce:
        print(announce, file=sys.stderr, flush=True)
    errors = []
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        cpp, out = Path(tmp) / f"{prefix}.cpp", Path(tmp) / so.name
        cpp.write_text(source)
        for flags in flag_sets:
            cmd = [cxx, *flags, str(cpp), "-o", str(out), *ldflags]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(out, so)
                return so
            errors.append(f"{' '.join(cmd)}\n{r.stderr[-3000:]}")
    raise RuntimeError("C++ build failed:\n" + "\n".join(errors))

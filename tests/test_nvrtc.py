"""Every kernel instantiation compiles through NVRTC for sm_90 (no GPU needed; the cubin is
cached by the hash of every input of the compile, so a second run is instant)."""

import pytest

from cupy_rope import _kernels
from cupy_rope._dev import hostkernels as _hostkernels


def _nvrtc_or_skip():
    try:
        import cuda.pathfinder as pf
        from cupy.cuda import nvrtc

        nvrtc.getVersion()  # loads the NVRTC library
        if not pf.find_nvidia_header_directory("cudart"):
            raise RuntimeError("no CUDA runtime headers")
    except Exception as e:
        pytest.skip(f"NVRTC not available here: {type(e).__name__}: {e}")


def test_every_instantiation_compiles_for_sm90():
    _nvrtc_or_skip()
    names = _kernels.all_kernels()
    # kinds x (bf16, f16, f32 widths) x interleaved x direction, and the mixed, two-row and lean
    # kinds' 16-byte vectors
    assert len(names) == 4 * (4 + 4 + 3) * 4 + 3 * 3 * 4
    cubin = _hostkernels.nvrtc_cubin("sm_90")
    assert len(cubin) > 100000
    for n in names:  # every entry point is present as an unmangled symbol
        assert n.encode() in cubin, n

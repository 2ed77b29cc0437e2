"""Every kernel instantiation compiles through NVRTC for sm_90 (no GPU needed)."""

import pytest

from cupy_rope import _kernels


def _nvrtc():
    try:
        import cuda.pathfinder as pf
        from cupy.cuda import nvrtc

        inc = pf.find_nvidia_header_directory("cudart")
        return nvrtc, inc
    except Exception as e:  # pragma: no cover
        pytest.skip(f"NVRTC not available: {e}")


def test_every_instantiation_compiles_for_sm90():
    nvrtc, inc = _nvrtc()
    names = _kernels.all_kernels()
    assert len(names) == 2 * (4 + 4 + 3) * 4  # kinds x (bf16, f16, f32 widths) x interleaved x direction
    src = _kernels.source_for(names)
    prog = nvrtc.createProgram(src, "cupy_rope.cu", [], [])
    opts = ["-arch=sm_90", "--std=c++17", f"-I{inc}", "-default-device", *_kernels.defines()]
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception:
        raise AssertionError(nvrtc.getProgramLog(prog))
    cubin = nvrtc.getCUBIN(prog)
    assert len(cubin) > 100000
    for n in names:  # every entry point is present as an unmangled symbol
        assert n.encode() in cubin, n

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
    # kinds x (bf16, f16, f32 widths) x interleaved x direction, and the mixed kind's 16-byte vectors
    assert len(names) == 4 * (4 + 4 + 3) * 4 + 3 * 4
    cubin = _hostkernels.nvrtc_cubin("sm_90")
    assert len(cubin) > 100000
    for n in names:  # every entry point is present as an unmangled symbol
        assert n.encode() in cubin, n



def _ptx(names, *defines) -> str:
    """The PTX of kernels ``names`` compiled by NVRTC for sm_90 with extra ``defines``."""
    return _hostkernels.nvrtc_compile(names, "sm_90", defines, ptx=True).decode()


@pytest.mark.parametrize("defines, expected", [
    ((), ["cp.async.ca.shared.global [", "st.global.v4.b32 ["]),
    (("-DCUPY_ROPE_PREFETCH=256",), ["cp.async.ca.shared.global.L2::256B [", "ld.global.L2::256B.v4.b32"]),
    (("-DCUPY_ROPE_LOAD_EVICT_FIRST=1",), ["createpolicy.fractional.L2::evict_first.b64",
                                           "cp.async.ca.shared.global.L2::cache_hint ["]),
    (("-DCUPY_ROPE_STORE_HINT=1",), ["st.global.cs.v4.b32 ["]),
    (("-DCUPY_ROPE_STORE_HINT=2",), ["st.global.L2::cache_hint.v4.b32 ["]),
], ids=["plain", "prefetch", "load-evict-first", "store-cs", "store-evict-first"])
def test_cache_hint_variants_compile(defines, expected):
    """The cache-hint defines of the benchmark variants (kernels_cu/rope_common.cuh) compile for
    sm_90 and put their instructions in the streaming (ring) and one-row kernels' PTX; without
    them the accesses carry no hint."""
    _nvrtc_or_skip()
    ptx = _ptx(["rope_bf16_v8_n_f", "rope1_bf16_v8_n_f"], *defines)
    for e in expected:
        assert e in ptx, e
    assert any(h in ptx for h in ("L2::", ".cs.", "createpolicy")) == bool(defines)


@pytest.mark.parametrize("define", ["-DCUPY_ROPE_PREFETCH=100", "-DCUPY_ROPE_STORE_HINT=3"])
def test_cache_hint_defines_out_of_range_do_not_compile(define):
    _nvrtc_or_skip()
    with pytest.raises(RuntimeError, match=define.split("=")[0][2:]):
        _ptx(["rope_bf16_v8_n_f"], define)


def test_qkv_incremental_variant_compiles():
    """The QKV backward's benchmark variant (``-DCUPY_QKV_INCREMENTAL=1``: running row pointers)
    compiles for sm_90 (its results are checked on the CPU by running the host build with it:
    benchmarks/NOTES.md)."""
    _nvrtc_or_skip()
    names = ["qkv_bf16_v8_n_b", "qkv_f32_v4_i_b"]
    ptx = _ptx(names, "-DCUPY_QKV_INCREMENTAL=1")
    assert all(n in ptx for n in names)

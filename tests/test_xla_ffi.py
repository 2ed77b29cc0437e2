"""The XLA FFI launch (``cupy_rope/_xla.py``, ``csrc/xla_launch.cpp``) without a GPU.

The launch a traced call hands to XLA lives in the custom call's attributes (kernel, parameter
blocks with byte offsets in the address words, address slots, geometry). Here the calls are
lowered for CUDA on the CPU (the device plumbing replaced: one GPU of 132 SMs, kernels not
loaded), the handler's contract applied to NumPy buffers (each slot's word += its buffer's
address) and the kernel run on the CPU by the host build of the same ``.cu``: the results must
match the float64 reference, with every output poisoned first. The handler library itself is
built and its symbols checked; the environment switch is validated. The GPU runs the handler
itself (``tests/test_gpu_shims.py``).
"""

import re

import numpy as np
import pytest

import cupy_rope
from reference import assert_close_to_ref, qkv_split_ref, rope_ref

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


@pytest.fixture
def lowered_for_cuda(monkeypatch):
    """Trace calls as on one 132-SM GPU (no PDL) and lower them for CUDA; returns lower(fn, *args)."""
    from cupy_rope import _jax_ops, _launch, _xla

    if _xla.ffi_library() is None:
        pytest.skip("the XLA launch handler did not build here (no C++ compiler or CUPY_ROPE_XLA_FFI=0)")
    monkeypatch.setattr(_xla, "gpu_ordinals", lambda: (0,))
    monkeypatch.setattr(_xla, "precompile", lambda names: None)
    monkeypatch.setattr(_xla, "_registered", set())
    monkeypatch.setattr(_launch, "sm_count", lambda d: 132)
    monkeypatch.setattr(_launch, "pdl_launcher", lambda d: None)
    monkeypatch.setattr(_launch, "function", lambda name, d: (0, 0))
    monkeypatch.setattr(_jax_ops, "_on_gpu", lambda *a: True)

    def lower(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    return lower


def _attr(text, name):
    m = re.search(name + r" = dense<\[?([-\d, ]*)\]?> : tensor<(\d+)xi64>", text)
    vals = [int(v) for v in m.group(1).split(",")] if m.group(1).strip() else []
    return np.array(vals * (int(m.group(2)) if len(vals) == 1 else 1), np.int64)


def run_lowered(text, operands, results):
    """Apply the handler's contract to NumPy buffers: the custom call's words, each slot's word
    plus its buffer's address (operands, then results), launched on the host build."""
    from cupy_rope._dev import hostkernels

    assert text.count("stablehlo.custom_call @cupy_rope_launch") == 1, "expected one FFI launch"
    kernel = re.search(r'kernel = "(\w+)"', text).group(1)
    words, slots, geometry = _attr(text, "params"), _attr(text, "slots"), _attr(text, "geometry")
    buffers = list(operands) + list(results)
    for b in buffers:
        assert b.ctypes.data % 16 == 0, "NumPy buffer not 16-byte aligned"
    for b, w in slots.reshape(-1, 2):
        words[w] += buffers[b].ctypes.data
    gx, gy, block, nblocks, pdl = (int(v) for v in geometry)
    assert len(words) % nblocks == 0 and pdl == 0
    hostkernels.launch(kernel, (gx, gy), block, words.astype("<i8").tobytes())
    return kernel


def _poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype)


def _aligned(a):
    """A 16-byte aligned copy of ``a`` (XLA's buffers are)."""
    raw = np.empty(a.nbytes + 16, np.uint8)
    off = (-raw.ctypes.data) % 16
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def test_ffi_rope_single_tensor(lowered_for_cuda):
    import cupy_rope.jax as crj

    rng = np.random.default_rng(11)
    fn_ = rng.uniform(-5, 5, (64, 1, 1, 64)).astype(np.float32)
    xn = rng.uniform(-1, 1, (24, 2, 3, 80)).astype(np.float32)
    sp = np.array([3, 9], np.int32)
    for backward in (False, True):
        entry = crj.apply_rope_backward if backward else crj.apply_rope
        text = lowered_for_cuda(lambda t, f, s: entry(t, f, "sbhd", start_positions=s, cp_size=2, cp_rank=1),
                                xn, fn_, sp)
        y = _poisoned(xn.shape, np.float32)
        kernel = run_lowered(text, [_aligned(xn), _aligned(fn_), _aligned(sp)], [y])
        assert_close_to_ref(y, rope_ref(xn, fn_, start_positions=sp, cp_size=2, cp_rank=1, backward=backward),
                            xn, 64, "float32")
        # planned on addresses as aligned as XLA's buffers: the widest (16-byte) vectors
        assert "_f32_v4_" in kernel, kernel


@pytest.mark.parametrize("form", ["separate", "fused5", "flat_gqa"])
def test_ffi_rope_qk(lowered_for_cuda, form):
    """q and k in one launch: separate tensors, views of a fused [b, s, 3, h, d] projection and of
    a flat GQA projection [b, s, (hq + 2 hk) d] (byte offsets in the address words)."""
    import cupy_rope.jax as crj

    rng = np.random.default_rng(12)
    fn_ = rng.uniform(-5, 5, (32, 1, 1, 64)).astype(np.float32)
    sp = np.array([1, 4], np.int32)
    if form == "separate":
        qn, kn = (rng.uniform(-1, 1, (2, 16, h, 64)).astype(np.float32) for h in (4, 2))
        text = lowered_for_cuda(lambda a, b, f, s: crj.apply_rope_qk(a, b, f, "bshd", start_positions=s), qn, kn,
                                fn_, sp)
        operands = [qn, kn, fn_, sp]
    elif form == "fused5":
        qkv = rng.uniform(-1, 1, (2, 16, 3, 4, 64)).astype(np.float32)
        qn, kn = qkv[:, :, 0], qkv[:, :, 1]
        text = lowered_for_cuda(lambda a, f, s: crj.apply_rope_qk_fused(a, f, "bshd", start_positions=s), qkv, fn_,
                                sp)
        operands = [qkv, fn_, sp]
    else:
        qkv = rng.uniform(-1, 1, (2, 16, (8 + 2 * 2) * 64)).astype(np.float32)
        qn, kn = qkv[..., :512].reshape(2, 16, 8, 64), qkv[..., 512:640].reshape(2, 16, 2, 64)
        text = lowered_for_cuda(lambda a, f, s: crj.apply_rope_qk_fused(a, f, "bshd", num_q_heads=8, num_kv_heads=2,
                                                                        start_positions=s), qkv, fn_, sp)
        operands = [qkv, fn_, sp]
    outs = [_poisoned(qn.shape, np.float32), _poisoned(kn.shape, np.float32)]
    run_lowered(text, [_aligned(a) for a in operands], outs)
    for got, a, name in zip(outs, (qn, kn), "qk"):
        assert_close_to_ref(got, rope_ref(a, fn_, layout="bshd", start_positions=sp), a, 64, "float32", name)


@pytest.mark.parametrize("empty", ["k", "q", "both"])
def test_ffi_rope_qk_tensor_without_heads(lowered_for_cuda, empty):
    """A q+k call where a tensor has no heads: one launch rotates the other (forward and
    backward), and only a call where both are empty lowers to no launch at all."""
    import cupy_rope.jax as crj

    rng = np.random.default_rng(13)
    fn_ = rng.uniform(-5, 5, (32, 1, 1, 64)).astype(np.float32)
    full, none = rng.uniform(-1, 1, (2, 16, 4, 64)).astype(np.float32), np.zeros((2, 16, 0, 64), np.float32)
    pair = {"k": (full, none), "q": (none, full), "both": (none, none)}[empty]
    for backward in (False, True):
        entry = crj.apply_rope_qk_backward if backward else crj.apply_rope_qk
        text = lowered_for_cuda(lambda a, b, f: entry(a, b, f, "bshd"), *pair, fn_)
        if empty == "both":
            assert "cupy_rope_launch" not in text
            continue
        outs = [_aligned(_poisoned(a.shape, np.float32)) for a in pair]
        run_lowered(text, [_aligned(a) for a in (*pair, fn_)], outs)
        side = 0 if empty == "k" else 1
        assert_close_to_ref(outs[side], rope_ref(full, fn_, layout="bshd", backward=backward), full, 64, "float32")
        assert outs[1 - side].shape == none.shape


@pytest.mark.parametrize("form", ["stacked", "flat_gqa"])
def test_ffi_fused_gradient_one_buffer(lowered_for_cuda, form):
    """The fused entry's gradient: one launch writes the rotated dq and dk into their parts of one
    projection-shaped buffer and nothing else (its v part stays poisoned here); XLA then sets the v
    part in place. The lowered backward holds the forward's launch and this one, no other."""
    import jax.numpy as jnp

    import cupy_rope.jax as crj
    from cupy_rope import _jax_ops

    rng = np.random.default_rng(16)
    fn_ = rng.uniform(-5, 5, (32, 1, 1, 48)).astype(np.float32)  # rotary 48 of 64: the rest copied
    sp = np.array([2, 7], np.int32)
    if form == "stacked":
        shape, kw, (hq, hk) = (2, 16, 3, 4, 64), {}, (4, 4)
    else:
        shape, kw, (hq, hk) = (2, 16, (8 + 2 * 2) * 64), dict(num_q_heads=8, num_kv_heads=2), (8, 2)
    views = _jax_ops._hashable_views(_jax_ops.fused_views(shape, "bshd", **kw))
    gq, gk = (rng.uniform(-1, 1, (2, 16, h, 64)).astype(np.float32) for h in (hq, hk))
    text = lowered_for_cuda(lambda a, b, f, s: _jax_ops._fused_t(a, b, f, (None, s), views, shape, "bshd", False, 1, 0,
                                                                 True, None), gq, gk, fn_, sp)
    d = _poisoned(shape, np.float32)
    run_lowered(text, [_aligned(a) for a in (gq, gk, fn_, sp)], [d])
    flat = d.reshape(2, 16, -1)
    got_q, got_k = flat[..., : hq * 64].reshape(gq.shape), flat[..., hq * 64: (hq + hk) * 64].reshape(gk.shape)
    for got, g, name in ((got_q, gq, "dq"), (got_k, gk, "dk")):
        assert_close_to_ref(got, rope_ref(g, fn_, layout="bshd", start_positions=sp, backward=True), g, 48, "float32",
                            name)
    assert np.isnan(flat[..., (hq + hk) * 64:]).all(), "the launch wrote the v part"
    for return_v in (True, False):
        def loss(a):
            out = crj.apply_rope_qk_fused(a, jnp.asarray(fn_), "bshd", start_positions=jnp.asarray(sp),
                                          return_v=return_v, **kw)
            return sum((o * o).sum() for o in out)  # not linear: the forward's launch stays

        grad_text = lowered_for_cuda(jax.grad(loss), np.ones(shape, np.float32))
        assert grad_text.count("stablehlo.custom_call @cupy_rope_launch") == 2, grad_text
        assert "stablehlo.dynamic_update_slice" in grad_text and "stablehlo.concatenate" not in grad_text



def _m2m(order):
    """XLA's minor-to-major text of the major-to-minor ``order``."""
    return "dense<[" + ", ".join(str(i) for i in reversed(order)) + "]>"


@pytest.mark.parametrize("form", ["fused_bshd", "fused_thd_gqa", "separate_sbhd"])
def test_ffi_heads_major(lowered_for_cuda, form):
    """``heads_major``: the forward call declares its results heads-major ([b, h, s, d]; thd
    [h, t, d]) and the kernel writes them with those strides; the backward call declares its
    cotangent operands so and reads them so. Run on NumPy buffers in those physical orders, the
    results match the float64 reference, and every output element is written (poisoned first)."""
    import cupy_rope.jax as crj
    from cupy_rope import _jax_ops

    rng = np.random.default_rng(19)
    fn_ = rng.uniform(-5, 5, (40, 1, 1, 48)).astype(np.float32)  # rotary 48 of 64: the rest copied
    cu = None
    if form == "fused_bshd":
        layout, shape, kw = "bshd", (2, 16, 3, 4, 64), {}
        qkv = rng.uniform(-1, 1, shape).astype(np.float32)
        qn, kn = qkv[:, :, 0], qkv[:, :, 1]
        text = lowered_for_cuda(lambda a, f: crj.apply_rope_qk_fused(a, f, layout, heads_major=True), qkv, fn_)
        operands = [qkv, fn_]
    elif form == "fused_thd_gqa":
        layout, shape, kw = "thd", (40, (8 + 2 * 2) * 64), dict(num_q_heads=8, num_kv_heads=2)
        cu = np.array([0, 17, 40], np.int32)
        qkv = rng.uniform(-1, 1, shape).astype(np.float32)
        qn, kn = qkv[:, :512].reshape(40, 8, 64), qkv[:, 512:640].reshape(40, 2, 64)
        text = lowered_for_cuda(lambda a, f, c: crj.apply_rope_qk_fused(a, f, layout, cu_seqlens=c, heads_major=True,
                                                                        **kw), qkv, fn_, cu)
        operands = [qkv, fn_, cu]
    else:
        layout = "sbhd"
        qn, kn = (rng.uniform(-1, 1, (16, 2, h, 64)).astype(np.float32) for h in (4, 2))
        text = lowered_for_cuda(lambda a, b, f: crj.apply_rope_qk(a, b, f, layout, heads_major=True), qn, kn, fn_)
        operands = [qn, kn, fn_]
    order = _jax_ops.heads_major_order(layout)
    assert text.count(_m2m(order)) == 2, text  # both results
    outs = [_poisoned(tuple(a.shape[i] for i in order), np.float32) for a in (qn, kn)]
    run_lowered(text, [_aligned(a) for a in operands], outs)
    for phys, a, name in zip(outs, (qn, kn), "qk"):
        assert_close_to_ref(np.transpose(phys, np.argsort(order)), rope_ref(a, fn_, layout=layout, cu_seqlens=cu), a,
                            48, "float32", name)

    # the backward: cotangents read heads-major
    gq, gk = (rng.uniform(-1, 1, a.shape).astype(np.float32) for a in (qn, kn))
    phys_in = [_aligned(np.ascontiguousarray(np.transpose(g, order))) for g in (gq, gk)]
    if form == "separate_sbhd":
        text = lowered_for_cuda(lambda a, b, f: _jax_ops._qk(a, b, f, (None, None), layout, False, 1, 0, True,
                                                             (order, None)), gq, gk, fn_)
        outs = [_poisoned(g.shape, np.float32) for g in (gq, gk)]
        run_lowered(text, phys_in + [_aligned(fn_)], outs)
        got = outs
    else:
        views = _jax_ops._hashable_views(_jax_ops.fused_views(shape, layout, **kw))
        text = lowered_for_cuda(lambda a, b, f, c: _jax_ops._fused_t(a, b, f, (c, None), views, shape, layout, False, 1,
                                                                     0, True, order), gq, gk, fn_, cu)
        d = _poisoned(shape, np.float32)
        run_lowered(text, phys_in + [_aligned(fn_)] + ([_aligned(cu)] if cu is not None else []), [d])
        flat = d.reshape(shape[:-3 if form == "fused_bshd" else -1] + (-1,))
        hq, hk = gq.shape[-2], gk.shape[-2]
        got = [flat[..., : hq * 64].reshape(gq.shape), flat[..., hq * 64: (hq + hk) * 64].reshape(gk.shape)]
    assert text.count(_m2m(order)) == 2, text  # both cotangent operands
    for g_got, g, name in zip(got, (gq, gk), ("dq", "dk")):
        assert_close_to_ref(g_got, rope_ref(g, fn_, layout=layout, cu_seqlens=cu, backward=True), g, 48, "float32",
                            name)

    # the entry's gradient: the forward's results and the backward's cotangents heads-major
    entry = rope_of = None
    if form == "separate_sbhd":
        def rope_of(a):
            return crj.apply_rope_qk(a, a[..., :2, :], fn_, layout, heads_major=True)
        entry = qn
    else:
        def rope_of(a):
            return crj.apply_rope_qk_fused(a, fn_, layout, cu_seqlens=cu, heads_major=True, **kw)
        entry = qkv
    grad_text = lowered_for_cuda(jax.grad(lambda a: sum((o * o).sum() for o in rope_of(a))), entry)
    m2m = f"{_m2m(order)} : tensor<{len(order)}xindex>"
    assert grad_text.count(f"result_layouts = [{m2m}, {m2m}]") == 1, grad_text
    assert grad_text.count(f"operand_layouts = [{m2m}, {m2m}, ") == 1, grad_text



@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_ffi_heads_major_single_tensor(lowered_for_cuda, layout):
    """``apply_rope(..., heads_major=True)``: the result declared and written heads-major, the
    backward's cotangent declared and read so (the gradient's launch), on NumPy buffers in those
    physical orders against the float64 reference, outputs poisoned first."""
    import cupy_rope.jax as crj
    from cupy_rope import _jax_ops

    rng = np.random.default_rng(20)
    fn_ = rng.uniform(-5, 5, (40, 1, 1, 32)).astype(np.float32)  # rotary 32 of 64
    shape = (40, 3, 64) if layout == "thd" else (2, 20, 3, 64)
    c = np.array([0, 13, 40], np.int32) if layout == "thd" else None
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    order = _jax_ops.heads_major_order(layout)
    m2m = f"{_m2m(order)} : tensor<{len(order)}xindex>"
    for backward in (False, True):
        if backward:  # the forward's VJP: the cotangent heads-major in, the gradient row-major out
            fn = lambda a, f, cu: _jax_ops._rope(a, f, cu, None, layout, False, 1, 0, True, (order, None))  # noqa: E731
        else:
            fn = lambda a, f, cu: crj.apply_rope(a, f, layout, cu_seqlens=cu, heads_major=True)  # noqa: E731
        text = lowered_for_cuda(fn, x, fn_, c)
        assert (f"operand_layouts = [{m2m}, " if backward else f"result_layouts = [{m2m}]") in text, text
        x_in = np.ascontiguousarray(np.transpose(x, order)) if backward else x
        y = _poisoned(shape if backward else tuple(shape[i] for i in order), np.float32)
        run_lowered(text, [_aligned(a) for a in (x_in, fn_, c) if a is not None], [y])
        got = y if backward else np.transpose(y, np.argsort(order))
        assert_close_to_ref(got, rope_ref(x, fn_, layout=layout, cu_seqlens=c, backward=backward), x, 32, "float32")
    grad_text = lowered_for_cuda(jax.grad(lambda a: (crj.apply_rope(a, fn_, layout, cu_seqlens=c, heads_major=True)
                                                     ** 2).sum()), x)
    assert f"result_layouts = [{m2m}]" in grad_text and f"operand_layouts = [{m2m}, " in grad_text, grad_text


def test_ffi_rope_pos_cos_sin_cache(lowered_for_cuda):
    """The positions API: per-token positions, a float32 cos/sin cache, q and k (GQA), NeoX."""
    import cupy_rope.jax as crj

    rng = np.random.default_rng(13)
    cache = np.asarray(cupy_rope.rope_cos_sin_cache(64, 50))  # [50, 64]: cos | sin
    pos = rng.integers(0, 50, 24).astype(np.int32)  # JAX without x64: int32
    qn, kn = rng.uniform(-1, 1, (24, 4, 64)).astype(np.float32), rng.uniform(-1, 1, (24, 2, 64)).astype(np.float32)
    text = lowered_for_cuda(lambda p, a, b, c: crj.apply_rope_pos(p, a, b, cos_sin_cache=c), pos, qn, kn, cache)
    outs = [_poisoned(qn.shape, np.float32), _poisoned(kn.shape, np.float32)]
    run_lowered(text, [_aligned(pos), _aligned(qn), _aligned(kn), _aligned(cache)], outs)
    cos, sin = cache[pos, :32].astype(np.float64), cache[pos, 32:].astype(np.float64)
    for got, a in zip(outs, (qn, kn)):
        x1, x2 = a[..., :32].astype(np.float64), a[..., 32:].astype(np.float64)
        ref = np.concatenate([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]], -1)
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)


def test_ffi_qkv_packed(lowered_for_cuda):
    import cupy_rope.jax as crj

    rng = np.random.default_rng(14)
    fn_ = rng.uniform(-5, 5, (16, 1, 1, 64)).astype(np.float32)
    qkv = rng.uniform(-1, 1, (16, 2, 2, 6 * 64)).astype(np.float32)
    text = lowered_for_cuda(lambda a, f: crj.apply_qkv_rope(a, f, f, num_q_heads=8), qkv, fn_)
    q = _poisoned((16, 2, 8, 64), np.float32)
    k, v = _poisoned((16, 2, 2, 64), np.float32), _poisoned((16, 2, 2, 64), np.float32)
    fa = _aligned(fn_)
    # the custom call's operands: the projection and the table once per role (q, k)
    n_ops = len(re.search(r"custom_call @cupy_rope_launch\(([^)]*)\)", text).group(1).split(","))
    run_lowered(text, [_aligned(qkv)] + [fa] * (n_ops - 1), [q, k, v])
    xq, xk, xv = qkv_split_ref(qkv, 4, 64)
    assert_close_to_ref(q, rope_ref(xq, fn_), xq, 64, "float32", "q")
    assert_close_to_ref(k, rope_ref(xk, fn_), xk, 64, "float32", "k")
    np.testing.assert_array_equal(v, xv)


def test_ffi_bf16_matches_cpu_path(lowered_for_cuda):
    """bf16 through the FFI attributes: every element within one bf16 ulp of the CPU path (jnp)."""
    import ml_dtypes

    import cupy_rope.jax as crj

    rng = np.random.default_rng(15)
    fn_ = np.asarray(cupy_rope.rope_freqs(128, 64))
    xn = rng.uniform(-2, 2, (1, 64, 32, 128)).astype(ml_dtypes.bfloat16)
    sp = rng.integers(0, 60, 64).astype(np.int32)
    text = lowered_for_cuda(lambda t, f, s: crj.apply_rope(t, f, "sbhd", start_positions=s), xn, fn_, sp)
    y = np.full(xn.shape, np.nan, ml_dtypes.bfloat16)
    run_lowered(text, [_aligned(xn), _aligned(fn_), _aligned(sp)], [y])
    ref = rope_ref(xn.astype(np.float32), fn_, start_positions=sp)
    assert_close_to_ref(y, ref, xn, 128, "bfloat16")


def test_ffi_handler_library_exports():
    import ctypes

    from cupy_rope import _cxx, _xla

    if _cxx.compiler() is None:
        pytest.skip("no C++ compiler")
    lib = ctypes.CDLL(str(_xla.build_ffi()))
    assert lib.cupy_rope_xla_launch and lib.cupy_rope_xla_register


def test_ffi_switch(monkeypatch):
    from cupy_rope import _xla

    monkeypatch.setattr(_xla, "_ffi", [])
    monkeypatch.setenv("CUPY_ROPE_XLA_FFI", "sometimes")
    with pytest.raises(ValueError, match="CUPY_ROPE_XLA_FFI: expected auto, 0 or 1, got 'sometimes'"):
        _xla.ffi_library()
    monkeypatch.setattr(_xla, "_ffi", [])
    monkeypatch.setenv("CUPY_ROPE_XLA_FFI", "0")
    assert _xla.ffi_library() is None


def test_ffi_build_failure(monkeypatch):
    """auto: a failed build warns and the callback path serves; 1: it raises."""
    from cupy_rope import _xla

    def fail():
        raise RuntimeError("C++ build failed: planted")

    monkeypatch.setattr(_xla, "_load_ffi", fail)
    monkeypatch.setattr(_xla, "_ffi", [])
    monkeypatch.setenv("CUPY_ROPE_XLA_FFI", "auto")
    with pytest.warns(RuntimeWarning, match="XLA launch handler is unavailable.*planted"):
        assert _xla.ffi_library() is None
    monkeypatch.setattr(_xla, "_ffi", [])
    monkeypatch.setenv("CUPY_ROPE_XLA_FFI", "1")
    with pytest.raises(RuntimeError, match="planted"):
        _xla.ffi_library()


def test_callback_path_addresses(monkeypatch):
    """The buffer-callback launch (where the FFI handler is unavailable) gives each address name
    its buffer's address plus the slot's byte offset (0 for an absent input), plans once per device
    and 16-byte alignment of the addresses, and patches each later call's addresses into that
    plan. Checked with fake XLA buffers, a fake ``buffer_callback`` and a fake prepared launch."""
    import jax.experimental.buffer_callback as jbc

    from cupy_rope import _launch, _xla

    class Buf:  # an XLA buffer as the callback sees it: a CUDA address and a device
        def __init__(self, ptr, device=0):
            self.__cuda_array_interface__ = {"data": (ptr, False)}
            self.device = device

        def __dlpack_device__(self):
            return (2, self.device)

    class Ctx:
        stream = 77

    plans, launches, made = [], [], {}

    class Prepared:
        def __init__(self, spec, device, names):
            plans.append((spec, device, names))

        def __call__(self, stream, addrs):
            launches.append((stream, addrs))

    def fake_buffer_callback(callback, result_shapes, **kw):
        made["callback"] = callback
        return lambda *args: args

    monkeypatch.setattr(_xla, "FFI", False)
    monkeypatch.setattr(jbc, "buffer_callback", fake_buffer_callback)
    monkeypatch.setattr(_launch, "Prepared", Prepared)
    in_slots = ((("x", 0), ("x2", 256)), (("cu", 0),), (("t", 32),))
    out_slots = ((("y", 0), ("y2", 512)),)
    x, t = object(), object()
    assert _xla.gpu_call("shapes", (x, None, t), in_slots, out_slots, lambda addr, d: ("spec", dict(addr), d)) == (x, t)
    names = ("x", "x2", "cu", "t", "y", "y2")

    def run(yp, xp, tp, device=0):
        made["callback"](Ctx, Buf(yp, device), Buf(xp, device), Buf(tp, device))
        return launches[-1]

    expect = [0x10000, 0x10000 + 256, 0, 0x20000 + 32, 0x30000, 0x30000 + 512]
    assert run(0x30000, 0x10000, 0x20000) == (77, expect)
    assert plans == [(("spec", dict(zip(names, expect)), 0), 0, names)]
    # the same alignments: the plan is reused, the new addresses patched in
    assert run(0x70000, 0x50000, 0x60010) == (77, [0x50000, 0x50100, 0, 0x60030, 0x70000, 0x70200])
    assert len(plans) == 1
    # another alignment of one buffer, or another device: a plan of its own
    run(0x70000, 0x50008, 0x60010)
    assert len(plans) == 2 and plans[-1][0][1]["x"] == 0x50008 and plans[-1][0][1]["x2"] == 0x50108
    run(0x70000, 0x50000, 0x60010, device=1)
    assert len(plans) == 3 and plans[-1][1] == 1

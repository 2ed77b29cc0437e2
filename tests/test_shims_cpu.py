"""Framework shims on the CPU: torch custom ops (gradcheck, opcheck, torch.compile), JAX
(jit, grad against a pure-jnp reference, vmap), TE drop-in (against the reference)."""

import numpy as np
import pytest

import cupy_rope
from reference import assert_close_to_ref, qkv_split_ref, rope_ref

torch = pytest.importorskip("torch")


def _f(d2, S, dtype=torch.float64):
    return torch.from_numpy(np.random.default_rng(S).uniform(-6, 6, (S, 1, 1, d2)).astype(np.float32))


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_torch_autograd_matches_reference(layout, interleaved):
    import cupy_rope.torch as crt

    rng = np.random.default_rng(0)
    f = _f(48, 40)
    kw = dict(layout=layout, interleaved=interleaved, cp_size=2, cp_rank=1)
    if layout == "thd":
        shape = (14, 3, 64)
        kw["cu_seqlens"] = torch.tensor([0, 8, 8, 24], dtype=torch.int32)
    else:
        shape = (4, 2, 3, 64) if layout == "sbhd" else (2, 4, 3, 64)
    kw["start_positions"] = torch.tensor([3, 1, 0], dtype=torch.int64)
    x = torch.from_numpy(rng.uniform(-1, 1, shape).astype(np.float32)).requires_grad_()
    y = crt.apply_rope(x, f, **kw)
    g = torch.from_numpy(rng.uniform(-1, 1, shape).astype(np.float32))
    y.backward(g)
    nkw = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    assert_close_to_ref(y.detach().numpy(), rope_ref(x.detach().numpy(), f.numpy(), **nkw), x.detach().numpy(), 48, "float32")
    assert_close_to_ref(x.grad.numpy(), rope_ref(g.numpy(), f.numpy(), backward=True, **nkw), g.numpy(), 48, "float32")
    # the backward is the exact transpose: <y(x), g> == <x, y^T(g)>
    lhs = (y.detach().double() * g.double()).sum()
    rhs = (x.detach().double() * x.grad.double()).sum()
    assert abs(float(lhs - rhs)) < 1e-4 * float(abs(lhs)) + 1e-4


@pytest.mark.filterwarnings("ignore:Input #")
def test_torch_gradcheck_and_double_backward():
    """Kernels take float32 at most (spec 1): a float32 gradcheck with finite-difference tolerances."""
    import cupy_rope.torch as crt

    f = _f(32, 8)
    x = torch.randn(8, 2, 2, 32, dtype=torch.float32, requires_grad=True)
    # float32 CPU tensors (the NumPy backend): Jacobian-vector products against finite differences
    torch.autograd.gradcheck(lambda t: crt.apply_rope(t, f), (x,), eps=1e-2, atol=1e-2, rtol=1e-2)
    torch.autograd.gradgradcheck(lambda t: crt.apply_rope(t, f, interleaved=True), (x,), eps=1e-2, atol=1e-2, rtol=1e-2)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_torch_forward_mode_ad():
    """Forward-mode AD (``torch.autograd.forward_ad``): every differentiable entry point's output
    tangent is the same op applied to the input tangent (RoPE is linear; a missing tangent is
    zero), checked against the reference; the primal is the op's result; in-place calls and an
    explicit ``out`` refuse a tangent by name (they would drop it); ``torch.func.jvp`` and
    ``jacfwd`` (the rotation's matrix) agree."""
    import torch.autograd.forward_ad as fwad

    import cupy_rope.torch as crt

    torch.manual_seed(6)
    f = _f(32, 8)
    x, tx, k, tk = torch.randn(8, 2, 2, 32), torch.randn(8, 2, 2, 32), torch.randn(8, 2, 1, 32), torch.randn(8, 2, 1, 32)
    ref = lambda t, **kw: torch.from_numpy(rope_ref(t.numpy(), f.numpy(), **kw)).float()  # noqa: E731
    close = lambda a, b: torch.allclose(a, b, atol=1e-5)  # noqa: E731
    with fwad.dual_level():
        for bwd, fn in ((False, crt.apply_rope), (True, crt.apply_rope_backward)):
            p, t = fwad.unpack_dual(fn(fwad.make_dual(x, tx), f, interleaved=True))
            assert close(p, ref(x, backward=bwd, interleaved=True)) and close(t, ref(tx, backward=bwd, interleaved=True))
        qo, ko = crt.apply_rope_qk(fwad.make_dual(x, tx), k, f)
        assert close(fwad.unpack_dual(qo).tangent, ref(tx))
        assert fwad.unpack_dual(ko).tangent is None or not fwad.unpack_dual(ko).tangent.any()
        qo, ko = crt.apply_rope_qk(fwad.make_dual(x, tx), fwad.make_dual(k, tk), f)
        assert close(fwad.unpack_dual(qo).tangent, ref(tx)) and close(fwad.unpack_dual(ko).tangent, ref(tk))
        cache = torch.from_numpy(cupy_rope.rope_cos_sin_cache(32, 8))
        pos = torch.tensor([1, 5, 9, 0])  # 9: outside the cache (copied: the tangent too)
        q4, t4 = torch.randn(4, 2, 32), torch.randn(4, 2, 32)
        for kk in (None, fwad.make_dual(q4[:, :1] * 2, t4[:, :1] * 3)):
            outs = crt.apply_rope_pos(pos, fwad.make_dual(q4, t4), kk, cos_sin_cache=cache)
            want = crt.apply_rope_pos(pos, t4, None if kk is None else t4[:, :1] * 3, cos_sin_cache=cache)
            for o, w in zip(outs, want):
                assert (o is None) == (w is None) and (o is None or close(fwad.unpack_dual(o).tangent, w))
        assert torch.equal(fwad.unpack_dual(outs[0]).tangent[2], t4[2])  # copied position
        qkv, tq = torch.randn(8, 1, 2, 6 * 32), torch.randn(8, 1, 2, 6 * 32)
        for o, w in zip(crt.apply_qkv_rope(fwad.make_dual(qkv, tq), f, f, [128, 32, 32]),
                        crt.apply_qkv_rope(tq, f, f, [128, 32, 32])):
            assert close(fwad.unpack_dual(o).tangent, w)
        with pytest.raises(ValueError, match="`inplace`: expected False when `q` or `k` requires grad or carries a "
                                             "forward-mode tangent"):
            crt.apply_rope_qk(fwad.make_dual(x, tx), k, f, inplace=True)
        with pytest.raises(ValueError, match="`out`: expected None when `x` requires grad or carries"):
            crt.apply_rope(fwad.make_dual(x, tx), f, out=torch.empty_like(x))
    # torch.func's forward mode: jvp, and jacfwd (the rotation's matrix)
    _, t = torch.func.jvp(lambda a: crt.apply_rope(a, f), (x,), (tx,))
    assert close(t, ref(tx))
    xs = x[:2, :1, :1]
    jac = torch.func.jacfwd(lambda a: crt.apply_rope(a, f))(xs).reshape(64, 64)
    eye = torch.eye(64, dtype=torch.float64).reshape(64, 2, 1, 1, 32)
    assert np.allclose(jac.numpy(), np.stack([rope_ref(e.numpy(), f.numpy()) for e in eye]).reshape(64, 64).T,
                       atol=1e-6)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_torch_func_transforms():
    """``torch.func``: ``grad`` equals ``torch.autograd``'s gradient (rope, q and k, positions API),
    ``jacrev`` is the rotation's matrix (the reference applied to unit vectors), ``vmap`` equals a
    loop over the samples, also of the gradient (torch's per-sample fallback runs the op)."""
    import cupy_rope.torch as crt

    torch.manual_seed(5)
    f = _f(32, 8)
    x, k = torch.randn(8, 2, 2, 32), torch.randn(8, 2, 1, 32)
    pos = torch.tensor([3, 0, 7, 1, 9, 2])  # 9: outside the table, copied
    cache = torch.from_numpy(cupy_rope.rope_cos_sin_cache(32, 8))

    def autograd_grad(fn, *ts):
        ts = [t.clone().requires_grad_(True) for t in ts]
        return torch.autograd.grad(fn(*ts), ts)

    losses = [
        (lambda t: crt.apply_rope(t, f).pow(2).mul(torch.arange(32.0)).sum(), (x,)),
        (lambda a, b: sum(o.pow(3).sum() for o in crt.apply_rope_qk(a, b, f)), (x, k)),
        (lambda a, b: sum(o.sin().sum() for o in crt.apply_rope_pos(pos, a, b, cos_sin_cache=cache)),
         (torch.randn(6, 2, 32), torch.randn(6, 1, 32))),
    ]
    for fn, ts in losses:
        got = torch.func.grad(fn, argnums=tuple(range(len(ts))))(*ts)
        for g, want in zip(got, autograd_grad(fn, *ts)):
            assert torch.allclose(g, want, atol=1e-5), (g - want).abs().max()
    xs = x[:2, :1, :1]  # [2, 1, 1, 32]
    jac = torch.func.jacrev(lambda t: crt.apply_rope(t, f))(xs).reshape(64, 64)
    eye = torch.eye(64, dtype=torch.float64).reshape(64, 2, 1, 1, 32)
    want = np.stack([rope_ref(e.numpy(), f.numpy()) for e in eye]).reshape(64, 64).T
    assert np.allclose(jac.numpy(), want, atol=1e-6)
    batch = torch.randn(3, 8, 2, 2, 32)
    assert torch.equal(torch.func.vmap(lambda t: crt.apply_rope(t, f))(batch),
                       torch.stack([crt.apply_rope(t, f) for t in batch]))
    per = torch.func.vmap(torch.func.grad(losses[0][0]))(batch)
    assert torch.allclose(per, torch.stack([autograd_grad(losses[0][0], t)[0] for t in batch]), atol=1e-5)


def test_torch_opcheck():
    import cupy_rope.torch as crt  # noqa: F401

    f = _f(32, 8)
    x = torch.randn(8, 2, 2, 32, requires_grad=True)
    torch.library.opcheck(torch.ops.cupy_rope.rope.default, (x, f, "sbhd", False, None, None, 1, 0, False, False))
    qkv = torch.randn(8, 1, 2, 6 * 32, requires_grad=True)
    torch.library.opcheck(torch.ops.cupy_rope.qkv_rope.default, (qkv, f, f, [128, 32, 32], "sbhd", False, None, None, 1, 0))
    dq, dk, dv = torch.randn(8, 1, 8, 32), torch.randn(8, 1, 2, 32), torch.randn(8, 1, 2, 32)
    torch.library.opcheck(torch.ops.cupy_rope.qkv_rope_backward.default,
                          (dq, dk, dv, f, f, [128, 32, 32], "sbhd", False, None, None, 1, 0))


def test_torch_autograd_free_ops_skip_autograd():
    """The autograd-free ops (what torch.compile's graphs call) have a fallthrough at the Autograd
    keys, not torch's boxed autograd fallback: inputs that require grad give results without
    autograd history (the fallback would attach a node that warns at backward), with the same
    values as the public functions'."""
    import cupy_rope.torch as crt

    ops = torch.ops.cupy_rope
    f = _f(32, 8)
    x = torch.randn(8, 2, 3, 32, requires_grad=True)
    k = torch.randn(8, 2, 1, 32, requires_grad=True)
    pos = torch.tensor([3, 0, 7, 1, 5, 2, 6, 4])
    outs = [ops._rope_impl(x, f, "sbhd", False, None, None, 1, 0, False, False),
            *ops._rope_qk_impl(x, k, f, "sbhd", False, None, None, 1, 0, False),
            *ops._rope_pos_impl(pos, x[:, 0], k[:, 0], f, "freqs", 0, False, 0, False)]
    assert all(not o.requires_grad and o.grad_fn is None for o in outs), [o.grad_fn for o in outs]
    with torch.no_grad():
        want = [crt.apply_rope(x, f, "sbhd"), *crt.apply_rope_qk(x, k, f, "sbhd"),
                *cupy_rope.apply_rope_pos(pos, x[:, 0], k[:, 0], freqs=f)]
    for o, w in zip(outs, want):
        torch.testing.assert_close(o, w, rtol=0, atol=0)


@pytest.mark.parametrize("cp", [(1, 0), (4, 0), (4, 3)])
def test_torch_common_options_are_checked_by_type_alone(cp, monkeypatch):
    """The shim's hot path: options of the exact types with ranks in range (rank 0 and the last
    included) skip the full option checks; anything else takes them (a wrong value is named)."""
    import cupy_rope.torch as crt
    from cupy_rope import _plan

    cp_size, cp_rank = cp
    f = _f(32, 32)
    x, k = torch.randn(8, 2, 3, 32), torch.randn(8, 2, 1, 32)
    want = (crt.apply_rope(x, f, cp_size=cp_size, cp_rank=cp_rank),
            *crt.apply_rope_qk(x, k, f, cp_size=cp_size, cp_rank=cp_rank))
    calls = []
    orig = _plan.check_options
    monkeypatch.setattr(_plan, "check_options", lambda *a: calls.append(a) or orig(*a))
    got = (crt.apply_rope(x, f, cp_size=cp_size, cp_rank=cp_rank),
           *crt.apply_rope_qk(x, k, f, cp_size=cp_size, cp_rank=cp_rank))
    assert calls == []
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="`cp_rank`"):
        crt.apply_rope(x, f, cp_size=cp_size, cp_rank=cp_size)
    with pytest.raises(TypeError, match="`interleaved`"):
        crt.apply_rope_qk(x, k, f, interleaved=1)
    assert len(calls) == 2


def test_torch_compile_fullgraph():
    import cupy_rope.torch as crt

    f = _f(32, 16)

    def block(x, qkv):
        q, k, v = crt.apply_qkv_rope(qkv, f, f, split=(64, 32, 32))
        return crt.apply_rope(x, f, "bshd").square().sum() + (q * 2).sum() + k.sum() + v.sum()

    x = torch.randn(2, 16, 4, 32, requires_grad=True)
    qkv = torch.randn(2, 16, 2, 4 * 32, requires_grad=True)
    # sbhd for the qkv call: shape [s=2, b=16, g=2, ...]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x, qkv)
    out.backward()
    gx, gq = x.grad.clone(), qkv.grad.clone()
    x.grad = None
    qkv.grad = None
    block(x, qkv).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gq, qkv.grad)


def test_torch_qkv_autograd_vs_separate():
    import cupy_rope.torch as crt

    f, kf = _f(32, 12), _f(32, 13)
    qkv = torch.randn(6, 2, 2, 5 * 32, requires_grad=True)
    sp = torch.tensor([1, 2], dtype=torch.int32)
    q, k, v = crt.apply_qkv_rope(qkv, f, kf, num_q_heads=6, start_positions=sp)
    (q.sum() * 3 + (k * k).sum() + v.sum()).backward()
    x = qkv.detach().clone().requires_grad_()
    q2 = crt.apply_rope(x[..., :96].reshape(6, 2, 6, 32), f, start_positions=sp)
    k2 = crt.apply_rope(x[..., 96:128], kf, start_positions=sp)
    (q2.sum() * 3 + (k2 * k2).sum() + x[..., 128:].sum()).backward()
    torch.testing.assert_close(q, q2)
    torch.testing.assert_close(qkv.grad, x.grad)


def test_rotary_module():
    import cupy_rope.torch as crt

    m = crt.RotaryPositionEmbedding(128, rotary_percent=0.5, rotary_base=500000.0, interleaved=True)
    t = m(64, offset=3)
    assert t.shape == (64, 1, 1, 64) and t.dtype == torch.float32
    np.testing.assert_array_equal(t.numpy(), cupy_rope.rope_freqs(128, 64, rotary_percent=0.5, base=500000.0,
                                                                    interleaved=True, offset=3))


def test_te_dropin_matches_reference():
    from cupy_rope import te

    rng = np.random.default_rng(4)
    f = _f(64, 48)
    for fmt in ("sbhd", te.NVTE_QKV_Format.NVTE_BSHD, "thd"):
        if fmt == "thd":
            x = torch.from_numpy(rng.uniform(-1, 1, (30, 4, 64)).astype(np.float32))
            cu = torch.tensor([0, 8, 16, 32], dtype=torch.int32)
            lay = "thd"
        else:
            lay = fmt if isinstance(fmt, str) else "bshd"
            x = torch.from_numpy(rng.uniform(-1, 1, (8, 2, 4, 64)).astype(np.float32))
            cu = None
        sp = torch.tensor([2, 0, 1, 3, 0, 1, 2, 0], dtype=torch.int32)
        y = te.fused_rope_forward(x, f, sp, fmt, False, cu, 2, 1)
        g = te.fused_rope_backward(x, f, sp, fmt, True, cu, 2, 0)
        # the pre-2.x positional order (no start_positions) still works
        g_old = te.fused_rope_backward(x, f, fmt, True, cu, 2, 0)
        torch.testing.assert_close(g_old, te.fused_rope_backward(x, f, None, fmt, True, cu, 2, 0))
        kw = dict(layout=lay, start_positions=sp.numpy(), cp_size=2,
                  cu_seqlens=None if cu is None else cu.numpy())
        assert_close_to_ref(y.numpy(), rope_ref(x.numpy(), f.numpy(), cp_rank=1, **kw), x.numpy(), 64, "float32")
        assert_close_to_ref(g.numpy(), rope_ref(x.numpy(), f.numpy(), cp_rank=0, interleaved=True, backward=True, **kw),
                            x.numpy(), 64, "float32")
    qkv = torch.from_numpy(rng.uniform(-1, 1, (4, 2, 2, 6 * 32)).astype(np.float32))
    f32 = torch.from_numpy(cupy_rope.rope_freqs(32, 8))  # standard table: a rotation
    q, k, v = te.fused_qkv_rope_forward(qkv, f32, f32, None, [128, 32, 32], "sbhd", False, 1, 0)
    assert q.shape == (4, 2, 8, 32) and k.shape == (4, 2, 2, 32) and q.is_contiguous()
    d = te.fused_qkv_rope_backward(q, k, v, f32, f32, [128, 32, 32], "sbhd", False, 1, 0)
    torch.testing.assert_close(d, qkv, rtol=1e-5, atol=1e-5)  # rotation then its transpose
    d2 = te.fused_qkv_rope_backward(q, k, v, f32, f32, [128, 32, 32], "sbhd", False, 1, 0,
                                    start_positions=torch.tensor([0, 0], dtype=torch.int32))
    torch.testing.assert_close(d2, d)




@pytest.mark.parametrize("kw", [dict(), dict(rotary_percent=0.5), dict(interleaved=True, base=500000.0),
                                dict(seq_len_interpolation_factor=2, pretrained_max_position_embeddings=100, offset=3),
                                dict(seq_len_interpolation_factor=4, pretrained_max_position_embeddings=1000)])
def test_rope_freqs_matches_te_formula(kw):
    """TE's RotaryPositionEmbedding written out with torch ops (spec 2): ``rope_freqs(like=tensor)``
    runs those ops on the tensor's device (bit for bit); the NumPy table uses a correctly rounded
    float32 pow, so it may differ from a platform's powf by an ulp or two in a few entries."""
    dim, L = 96, 300
    base = kw.get("base", 10000.0)
    rp = kw.get("rotary_percent", 1.0)
    d = int(dim * rp) if rp < 1.0 else dim
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    seq = torch.arange(L, dtype=torch.float32) + kw.get("offset", 0)
    P, F = kw.get("pretrained_max_position_embeddings"), kw.get("seq_len_interpolation_factor")
    if P is not None and F is not None:
        seq *= 1 / (L / P) if L > P * F else 1 / F
    f = torch.einsum("i , j -> i j", seq, inv)
    emb = torch.stack((f.view(-1, 1), f.view(-1, 1)), dim=-1).view(f.shape[0], -1) if kw.get("interleaved") \
        else torch.cat((f, f), dim=-1)
    want = emb.reshape(L, 1, 1, -1).numpy()
    got = cupy_rope.rope_freqs(dim, L, **kw)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_max_ulp(got, want, maxulp=2)  # 1 ulp of inv_freq, then the product
    np.testing.assert_array_equal(cupy_rope.rope_freqs(dim, L, like=torch.empty(0), **kw).numpy(), want)


def test_empty_like_allocates_in_the_callers_framework():
    from cupy_rope import _interop

    like = torch.zeros(3, 2, 4, 8, dtype=torch.bfloat16)
    y, ptr = _interop.empty_like("torch", like, (3, 2, 4, 8))
    assert y.shape == (3, 2, 4, 8) and y.dtype == torch.bfloat16 and y.is_contiguous() and ptr == y.data_ptr()
    t, ptr = _interop.empty_like("torch", like, (3, 2, 4, 8), transposed=True)  # sbhd view of bshd memory
    assert t.shape == (3, 2, 4, 8) and t.stride() == (4 * 8, 3 * 4 * 8, 8, 1) and ptr == t.data_ptr()
    with pytest.raises(TypeError, match="cannot allocate"):
        _interop.empty_like("jax", np.zeros(3), (3,))
    n, ptr = _interop.empty_like("numpy", np.zeros((2, 3, 1, 4), np.float16), (3, 2, 1, 4), transposed=True)
    assert n.shape == (3, 2, 1, 4) and n.dtype == np.float16 and n.strides == (8, 24, 8, 2)


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_te_qkv_dropin_against_reference(layout, interleaved):
    """fused_qkv_rope_forward/backward against the float64 reference with general tables (two
    angles per pair), separate q/k tables, non-zero start positions and context parallelism:
    dropping any of start_positions, cp_size, cp_rank or a table would fail here."""
    from cupy_rope import te

    rng = np.random.default_rng(40 + interleaved)
    g, n, d, d2 = 2, 3, 32, 24
    qf = rng.uniform(-9, 9, (20, 1, 1, d2)).astype(np.float32)
    kf = rng.uniform(-9, 9, (21, d2)).astype(np.float32)
    sp = np.array([3, 1, 2], np.int32)
    cu = np.array([0, 4, 12], np.int32) if layout == "thd" else None
    lead = (7,) if layout == "thd" else ((4, 2) if layout == "sbhd" else (2, 4))
    qkv = rng.uniform(-1, 1, lead + (g, (n + 2) * d)).astype(np.float32)
    kw = dict(layout=layout, interleaved=interleaved, start_positions=sp, cp_size=2, cp_rank=1, cu_seqlens=cu)
    T = torch.from_numpy
    args = (T(qf), T(kf), T(sp), [n * d, d, d], layout, interleaved, 2, 1)
    q, k, v = te.fused_qkv_rope_forward(T(qkv), *args, cu_seqlens=None if cu is None else T(cu))
    xq, xk, xv = qkv_split_ref(qkv, n, d)
    assert_close_to_ref(q.numpy(), rope_ref(xq, qf, **kw), xq, d2, "float32", "q")
    assert_close_to_ref(k.numpy(), rope_ref(xk, kf, **kw), xk, d2, "float32", "k")
    np.testing.assert_array_equal(v.numpy(), xv)
    dq, dk, dv = (rng.uniform(-1, 1, lead + (h, d)).astype(np.float32) for h in (g * n, g, g))
    dqkv = te.fused_qkv_rope_backward(T(dq), T(dk), T(dv), T(qf), T(kf), [n * d, d, d], layout, interleaved, 2, 1,
                                      start_positions=T(sp), cu_seqlens=None if cu is None else T(cu))
    gq, gk, gv = qkv_split_ref(dqkv.numpy(), n, d)
    assert_close_to_ref(gq, rope_ref(dq, qf, backward=True, **kw), dq, d2, "float32", "dq")
    assert_close_to_ref(gk, rope_ref(dk, kf, backward=True, **kw), dk, d2, "float32", "dk")
    np.testing.assert_array_equal(gv, dv)


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
def test_torch_rope_qk_fused_views_autograd_and_inplace(layout):
    """q and k as views of one fused projection: forward, gradients into the projection (v's part
    zero), against the reference; inplace=True rotates the views where they are."""
    import cupy_rope.torch as crt

    rng = np.random.default_rng(5)
    f = _f(48, 40)
    lead = (14,) if layout == "thd" else ((4, 2) if layout == "sbhd" else (2, 4))
    kw = dict(layout=layout, interleaved=layout == "bshd", start_positions=torch.tensor([2, 0, 1]))
    if layout == "thd":
        kw["cu_seqlens"] = torch.tensor([0, 6, 6, 14], dtype=torch.int64)
    qkv = torch.from_numpy(rng.uniform(-1, 1, lead + (3, 3, 64)).astype(np.float32)).requires_grad_()
    ax = len(lead)
    q, k = crt.apply_rope_qk(qkv.select(ax, 0), qkv.select(ax, 1), f, **kw)
    wq, wk = (torch.from_numpy(rng.uniform(-1, 1, q.shape).astype(np.float32)) for _ in range(2))
    ((q * wq).sum() + (k * wk).sum()).backward()
    nkw = {k_: (v.numpy() if isinstance(v, torch.Tensor) else v) for k_, v in kw.items()}
    xn = qkv.detach().numpy()
    for i, (y, w) in enumerate(((q, wq), (k, wk))):
        xi = np.take(xn, i, axis=ax)
        assert_close_to_ref(y.detach().numpy(), rope_ref(xi, f.numpy(), **nkw), xi, 48, "float32")
        gi = np.take(qkv.grad.numpy(), i, axis=ax)
        assert_close_to_ref(gi, rope_ref(w.numpy(), f.numpy(), backward=True, **nkw), w.numpy(), 48, "float32")
    assert not np.take(qkv.grad.numpy(), 2, axis=ax).any()
    # in place on the views: q and k rotated inside the projection, v untouched
    buf = qkv.detach().clone()
    rq, rk = crt.apply_rope_qk(buf.select(ax, 0), buf.select(ax, 1), f, inplace=True, **kw)
    assert rq.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf.select(ax, 0), q.detach(), rtol=0, atol=0)
    torch.testing.assert_close(buf.select(ax, 1), k.detach(), rtol=0, atol=0)
    torch.testing.assert_close(buf.select(ax, 2), qkv.detach().select(ax, 2), rtol=0, atol=0)
    with pytest.raises(ValueError, match="`inplace`"):
        crt.apply_rope_qk(qkv.select(ax, 0), qkv.select(ax, 1), f, inplace=True, **kw)
    with pytest.raises(ValueError, match="`k`"):
        crt.apply_rope_qk(buf.select(ax, 0), buf.select(ax, 0), f, inplace=True, **kw)


def test_torch_rope_qk_gqa_opcheck_compile():
    """Different head counts and head dims for q and k; the ops pass opcheck; torch.compile
    (fullgraph) of a block using them gives eager's gradients."""
    import cupy_rope.torch as crt

    f = _f(32, 16)
    q = torch.randn(16, 2, 8, 64, requires_grad=True)
    k = torch.randn(16, 2, 2, 32, requires_grad=True)
    rq, rk = crt.apply_rope_qk(q, k, f)
    torch.testing.assert_close(rq, crt.apply_rope(q, f), rtol=0, atol=0)
    torch.testing.assert_close(rk, crt.apply_rope(k, f), rtol=0, atol=0)
    gq, gk = crt.apply_rope_qk_backward(rq.detach(), rk.detach(), f)
    torch.testing.assert_close(gq, crt.apply_rope_backward(rq.detach(), f), rtol=0, atol=0)
    args = (f, "sbhd", False, None, None, 1, 0, False)
    torch.library.opcheck(torch.ops.cupy_rope.rope_qk.default, (q, k) + args)
    torch.library.opcheck(torch.ops.cupy_rope.rope_qk_.default, (q.detach().clone(), k.detach().clone()) + args)

    def block(q, k):
        a, b = crt.apply_rope_qk(q, k, f)
        return (a.square().sum() + (b * 3).sum()) + crt.apply_rope(q, f, interleaved=True).sum()

    out = torch.compile(block, fullgraph=True, backend="aot_eager")(q, k)
    out.backward()
    g1 = (q.grad.clone(), k.grad.clone())
    q.grad = k.grad = None
    block(q, k).backward()
    torch.testing.assert_close(g1[0], q.grad)
    torch.testing.assert_close(g1[1], k.grad)


def test_te_dropin_inside_torch_compile():
    """TE calls its extension from autograd.Functions; with the drop-in standing in, a compiled
    model holds cupy_rope's ops (fullgraph: no graph break), forward and backward, for the
    single-tensor and the packed-QKV functions, at changing sequence lengths."""
    from cupy_rope import te

    f = _f(32, 64)

    class FusedRoPE(torch.autograd.Function):  # the shape of TE's FusedRoPEFunc
        @staticmethod
        def forward(ctx, t, freqs):
            ctx.save_for_backward(freqs)
            return te.fused_rope_forward(t, freqs, None, "sbhd", False, None, 1, 0)

        @staticmethod
        def backward(ctx, g):
            (freqs,) = ctx.saved_tensors
            return te.fused_rope_backward(g, freqs, None, "sbhd", False, None, 1, 0), None

    class FusedQKV(torch.autograd.Function):  # TE's FusedQKVRoPEFunc
        @staticmethod
        def forward(ctx, qkv, freqs):
            ctx.save_for_backward(freqs)
            return te.fused_qkv_rope_forward(qkv, freqs, freqs, None, [64, 32, 32], "sbhd", False, 1, 0)

        @staticmethod
        def backward(ctx, dq, dk, dv):
            (freqs,) = ctx.saved_tensors
            return te.fused_qkv_rope_backward(dq, dk, dv, freqs, freqs, [64, 32, 32], "sbhd", False, 1, 0), None

    def step(x, qkv):
        q, k, v = FusedQKV.apply(qkv, f)
        return (FusedRoPE.apply(x, f) ** 2).sum() + (q * q).sum() + (k * 3).sum() + v.sum()

    # eager calls on plain tensors keep the public API's route (no custom-op dispatch); traces and
    # tensor subclasses take the torch shim's ops
    import cupy_rope.torch as crt

    assert te._entry(torch.zeros(1), "input") is cupy_rope._api
    assert te._entry(torch.nn.Parameter(torch.zeros(1)), "input") is crt
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    rng = np.random.default_rng(9)
    for s in (4, 6, 8):
        x = torch.from_numpy(rng.standard_normal((s, 2, 4, 32)).astype(np.float32)).requires_grad_()
        qkv = torch.from_numpy(rng.standard_normal((s, 2, 2, 128)).astype(np.float32)).requires_grad_()
        got = compiled(x, qkv)
        got.backward()
        gx, gqkv = x.grad, qkv.grad
        x2, qkv2 = x.detach().clone().requires_grad_(), qkv.detach().clone().requires_grad_()
        want = step(x2, qkv2)
        want.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(gx, x2.grad)
        torch.testing.assert_close(gqkv, qkv2.grad)


def test_torch_qkv_backward_matches_public_api():
    import cupy_rope.torch as crt

    rng = np.random.default_rng(10)
    f = _f(32, 12)
    dq, dk, dv = (rng.standard_normal((6, 2, h, 32)).astype(np.float32) for h in (6, 2, 2))
    sp = np.array([1, 2], np.int32)
    T = torch.from_numpy
    want = cupy_rope.apply_qkv_rope_backward(dq, dk, dv, f.numpy(), f.numpy(), start_positions=sp)
    for kw in ({}, dict(num_q_heads=6), dict(split=(96, 32, 32))):
        got = crt.apply_qkv_rope_backward(T(dq), T(dk), T(dv), f, f, start_positions=T(sp), **kw)
        np.testing.assert_array_equal(got.numpy(), want)
    # differentiable: its gradient is the forward
    g = T(dq).requires_grad_()
    out = crt.apply_qkv_rope_backward(g, T(dk), T(dv), f, f)
    w = torch.from_numpy(rng.standard_normal(tuple(out.shape)).astype(np.float32))
    (out * w).sum().backward()
    q, _, _ = crt.apply_qkv_rope(w, f, f, num_q_heads=6)
    torch.testing.assert_close(g.grad, q)

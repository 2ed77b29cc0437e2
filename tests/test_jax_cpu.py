"""JAX shim on the CPU: jit, grad against a pure-jnp reference, vmap, packed QKV."""

import functools

import numpy as np
import pytest

import cupy_rope
from reference import assert_close_to_ref, qkv_split_ref, rope_ref

jax = pytest.importorskip("jax")


def test_jax_jit_grad_vmap_cpu():
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    rng = np.random.default_rng(5)
    f = jnp.asarray(rng.uniform(-5, 5, (24, 1, 1, 32)).astype(np.float32))
    x = jnp.asarray(rng.uniform(-1, 1, (8, 2, 3, 48)).astype(np.float32))
    sp = jnp.asarray(np.array([1, 3], np.int32))

    def loss(x):
        return (crj.apply_rope(x, f, "sbhd", start_positions=sp, cp_size=2, cp_rank=1) ** 2).sum()

    def ref_rope(x):  # pure jnp, straight from the spec
        pos = np.arange(4, 12)[:, None] + np.asarray(sp)[None, :]  # rank 1 of 2: chunks 1 and 2 of 4
        th = f.reshape(24, 32)[pos][:, :, None, :]
        x1, x2 = x[..., :16], x[..., 16:32]
        rot = jnp.concatenate([-x2, x1], -1)
        return jnp.concatenate([x[..., :32] * jnp.cos(th) + rot * jnp.sin(th), x[..., 32:]], -1)

    y = jax.jit(lambda x: crj.apply_rope(x, f, "sbhd", start_positions=sp, cp_size=2, cp_rank=1))(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_rope(x)), rtol=1e-5, atol=1e-5)
    g = jax.jit(jax.grad(loss))(x)
    gr = jax.grad(lambda x: (ref_rope(x) ** 2).sum())(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=1e-4, atol=1e-4)
    cu = np.array([0, 3, 7], np.int32)  # a padding row at the end
    xs = x.reshape(2, 8, 3, 48)
    yv = jax.vmap(lambda t: crj.apply_rope(t, f, "thd", cu_seqlens=jnp.asarray(cu)))(xs)
    for i in range(2):  # each mapped slice against the float64 reference
        xi = np.asarray(xs[i])
        assert_close_to_ref(np.asarray(yv[i]), rope_ref(xi, np.asarray(f), "thd", cu_seqlens=cu), xi, 32, "float32")
    # top-level API with a JAX CPU array returns a JAX array
    y2 = cupy_rope.apply_rope(x, f, start_positions=sp, cp_size=2, cp_rank=1)
    assert isinstance(y2, jax.Array)
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_jax_qkv_cpu():
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    rng = np.random.default_rng(6)
    f = jnp.asarray(rng.uniform(-5, 5, (8, 1, 1, 32)).astype(np.float32))
    qkv = jnp.asarray(rng.uniform(-1, 1, (8, 1, 2, 5 * 32)).astype(np.float32))
    kf = jnp.asarray(rng.uniform(-5, 5, (9, 32)).astype(np.float32))  # a separate k table
    sp = np.array([1], np.int32)
    q, k, v = jax.jit(lambda a: crj.apply_qkv_rope(a, f, kf, num_q_heads=6, start_positions=jnp.asarray(sp)))(qkv)
    qn = np.asarray(qkv)
    xq, xk, xv = qkv_split_ref(qn, 3, 32)
    fq, fk = np.asarray(f), np.asarray(kf)
    assert_close_to_ref(np.asarray(q), rope_ref(xq, fq, start_positions=sp), xq, 32, "float32", "q")
    assert_close_to_ref(np.asarray(k), rope_ref(xk, fk, start_positions=sp), xk, 32, "float32", "k")
    np.testing.assert_array_equal(np.asarray(v), xv)
    # the VJP of sum(q * wq) + sum(k * wk) + sum(v * wv) is the backward rotation of the weights
    wq, wk, wv = (rng.uniform(-1, 1, t.shape).astype(np.float32) for t in (q, k, v))

    def loss(a):
        tq, tk, tv = crj.apply_qkv_rope(a, f, kf, split=(96, 32, 32), start_positions=jnp.asarray(sp))
        return (tq * wq).sum() + (tk * wk).sum() + (tv * wv).sum()

    g = np.asarray(jax.grad(loss)(qkv))
    gq, gk, gv = qkv_split_ref(g, 3, 32)
    assert_close_to_ref(gq, rope_ref(wq, fq, start_positions=sp, backward=True), wq, 32, "float32", "dq")
    assert_close_to_ref(gk, rope_ref(wk, fk, start_positions=sp, backward=True), wk, 32, "float32", "dk")
    np.testing.assert_array_equal(gv, wv)


def _fused_case(rng, form, hq, hk, d, rows, d2):
    """A random bshd fused projection [2, 8, ..] (``stacked`` [2, 8, 3, hq, d], hk = hq, or
    ``flat`` [2, 8, (hq + 2*hk) * d]), a random angle table [rows, d2] and start positions; returns
    (projection, table, start positions, the fused entry's head keywords, parts(a) -> its q, k and
    v parts)."""
    if form == "stacked":
        qkv, kw = rng.uniform(-1, 1, (2, 8, 3, hq, d)).astype(np.float32), {}

        def parts(a):
            return a[:, :, 0], a[:, :, 1], a[:, :, 2]
    else:
        qkv = rng.uniform(-1, 1, (2, 8, (hq + 2 * hk) * d)).astype(np.float32)
        kw = dict(num_q_heads=hq, num_kv_heads=hk)

        def parts(a):
            return tuple(a[..., lo * d: (lo + h) * d].reshape(2, 8, h, d)
                         for lo, h in ((0, hq), (hq, hk), (hq + hk, hk)))

    sp = rng.integers(0, rows - 8, 2).astype(np.int32)
    return qkv, rng.uniform(-5, 5, (rows, d2)).astype(np.float32), sp, kw, parts


@pytest.mark.parametrize("form", ["stacked", "flat"])
def test_jax_rope_qk_and_fused_cpu(form):
    """apply_rope_qk and the fused-projection entry against the reference, jitted, with gradients."""
    import jax
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    rng = np.random.default_rng(4)
    qkv_n, fn_, sp, fused_kw, parts = _fused_case(rng, form, 4, 2, 64, 20, 48)
    f, kw = jnp.asarray(fn_), dict(start_positions=jnp.asarray(sp))
    qn, kn, _ = parts(qkv_n)
    q, k = jax.jit(lambda a: crj.apply_rope_qk_fused(a, f, "bshd", **fused_kw, **kw))(jnp.asarray(qkv_n))
    q2, k2 = jax.jit(lambda a, b: crj.apply_rope_qk(a, b, f, "bshd", **kw))(jnp.asarray(qn), jnp.asarray(kn))
    for y, y2, xn in ((q, q2, qn), (k, k2, kn)):
        assert_close_to_ref(np.asarray(y), rope_ref(xn, fn_, layout="bshd", start_positions=sp), xn, 48, "float32")
        np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
    wq, wk = rng.uniform(-1, 1, q.shape).astype(np.float32), rng.uniform(-1, 1, k.shape).astype(np.float32)

    def loss(a):
        a, b = crj.apply_rope_qk_fused(a, f, "bshd", **fused_kw, **kw)
        return (a * wq).sum() + (b * wk).sum()

    g = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(qkv_n)))
    gq_ref = rope_ref(wq, fn_, layout="bshd", start_positions=sp, backward=True)
    gk_ref = rope_ref(wk, fn_, layout="bshd", start_positions=sp, backward=True)
    gq, gk, gv = parts(g)
    np.testing.assert_allclose(gq, gq_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gk, gk_ref, rtol=1e-5, atol=1e-5)
    assert not gv.any()
    with pytest.raises(ValueError, match="`num_q_heads`"):
        crj.apply_rope_qk_fused(jnp.asarray(qkv_n.reshape(2, 8, -1)), f, "bshd")


@pytest.mark.parametrize("form", ["stacked", "flat"])
def test_jax_fused_return_v_cpu(form):
    """``return_v``: v is the projection's v part; the gradient (v's included) is the reference's,
    the same as with v sliced by the caller; second-order derivatives agree with the separate q
    and k entry on slices (the fused entry's transpose has a VJP of its own)."""
    import jax
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    rng = np.random.default_rng(9)
    qkv_n, fn_, sp_n, fused_kw, parts = _fused_case(rng, form, 6, 2, 32, 24, 24)
    f, kw = jnp.asarray(fn_), dict(start_positions=jnp.asarray(sp_n))
    q, k, v = jax.jit(lambda a: crj.apply_rope_qk_fused(a, f, "bshd", return_v=True, **fused_kw, **kw))(
        jnp.asarray(qkv_n))
    qn, kn, vn = parts(qkv_n)
    np.testing.assert_array_equal(np.asarray(v), vn)
    for y, xn in ((q, qn), (k, kn)):
        assert_close_to_ref(np.asarray(y), rope_ref(xn, fn_, layout="bshd", start_positions=sp_n), xn, 24, "float32")
    w = [rng.uniform(-1, 1, a.shape).astype(np.float32) for a in (q, k, v)]

    def loss(a, return_v):
        out = crj.apply_rope_qk_fused(a, f, "bshd", return_v=return_v, **fused_kw, **kw)
        v = out[2] if return_v else parts(a)[2]
        return sum((o * wi).sum() for o, wi in zip((out[0], out[1], v), w))

    g = jax.jit(jax.grad(lambda a: loss(a, True)))(jnp.asarray(qkv_n))
    gq, gk, gv = (np.asarray(t) for t in parts(g))
    np.testing.assert_allclose(gq, rope_ref(w[0], fn_, layout="bshd", start_positions=sp_n, backward=True),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gk, rope_ref(w[1], fn_, layout="bshd", start_positions=sp_n, backward=True),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(gv, w[2])
    g_sliced = jax.jit(jax.grad(lambda a: loss(a, False)))(jnp.asarray(qkv_n))
    np.testing.assert_array_equal(np.asarray(g_sliced), np.asarray(g))
    jax.config.update("jax_debug_nans", True)  # the gradient assembled from separate q and k outputs
    try:
        g_debug = jax.jit(jax.grad(lambda a: loss(a, True)))(jnp.asarray(qkv_n))
    finally:
        jax.config.update("jax_debug_nans", False)
    np.testing.assert_array_equal(np.asarray(g_debug), np.asarray(g))

    def quad(a, fused):  # a non-linear loss: second derivatives go through the transpose's VJP
        if fused:
            out = crj.apply_rope_qk_fused(a, f, "bshd", return_v=True, **fused_kw, **kw)
        else:
            pq, pk, pv = parts(a)
            out = (*crj.apply_rope_qk(pq, pk, f, "bshd", **kw), pv)
        return sum(((o * wi) ** 2).sum() for o, wi in zip(out, w))

    t = jnp.asarray(rng.uniform(-1, 1, qkv_n.shape).astype(np.float32))
    hv = [np.asarray(jax.grad(lambda a, fu=fu: jnp.vdot(jax.grad(functools.partial(quad, fused=fu))(a), t))(
        jnp.asarray(qkv_n))) for fu in (True, False)]  # reverse over reverse: Hessian times t
    assert np.abs(hv[1]).max() > 0
    np.testing.assert_allclose(hv[0], hv[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="`return_v`"):
        crj.apply_rope_qk_fused(jnp.asarray(qkv_n), f, "bshd", return_v=1, **fused_kw)


@pytest.mark.parametrize("entry", ["fused", "qk", "single"])
def test_jax_heads_major_cpu(entry):
    """``heads_major`` (a memory order the GPU's FFI call declares) changes nothing on the CPU:
    values and gradients those without it; anything but a bool is a named ``TypeError``."""
    import jax
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    rng = np.random.default_rng(21)
    qkv = jnp.asarray(rng.uniform(-1, 1, (2, 8, 3, 4, 32)).astype(np.float32))
    f = jnp.asarray(rng.uniform(-5, 5, (16, 1, 1, 24)).astype(np.float32))
    sp = jnp.asarray(np.array([1, 6], np.int32))
    calls = {"fused": lambda a, hm: crj.apply_rope_qk_fused(a, f, "bshd", start_positions=sp, heads_major=hm),
             "qk": lambda a, hm: crj.apply_rope_qk(a[:, :, 0], a[:, :, 1], f, "bshd", start_positions=sp,
                                                   heads_major=hm),
             "single": lambda a, hm: (crj.apply_rope(a[:, :, 0], f, "bshd", start_positions=sp, heads_major=hm),)}
    call = calls[entry]
    w = jnp.asarray(rng.uniform(-1, 1, (2, 8, 4, 32)).astype(np.float32))
    for hm in (False, True):
        out = jax.jit(lambda a, hm=hm: call(a, hm))(qkv)
        g = jax.grad(lambda a, hm=hm: sum(((o * w) ** 2).sum() for o in call(a, hm)))(qkv)
        if hm:
            for a, b in zip((*out, g), (*out0, g0)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        out0, g0 = out, g
    assert_close_to_ref(np.asarray(out0[0]), rope_ref(np.asarray(qkv[:, :, 0]), np.asarray(f), layout="bshd",
                                                      start_positions=np.asarray(sp)), np.asarray(qkv[:, :, 0]), 24,
                        "float32")
    with pytest.raises(TypeError, match="`heads_major`"):
        call(qkv, "yes")


def test_jax_qkv_backward_split_as_the_public_api():
    """The shim's static split of the packed-QKV backward comes from the public API's own checks:
    with no KV groups (g = 0) only ``split`` gives the packed width; ``num_q_heads`` that does
    not match the gradients is named."""
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    rng = np.random.default_rng(8)
    f = rng.uniform(-5, 5, (6, 1, 1, 16)).astype(np.float32)
    dq, dk = np.zeros((6, 1, 0, 16), np.float32), np.zeros((6, 1, 0, 16), np.float32)
    for lib in (cupy_rope, crj):
        a = (lambda t: t) if lib is cupy_rope else jnp.asarray
        out = lib.apply_qkv_rope_backward(a(dq), a(dk), a(dk), a(f), a(f), split=(32, 16, 16))
        assert tuple(out.shape) == (6, 1, 0, 64)
        with pytest.raises(ValueError, match="`split`"):
            lib.apply_qkv_rope_backward(a(dq), a(dk), a(dk), a(f), a(f))
        g = rng.standard_normal((6, 1, 2, 16)).astype(np.float32)
        with pytest.raises(ValueError, match="`num_q_heads`"):
            lib.apply_qkv_rope_backward(a(np.concatenate([g, g], 2)), a(g), a(g), a(f), a(f), num_q_heads=6)

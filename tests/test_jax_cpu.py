"""JAX shim on the CPU: jit, grad against a pure-jnp reference, vmap, packed QKV."""

import numpy as np
import pytest

import cupy_rope

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
    yv = jax.vmap(lambda x: crj.apply_rope(x, f, "thd", cu_seqlens=jnp.array([0, 4, 8], jnp.int32)))(x.reshape(2, 8, 3, 48)[:, :, :, :])
    assert yv.shape == (2, 8, 3, 48)
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
    q, k, v = jax.jit(lambda a: crj.apply_qkv_rope(a, f, f, num_q_heads=6))(qkv)
    qn, kn, vn = cupy_rope.apply_qkv_rope(np.asarray(qkv), np.asarray(f), np.asarray(f), num_q_heads=6)
    np.testing.assert_allclose(np.asarray(q), qn, rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda a: sum(t.sum() for t in crj.apply_qkv_rope(a, f, f, split=(96, 32, 32))))(qkv)
    gn = cupy_rope.apply_qkv_rope_backward(np.ones_like(qn), np.ones_like(kn), np.ones_like(vn), np.asarray(f), np.asarray(f))
    np.testing.assert_allclose(np.asarray(g), gn, rtol=1e-5, atol=1e-5)

"""GPU (H200): torch.compile on CUDA, CUDA graphs through the custom op, JAX jit/grad/vmap on
the GPU, the TE drop-in on CUDA, and a small attention block trained with the torch shim."""

import numpy as np
import pytest

import cupy_rope
from reference import assert_close_to_ref, qkv_split_ref, rope_ref

pytestmark = pytest.mark.gpu


def test_torch_compile_cuda_fullgraph_and_graph_capture():
    import torch

    import cupy_rope.torch as crt

    f = torch.from_numpy(cupy_rope.rope_freqs(64, 128)).cuda()

    def fn(x, qkv):
        q, k, v = crt.apply_qkv_rope(qkv, f, f, split=(256, 64, 64))
        return (crt.apply_rope(x, f).float() ** 2).sum() + q.float().sum() + (k.float() * v.float()).sum()

    x = torch.randn(128, 2, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qkv = torch.randn(128, 2, 2, 6 * 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    explain = torch._dynamo.explain(fn)(x, qkv)
    assert explain.graph_break_count == 0, explain.break_reasons
    c = torch.compile(fn, fullgraph=True)
    out = c(x, qkv)
    out.backward()
    g1, g2 = x.grad.clone(), qkv.grad.clone()
    x.grad = qkv.grad = None
    fn(x, qkv).backward()
    torch.testing.assert_close(g1, x.grad)
    torch.testing.assert_close(g2, qkv.grad)
    # reduce-overhead (CUDA graph trees)
    c2 = torch.compile(lambda t: crt.apply_rope(t, f) * 2, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        t = torch.randn(128, 2, 8, 64, device="cuda")
        torch.testing.assert_close(c2(t), crt.apply_rope(t, f) * 2)


def test_torch_op_in_cuda_graph_with_backward():
    import torch

    import cupy_rope.torch as crt

    f = torch.from_numpy(cupy_rope.rope_freqs(64, 64)).cuda()
    x = torch.randn(64, 2, 4, 64, device="cuda", requires_grad=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            crt.apply_rope(x, f).sum().backward()
    torch.cuda.current_stream().wait_stream(s)
    x.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = crt.apply_rope(x, f)
        y.sum().backward()
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(y, crt.apply_rope(x.detach(), f), rtol=0, atol=0)


def test_jax_gpu_jit_grad_vmap():
    import jax
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    assert jax.default_backend() == "gpu"
    rng = np.random.default_rng(0)
    fn_ = rng.uniform(-5, 5, (64, 1, 1, 64)).astype(np.float32)
    xn = rng.uniform(-1, 1, (32, 2, 4, 64)).astype(np.float32)
    sp = np.array([3, 7], np.int32)
    f, x = jnp.asarray(fn_), jnp.asarray(xn)
    kw = dict(start_positions=jnp.asarray(sp), cp_size=2, cp_rank=1)
    y = jax.jit(lambda x: crj.apply_rope(x, f, "sbhd", **kw))(x)
    assert_close_to_ref(np.asarray(y), rope_ref(xn, fn_, start_positions=sp, cp_size=2, cp_rank=1), xn, 64, "float32")
    g = jax.jit(jax.grad(lambda x: (crj.apply_rope(x, f, "sbhd", **kw) * x).sum()))(x)
    ref_g = rope_ref(xn, fn_, start_positions=sp, cp_size=2, cp_rank=1) + \
        rope_ref(xn, fn_, start_positions=sp, cp_size=2, cp_rank=1, backward=True)
    np.testing.assert_allclose(np.asarray(g), ref_g, rtol=1e-5, atol=1e-5)
    yv = jax.vmap(lambda t: crj.apply_rope(t, f, "sbhd"))(jnp.stack([x, 2 * x]))
    np.testing.assert_allclose(np.asarray(yv[1]), 2 * np.asarray(crj.apply_rope(x, f)), rtol=1e-6, atol=1e-6)
    for dt in (jnp.bfloat16, jnp.float16):
        xb = x.astype(dt)
        yb = jax.jit(lambda t: crj.apply_rope(t, f))(xb)
        assert yb.dtype == dt
        assert_close_to_ref(np.asarray(yb), rope_ref(np.asarray(xb), fn_), np.asarray(xb), 64,
                            jnp.dtype(dt).name)
    # top-level API with a JAX GPU array
    assert isinstance(cupy_rope.apply_rope(x, f), jax.Array)
    qkv_n = rng.uniform(-1, 1, (32, 2, 2, 6 * 64)).astype(np.float32)
    q, k, v = jax.jit(lambda a: crj.apply_qkv_rope(a, f, f, num_q_heads=8))(jnp.asarray(qkv_n))
    xq, xk, xv = qkv_split_ref(qkv_n, 4, 64)
    assert_close_to_ref(np.asarray(q), rope_ref(xq, fn_), xq, 64, "float32", "jax q")
    assert_close_to_ref(np.asarray(k), rope_ref(xk, fn_), xk, 64, "float32", "jax k")
    np.testing.assert_array_equal(np.asarray(v), xv)
    wq = rng.uniform(-1, 1, q.shape).astype(np.float32)
    gq = jax.grad(lambda a: (crj.apply_qkv_rope(a, f, f, num_q_heads=8)[0] * wq).sum())(jnp.asarray(qkv_n))
    dq, dk, dv = qkv_split_ref(np.asarray(gq), 4, 64)
    assert_close_to_ref(dq, rope_ref(wq, fn_, backward=True), wq, 64, "float32", "jax dq")
    assert not np.asarray(dk).any() and not np.asarray(dv).any()


def test_te_dropin_cuda_matches_reference():
    import torch

    from cupy_rope import te

    rng = np.random.default_rng(1)
    fn_ = rng.uniform(-5, 5, (64, 1, 1, 64)).astype(np.float32)
    xn = rng.uniform(-1, 1, (16, 2, 4, 64)).astype(np.float32)
    y = te.fused_rope_forward(torch.from_numpy(xn).cuda(), torch.from_numpy(fn_).cuda(), None,
                              te.NVTE_QKV_Format.NVTE_SBHD, True, None, 1, 0)
    assert y.is_cuda and y.is_contiguous()
    assert_close_to_ref(y.cpu().numpy(), rope_ref(xn, fn_, interleaved=True), xn, 64, "float32")


def test_train_attention_block_matches_pure_torch():
    """A tiny float32 attention block trained a few steps: the shim's losses and final weights
    match a pure-torch RoPE to float32 rounding (both compute the rotation in float32)."""
    import torch

    import cupy_rope.torch as crt

    def torch_rope(x, freqs):  # TE's unfused formula, sbhd
        d2 = freqs.shape[-1]
        t = freqs[: x.shape[0]]
        x1, x2 = x[..., : d2 // 2], x[..., d2 // 2: d2]
        rot = torch.cat([-x2, x1], -1)
        return torch.cat([(x[..., :d2].float() * t.cos() + rot.float() * t.sin()).to(x.dtype), x[..., d2:]], -1)

    def run(rope_fn):
        torch.manual_seed(0)
        s, b, h, d = 64, 4, 4, 32
        lin = torch.nn.Linear(h * d, 3 * h * d).cuda()
        out = torch.nn.Linear(h * d, h * d).cuda()
        opt = torch.optim.SGD(list(lin.parameters()) + list(out.parameters()), lr=0.05)
        freqs = torch.from_numpy(cupy_rope.rope_freqs(d, s)).cuda()
        data = torch.randn(s, b, h * d, device="cuda")
        losses = []
        for _ in range(5):
            qkv = lin(data).view(s, b, 3, h, d)
            q, k, v = rope_fn(qkv[:, :, 0], freqs), rope_fn(qkv[:, :, 1], freqs), qkv[:, :, 2]
            a = torch.nn.functional.scaled_dot_product_attention(
                q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True)
            loss = out(a.permute(2, 0, 1, 3).reshape(s, b, h * d)).float().pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, lin.weight.detach().cpu().numpy()

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # plain float32 matrix products in both runs
    try:
        ours, w_ours = run(lambda x, f: crt.apply_rope(x, f))
        ref, w_ref = run(torch_rope)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    np.testing.assert_allclose(ours, ref, rtol=1e-4)
    np.testing.assert_allclose(w_ours, w_ref, rtol=1e-4, atol=1e-5)

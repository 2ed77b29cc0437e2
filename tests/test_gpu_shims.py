"""GPU (H200): torch.compile on CUDA, CUDA graphs through the custom op, JAX jit/grad/vmap on
the GPU, the TE drop-in on CUDA, and a small attention block trained with the torch shim."""

import functools

import numpy as np
import pytest

import cupy_rope
from cases import part_threads
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


def test_jax_gpu_jit_grad_vmap(xla_launch):
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


def test_jax_gpu_launch_way(xla_launch):
    """The traced call launches the way the fixture chose: the FFI custom call, or a callback."""
    import jax
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    f = jnp.asarray(cupy_rope.rope_freqs(64, 16))
    text = jax.jit(lambda t: crj.apply_rope(t, f)).lower(jnp.ones((16, 2, 4, 64), jnp.float32)).as_text()
    assert ("@cupy_rope_launch" in text) == (xla_launch == "ffi"), text[-2000:]


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


def test_torch_rope_qk_cuda_one_launch_matches_separate_calls():
    """q and k in one launch: bit-identical to two apply_rope calls (GQA head counts, views of a
    fused projection), forward, backward and in place; cached relaunches with new buffers; CUDA
    graph capture and torch.compile (reduce-overhead) of a block using it."""
    import torch

    import cupy_rope.torch as crt
    from cupy_rope import _launch

    f = torch.from_numpy(cupy_rope.rope_freqs(128, 256)).cuda()
    sp = torch.tensor([5, 0, 17, 3], dtype=torch.int32, device="cuda")
    launches = []
    orig = _launch.launch
    _launch.launch = lambda spec, *a, **k: (launches.append(spec), orig(spec, *a, **k))[1]
    try:
        for trial in range(3):  # new buffers each time: the cached launch patches the addresses
            qkv = torch.randn(4, 32, 3, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            q, k = crt.apply_rope_qk(qkv[:, :, 0], qkv[:, :, 1], f, "bshd", start_positions=sp)
            rq = crt.apply_rope(qkv[:, :, 0], f, "bshd", start_positions=sp)
            rk = crt.apply_rope(qkv[:, :, 1], f, "bshd", start_positions=sp)
            torch.testing.assert_close(q, rq, rtol=0, atol=0)
            torch.testing.assert_close(k, rk, rtol=0, atol=0)
            g = torch.randn_like(q)
            (q * g).sum().backward(retain_graph=True)
            gq = qkv.grad[:, :, 0].clone()
            torch.testing.assert_close(gq, crt.apply_rope_backward(g, f, "bshd", start_positions=sp), rtol=0, atol=0)
            assert not qkv.grad[:, :, 1:].any()
    finally:
        _launch.launch = orig
    # q and k: both tensors' parts in the grid of one launch
    assert any(part_threads(s.block, s.params) < s.grid[0] * s.block for s in launches if s.name.startswith("rope")), \
        launches
    # GQA: other head counts and head dims; in place into the projection
    q8 = torch.randn(64, 2, 16, 128, device="cuda", dtype=torch.float16)
    k2 = torch.randn(64, 2, 2, 64, device="cuda", dtype=torch.float16)[..., :64]
    f64 = f[..., :64]
    a, b = crt.apply_rope_qk(q8, k2, f64)
    torch.testing.assert_close(a, crt.apply_rope(q8, f64), rtol=0, atol=0)
    torch.testing.assert_close(b, crt.apply_rope(k2, f64), rtol=0, atol=0)
    buf = torch.randn(4, 32, 3, 8, 128, device="cuda", dtype=torch.bfloat16)
    ref = [crt.apply_rope(buf[:, :, i], f, "bshd") for i in (0, 1)]
    v = buf[:, :, 2].clone()
    crt.apply_rope_qk(buf[:, :, 0], buf[:, :, 1], f, "bshd", inplace=True)
    for i in (0, 1):
        torch.testing.assert_close(buf[:, :, i], ref[i], rtol=0, atol=0)
    torch.testing.assert_close(buf[:, :, 2], v, rtol=0, atol=0)

    def block(x):
        q, k = crt.apply_rope_qk(x[:, :, 0], x[:, :, 1], f, "bshd", start_positions=sp)
        return q.float().square().sum() + k.float().sum()

    x = torch.randn(4, 32, 3, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for mode in ("default", "reduce-overhead"):
        c = torch.compile(block, fullgraph=True, mode=mode)
        for _ in range(3):
            x.grad = None
            out = c(x)
            out.backward()
            gc = x.grad.clone()
            x.grad = None
            block(x).backward()
            torch.testing.assert_close(gc, x.grad)
            with torch.no_grad():
                x.copy_(torch.randn_like(x))


def test_jax_rope_qk_fused_gpu_command_buffers(xla_launch):
    """The JAX q+k entries on the GPU: against the reference, and a jitted multi-layer chain called
    with alternating inputs (XLA may record the launches into a command buffer and replay them:
    every call must see its own buffers); grad and vmap."""
    import jax
    import jax.numpy as jnp

    import cupy_rope.jax as crj

    rng = np.random.default_rng(3)
    fn_ = rng.uniform(-5, 5, (64, 1, 1, 128)).astype(np.float32)
    f = jnp.asarray(fn_)
    sp_n = np.array([3, 9], np.int32)
    sp = jnp.asarray(sp_n)

    def chain(t):
        outs = []
        for _ in range(6):
            q, k = crj.apply_rope_qk_fused(t, f, "bshd", start_positions=sp)
            t = t.at[:, :, 0].set(q).at[:, :, 1].set(k)
            outs.append(q)
        return t, outs

    fn = jax.jit(chain)
    inputs = [rng.uniform(-1, 1, (2, 16, 3, 4, 128)).astype(np.float32) for _ in range(2)]
    for trial in range(6):
        xn = inputs[trial % 2]
        t, outs = fn(jnp.asarray(xn))
        ref_q, ref_k = xn[:, :, 0], xn[:, :, 1]
        for i in range(6):
            ref_q = rope_ref(ref_q, fn_, layout="bshd", start_positions=sp_n)
            ref_k = rope_ref(ref_k, fn_, layout="bshd", start_positions=sp_n)
        np.testing.assert_allclose(np.asarray(t[:, :, 0]), ref_q, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(t[:, :, 1]), ref_k, rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(np.asarray(t[:, :, 2]), xn[:, :, 2])
    # flat [b, s, (hq + 2 hk) d] projection, GQA; grad; separate q, k entry; vmap
    flat = rng.uniform(-1, 1, (2, 16, (8 + 2 * 2) * 128)).astype(np.float32)
    q, k = jax.jit(lambda a: crj.apply_rope_qk_fused(a, f, "bshd", num_q_heads=8, num_kv_heads=2))(jnp.asarray(flat))
    qn, kn = flat[..., :1024].reshape(2, 16, 8, 128), flat[..., 1024:1280].reshape(2, 16, 2, 128)
    assert_close_to_ref(np.asarray(q), rope_ref(qn, fn_, layout="bshd"), qn, 128, "float32")
    assert_close_to_ref(np.asarray(k), rope_ref(kn, fn_, layout="bshd"), kn, 128, "float32")
    q2, k2 = jax.jit(lambda a, b: crj.apply_rope_qk(a, b, f, "bshd"))(jnp.asarray(qn), jnp.asarray(kn))
    np.testing.assert_array_equal(np.asarray(q2), np.asarray(q))
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(k))
    w = rng.uniform(-1, 1, q.shape).astype(np.float32)
    g = jax.jit(jax.grad(lambda a: (crj.apply_rope_qk_fused(a, f, "bshd", num_q_heads=8, num_kv_heads=2)[0]
                                    * w).sum()))(jnp.asarray(flat))
    np.testing.assert_allclose(np.asarray(g)[..., :1024].reshape(w.shape),
                               rope_ref(w, fn_, layout="bshd", backward=True), rtol=1e-5, atol=1e-5)
    assert not np.asarray(g)[..., 1024:].any()
    qv, _ = jax.vmap(lambda a: crj.apply_rope_qk(a, a[..., :2, :], f, "bshd"))(jnp.stack([jnp.asarray(qn)] * 2))
    np.testing.assert_array_equal(np.asarray(qv[1]), np.asarray(q))


@pytest.mark.parametrize("form", ["stacked", "flat"])
def test_jax_rope_qk_fused_gpu_gradient_one_buffer(xla_launch, form):
    """The fused entry's gradient on the GPU (one launch into the gradient's buffer, its v part set
    in place), with and without ``return_v``, in bf16 and float32, jitted and called with
    alternating inputs: the gradient of every call is the reference's for its own cotangents."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    import cupy_rope.jax as crj

    rng = np.random.default_rng(17)
    fn_ = rng.uniform(-5, 5, (64, 1, 1, 128)).astype(np.float32)
    f, sp_n = jnp.asarray(fn_), np.array([5, 11], np.int32)
    if form == "stacked":
        shape, kw, (hq, hk) = (2, 16, 3, 4, 128), {}, (4, 4)
    else:
        shape, kw, (hq, hk) = (2, 16, (8 + 2 * 2) * 128), dict(num_q_heads=8, num_kv_heads=2), (8, 2)

    def parts(a):
        a = a.reshape(2, 16, -1)
        return (a[..., : hq * 128].reshape(2, 16, hq, 128), a[..., hq * 128: (hq + hk) * 128].reshape(2, 16, hk, 128),
                a[..., (hq + hk) * 128:].reshape(2, 16, hk, 128))

    for dtype, tol in ((np.float32, 1e-5), (ml_dtypes.bfloat16, 2e-2)):
        for return_v in (True, False):
            def vjp(a, cq, ck, cv, return_v=return_v):
                def fwd(t):
                    out = crj.apply_rope_qk_fused(t, f, "bshd", start_positions=jnp.asarray(sp_n), return_v=return_v,
                                                  **kw)
                    return out if return_v else (*out, parts(t)[2])
                return jax.vjp(fwd, a)[1]((cq, ck, cv))[0]

            fn = jax.jit(vjp)
            for trial in range(4):
                a = rng.uniform(-1, 1, shape).astype(dtype)
                cots = [rng.uniform(-1, 1, (2, 16, h, 128)).astype(dtype) for h in (hq, hk, hk)]
                g = np.asarray(fn(jnp.asarray(a), *(jnp.asarray(c) for c in cots))).astype(np.float32)
                gq, gk, gv = parts(g)
                for got, c in ((gq, cots[0]), (gk, cots[1])):
                    ref = rope_ref(c.astype(np.float32), fn_, layout="bshd", start_positions=sp_n, backward=True)
                    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
                np.testing.assert_array_equal(gv, cots[2].astype(np.float32))


@pytest.mark.parametrize("form", ["fused_bshd", "fused_thd_gqa", "separate_sbhd", "single_bshd"])
def test_jax_heads_major_gpu(xla_launch, form):
    """``heads_major``: q' and k' stored [b, h, s, d] (thd: [h, t, d]) by the FFI launch, row-major
    by the callback. Either way q', k' and the gradient (a VJP with random cotangents) are those
    without it, bit for bit, and an einsum reading them (XLA's attention's first product) agrees,
    jitted with alternating inputs, in bf16 and float32."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    import cupy_rope.jax as crj

    rng = np.random.default_rng(18)
    fn_ = rng.uniform(-5, 5, (64, 1, 1, 96)).astype(np.float32)  # rotary 96 of 128
    f = jnp.asarray(fn_)
    if form == "fused_bshd":
        shape, eq, rep = (2, 16, 3, 4, 128), "bshd,bthd->bhst", 1
        sp = jnp.asarray(np.array([5, 11], np.int32))

        def rope(t, hm):
            return crj.apply_rope_qk_fused(t, f, "bshd", start_positions=sp, heads_major=hm)
    elif form == "fused_thd_gqa":
        shape, eq, rep = (40, (8 + 2 * 2) * 128), "shd,thd->hst", 4  # k's 2 heads repeated for q's 8
        cu = jnp.asarray(np.array([0, 17, 40], np.int32))

        def rope(t, hm):
            return crj.apply_rope_qk_fused(t, f, "thd", num_q_heads=8, num_kv_heads=2, cu_seqlens=cu, heads_major=hm)
    elif form == "separate_sbhd":
        shape, eq, rep = (16, 2, 2, 4, 128), "sbhd,tbhd->bhst", 1  # q and k passed as two arrays

        def rope(t, hm):
            return crj.apply_rope_qk(t[:, :, 0], t[:, :, 1], f, "sbhd", heads_major=hm)
    else:
        shape, eq, rep = (2, 16, 2, 4, 128), "bshd,bthd->bhst", 1  # q and k rotated by two calls

        def rope(t, hm):
            return tuple(crj.apply_rope(t[:, :, i], f, "bshd", heads_major=hm) for i in (0, 1))

    def run(t, cq, ck, hm):
        (q, k), vjp = jax.vjp(functools.partial(rope, hm=hm), t)
        s = jnp.einsum(eq, q, jnp.repeat(k, rep, axis=-2), preferred_element_type=jnp.float32)
        return q, k, vjp((cq, ck))[0], s

    fns = {hm: jax.jit(functools.partial(run, hm=hm)) for hm in (False, True)}
    for dtype in (np.float32, ml_dtypes.bfloat16):
        for trial in range(3):
            t = jnp.asarray(rng.uniform(-1, 1, shape).astype(dtype))
            q0, k0 = rope(t, False)
            cq, ck = (jnp.asarray(rng.uniform(-1, 1, a.shape).astype(dtype)) for a in (q0, k0))
            r0, r1 = fns[False](t, cq, ck), fns[True](t, cq, ck)
            for a, b in zip(r0[:3], r1[:3]):
                np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
            np.testing.assert_allclose(np.asarray(r1[3]), np.asarray(r0[3]), rtol=1e-5, atol=1e-4)
    if xla_launch == "ffi":  # the call declares the heads-major layout of its results
        text = jax.jit(lambda t: rope(t, True)).lower(jnp.zeros(shape, jnp.float32)).as_text()
        assert "result_layouts = [dense<[" + ("2, 0, 1" if form == "fused_thd_gqa" else
                                              "3, 0, 2, 1" if form == "separate_sbhd" else "3, 1, 2, 0") in text, text


@pytest.mark.parametrize("empty", ["k", "q"])
def test_rope_qk_gpu_one_tensor_without_heads(xla_launch, empty):
    """A q+k call where one tensor has no heads (a zero-size part of the launch): the other is
    rotated as apply_rope rotates it, forward and backward, in CuPy, torch and JAX (eager and
    jitted, each XLA launch way); the empty one comes back empty."""
    import cupy
    import jax
    import jax.numpy as jnp
    import torch

    import cupy_rope.jax as crj
    import cupy_rope.torch as crt
    from fuzz import to_numpy

    rng = np.random.default_rng(11)
    fn_ = rng.uniform(-5, 5, (32, 1, 1, 64)).astype(np.float32)
    full = rng.uniform(-1, 1, (16, 2, 4, 64)).astype(np.float32)
    none = np.zeros((16, 2, 0, 64), np.float32)
    pair = (full, none) if empty == "k" else (none, full)
    side = 0 if empty == "k" else 1
    for backward in (False, True):
        ref = rope_ref(full, fn_, backward=backward)
        jfn = crj.apply_rope_qk_backward if backward else crj.apply_rope_qk
        calls = {
            "cupy": lambda: (cupy_rope.apply_rope_qk_backward if backward else cupy_rope.apply_rope_qk)(
                *(cupy.asarray(a) for a in pair), cupy.asarray(fn_)),
            "torch": lambda: (crt.apply_rope_qk_backward if backward else crt.apply_rope_qk)(
                *(torch.from_numpy(a).cuda() for a in pair), torch.from_numpy(fn_).cuda()),
            "jax": lambda: jfn(*(jnp.asarray(a) for a in pair), jnp.asarray(fn_)),
            "jax jit": lambda: jax.jit(jfn)(*(jnp.asarray(a) for a in pair), jnp.asarray(fn_)),
        }
        for name, call in calls.items():
            out = [to_numpy(o) for o in call()]
            assert out[1 - side].shape == none.shape, name
            assert_close_to_ref(out[side], ref, full, 64, "float32", f"{name} backward={backward}")

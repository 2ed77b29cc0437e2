"""The torch shim's C++ launch path (cupy_rope/csrc/torch_launch.cpp, cupy_rope/_torch_ext.py).

CPU: the library builds with torch's extension builder and loads beside the Python kernels (a
subprocess with ``CUPY_ROPE_TORCH_EXT=1``); the environment switch is validated. GPU: every op
served from the C++ cache gives the Python path's exact results (out of place, in place,
transposed output, q alone, strided views, other address alignments), debug mode bypasses it,
CUDA graphs capture it.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import cupy_rope

torch = pytest.importorskip("torch")


def _run(code: str, mode: str):
    env = dict(os.environ, CUPY_ROPE_TORCH_EXT=mode)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)


def test_env_switch_is_validated(monkeypatch):
    from cupy_rope import _torch_ext

    monkeypatch.setattr(_torch_ext, "build", lambda: pytest.fail("built"))
    monkeypatch.setenv("CUPY_ROPE_TORCH_EXT", "yes")
    with pytest.raises(ValueError, match="CUPY_ROPE_TORCH_EXT: expected auto, 0 or 1, got 'yes'"):
        _torch_ext.load()
    monkeypatch.setenv("CUPY_ROPE_TORCH_EXT", "0")
    assert _torch_ext.load() is False


def test_builds_and_loads_beside_the_cpu_kernels():
    from cupy_rope import _torch_ext

    why = _torch_ext.missing_tools()
    if why:
        pytest.skip(f"cannot build the C++ launch path here: {why}")
    code = (
        "import torch, numpy as np, cupy_rope, cupy_rope.torch as crt\n"
        "from cupy_rope import _torch_ext\n"
        "assert crt._EXT and _torch_ext.loaded()\n"
        "assert _torch_ext.info() == dict(hits=0, misses=0, size=0), _torch_ext.info()\n"
        "torch.ops.cupy_rope._ext_put(1, 1, 1, 32, False, [0, 0], [0, 1], [1], [0], [])  # no miss pending: ignored\n"
        "assert _torch_ext.info()['size'] == 0\n"
        "f = torch.from_numpy(cupy_rope.rope_freqs(64, 16))\n"
        "x = torch.randn(16, 2, 4, 64)\n"
        "y = crt.apply_rope(x, f)\n"
        "assert torch.equal(y, cupy_rope.apply_rope(x, f))\n"
        "q, k = torch.ops.cupy_rope.rope_qk(x, x, f, 'sbhd', False, None, None, 1, 0, False)\n"
        "assert torch.equal(q, y) and torch.equal(k, y)\n"
        "cupy_rope.set_debug(True); cupy_rope.set_debug(False)\n"
        "import os, sysconfig\n"
        "if os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')):\n"
        "    assert _torch_ext.FAST is not None and crt._launch.NATIVE is crt._public_route\n"
        "if _torch_ext.FAST is not None:\n"
        "    i = _torch_ext.FAST_INDEX['_rope_impl']\n"
        "    assert _torch_ext.FAST(i, x, f, 'sbhd', False, None, None, 1, 0, False, False) is None  # CPU: not served\n"
        "    assert _torch_ext.FAST(i, x) is None  # wrong arity: left to the dispatcher\n"
        "    for bad, exc in ((99, ValueError), ('rope', TypeError)):\n"
        "        try:\n"
        "            _torch_ext.FAST(bad, x)\n"
        "        except exc:\n"
        "            pass\n"
        "        else:\n"
        "            raise AssertionError(bad)\n"
        "print('ok')\n"
    )
    r = _run(code, "1")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


_AUTOGRAD_CODE = """
import torch, cupy_rope, cupy_rope.torch as crt
from cupy_rope import _torch_ext
assert crt._EXT and _torch_ext.loaded()
for name in ("rope", "rope_qk", "rope_pos"):
    for key in ("AutogradCPU", "AutogradCUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("cupy_rope::" + name, key), (name, key)
    assert "torch_launch" in torch._C._dispatch_dump("cupy_rope::" + name).split("AutogradCPU:")[1].split(chr(10))[0]
torch.manual_seed(0)
f = torch.from_numpy(cupy_rope.rope_freqs(64, 16))
x, k = torch.randn(16, 2, 4, 64), torch.randn(16, 2, 2, 64)
g, gk = torch.randn_like(x), torch.randn_like(k)
R, QK, POS = torch.ops.cupy_rope.rope, torch.ops.cupy_rope.rope_qk, torch.ops.cupy_rope.rope_pos
rope = lambda t, tab=f: R(t, tab, "sbhd", False, None, None, 1, 0, False, False)
qk = lambda a, b: QK(a, b, f, "sbhd", False, None, None, 1, 0, False)
pos = torch.arange(16).repeat_interleave(2)
cache = torch.from_numpy(cupy_rope.rope_cos_sin_cache(64, 16))
rpos = lambda a, b: POS(pos, a.reshape(32, -1, 64), None if b is None else b.reshape(32, -1, 64), cache,
                        "cos_sin_cache", 0, False, 0, False)
ref = cupy_rope.apply_rope(x, f)
# no input requires grad / grad mode off / only the table requires grad: no autograd node
fg = f.clone().requires_grad_(True)
for y in (rope(x), qk(x, k)[0], rpos(x, k)[0], rope(x, fg)):
    assert y.grad_fn is None and not y.requires_grad
xg, kg = x.clone().requires_grad_(True), k.clone().requires_grad_(True)
with torch.no_grad():
    assert rope(xg).grad_fn is None and qk(xg, kg)[1].grad_fn is None and rpos(xg, kg)[0].grad_fn is None
assert torch.equal(rope(x), ref) and torch.equal(qk(x, k)[0], ref)
# the Python autograd kernel (op _ag_<op>) runs only for the calls that need a gradient
def ops_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}
assert not any(n.startswith("cupy_rope::_ag_") for n in ops_run(lambda: (rope(x), qk(xg.detach(), k), rpos(x, k))))
assert {"cupy_rope::_ag_rope", "cupy_rope::_ag_rope_qk", "cupy_rope::_ag_rope_pos"} <= ops_run(
    lambda: (rope(xg), qk(x, kg), rpos(xg, None)))
# the gradient: the backward rotation
back = lambda t: cupy_rope.apply_rope_backward(t, f)
y = rope(xg)
assert y.grad_fn is not None and torch.equal(y.detach(), ref)
y.backward(g)
assert torch.allclose(xg.grad, back(g), atol=1e-6)
for a, b in ((xg, k), (x, kg)):  # q or k alone requires grad
    for t in (xg, kg):
        t.grad = None
    yq, yk = qk(a, b)
    (yq * g).sum().add_((yk * gk).sum()).backward()
    t, gt = (xg, g) if a is xg else (kg, gk)
    assert torch.allclose(t.grad, back(gt), atol=1e-6), a is xg
import torch.autograd.forward_ad as fwad
with fwad.dual_level():  # a forward-mode tangent (no requires_grad) takes the Python kernel too
    t = torch.randn_like(x)
    for y, want in ((rope(fwad.make_dual(x, t)), cupy_rope.apply_rope(t, f)),
                    (qk(x, fwad.make_dual(k, gk))[1], cupy_rope.apply_rope(gk, f))):
        yt = fwad.unpack_dual(y).tangent
        assert yt is not None and torch.allclose(yt, want, atol=1e-6)
xg.grad = None
outs = rpos(xg, None)
assert len(outs) == 1 and outs[0].grad_fn is not None
outs[0].backward(g.reshape(32, -1, 64))
assert torch.allclose(xg.grad, back(g), atol=1e-5)
print("ok")
"""


def test_cpp_autograd_kernels_on_the_cpu():
    """With the C++ launch path loaded, the out-of-place ops' CPU and CUDA autograd kernels are
    C++: a call that needs no gradient (no input requires grad, grad mode off, only the table
    requires grad) records no autograd node; one that does (x; q or k alone; the positions op with
    and without k) gets the Python autograd kernel's node and the backward rotation as its
    gradient; a forward-mode tangent gets the rotated tangent."""
    from cupy_rope import _torch_ext

    why = _torch_ext.missing_tools()
    if why:
        pytest.skip(f"cannot build the C++ launch path here: {why}")
    r = _run(_AUTOGRAD_CODE, "1")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_off_switch_keeps_the_python_kernels():
    r = _run("import cupy_rope.torch as crt; from cupy_rope import _torch_ext; "
             "assert not crt._EXT and _torch_ext.info() == {}; print('ok')", "0")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


# ----------------------------------------------------------------------------- GPU
def _ext_or_skip():
    import cupy_rope.torch as crt
    from cupy_rope import _torch_ext

    if not crt._EXT:
        pytest.skip("the C++ launch path is not loaded (CUPY_ROPE_TORCH_EXT or build tools)")
    return crt, _torch_ext


def _hits():
    from cupy_rope import _torch_ext

    return _torch_ext.info()["hits"]


def _offset(t, elems: int):
    """``t``'s values at an address ``elems`` elements past a fresh allocation's."""
    buf = torch.empty(t.numel() + elems, dtype=t.dtype, device=t.device)
    v = buf[elems:].view(t.shape)
    v.copy_(t)
    return v


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_every_op_from_the_cpp_cache_matches_the_python_path(dtype, monkeypatch):
    crt, _ = _ext_or_skip()
    from cupy_rope import _launch

    monkeypatch.setattr(_launch, "NATIVE", None)  # the public API's own (Python) path for the wants
    dt = getattr(torch, dtype)
    rng = np.random.default_rng(7)
    f = torch.from_numpy(cupy_rope.rope_freqs(64, 256)).cuda()
    sp = torch.from_numpy(rng.integers(0, 100, 4).astype(np.int32)).cuda()
    cs = torch.from_numpy(cupy_rope.rope_cos_sin_cache(64, 256)).cuda()
    pos = torch.from_numpy(rng.integers(-3, 260, 24)).cuda()
    ops = torch.ops.cupy_rope
    for trial in range(3):
        qkv = torch.randn(4, 6, 3, 4, 64, device="cuda", dtype=dt)  # bshd views of a fused projection
        q, k = qkv[:, :, 0], qkv[:, :, 1]
        xs = torch.randn(6, 4, 4, 64, device="cuda", dtype=dt)
        qt, kt = torch.randn(24, 4 * 64, device="cuda", dtype=dt), torch.randn(24, 2, 64, device="cuda", dtype=dt)
        if trial == 2:  # other address alignments than the cached launches': a new launch each
            q, xs, qt = _offset(q, 4), _offset(xs, 2), _offset(qt, 1)
        want_rope = cupy_rope.apply_rope(xs, f, "sbhd", start_positions=sp)  # the Python path
        want_tom = cupy_rope.apply_rope(xs, f, "sbhd", transpose_output_memory=True)
        want_qk = cupy_rope.apply_rope_qk(q, k, f, "bshd", start_positions=sp)
        want_pos = cupy_rope.apply_rope_pos(pos, qt, kt, cos_sin_cache=cs, head_size=64)
        want_pos_q = cupy_rope.apply_rope_pos(pos, qt, None, freqs=f, head_size=64, inverse=True)
        # the in-place ops run on clones (aligned, dense): their own kernel instantiation, whose
        # last bits may differ from the views' (FMA contraction); the Python path on clones too
        want_qk_ = cupy_rope.apply_rope_qk(q.clone(), k.clone(), f, "bshd", start_positions=sp)
        want_pos_ = cupy_rope.apply_rope_pos(pos, qt.clone(), kt.clone(), cos_sin_cache=cs, head_size=64)
        for rep in range(3):
            before = _hits()
            got = ops.rope(xs, f, "sbhd", False, None, sp, 1, 0, False, False)
            assert torch.equal(got, want_rope)
            got = ops._rope_impl(xs, f, "sbhd", False, None, None, 1, 0, False, True)
            assert torch.equal(got, want_tom) and got.stride() == want_tom.stride()
            gq, gk = ops.rope_qk(q, k, f, "bshd", False, None, sp, 1, 0, False)
            assert torch.equal(gq, want_qk[0]) and torch.equal(gk, want_qk[1])
            gq, gk = ops._rope_qk_impl(q, k, f, "bshd", False, None, sp, 1, 0, False)
            assert torch.equal(gq, want_qk[0]) and torch.equal(gk, want_qk[1])
            iq, ik = q.clone(), k.clone()
            ops.rope_qk_(iq, ik, f, "bshd", False, None, sp, 1, 0, False)
            assert torch.equal(iq, want_qk_[0]) and torch.equal(ik, want_qk_[1])
            res = ops.rope_pos(pos, qt, kt, cs, "cos_sin_cache", 64, False, 0, False)
            assert len(res) == 2 and torch.equal(res[0], want_pos[0]) and torch.equal(res[1], want_pos[1])
            res = ops._rope_pos_impl(pos, qt, None, f, "freqs", 64, False, 0, True)
            assert len(res) == 1 and torch.equal(res[0], want_pos_q[0])
            iq, ik = qt.clone(), kt.clone()
            ops.rope_pos_(pos, iq, ik, cs, "cos_sin_cache", 64, False, 0, False)
            assert torch.equal(iq, want_pos_[0]) and torch.equal(ik, want_pos_[1])
            if rep:  # every call after the first of each signature: served by C++
                assert _hits() == before + 8


@pytest.mark.gpu
def test_gpu_public_functions_and_autograd_use_the_cpp_path():
    crt, _ = _ext_or_skip()
    f = torch.from_numpy(cupy_rope.rope_freqs(128, 512)).cuda()
    x = torch.randn(64, 2, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(64, 2, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    def step():
        q_out, k_out = crt.apply_rope_qk(x, k, f)
        (q_out.float().square().sum() + k_out.float().square().sum()).backward()

    step()  # the first forward and backward signatures: the Python path
    before = _hits()
    step()
    assert _hits() == before + 2  # forward and backward
    with torch.no_grad():
        want = cupy_rope.apply_rope(x, f)
        assert torch.equal(crt.apply_rope(x, f), want)


@pytest.mark.gpu
def test_gpu_debug_mode_bypasses_the_cpp_cache():
    crt, _ = _ext_or_skip()
    f = torch.from_numpy(cupy_rope.rope_freqs(64, 16)).cuda()
    x = torch.randn(8, 2, 4, 64, device="cuda")
    sp = torch.tensor([0, 12], dtype=torch.int32, device="cuda")  # 12 + 8 > 16 rows
    crt.apply_rope(x, f, start_positions=sp)
    crt.apply_rope(x, f, start_positions=sp)  # cached
    cupy_rope.set_debug(True)
    try:
        with pytest.raises(ValueError, match="start_positions"):
            crt.apply_rope(x, f, start_positions=sp)
    finally:
        cupy_rope.set_debug(False)
    before = _hits()
    crt.apply_rope(x, f, start_positions=sp)
    crt.apply_rope(x, f, start_positions=sp)
    assert _hits() == before + 1  # the cache was dropped: one miss, then hits again


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_the_cpp_launch():
    crt, _ = _ext_or_skip()
    f = torch.from_numpy(cupy_rope.rope_freqs(128, 4096)).cuda()
    q = torch.randn(1, 64, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 64, 8, 128, device="cuda", dtype=torch.bfloat16)
    sp = torch.randint(0, 4000, (64,), device="cuda", dtype=torch.int32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            crt.apply_rope_qk(q, k, f, start_positions=sp)
    torch.cuda.current_stream().wait_stream(s)
    before = _hits()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = crt.apply_rope_qk(q, k, f, start_positions=sp)
    assert _hits() == before + 1
    for _ in range(2):
        q.copy_(torch.randn_like(q)), k.copy_(torch.randn_like(k))
        sp.copy_(torch.randint(0, 4000, (64,), device="cuda", dtype=torch.int32))
        g.replay()
        want = cupy_rope.apply_rope_qk(q, k, f, start_positions=sp)
        torch.cuda.synchronize()
        assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1])


@pytest.mark.gpu
def test_gpu_cached_in_place_calls_still_reject_overlaps():
    """A cached in-place signature must not serve a call whose arrays overlap differently (the
    C++ path and the Python path's launch cache)."""
    import cupy_rope.torch as crt

    tab = torch.from_numpy(cupy_rope.rope_freqs(64, 64)).cuda()  # [64, 1, 1, 64] float32
    buf = torch.randn(8192, device="cuda")
    q = buf[:1024].view(4, 4, 1, 64)
    k_ok, k_bad = buf[2048:3072].view(4, 4, 1, 64), buf[512:1536].view(4, 4, 1, 64)  # k_bad overlaps q
    shared = torch.empty(64 * 64 + 1024, device="cuda")
    shared[:4096] = tab.reshape(-1)
    f_shared = shared[:4096].view(64, 1, 1, 64)
    q_on_table = shared[3072:4096].view(4, 4, 1, 64)  # q inside the table's last rows
    for fn in (lambda a, b, f: crt.apply_rope_qk(a, b, f, inplace=True),
               lambda a, b, f: cupy_rope.apply_rope_qk(a, b, f, inplace=True)):
        for _ in range(2):  # cached
            fn(q, k_ok, tab)
            fn(shared[4096:5120].view(4, 4, 1, 64), k_ok, f_shared)
        q_before = q.clone()
        with pytest.raises(ValueError, match="overlapping tensors"):
            fn(q, k_bad, tab)
        with pytest.raises(ValueError, match="overlap"):
            fn(q_on_table, k_ok, f_shared)
        assert torch.equal(q, q_before)  # nothing written on error


@pytest.mark.gpu
def test_gpu_tables_built_for_torch_are_static_for_cuda_graph_trees():
    """rope_freqs / rope_cos_sin_cache with a CUDA ``like`` mark their result as a static input
    (read in place by torch.compile(mode="reduce-overhead"), never copied per replay)."""
    like = torch.empty(0, device="cuda")
    for t in (cupy_rope.rope_freqs(64, 16, like=like), cupy_rope.rope_cos_sin_cache(64, 16, like=like)):
        assert t.is_cuda and getattr(t, "_dynamo_static_input_type", None) == "unguarded"
    assert getattr(cupy_rope.rope_freqs(64, 16, like=torch.empty(0)), "_dynamo_static_input_type", None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_fast_entry_and_the_public_api_route(dtype, monkeypatch):
    """Cached calls from Python without the dispatcher (the fast entry) and the public API's
    calls on torch tensors through the C++ path: the Python path's exact results, counted as C++
    hits; in-place calls bump the version counters; tensors that require grad keep the public
    API's own path (outputs without autograd history)."""
    crt, ext = _ext_or_skip()
    from cupy_rope import _launch

    assert ext.FAST is not None, "the fast entry did not build on the GPU machine"
    dt = getattr(torch, dtype)
    rng = np.random.default_rng(17)
    f = torch.from_numpy(cupy_rope.rope_freqs(128, 512)).cuda()
    cs = torch.from_numpy(cupy_rope.rope_cos_sin_cache(128, 512)).cuda().to(dt)
    sp = torch.from_numpy(rng.integers(0, 400, 8).astype(np.int32)).cuda()
    pos = torch.from_numpy(rng.integers(0, 512, 8)).cuda()
    for trial in range(3):
        qkv = torch.randn(8, 1, 3, 6, 128, device="cuda", dtype=dt)  # [b, s, 3, h, d]: strided views
        q, k = qkv[:, :, 0], qkv[:, :, 1]
        qt, kt = torch.randn(8, 6 * 128, device="cuda", dtype=dt), torch.randn(8, 2 * 128, device="cuda", dtype=dt)
        with monkeypatch.context() as m:
            m.setattr(_launch, "NATIVE", None)
            want = cupy_rope.apply_rope(q, f, "bshd", start_positions=sp)
            want_qk = cupy_rope.apply_rope_qk(q, k, f, "bshd", start_positions=sp)
            want_pos = cupy_rope.apply_rope_pos(pos, qt, kt, cos_sin_cache=cs, head_size=128)
        for rep in range(3):
            before, before_native = _hits(), cupy_rope._api.cache_info()["native_hits"]
            assert torch.equal(crt.apply_rope(q, f, "bshd", start_positions=sp), want)
            gq, gk = crt.apply_rope_qk(q, k, f, "bshd", start_positions=sp)
            assert torch.equal(gq, want_qk[0]) and torch.equal(gk, want_qk[1])
            assert torch.equal(cupy_rope.apply_rope(q, f, "bshd", start_positions=sp), want)  # public API
            gq, gk = cupy_rope.apply_rope_qk(q, k, f, "bshd", start_positions=sp)
            assert torch.equal(gq, want_qk[0]) and torch.equal(gk, want_qk[1])
            iq, ik = qkv.clone()[:, :, 0], qkv.clone()[:, :, 1]
            v0 = (iq._version, ik._version)
            crt.apply_rope_qk(iq, ik, f, "bshd", start_positions=sp, inplace=True)
            assert torch.equal(iq, want_qk[0]) and torch.equal(ik, want_qk[1])
            assert iq._version > v0[0] and ik._version > v0[1]
            pq, pk = crt.apply_rope_pos(pos, qt, kt, cos_sin_cache=cs, head_size=128)
            assert torch.equal(pq, want_pos[0]) and torch.equal(pk, want_pos[1])
            iq, ik = qt.clone(), kt.clone()
            crt.apply_rope_pos(pos, iq, ik, cos_sin_cache=cs, head_size=128, inplace=True)
            assert torch.equal(iq, want_pos[0]) and torch.equal(ik, want_pos[1])
            # the public API: in-place q and k, the positions API (also in place)
            iq, ik = qkv.clone()[:, :, 0], qkv.clone()[:, :, 1]
            v0 = (iq._version, ik._version)
            assert cupy_rope.apply_rope_qk(iq, ik, f, "bshd", start_positions=sp, inplace=True) == (iq, ik)
            assert torch.equal(iq, want_qk[0]) and torch.equal(ik, want_qk[1])
            assert iq._version > v0[0] and ik._version > v0[1]
            pq, pk = cupy_rope.apply_rope_pos(pos, qt, kt, cos_sin_cache=cs, head_size=128)
            assert torch.equal(pq, want_pos[0]) and torch.equal(pk, want_pos[1])
            with torch.inference_mode():  # inference tensors (no version counter) in place
                iq, ik = qt.clone(), kt.clone()
            assert cupy_rope.apply_rope_pos(pos, iq, ik, cos_sin_cache=cs, head_size=128, inplace=True) == (iq, ik)
            assert torch.equal(iq, want_pos[0]) and torch.equal(ik, want_pos[1])
            if rep:
                assert _hits() == before + 10
                assert cupy_rope._api.cache_info()["native_hits"] == before_native + 10
    # a signature not cached yet: not served by the fast entry (the op then validates and caches it)
    x = torch.randn(3, 1, 2, 128, device="cuda", dtype=dt)
    i = ext.FAST_INDEX["_rope_impl"]
    assert ext.FAST(i, x, f, "sbhd", False, None, None, 1, 0, False, False) is None
    assert ext.FAST(i, x, f, "sbhd", 0, None, None, 1, 0, False, False) is None  # an int for a bool
    # the public API on tensors that require grad: its own path, no autograd history
    xg = x.clone().requires_grad_(True)
    for _ in range(2):
        y = cupy_rope.apply_rope(xg, f)
        assert not y.requires_grad and y.grad_fn is None
    # errors keep their names and types through the public API's route, and arguments of other
    # types than the op's stay on the public API's path
    with pytest.raises(ValueError, match="`freqs`"):
        cupy_rope.apply_rope(x, f[:1], "sbhd", start_positions=sp[:1] + 100)
    with pytest.raises(ValueError, match="`layout`"):
        cupy_rope.apply_rope(x, f, None)
    with monkeypatch.context() as m:
        m.setattr(_launch, "NATIVE", None)
        want = cupy_rope.apply_rope(x, f, interleaved=True)
    assert torch.equal(cupy_rope.apply_rope(x, f, interleaved=np.bool_(True)), want)
    import cupy

    assert torch.equal(cupy_rope.apply_rope(x, cupy.from_dlpack(f)), crt.apply_rope(x, f))  # a CuPy table


def test_public_route_logic_on_the_cpu(monkeypatch):
    """The public API's route through the C++ path (``cupy_rope.torch._public_route``), with the
    fast entry and the plain-CUDA check replaced: a hit is returned as is (its key holds the types
    of a call the op validated); on a miss, arguments of the op's exact types run the op (here its
    CPU kernel), anything else (a numpy bool, an int beyond int64, a tensor that requires grad)
    and a call made while a miss is being resolved go back to the public API's path (None)."""
    import cupy_rope.torch as crt
    from cupy_rope import _torch_ext

    calls = []
    hit = object()

    def fake_fast(index, *args):
        calls.append(index)
        return hit if args[2] == "bshd" else None  # "cached": the bshd calls

    monkeypatch.setattr(crt, "_FAST", fake_fast)
    monkeypatch.setattr(crt, "_FAST_INDEX", {"_rope_impl": 0, "_rope_qk_impl": 1})
    monkeypatch.setattr(crt, "_plain_cuda", lambda t: True)
    f = torch.from_numpy(cupy_rope.rope_freqs(64, 16))
    x = torch.randn(8, 2, 4, 64)
    args = (f, "sbhd", False, None, None, 1, 0, False, False)
    assert crt._public_route("rope", x, x, f, "bshd", np.bool_(False), None, None, 1, 0, False, False) is hit
    y = crt._public_route("rope", x, x, *args)
    assert torch.equal(y, cupy_rope.apply_rope(x, f))  # a miss: the op ran
    q, k = crt._public_route("rope_qk", x, x, x[:, :, :1], f, "sbhd", False, None, None, 1, 0, False)
    assert torch.equal(q, y) and torch.equal(k, y[:, :, :1])
    assert calls == [0, 0, 1]
    assert crt._public_route("rope", x, x, f, "sbhd", np.bool_(False), None, None, 1, 0, False, False) is None
    assert crt._public_route("rope", x, x, f, "sbhd", False, None, None, 2**64, 0, False, False) is None
    assert crt._public_route("rope", x, x, f, "sbhd", False, None, None, 2**63, 0, False, False) is None
    with pytest.raises(ValueError, match="`cp_rank`"):  # within int64: the op ran and refused it
        crt._public_route("rope", x, x, f, "sbhd", False, None, None, 1, -2**63, False, False)
    assert crt._public_route("rope", x, x.requires_grad_(True), *args) is None
    monkeypatch.setattr(_torch_ext._state, "on", True, raising=False)
    n = len(calls)
    assert crt._public_route("rope", x, x, f, "bshd", False, None, None, 1, 0, False, False) is None
    assert len(calls) == n


def test_public_route_in_place_and_positions_logic_on_the_cpu(monkeypatch):
    """The public API's in-place q+k calls and its positions API on torch tensors take the same
    route (``_public_route``): a hit is returned as is and an in-place hit bumps the version
    counters; a miss runs the op (an in-place op through its autograd kernel, which bumps them
    too); in-place calls on tensors that require grad stay on the public API's path (which writes
    them without autograd, as before); head_size 0, tables of other types and calls with two
    tables are not routed. CPU tensors stand in for CUDA ones (the ops' CPU kernels run)."""
    import cupy_rope.torch as crt
    from cupy_rope import _launch

    hit = object()
    served, routed, inside = set(), [], []

    def fake_fast(index, *args):
        return (True if index in (1, 3) else hit) if index in served else None

    def route(name, lead, *args):  # re-entered from the op's miss: what resolving_now() says on the GPU
        if inside:
            return None
        routed.append(name)
        inside.append(name)
        try:
            return crt._public_route(name, lead, *args)
        finally:
            inside.pop()

    kind = _launch.cache_kind
    monkeypatch.setattr(crt, "_FAST", fake_fast)
    monkeypatch.setattr(crt, "_FAST_INDEX", {"_rope_impl": 5, "_rope_qk_impl": 0, "rope_qk_": 1,
                                             "_rope_pos_impl": 2, "rope_pos_": 3})
    monkeypatch.setattr(crt, "_plain_cuda", lambda t: True)
    monkeypatch.setattr(_launch, "cache_kind", lambda a: "torch" if isinstance(a, torch.Tensor) else kind(a))
    monkeypatch.setattr(_launch, "NATIVE", route)
    rng = np.random.default_rng(5)
    f = torch.from_numpy(cupy_rope.rope_freqs(64, 16))
    cs = torch.from_numpy(cupy_rope.rope_cos_sin_cache(64, 16))
    sp = torch.from_numpy(rng.integers(0, 8, 2))
    pos = torch.from_numpy(rng.integers(0, 16, 5))
    qkv = torch.from_numpy(rng.standard_normal((8, 2, 3, 4, 64)).astype(np.float32))
    qt = torch.from_numpy(rng.standard_normal((5, 4 * 64)).astype(np.float32))
    kt = torch.from_numpy(rng.standard_normal((5, 2, 64)).astype(np.float32))
    with monkeypatch.context() as m:
        m.setattr(_launch, "NATIVE", None)
        want_qk = cupy_rope.apply_rope_qk(qkv[:, :, 0], qkv[:, :, 1], f, start_positions=sp)
        want_pos = cupy_rope.apply_rope_pos(pos, qt, kt, cos_sin_cache=cs, head_size=64)
        want_q = cupy_rope.apply_rope_pos(pos, qt, None, cos_sin_cache=cs, head_size=64)[0]
    # misses: the ops run (their CPU kernels); in place, the versions bumped
    q, k = qkv.clone()[:, :, 0], qkv.clone()[:, :, 1]
    v0 = (q._version, k._version)
    assert cupy_rope.apply_rope_qk(q, k, f, start_positions=sp, inplace=True) == (q, k)
    assert torch.equal(q, want_qk[0]) and torch.equal(k, want_qk[1])
    assert q._version > v0[0] and k._version > v0[1]
    gq, gk = cupy_rope.apply_rope_pos(pos, qt, kt, cos_sin_cache=cs, head_size=64)
    assert torch.equal(gq, want_pos[0]) and torch.equal(gk, want_pos[1])
    gq, gk = cupy_rope.apply_rope_pos(pos, qt, None, cos_sin_cache=cs, head_size=64)
    assert torch.equal(gq, want_q) and gk is None
    pq, pk = qt.clone(), kt.clone()
    v0 = (pq._version, pk._version)
    assert cupy_rope.apply_rope_pos(pos, pq, pk, cos_sin_cache=cs, head_size=64, inplace=True) == (pq, pk)
    assert torch.equal(pq, want_pos[0]) and torch.equal(pk, want_pos[1])
    assert pq._version > v0[0] and pk._version > v0[1]
    assert routed == ["rope_qk_", "rope_pos", "rope_pos", "rope_pos_"]
    # hits: returned as is (the fake hits write nothing); in place, the versions bumped
    served.update({0, 1, 2, 3})
    pq, pk = qt.clone(), kt.clone()
    v0 = (pq._version, pk._version)
    assert cupy_rope.apply_rope_pos(pos, pq, pk, cos_sin_cache=cs, head_size=64, inplace=True) == (pq, pk)
    assert torch.equal(pq, qt) and pq._version > v0[0] and pk._version > v0[1]
    assert crt._public_route("rope_pos", qt, pos, qt, kt, cs, "cos_sin_cache", 64, False, 0, False) is hit
    v0 = q._version
    assert cupy_rope.apply_rope_qk(q, k, f, start_positions=sp, inplace=True) == (q, k)
    assert torch.equal(q, want_qk[0]) and q._version > v0
    rq = qt.clone().requires_grad_(True)  # in place with grad: handed back even where it would hit
    assert crt._public_route("rope_pos_", rq, pos, rq, None, cs, "cos_sin_cache", 64, False, 0, False) is None
    # not routed, or routed and handed back: the public API's own path, its results and errors
    served.clear()
    del routed[:]
    with pytest.raises(ValueError, match="`head_size`"):
        cupy_rope.apply_rope_pos(pos, qt, kt, cos_sin_cache=cs, head_size=0)
    gq, gk = cupy_rope.apply_rope_pos(pos, qt, kt, cos_sin_cache=cs.numpy(), head_size=64)  # a NumPy table
    assert torch.equal(gq, want_pos[0]) and torch.equal(gk, want_pos[1])
    with pytest.raises(ValueError, match="cos_sin_cache"):
        cupy_rope.apply_rope_pos(pos, qt, kt, cos_sin_cache=cs, freqs=f, head_size=64)
    assert routed == ["rope_pos"]

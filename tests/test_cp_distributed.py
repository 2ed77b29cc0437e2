"""Context parallelism with real process groups: torch.distributed (gloo on CPU tensors; NCCL
across GPUs when there are two or more) and JAX shard_map (4 host devices on the CPU; the GPUs
when there are several). Each rank applies RoPE to its dual-chunk shard with its cp_rank; the
gathered, reordered outputs and input gradients must equal a single-device run."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupy_rope.testing import cp_shard_index  # noqa: E402

WORLD = 2
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _problem(layout, seed=0):
    """Global inputs: x, weights for the loss, freqs, cu_seqlens (thd), start positions."""
    rng = np.random.default_rng(seed)
    d, h = 64, 3
    cu = None
    if layout == "thd":
        lens = np.array([8, 0, 16, 4, 12]) * WORLD  # each divisible by 2 * cp_size
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        shape = (int(cu[-1]), h, d)
        sp = rng.integers(0, 5, len(lens)).astype(np.int32)
        rows = int(lens.max()) + 5
    else:
        s, b = 16, 2
        shape = (s, b, h, d) if layout == "sbhd" else (b, s, h, d)
        sp = rng.integers(0, 5, b).astype(np.int32)
        rows = s + 5
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    w = rng.uniform(-1, 1, shape).astype(np.float32)
    f = rng.uniform(-3, 3, (rows, 1, 1, 48)).astype(np.float32)
    return x, w, f, cu, sp


def _seq_axis(layout):
    return 1 if layout == "bshd" else 0


def _run_rank(rank, layout, backend, port, result_path):
    import torch.distributed as dist

    import cupy_rope.torch as crt

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    dev = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    x, w, f, cu, sp = _problem(layout)
    ax = _seq_axis(layout)
    idx = cp_shard_index(layout, x.shape[ax], WORLD, rank, cu)
    xl = torch.from_numpy(np.take(x, idx, axis=ax)).to(dev).requires_grad_()
    wl = torch.from_numpy(np.take(w, idx, axis=ax)).to(dev)
    kw = dict(layout=layout, start_positions=torch.from_numpy(sp).to(dev), cp_size=WORLD, cp_rank=rank,
              cu_seqlens=None if cu is None else torch.from_numpy(cu).to(dev))
    y = crt.apply_rope(xl, torch.from_numpy(f).to(dev), **kw)
    (y * wl).sum().backward()
    ys = [torch.empty_like(y) for _ in range(WORLD)]
    gs = [torch.empty_like(y) for _ in range(WORLD)]
    dist.all_gather(ys, y.detach().contiguous())
    dist.all_gather(gs, xl.grad.contiguous())
    # packed QKV under cp (sbhd/bshd/thd): q, k, v and the packed gradient
    rng = np.random.default_rng(7)
    qkv = rng.uniform(-1, 1, x.shape[:-2] + (2, 4 * 32)).astype(np.float32)
    ql = torch.from_numpy(np.take(qkv, idx, axis=ax)).to(dev).requires_grad_()
    fq = torch.from_numpy(f[..., :16].copy()).to(dev)
    q, k, v = crt.apply_qkv_rope(ql, fq, fq, split=(64, 32, 32), **kw)
    (q.square().sum() + 2 * k.sum() + v.sum()).backward()
    qg = [torch.empty_like(ql) for _ in range(WORLD)]
    qs = [torch.empty_like(q) for _ in range(WORLD)]
    dist.all_gather(qg, ql.grad.contiguous())
    dist.all_gather(qs, q.detach().contiguous())
    if rank == 0:
        np.savez(result_path, y=[t.cpu().numpy() for t in ys], g=[t.cpu().numpy() for t in gs],
                 qg=[t.cpu().numpy() for t in qg], q=[t.cpu().numpy() for t in qs])
    dist.barrier()  # no rank tears down its connections while another still uses them
    dist.destroy_process_group()
    # leave without C++ static teardown: gloo's threads sometimes abort the interpreter's exit
    # ("terminate called without an active exception") after all results are written
    sys.stdout.flush()
    os._exit(0)


def _unshard(parts, layout, n, cu):
    ax = _seq_axis(layout)
    shape = list(parts[0].shape)
    shape[ax] = n
    out = np.zeros(shape, parts[0].dtype)
    for r, p in enumerate(parts):
        idx = cp_shard_index(layout, n, WORLD, r, cu)
        sl = [slice(None)] * out.ndim
        sl[ax] = idx
        out[tuple(sl)] = p
    return out


def _single_device(layout):
    import cupy_rope.torch as crt

    x, w, f, cu, sp = _problem(layout)
    xt = torch.from_numpy(x).requires_grad_()
    kw = dict(layout=layout, start_positions=torch.from_numpy(sp),
              cu_seqlens=None if cu is None else torch.from_numpy(cu))
    y = crt.apply_rope(xt, torch.from_numpy(f), **kw)
    (y * torch.from_numpy(w)).sum().backward()
    rng = np.random.default_rng(7)
    qkv = torch.from_numpy(rng.uniform(-1, 1, x.shape[:-2] + (2, 4 * 32)).astype(np.float32)).requires_grad_()
    q, k, v = crt.apply_qkv_rope(qkv, torch.from_numpy(f[..., :16].copy()), torch.from_numpy(f[..., :16].copy()),
                                 split=(64, 32, 32), **kw)
    (q.square().sum() + 2 * k.sum() + v.sum()).backward()
    return x, cu, y.detach().numpy(), xt.grad.numpy(), q.detach().numpy(), qkv.grad.numpy()


def _backend():
    if torch.cuda.is_available() and torch.cuda.device_count() >= WORLD:
        return "nccl"
    return "gloo"


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "thd"])
def test_torch_distributed_cp(layout, tmp_path):
    import socket

    import torch.multiprocessing as mp

    backend = _backend()
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "res.npz")
    mp.spawn(_run_rank, args=(layout, backend, port, out), nprocs=WORLD, join=True)
    res = np.load(out)
    x, cu, y1, g1, q1, qg1 = _single_device(layout)
    ax = _seq_axis(layout)
    n = x.shape[ax]
    np.testing.assert_allclose(_unshard(list(res["y"]), layout, n, cu), y1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_unshard(list(res["g"]), layout, n, cu), g1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_unshard(list(res["q"]), layout, n, cu), q1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_unshard(list(res["qg"]), layout, n, cu), qg1, rtol=1e-5, atol=1e-5)


JAX_SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {here!r})
    import numpy as np, jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    import cupy_rope.jax as crj
    from cupy_rope.testing import cp_shard_index
    from test_cp_distributed import _problem, _unshard
    CP = {cp}
    devs = jax.devices()[:CP]
    assert len(devs) == CP, devs
    mesh = Mesh(np.array(devs), ("cp",))
    for layout in ("sbhd", "bshd", "thd"):
        import test_cp_distributed as t
        t.WORLD = CP
        x, w, f, cu, sp = _problem(layout)
        ax = 1 if layout == "bshd" else 0
        n = x.shape[ax]
        # stack each rank's shard along a new leading axis, shard that axis over "cp"
        xs = np.stack([np.take(x, cp_shard_index(layout, n, CP, r, cu), axis=ax) for r in range(CP)])
        ws = np.stack([np.take(w, cp_shard_index(layout, n, CP, r, cu), axis=ax) for r in range(CP)])
        kw = dict(start_positions=jnp.asarray(sp), cu_seqlens=None if cu is None else jnp.asarray(cu))

        def local(xl, wl):
            rank = jax.lax.axis_index("cp")
            def loss(xl):
                y = crj.apply_rope(xl[0], jnp.asarray(f), layout, cp_size=CP, cp_rank=rank, **kw)
                return (y * wl[0]).sum(), y
            (l, y), g = jax.value_and_grad(loss, has_aux=True)(xl)
            return y[None], g

        fn = jax.jit(shard_map(local, mesh=mesh, in_specs=(P("cp"), P("cp")), out_specs=(P("cp"), P("cp"))))
        y, g = fn(jnp.asarray(xs), jnp.asarray(ws))
        y1 = crj.apply_rope(jnp.asarray(x), jnp.asarray(f), layout, **kw)
        g1 = crj.apply_rope_backward(jnp.asarray(w), jnp.asarray(f), layout, **kw)
        np.testing.assert_allclose(_unshard(list(np.asarray(y)), layout, n, cu), np.asarray(y1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(_unshard(list(np.asarray(g)[:, ...].reshape((CP,) + xs.shape[1:])), layout, n, cu),
                                   np.asarray(g1), rtol=1e-5, atol=1e-5)
        print(layout, "ok on", [d.platform for d in devs])
""")


def test_jax_shard_map_cp():
    pytest.importorskip("jax")
    cp = 4
    env = dict(os.environ)
    gpus = 0
    try:
        gpus = torch.cuda.device_count()
    except Exception:
        pass
    if gpus >= 2:
        cp = 2 if gpus < 4 else 4
    else:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
        env["JAX_PLATFORMS"] = "cpu"
    code = JAX_SCRIPT.format(root=ROOT, here=HERE, cp=cp)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("ok on") == 3, r.stdout

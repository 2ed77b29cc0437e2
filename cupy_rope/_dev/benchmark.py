"""Benchmark suite (GPU): cupy_rope against a device-to-device copy of the same bytes and
against its peers, per shape, forward and backward.

    python -m cupy_rope bench [--quick] [--json FILE] [--md FILE] [--rows 1,2,...] [--no-peers]
    python benchmarks/run.py ...              (same)

* **device** time: CUDA-graph replay of many launches over rotating input buffers (together
  several times the 60 MB L2), divided by the launch count: the kernel alone.
* **eager** time: wall time of many back-to-back Python calls, one synchronisation at the end,
  divided by the call count: what a training step outside a graph sees (host work hidden
  behind the kernel when the kernel is longer).
* **copy**: ``dst.copy_(src)`` of a buffer holding the bytes the operation must move
  (input read once, output written once, the angle rows used once), timed the same way.
* peers, each in its native layout, checked against cupy_rope's result first (``WRONG`` if
  not within bf16 tolerance, then not timed): torch eager (TE/HF unfused formula with cos/sin
  pre-cast to the input dtype and pre-gathered per token), ``torch.compile`` of the same
  function, JAX ``jit`` of the jnp formula, Liger-Kernel (``rope_forward``/``rope_backward``)
  where installed. A peer that cannot express a row prints ``n/a``. Peers' backward is their
  own backward (Liger) or the transposed formula (sin negated; exact for standard tables).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

L2_BYTES = 60 * 2**20


def gpu_missing() -> str:
    """Why the suite cannot run here ('' when a CUDA GPU is visible to CuPy and torch)."""
    try:
        import cupy

        if not (cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0):
            return "CuPy finds no CUDA device"
    except Exception as e:
        return f"CuPy unavailable: {type(e).__name__}"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return "" if torch.cuda.is_available() else "torch has no CUDA device (a CPU build?)"


# ----------------------------------------------------------------------------- timing
def graph_time(fns, reps=15):
    """Median device µs per function call, from CUDA-graph replays of ``fns`` in order."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(fns))
    del g
    return float(np.median(times))


def event_time(fns, reps=7):
    """Median device µs per call from events around back-to-back launches (no graph)."""
    import torch

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for fn in fns:
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(fns))
    return float(np.median(times))


def eager_time(fns, rounds=5, sync=None, min_calls=64):
    """Median wall µs per call of back-to-back calls, one synchronisation per round.

    Each round makes at least ``min_calls`` calls (``fns`` repeated), so that the round's first
    launch and final synchronisation are amortised as in a training loop.
    ``sync(last_result)`` waits for the work (default: ``torch.cuda.synchronize``)."""
    import torch

    sync = sync or (lambda _: torch.cuda.synchronize())
    fns = list(fns) * max(1, -(-min_calls // max(len(fns), 1)))
    last = None
    for fn in fns:
        last = fn()
    sync(last)
    res = []
    for _ in range(rounds):
        t = time.perf_counter()
        for fn in fns:
            last = fn()
        sync(last)
        res.append((time.perf_counter() - t) * 1e6 / len(fns))
    return float(np.median(res))


def _jax_sync(last):
    import jax

    jax.block_until_ready(last)


# ----------------------------------------------------------------------------- problems
SHAPES = [
    (1, "sbhd 4096x2x32x128", dict(layout="sbhd", shape=(4096, 2, 32, 128))),
    (2, "bshd 2x8192x8x128", dict(layout="bshd", shape=(2, 8192, 8, 128))),
    (3, "thd 32768 tok/16 seq h32", dict(layout="thd", tokens=32768, nseq=16, heads=32, d=128)),
    (4, "thd 65536 tok/1024 seq h16", dict(layout="thd", tokens=65536, nseq=1024, heads=16, d=128)),
    (5, "sbhd d2=64 interleaved", dict(layout="sbhd", shape=(4096, 2, 32, 128), d2=64, interleaved=True)),
    (6, "sbhd 2048x4x16x64 fp32", dict(layout="sbhd", shape=(2048, 4, 16, 64), dtype="float32")),
    (7, "sbhd 4096x2x32x80", dict(layout="sbhd", shape=(4096, 2, 32, 80))),
    (8, "sbhd cp_size=4 rank 1", dict(layout="sbhd", shape=(4096, 2, 32, 128), cp=(4, 1))),
    (9, "QKV sbhd 8 grp x 4 q", dict(layout="sbhd", qkv=(4096, 2, 8, 4, 128))),
    (10, "decode bshd 64x1x32x128", dict(layout="bshd", shape=(64, 1, 32, 128), decode=True)),
    # the positions API (serving): q [t, 32*128] and k [t, 8*128] bf16 in place, per-token positions,
    # a float32 cos/sin cache [8192, 128] (FlashInfer's layout); "bwd" is inverse=True
    (11, "serve decode 64 tok 32q+8kv pos+cache", dict(serving=(64, 32, 8, 128))),
    (12, "serve prefill 16K tok 32q+8kv pos+cache", dict(serving=(16384, 32, 8, 128))),
    # row 11 with int32 positions (FlashInfer's pos_ids are often int32)
    (13, "serve decode 64 tok 32q+8kv int32 pos+cache", dict(serving=(64, 32, 8, 128), pos_dtype="int32")),
]
SERVING_ROWS = tuple(i for i, _, spec in SHAPES if spec.get("serving"))


class Problem:
    """Rotating inputs, the angle table and keyword arguments for one row (torch tensors)."""

    def __init__(self, spec, nbuf=None):
        import torch

        import cupy_rope

        self.spec = spec
        dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[spec.get("dtype", "bfloat16")]
        self.dtype = dt
        dev = "cuda"
        g = torch.Generator(device=dev).manual_seed(0)
        kw = dict(layout=spec["layout"], interleaved=spec.get("interleaved", False))
        self.qkv = spec.get("qkv")
        anchor = torch.empty(0, device=dev)
        if self.qkv:
            s, b, grp, n, d = self.qkv
            shape = (s, b, grp, (n + 2) * d)
            self.split = (n * d, d, d)
            f = cupy_rope.rope_freqs(d, s, like=anchor)
            self.positions = torch.arange(s, device=dev)[:, None].expand(s, b)
        elif spec["layout"] == "thd":
            tok, nseq, h, d = spec["tokens"], spec["nseq"], spec["heads"], spec["d"]
            rng = np.random.default_rng(0)
            w = rng.uniform(0.2, 1.8, nseq)
            lens = np.floor(w / w.sum() * tok).astype(np.int64)
            lens[-1] += tok - lens.sum()
            cu = np.concatenate([[0], np.cumsum(lens)])
            kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=dev)
            shape = (tok, h, d)
            f = cupy_rope.rope_freqs(d, int(lens.max()), like=anchor)
            self.positions = torch.tensor(np.concatenate([np.arange(n) for n in lens]), device=dev)
        else:
            shape = spec["shape"]
            cp_size, cp_rank = spec.get("cp", (1, 0))
            kw.update(cp_size=cp_size, cp_rank=cp_rank)
            d = shape[-1]
            d2 = spec.get("d2", d)
            s = shape[0] if spec["layout"] == "sbhd" else shape[1]
            b = shape[1] if spec["layout"] == "sbhd" else shape[0]
            rows = s * cp_size
            sp = None
            if spec.get("decode"):
                sp = torch.randint(0, 4000, (b,), dtype=torch.int32, device=dev)
                kw["start_positions"] = sp
                rows = 4096
            self.positions = torch.tensor(_positions_of(spec["layout"], shape, cp_size, cp_rank, sp), device=dev)
            f = cupy_rope.rope_freqs(d2, rows, like=anchor, interleaved=kw["interleaved"])
        self.shape, self.freqs, self.kw = shape, f, kw
        esz = torch.tensor([], dtype=dt).element_size()
        per = math.prod(shape) * esz
        self.nbuf = nbuf or max(2, min(16, math.ceil(3 * L2_BYTES / max(per, 1))))
        self.xs = [torch.empty(shape, dtype=dt, device=dev).uniform_(-1, 1, generator=g) for _ in range(self.nbuf)]
        n_tok = math.prod(shape[:-2])
        self.bytes = 2 * per + min(f.numel(), n_tok * f.shape[-1]) * 4
        self.per = per


def _positions_of(layout, shape, cp_size, cp_rank, sp=None):
    """Every token's position (the library's own definition, cupy_rope._positions)."""
    from .._plan import resolve_positions, split_tokens
    from .._positions import token_positions

    tokens_shape = split_tokens(layout, shape)[2]
    pos = resolve_positions(layout, tokens_shape, {}, None, None, cp_size, cp_rank)
    return token_positions(np, pos, tuple(shape[:-2]), None, None if sp is None else sp.cpu().numpy())[0]


_COPY_SRC = r"""
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = src[i];
}
"""


def copy_time(nbytes, nbuf, idx):
    """Device µs of the best device-to-device copy of ``nbytes`` read+written (half each way):
    ``cudaMemcpyAsync`` (``Tensor.copy_``) or a 16-byte-vector SM copy kernel, whichever is faster."""
    import torch

    half = max((nbytes // 2 + 15) // 16 * 16, 16)
    src = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(nbuf)]
    dst = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(nbuf)]
    t_memcpy = graph_time([lambda i=i: dst[i].copy_(src[i]) for i in idx])
    kcopy = copy_kernel(half)
    t_kernel = graph_time([lambda i=i: kcopy(src[i], dst[i]) for i in idx])
    return (t_memcpy, "cudaMemcpy") if t_memcpy <= t_kernel else (t_kernel, "copy kernel")


def copy_kernel(nbytes):
    """``fn(src, dst)``: the 16-byte-vector SM copy of ``nbytes`` (a multiple of 16) between two
    torch CUDA tensors, launched on torch's current stream."""
    import cupy
    import torch

    kern = cupy.RawKernel(_COPY_SRC, "copy16")
    n16 = nbytes // 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = min(-(-n16 // 256), sms * 8)

    def run(src, dst):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        kern((grid,), (256,), (src.data_ptr(), dst.data_ptr(), np.int64(n16)), stream=stream)

    return run


def _ours(p, direction, fw):
    """List-of-callables factory for cupy_rope on rotating buffers through entry point ``fw``."""
    import torch

    import cupy_rope

    conv = (lambda t: t)
    if fw == "cupy":
        import cupy

        conv = cupy.from_dlpack
    elif fw == "jax":
        import jax
        import jax.dlpack

        import cupy_rope.jax as crj

        conv = jax.dlpack.from_dlpack
        jf, jkw = conv(p.freqs), {k: (conv(v) if isinstance(v, torch.Tensor) else v) for k, v in p.kw.items()}
        arrays = {k: v for k, v in jkw.items() if not isinstance(v, (bool, int, str))}
        static = {k: v for k, v in jkw.items() if isinstance(v, (bool, int, str))}
        xs = [conv(x) for x in p.xs]
        if p.qkv:
            if direction == "bwd":
                raise NotImplementedError("JAX QKV backward row not timed")
            fn = jax.jit(lambda x, f, a: crj.apply_qkv_rope(x, f, f, p.split, **static, **a))
        else:
            api = crj.apply_rope if direction == "fwd" else crj.apply_rope_backward
            fn = jax.jit(lambda x, f, a: api(x, f, **static, **a))
        return lambda i: fn(xs[i], jf, arrays)
    f = conv(p.freqs)
    kw = {k: (conv(v) if isinstance(v, torch.Tensor) else v) for k, v in p.kw.items()}
    if p.qkv:
        if direction == "fwd":
            xs = [conv(x) for x in p.xs]
            fn = cupy_rope.apply_qkv_rope
            return lambda i: fn(xs[i], f, f, p.split, **kw)
        q, k, v = cupy_rope.apply_qkv_rope(p.xs[0], p.freqs, p.freqs, p.split, **p.kw)
        grads = [tuple(conv(torch.empty_like(t).uniform_(-1, 1)) for t in (q, k, v)) for _ in range(p.nbuf)]
        return lambda i: cupy_rope.apply_qkv_rope_backward(*grads[i], f, f, p.split, **kw)
    xs = [conv(x) for x in p.xs]
    fn = cupy_rope.apply_rope if direction == "fwd" else cupy_rope.apply_rope_backward
    return lambda i: fn(xs[i], f, **kw)


# ----------------------------------------------------------------------------- peers
def _cos_sin(p):
    """Per-token cos/sin, pre-gathered and pre-cast to the input dtype (HF/TE unfused)."""
    f = p.freqs.reshape(p.freqs.shape[0], -1)
    ang = f[p.positions]  # token dims + (d2,)
    return ang.cos().to(p.dtype).unsqueeze(-2), ang.sin().to(p.dtype).unsqueeze(-2)


def torch_formula(x, cos, sin, interleaved):
    import torch

    d2 = cos.shape[-1]
    xr = x[..., :d2]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack([-x2, x1], -1).flatten(-2)
    else:
        x1, x2 = xr[..., : d2 // 2], xr[..., d2 // 2:]
        rot = torch.cat([-x2, x1], -1)
    y = xr * cos + rot * sin
    return torch.cat([y, x[..., d2:]], -1) if d2 < x.shape[-1] else y


def _peer_fns(p, direction):
    """{peer name: (callable(i) or None for n/a)} for the torch-side peers."""
    import torch

    out = {}
    if p.qkv:
        return {"torch eager": None, "torch.compile": None, "JAX jit": None, "Liger": None}
    cos, sin = _cos_sin(p)
    if direction == "bwd":
        sin = -sin
    il = p.kw["interleaved"]
    out["torch eager"] = lambda i: torch_formula(p.xs[i], cos, sin, il)
    compiled = torch.compile(torch_formula, dynamic=False)
    out["torch.compile"] = lambda i: compiled(p.xs[i], cos, sin, il)
    try:
        import jax
        import jax.dlpack
        import jax.numpy as jnp

        jc, js = jax.dlpack.from_dlpack(cos), jax.dlpack.from_dlpack(sin)
        jxs = [jax.dlpack.from_dlpack(x) for x in p.xs]

        @jax.jit
        def jf(x, c, s):
            d2 = c.shape[-1]
            xr = x[..., :d2]
            if il:
                x1, x2 = xr[..., 0::2], xr[..., 1::2]
                rot = jnp.stack([-x2, x1], -1).reshape(xr.shape)
            else:
                rot = jnp.concatenate([-xr[..., d2 // 2:], xr[..., : d2 // 2]], -1)
            y = xr * c + rot * s
            return jnp.concatenate([y, x[..., d2:]], -1) if d2 < x.shape[-1] else y

        out["JAX jit"] = ("jax", lambda i: jf(jxs[i], jc, js))
    except Exception:
        out["JAX jit"] = None
    out["Liger"] = _liger(p, direction, cos, sin)
    return out


def _liger(p, direction, cos, sin):
    """Liger-Kernel's Triton rope on its native layout: q as a [b, h, s, d] view of bshd storage
    (sbhd rows get bshd copies made up front, not timed), cos/sin [b, s, d]. Liger rotates q and k
    in place in one launch; k is a separate one-head tensor (1/h extra bytes, counted against it).
    The result is returned in the row's own layout for the correctness check."""
    try:
        import torch
        from liger_kernel.ops.rope import rope_backward, rope_forward
    except Exception:
        return None
    if p.kw["interleaved"] or p.freqs.shape[-1] != p.shape[-1] or p.spec["layout"] == "thd" \
            or p.spec.get("cp") or p.spec.get("decode"):
        return None  # Liger: rotate-half, full rotary, position-aligned cos/sin only
    lay = p.spec["layout"]
    store = [x.transpose(0, 1).contiguous() if lay == "sbhd" else x for x in p.xs]  # bshd storage
    qs = [x.transpose(1, 2) for x in store]  # [b, h, s, d]
    b, s, _, d = store[0].shape
    ks = [torch.empty((b, s, 1, d), dtype=p.dtype, device="cuda").uniform_(-1, 1).transpose(1, 2)
          for _ in store]
    c = cos.squeeze(-2)
    sn = sin.squeeze(-2) if direction == "fwd" else -sin.squeeze(-2)
    if lay == "sbhd":
        c, sn = c.transpose(0, 1), sn.transpose(0, 1)
    c, sn = c.contiguous(), sn.contiguous()
    op = rope_forward if direction == "fwd" else rope_backward
    back = (lambda q: q.permute(2, 0, 1, 3)) if lay == "sbhd" else (lambda q: q.transpose(1, 2))
    return lambda i: back(op(qs[i], ks[i], c, sn)[0])


def _close(a, b):
    import torch

    a, b = a.float(), b.float()
    return bool(torch.allclose(a, b, rtol=2e-2, atol=2e-2))


def _time_peer(fn, ref, idx, copy_us):
    """Check a peer against cupy_rope's result, then time it (JAX: wall time as device time)."""
    import torch

    is_jax = isinstance(fn, tuple)
    call = fn[1] if is_jax else fn
    got = call(0)
    if is_jax:
        got = torch.from_dlpack(got)
        torch.cuda.synchronize()
    if not _close(got, ref):
        return "WRONG"
    fns = [lambda i=i: call(i) for i in idx]
    if is_jax:  # JAX runs on XLA's stream: torch events do not see it; report wall time
        eager = eager_time(fns, sync=_jax_sync)
        dev = eager
    else:
        try:
            dev = graph_time(fns)
        except Exception:
            dev = event_time(fns)
        eager = eager_time(fns)
    return dict(device_us=dev, eager_us=eager, pct_copy=100 * copy_us / dev)


def vllm_native(positions, q, k, cache, head_size):
    """vLLM's ``forward_native`` rotate-half formula (gather cos/sin rows, cast, rotate): the peer
    of the serving rows, eager and under torch.compile."""
    import torch

    cs = cache.index_select(0, positions)
    cos, sin = cs.chunk(2, dim=-1)
    out = []
    for x in (q, k):
        xv = x.view(x.shape[0], -1, head_size)
        c, s_ = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x1, x2 = xv.chunk(2, dim=-1)
        out.append(torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_), dim=-1).reshape(x.shape))
    return out


def serving_inputs(spec):
    """A positions-API row's inputs (torch, CUDA): ``(pos, qs, ks, cache, d, per)``, ``qs``/``ks``
    the buffers the timed calls rotate in turn (enough to leave the L2 cold), ``per`` the bytes of
    one q and k."""
    import torch

    import cupy_rope

    t, hq, hk, d = spec["serving"]
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    cache = cupy_rope.rope_cos_sin_cache(d, 8192, like=torch.empty(0, device=dev))
    per = t * (hq + hk) * d * 2
    nbuf = max(2, min(16, math.ceil(3 * L2_BYTES / per)))
    qs = [torch.empty(t, hq * d, dtype=dt, device=dev).uniform_(-1, 1, generator=g) for _ in range(nbuf)]
    ks = [torch.empty(t, hk * d, dtype=dt, device=dev).uniform_(-1, 1, generator=g) for _ in range(nbuf)]
    pos = torch.randint(0, 8192, (t,), device=dev, generator=g).to(getattr(torch, spec.get("pos_dtype", "int64")))
    return pos, qs, ks, cache, d, per


def run_serving_row(rid, desc, spec, quick=False, peers=True):
    """A positions-API row: q and k rotated in place in one launch (fwd), or by the inverse (bwd)."""
    import torch

    import cupy_rope

    pos, qs, ks, cache, d, per = serving_inputs(spec)
    t, nbuf = pos.shape[0], len(qs)
    nbytes = 2 * per + t * d * 4  # q and k read and written, one float32 cache row per token
    n_launch = nbuf * max(1, (4 if quick else 12) // nbuf) if per > 2**20 else (100 if quick else 400)
    idx = [i % nbuf for i in range(n_launch)]
    row = dict(id=rid, shape=desc, bytes=nbytes, dtype="bfloat16")
    row["copy_us"], row["copy_kind"] = copy_time(nbytes, nbuf, idx)
    import cupy

    cq, ck, cpos, ccache = ([cupy.from_dlpack(a) for a in qs], [cupy.from_dlpack(a) for a in ks],
                            cupy.from_dlpack(pos), cupy.from_dlpack(cache))
    for direction in ("fwd", "bwd"):
        inv = direction == "bwd"
        kw = dict(head_size=d, inverse=inv, inplace=True)
        r = {}

        def ours(i):
            return cupy_rope.apply_rope_pos(pos, qs[i], ks[i], cos_sin_cache=cache, **kw)

        r["device_us"] = graph_time([lambda i=i: ours(i) for i in idx])
        r["pct_copy"] = 100 * row["copy_us"] / r["device_us"]
        r["gbps"] = nbytes / r["device_us"] / 1e3
        r["eager_torch_us"] = eager_time([lambda i=i: ours(i) for i in idx])
        r["eager_cupy_us"] = eager_time([lambda i=i: cupy_rope.apply_rope_pos(
            cpos, cq[i], ck[i], cos_sin_cache=ccache, **kw) for i in idx])
        if peers:
            ref = cupy_rope.apply_rope_pos(pos, qs[0], ks[0], cos_sin_cache=cache, head_size=d, inverse=inv)[0]
            c = cache if not inv else torch.cat([cache[:, : d // 2], -cache[:, d // 2:]], dim=1)
            compiled = torch.compile(vllm_native, dynamic=False)
            r["peers"] = {
                "torch eager": _time_peer(lambda i: vllm_native(pos, qs[i], ks[i], c, d)[0], ref, idx, row["copy_us"]),
                "torch.compile": _time_peer(lambda i: compiled(pos, qs[i], ks[i], c, d)[0], ref, idx, row["copy_us"]),
                "JAX jit": "n/a", "Liger": "n/a"}
        row[direction] = r
    return row


def run_row(rid, desc, spec, quick=False, peers=True):
    if spec.get("serving"):
        return run_serving_row(rid, desc, spec, quick, peers)
    p = Problem(spec)
    n_launch = p.nbuf * max(1, (4 if quick else 12) // p.nbuf) if p.per > 2**20 else (100 if quick else 400)
    idx = [i % p.nbuf for i in range(n_launch)]
    row = dict(id=rid, shape=desc, bytes=p.bytes, dtype=str(p.dtype).replace("torch.", ""))
    row["copy_us"], row["copy_kind"] = copy_time(p.bytes, p.nbuf, idx)
    ours_torch = {}  # direction -> cupy_rope through torch, the peers' reference
    for direction in ("fwd", "bwd"):
        r = {}
        ours = {fw: _ours(p, direction, fw) for fw in ("torch", "cupy")}
        ours_torch[direction] = ours["torch"]
        r["device_us"] = graph_time([lambda i=i: ours["torch"](i) for i in idx])
        r["pct_copy"] = 100 * row["copy_us"] / r["device_us"]
        r["gbps"] = p.bytes / r["device_us"] / 1e3
        r["eager_torch_us"] = eager_time([lambda i=i: ours["torch"](i) for i in idx])
        r["eager_cupy_us"] = eager_time([lambda i=i: ours["cupy"](i) for i in idx])
        if rid == 10 or not quick:
            try:
                jfn = _ours(p, direction, "jax")
                r["eager_jax_us"] = eager_time([lambda i=i: jfn(i) for i in idx], sync=_jax_sync)
            except Exception as e:  # pragma: no cover
                r["eager_jax_us"] = None
                r["jax_error"] = repr(e)[:200]
        row[direction] = r
    # The peers run after both of cupy_rope's directions are timed: timed after the forward's peers,
    # cupy_rope's thd backward read 10% slower than in a run without peers (benchmarks/NOTES.md).
    for direction in ("fwd", "bwd") if peers else ():
        ref = ours_torch[direction](0)
        ref = ref[0] if isinstance(ref, tuple) else ref
        pr = {}
        for name, fn in _peer_fns(p, direction).items():
            if fn is None:
                pr[name] = "n/a"
                continue
            try:
                pr[name] = _time_peer(fn, ref, idx, row["copy_us"])
            except Exception as e:  # a peer failing to run is reported, not fatal
                pr[name] = f"error: {type(e).__name__}: {str(e)[:120]}"
        row[direction]["peers"] = pr
    return row


def first_call_times():
    """Seconds to the first result in a fresh process: empty kernel cache, then warm cache."""
    import tempfile

    code = ("import time; t=time.perf_counter(); import cupy, cupy_rope; "
            "x=cupy.ones((16,2,4,64),cupy.float32); f=cupy.asarray(cupy_rope.rope_freqs(64,16)); "
            "cupy_rope.apply_rope(x,f); cupy.cuda.runtime.deviceSynchronize(); print(time.perf_counter()-t)")
    out = {}
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, CUPY_CACHE_DIR=d, PYTHONPATH=os.pathsep.join(sys.path))
        for label in ("cold_cache_s", "warm_cache_s"):
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            out[label] = float(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else r.stderr[-300:]
    return out


def _fmt(v):
    if isinstance(v, str):
        return v
    if v is None:
        return "-"
    return f"{v:.1f}"


def markdown(rows):
    head = ("| # | shape | copy µs | cupy_rope device µs fwd / bwd | % of copy fwd / bwd | GB/s fwd | "
            "eager µs cupy fwd / bwd | eager µs torch fwd / bwd | eager µs JAX fwd |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        f, b = r["fwd"], r["bwd"]
        lines.append(
            f"| {r['id']} | {r['shape']} | {r['copy_us']:.1f} | {f['device_us']:.1f} / {b['device_us']:.1f} | "
            f"{f['pct_copy']:.0f}% / {b['pct_copy']:.0f}% | {f['gbps']:.0f} | "
            f"{f['eager_cupy_us']:.1f} / {b['eager_cupy_us']:.1f} | {f['eager_torch_us']:.1f} / {b['eager_torch_us']:.1f} | "
            f"{_fmt(f.get('eager_jax_us'))} |")
    peer_names = []
    for r in rows:
        for name in r["fwd"].get("peers", {}):
            if name not in peer_names:
                peer_names.append(name)
    if peer_names:
        lines += ["", "Peers, device µs fwd / bwd (% of copy fwd); eager µs fwd:", "",
                  "| # | " + " | ".join(peer_names) + " |", "|" + "---|" * (len(peer_names) + 1)]
        for r in rows:
            cells = []
            for name in peer_names:
                pf, pb = r["fwd"].get("peers", {}).get(name), r["bwd"].get("peers", {}).get(name)
                if isinstance(pf, dict):
                    bdev = pb["device_us"] if isinstance(pb, dict) else None
                    cells.append(f"{pf['device_us']:.1f} / {_fmt(bdev if bdev is not None else pb)} "
                                 f"({pf['pct_copy']:.0f}%); {pf['eager_us']:.0f}")
                else:
                    cells.append(str(pf))
            lines.append(f"| {r['id']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, path):
    """PNG: % of copy bandwidth per shape for cupy_rope (fwd, bwd) and each peer (fwd)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {"cupy_rope fwd": [r["fwd"]["pct_copy"] for r in rows],
              "cupy_rope bwd": [r["bwd"]["pct_copy"] for r in rows]}
    for i, r in enumerate(rows):
        for name, pv in r["fwd"].get("peers", {}).items():
            series.setdefault(f"{name} fwd", [0.0] * len(rows))[i] = pv["pct_copy"] if isinstance(pv, dict) else 0.0
    fig, ax = plt.subplots(figsize=(12, 4.5))
    w = 0.8 / len(series)
    for j, (name, vals) in enumerate(series.items()):
        ax.bar([i + j * w for i in range(len(rows))], vals, w, label=name)
    ax.axhline(100, color="k", lw=0.8)
    ax.set_ylabel("% of device-to-device copy bandwidth")
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{r['id']}: {r['shape']}" for r in rows], rotation=30, ha="right", fontsize=8)
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("RoPE device time vs a copy of the same bytes (H200; higher is better, 0 = n/a)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --tune keys: the work split's constants (cupy_rope._worksplit, each an int but MIXED, 0 or 1) and
# DEFINES, the kernel build's extra defines
_TUNE_INTS = ("THREADS_PER_SM", "MAX_VEC_BYTES", "ONE_ROW_BLOCK", "ONE_ROW_ANGLE_VEC", "MIXED", "ODD_UNITS_FACTOR",
              "ODD_UNITS_MIN_ROWS", "SHARE_SINCOS", "NARROW_THREADS_PER_SM", "NARROW_SHARED_THREADS_PER_SM", "TWO_ROWS",
              "LEAN", "LEAN_MIN_HEADS", "LEAN_MAX_SEQS", "LEAN_MAX_FAST_SEQS", "LEAN_MIN_SEQ_TOKENS")
_TUNE_BOOLS = ("MIXED", "SHARE_SINCOS", "TWO_ROWS", "LEAN")


def apply_tuning(spec: str, ap) -> None:
    """Set the library's tuning constants for this process (benchmark variants; never the default)."""
    from .. import _kernels, _worksplit

    for item in filter(None, spec.split(",")):
        key, _, val = item.partition("=")
        if key in _TUNE_INTS:
            setattr(_worksplit, f"_{key}", bool(int(val)) if key in _TUNE_BOOLS else int(val))
        elif key == "DEFINES":
            _kernels.DEFINES = tuple(v for v in val.split(";") if v)
        else:
            ap.error(f"--tune: unknown {key!r}, expected one of {', '.join(_TUNE_INTS)} or DEFINES")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cupy_rope bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write all numbers to this JSON file")
    ap.add_argument("--md", help="write the Markdown tables to this file")
    ap.add_argument("--quick", action="store_true", help="fewer launches per measurement")
    ap.add_argument("--rows", default="", help="comma-separated row ids (default: all)")
    ap.add_argument("--no-peers", action="store_true", help="time cupy_rope and the copy only")
    ap.add_argument("--plot", help="write a PNG of %% of copy bandwidth per shape")
    ap.add_argument("--tune", default="", help="tuning variant, this process only: comma-separated "
                    "THREADS_PER_SM=N, MAX_VEC_BYTES=N (0: 16), ONE_ROW_BLOCK=N, ONE_ROW_ANGLE_VEC=N (0: any), "
                    "MIXED=0|1, ODD_UNITS_FACTOR=N, ODD_UNITS_MIN_ROWS=N, SHARE_SINCOS=0|1, NARROW_THREADS_PER_SM=N, "
                    "NARROW_SHARED_THREADS_PER_SM=N, TWO_ROWS=0|1, LEAN=0|1, LEAN_MIN_HEADS=N, LEAN_MAX_SEQS=N, "
                    "LEAN_MAX_FAST_SEQS=N, LEAN_MIN_SEQ_TOKENS=N, DEFINES=-DNAME=V;-DNAME=V (kernel build)")
    a = ap.parse_args(argv)
    apply_tuning(a.tune, ap)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    why = gpu_missing()
    if why:
        print(f"cupy_rope bench: the benchmark suite needs a CUDA GPU visible to CuPy and to torch ({why}); "
              "`python -m cupy_rope` prints a CPU table.", file=sys.stderr)
        raise SystemExit(2)
    import torch

    want = {int(v) for v in a.rows.split(",") if v}
    rows = []
    for rid, desc, spec in SHAPES:
        if want and rid not in want:
            continue
        t = time.perf_counter()
        rows.append(run_row(rid, desc, spec, a.quick, peers=not a.no_peers))
        print(f"[bench] row {rid} ({time.perf_counter() - t:.0f} s): fwd {rows[-1]['fwd']['pct_copy']:.0f}% "
              f"bwd {rows[-1]['bwd']['pct_copy']:.0f}% of copy", file=sys.stderr, flush=True)
    first = first_call_times()
    md = markdown(rows) + f"\n\nFirst call in a fresh process: {first}\n"
    print(md)
    env = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
               command="python -m cupy_rope bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    try:
        import cupy

        env["cupy"] = cupy.__version__
        import jax

        env["jax"] = jax.__version__
    except Exception:
        pass
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(env=env, rows=rows, first_call=first), fh, indent=1)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(md)
    if a.plot:
        plot(rows, a.plot)
    return rows


if __name__ == "__main__":
    main()

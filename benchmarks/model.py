"""End-to-end and per-call benchmarks: does swapping cupy_rope into a model make it faster?

The model (per layer): ``qkv = x @ W_qkv`` viewed as ``[b, s, 3, h, d]``, RoPE on the q and k
views (strided, no copies), causal attention (``F.scaled_dot_product_attention`` /
``jax.nn.dot_product_attention``), output projection, residual; bf16. Written twice in the same
framework and mode: with the plain formula (``x*cos + rotate_half(x)*sin``, cos/sin tables in
the model's dtype gathered at the positions, as model code writes it) and with cupy_rope (torch:
``cupy_rope.torch.apply_rope_qk`` on the two views; JAX: ``cupy_rope.jax.apply_rope_qk_fused``
on the unsliced projection, with ``return_v=True``: v from the same call). Decode steps pass
per-sequence positions (``start_positions``).
A third torch variant, ``cupy_rope_cache``, is the serving engines' form: per-token positions and
a cos/sin cache in the model's dtype (``cupy_rope.torch.apply_rope_pos(positions, q, k,
cos_sin_cache=...)``, the cache from ``rope_cos_sin_cache``), no sine or cosine in the kernel.

Constant tables (the formula's cos/sin, cupy_rope's angle table from ``rope_freqs``, the decode
positions) and the weights are marked static for CUDA-graph trees in both variants, as torch marks
a model's registered buffers and parameters (unmarked, each replay copied every weight into the
graph first: about half of a reduce-overhead decode step's device time, in both variants).

Modes: torch eager, ``torch.compile`` and ``torch.compile(mode="reduce-overhead")`` (each layer
compiled, the compiled layer reused by every layer: regional compilation), JAX ``jit``; kinds:
``infer`` (forward, no grad) and ``train`` (forward + backward of a scalar loss, gradients of the
weights and the input). Time per step: median over rounds of back-to-back steps, one
synchronisation per round, Python's garbage collector off while a round runs; the variants'
rounds interleaved, so that the host's speed, which sets the time of host-bound steps, drifts
alike for all. Each variant's layer is its own code object, compiled as if it were the only one.

Per call (``--percall``): host cost of each entry point at the decode shape ``[1, 64, 32, 128]``
bf16 with offsets, against the formula in the same framework and mode (their rounds interleaved),
and the raw launch cost of ``cupy.RawKernel`` against CuPy's binding of ``cuLaunchKernel``,
libcuda's ``cuLaunchKernel`` and ``cuLaunchKernelEx`` with the programmatic attribute through
ctypes (the library's Python launch), and cuda-bindings' ``cuda.bindings.driver.cuLaunchKernel``
(where installed) on a prepared argument block.

    python benchmarks/model.py --json benchmarks/results/h200_model.json
    python benchmarks/model.py --configs decode --modes eager --kinds infer   # a subset
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

CONFIGS = {
    "prefill": dict(b=8, s=128, h=8, d=128, layers=8, decode=False),
    "train": dict(b=2, s=2048, h=16, d=128, layers=8, decode=False),
    "decode": dict(b=64, s=1, h=32, d=128, layers=16, decode=True),
}
MODES = ("eager", "compile", "reduce-overhead", "jit")
# JAX's cupy_rope: the fused entry with return_v and heads_major (q and k stored in the order of
# XLA's attention). cupy_rope_row_major: without heads_major; cupy_rope_sliced_v: without either,
# v sliced from the projection by the model (its gradient added to the entry's by XLA): what each
# option saves, in the same run.
EXTRA = {"cupy_rope_cache": "cache", "cupy_rope_row_major": "row_major", "cupy_rope_sliced_v": "sliced_v"}
VARIANTS = {"torch": ("formula", "cupy_rope", "cupy_rope_cache"),
            "jax": ("formula", "cupy_rope", "cupy_rope_row_major", "cupy_rope_sliced_v")}
DEVICE = "cuda"  # torch models' device (a CPU run is a smoke test of the code, not a benchmark)
KINDS = ("infer", "train")
MAX_POS = 4096
PROBE_ROPES: dict = {}  # more torch variants: name -> f(freqs, start_positions) -> rope(q, k) -> (q, k)


def _per_call(fn, sync, calls, rounds, warm=3):
    """Median seconds per call over ``rounds`` rounds of ``calls`` back-to-back calls, one
    synchronisation per round; Python's cyclic garbage collector off while they run (as
    ``timeit`` does: a collection that lands in one variant's round otherwise moved host-bound
    steps apart between variants, benchmarks/NOTES.md)."""
    if warm:
        for _ in range(warm):
            last = fn()
        sync(last)
    res = []
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            for _ in range(calls):
                last = fn()
            sync(last)
            res.append((time.perf_counter() - t) / calls)
    finally:
        if was_on:
            gc.enable()
    return float(np.median(res))


def _paired_step_ms(steps, sync, rounds=7, per_round=10):
    """Median ms per model step of each of ``steps`` (name -> step function), their rounds of
    ``per_round`` back-to-back steps interleaved (the order alternating from round to round), so
    that a drift of the host's speed during the measurement reaches every variant alike."""
    names = list(steps)
    for name in names:
        _per_call(steps[name], sync, per_round, 1)  # warm-up (compilation, graph recording)
    res = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            res[name].append(_per_call(steps[name], sync, per_round, 1, warm=0) * 1e3)
    return {name: float(np.median(v)) for name, v in res.items()}


# ----------------------------------------------------------------------------- torch model
def _torch_model(cfg, variant, seed=0):
    """(layer function, weights, inputs dict) of the torch model; ``variant`` one of ``VARIANTS``."""
    import torch
    import torch.nn.functional as F

    import cupy_rope
    import cupy_rope.torch as crt

    b, s, h, d = cfg["b"], cfg["s"], cfg["h"], cfg["d"]
    D = h * d
    dev, dt = DEVICE, torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed)
    freqs = cupy_rope.rope_freqs(d, MAX_POS, like=torch.empty(0, device=dev))  # [S, 1, 1, d] float32
    if cfg["decode"]:
        sp = torch.randint(0, MAX_POS - s, (b,), generator=g, device=dev, dtype=torch.int32)
        positions = sp[:, None].long() + torch.arange(s, device=dev)[None, :]
    else:
        sp = None
        positions = torch.arange(s, device=dev)[None, :].expand(b, s)
    ang = freqs.reshape(MAX_POS, d)[positions]  # [b, s, d]
    cos, sin = ang.cos().to(dt)[:, :, None, :], ang.sin().to(dt)[:, :, None, :]
    for t in (cos, sin) + ((sp,) if sp is not None else ()):  # constant buffers of the model (as
        torch._dynamo.mark_static_address(t)  # torch marks a module's buffers; freqs: rope_freqs does

    def rotate_half(t):
        return torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1)

    def rope_formula(q, k):
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def rope_ours(q, k):
        return crt.apply_rope_qk(q, k, freqs, "bshd", start_positions=sp)

    rope = {"formula": rope_formula, "cupy_rope": rope_ours}.get(variant)
    if variant in PROBE_ROPES:  # a development probe's variant (benchmarks/overhead_probe.py)
        rope = PROBE_ROPES[variant](freqs, sp)
    if variant == "cupy_rope_cache":  # the serving form: per-token positions, a bf16 cos/sin cache
        cache = cupy_rope.rope_cos_sin_cache(d, MAX_POS, dtype="bfloat16", like=torch.empty(0, device=dev))
        pos_ids = positions.contiguous()  # [b, s] int64
        for t in (cache, pos_ids):
            torch._dynamo.mark_static_address(t)

        def rope(q, k):
            return crt.apply_rope_pos(pos_ids, q, k, cos_sin_cache=cache)

    def layer(x, w_qkv, w_o):
        qkv = (x @ w_qkv).view(b, s, 3, h, d)
        q, k = rope(qkv[:, :, 0], qkv[:, :, 1])
        v = qkv[:, :, 2]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return x + o.transpose(1, 2).reshape(b, s, D) @ w_o

    weights = [(torch.randn(D, 3 * D, generator=g, device=dev, dtype=dt) * D ** -0.5,
                torch.randn(D, D, generator=g, device=dev, dtype=dt) * D ** -0.5) for _ in range(cfg["layers"])]
    # A module's parameters, which torch treats as static: CUDA-graph trees would otherwise copy
    # every weight into the graph on each replay (both variants alike). Unguarded: every layer
    # passes other weights to the one compiled layer; a guarded mark recompiles it per layer.
    for pair in weights:
        for w in pair:
            torch._dynamo.mark_static_address(w, guard=False)
    x = torch.randn(b, s, D, generator=g, device=dev, dtype=dt)
    return layer, weights, x


def _torch_step(cfg, variant, mode, kind, reset=True):
    import torch

    layer, weights, x = _torch_model(cfg, variant)
    if mode != "eager" and reset:
        torch._dynamo.reset()  # compiles afresh: no recompile-limit carry-over
    # One code object per variant: torch.compile keeps its compiled code, and its decisions on
    # which input sizes are dynamic, per code object. The variants of a row are compiled in one
    # process from one `def layer`: sharing it, each later variant was a recompile of the first
    # (its calls also checking the guards of the other variants' entries) and could be compiled
    # with dynamic sizes, which a model holding one variant never is.
    layer.__code__ = layer.__code__.replace(co_name=f"layer_{variant}")
    if mode == "compile":
        layer = torch.compile(layer, fullgraph=True)
    elif mode == "reduce-overhead":
        layer = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    train = kind == "train"
    params = [w for pair in weights for w in pair]
    if train:
        for p in params:
            p.requires_grad_(True)
        x = x.clone().requires_grad_(True)

    def forward():
        y = x
        for w_qkv, w_o in weights:
            y = layer(y, w_qkv, w_o)
        return y

    if train:
        def step():
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            for p in params:
                p.grad = None
            x.grad = None
            loss = forward().float().square().mean()
            loss.backward()
            return loss
    else:
        def step():
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad():
                return forward()
    return step, lambda _: torch.cuda.synchronize()


# ----------------------------------------------------------------------------- JAX model
def _jax_step(cfg, variant, kind):
    import jax
    import jax.numpy as jnp

    import cupy_rope
    import cupy_rope.jax as crj

    b, s, h, d = cfg["b"], cfg["s"], cfg["h"], cfg["d"]
    D = h * d
    dt = jnp.bfloat16
    key = jax.random.key(0)
    freqs = jnp.asarray(cupy_rope.rope_freqs(d, MAX_POS))
    rng = np.random.default_rng(0)
    if cfg["decode"]:
        sp_n = rng.integers(0, MAX_POS - s, b).astype(np.int32)
        sp = jnp.asarray(sp_n)
        positions = sp_n[:, None] + np.arange(s)[None, :]
    else:
        sp = None
        positions = np.broadcast_to(np.arange(s)[None, :], (b, s))
    ang = jnp.asarray(np.asarray(cupy_rope.rope_freqs(d, MAX_POS)).reshape(MAX_POS, d)[positions])
    cos, sin = jnp.cos(ang).astype(dt)[:, :, None, :], jnp.sin(ang).astype(dt)[:, :, None, :]

    def rotate_half(t):
        return jnp.concatenate([-t[..., d // 2:], t[..., : d // 2]], -1)

    def layer(x, w_qkv, w_o):
        qkv = (x @ w_qkv).reshape(b, s, 3, h, d)
        if variant == "formula":
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        elif variant != "cupy_rope_sliced_v":  # v from the same call: its gradient goes into the entry's buffer
            q, k, v = crj.apply_rope_qk_fused(qkv, freqs, "bshd", start_positions=sp, return_v=True,
                                              heads_major=variant == "cupy_rope")
        else:
            (q, k), v = crj.apply_rope_qk_fused(qkv, freqs, "bshd", start_positions=sp), qkv[:, :, 2]
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [b, s, h, d]
        return x + o.reshape(b, s, D) @ w_o

    keys = jax.random.split(key, 2 * cfg["layers"] + 1)
    weights = [((jax.random.normal(keys[2 * i], (D, 3 * D)) * D ** -0.5).astype(dt),
                (jax.random.normal(keys[2 * i + 1], (D, D)) * D ** -0.5).astype(dt)) for i in range(cfg["layers"])]
    x = jax.random.normal(keys[-1], (b, s, D)).astype(dt)

    def forward(weights, x):
        for w_qkv, w_o in weights:
            x = layer(x, w_qkv, w_o)
        return x

    if kind == "train":
        fn = jax.jit(jax.value_and_grad(lambda w, x: jnp.mean(jnp.square(forward(w, x).astype(jnp.float32))),
                                        argnums=(0, 1)))
    else:
        fn = jax.jit(forward)
    return (lambda: fn(weights, x)), jax.block_until_ready


# ----------------------------------------------------------------------------- end to end
def _launch_counts() -> dict:
    """Launch-cache counters (Python path and the torch shim's C++ path), to show per row how
    the timed calls were served."""
    from cupy_rope import _launch

    info = _launch.cache_info()
    return dict(hits=info["hits"], misses=info["misses"], native_hits=info["native_hits"])


def model_rows(configs, modes, kinds, rounds):
    rows = []
    jobs = [(c, m, k) for c in configs for m in modes for k in kinds]
    for cname, mode, kind in tqdm(jobs, desc="model", file=sys.stdout):
        cfg = CONFIGS[cname]
        fw = "jax" if mode == "jit" else "torch"
        try:
            if fw == "torch" and mode != "eager":
                import torch

                torch._dynamo.reset()  # each row compiles afresh: no recompile-limit carry-over
            steps = {}
            for variant in VARIANTS[fw]:
                steps[variant], sync = (_jax_step(cfg, variant, kind) if fw == "jax"
                                        else _torch_step(cfg, variant, mode, kind, reset=False))
            before = _launch_counts()  # only the cupy_rope variants launch through cupy_rope
            times = _paired_step_ms(steps, sync, rounds=rounds)
            after = _launch_counts()
            rows.append(dict(framework=fw, mode=mode, config=cname, kind=kind, formula_ms=times["formula"],
                             cupy_rope_ms=times["cupy_rope"], ratio=times["cupy_rope"] / times["formula"],
                             shape=cfg, launch_cache={k: after[k] - before[k] for k in after}))
            for variant, key in EXTRA.items():
                if variant in times:
                    rows[-1].update({f"{variant}_ms": times[variant],
                                     f"ratio_{key}": times[variant] / times["formula"]})
        except Exception as e:  # recorded, never hidden
            rows.append(dict(framework=fw, mode=mode, config=cname, kind=kind, error=f"{type(e).__name__}: {e}"[:400]))
        tqdm.write(json.dumps({k: v for k, v in rows[-1].items() if k != "shape"}))
    return rows


# ----------------------------------------------------------------------------- per call
def _wall_us(fn, sync, calls=200, rounds=7):
    """Median wall µs per call of back-to-back calls (the host cost, for small work)."""
    return _per_call(fn, sync, calls, rounds, warm=20) * 1e6


def _paired_us(ours, formula, sync, calls=200, rounds=9, per=1):
    """(ours, formula): median wall µs per call of each, their rounds interleaved
    (:func:`_paired_step_ms`), so that the host's drift during the measurement reaches both; divided
    by ``per`` (calls per function call, for chains)."""
    r = _paired_step_ms({"ours": ours, "formula": formula}, sync, rounds=rounds, per_round=calls)
    return r["ours"] * 1e3 / per, r["formula"] * 1e3 / per


def _profile(path, fns, n=3000):
    """cProfile of ``n`` calls of each function (the hot path's own cost), written to ``path``."""
    import cProfile
    import io
    import pstats

    with open(path, "w") as fh:
        for name, fn in fns.items():
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(n):
                fn()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
            fh.write(f"==== {name}: {n} calls\n{s.getvalue()}\n")


def percall_rows(profile=None):
    """Host µs per call at the decode shape [1, 64, 32, 128] bf16 (sbhd) with offsets."""
    import cupy
    import jax
    import jax.numpy as jnp
    import torch

    import cupy_rope
    import cupy_rope.jax as crj
    import cupy_rope.torch as crt

    s, b, h, d = 1, 64, 32, 128
    rows = []

    def add(entry, us, formula_us=None, note=""):
        rows.append(dict(entry=entry, us_per_call=us, formula_us_per_call=formula_us, note=note))
        tqdm.write(json.dumps(rows[-1]))

    tsync = lambda _: torch.cuda.synchronize()  # noqa: E731
    dev = "cuda"
    f = cupy_rope.rope_freqs(d, MAX_POS, like=torch.empty(0, device=dev))
    sp = torch.randint(0, MAX_POS - 1, (b,), device=dev, dtype=torch.int32)
    x = torch.randn(s, b, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(s, b, 8, d, device=dev, dtype=torch.bfloat16)
    pos = sp.long()[None, :]
    ang = f.reshape(MAX_POS, d)[pos]
    cos, sin = ang.cos().bfloat16()[:, :, None, :], ang.sin().bfloat16()[:, :, None, :]

    def formula(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * sin

    # torch eager
    add("torch: cupy_rope.torch.apply_rope", *_paired_us(lambda: crt.apply_rope(x, f, start_positions=sp),
                                                          lambda: formula(x), tsync))
    add("torch: cupy_rope.apply_rope (plain API)", _wall_us(lambda: cupy_rope.apply_rope(x, f, start_positions=sp), tsync))
    op = torch.ops.cupy_rope.rope.default
    add("torch: torch.ops.cupy_rope.rope", _wall_us(lambda: op(x, f, "sbhd", False, None, sp, 1, 0, False, False), tsync))
    add("torch: cupy_rope.torch.apply_rope_qk (q and k)",
        *_paired_us(lambda: crt.apply_rope_qk(x, k, f, start_positions=sp), lambda: (formula(x), formula(k)), tsync))
    import cupy_rope.vllm as crv

    pos_t = sp.long()
    qs, ks = torch.randn(b, h * d, device=dev, dtype=torch.bfloat16), torch.randn(b, 8 * d, device=dev,
                                                                                 dtype=torch.bfloat16)
    cs_cache = cupy_rope.rope_cos_sin_cache(d, MAX_POS, like=x)
    add("torch: cupy_rope.vllm.rotary_embedding (serving, in place, 32q+8kv)",
        _wall_us(lambda: crv.rotary_embedding(pos_t, qs, ks, d, cs_cache, True), tsync))
    add("torch: cupy_rope.apply_rope_pos (plain API, in place, 32q+8kv)",
        _wall_us(lambda: cupy_rope.apply_rope_pos(pos_t, qs, ks, cos_sin_cache=cs_cache, head_size=d, inplace=True),
                 tsync))
    xg = x.clone().requires_grad_(True)
    gy = torch.randn_like(x)
    add("torch: apply_rope forward+backward (autograd)",
        *_paired_us(lambda: crt.apply_rope(xg, f, start_positions=sp).backward(gy), lambda: formula(xg).backward(gy),
                    tsync))
    # torch.compile: a chain of 16 calls, per call
    n = 16

    def chain(fn):
        def run(t):
            for _ in range(n):
                t = fn(t)
            return t
        return run

    for mode in ("default", "reduce-overhead"):
        kw = {} if mode == "default" else dict(mode="reduce-overhead")
        c_ours = torch.compile(chain(lambda t: crt.apply_rope(t, f, start_positions=sp)), fullgraph=True, **kw)
        c_form = torch.compile(chain(formula), fullgraph=True, **kw)
        add(f"torch.compile({mode}): per call in a chain of {n}",
            *_paired_us(lambda: c_ours(x), lambda: c_form(x), tsync, calls=50, per=n))
    # CuPy
    xc, fc, spc = cupy.from_dlpack(x), cupy.from_dlpack(f), cupy.from_dlpack(sp)
    csync = lambda _: cupy.cuda.get_current_stream().synchronize()  # noqa: E731
    from cupy_rope import _launch

    def cupy_call():
        return cupy_rope.apply_rope(xc, fc, start_positions=spc)

    cupy_call()  # loads the C++ CuPy path where it builds
    ext = _launch.CUPY_EXT

    def cupy_python_path():  # the same call, its hit served by the Python path
        _launch.CUPY_EXT = None
        try:
            return cupy_call()
        finally:
            _launch.CUPY_EXT = ext

    r = _paired_step_ms({"default": cupy_call, "python": cupy_python_path}, csync, rounds=9, per_round=200)
    add("cupy: cupy_rope.apply_rope", r["default"] * 1e3,
        note="C++ hit path" if ext else "Python hit path: the C++ path is unavailable")
    add("cupy: cupy_rope.apply_rope, Python hit path (CUPY_ROPE_CUPY_EXT=0)", r["python"] * 1e3)
    # JAX
    xj, fj, spj = jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16), jnp.asarray(f.cpu().numpy()), \
        jnp.asarray(sp.cpu().numpy())
    cosj, sinj = jnp.asarray(cos.float().cpu().numpy()).astype(jnp.bfloat16), \
        jnp.asarray(sin.float().cpu().numpy()).astype(jnp.bfloat16)

    def jformula(t):
        return t * cosj + jnp.concatenate([-t[..., d // 2:], t[..., : d // 2]], -1) * sinj

    one = jax.jit(lambda t: crj.apply_rope(t, fj, start_positions=spj))
    one_f = jax.jit(jformula)
    add("jax: one jitted call", *_paired_us(lambda: one(xj), lambda: one_f(xj), jax.block_until_ready))
    jchain = jax.jit(chain(lambda t: crj.apply_rope(t, fj, start_positions=spj)))
    jchain_f = jax.jit(chain(jformula))
    add(f"jax: per op inside a jitted chain of {n}",
        *_paired_us(lambda: jchain(xj), lambda: jchain_f(xj), jax.block_until_ready, calls=50, per=n))
    from cupy_rope import _xla

    launch_way = "FFI handler" if _xla.ffi_library() is not None else "callback (the FFI handler did not build)"
    rows[-2]["note"] = rows[-1]["note"] = launch_way
    _xla.FFI = False  # the same ops through buffer callbacks: command-buffer compatible, then plain
    try:
        for cb in (True, False):
            _xla.COMMAND_BUFFERS = cb
            what = "command-buffer callback" if cb else "plain callback"
            one_p = jax.jit(lambda t: crj.apply_rope(t, fj, start_positions=spj) * 1)
            jchain_p = jax.jit(chain(lambda t: crj.apply_rope(t, fj, start_positions=spj) * 1))
            add(f"jax: one jitted call, {what}", _wall_us(lambda: one_p(xj), jax.block_until_ready))
            add(f"jax: per op inside a jitted chain of {n}, {what}",
                _wall_us(lambda: jchain_p(xj), jax.block_until_ready, calls=50) / n)
    finally:
        _xla.FFI, _xla.COMMAND_BUFFERS = True, True
    if profile:
        _profile(profile, {"torch crt.apply_rope": lambda: crt.apply_rope(x, f, start_positions=sp),
                           "cupy apply_rope": lambda: cupy_rope.apply_rope(xc, fc, start_positions=spc),
                           "jax one jitted call": lambda: one(xj)})
    # raw launch: cupy.RawKernel call vs driver launch of a prepared argument block (one int64 arg)
    import ctypes

    from cupy.cuda import driver

    kern = cupy.RawKernel('extern "C" __global__ void nop(long long a) {}', "nop")
    kern((1,), (32,), (np.int64(0),))
    arg = ctypes.c_int64(0)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    fptr, stream = kern.kernel.ptr, cupy.cuda.get_current_stream().ptr
    add("launch: cupy.RawKernel.__call__ (1 arg)", _wall_us(lambda: kern((1,), (32,), (np.int64(0),)), csync))
    add("launch: cupy.cuda.driver.launchKernel, prepared args",
        _wall_us(lambda: driver.launchKernel(fptr, 1, 1, 1, 32, 1, 1, 0, stream, ctypes.addressof(argv), 0), csync))
    # the library's Python launch (cupy_rope._launch.Prepared: libcuda through ctypes), plain and
    # programmatic: what the programmatic attribute costs the host per launch
    argv_addr = ctypes.addressof(argv)
    what = "launch: libcuda cuLaunchKernel through ctypes, prepared args"
    try:
        plain = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
        plain.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        plain.restype = ctypes.c_int

        def launch_plain():
            return plain(fptr, 1, 1, 1, 32, 1, 1, 0, stream, argv_addr, None)

        rc = launch_plain()
        if rc:
            raise RuntimeError(f"cuLaunchKernel returned {rc}")
        add(what, _wall_us(launch_plain, csync))
        ex = _launch._launch_ex()
        if ex is not None:
            what = "launch: libcuda cuLaunchKernelEx through ctypes, programmatic, prepared args"
            attr = _launch._LaunchAttribute(id=_launch._PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
            config = _launch._LaunchConfig((1, 1, 1), (32, 1, 1), 0, stream, ctypes.pointer(attr), 1)
            config_addr = ctypes.addressof(config)

            def launch_ex():
                return ex(config_addr, fptr, argv_addr, None)

            rc = launch_ex()
            if rc:
                raise RuntimeError(f"cuLaunchKernelEx returned {rc}")
            add(what, _wall_us(launch_ex, csync))
    except Exception as e:  # noqa: BLE001 - recorded, not fatal: the rows above are kept
        rows.append(dict(entry=what, us_per_call=None, formula_us_per_call=None,
                         note=f"failed: {type(e).__name__}: {e}"[:200]))
    try:
        from cuda.bindings import driver as cbd
    except ImportError:
        rows.append(dict(entry="launch: cuda.bindings.driver.cuLaunchKernel, prepared args", us_per_call=None,
                         formula_us_per_call=None, note="cuda-bindings not installed on the benchmark machine"))
        return rows
    try:  # the same prepared block through cuda-bindings (kernelParams as the address of the void* array)
        def cb_launch():
            err, = cbd.cuLaunchKernel(fptr, 1, 1, 1, 32, 1, 1, 0, stream, argv_addr, 0)
            if err != cbd.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuLaunchKernel: {err}")

        add("launch: cuda.bindings.driver.cuLaunchKernel, prepared args", _wall_us(cb_launch, csync))
    except Exception as e:  # noqa: BLE001 - an API difference of this cuda-bindings: recorded, not fatal
        rows.append(dict(entry="launch: cuda.bindings.driver.cuLaunchKernel, prepared args", us_per_call=None,
                         formula_us_per_call=None, note=f"failed: {type(e).__name__}: {e}"[:200]))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here (merged into an existing file's rows)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated from {list(CONFIGS)}")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated from {list(MODES)}")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated from {list(KINDS)}")
    ap.add_argument("--rounds", type=int, default=7, help="timing rounds per measurement")
    ap.add_argument("--percall", action="store_true", help="also the per-call overhead table")
    ap.add_argument("--no-model", action="store_true", help="skip the end-to-end model rows")
    ap.add_argument("--profile", help="with --percall: write a cProfile of the eager hot paths here")
    a = ap.parse_args(argv)
    for name, allowed in (("configs", CONFIGS), ("modes", MODES), ("kinds", KINDS)):
        bad = [v for v in getattr(a, name).split(",") if v and v not in allowed]
        if bad:
            ap.error(f"--{name}: unknown {bad}, expected some of {list(allowed)}")
    from cupy_rope._dev.benchmark import gpu_missing

    why = gpu_missing()
    if why:
        print(f"benchmarks/model.py needs a CUDA GPU: {why}", file=sys.stderr)
        return 2
    result = {"rows": [], "percall": []}
    if a.json and os.path.exists(a.json):
        with open(a.json) as fh:
            result = json.load(fh)
    if not a.no_model:
        new = model_rows(a.configs.split(","), a.modes.split(","), a.kinds.split(","), a.rounds)
        keep = {(r["framework"], r["mode"], r["config"], r["kind"]) for r in new}
        result["rows"] = [r for r in result.get("rows", [])
                          if (r["framework"], r["mode"], r["config"], r["kind"]) not in keep] + new
    if a.percall:
        result["percall"] = percall_rows(a.profile)
    import torch

    result["environment"] = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                 python=platform.python_version(), date=time.strftime("%Y-%m-%d"))
    # a merged file lists every command whose results it holds
    commands = [c for c in result.get("command", "").split("; ") if c]
    this = "python benchmarks/model.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result["command"] = "; ".join(commands + [this] if this not in commands else commands)
    try:
        import jax

        result["environment"]["jax"] = jax.__version__
    except ImportError:  # pragma: no cover
        pass
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

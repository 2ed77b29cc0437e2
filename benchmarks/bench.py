"""cupy_rope benchmark suite (H200): device time vs a device-to-device copy of the same bytes,
and eager per-call time, per shape, forward and backward.

    python benchmarks/bench.py [--json FILE] [--md FILE] [--quick] [--rows 1,2,...]

Device time: CUDA-graph replay of many launches over rotating buffers (larger than L2),
divided by the launch count. Eager: wall time of many back-to-back Python calls (synchronised
once at the end) divided by the call count. Copy: ``dst.copy_(src)`` of a buffer holding the
bytes the operation must move (input + output + angle rows used), timed the same way.
"""

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import cupy_rope  # noqa: E402

L2_BYTES = 60 * 2**20


def shapes():
    """The issue's shapes: (id, description, builder)."""
    bf16, f32 = torch.bfloat16, torch.float32
    return [
        (1, "sbhd 4096x2x32x128 bf16", dict(layout="sbhd", shape=(4096, 2, 32, 128), dtype=bf16)),
        (2, "bshd 2x8192x8x128 bf16", dict(layout="bshd", shape=(2, 8192, 8, 128), dtype=bf16)),
        (3, "thd 32768 tok / 16 seqs, h32", dict(layout="thd", tokens=32768, nseq=16, heads=32, d=128, dtype=bf16)),
        (4, "thd 65536 tok / 1024 seqs, h16", dict(layout="thd", tokens=65536, nseq=1024, heads=16, d=128, dtype=bf16)),
        (5, "sbhd d2=64 interleaved", dict(layout="sbhd", shape=(4096, 2, 32, 128), dtype=bf16, d2=64, interleaved=True)),
        (6, "sbhd 2048x4x16x64 fp32", dict(layout="sbhd", shape=(2048, 4, 16, 64), dtype=f32)),
        (7, "sbhd 4096x2x32x80", dict(layout="sbhd", shape=(4096, 2, 32, 80), dtype=bf16)),
        (8, "sbhd cp_size=4 cp_rank=1", dict(layout="sbhd", shape=(4096, 2, 32, 128), dtype=bf16, cp=(4, 1))),
        (9, "packed QKV sbhd 8 groups x 4 q", dict(layout="sbhd", qkv=(4096, 2, 8, 4, 128), dtype=bf16)),
        (10, "decode bshd 64x1x32x128 + offsets", dict(layout="bshd", shape=(64, 1, 32, 128), dtype=bf16, decode=True)),
    ]


def graph_time(fn_list, reps=20):
    """Median per-launch device time (µs) of graph replays that run fn_list once each."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fn_list:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fn_list:
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
        times.append(a.elapsed_time(b) * 1000 / len(fn_list))
    return float(np.median(times))


def eager_time(fn_list, rounds=5):
    """Median per-call wall time (µs) of back-to-back calls, one sync per round."""
    for fn in fn_list:
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(rounds):
        t = time.perf_counter()
        for fn in fn_list:
            fn()
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t) * 1e6 / len(fn_list))
    return float(np.median(res))


def build(spec, nbuf):
    """Inputs for a shape: list of (args, kwargs) per rotating buffer, bytes moved."""
    dev = "cuda"
    dt = spec["dtype"]
    esz = torch.tensor([], dtype=dt).element_size()
    kw = dict(layout=spec["layout"], interleaved=spec.get("interleaved", False))
    g = torch.Generator(device=dev).manual_seed(0)
    if "qkv" in spec:
        s, b, grp, n, d = spec["qkv"]
        shape = (s, b, grp, (n + 2) * d)
        f = cupy_rope.rope_freqs(d, s, like=torch.empty(0, device=dev))
        xs = [torch.empty(shape, dtype=dt, device=dev).uniform_(-1, 1, generator=g) for _ in range(nbuf)]
        nbytes = 2 * math.prod(shape) * esz + f.numel() * 4
        return xs, f, kw, nbytes, dict(qkv=(n, d))
    if spec["layout"] == "thd":
        tok, nseq, h, d = spec["tokens"], spec["nseq"], spec["heads"], spec["d"]
        rng = np.random.default_rng(0)
        w = rng.uniform(0.2, 1.8, nseq)
        lens = np.floor(w / w.sum() * tok).astype(np.int64)
        lens[-1] += tok - lens.sum()
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=dev)
        shape = (tok, h, d)
        kw["cu_seqlens"] = cu
        maxlen = int(lens.max())
        f = cupy_rope.rope_freqs(d, maxlen, like=torch.empty(0, device=dev))
    else:
        shape = spec["shape"]
        cp_size, cp_rank = spec.get("cp", (1, 0))
        kw.update(cp_size=cp_size, cp_rank=cp_rank)
        d = shape[-1]
        d2 = spec.get("d2", d)
        s = shape[0] if spec["layout"] == "sbhd" else shape[1]
        rows = s * cp_size
        if spec.get("decode"):
            kw["start_positions"] = torch.randint(0, 4000, (shape[0],), dtype=torch.int32, device=dev)
            rows = 4096
        f = cupy_rope.rope_freqs(d2, rows, like=torch.empty(0, device=dev), interleaved=kw["interleaved"])
    xs = [torch.empty(shape, dtype=dt, device=dev).uniform_(-1, 1, generator=g) for _ in range(nbuf)]
    table_bytes = min(f.numel(), math.prod(shape[:-2]) * f.shape[-1]) * 4
    nbytes = 2 * math.prod(shape) * esz + table_bytes
    return xs, f, kw, nbytes, {}


def run_row(rid, desc, spec, quick):
    xs0, _, _, nbytes, _ = build(spec, 1)
    per = xs0[0].numel() * xs0[0].element_size()
    nbuf = max(2, min(16, math.ceil(3 * L2_BYTES / max(per, 1))))
    del xs0
    xs, f, kw, nbytes, extra = build(spec, nbuf)
    n_launch = nbuf * max(1, (4 if quick else 16) // nbuf) if per > 2**20 else 200
    idx = [i % nbuf for i in range(n_launch)]
    half = max(nbytes // 2, 1)
    src = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(nbuf)]
    dst = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(nbuf)]
    row = dict(id=rid, shape=desc, bytes=nbytes)
    row["copy_us"] = graph_time([lambda i=i: dst[i].copy_(src[i]) for i in idx])
    import cupy

    for direction in ("fwd", "bwd"):
        if "qkv" in extra:
            n, d = extra["qkv"]
            split = (n * d, d, d)
            if direction == "fwd":
                fn = lambda i: cupy_rope.apply_qkv_rope(xs[i], f, f, split, **kw)  # noqa: E731
                cx = [cupy.from_dlpack(x) for x in xs]
                cf = cupy.from_dlpack(f)
                cfn = lambda i: cupy_rope.apply_qkv_rope(cx[i], cf, cf, split, **kw)  # noqa: E731
            else:
                q, k, v = cupy_rope.apply_qkv_rope(xs[0], f, f, split, **kw)
                grads = [(torch.empty_like(q).uniform_(-1, 1), torch.empty_like(k).uniform_(-1, 1),
                          torch.empty_like(v).uniform_(-1, 1)) for _ in range(nbuf)]
                fn = lambda i: cupy_rope.apply_qkv_rope_backward(*grads[i], f, f, split, **kw)  # noqa: E731
                cg = [tuple(cupy.from_dlpack(t) for t in gr) for gr in grads]
                cf = cupy.from_dlpack(f)
                cfn = lambda i: cupy_rope.apply_qkv_rope_backward(*cg[i], cf, cf, split, **kw)  # noqa: E731
        else:
            api = cupy_rope.apply_rope if direction == "fwd" else cupy_rope.apply_rope_backward
            fn = lambda i: api(xs[i], f, **kw)  # noqa: E731
            cx = [cupy.from_dlpack(x) for x in xs]
            ckw = {k: (cupy.from_dlpack(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
            cf = cupy.from_dlpack(f)
            cfn = lambda i: api(cx[i], cf, **ckw)  # noqa: E731
        dev_us = graph_time([lambda i=i: fn(i) for i in idx])
        eager_torch = eager_time([lambda i=i: fn(i) for i in idx])
        eager_cupy = eager_time([lambda i=i: cfn(i) for i in idx])
        row[direction] = dict(device_us=dev_us, pct_copy=100 * row["copy_us"] / dev_us,
                              gbps=nbytes / dev_us / 1e3, eager_torch_us=eager_torch, eager_cupy_us=eager_cupy)
    return row


def table(rows):
    lines = ["| # | shape | copy µs | fwd µs (%copy) | bwd µs (%copy) | fwd GB/s | eager cupy fwd/bwd µs | eager torch fwd/bwd µs |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, b = r["fwd"], r["bwd"]
        lines.append(f"| {r['id']} | {r['shape']} | {r['copy_us']:.1f} | {f['device_us']:.1f} ({f['pct_copy']:.0f}%) | "
                     f"{b['device_us']:.1f} ({b['pct_copy']:.0f}%) | {f['gbps']:.0f} | "
                     f"{f['eager_cupy_us']:.1f} / {b['eager_cupy_us']:.1f} | {f['eager_torch_us']:.1f} / {b['eager_torch_us']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--md")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="")
    a = ap.parse_args(argv)
    want = {int(v) for v in a.rows.split(",") if v}
    rows = []
    for rid, desc, spec in shapes():
        if want and rid not in want:
            continue
        rows.append(run_row(rid, desc, spec, a.quick))
        print(f"row {rid} done: fwd {rows[-1]['fwd']['pct_copy']:.0f}% bwd {rows[-1]['bwd']['pct_copy']:.0f}%",
              flush=True)
    md = table(rows)
    print(md)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(rows=rows, env=dict(torch=torch.__version__, device=torch.cuda.get_device_name())), fh, indent=1)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(md + "\n")


if __name__ == "__main__":
    main()

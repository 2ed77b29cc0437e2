"""``python -m cupy_rope``: check every layout and option on this machine, then benchmark.

    python -m cupy_rope                 check (quick matrix) + short benchmark table
    python -m cupy_rope check           the full spec matrix against the float64 reference
    python -m cupy_rope bench           the full benchmark suite (GPU; peers side by side)
    options: --quick, --json FILE, --dtype {float32,float16,bfloat16}, --layout {sbhd,bshd,thd}

On a GPU (found through CuPy) the CUDA kernels run on CuPy arrays; without one the NumPy
backend runs, and the output says which. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

import cupy_rope
from cupy_rope import testing


def detect_device():
    """('gpu', name) when CuPy sees a CUDA device, else ('cpu', reason)."""
    try:
        import cupy

        if cupy.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0:
            props = cupy.cuda.runtime.getDeviceProperties(0)
            return "gpu", props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return "cpu", "CuPy found no CUDA device"
    except Exception as e:  # ImportError or driver problems
        return "cpu", f"CuPy unavailable ({type(e).__name__})"


def progress(total, label):
    """A progress bar on stderr (tqdm), shown only when stderr is a terminal (no carriage
    returns in logs)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, disable=None, leave=False, file=sys.stderr)


def _to_dev(a, dev):
    if dev != "gpu" or a is None or not isinstance(a, np.ndarray):
        return a
    import cupy

    if 0 in a.strides and a.size:  # keep stride-0 inputs stride-0
        idx = tuple(slice(0, 1) if s == 0 else slice(None) for s in a.strides)
        return cupy.broadcast_to(cupy.asarray(a[idx].copy()), a.shape)
    return cupy.asarray(a)


def _to_host(a):
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def run_check(dev, quick=False, dtype=None, layout=None):
    """Forward and backward of the spec matrix (and packed QKV) against the reference."""
    cases = [c for c in testing.matrix() if (dtype is None or c.dtype == dtype)
             and (layout is None or c.layout == layout)]
    if quick:
        cases = cases[::4]
    failures = []
    prog = progress(2 * len(cases) + 6 + 2 * len(_POS_CASES), "check")
    for case in cases:
        x, freqs, kw = testing.inputs(case)
        dkw = {k: _to_dev(v, dev) for k, v in kw.items()}
        for backward in (False, True):
            fn = cupy_rope.apply_rope_backward if backward else cupy_rope.apply_rope
            try:
                y = _to_host(fn(_to_dev(x, dev), _to_dev(freqs, dev), **dkw))
                ref = testing.rope_ref(x, freqs, backward=backward, **kw)
                testing.assert_close_to_ref(y, ref, x, freqs.shape[-1], case.dtype,
                                            case.id() + (" bwd" if backward else " fwd"))
            except Exception as e:
                failures.append(f"{case.id()} {'bwd' if backward else 'fwd'}: {e}")
            prog.update()
    for i, (lay, g, n, d) in enumerate([("sbhd", 2, 4, 64), ("bshd", 1, 8, 80), ("thd", 8, 1, 128)]):
        if layout not in (None, lay):
            prog.update(2)
            continue
        rng = np.random.default_rng(i)
        dt = dtype or ("bfloat16", "float16", "float32")[i]
        lead = (6, 2) if lay != "thd" else (11,)
        qkv = rng.uniform(-1, 1, lead + (g, (n + 2) * d)).astype(testing.NP_DTYPES[dt])
        kw = dict(layout=lay, interleaved=i == 2)
        f = cupy_rope.rope_freqs(d, 16, rotary_percent=0.5 if i == 1 else 1.0, interleaved=kw["interleaved"])
        if lay == "thd":
            kw["cu_seqlens"] = np.array([0, 4, 4, 10], np.int32)
        try:
            q, k, v = (_to_host(t) for t in cupy_rope.apply_qkv_rope(_to_dev(qkv, dev), _to_dev(f, dev), _to_dev(f, dev),
                                                                   (n * d, d, d), **{a: _to_dev(b, dev) for a, b in kw.items()}))
            xq, xk, xv = testing.qkv_split_ref(qkv, n, d)
            testing.assert_close_to_ref(q, testing.rope_ref(xq, f, **kw), xq, f.shape[-1], dt, f"qkv {lay} q")
            testing.assert_close_to_ref(k, testing.rope_ref(xk, f, **kw), xk, f.shape[-1], dt, f"qkv {lay} k")
            np.testing.assert_array_equal(v.astype(np.float64), xv.astype(np.float64))
        except Exception as e:
            failures.append(f"qkv {lay} fwd: {e}")
        prog.update()
        try:
            d_all = _to_host(cupy_rope.apply_qkv_rope_backward(_to_dev(q, dev), _to_dev(k, dev), _to_dev(v, dev),
                                                               _to_dev(f, dev), _to_dev(f, dev), (n * d, d, d),
                                                               **{a: _to_dev(b, dev) for a, b in kw.items()}))
            # with a standard table the backward undoes the forward
            np.testing.assert_allclose(d_all.astype(np.float64), qkv.astype(np.float64), rtol=0.05, atol=0.05)
        except Exception as e:
            failures.append(f"qkv {lay} bwd: {e}")
        prog.update()
    n_pos = _check_positions(dev, dtype, failures, prog)
    prog.close()
    return len(cases) * 2 + 6 + n_pos, failures


# the positions API: (table kind, table dtype or None, interleaved, rope_dim_offset, inverse, d, d2)
_POS_CASES = [("cos_sin_cache", "float32", False, 0, False, 128, 128), ("cos_sin_cache", "same", True, 0, True, 64, 32),
              ("inv_freq", "float64", False, 64, False, 128, 64), ("freqs", "float32", True, 8, True, 80, 64)]


def _check_positions(dev, dtype, failures, prog) -> int:
    """q (flattened heads) and k (GQA) at random per-token positions, out of place and in place."""
    for i, (tname, tdt, il, off, inv, d, d2) in enumerate(_POS_CASES):
        rng = np.random.default_rng(100 + i)
        dt = dtype or ("bfloat16", "float16", "float32")[i % 3]
        npdt = testing.NP_DTYPES[dt]
        rows = 64
        pos = rng.integers(-2, rows + 2, 9)
        q = rng.uniform(-1, 1, (9, 8 * d)).astype(npdt)
        k = rng.uniform(-1, 1, (9, 2, d)).astype(npdt)
        if tname == "cos_sin_cache":
            table = cupy_rope.rope_cos_sin_cache(d2, rows, dtype="float32" if tdt == "float32" else dt)
            kind, trows = "cos_sin", rows
        elif tname == "inv_freq":
            table, kind, trows = cupy_rope.rope_inv_freq(d2)[0], "inv_freq", 2**62
        else:
            table, kind, trows = cupy_rope.rope_freqs(d2, rows, interleaved=il)[:, 0, 0], "angles", rows
        kw = dict(head_size=d, interleaved=il, rope_dim_offset=off, inverse=inv)
        for inplace in (False, True):
            try:
                dq, dk = _to_dev(q.copy(), dev), _to_dev(k.copy(), dev)
                qo, ko = cupy_rope.apply_rope_pos(_to_dev(pos, dev), dq, dk, **{tname: _to_dev(table, dev)}, **kw,
                                                  inplace=inplace)
                for name, x, y in (("q", q.reshape(9, 8, d), qo), ("k", k, ko)):
                    ref = testing.rope_pos_ref(x, pos, kind, table, trows, il, off, inv)
                    scale = np.abs(x.astype(np.float64))
                    scale[..., off:off + d2] += scale[..., off:off + d2].max(axis=-1, keepdims=True)
                    testing.assert_close_to_ref(_to_host(y).reshape(x.shape), ref, x, d2, dt,
                                                f"positions {tname} {name}", scale=scale)
            except Exception as e:
                failures.append(f"positions {tname} {dt} {'in place' if inplace else 'out of place'}: {e}")
            prog.update()
    return 2 * len(_POS_CASES)


def _short_bench_rows():
    return [("sbhd 2048x2x16x128 bf16", dict(shape=(2048, 2, 16, 128), layout="sbhd", dtype="bfloat16")),
            ("thd 16384 tok/256 seq h16", dict(tokens=16384, nseq=256, heads=16, d=128, layout="thd", dtype="bfloat16")),
            ("sbhd d2=64 interleaved fp16", dict(shape=(2048, 2, 16, 128), layout="sbhd", dtype="float16", d2=64,
                                                 interleaved=True)),
            ("sbhd 1024x4x16x64 fp32", dict(shape=(1024, 4, 16, 64), layout="sbhd", dtype="float32"))]


def run_short_bench(dev, quick=False):
    """Median time per call against a copy of the same bytes, in the same array library."""
    rows = []
    for desc, spec in _short_bench_rows():
        rng = np.random.default_rng(0)
        kw = dict(layout=spec["layout"], interleaved=spec.get("interleaved", False))
        if spec["layout"] == "thd":
            lens = np.full(spec["nseq"], spec["tokens"] // spec["nseq"])
            kw["cu_seqlens"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            shape = (spec["tokens"], spec["heads"], spec["d"])
            rows_needed = int(lens.max())
        else:
            shape = spec["shape"]
            rows_needed = shape[0]
        if dev == "cpu":
            shape = (shape[0] // 8,) + tuple(shape[1:])  # the NumPy backend: a smaller problem
            if "cu_seqlens" in kw:
                kw["cu_seqlens"] = (kw["cu_seqlens"] // 8).astype(np.int32)
        d2 = spec.get("d2", shape[-1])
        f = cupy_rope.rope_freqs(d2, rows_needed, interleaved=kw["interleaved"])
        nbytes = 2 * math.prod(shape) * np.dtype(testing.NP_DTYPES[spec["dtype"]]).itemsize
        nbuf = 4 if dev == "gpu" else 1
        xs = [_to_dev(rng.uniform(-1, 1, shape).astype(testing.NP_DTYPES[spec["dtype"]]), dev) for _ in range(nbuf)]
        fd = _to_dev(f, dev)
        dkw = {k: _to_dev(v, dev) for k, v in kw.items()}
        reps = (20 if quick else 100) if dev == "gpu" else 3
        if dev == "gpu":
            import cupy

            dst = [cupy.empty_like(x) for x in xs]

            def timed(fn):
                fn(0)
                s, e = cupy.cuda.Event(), cupy.cuda.Event()
                s.record()
                for i in range(reps):
                    fn(i % nbuf)
                e.record()
                e.synchronize()
                return cupy.cuda.get_elapsed_time(s, e) * 1000 / reps

            copy_us = timed(lambda i: cupy.copyto(dst[i], xs[i]))
        else:
            dst = [np.empty_like(x) for x in xs]

            def timed(fn):
                fn(0)
                t = time.perf_counter()
                for i in range(reps):
                    fn(i % nbuf)
                return (time.perf_counter() - t) * 1e6 / reps

            copy_us = timed(lambda i: np.copyto(dst[i], xs[i]))
        fwd_us = timed(lambda i: cupy_rope.apply_rope(xs[i], fd, **dkw))
        bwd_us = timed(lambda i: cupy_rope.apply_rope_backward(xs[i], fd, **dkw))
        rows.append(dict(shape=desc + (" (1/8 size)" if dev == "cpu" else ""), copy_us=copy_us, fwd_us=fwd_us,
                         bwd_us=bwd_us, gbps=nbytes / fwd_us / 1e3, pct_copy_fwd=100 * copy_us / fwd_us,
                         pct_copy_bwd=100 * copy_us / bwd_us))
    return rows


def print_bench(rows, dev):
    what = ("time per call: CUDA events around back-to-back calls, host cost included where it exceeds "
            "the kernel; `python -m cupy_rope bench` for device times" if dev == "gpu" else "wall time, NumPy backend")
    print(f"\nbenchmark ({what}; % = a copy of the same bytes over cupy_rope's time):")
    print(f"{'shape':40s} {'copy µs':>9s} {'fwd µs':>9s} {'bwd µs':>9s} {'GB/s fwd':>9s} {'% copy fwd/bwd':>15s}")
    for r in rows:
        print(f"{r['shape']:40s} {r['copy_us']:9.1f} {r['fwd_us']:9.1f} {r['bwd_us']:9.1f} {r['gbps']:9.3g} "
              f"{r['pct_copy_fwd']:6.0f}% / {r['pct_copy_bwd']:3.0f}%")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m cupy_rope", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="`python -m cupy_rope bench --help` lists the benchmark suite's options.")
    ap.add_argument("command", nargs="?", choices=["check", "bench"],
                    help="check: the spec matrix only; bench: the full GPU benchmark suite; default: both (short)")
    ap.add_argument("--quick", action="store_true", help="a quarter of the check matrix, fewer timing repeats")
    ap.add_argument("--json", metavar="FILE", help="write results (checks, failures, timings) as JSON")
    ap.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="check only this dtype")
    ap.add_argument("--layout", choices=["sbhd", "bshd", "thd"], help="check only this layout")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark suite has its own options (bench --help lists them)
        from cupy_rope._dev import benchmark

        try:
            benchmark.main(argv[1:])
        except SystemExit as e:
            return e.code
        return 0
    a = ap.parse_args(argv)
    dev, name = detect_device()
    print(f"cupy_rope {cupy_rope.__version__}: running on "
          + (f"the GPU ({name}) through CuPy" if dev == "gpu" else f"the CPU through the NumPy backend ({name})"))
    n, failures = run_check(dev, quick=a.quick or a.command is None, dtype=a.dtype, layout=a.layout)
    print(f"check: {n - len(failures)} passed, {len(failures)} failed (forward and backward vs the float64 reference)")
    for f in failures[:20]:
        print("  FAIL", f)
    result = dict(device=dev, device_name=name, checks=n, failures=failures)
    if a.command is None:
        rows = run_short_bench(dev, quick=a.quick)
        print_bench(rows, dev)
        result["bench"] = rows
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

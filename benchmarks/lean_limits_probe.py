"""A/B of the lean kernel's routing limits (``_worksplit._LEAN_MIN_HEADS``, ``_LEAN_MAX_SEQS``,
``_LEAN_MAX_FAST_SEQS``) and of the mixed kernels' build, bf16 (mixed: also fp32), angle table.

    python benchmarks/lean_limits_probe.py [--limit heads|seqs|fastseqs|mixed] [--values V,V]
                                           [--rounds 5] [--defines D;D] [--json FILE]

``--limit heads`` (values default 8,1: the limit before and after the thirty-eighth session): q+k
launches of grouped-query attention (a k of few heads: 8 down to 1), tensors of 1-12 heads alone,
sbhd/bshd, and decode steps (one token per sequence). ``--limit seqs`` (values default 64,1073741824,
i.e. no limit): packed ``thd`` launches of 64 to 65536 sequences (random lengths, fixed seed),
where each lean thread searches ``cu_seqlens`` for its token's sequence. ``--limit fastseqs``
(values default 64,2048): the same launches (int32 ``cu_seqlens``, searched in 32 bits) under the
limit for launches of ``_LEAN_MIN_SEQ_TOKENS`` tokens per sequence or more. ``--limit mixed``
(values: kernel build defines, ``;``-separated, the values ``|``-separated; default the build
before the thirty-seventh session, ``-DCUPY_ROPEM_ASYNC_DEPTH=2;-DCUPY_ROPEM_MIN_BLOCKS=4``,
against none): launches of a rotary slice narrower than the head (the mixed kernels, ``ropem``),
each value's build compiled and loaded in turn; the interleaved cases take an interleaved table
(``rope_freqs(..., interleaved=True)``, as TE builds it: one angle per pair, so each thread's
cos/sin are computed once and held).

Per case: the kernel each value launches, whether the outputs are bit-identical across values,
and device µs per call from CUDA-graph replays (``benchmark.graph_time``) of six distinct input
sets (so that L2 does not hold them), the values' rounds interleaved, with a copy of the same bytes.
"""
import argparse
import json
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import cupy_rope  # noqa: E402
from cupy_rope import _api, _kernels, _launch, _worksplit  # noqa: E402
from cupy_rope._dev.benchmark import graph_time  # noqa: E402

# --limit heads; name: (layout, token dims, q heads (0: k alone), k heads, q and k views of one
# fused projection)
HEAD_CASES = {
    "sbhd q32+k8 4096x2": ("sbhd", (4096, 2), 32, 8, False),
    "bshd q32+k8 2x4096": ("bshd", (2, 4096), 32, 8, False),
    "sbhd q32+k8 views of a fused projection": ("sbhd", (4096, 2), 32, 8, True),
    "bshd q64+k8 1x8192": ("bshd", (1, 8192), 64, 8, False),
    "bshd k8 alone 2x8192": ("bshd", (2, 8192), 0, 8, False),
    "sbhd q12+k12 4096x4": ("sbhd", (4096, 4), 12, 12, False),
    # fewer than 8 k heads (Qwen2-7B: 28 + 4; multi-query attention: one)
    "sbhd q32+k4 4096x2": ("sbhd", (4096, 2), 32, 4, False),
    "bshd q28+k4 views of a fused projection 2x4096": ("bshd", (2, 4096), 28, 4, True),
    "bshd q32+k2 2x4096": ("bshd", (2, 4096), 32, 2, False),
    "bshd q32+k1 2x4096": ("bshd", (2, 4096), 32, 1, False),
    "bshd k4 alone 2x8192": ("bshd", (2, 8192), 0, 4, False),
    "bshd k2 alone 2x8192": ("bshd", (2, 8192), 0, 2, False),
    "bshd k1 alone 4x8192": ("bshd", (4, 8192), 0, 1, False),
    "bshd q8+k1 8x2048": ("bshd", (8, 2048), 8, 1, False),
    "bshd q4+k4 4x4096": ("bshd", (4, 4096), 4, 4, False),
    # decode steps (one token per sequence): a q+k launch of 64 sequences
    "bshd q32+k8 64x1 decode": ("bshd", (64, 1), 32, 8, False),
    "bshd q32+k4 64x1 decode": ("bshd", (64, 1), 32, 4, False),
    "bshd q32+k1 256x1 decode": ("bshd", (256, 1), 32, 1, False),
}
# --limit seqs; name: (tokens, q heads, k heads (0: q alone), sequences)
SEQ_CASES = {f"thd {t} tokens q{hq}{f'+k{hk}' if hk else ''} {n} seqs": (t, hq, hk, n) for t, hq, hk, n in [
    (65536, 16, 0, 64), (65536, 16, 0, 1024), (65536, 16, 0, 2048), (65536, 16, 0, 4096),
    (65536, 16, 0, 16384), (65536, 16, 0, 65536), (16384, 32, 8, 1024), (16384, 32, 8, 4096),
    (16384, 32, 8, 8192), (8192, 32, 0, 512), (32768, 16, 0, 1024), (131072, 16, 0, 2048),
    (16384, 32, 0, 256), (32768, 32, 8, 1024), (65536, 16, 0, 1536)]}
# --limit mixed; name: (layout, token dims, q heads, k heads (0: q alone), head size, rotary width,
# interleaved, dtype; thd: 16 sequences)
BF16, F32 = torch.bfloat16, torch.float32
MIXED_CASES = {
    "sbhd 4096x2 h32 d128 d2 64 interleaved (suite row 5)": ("sbhd", (4096, 2), 32, 0, 128, 64, True, BF16),
    "sbhd 4096x2 h32 d128 d2 64": ("sbhd", (4096, 2), 32, 0, 128, 64, False, BF16),
    "bshd 2x4096 h32 d128 d2 32": ("bshd", (2, 4096), 32, 0, 128, 32, False, BF16),
    "bshd 4x2048 h32 d80 d2 32": ("bshd", (4, 2048), 32, 0, 80, 32, False, BF16),
    "bshd 2x8192 h8 d128 d2 64": ("bshd", (2, 8192), 8, 0, 128, 64, False, BF16),
    "sbhd 4096x2 q32+k8 d128 d2 64": ("sbhd", (4096, 2), 32, 8, 128, 64, False, BF16),
    "thd 32768 tokens in 16 seqs h32 d128 d2 64 interleaved": ("thd", (32768,), 32, 0, 128, 64, True, BF16),
    "bshd 2x8192 h8 d128 d2 64 interleaved": ("bshd", (2, 8192), 8, 0, 128, 64, True, BF16),
    "sbhd 4096x2 h32 d128 d2 64 interleaved fp32": ("sbhd", (4096, 2), 32, 0, 128, 64, True, F32),
    "sbhd 2048x4 h16 d64 d2 32 fp32": ("sbhd", (2048, 4), 16, 0, 64, 32, False, F32),
}
# name: (what is varied: a _worksplit constant or DEFINES, default values, their separator)
LIMITS = {"heads": ("_LEAN_MIN_HEADS", "8,1", ","), "seqs": ("_LEAN_MAX_SEQS", "64,1073741824", ","),
          "fastseqs": ("_LEAN_MAX_FAST_SEQS", "64,2048", ","),
          "mixed": ("DEFINES", "-DCUPY_ROPEM_ASYNC_DEPTH=2;-DCUPY_ROPEM_MIN_BLOCKS=4|", "|")}
SETS = 6
KERNELS = []  # (kernel, grid, block) of each launch the Python path makes
_launch_gpu = _api._launch_gpu


def _recording_launch(spec, *args):
    KERNELS.append((spec.name, spec.grid, spec.block))
    return _launch_gpu(spec, *args)


def set_limit(name: str, v, base_defines=()) -> None:
    """The limit (or, for DEFINES, the build: ``base_defines`` and the value's) for this process;
    the launch caches dropped (their launches were planned with the previous limit, their kernels
    loaded from the previous build): the debug switch clears the C++ caches, then the Python ones."""
    if name == "DEFINES":
        _kernels.DEFINES = tuple(base_defines) + tuple(d for d in v.split(";") if d)
        _launch._functions.clear()
    else:
        setattr(_worksplit, name, int(v))
    cupy_rope.set_debug(True)
    cupy_rope.set_debug(False)
    _launch._CACHE.clear()


def _randn(*shape, dtype=BF16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def _call(a, b, f, layout, **kw):
    """One launch as a call returning its outputs: ``a`` and ``b`` rotated together, or ``a`` alone
    where ``b`` is None."""
    if b is None:
        return lambda: (cupy_rope.apply_rope(a, f, layout, **kw),)
    return lambda: cupy_rope.apply_rope_qk(a, b, f, layout, **kw)


def head_case(case, f):
    """Calls on SETS input sets of a ``--limit heads`` case: q (None: k alone) and k, contiguous or
    views of one fused projection; and the bytes of one set's inputs."""
    layout, lead, hq, hk, fused = case
    calls = []
    for _ in range(SETS):
        if fused:
            p = _randn(*lead, (hq + 2 * hk) * 128)
            q = p[..., : hq * 128].unflatten(-1, (hq, 128))
            k = p[..., hq * 128: (hq + hk) * 128].unflatten(-1, (hk, 128))
        else:
            q, k = (_randn(*lead, hq, 128) if hq else None), _randn(*lead, hk, 128)
        calls.append(_call(q, k, f, layout) if hq else _call(k, None, f, layout))
    return calls, (hq + hk) * math.prod(lead) * 128 * BF16.itemsize


def _cu_seqlens(t, n):
    """int32 cu_seqlens of ``t`` tokens in ``n`` sequences of random lengths (at least one token
    each; the generator seeded with ``n``)."""
    g = torch.Generator().manual_seed(n)
    cuts = torch.sort(torch.randperm(t - 1, generator=g)[: n - 1] + 1).values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([t])]).to(torch.int32).cuda()


def seq_case(case, f):
    """Calls on SETS input sets of a ``--limit seqs`` case: thd q (and k) of ``tokens`` tokens in
    ``n`` sequences of random lengths; and the bytes of one set's inputs."""
    t, hq, hk, n = case
    cu = _cu_seqlens(t, n)
    calls = []
    for _ in range(SETS):
        q, k = _randn(t, hq, 128), (_randn(t, hk, 128) if hk else None)
        calls.append(_call(q, k, f, "thd", cu_seqlens=cu))
    return calls, (hq + hk) * t * 128 * BF16.itemsize


def mixed_case(case, _):
    """Calls on SETS input sets of a ``--limit mixed`` case, with its own table (rotary width d2),
    and the bytes of one set's inputs."""
    layout, lead, hq, hk, d, d2, il, dtype = case
    rows = lead[0] if layout == "thd" else max(lead)
    f = torch.from_numpy(cupy_rope.rope_freqs(d2, rows, interleaved=il)).cuda().reshape(rows, 1, 1, d2)
    kw = dict(interleaved=il, **({"cu_seqlens": _cu_seqlens(lead[0], 16)} if layout == "thd" else {}))
    calls = []
    for _ in range(SETS):
        q, k = _randn(*lead, hq, d, dtype=dtype), (_randn(*lead, hk, d, dtype=dtype) if hk else None)
        calls.append(_call(q, k, f, layout, **kw))
    return calls, (hq + hk) * math.prod(lead) * d * dtype.itemsize


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", choices=sorted(LIMITS), default="heads", help="which limit to vary")
    ap.add_argument("--values", help="values of the limit, comma-separated (mixed: '|'-separated define "
                    "sets; default: by --limit)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--defines", default="", help="kernel build defines for the whole run, ';'-separated "
                    "(as run.py --tune DEFINES=...), e.g. a patch's -DCUPY_TMP_... variant")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    base = tuple(d for d in a.defines.split(";") if d)
    _kernels.DEFINES = base
    attr, default, sep = LIMITS[a.limit]
    values = (a.values or default).split(sep)
    cases, make = {"heads": (HEAD_CASES, head_case), "mixed": (MIXED_CASES, mixed_case)}.get(
        a.limit, (SEQ_CASES, seq_case))
    _api._launch_gpu = _recording_launch
    torch.manual_seed(0)
    f = None  # the heads and seqs cases' table (d 128); the mixed cases make their own
    if a.limit != "mixed":
        rows = max(c[0] for c in SEQ_CASES.values())
        f = torch.from_numpy(cupy_rope.rope_freqs(128, rows)).cuda().reshape(rows, 1, 1, 128)
    res = {}
    for name, case in cases.items():
        calls, size = make(case, f)
        nbytes = 2 * size  # the inputs' bytes, read and written
        src = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(SETS)]
        dst = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(SETS)]
        r = {"kernel": {}, "us": {str(v): [] for v in values}, "copy_us": []}
        outs = []
        for v in values:
            set_limit(attr, v, base)
            KERNELS.clear()
            outs.append(calls[0]())
            r["kernel"][str(v)] = KERNELS[0][0] if KERNELS else None
        r["bit_identical"] = all(torch.equal(x, y) for out in outs[1:] for x, y in zip(outs[0], out))
        for _ in range(a.rounds):
            for v in values:
                set_limit(attr, v, base)
                r["us"][str(v)].append(round(graph_time(calls), 2))
            r["copy_us"].append(round(graph_time([lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)]), 2))
        res[name] = r
        med = {v: statistics.median(t) for v, t in r["us"].items()}
        print(f"{name}: " + ", ".join(f"{v or '(none)'}: {r['kernel'][v]} {m:.2f} us" for v, m in med.items())
              + f"; copy {statistics.median(r['copy_us']):.2f} us; bit-identical {r['bit_identical']}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "limit": attr, "defines": list(base),
                       "cases": res}, fh, indent=1)


if __name__ == "__main__":
    main()

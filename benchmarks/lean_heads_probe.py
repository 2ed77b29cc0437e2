"""A/B of the lean kernel's head limit (``_worksplit._LEAN_MIN_HEADS``) on q+k launches of
grouped-query attention (a k of few heads) and on tensors of 8-12 heads, bf16, d 128, angle table.

    python benchmarks/lean_heads_probe.py [--values 16,8] [--rounds 5] [--json FILE]

Per case: the kernel each value launches, whether the outputs are bit-identical across values,
and device µs per call from CUDA-graph replays (``benchmark.graph_time``) of six distinct input
sets (so that L2 does not hold them), the values' rounds interleaved, with a copy of the same bytes.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import cupy_rope  # noqa: E402
from cupy_rope import _api, _launch, _worksplit  # noqa: E402
from cupy_rope._dev.benchmark import graph_time  # noqa: E402

# name: (layout, token dims, q heads (0: k alone), k heads, q and k views of one fused projection)
CASES = {
    "sbhd q32+k8 4096x2": ("sbhd", (4096, 2), 32, 8, False),
    "bshd q32+k8 2x4096": ("bshd", (2, 4096), 32, 8, False),
    "sbhd q32+k8 views of a fused projection": ("sbhd", (4096, 2), 32, 8, True),
    "bshd q64+k8 1x8192": ("bshd", (1, 8192), 64, 8, False),
    "bshd k8 alone 2x8192": ("bshd", (2, 8192), 0, 8, False),
    "sbhd q12+k12 4096x4": ("sbhd", (4096, 4), 12, 12, False),
}
SETS = 6
KERNELS = []  # (kernel, grid, block) of each launch the Python path makes
_launch_gpu = _api._launch_gpu


def _recording_launch(spec, *args):
    KERNELS.append((spec.name, spec.grid, spec.block))
    return _launch_gpu(spec, *args)


def set_min_heads(v: int) -> None:
    """The limit for this process; the launch caches dropped (their launches were planned with the
    previous limit): the debug switch clears the C++ caches, then the Python one."""
    _worksplit._LEAN_MIN_HEADS = v
    cupy_rope.set_debug(True)
    cupy_rope.set_debug(False)
    _launch._CACHE.clear()


def inputs(lead, hq, hk, fused):
    """q (None: k alone) and k, bf16 random, contiguous or views of one fused projection."""
    if fused:
        p = torch.randn(*lead, (hq + 2 * hk) * 128, device="cuda", dtype=torch.bfloat16)
        q = p[..., : hq * 128].unflatten(-1, (hq, 128))
        k = p[..., hq * 128: (hq + hk) * 128].unflatten(-1, (hk, 128))
    else:
        q = torch.randn(*lead, hq, 128, device="cuda", dtype=torch.bfloat16) if hq else None
        k = torch.randn(*lead, hk, 128, device="cuda", dtype=torch.bfloat16)
    return q, k


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", default="16,8", help="comma-separated _LEAN_MIN_HEADS values")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    values = [int(v) for v in a.values.split(",")]
    _api._launch_gpu = _recording_launch
    torch.manual_seed(0)
    f = torch.from_numpy(cupy_rope.rope_freqs(128, 8192)).cuda().reshape(8192, 1, 1, 128)
    res = {}
    for name, (layout, lead, hq, hk, fused) in CASES.items():
        sets = [inputs(lead, hq, hk, fused) for _ in range(SETS)]
        nbytes = sum(t.numel() for t in sets[0] if t is not None) * 2 * 2  # read and written, bf16
        src = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(SETS)]
        dst = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(SETS)]
        if hq:
            calls = [lambda q=q, k=k: cupy_rope.apply_rope_qk(q, k, f, layout) for q, k in sets]
        else:
            calls = [lambda k=k: (cupy_rope.apply_rope(k, f, layout),) for _, k in sets]
        r = {"kernel": {}, "us": {str(v): [] for v in values}, "copy_us": []}
        outs = []
        for v in values:
            set_min_heads(v)
            KERNELS.clear()
            outs.append(calls[0]())
            r["kernel"][str(v)] = KERNELS[0][0] if KERNELS else None
        r["bit_identical"] = all(torch.equal(x, y) for out in outs[1:] for x, y in zip(outs[0], out))
        for _ in range(a.rounds):
            for v in values:
                set_min_heads(v)
                r["us"][str(v)].append(round(graph_time(calls), 2))
            r["copy_us"].append(round(graph_time([lambda s=s, d=d: d.copy_(s) for s, d in zip(src, dst)]), 2))
        res[name] = r
        med = {v: statistics.median(t) for v, t in r["us"].items()}
        print(f"{name}: " + ", ".join(f"{v}: {r['kernel'][v]} {m:.2f} us" for v, m in med.items())
              + f"; copy {statistics.median(r['copy_us']):.2f} us; bit-identical {r['bit_identical']}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "cases": res}, fh, indent=1)


if __name__ == "__main__":
    main()

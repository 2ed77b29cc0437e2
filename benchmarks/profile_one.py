"""A few launches of one benchmark row, for a profiler (ncu) to look at.

    ncu --clock-control none --kernel-name regex:'^(rope|qkv|copy16)' --launch-skip 2 \
        --launch-count 1 --section SpeedOfLight python3 benchmarks/profile_one.py ROW [fwd|bwd|copy] [TUNE]

TUNE: the library's tuning, as benchmarks/run.py --tune takes it (e.g. LEAN=1). The serving rows
(positions API, 11 and 12) take fwd or bwd (the inverse rotation); their copy is not here.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from cupy_rope._dev import benchmark as B  # noqa: E402


def main():
    rid = int(sys.argv[1])
    what = sys.argv[2] if len(sys.argv) > 2 else "fwd"
    if len(sys.argv) > 3:
        import argparse

        B.apply_tuning(sys.argv[3], argparse.ArgumentParser())
    spec = {r: s for r, _, s in B.SHAPES}[rid]
    if spec.get("serving"):  # the positions API: q and k in place, in one launch
        import cupy_rope

        pos, qs, ks, cache, d, _ = B.serving_inputs(spec)
        for i in range(4):
            cupy_rope.apply_rope_pos(pos, qs[i % len(qs)], ks[i % len(ks)], cos_sin_cache=cache, head_size=d,
                                     inverse=what == "bwd", inplace=True)
        torch.cuda.synchronize()
        return
    p = B.Problem(spec)
    if what == "copy":
        half = (p.bytes // 2 + 15) // 16 * 16
        src = torch.empty(half, dtype=torch.uint8, device="cuda")
        dst = torch.empty(half, dtype=torch.uint8, device="cuda")
        kcopy = B.copy_kernel(half)
        for _ in range(4):
            kcopy(src, dst)
    else:
        fn = B._ours(p, what, "torch")
        for i in range(4):
            fn(i % p.nbuf)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

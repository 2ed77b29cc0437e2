"""Per op inside a jitted chain: where JAX's cost goes (a development probe, not a benchmark of record).

    python benchmarks/jax_chain_probe.py [--json FILE] [CASE ...]

A case is ``NAME`` or ``NAME:ENV=VALUE,ENV=VALUE`` (environment for that case's process, e.g.
``nopdl:CUPY_ROPE_PDL=0`` or ``cc:XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL``;
XLA_FLAGS values are added to the environment's). Each case runs
in its own process (XLA reads its flags once) and times, at the per-call benchmark's decode shape
([1, 64, 32, 128] bf16, offsets, ``benchmarks/model.py --percall``), a jitted chain of 16 calls of:
cupy_rope through the FFI handler, cupy_rope through the command-buffer callback, and the formula;
it prints µs per op and, from XLA's own log (``TF_CPP_VMODULE=command_buffer_conversion_pass=3``,
set for the case's process), the thunks of each command buffer XLA made of each chain: XLA turns
runs of thunks into command buffers (CUDA graphs) after optimization, so the optimized HLO does
not show them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

N = 16


def _child() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import cupy_rope
    import cupy_rope.jax as crj
    from cupy_rope import _xla

    s, b, h, d, max_pos = 1, 64, 32, 128, 4096
    rng = np.random.default_rng(0)
    f = jnp.asarray(cupy_rope.rope_freqs(d, max_pos))
    sp = jnp.asarray(rng.integers(0, max_pos - 1, b).astype(np.int32))
    x = jnp.asarray(rng.uniform(-1, 1, (s, b, h, d)).astype(np.float32)).astype(jnp.bfloat16)
    ang = np.asarray(f).reshape(max_pos, d)[np.asarray(sp)][None, :, None, :]
    cos, sin = jnp.asarray(np.cos(ang)).astype(jnp.bfloat16), jnp.asarray(np.sin(ang)).astype(jnp.bfloat16)

    def chain(fn, name):
        def run(t):
            for _ in range(N):
                t = fn(t)
            return t
        run.__name__ = f"chain_{name}"  # XLA's module: jit_chain_<name>
        return run

    def formula(t):
        return t * cos + jnp.concatenate([-t[..., d // 2:], t[..., : d // 2]], -1) * sin

    def ours(t):
        return crj.apply_rope(t, f, start_positions=sp)

    def per_op(fn):
        jax.block_until_ready(fn(x))
        best = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(50):
                out = fn(x)
            jax.block_until_ready(out)
            best.append((time.perf_counter() - t0) / 50 / N * 1e6)
        return float(np.median(best))

    res = {"ffi": _xla.ffi_library() is not None}
    for name, setup in (("formula", None), ("ffi", True), ("cb_callback", False)):
        if setup is not None:
            _xla.FFI = setup
        fn = jax.jit(chain(formula if name == "formula" else ours, name))
        res[name + "_us"] = per_op(fn)
        text = fn.lower(x).compile().as_text()
        res[name + "_custom_calls"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    _xla.FFI = True
    return res


def command_buffers(log: str) -> dict:
    """{XLA module: [[thunk, ...] per command buffer]} from XLA's command-buffer conversion log."""
    out: dict = {}
    module = None
    for line in log.splitlines():
        m = re.search(r"Module (\S+) CommandBufferConfig", line)
        if m:
            module = m.group(1)
            out.setdefault(module, [])
        m = re.search(r"Creating command buffer thunk with the following thunks: (.*)", line)
        if m and module is not None:
            out[module].append([t.strip() for t in m.group(1).split(",")])
    return out


def main() -> None:
    if os.environ.get("CHAIN_PROBE_CHILD"):
        print("RESULT " + json.dumps(_child()))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=["default"])
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for case in args.cases:
        name, _, envs = case.partition(":")
        env = dict(os.environ)
        for kv in filter(None, re.split(r",(?=[A-Za-z_]\w*=)", envs)):  # a value may hold commas
            k, _, v = kv.partition("=")
            env[k] = (env.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
        env.update(CHAIN_PROBE_CHILD="1", TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=",".join(
            filter(None, [env.get("TF_CPP_VMODULE"), "command_buffer_conversion_pass=3"])))
        p = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        row = dict(case=name, env=envs, **(json.loads(line[-1][7:]) if line else {"error": p.stderr[-2000:]}))
        buffers = command_buffers(p.stderr)
        for v in ("formula", "ffi", "cb_callback"):
            row[v + "_command_buffers"] = buffers.get(f"jit_chain_{v}", [])
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

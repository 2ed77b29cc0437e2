"""What XLA makes of the JAX model benchmark's step (a development probe, not a benchmark of record).

    python benchmarks/xla_probe.py OUTDIR [config] [kind]

Dumps the optimized HLO of the model benchmark's jitted step (``benchmarks/model.py``, both
variants: the formula and cupy_rope) into ``OUTDIR/<variant>/``, and prints per variant the
operations of the optimized module's entry computation that launch work (fusions by kind, custom
calls by target, copies), how many command-buffer computations XLA formed, and the step time.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
config = sys.argv[2] if len(sys.argv) > 2 else "decode"
kind = sys.argv[3] if len(sys.argv) > 3 else "infer"
variant = os.environ.get("PROBE_VARIANT")
if variant is None:  # one process per variant: XLA reads its flags once
    import subprocess

    for v in ("formula", "cupy_rope"):
        subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=dict(os.environ, PROBE_VARIANT=v), check=True)
    sys.exit(0)
dump = out / variant
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
                           " --xla_dump_hlo_pass_re=^$ --xla_dump_hlo_module_re=.*jit.*")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402

step, sync = M._jax_step(M.CONFIGS[config], variant, kind)
for _ in range(5):
    sync(step())
t = time.perf_counter()
for _ in range(50):
    last = step()
sync(last)
ms = (time.perf_counter() - t) / 50 * 1e3
final = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)[-1]
text = final.read_text()
entry = text[text.index("ENTRY"):]
print(f"==== {variant} {config} {kind}: {ms:.3f} ms/step, module {final.name}")
counts: dict = {}
for line in entry.splitlines():
    m = re.search(r" (fusion|custom-call|copy|transpose|call)\(", line)
    if not m:
        continue
    target = re.search(r'custom_call_target="([^"]+)"', line)
    callee = re.search(r"calls=%?([A-Za-z_]+)", line)
    name = target.group(1) if target else (f"{m.group(1)} {callee.group(1)}" if callee else m.group(1))
    counts[name] = counts.get(name, 0) + 1
for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
    print(f"  {n:4d}  {name}")
buffers = set(re.findall(r"%command_buffer[\w.]*", text))
print(f"  command-buffer computations: {len(buffers)}")

#!/usr/bin/env bash
# One H200 session step: GPU suite, then benchmarks (and tuning variants given as
# "NAME:KEY=VAL,KEY=VAL" arguments, see benchmarks/run.py --tune). Output files go to $OUT.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false CUPY_CACHE_DIR=/tmp/cupy_cache PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
MODE=${MODE:-all}
if [[ $MODE == *tests* || $MODE == all ]]; then
  # TEST_K=gpu: only the tests that skip without a device, for a short device window; the
  # default also runs the rest (on the CPU they pass in CI)
  timeout ${TEST_TIMEOUT:-450} python3 -m pytest -q -p no:cacheprovider --maxfail=20 tests/test_gpu.py tests/test_gpu_shims.py \
    tests/test_fuzz.py tests/test_instantiations.py tests/test_docs.py tests/test_positions.py tests/test_torch_ext.py tests/test_launch_cache.py -k "${TEST_K:-gpu or not fuzz}" \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -12
fi
if [[ $MODE == *bench* || $MODE == all ]]; then
  timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/run.py ${BENCH_ARGS:---quick --no-peers} --json "$OUT/bench.json" --md "$OUT/bench.md" --plot "$OUT/bench.png" 2>&1 | tail -32
fi
if [[ $MODE == *model* ]]; then
  timeout ${MODEL_TIMEOUT:-400} python3 benchmarks/model.py --json "$OUT/model.json" ${MODEL_ARGS:-} 2>&1 | grep -v "^model:" | tail -60
fi
if [[ $MODE == *main* ]]; then
  timeout 200 python3 -m cupy_rope --json "$OUT/main.json" 2>/dev/null | tee "$OUT/main.log" | tail -9
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_notebooks.py tests/test_main.py 2>&1 | tail -3
fi
if [[ $MODE == *sanitize* ]] && command -v compute-sanitizer >/dev/null; then
  # the fuzz of every entry point under memcheck, memory pools off so that a read past a small
  # (index) array leaves its allocation (SAN_BACKENDS adds e.g. jax: XLA's platform allocator)
  for b in ${SAN_BACKENDS:-cupy torch-cuda}; do
    PYTHONPATH=$PWD PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-200} compute-sanitizer --tool memcheck --error-exitcode 9 \
      python3 tests/fuzz.py --backend $b --seeds ${SAN_SEEDS:-0:400} --no-pool 2>&1 | tee "$OUT/memcheck_$b.log" \
      | grep -E "^fuzz|ERROR SUMMARY|FAIL seed|Invalid" | head -8
  done
fi
if [[ $MODE == *probe* ]]; then
  # benchmarks/access_probe.py --rope on the suite's rows 1, 2 and 7 (sbhd; bshd 8 heads; d 80)
  for n in 1 2 7; do
    case $n in 1) args="";; 2) args="--tokens 16384 --heads 8 --positions 8192 --pdiv 1";; 7) args="--d 80";; esac
    echo "== probe row $n"
    timeout ${PROBE_TIMEOUT:-120} python3 benchmarks/access_probe.py --rope $args --json "$OUT/probe_row$n.json" 2>&1 | tail -45
  done
fi
if [[ $MODE == *mixed* ]]; then
  # the mixed kernels' builds (ring depth, register budget) on partial-rotary launches, each build
  # loaded in turn, outputs compared bit for bit: the old build (depth 2, 64 registers), depth 1
  # with 64, depth 2 with 80, the default (depth 1, 80) (benchmarks/NOTES.md, 37th session)
  timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/lean_limits_probe.py --limit mixed --json "$OUT/mixed_probe.json" \
    --values="${MIXED_VALUES:--DCUPY_ROPEM_ASYNC_DEPTH=2;-DCUPY_ROPEM_MIN_BLOCKS=4|-DCUPY_ROPEM_MIN_BLOCKS=4|-DCUPY_ROPEM_ASYNC_DEPTH=2|}" 2>&1 | tail -12
fi
if [[ $MODE == *leanrows* ]]; then
  # the lean kernel's rows per thread: 4 (main) against 2, interleaved (NOTES.md: 2 wins on an
  # H100's lean rows, 4 on the H200's, by 4-9%, in the eighteenth and twenty-eighth sessions)
  ROUNDS=${ROUNDS:-2} ROWS=${ROWS:-1,3,6,7,8} bash benchmarks/ab_defines.sh "base:" "r2:DEFINES=-DCUPY_ROPE_LEAN_ROWS=2"
fi
if [[ $MODE == *techeck* ]]; then
  # TransformerEngine's own RoPE test file against cupy_rope.te: a local harness in .te_check/ (not
  # in git: TE's code; pass it with the device call's carry; benchmarks/NOTES.md says how it is made)
  if [ -f .te_check/test_fused_rope.py ]; then
    PYTHONPATH=$PWD/.te_check:$PWD${PYTHONPATH:+:$PYTHONPATH} timeout ${TE_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider \
      .te_check/test_fused_rope.py 2>&1 | tee "$OUT/te_test_fused_rope.log" | tail -3
  else
    echo "techeck: no .te_check/test_fused_rope.py (carry it)"
  fi
fi
for v in "$@"; do
  name=${v%%:*}; envs=${v#*:}
  echo "== variant $name ($envs)"
  timeout ${VAR_TIMEOUT:-60} python3 benchmarks/run.py --quick --no-peers --tune "$envs" --rows ${VAR_ROWS:-1,2,4,5,6,9} \
    --json "$OUT/var_$name.json" 2>&1 | grep "^| [0-9]" | cut -d'|' -f2,3,5,6 | head -10
done

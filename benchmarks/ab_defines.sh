#!/usr/bin/env bash
# Interleaved A/B of kernel build variants on the H200: ROUNDS rounds, each running every variant
# once in turn ("name:TUNE" arguments, TUNE as benchmarks/run.py --tune takes it; "base:" = none).
# Prints "variant row fwd bwd copy" lines; JSON per run under $OUT/ab/.
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupy_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ab"
for r in $(seq 1 ${ROUNDS:-2}); do
  for v in "$@"; do
    name=${v%%:*}; tune=${v#*:}
    j="$OUT/ab/${name}_r$r.json"
    timeout ${VAR_TIMEOUT:-90} python3 benchmarks/run.py --quick --no-peers --rows ${ROWS:-1,2,3,7,12} \
      ${tune:+--tune "$tune"} --json "$j" > "$OUT/ab/${name}_r$r.log" 2>&1 \
      || { echo "$name r$r FAILED:"; tail -5 "$OUT/ab/${name}_r$r.log"; continue; }
    python3 - "$j" "$name" "$r" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for row in d.get("rows", []):
    f, b = row["fwd"] or {}, row.get("bwd") or {}
    print(sys.argv[2], "r" + sys.argv[3], row["id"], "%.2f %.2f copy %.2f" % (
        f.get("device_us", 0), b.get("device_us", 0), row["copy_us"]))
PY
  done
done

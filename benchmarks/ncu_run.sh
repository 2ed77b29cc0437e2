#!/usr/bin/env bash
# Nsight Compute on a few benchmark rows (device tool): NAME:DIR:ROW:WHAT[:ENV=V,ENV=V] ...
# DIR: the checkout to run from (. or a copy of an older tree). Reports go to $OUT. NCU_EXTRA: more
# metrics (e.g. local memory: l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum).
export PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=/tmp/cupy_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=smsp__average_warps_issue_stalled_
METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,launch__registers_per_thread,launch__occupancy_limit_registers,sm__inst_executed_pipe_lsu.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,lts__t_sector_hit_rate.pct
for r in long_scoreboard short_scoreboard wait math_pipe_throttle lg_throttle mio_throttle drain no_instruction not_selected selected dispatch_stall imc_miss branch_resolving barrier membar tex_throttle; do
  METRICS=$METRICS,${M}${r}_per_issue_active.ratio
done
METRICS=$METRICS${NCU_EXTRA:+,$NCU_EXTRA}  # more metrics, comma-separated
for spec in "$@"; do
  IFS=: read -r name dir row what envs <<< "$spec"
  echo "== $name ($dir row $row $what $envs)"
  ( cd "$dir" && env $(echo "$envs" | tr ',' ' ') timeout 120 ncu --clock-control none \
      --kernel-name regex:'^(rope|qkv|copy16)' --launch-skip 2 --launch-count 1 --metrics "$METRICS" \
      python3 "$(ls benchmarks/profile_one.py profile_one.py 2>/dev/null | head -1)" "$row" "$what" ) > "$OUT/ncu_$name.txt" 2>&1
  grep -E "^\s+(gpu__time|dram__|sm__warps|smsp__issue|smsp__inst|launch__|sm__inst|l1tex|lts__|smsp__average)" "$OUT/ncu_$name.txt" \
    | awk '{printf "%s=%s ", $1, $NF} END {print ""}' | sed 's/smsp__average_warps_issue_stalled_//g; s/_per_issue_active.ratio//g'
done

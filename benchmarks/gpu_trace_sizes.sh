#!/usr/bin/env bash
# Where does a transfer's time go under load? Traces the transport bench (16 in flight)
# at 1 and 32 MiB with both enqueue modes and prints the per-hop medians of the middle
# transfers (steady state) and the average overlap.
#   run (kind nvidia-h200-x2, carry .whl .whl2):  bash benchmarks/gpu_trace_sizes.sh
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
T=/tmp/trace; rm -rf $T; mkdir -p $T
for m in 0 1; do for s in 1 32; do
  AIOKV_NCCL_BLOCKING_OPS=$m AIOKV_TRACE=$T/b${m}s$s timeout 60 python3 -m aiokv bench transport \
    --transport nccl --json --loop uvloop --sizes $s --window 16 --reps 1 2>/dev/null \
    | sed "s/^{/{\"blocking_ops\": $m, /" | tee -a "$OUT/bench.jsonl" | cut -c1-220
  echo "== ${s} MiB, 16 in flight, blocking_ops=$m"
  python3 benchmarks/trace_report.py $T/b${m}s$s.*.json --last 400
done; done 2>&1 | tee "$OUT/traces.txt"

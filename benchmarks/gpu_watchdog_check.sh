#!/usr/bin/env bash
# The bidirectional test "cold" (AIOKV_TEST_COLD=1: the workers first-launch kernels while NCCL
# traffic flows; 1 run in 3 hung in s9r1) with a 5 s loop watchdog, N times. Each run ends as:
# passed, "BIDIR {error...}", or a hang (the test's 90 s bound; stacks in $OUT/wd_<i>.txt); the
# count of watchdog log lines says whether the stuck loop was reported. Run s9r8 used it when
# the watchdog still aborted the communicators: the abort did not free the stuck loop.
#   run (kind nvidia-h200-x2, carry .whl .whl2):  bash benchmarks/gpu_watchdog_check.sh [N] [BUDGET]
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
N="${1:-6}"; BUDGET="${2:-200}"; start=$SECONDS
for i in $(seq 1 "$N"); do
  if (( SECONDS - start > BUDGET )); then echo "run $i: skipped (budget)"; continue; fi
  t0=$SECONDS
  AIOKV_TEST_COLD=1 AIOKV_TEST_WATCHDOG=5 timeout 150 python3 -m pytest $P \
    tests/gpu/test_engine_nccl_gpu.py -k bidirectional > "$OUT/wd_$i.txt" 2>&1
  echo "run $i: rc=$? $((SECONDS - t0)) s $(grep -o 'BIDIR {.*' "$OUT/wd_$i.txt" | head -1) $(grep -c 'event loop has been stuck' "$OUT/wd_$i.txt") watchdog log line(s)"
done

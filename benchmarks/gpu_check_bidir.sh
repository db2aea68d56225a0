#!/usr/bin/env bash
# First thing for the next GPU session: does the bidirectional NCCL test hang?
# Runs it N times (default 5) on the device; a hang fails within ~2 min and leaves both
# workers' Python stacks (SIGUSR1 → faulthandler) in $OUT/bidir_<i>.txt.
#   run (kind nvidia-h200-x2, carry .whl .whl2):  bash benchmarks/gpu_check_bidir.sh [N]
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
N="${1:-5}"
for i in $(seq 1 "$N"); do
  timeout 150 python3 -m pytest $P tests/gpu/test_engine_nccl_gpu.py -k bidirectional > "$OUT/bidir_$i.txt" 2>&1
  echo "run $i: rc=$? $(grep -Eo '[0-9]+ (passed|failed)' "$OUT/bidir_$i.txt" | tr '\n' ' ')"
done

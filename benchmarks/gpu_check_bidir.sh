#!/usr/bin/env bash
# Does the bidirectional NCCL test hang, and does launching kernels first prevent it?
# Runs tests/gpu/test_engine_nccl_gpu.py -k bidirectional in three set-ups, each in fresh
# processes (so every kernel starts unloaded):
#   cold   AIOKV_TEST_COLD=1: the workers launch new kernels while NCCL traffic flows
#   warm   the default: each worker launches every kernel it will use before it sends
#   eager  cold, but CUDA_MODULE_LOADING=EAGER (no lazy module loading at all)
# A hang fails within ~2 min and leaves both workers' stacks (SIGUSR1 threads, SIGUSR2
# tasks) in $OUT/bidir_<setup>_<i>.txt. Stops starting runs after BUDGET seconds.
#   run (kind nvidia-h200-x2, carry .whl .whl2):
#     bash benchmarks/gpu_check_bidir.sh [COLD_N] [WARM_N] [EAGER_N] [BUDGET]
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
COLD_N="${1:-3}"; WARM_N="${2:-5}"; EAGER_N="${3:-2}"; BUDGET="${4:-450}"
start=$SECONDS
one() {  # setup index env...
  local setup=$1 i=$2; shift 2
  if (( SECONDS - start > BUDGET )); then echo "$setup $i: skipped (budget)"; return; fi
  local t0=$SECONDS
  env "$@" timeout 150 python3 -m pytest $P tests/gpu/test_engine_nccl_gpu.py -k bidirectional \
    > "$OUT/bidir_${setup}_$i.txt" 2>&1
  local rc=$?
  echo "$setup $i: rc=$rc $((SECONDS - t0)) s $(grep -Eo '[0-9]+ (passed|failed)' "$OUT/bidir_${setup}_$i.txt" | tr '\n' ' ') $(grep -o 'BIDIR {[^}]*}' "$OUT/bidir_${setup}_$i.txt" | head -1)"
}
for i in $(seq 1 "$WARM_N"); do one warm "$i"; done
for i in $(seq 1 "$COLD_N"); do one cold "$i" AIOKV_TEST_COLD=1; done
for i in $(seq 1 "$EAGER_N"); do one eager "$i" AIOKV_TEST_COLD=1 CUDA_MODULE_LOADING=EAGER; done

#!/usr/bin/env bash
# Session 14: the IPC plane's first mapping (benchmarks/ipc_first_mapping.py), with a
# cold Triton cache and again warm, then the one-GPU suite (unless SKIP_TESTS=1).
#   device: TAG=s14d bash benchmarks/gpu_s14c.sh   (carry .whl .whl2)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s14c}"
TRITON_CACHE_DIR=$(mktemp -d)
export TRITON_CACHE_DIR
for i in 1 2; do
  timeout 120 python3 benchmarks/ipc_first_mapping.py --json 2>>"$OUT/$TAG-err.txt" | tail -1 | tee -a "$OUT/$TAG-first-mapping.jsonl"
done
unset TRITON_CACHE_DIR
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest $P -rfE --durations=8 -m "gpu and not multi_gpu" tests/gpu > "$OUT/$TAG-gpu-tests.txt" 2>&1
  tail -8 "$OUT/$TAG-gpu-tests.txt"
fi

#!/usr/bin/env bash
# Session 15 on ONE H200 (nvidia-h200): the armed-copy probe (benchmarks/ipc_armed_probe.py),
# then (unless SKIP_S14=1) the one-GPU suite and the demo over IPC and TCP (gpu_s14.sh).
#   device: TAG=s15a bash benchmarks/gpu_s15.sh   (carry .whl .whl2)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s15}"
while read -r args; do
  [ -n "$args" ] || continue
  timeout 200 python3 benchmarks/ipc_armed_probe.py $args 2>&1 | tee -a "$OUT/$TAG-armed-probe.jsonl" | tail -c 1500
done <<< "${PROBE_LINES:-$'--gap-ms 0.5\n--gap-ms 5 --iters 100\n--gap-ms 0.5 --mib 32'}"
if [ "${SKIP_S14:-0}" != 1 ]; then
  TAG="$TAG" bash "$(dirname "${BASH_SOURCE[0]}")/gpu_s14.sh"
fi

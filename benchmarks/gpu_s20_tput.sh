#!/usr/bin/env bash
# Session 20 on ONE H200 (nvidia-h200): layer-wise throughput (bench kv --layerwise now
# saves every throughput request layer by layer, all layers in one pass) beside the
# whole-request throughput, pull and push, short and long, interleaved by round.
#   device: TAG=s20c bash benchmarks/gpu_s20_tput.sh   (carry .whl .whl2)
#   env: ROUNDS (1), LW_ONLY=1 (no whole-request rows), GPU_TESTS (test files run after)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TAG="${TAG:-s20c}"
for r in $(seq "${ROUNDS:-1}"); do
  TAG="$TAG-lw$r" GAP_MS=2 LEAD_US=3200 LAYERWISE=1 SKIP_TESTS=1 SKIP_PUSH_TESTS=1 LAT_N=60 \
    bash "$HERE/gpu_s17.sh"
  [ "${LW_ONLY:-0}" = 1 ] && continue
  TAG="$TAG-whole$r" GAP_MS=2 LEAD_US=500 SKIP_TESTS=1 SKIP_PUSH_TESTS=1 LAT_N=60 \
    bash "$HERE/gpu_s17.sh"
done
if [ -n "${GPU_TESTS:-}" ]; then  # e.g. GPU_TESTS=tests/gpu/test_ipc_layers_gpu.py
  . "$HERE/_device_env.sh"
  timeout 200 python3 -m pytest $P -rfE -m gpu $GPU_TESTS > "$OUT/$TAG-tests.txt" 2>&1
  echo "tests rc=$?"; tail -3 "$OUT/$TAG-tests.txt"
fi

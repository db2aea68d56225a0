#!/usr/bin/env bash
# Session 20 on ONE H200 (nvidia-h200), one call: the final tree of session 19 (the
# shared FinePoll) on the GPU. (1) the push GPU tests, then layer-wise latency from
# the GPU ready (32 layers, 3.2 ms of GPU work, pull and push); (2) whole-request
# latency from the GPU ready with a 0.5 ms lead (session 18's regime: must not
# regress); (3) the one-GPU suite (tests/gpu/test_finesleep_gpu.py included).
#   device: TAG=s20a bash benchmarks/gpu_s20.sh   (carry .whl .whl2; with OLD=build/old
#   carried too, every bench run is repeated with that tree, interleaved; run s20a had
#   build/old = `git archive 648158a aiokv`, session 19's final tree, so that the
#   layer-wise pull rows compare one LayerReady per layer with one per run)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TAG="${TAG:-s20a}"
start=$SECONDS
TAG="$TAG-lw" ROUNDS="${ROUNDS:-1}" GAP_MS=2 LEAD_US=3200 LAYERWISE=1 SKIP_TESTS=1 \
  bash "$HERE/gpu_s17.sh"
TAG="$TAG-whole" ROUNDS="${ROUNDS:-1}" GAP_MS=2 LEAD_US=500 SKIP_PUSH_TESTS=1 \
  BUDGET_S=$(( ${BUDGET_S:-570} - (SECONDS - start) )) bash "$HERE/gpu_s17.sh"

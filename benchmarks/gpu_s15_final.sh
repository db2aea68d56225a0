#!/usr/bin/env bash
# Session 15, end, on ONE H200 (nvidia-h200): the one-GPU suite on this tree (unless
# SKIP_TESTS=1); the demo over the IPC plane (--same-gpu --require-ipc) with the session's
# start (build/s15) and now, without and then with MPS; with MPS also the IPC latency
# bench, start vs now, interleaved (as gpu_s15_mps.sh).
#   here:   mkdir -p build/s15 && git archive <start> aiokv | tar -x -C build/s15
#   device: TAG=s15h bash benchmarks/gpu_s15_final.sh   (carry .whl .whl2 build/s15)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_device_env.sh"
TAG="${TAG:-s15}"
START="${START:-build/s15}"
{ date -u; nvidia-smi -L; python3 -c "import torch, zmq; print('torch', torch.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest $P -rfE --durations=6 -m "gpu and not multi_gpu" tests/gpu > "$OUT/$TAG-gpu-tests.txt" 2>&1
  tail -8 "$OUT/$TAG-gpu-tests.txt"
fi
demo() {  # $1: label; runs in the current directory's aiokv
  echo "== $1" | tee -a "$OUT/$TAG-demo.txt"
  COLUMNS=160 timeout 120 python3 -m aiokv demo --device cuda --same-gpu --require-ipc --prompts 16 --max-tokens 8 2>&1 | tee -a "$OUT/$TAG-demo.txt" | grep -E "outputs equal|KV plane|KV moved" | tail -3
}
demos() {
  for i in $(seq "${DEMO_ROUNDS:-1}"); do
    ( cd "$START" && export PYTHONPATH=/tmp/site:$PWD && demo "start $1" )
    demo "now $1"
  done
}
demos "no-mps"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/aiokv-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/aiokv-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d && echo "MPS started"
trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
demos "mps"
SKIP_MPS_START=1 MPS=0 TAG="$TAG" bash "$HERE/gpu_s15_mps.sh"

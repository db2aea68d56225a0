#!/usr/bin/env bash
# Session 14 on ONE H200 (nvidia-h200): the one-GPU suite (unless SKIP_TESTS=1), then the
# demo on cuda:0 with both workers on the one GPU, every request required to come over
# the IPC plane, and the same with the plane off (TCP) for comparison.
#   device: TAG=s14b bash benchmarks/gpu_s14.sh   (carry .whl .whl2)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s14}"
{ date -u; nvidia-smi -L; python3 -c "import torch, zmq; print('torch', torch.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest $P -rfE --durations=8 -m "gpu and not multi_gpu" tests/gpu > "$OUT/$TAG-gpu-tests.txt" 2>&1
  tail -8 "$OUT/$TAG-gpu-tests.txt"
fi
for i in $(seq "${DEMO_ROUNDS:-1}"); do
  COLUMNS=140 timeout 200 python3 -m aiokv demo --device cuda --same-gpu --require-ipc --prompts 16 --max-tokens 8 --keep-logs 2>&1 | tee -a "$OUT/$TAG-demo-ipc.txt" | tail -4
  COLUMNS=140 timeout 200 python3 -m aiokv demo --device cuda --same-gpu --no-ipc --prompts 16 --max-tokens 8 2>&1 | tee -a "$OUT/$TAG-demo-tcp.txt" | tail -4
done

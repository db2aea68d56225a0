#!/usr/bin/env bash
# Session 11 on ONE H200 (nvidia-h200; the two-GPU kind was not lent): the whole one-GPU
# suite on this checkout, the IPC plane's latency with the code at the session's start
# (build/base: `git archive 0343d39 aiokv | tar -x -C build/base`) and now, interleaved,
# and `aiokv bench control` (CPU only: two processes on loopback) base vs now, interleaved,
# on the GPU host's 16 idle cores -- a quieter stand-in for the 2-core CI box.
# Run (here): mkdir -p build/base && git archive 0343d39 aiokv | tar -x -C build/base
#   device: TAG=s11r1 bash benchmarks/gpu_s11.sh   (carry .whl .whl2 build)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s11}"
{ date -u; nvidia-smi -L; nproc; python3 -c "import torch, zmq; print('torch', torch.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest $P -rfE --durations=10 -m "gpu and not multi_gpu" tests/gpu > "$OUT/$TAG-gpu-tests.txt" 2>&1
  tail -15 "$OUT/$TAG-gpu-tests.txt"
fi
if [ "${SKIP_IPC:-0}" != 1 ]; then
  BENCH="-m aiokv.kv.bench --transport ipc --json --iters 3 --latency-n 150 --workload short"
  for i in 1 2; do
    ( cd build/base && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 $BENCH 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "base", /' )
    timeout 100 python3 $BENCH 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "now", /'
  done | tee "$OUT/$TAG-ipc.jsonl" | python3 "$(dirname "${BASH_SOURCE[0]}")/show_runs.py" kv
fi
for i in 1 2 3; do
  ( cd build/base && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m aiokv bench control --json 2>>"$OUT/$TAG-err.txt" | sed 's/^{/{"tree": "base", /' )
  timeout 60 python3 -m aiokv bench control --json 2>>"$OUT/$TAG-err.txt" | sed 's/^{/{"tree": "now", /'
done | tee "$OUT/$TAG-control.jsonl" | python3 "$(dirname "${BASH_SOURCE[0]}")/show_runs.py" control

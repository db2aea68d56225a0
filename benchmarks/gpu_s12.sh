#!/usr/bin/env bash
# Session 12, issue 15, on ONE H200: the one-GPU suite on this tree, then the IPC plane's
# bench (short and long, 256-token latency traced) with main's code (build/s12/main:
# `git archive main aiokv`) and this tree, interleaved, and the engine-hop probe.
#   device: cd build/s12/now && TAG=s12-ipc-r2 bash benchmarks/gpu_s12.sh   (carry build)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s12}"
{ date -u; nproc; cat REV ../main/REV; python3 -c "import torch, zmq; print('torch', torch.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest $P -rfE --durations=5 -m "gpu and not multi_gpu" tests/gpu > "$OUT/$TAG-gpu-tests.txt" 2>&1
  tail -6 "$OUT/$TAG-gpu-tests.txt"
fi
[ "${SKIP_HOP:-0}" = 1 ] || python3 benchmarks/ipc_hop.py --micro | tee "$OUT/$TAG-hop.jsonl"
[ "${SKIP_HOP:-0}" = 1 ] || timeout 120 python3 benchmarks/ipc_hop.py --json --n 300 --reps 1 --variants "${HOP_VARIANTS:-cpu,cuda,cuda+gap1,shm,shm+gap1}" 2>>"$OUT/$TAG-err.txt" | tee -a "$OUT/$TAG-hop.jsonl"
BENCH="-m aiokv.kv.bench --transport ipc --json --iters 3 --latency-n 150 --trace"
for i in $(seq "${ROUNDS:-2}"); do
  for w in ${WLS:-short long}; do
    ( cd ../main && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 $BENCH --workload $w 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "main", /' )
    timeout 100 python3 $BENCH --workload $w 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "now", /'
  done
done | tee "$OUT/$TAG-ipc.jsonl" | python3 "$(dirname "${BASH_SOURCE[0]}")/show_runs.py" kv

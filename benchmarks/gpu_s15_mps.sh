#!/usr/bin/env bash
# Session 15: the IPC plane's latency on ONE H200 with both processes as clients of an
# MPS server (one GPU context: no time-slicing between the producer's and the consumer's
# contexts, whose switch costs ~0.15 ms per request without MPS: the armed probe's
# event_hop_after_copy). start (build/s15) vs now, interleaved, traced. The MPS control
# daemon runs from a private directory and is stopped at the end.
#   device: TAG=s15g bash benchmarks/gpu_s15_mps.sh   (carry .whl .whl2 build/s15)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s15}"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/aiokv-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/aiokv-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if [ "${MPS:-1}" = 1 ]; then
  command -v nvidia-cuda-mps-control || { echo "no nvidia-cuda-mps-control"; exit 3; }
  nvidia-cuda-mps-control -d && echo "MPS started"
  trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
fi
START="${START:-build/s15}"
BENCH="-m aiokv.kv.bench --transport ipc --json --iters 3 --latency-n 150 --trace"
show='import json,sys
for l in sys.stdin:
    d=json.loads(l); print(d.get("tree"), d.get("workload"), "p50", d["p50_ms"], "p99", d["p99_ms"], "GB/s", d["aiokv_gbps"], "ring", d.get("ipc",{}).get("ring_launches"), d.get("ipc",{}).get("staged_launches")); print("  ", d.get("trace_ms")); print("  ", d.get("trace_n"))'
for i in $(seq "${ROUNDS:-1}"); do
  for w in ${WLS:-short long}; do
    ( cd "$START" && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 $BENCH --workload $w 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "start", /' )
    timeout 100 python3 $BENCH --workload $w 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "now", /'
  done
done | tee "$OUT/$TAG-ipc.jsonl" | python3 -c "$show"
tail -5 "$OUT/$TAG-err.txt"

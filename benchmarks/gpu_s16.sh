#!/usr/bin/env bash
# Session 16 on ONE H200 (nvidia-h200): the IPC plane's one-request latency under MPS
# (both processes clients of one MPS server: no context switch between them; see
# gpu_s15_mps.sh), the session's start (build/s16) vs now, interleaved and traced; then
# the one-GPU suite on this tree with what is left of a ~570 s budget (unless
# SKIP_TESTS=1). Runs s16a-c also ran "now-upload" (UPLOAD=1): AIOKV_IPC_HOST_IDS_MAX=0
# turned off commit 0886a74's in-place ids, reverted after them (no measurable gain:
# docs/benchmarks.md, "Session 16"); on later trees that variant equals "now".
#   here:   mkdir -p build/s16 && git archive <start> | tar -x -C build/s16
#   device: TAG=s16a bash benchmarks/gpu_s16.sh   (carry .whl .whl2 build/s16)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_device_env.sh"
TAG="${TAG:-s16}"
START="${START:-build/s16}"
{ date -u; nvidia-smi -L; python3 -c "import torch, zmq; print('torch', torch.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
export CUDA_MPS_PIPE_DIRECTORY=/tmp/aiokv-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/aiokv-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if [ "${MPS:-1}" = 1 ]; then
  nvidia-cuda-mps-control -d && echo "MPS started"
  trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
fi
BENCH="-m aiokv.kv.bench --transport ipc --json --iters 3 --latency-n ${LAT_N:-150}"
[ "${TRACE:-1}" = 1 ] && BENCH="$BENCH --trace"
show='import json,sys
for l in sys.stdin:
    d=json.loads(l); t=d.get("trace_ms") or {}
    print(d.get("tree"), d.get("workload"), "p50", d["p50_ms"], "ret", d.get("p50_return_ms"), "p99", d["p99_ms"], "GB/s", d["aiokv_gbps"], "ratio", d["ratio"], "ok", d["ok"], "ring", d.get("ipc",{}).get("ring_launches"), d.get("ipc",{}).get("staged_launches"))
    print("   ", {k: t[k] for k in t})'
one() {  # $1 tree label, $2 workload; runs in the current directory's aiokv
  timeout "${BENCH_TIMEOUT:-90}" python3 $BENCH --workload "$2" 2>>"$OUT/$TAG-err.txt" | tail -1 | sed "s/^{/{\"tree\": \"$1\", /"
}
for i in $(seq "${ROUNDS:-1}"); do
  for w in ${WLS:-short long}; do
    ( cd "$START" && PYTHONPATH=/tmp/site:$PWD one start "$w" )
    one now "$w"
    [ "${UPLOAD:-0}" = 1 ] && AIOKV_IPC_HOST_IDS_MAX=0 one now-upload "$w"
  done
done | tee "$OUT/$TAG-ipc.jsonl" | python3 -c "$show"
tail -3 "$OUT/$TAG-err.txt" 2>/dev/null
echo "bench done at ${SECONDS}s"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  left=$(( ${BUDGET_S:-570} - SECONDS ))
  if [ "$left" -gt 60 ]; then
    echo quit | nvidia-cuda-mps-control 2>/dev/null; trap - EXIT; echo "MPS stopped (tests run without it)"
    timeout "$left" python3 -m pytest $P -rfE --durations=6 -m "gpu and not multi_gpu" tests/gpu > "$OUT/$TAG-gpu-tests.txt" 2>&1
    echo "tests rc=$? at ${SECONDS}s"; tail -8 "$OUT/$TAG-gpu-tests.txt"
  else
    echo "no time left for the tests ($left s)"
  fi
fi

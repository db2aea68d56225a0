#!/usr/bin/env bash
# Session 17 on ONE H200 (nvidia-h200): push mode (IpcOptions(push=True)). First its
# GPU tests (tests/gpu/test_ipc_push_gpu.py, no MPS), then the one-request latency
# under MPS, pull vs push on this tree, interleaved (--latency-gap-ms so that the
# consumer's grant has landed before the producer sends; both modes get the same gap),
# then the rest of the one-GPU suite with what is left of a ~570 s budget.
#   device: TAG=s17a bash benchmarks/gpu_s17.sh   (carry .whl .whl2)
# env: ROUNDS (1), WLS ("short long"), LAT_N (150), GAP_MS (1), SKIP_PUSH_TESTS,
#      SKIP_TESTS, TRACE (1), MPS (1), MODES ("pull push"), LEAD_US (--gpu-lead-us:
#      the latency from the producer's GPU ready too, p50_ready_ms), LAYERWISE=1
#      (--layerwise: latency requests saved layer by layer; give LEAD_US=3200),
#      OLD (a directory holding an older tree's aiokv/, e.g. build/old from
#      `git archive REV aiokv | tar -x -C build/old`; carry it: each bench run is then
#      repeated with it, interleaved, labelled old-pull / old-push)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$HERE/_device_env.sh"
TAG="${TAG:-s17}"
{ date -u; nvidia-smi -L; python3 -c "import torch, zmq; print('torch', torch.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
rm -f /dev/shm/aiokv-bell-*
if [ "${SKIP_PUSH_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest $P -rfE --durations=6 -m gpu tests/gpu/test_ipc_push_gpu.py > "$OUT/$TAG-push-tests.txt" 2>&1
  echo "push tests rc=$? at ${SECONDS}s"; grep -E "passed|failed|Error|assert" "$OUT/$TAG-push-tests.txt" | tail -12
fi
export CUDA_MPS_PIPE_DIRECTORY=/tmp/aiokv-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/aiokv-mps-log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
if [ "${MPS:-1}" = 1 ]; then
  nvidia-cuda-mps-control -d && echo "MPS started"
  trap 'echo quit | nvidia-cuda-mps-control; echo "MPS stopped"' EXIT
fi
BENCH="-m aiokv.kv.bench --transport ipc --json --iters 3 --latency-n ${LAT_N:-150} --latency-gap-ms ${GAP_MS:-1}"
[ "${TRACE:-1}" = 1 ] && BENCH="$BENCH --trace"
[ -n "${LEAD_US:-}" ] && BENCH="$BENCH --gpu-lead-us $LEAD_US"
[ "${LAYERWISE:-0}" = 1 ] && BENCH="$BENCH --layerwise"
show='import json,sys
for l in sys.stdin:
    d=json.loads(l); t=d.get("trace_ms") or {}; s=d.get("ipc") or {}
    print(d.get("tree"), d.get("workload"), "p50", d["p50_ms"], "ret", d.get("p50_return_ms"), "ready", d.get("p50_ready_ms"), d.get("p50_ready_return_ms"), "p99", d["p99_ms"], "GB/s", d["aiokv_gbps"], "ratio", d["ratio"], "ok", d["ok"], "pushed", s.get("pushes_received"), "grants", s.get("grants"), "fb", s.get("fallbacks"), "wakes", s.get("event_wakes"), d.get("error", ""))
    print("   ", {k: t[k] for k in t})'
one() {  # $1 label, $2 workload, then extra flags
  lab=$1; w=$2; shift 2
  (cd "${RUN_DIR:-.}" && timeout "${BENCH_TIMEOUT:-90}" python3 $BENCH --workload "$w" "$@") 2>>"$OUT/$TAG-err.txt" | tail -1 | sed "s/^{/{\"tree\": \"$lab\", /"
}
both() {  # this tree, then (with OLD) the old one
  one "$@"
  if [ -n "${OLD:-}" ]; then
    lab=$1; shift
    RUN_DIR="$OLD" PYTHONPATH="/tmp/site:$PWD/$OLD" one "old-$lab" "$@"
  fi
}
for i in $(seq "${ROUNDS:-1}"); do
  for w in ${WLS:-short long}; do
    for mode in ${MODES:-pull push}; do
      if [ "$mode" = push ]; then both push "$w" --push; else both pull "$w"; fi
    done
  done
done | tee "$OUT/$TAG-ipc.jsonl" | python3 -c "$show"
tail -5 "$OUT/$TAG-err.txt" 2>/dev/null
echo "bench done at ${SECONDS}s"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  left=$(( ${BUDGET_S:-570} - SECONDS ))
  if [ "$left" -gt 60 ]; then
    echo quit | nvidia-cuda-mps-control 2>/dev/null; trap - EXIT; echo "MPS stopped (tests run without it)"
    timeout "$left" python3 -m pytest $P -rfE --durations=6 -m "gpu and not multi_gpu" tests/gpu --ignore=tests/gpu/test_ipc_push_gpu.py > "$OUT/$TAG-gpu-tests.txt" 2>&1
    echo "tests rc=$? at ${SECONDS}s"; tail -8 "$OUT/$TAG-gpu-tests.txt"
  else
    echo "no time left for the tests ($left s)"
  fi
fi

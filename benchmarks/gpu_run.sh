#!/usr/bin/env bash
# The GPU benchmarks and tests of aiokv, on a GPU host, from the repository root.
#
#   bash benchmarks/gpu_run.sh --fetch-wheels        # on a machine with registry access:
#                                                    # the wheels a bare GPU host lacks
#   bash benchmarks/gpu_run.sh [options]             # on the GPU host (carry .whl .whl2)
#
# Options (any combination; they run in this order):
#   --suite            the one-GPU test suite: pytest -m "gpu and not multi_gpu" tests/gpu
#   --suite-all        every GPU test (tests/gpu; the multi_gpu ones need 2 GPUs)
#   --tests FILES      these GPU test files only (quoted, space-separated)
#   --blocking         NCCL with blocking enqueues (AIOKV_NCCL_BLOCKING_OPS=1) for --bench nccl
#                      and the tests
#   --bench kv         aiokv bench kv --transport ipc, short and long, pull and push (one GPU)
#   --bench nccl       aiokv bench transport and kv over NCCL, cuda:0 -> cuda:1 (two GPUs)
#   --layerwise        with --bench kv: requests saved layer by layer (give --lead-us 3200)
#   --lead-us N        with --bench kv: latency from the producer's GPU ready, N us of GPU work
#                      queued before it (default 500; 0 = latency from the producer's call)
#   --gap-ms N         with --bench kv: the producer sends N ms after the consumer waits (2)
#   --latency-n N      with --bench kv: latency requests per run (150)
#   --rounds N         with --bench kv: repeat the runs, interleaved by mode (1)
#   --no-mps           with --bench kv: no MPS server (two processes then time-slice one GPU)
#   --trace            with --bench kv: per-stage timings of each latency request (trace_ms)
#   --batch N          with --bench kv: also step batches of N short requests over the plane,
#                      batched (send_requests / recv_requests) and --one-by-one, per round
#   --raw-nccl         the raw NCCL send/recv baseline (benchmarks/raw_nccl.py, two GPUs)
#   --doctor           aiokv doctor
#   --demo             the demo on the GPUs (aiokv.serving.demo.run --device auto)
#   --tag TAG          prefix of the output files (default: run)
# Outputs go to $OUT (default ./gpu-out): TAG-env.txt, TAG-tests.txt, TAG-kv.jsonl,
# TAG-nccl.jsonl, TAG-raw-nccl.jsonl, TAG-doctor.txt, TAG-demo.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "${1:-}" = --fetch-wheels ]; then
  # .whl = pyzmq (the engine), .whl2 = what the demo's router and workers need; both
  # folders are git-ignored. Python 3.12, manylinux x86_64.
  set -e
  PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl pyzmq==27.3.0
  python3 -m pip download -q --no-deps "${PLAT[@]}" -d .whl2 \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 uvicorn==0.54.0 \
    httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
    prometheus_client==0.26.0 typing-inspection==0.4.5 annotated-types==0.8.0 click==8.5.1 \
    idna==3.20 certifi typing_extensions==4.16.0 opentelemetry-api==1.45.2 annotated-doc \
    pygments==2.21.0
  ls .whl .whl2
  exit 0
fi

SUITE="" TESTS="" BENCH="" LAYERWISE=0 LEAD_US=500 GAP_MS=2 LAT_N=150 ROUNDS=1 MPS=1
TRACE=0 RAW=0 DOCTOR=0 DEMO=0 TAG=run BLOCKING=0 BATCH=0
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) SUITE="gpu and not multi_gpu" ;;
    --suite-all) SUITE="gpu or multi_gpu" ;;
    --tests) TESTS="$2"; shift ;;
    --blocking) BLOCKING=1 ;;
    --bench) BENCH="$BENCH $2"; shift ;;
    --layerwise) LAYERWISE=1 ;;
    --lead-us) LEAD_US="$2"; shift ;;
    --gap-ms) GAP_MS="$2"; shift ;;
    --latency-n) LAT_N="$2"; shift ;;
    --rounds) ROUNDS="$2"; shift ;;
    --no-mps) MPS=0 ;;
    --trace) TRACE=1 ;;
    --batch) BATCH="$2"; shift ;;
    --raw-nccl) RAW=1 ;;
    --doctor) DOCTOR=1 ;;
    --demo) DEMO=1 ;;
    --tag) TAG="$2"; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
  shift
done

# The carried wheels (pyzmq; the demo's web stack) on PYTHONPATH, this tree's aiokv first.
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl \
    >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export AIOKV_NCCL_BLOCKING_OPS=$BLOCKING
P="-q -s -rfE --durations=6 -W ignore::pytest.PytestConfigWarning -p no:cacheprovider"
{ date -u; nproc; nvidia-smi -L
  python3 -c "import torch, zmq; print('torch', torch.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/$TAG-env.txt"

if [ -n "$SUITE" ] || [ -n "$TESTS" ]; then
  rm -f /dev/shm/aiokv-bell-*
  if [ -n "$TESTS" ]; then sel=(-m "gpu or multi_gpu" $TESTS); else sel=(-m "$SUITE" tests/gpu); fi
  timeout 400 python3 -m pytest $P "${sel[@]}" > "$OUT/$TAG-tests.txt" 2>&1
  echo "tests rc=$? at ${SECONDS}s"; tail -8 "$OUT/$TAG-tests.txt"
fi

for b in $BENCH; do
  case "$b" in
  kv)
    # Both processes clients of one MPS server: no time-slicing between them, the closest
    # one-GPU stand-in for two GPUs.
    if [ "$MPS" = 1 ]; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/aiokv-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/aiokv-mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
    fi
    args="--transport ipc --json --iters 3 --latency-n $LAT_N --latency-gap-ms $GAP_MS"
    [ "$LEAD_US" != 0 ] && args="$args --gpu-lead-us $LEAD_US"
    [ "$LAYERWISE" = 1 ] && args="$args --layerwise"
    [ "$TRACE" = 1 ] && args="$args --trace"
    for _ in $(seq "$ROUNDS"); do
      for w in short long; do
        for mode in pull push; do
          flag=""; [ "$mode" = push ] && flag=--push
          timeout 120 python3 -m aiokv bench kv $args --workload "$w" $flag 2>>"$OUT/$TAG-err.txt" \
            | tail -1 | sed "s/^{/{\"mode\": \"$mode\", /"
        done
      done
      if [ "$BATCH" != 0 ]; then
        for how in batch one-by-one; do
          flag="--batch $BATCH"; [ "$how" = one-by-one ] && flag="$flag --one-by-one"
          timeout 120 python3 -m aiokv bench kv --transport ipc --json --workload short $flag \
            2>>"$OUT/$TAG-err.txt" | tail -1 | sed "s/^{/{\"mode\": \"$how\", /"
        done
      fi
    done | tee "$OUT/$TAG-kv.jsonl" | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        d = json.loads(line)
    except ValueError:
        print(line, end=""); continue
    print(d.get("mode"), d["workload"], "GB/s", round(d["aiokv_gbps"], 1), "raw", round(d["raw_gbps"]),
          "p50", d["p50_ms"], "from ready", d.get("p50_ready_ms"), "p99", d["p99_ms"], "ok", d["ok"])'
    if [ "$MPS" = 1 ]; then echo quit | nvidia-cuda-mps-control; trap - EXIT; fi
    ;;
  nccl)
    T="python3 -m aiokv bench transport --transport nccl --json --loop uvloop"
    { timeout 90 $T --sizes 1,4,16,32,128,512 --window 16 --reps 3
      timeout 30 $T --sizes 1 --window 64 --reps 3
      for w in short long; do
        timeout 60 python3 -m aiokv bench kv --transport nccl --workload $w --json --iters 3 | tail -1
      done
    } 2>>"$OUT/$TAG-err.txt" | sed "s/^{/{\"blocking_ops\": $BLOCKING, /" | tee "$OUT/$TAG-nccl.jsonl" | cut -c1-200
    ;;
  *) echo "unknown bench: $b (kv, nccl)" >&2 ;;
  esac
done

if [ "$RAW" = 1 ]; then
  timeout 120 python3 benchmarks/raw_nccl.py | tee "$OUT/$TAG-raw-nccl.jsonl"
fi
if [ "$DOCTOR" = 1 ]; then
  python3 -m aiokv doctor > "$OUT/$TAG-doctor.txt" 2>&1; tail -5 "$OUT/$TAG-doctor.txt"
fi
if [ "$DEMO" = 1 ]; then
  timeout 60 python3 -m aiokv.serving.demo.run --device auto > "$OUT/$TAG-demo.txt" 2>&1; tail -3 "$OUT/$TAG-demo.txt"
fi

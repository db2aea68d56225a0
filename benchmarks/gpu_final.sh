#!/usr/bin/env bash
# The figures run: transport benchmarks (default non-blocking enqueues: every size with
# 16 in flight, 1 MiB with 64, 32/128 MiB with 32; blocking enqueues: 1/32/512 MiB) and
# KV benchmarks with non-blocking (0) and blocking (1) NCCL enqueues, traced latency, the whole GPU test suite (default mode), the
# engine/fault GPU tests with blocking enqueues, and the demo.
#   run (kind nvidia-h200-x2, carry .whl .whl2):  bash benchmarks/gpu_final.sh
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
B="python3 -m aiokv bench transport --transport nccl --json --loop uvloop"
T=/tmp/trace; rm -rf $T; mkdir -p $T
tag() { sed "s/^{/{\"blocking_ops\": $1, /"; }
{ AIOKV_NCCL_BLOCKING_OPS=0 timeout 80 $B --sizes 1,4,16,32,128,512 --window 16 --reps 3 2>/dev/null | tag 0
  AIOKV_NCCL_BLOCKING_OPS=0 timeout 30 $B --sizes 1 --window 64 --reps 3 2>/dev/null | tag 0
  AIOKV_NCCL_BLOCKING_OPS=0 timeout 60 $B --sizes 32,128 --window 32 --reps 3 2>/dev/null | tag 0
  AIOKV_NCCL_BLOCKING_OPS=1 timeout 60 $B --sizes 1,32,512 --window 16 --reps 3 2>/dev/null | tag 1
} | tee "$OUT/bench_nccl.jsonl" | cut -c1-150
for m in 1 0; do for w in short long; do
  [ "$m$w" = "0long" ] && continue
  AIOKV_NCCL_BLOCKING_OPS=$m AIOKV_TRACE=$T/kv$m$w timeout 40 python3 -m aiokv.kv.bench --transport nccl \
    --workload $w --json --iters 3 2>/dev/null | tail -1 | tag $m
done; done | tee "$OUT/kv.jsonl" | cut -c1-200
for m in 1 0; do echo "== KV 256-token latency, blocking_ops=$m"
  python3 benchmarks/trace_report.py $T/kv${m}short.*.json --last 50; done | tee "$OUT/traces.txt"
timeout 200 python3 -m pytest $P --durations=5 tests/gpu/ 2>&1 | tee "$OUT/gpu_tests.txt" \
  | grep -E "passed|failed|Error|BIDIR|KILL|SIGSTOP|RESTART|MEM"
AIOKV_NCCL_BLOCKING_OPS=1 timeout 120 python3 -m pytest $P tests/gpu/test_engine_nccl_gpu.py \
  tests/gpu/test_engine_faults_gpu.py tests/gpu/test_kv_connector_gpu.py 2>&1 | tee "$OUT/gpu_tests_blocking.txt" \
  | grep -E "passed|failed|Error|SIGSTOP|MEM"
python3 -m aiokv doctor > "$OUT/doctor.txt" 2>&1
timeout 40 python3 -m aiokv.demo.run --device auto 2>&1 | tee "$OUT/demo_gpu.txt" | tail -3

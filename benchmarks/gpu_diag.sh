#!/usr/bin/env bash
# Diagnostic device run: the NCCL fault tests, the transport and KV benchmarks with
# AIOKV_TRACE timelines joined by benchmarks/trace_report.py.
#   run (kind nvidia-h200-x2, carry .whl .whl2):  bash benchmarks/gpu_diag.sh
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
timeout 150 python3 -m pytest $P tests/gpu/test_engine_faults_gpu.py 2>&1 | tee "$OUT/gpu_fault_tests.txt" \
  | grep -E "passed|failed|Error|SIGSTOP|RESTART|MEM"
B="python3 -m aiokv bench transport --transport nccl --json --loop uvloop"
T=/tmp/trace; rm -rf $T; mkdir -p $T
AIOKV_TRACE=$T/w16 timeout 60 $B --sizes 1 --window 16 --reps 1 2>/dev/null | cut -c1-160
python3 benchmarks/trace_report.py $T/w16.*.json --last 1000 | tee "$OUT/trace_1mib_w16.txt"
{ timeout 90 $B --sizes 1,4,16,32,128,512 --window 16 --reps 3 2>/dev/null
  timeout 60 $B --sizes 1 --window 64 --reps 3 2>/dev/null
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 timeout 90 $B --sizes 1,32,512 --window 16 --reps 2 2>/dev/null | sed 's/"nccl"/"nccl-socket"/'
} | tee "$OUT/bench_nccl.jsonl" | cut -c1-190
for w in short long; do
  AIOKV_TRACE=$T/kv$w timeout 60 python3 -m aiokv.kv.bench --transport nccl --workload $w --json --iters 3 2>/dev/null | tail -1
done | tee "$OUT/kv.jsonl" | cut -c1-230
python3 benchmarks/trace_report.py $T/kvshort.*.json --last 50 | tee "$OUT/trace_kv_latency.txt"

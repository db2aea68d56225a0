#!/usr/bin/env bash
# Diagnostic device run: GPU tests, raw NCCL posting-pattern variants, a cProfile of
# both bench processes on the 1 MiB stream, and the transport/KV benchmarks.
#   run (kind nvidia-h200-x2, carry .whl .whl2):  bash benchmarks/gpu_diag.sh
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="-q -s -W ignore::pytest.PytestConfigWarning -W ignore::pytest.PytestUnknownMarkWarning -p no:cacheprovider"
timeout 240 python3 -m pytest $P --durations=5 tests/gpu/ 2>&1 | tee "$OUT/gpu_tests.txt" \
  | grep -E "passed|failed|Error|BIDIR|KILL|SIGSTOP|RESTART|MEM"
for v in plain group rotate event depth group+rotate+event+depth; do
  timeout 40 python3 benchmarks/raw_nccl.py --variant $v --sizes-mib 1,128,512 --repeats 2 \
    --min-bytes-per-repeat 2147483648 2>/dev/null
done | tee "$OUT/raw_variants.jsonl" | cut -c1-110
AIOKV_BENCH_PROFILE=$OUT timeout 60 python3 -m aiokv bench transport --transport nccl --json \
  --sizes 1 --window 16 --reps 1 --loop uvloop 2>/dev/null | cut -c1-200
timeout 90 python3 -m aiokv bench transport --transport nccl --json --sizes 1,32,128,512 --window 16 \
  --reps 2 --loop uvloop 2>/dev/null | tee "$OUT/bench_nccl.jsonl" | cut -c1-200
for w in short long; do
  timeout 45 python3 -m aiokv.kv.bench --transport nccl --workload $w --json --iters 2 2>/dev/null | tail -1
done | tee "$OUT/kv.jsonl" | cut -c1-220
timeout 50 python3 -m aiokv.demo.run --device auto 2>&1 | tee "$OUT/demo_gpu.txt" | tail -3

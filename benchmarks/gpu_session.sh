#!/usr/bin/env bash
# Everything that needs the 2-GPU machine, in one device command (device time is scarce).
#   run (kind nvidia-h200-x2, carry .whl .whl2):  bash benchmarks/gpu_session.sh
# .whl / .whl2: wheels the device lacks — make them first with benchmarks/fetch_device_wheels.sh
# Writes its outputs under $OUT (or ./gpu-out) and prints a short summary.
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl .whl2/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
P="-q -s -W ignore::pytest.PytestConfigWarning -W ignore::pytest.PytestUnknownMarkWarning -p no:cacheprovider"

timeout 300 python3 -m pytest $P --durations=8 tests/gpu/ 2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "passed|failed|Error|BIDIR|KILL|SIGSTOP|RESTART|MEM|s call"
for mode in 0 1; do
  AIOKV_NCCL_BLOCKING_OPS=$mode timeout 90 python3 -m aiokv bench transport --transport nccl --json \
    --sizes 1,32,128,512 --window 16 --reps 2 --loop uvloop 2>/dev/null \
    | tee "$OUT/bench_nccl_blocking$mode.jsonl" | cut -c1-200
  AIOKV_NCCL_BLOCKING_OPS=$mode timeout 45 python3 -m aiokv.kv.bench --transport nccl --workload short --json --iters 2 2>/dev/null \
    | tail -1 | tee "$OUT/kv_short_blocking$mode.jsonl" | cut -c1-200
done
timeout 45 python3 -m aiokv.kv.bench --transport nccl --workload long --json --iters 2 2>/dev/null \
  | tail -1 | tee "$OUT/kv_long.jsonl" | cut -c1-200
timeout 50 python3 -m aiokv.demo.run --device auto 2>&1 | tee "$OUT/demo_gpu.txt" | tail -4
timeout 40 python3 benchmarks/raw_nccl.py --sizes-mib 1,32,512 --repeats 3 2>/dev/null | tee "$OUT/raw_ctypes_nccl.jsonl" | cut -c1-120

#!/usr/bin/env bash
# Session 15: the IPC plane's latency bench on THIS tree only (traced, with the count of
# latency requests per stage: which path each took), hot and after a 50 ms gap.
#   device: TAG=s15c bash benchmarks/gpu_s15b.sh   (carry .whl .whl2)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s15}"
BENCH="-m aiokv.kv.bench --transport ipc --json --iters 3 --latency-n 150 --trace"
{
for i in $(seq "${ROUNDS:-1}"); do
  for w in ${WLS:-short long}; do
    timeout 100 python3 $BENCH --workload $w 2>>"$OUT/$TAG-err.txt" | tail -1
  done
  timeout 100 python3 $BENCH --workload short --latency-gap-ms 50 --latency-n 60 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"gap": 1, /'
done
} | tee "$OUT/$TAG-ipc.jsonl" | python3 -c "
import json,sys
for l in sys.stdin:
    d=json.loads(l); print(d.get('workload'), d.get('gap'), 'p50', d['p50_ms'], 'p99', d['p99_ms'], d.get('ipc',{}).get('ring_launches')); print('  ', d.get('trace_ms')); print('  ', d.get('trace_n'))
"

#!/usr/bin/env bash
# Issue 15, second round (one request's latency, layer-wise IPC): the IPC GPU tests, then
# `aiokv.kv.bench --transport ipc` short/long with the code BEFORE this round (a copy of
# the base commit's aiokv/ in build/base, carried) and after it, same command, same run,
# interleaved; the "after" runs also stamp each latency request's stages (--trace).
#   run (kind nvidia-h200, carry .whl .whl2 build):  TAG=s11-ipc-r1 bash benchmarks/gpu_ipc2.sh
#   build/base is made here with:  mkdir -p build/base && git archive BASE aiokv | tar -x -C build/base
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s11-ipc}"
TESTS="${TESTS:-tests/gpu/test_ipc_gpu.py}"
LAT_N="${LAT_N:-200}"
{ date -u; nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
if [ -n "$TESTS" ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest $P -rA --durations=12 $TESTS ${DESELECT:-} > "$OUT/$TAG-gpu-tests.txt" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/$TAG-gpu-tests.txt" | tail -25
fi
BENCH="-m aiokv.kv.bench --transport ipc --json --iters 3 --latency-n $LAT_N"
for w in ${WORKLOADS:-short long}; do
  ( cd build/base && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 $BENCH --workload $w 2>>"$OUT/$TAG-bench-err.txt" | tail -1 | sed 's/^{/{"tree": "before", /' )
  timeout 120 python3 $BENCH --workload $w --trace 2>>"$OUT/$TAG-bench-err.txt" | tail -1 | sed 's/^{/{"tree": "after", /'
done | tee "$OUT/$TAG-kv.jsonl" | python3 -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except Exception: print(line[:300]); continue
    print(r.get('tree'), r['workload'], 'GB/s', r['aiokv_gbps'], 'raw', r['raw_gbps'], 'p50', r['p50_ms'], 'p99', r['p99_ms'], 'ok', r['ok'], r.get('error', ''))
    if 'trace_ms' in r: print('   trace_ms', r['trace_ms'])
"

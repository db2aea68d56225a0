#!/usr/bin/env bash
# Session 12, end, on ONE H200 (nvidia-h200; the two-GPU kind was not lent): the one-GPU
# suite on this tree; the IPC plane's bench (short, long; 256-token latency) with the
# session's starting code (build/s11: `git archive ea460b5 aiokv`) and now, interleaved;
# `aiokv bench control` (CPU only, two processes on loopback) start vs now, interleaved, on
# the host's 16 idle cores.
#   here:   mkdir -p build/s11 && git archive ea460b5 aiokv | tar -x -C build/s11
#   device: TAG=s12f bash benchmarks/gpu_s12_final.sh   (carry .whl .whl2 build)
# Later sessions: START=<dir of the starting tree> (default build/s11); BENCH_EXTRA (more
# bench options, both trees, e.g. --trace); GROUNDS rounds of the short workload with
# --latency-gap-ms $GAP_MS (default 50) after the others (the start tree needs a bench.py
# with that option: copy today's aiokv/kv/bench.py into it).
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s12f}"
{ date -u; nproc; nvidia-smi -L; python3 -c "import torch, zmq; print('torch', torch.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest $P -rfE --durations=5 -m "gpu and not multi_gpu" tests/gpu > "$OUT/$TAG-gpu-tests.txt" 2>&1
  tail -6 "$OUT/$TAG-gpu-tests.txt"
fi
START="${START:-build/s11}"
BENCH="-m aiokv.kv.bench --transport ipc --json --iters 3 --latency-n 150 ${BENCH_EXTRA:-}"
{
for i in $(seq "${ROUNDS:-2}"); do
  for w in short long; do
    ( cd "$START" && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 $BENCH --workload $w 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "start", /' )
    timeout 100 python3 $BENCH --workload $w 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "now", /'
  done
done
for i in $(seq "${GROUNDS:-0}"); do
  G="--workload short --latency-gap-ms ${GAP_MS:-50} --latency-n 60"
  ( cd "$START" && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 $BENCH $G 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "start", "gap": 1, /' )
  timeout 100 python3 $BENCH $G 2>>"$OUT/$TAG-err.txt" | tail -1 | sed 's/^{/{"tree": "now", "gap": 1, /'
done
} | tee "$OUT/$TAG-ipc.jsonl" | python3 "$(dirname "${BASH_SOURCE[0]}")/show_runs.py" kv
for i in $(seq "${CROUNDS:-3}"); do
  ( cd "$START" && PYTHONPATH=/tmp/site:$PWD timeout 60 python3 -m aiokv bench control --json 2>>"$OUT/$TAG-err.txt" | sed 's/^{/{"tree": "start", /' )
  timeout 60 python3 -m aiokv bench control --json 2>>"$OUT/$TAG-err.txt" | sed 's/^{/{"tree": "now", /'
done | tee "$OUT/$TAG-control.jsonl" | python3 "$(dirname "${BASH_SOURCE[0]}")/show_runs.py" control

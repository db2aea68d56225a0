#!/usr/bin/env bash
# Issue 15, second round (one request's latency, layer-wise IPC): the IPC GPU tests, then
# `aiokv.kv.bench --transport ipc` short/long with the code BEFORE this round (a copy of
# the base commit's aiokv/ in build/base) and after it, same command, same run,
# interleaved; the "after" runs also stamp each latency request's stages (--trace).
#
# The device receives the session's checkout (/work/main), not a helper's worktree, so
# runs s11-ipc-r1..r3 went like this (the scratch folder is git-ignored, removed after):
#   here:   D=/work/main/build/ipc2-s11; mkdir -p $D/new $D/base
#           git ls-files aiokv tests benchmarks pyproject.toml | tar -cf - -T - | tar -xf - -C $D/new
#           git archive 0343d39 aiokv | tar -x -C $D/base
#   device (kind nvidia-h200, carry build/ipc2-s11 .whl .whl2):
#           python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl .whl2/*.whl
#           cd build/ipc2-s11/new && mkdir -p build && ln -s ../../base build/base
#           TAG=s11-ipc-r3 TEST_TIMEOUT=110 LAT_N=150 TESTS="..." bash benchmarks/gpu_ipc2.sh
# From a checkout of this branch itself: make build/base as above and carry .whl .whl2 build.
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
done | tee "$OUT/$TAG-kv.jsonl" | python3 "$(dirname "${BASH_SOURCE[0]}")/show_runs.py" kv

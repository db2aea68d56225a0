#!/usr/bin/env bash
# The IPC plane on the GPU machine (issue 15): doctor, the IPC GPU tests (two processes,
# CUDA IPC), and `aiokv.kv.bench --transport ipc` short/long (on one GPU both processes
# share cuda:0; on two GPUs the consumer is on cuda:1 and the raw reference is NCCL).
#   run (kind nvidia-h200 or nvidia-h200-x2, carry .whl):  bash benchmarks/gpu_ipc.sh
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
TAG="${TAG:-s10-ipc}"
{ date -u; nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
timeout 60 python3 -m aiokv doctor > "$OUT/$TAG-doctor.txt" 2>&1; tail -8 "$OUT/$TAG-doctor.txt"
timeout 300 python3 -m pytest $P -rA --durations=10 tests/gpu/test_ipc_gpu.py > "$OUT/$TAG-gpu-tests.txt" 2>&1
grep -E "passed|failed|PASSED|FAILED|Error" "$OUT/$TAG-gpu-tests.txt" | tail -15
for w in short long; do
  timeout 100 python3 -m aiokv.kv.bench --transport ipc --workload $w --json --iters 3 2>>"$OUT/$TAG-bench-err.txt" | tail -1
done | tee "$OUT/$TAG-kv.jsonl" | cut -c1-400
timeout 60 python3 benchmarks/ipc_kernel.py 2>&1 | tee "$OUT/$TAG-kernel.jsonl"

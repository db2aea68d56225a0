#!/usr/bin/env bash
# Receive-batch caps against rate: the transport bench (default non-blocking enqueues,
# 16 in flight) under several AIOKV_NCCL_RECV_BATCH="count,MiB" settings.
#   run (kind nvidia-h200-x2, carry .whl .whl2):  bash benchmarks/gpu_batch_sweep.sh [caps...]
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
CAPS=("$@"); [ ${#CAPS[@]} -eq 0 ] && CAPS=("4,8" "8,128" "8,64" "16,256")
for c in "${CAPS[@]}"; do
  AIOKV_NCCL_RECV_BATCH=$c timeout 100 python3 -m aiokv bench transport --transport nccl --json \
    --loop uvloop --sizes 1,16,32,128 --window 16 --reps 3 2>/dev/null \
    | sed "s/^{/{\"recv_batch\": \"$c\", /" | tee -a "$OUT/batch_sweep.jsonl" \
    | python3 -c 'import sys,json
for l in sys.stdin:
    d=json.loads(l); print(d["recv_batch"], d["size_mib"], "MiB", d["aiokv_gbps"], "/", d["raw_gbps"], "ratio", d["ratio"], "stall_ms", d["max_loop_stall_ms"], flush=True)'
done

#!/usr/bin/env bash
# Send-group caps against rate: AIOKV_NCCL_SEND_BATCH="count,MiB" settings, 32 and 128 MiB,
# 16 and 32 in flight, default non-blocking enqueues and default receive batches.
#   run (kind nvidia-h200-x2, carry .whl .whl2):  bash benchmarks/gpu_send_sweep.sh [caps...]
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
CAPS=("$@"); [ ${#CAPS[@]} -eq 0 ] && CAPS=("64,1048576" "8,128" "4,128")
for c in "${CAPS[@]}"; do for w in 16 32; do
  AIOKV_NCCL_SEND_BATCH=$c timeout 60 python3 -m aiokv bench transport --transport nccl --json \
    --loop uvloop --sizes 32,128 --window $w --reps 3 2>/dev/null \
    | sed "s/^{/{\"send_batch\": \"$c\", /" | tee -a "$OUT/send_sweep.jsonl" \
    | python3 -c 'import sys,json
for l in sys.stdin:
    d=json.loads(l); print(d["send_batch"], d["size_mib"], "MiB w", d["window"], d["aiokv_gbps"], "/", d["raw_gbps"], "ratio", d["ratio"], flush=True)'
done; done

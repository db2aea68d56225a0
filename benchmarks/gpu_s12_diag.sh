#!/usr/bin/env bash
# Session 12, issue 15: what inflates the IPC descriptor's engine hop on the GPU host.
# Run from a staged copy (build/s12/now = this tree, build/s12/main = `git archive main aiokv`):
#   device: cd build/s12/now && TAG=s12-ipc-r1 bash benchmarks/gpu_s12_diag.sh
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/_device_env.sh"
TAG="${TAG:-s12}"
{ date -u; uname -a; nproc; cat REV 2>/dev/null; head -3 aiokv/kv/ipc.py | tail -1;
  for f in /sys/devices/system/cpu/cpu0/cpuidle/state*/name; do echo "$f $(cat $f)"; done 2>/dev/null;
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null;
  python3 -c "import torch, zmq; print('torch', torch.__version__, 'pyzmq', zmq.__version__, 'gpus', torch.cuda.device_count())"; } 2>&1 | tee "$OUT/$TAG-env.txt"
python3 benchmarks/ipc_hop.py --micro | tee "$OUT/$TAG-hop.jsonl"
timeout 200 python3 benchmarks/ipc_hop.py --json --n 300 --reps 2 \
  --variants "${HOP_VARIANTS:-cpu,cuda,cuda+spinB,cuda+spinAB,cuda+gap1,cuda+spinB+gap1,cpu+gap1,cuda+uvloop}" \
  2>>"$OUT/$TAG-err.txt" | tee -a "$OUT/$TAG-hop.jsonl"
BENCH="-m aiokv.kv.bench --transport ipc --json --iters 1 --latency-n 150 --workload short --trace"
for v in "uvloop 0" "asyncio 0" "uvloop 20"; do
  set -- $v
  AIOKV_IPC_EXP_SPIN_MS=$2 timeout 100 python3 $BENCH --loop $1 2>>"$OUT/$TAG-err.txt" | tail -1 | sed "s/^{/{\"tree\": \"now\", \"loop\": \"$1\", \"spin_ms\": $2, /"
done | tee "$OUT/$TAG-ipc.jsonl" | python3 "$(dirname "${BASH_SOURCE[0]}")/show_runs.py" kv

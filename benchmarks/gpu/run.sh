#!/usr/bin/env bash
# What runs on a lent GPU machine (one GPU; the package not installed, the machine's own torch), from the repository
# root: `bash benchmarks/gpu/run.sh` with OUT set to a folder for the logs. Two ranks share the GPU over gloo; NCCL
# runs one rank (it refuses two ranks on one device).
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import sys, torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'python', sys.version.split()[0])"
git log --oneline -1 2>/dev/null || true

echo "=== the scenario matrix on CUDA (gloo, 2 ranks on one GPU) and NCCL (1 rank) against gloo on the CPU"
timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 tests/graph/test_scenarios.py -k "cuda or nccl" 2>&1 \
  | tee "$OUT/scenarios.log" | tail -8

check() {  # NAME NPROC ARGS...: one check run, its codes and following section
  local name=$1 nproc=$2; shift 2
  timeout 150 python3 -m ddp_doctor.cli check --nproc-per-node "$nproc" --json "$OUT/$name.json" "$@" \
    >"$OUT/$name.txt" 2>&1
  echo "--- $name: exit $?"
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as exc:
    print("no report:", exc); sys.exit()
print("backend", r.get("backend"), "world", r.get("world_size"), "steps", r.get("steps_observed"))
for f in r["findings"]:
    print(" ", f["severity"], f["code"], "|", f["title"][:150])
fol = r.get("following")
if fol:
    print("  following:", {k: fol[k] for k in fol if k in ("epoch_ends", "ended_by", "followed")})
t = (r.get("timing") or {}).get("per_rank")
if t:
    print("  per_rank timing keys:", sorted(t[0]) if isinstance(t, list) else sorted(t))
PY
}

echo "=== ddp-doctor check on the GPU"
check clean_nccl 1 examples/clean.py --epochs 2
check unused_head_nccl 1 examples/unused_head.py
check epoch_end_gloo_cuda 2 benchmarks/gpu/epoch_end_cuda.py --backend gloo
check epoch_end_nccl 1 benchmarks/gpu/epoch_end_cuda.py --backend nccl --eval-batches 50

echo "=== the group timeout as following reads it, on NCCL"
MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 RANK=0 WORLD_SIZE=1 python3 -c "
import datetime, torch, torch.distributed as dist
from ddp_doctor.launch.following_run import group_timeout
torch.cuda.set_device(0)
dist.init_process_group('nccl', timeout=datetime.timedelta(seconds=20))
dist.all_reduce(torch.ones(1, device='cuda'))
print('group_timeout on nccl:', group_timeout())
dist.destroy_process_group()"

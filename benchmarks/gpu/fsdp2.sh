#!/usr/bin/env bash
# FSDP2 on a lent GPU machine (one GPU; the package not installed, the machine's own torch, Accelerate and
# transformers), from the repository root: `bash benchmarks/gpu/fsdp2.sh` with OUT set to a folder for the logs.
# First the ground truth under plain torchrun, then the GPU-only check tests (tests/launch/test_check_fsdp2_gpu.py).
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import sys, torch, accelerate, transformers; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'accelerate', accelerate.__version__, 'transformers', transformers.__version__, 'python', sys.version.split()[0])"

plain() {  # NPROC SCRIPT ARGS...: the script under plain torchrun, its exit code and last lines
  local nproc=$1; shift
  echo "--- plain torchrun x$nproc $*"
  timeout 120 torchrun --nproc-per-node "$nproc" "$@" >"$OUT/plain.txt" 2>&1
  echo "exit $?"; grep -v "^W1\|^\s*$" "$OUT/plain.txt" | grep -i "rank\|error\|tensors\|train_loss\|loss" | tail -4
  grep -m2 "Error:" "$OUT/plain.txt" | cut -c1-300
}
echo "=== ground truth"
for m in none optimizer-before sync-off; do plain 1 tests/scripts/fsdp2_cuda.py --mistake $m --backend nccl; done
plain 2 tests/scripts/fsdp2_cuda.py --backend gloo   # two ranks sharing the GPU over gloo: does FSDP2 run?
for m in none step-in-sync; do plain 1 tests/scripts/accelerate_fsdp2.py --mistake $m; done
plain 1 tests/scripts/trainer_fsdp2.py

echo "=== the GPU-only check tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider -n 3 tests/launch/test_check_fsdp2_gpu.py 2>&1 \
  | tee "$OUT/fsdp2_gpu_tests.log" | tail -30

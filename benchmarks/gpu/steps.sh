#!/usr/bin/env bash
# The step time on a lent GPU machine (one GPU; the package not installed, the machine's own torch, Accelerate and
# transformers), from the repository root: `bash benchmarks/gpu/steps.sh` with OUT set to a folder for the logs.
# First the ground truth under plain torchrun (tests/scripts/gpu_input.py prints its own clocks), then the GPU-only
# step-time checks, then the GPU tests the GPU's clock could break: the FSDP2 checks and the scenario matrix on CUDA.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
nvidia-smi -L
python3 -c "import sys, torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'python', sys.version.split()[0])"

echo "=== ground truth, plain torchrun"
plain() {  # NPROC ARGS...: the script under plain torchrun, its own clocks and its exit code
  local nproc=$1; shift
  timeout 90 torchrun --nproc-per-node "$nproc" tests/scripts/gpu_input.py "$@" >"$OUT/plain.txt" 2>&1
  echo "exit $? ($nproc rank(s) $*): $(grep -h '^rank\|Error' "$OUT/plain.txt" | cut -c1-300)"
}
for api in ddp fsdp2; do for loader in slow fast; do plain 1 --api $api --loader $loader; done; done
plain 2 --api ddp --loader slow --backend gloo

echo "=== the step-time checks on the GPU"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/launch/test_check_gpu_steps.py 2>&1 \
  | tee "$OUT/steps_gpu_tests.log" | tail -30

echo "=== the FSDP2 checks on the GPU and the scenario matrix on CUDA"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 tests/launch/test_check_fsdp2_gpu.py 2>&1 \
  | tee "$OUT/fsdp2_gpu_tests.log" | tail -6
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 8 tests/graph/test_scenarios.py -k "cuda or nccl" 2>&1 \
  | tee "$OUT/scenarios.log" | tail -6

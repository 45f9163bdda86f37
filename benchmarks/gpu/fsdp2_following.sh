set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import sys, torch, accelerate, transformers; print('torch', torch.__version__, 'accelerate', accelerate.__version__, 'transformers', transformers.__version__)"
mkdir -p $OUT/ep
echo "--- plain torchrun fsdp2_epochs.py --cuda"; timeout 60 torchrun --nproc-per-node 1 tests/scripts/fsdp2_epochs.py --cuda --out $OUT/ep 2>&1 | grep -v "^W1" | tail -4; echo "exit $?"
rm -rf $OUT/ep
timeout 240 python3 -m pytest -q -p no:cacheprovider -n 4 tests/launch/test_check_fsdp2_gpu.py 2>&1 | tee $OUT/fsdp2_gpu_tests.log | tail -15
echo "--- check trainer_fsdp2.py (following)"
timeout 120 python3 -m ddp_doctor.cli check --json $OUT/trainer.json --nproc-per-node 1 tests/scripts/trainer_fsdp2.py > $OUT/trainer.txt 2>&1; echo "exit $?"
python3 -c "
import json; r=json.load(open('$OUT/trainer.json')); f=r.get('following') or {}
print('codes', [x['code'] for x in r['findings']], 'backend', r['backend'], 'parallelism', r['parallelism'])
print('following', f.get('epoch_ends'), f.get('ended_by'), [(d['site'], d['training'], d['batches']) for d in f.get('loaders', [])])
print('unchecked', r.get('unchecked'))"

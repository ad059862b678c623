#!/usr/bin/env bash
# Session 14, device call 1: GPU tests, then the models and training phases (results copied under $OUT).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
start=$(date +%s)
{ timeout 90 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py
  timeout 30 python -m pytest -q -p no:cacheprovider tests/test_compression.py -k fused
  timeout 40 python -m pytest -q -p no:cacheprovider tests/test_monitor.py -m gpu; } > "$OUT/gpu_tests.log" 2>&1
echo "tests: $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests.log"
cd benchmarks
timeout 280 python suite.py --phases models --worlds 2,4 --variants plain,torch,ours,trainer --rounds 5 --steps 15 \
  --timeout 135 --out /tmp/s_models > "$OUT/models.log" 2>&1
cp /tmp/s_models/results.json "$OUT/models.json"
echo "models done at $(( $(date +%s) - start )) s" >> "$OUT/models.log"
left=$(( 585 - ($(date +%s) - start) ))
timeout $left python suite.py --phases training --worlds 1,4 --models gpt-1.3b:8:1024 --rounds 2 \
  --impls torch_ddp,ours_ddp,zero1,zero2,ddp_bf16,torch_ddp_bf16,ours_ddp_ctas8,ours_ddp_b100 \
  --timeout $(( left / 2 )) --out /tmp/s_train > "$OUT/train.log" 2>&1
cp /tmp/s_train/results.json "$OUT/train.json"
echo "training done at $(( $(date +%s) - start )) s" >> "$OUT/train.log"

#!/usr/bin/env bash
# Session 14, device call 5 (2 GPUs): NCCL tests (pipeline included), then the pipeline phases (results under $OUT).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus5.txt"
timeout 120 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py > "$OUT/gpu_tests5.log" 2>&1
echo "tests: $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests5.log"
cd benchmarks
left=$(( 400 - ($(date +%s) - start) ))
timeout $left python suite.py --phases pipeline,pipeline_trainer --worlds 2 --timeout $(( left - 10 )) \
  --out /tmp/s_pp > "$OUT/pipeline.log" 2>&1
cp /tmp/s_pp/results.json "$OUT/pipeline.json"; cp /tmp/s_pp/results.md "$OUT/pipeline.md"
echo "done at $(( $(date +%s) - start )) s" >> "$OUT/pipeline.log"

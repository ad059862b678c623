#!/usr/bin/env bash
# Session 14, device call 2 (the 4-GPU machines were not lent then: 2 GPUs): collectives, Top-K, monitor,
# memory, precision, compile at worlds 1 and 2 (results copied under $OUT).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus2.txt"
cd benchmarks
timeout 570 python suite.py --phases collectives,topk,monitor,memory,precision,compile --worlds 1,2 \
  --timeout 280 --out /tmp/s_rest > "$OUT/rest.log" 2>&1
cp /tmp/s_rest/results.json "$OUT/rest.json"
echo "rest done at $(( $(date +%s) - start )) s" >> "$OUT/rest.log"

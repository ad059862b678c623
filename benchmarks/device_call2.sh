#!/usr/bin/env bash
# Session 14, device call 2: collectives, Top-K, monitor, memory, precision, profiling; NCCL-group variants
# of DDP at 1.3B (results copied under $OUT).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
start=$(date +%s)
cd benchmarks
timeout 420 python suite.py --phases collectives,topk,monitor,memory,precision,profiling --worlds 1,2,4 \
  --timeout 200 --out /tmp/s_rest > "$OUT/rest.log" 2>&1
cp /tmp/s_rest/results.json "$OUT/rest.json"
echo "rest done at $(( $(date +%s) - start )) s" >> "$OUT/rest.log"
left=$(( 580 - ($(date +%s) - start) ))
timeout $left python suite.py --phases training --worlds 4 --models gpt-1.3b:8:1024 --rounds 2 \
  --impls ours_ddp,ours_ddp_ctas32,ours_ddp_hp,torch_ddp --timeout $left --out /tmp/s_train2 > "$OUT/train2.log" 2>&1
cp /tmp/s_train2/results.json "$OUT/train2.json"
echo "training done at $(( $(date +%s) - start )) s" >> "$OUT/train2.log"

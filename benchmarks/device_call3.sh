#!/usr/bin/env bash
# Session 14, device call 3 (2 GPUs; 4-GPU machines not lent): collectives and GPT 1.3B training at
# worlds 1 and 2 in one suite run (the scaling model calibrated on this run's collectives), then the
# third-party models with 8 paired rounds (results copied under $OUT; merge with suite.py --merge).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus3.txt"
cd benchmarks
timeout 330 python suite.py --phases collectives,training,model_check --worlds 1,2 \
  --models gpt-1.3b:8:1024 --rounds 2 \
  --impls torch_ddp,ours_ddp,zero1,zero2,ddp_bf16,torch_ddp_bf16,ddp_topk,ddp_powersgd \
  --timeout 300 --out /tmp/s_call3 > "$OUT/call3.log" 2>&1
cp /tmp/s_call3/results.json "$OUT/call3.json"
echo "training done at $(( $(date +%s) - start )) s" >> "$OUT/call3.log"
left=$(( 575 - ($(date +%s) - start) ))
timeout $left python suite.py --phases models --worlds 2 --rounds 8 --steps 10 --variants plain,torch,ours,trainer \
  --timeout $left --out /tmp/s_call3m > "$OUT/call3_models.log" 2>&1
cp /tmp/s_call3m/results.json "$OUT/call3_models.json"
echo "models done at $(( $(date +%s) - start )) s" >> "$OUT/call3_models.log"

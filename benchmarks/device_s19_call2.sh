#!/usr/bin/env bash
# Session 19, device call 2 (4 GPUs): the models phase with the per-variant memory breakdown (plain, torch
# DDP, our DDP, our trainer) on HF GPT-2 / BERT, timm ResNet-50 / ViT-B/16; then rank 0's kernels of the 7B
# at TP = 4 without SP, ours against torch's DTensor TP (the 0.99x point). Results under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
start=$(date +%s)
export PYTHONPATH=$PWD
cd benchmarks
timeout 330 python suite.py --phases models --worlds 4 --third-party gpt2,resnet50,bert,vit \
  --variants plain,torch,ours,trainer --rounds 4 --timeout 320 --out /tmp/s_m > "$OUT/models.log" 2>&1
cp /tmp/s_m/results.json "$OUT/models.json"; cp /tmp/s_m/results.md "$OUT/models.md"
echo "models done at $(( $(date +%s) - start )) s" >> "$OUT/models.log"
left=$(( 540 - ($(date +%s) - start) ))
timeout $left python suite.py --phases tensor --worlds 4 --variants "big,profile,config=7B TP4 no SP" \
  --rounds 1 --timeout $(( left - 10 )) --out /tmp/s_tp > "$OUT/tensor_profile.log" 2>&1
cp /tmp/s_tp/results.json "$OUT/tensor_profile.json"; cp /tmp/s_tp/results.md "$OUT/tensor_profile.md"
echo "done at $(( $(date +%s) - start )) s" >> "$OUT/tensor_profile.log"

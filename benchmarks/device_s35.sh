#!/usr/bin/env bash
# Session 35: the 2-GPU kind (nvidia-h200-x2) lent, not the 4-GPU one. Results go straight to $OUT.
#   A: PowerSGD against torch's own PowerSGD hook (the reference it lacked). First one process on one GPU
#      (compression's compute alone, `powersgd_cost.py`: ours per matrix and torch's hook, each against
#      its own DDP with nothing compressed; 3 rounds, then a profile of each), then GPT-1.3B on both GPUs
#      (torch DDP, ours, ours + PowerSGD, torch DDP + its PowerSGD hook; 2 interleaved rounds).
. benchmarks/device_env.sh
case "$1" in
  A) CUDA_VISIBLE_DEVICES=0 timeout -k 5 200 torchrun --standalone --nproc_per_node=1 benchmarks/powersgd_cost.py \
        --out "$OUT/A_cost" --rounds 3 --variants dense,per_matrix,torch_dense,torch_hook --profile 2>&1 \
        | grep -v -i "warn" > "$OUT/A_cost.log"
     echo "A_cost exit $? at $(( $(date +%s) - start )) s" >> "$OUT/A_cost.log"
     (cd benchmarks && timeout -k 5 300 python suite.py --out "$OUT/A" --timeout 290 --worlds 2 --phases training \
        --models gpt-1.3b:8:1024 --impls torch_ddp,ours_ddp,ddp_powersgd,torch_ddp_powersgd --rounds 2) 2>&1 \
        | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/A.log"
     echo "A exit $? at $(( $(date +%s) - start )) s" >> "$OUT/A.log" ;;
esac
# B (2 GPUs): every GPU test two GPUs can run (pydantic from the carried wheels), after this session's
#    changes on GPU paths: DDP's used flags and ZeRO-1's read of held gradients (find_unused_parameters),
#    FSDP's and tensor parallelism's exposed-wait timing by CUDA events (the straggler tests now run
#    ZeRO-3 and tensor parallelism on NCCL too).
case "$1" in
  B) pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
     export PYTHONPATH=$PWD:/tmp/pyd
     gpu_tests gpu_tests_all 480 --durations=15 -rs ;;
esac

#!/usr/bin/env bash
# Session 49: the 1-GPU kind only (issue 15 still waits for 4 GPUs). Results go to $OUT.
#   A (1 GPU): every GPU test one GPU can run, on the session's code; FSDP's bf16 / fp32 no_sync accumulation
#      and the loss scaler's hysteresis on CUDA (check_fsdp_accumulation_s49.py).
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  A) timeout 120 torchrun --standalone --nproc-per-node 1 benchmarks/check_fsdp_accumulation_s49.py "$OUT" \
       > "$OUT/fsdp_accumulation.log" 2>&1; echo "exit $?" >> "$OUT/fsdp_accumulation.log"
     gpu_tests gpu_tests_1gpu_A 420 --durations=10 -rs ;;
esac

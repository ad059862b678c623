#!/usr/bin/env bash
# Session 50: the 1-GPU kind only (issue 15 still waits for 4 GPUs). Results go to $OUT.
#   A (1 GPU): session 50's FSDP / DDP fixes on CUDA (check_s50.py), then every GPU test one GPU can run.
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  A) timeout 120 torchrun --standalone --nproc-per-node 1 benchmarks/check_s50.py "$OUT" > "$OUT/check_s50.log" 2>&1
     echo "exit $?" >> "$OUT/check_s50.log"
     gpu_tests gpu_tests_1gpu_A 420 --durations=10 -rs ;;
esac

#!/usr/bin/env bash
# Session 48: the 1-GPU kind only (issue 15 still waits for 4 GPUs). Results go to $OUT.
#   A (1 GPU): every GPU test one GPU can run, on sessions 47-48's code (FSDP own-loop optimizer checks, stop_workers,
#      non-finite stop, checkpoint_dir checks), as the 2-GPU suite has not run on it.
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
#   B (1 GPU): A again on the session's last code, then DDP's ring pattern under the trainer on CUDA (the
#      blocking reducer timed by CUDA events, read back on log steps).
case "$1" in
  A) gpu_tests gpu_tests_1gpu_A 540 --durations=15 -rs ;;
  B) gpu_tests gpu_tests_1gpu_B 400 --durations=10 -rs
     timeout 120 torchrun --standalone --nproc-per-node 1 benchmarks/check_ring_timing_s48.py "$OUT" \
       > "$OUT/ring_timing.log" 2>&1; echo "exit $?" >> "$OUT/ring_timing.log" ;;
esac

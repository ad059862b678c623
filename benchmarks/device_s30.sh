#!/usr/bin/env bash
# Session 30: only the 1-GPU machine (nvidia-h200) was lent. Results go straight to $OUT.
#   A: the pipeline graphs' one-GPU tests after the accumulators' flush became multi-tensor ops
#      (graphed 1F1B / ZB-H1 equal to eager after every step, accumulators zero after each step, .grad
#      never an accumulator, StageGraphs.clear() handing the pools back) and the compiled loss's.
#   B: after `runtime.collective_device` replaced six hand-written device choices (the loss scaler, DDP,
#      ZeRO-1, FSDP without parameters, Join, the monitor): the new one-GPU NCCL test of an empty rank,
#      then every GPU test one GPU can run (the image lacks pydantic: files needing it fail to collect).
. benchmarks/device_env.sh
case "$1" in
  A) gpu_tests gpu_tests_graphs 240 tests/test_pipeline_graphs.py tests/test_compiled_loss.py -rs ;;
  B) gpu_tests gpu_tests_empty_rank 120 tests/test_gpu_empty_rank.py -rs
     gpu_tests gpu_tests_all 420 --continue-on-collection-errors --deselect tests/test_gpu_empty_rank.py --durations=15 ;;
esac

#!/usr/bin/env bash
# Session 30: only the 1-GPU machine (nvidia-h200) was lent. Results go straight to $OUT.
#   A: the pipeline graphs' one-GPU tests after the accumulators' flush became multi-tensor ops
#      (graphed 1F1B / ZB-H1 equal to eager after every step, accumulators zero after each step, .grad
#      never an accumulator, StageGraphs.clear() handing the pools back) and the compiled loss's.
#   B: after `runtime.collective_device` replaced six hand-written device choices (the loss scaler, DDP,
#      ZeRO-1, FSDP without parameters, Join, the monitor): the new one-GPU NCCL test of an empty rank,
#      then every GPU test one GPU can run (the image lacks pydantic: files needing it fail to collect).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> "$OUT/gpus.txt"
case "$1" in
  A) timeout -k 5 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pipeline_graphs.py \
       tests/test_compiled_loss.py -rs > "$OUT/gpu_tests_graphs.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests_graphs.log" ;;
  B) timeout -k 5 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_empty_rank.py -rs \
       > "$OUT/gpu_tests_empty_rank.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests_empty_rank.log"
     timeout -k 5 420 python -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors \
       --deselect tests/test_gpu_empty_rank.py --durations=15 > "$OUT/gpu_tests_all.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests_all.log" ;;
esac

#!/usr/bin/env bash
# Session 30: only the 1-GPU machine (nvidia-h200) was lent. Results go straight to $OUT.
#   A: the pipeline graphs' one-GPU tests after the accumulators' flush became multi-tensor ops
#      (graphed 1F1B / ZB-H1 equal to eager after every step, accumulators zero after each step, .grad
#      never an accumulator, StageGraphs.clear() handing the pools back) and the compiled loss's.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> "$OUT/gpus.txt"
case "$1" in
  A) timeout -k 5 240 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pipeline_graphs.py \
       tests/test_compiled_loss.py -rs > "$OUT/gpu_tests_graphs.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests_graphs.log" ;;
esac

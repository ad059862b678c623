#!/usr/bin/env bash
# Session 33: only the 1-GPU machine (nvidia-h200) was lent. Results go straight to $OUT.
#   A: PowerSGD's cost per step at GPT-1.3B, per weight matrix (new) against the whole bucket as one
#      (benchmarks/powersgd_cost.py, 3 rounds), then every GPU test one GPU can run.
. benchmarks/device_env.sh
case "$1" in
  A) timeout -k 5 300 torchrun --nproc_per_node=1 benchmarks/powersgd_cost.py --out "$OUT" --rounds 3 $PSGD_ARGS \
       > "$OUT/powersgd_cost.log" 2>&1
     echo "powersgd_cost exit $? at $(( $(date +%s) - start )) s" >> "$OUT/powersgd_cost.log"
     gpu_tests gpu_tests_all 240 --continue-on-collection-errors --durations=15 -rs ;;
esac
# B (after A showed per-matrix 36.8 ms over dense against the whole bucket's 28.0): the finish rewritten
#   (Gram-Schmidt instead of QR, products written in place) and a profile of the per-matrix step; then
#   the GPU tests again.
case "$1" in
  B) PSGD_ARGS=--profile bash benchmarks/device_s33.sh A ;;
esac
# C (B: both forms slower in that run, per matrix +105.7 ms and whole bucket +79.4 over dense; its profile:
#   the thin GEMMs of 4 columns ~250 us per 2048 x 8192 matrix, and Gram-Schmidt's ~1,200 small batched
#   matmuls a step on the host): QR and the A-form products again, the thin products split along their
#   inner dimension (per_matrix) against plain (per_matrix_unsplit), same run.
case "$1" in
  C) timeout -k 5 400 torchrun --nproc_per_node=1 benchmarks/powersgd_cost.py --out "$OUT" --rounds 3 \
       > "$OUT/powersgd_cost.log" 2>&1
     echo "powersgd_cost exit $? at $(( $(date +%s) - start )) s" >> "$OUT/powersgd_cost.log" ;;
esac
# D (after the review's and trials' fixes): every GPU test one GPU can run, tests/test_gpu_powersgd.py new
#   (Top-K and PowerSGD state resumed bit-exactly on NCCL).
case "$1" in
  D) gpu_tests gpu_tests_all 400 --continue-on-collection-errors --durations=15 -rs ;;
esac

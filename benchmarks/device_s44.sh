#!/usr/bin/env bash
# Session 44: the 1- and 2-GPU kinds lent (issue 15 still waits for 4 GPUs). Results go to $OUT.
#   A (2 GPUs): every GPU test two GPUs can run, with the session's changes on NCCL (the samples a batch
#      counts as the sampler deals them, evaluate()'s checks, the per-step batch agreement as a count of
#      ranks over NCCL, the epoch's random states kept in checkpoints).
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  A) gpu_tests gpu_tests_all_A 480 --durations=15 -rs ;;
esac

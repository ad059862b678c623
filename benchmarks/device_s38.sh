#!/usr/bin/env bash
# Session 38: the 1- and 2-GPU kinds lent (issue 15 still waits for 4 GPUs), and under ten device minutes
# left. Results go to $OUT.
#   A (2 GPUs): every GPU test two GPUs can run, after this session's changes on paths the GPUs take: DDP's
#      hook on a forward's outputs (the backward's end queued from there, on the outermost pass) and its
#      first-step arrival order without duplicates, FSDP's root unit gathered again at a backward's start,
#      requires_grad_ locked on sharded modules, accuracy over the targets kept, the first-sample checksum
#      in fit's length all-gather (NCCL).
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  A) gpu_tests gpu_tests_all_A 420 --durations=15 -rs ;;
esac
